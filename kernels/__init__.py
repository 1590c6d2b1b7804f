"""Kernels with pure-jnp references (see STYLE.md: every kernel ships with a reference and a test)."""
