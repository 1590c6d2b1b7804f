"""Shared fixtures: a tiny float32 config and models whose parameters are randomized to O(1) scale.

The default initializer (std 0.02) makes attention nearly uniform and norms near identity, which would
let a wrong mask or a missing scale slip past a numerical test. ``build_model`` therefore redraws every
parameter at a scale where each part of the block visibly changes the output.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

# Four CPU devices for the several-device tests (tests/test_mesh.py); everything else runs on the first
# (transfer.default_devices uses one device on CPU unless given more). Set before JAX starts its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax.models import Decoder, DecoderConfig

# XLA compilation dominates CPU test time, and many tests compile identical programs (the engine's per-part
# functions for the same model shape): a persistent cache lets every repeat load the first compile.
jax.config.update("jax_compilation_cache_dir", os.environ.get("MEGATRAIN_TEST_JAX_CACHE", 
                  os.path.join(tempfile.gettempdir(), "megatrain_jax_test_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
# The tests compare float32 results at float32's precision on every backend; a GPU's default runs float32 matrix
# products in TF32 (10-bit mantissas), which no float32 tolerance here allows. Tests of bfloat16 kernels set
# their own tolerances and are unaffected.
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(family="llama", vocab_size=97, hidden=32, ffn=48, layers=2, heads=4, kv_heads=2,
            max_positions=128, dtype="float32", loss_chunk_tokens=16)


def _random_leaf(path, shape: tuple[int, ...], rng: np.random.Generator) -> jax.Array:
    name = str(getattr(path[-1], "key", path[-1]))
    z = rng.standard_normal(shape).astype(np.float32)
    if name in ("kernel", "lm_head"):
        z = z / np.sqrt(shape[0])  # unit-variance activations, attention far from uniform
    elif name == "bias":
        z = 0.3 * z
    elif name == "scale":
        z = 1.0 + 0.2 * z
    elif name != "embedding":
        raise AssertionError(f"unexpected parameter {jax.tree_util.keystr(path)}; extend _random_leaf")
    return jnp.asarray(z)


def randomize(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """Redraw every nnx.Param of ``model`` in place (deterministic in ``seed``; works on an abstract
    model from ``nnx.eval_shape`` too). Numpy draws: no per-shape XLA compilation, which dominates the
    run time of tiny-model tests on CPU."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.default_rng(seed)
    new = [_random_leaf(path, tuple(leaf.shape), rng) for path, leaf in leaves]
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, new))
    nnx.update(model, state)
    return model


@pytest.fixture
def make_cfg():
    """Factory of tiny float32 configs: ``make_cfg(family='qwen3', qk_norm=True)``."""
    return lambda **overrides: DecoderConfig(**{**TINY, **overrides})


@pytest.fixture
def tiny_cfg(make_cfg) -> DecoderConfig:
    return make_cfg()


@pytest.fixture
def build_model():
    """Factory of tiny decoders with O(1)-scale random parameters: ``build_model(cfg, seed=0)``;
    ``random_params=False`` keeps the model's own initialization."""
    def build(cfg: DecoderConfig, seed: int = 0, random_params: bool = True) -> Decoder:
        if not random_params:  # the model's own initializers
            return Decoder(cfg, rngs=nnx.Rngs(seed))
        return randomize(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed))), seed)
    return build


@pytest.fixture
def tokens():
    """Factory of reproducible random token ids: ``tokens(B, T, vocab, seed=0)`` -> int32 numpy [B, T]."""
    return lambda B, T, vocab, seed=0: np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


@pytest.fixture(scope="module")
def lib():
    """The fused host AdamW kernel (built on first use). A test that needs it fails where it cannot be built:
    the kernel is what the docs measure and what capacity mode, 8-bit moments and the disk tier run in, so a
    machine without a C++ compiler must not pass the suite by skipping them."""
    from megatrain_jax.engine.update.host_kernel import load
    built = load()
    if built is None:
        pytest.fail("the fused host AdamW kernel could not be built or loaded: install a C++ compiler with OpenMP "
                    "(e.g. `apt-get install g++`; the warning above says what failed)", pytrace=False)
    return built


# --- transformers and torch, for the live Hugging Face checks ---------------------------------------------------

def _missing(what: str, how: str):
    """Skip a test whose ``what`` is missing here, but fail it where CI is set: CI provides it (the test extra,
    the torch venv .ci/run makes), and a skip there would let the docs' interop claims go unchecked."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI is set and {what} is missing: {how}", pytrace=False)
    pytest.skip(f"{what} is missing: {how}")


@pytest.fixture(scope="session")
def transformers():
    """The transformers module (pure Python, in the test extra), for the tokenizer and chat-template checks."""
    if importlib.util.find_spec("transformers") is None:
        _missing("transformers", "pip install -e '.[test]'")
    import transformers
    return transformers


@pytest.fixture(scope="session")
def hf_torch(tmp_path_factory):
    """transformers with torch (tests/torch_side.py): ``hf_torch.logits(folder, tokens)``, ``hf_torch.longrope``.
    In this interpreter where torch imports, else in the Python named by MEGATRAIN_TORCH_PYTHON."""
    from torch_side import connect
    side, where = connect(tmp_path_factory.mktemp("torch_side"))
    if side is None:
        _missing("torch", where)
    yield side
    side.close()
