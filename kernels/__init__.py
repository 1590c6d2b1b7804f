"""C++ kernel sources, installed as the data package ``megatrain_jax.kernels`` (pyproject.toml maps this
folder there; no top-level ``kernels`` package is installed). The loader and the pure-jnp reference are in
``megatrain_jax.engine.update.host_kernel``; every kernel ships with a reference and a test (docs/contributing.md).

This file is what makes an editable install find the folder: setuptools' editable finder does not resolve
a namespace subpackage that pyproject maps onto another directory."""
