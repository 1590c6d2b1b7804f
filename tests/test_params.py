"""Saving and loading parameters for any model that follows the layered contract: the built-in Decoder and
the bring-your-own GPT-2 example, from ``save_model`` and from a training checkpoint."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import Batch, EngineConfig, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import ShapeMismatchError, load_model, load_params, save_model
from megatrain_jax.data import demo_tokens
from megatrain_jax.models import Decoder, DecoderConfig, preset

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpt2 = _example("gpt2")
GPT2_CFG = gpt2.GPT2Config(vocab_size=97, max_positions=32, hidden=32, layers=2, heads=4, loss_chunk_tokens=16)


def params_of(model) -> dict:
    return {k: np.asarray(v) for k, v in
            traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def batches(vocab: int, n: int = 4):
    tokens, _ = demo_tokens(vocab, 1 << 12, seed=1)
    return [Batch.from_windows(np.stack([tokens[(2 * i + r) * 17:(2 * i + r + 1) * 17] for r in range(2)]))
            for i in range(n)]


@pytest.mark.parametrize("kind", ["gpt2", "decoder"])
def test_save_model_and_load_model_round_trip(tmp_path, kind):
    make = (lambda s: gpt2.GPT2(GPT2_CFG, rngs=nnx.Rngs(s))) if kind == "gpt2" else (
        lambda s: Decoder(preset("tiny", layers=2, vocab_size=97, hidden=32, ffn=64, heads=2, kv_heads=1), rngs=nnx.Rngs(s)))
    saved = make(0)
    save_model(tmp_path / "p", saved)
    loaded = load_model(tmp_path / "p", make(1))
    want, got = params_of(saved), params_of(loaded)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    cfg, io, blocks = load_params(tmp_path / "p")
    assert len(blocks) == 2
    assert isinstance(cfg, DecoderConfig) if kind == "decoder" else cfg["hidden"] == 32


def test_a_bring_your_own_model_loads_from_its_training_checkpoint(tmp_path):
    model = gpt2.GPT2(GPT2_CFG, rngs=nnx.Rngs(0))
    fit(model, batches(97), default_optimizer(1e-3), engine=EngineConfig(micro_batches=1),
        train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path / "ck")))
    fresh = load_model(tmp_path / "ck", gpt2.GPT2(GPT2_CFG, rngs=nnx.Rngs(5)))
    want, got = params_of(model), params_of(fresh)
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_a_model_of_other_shapes_is_refused_before_anything_changes(tmp_path):
    save_model(tmp_path / "p", gpt2.GPT2(GPT2_CFG, rngs=nnx.Rngs(0)))
    other = gpt2.GPT2(GPT2_CFG.__class__(**{**GPT2_CFG.__dict__, "hidden": 48, "layers": 3}), rngs=nnx.Rngs(0))
    before = params_of(other)
    with pytest.raises(ShapeMismatchError, match="does not fit this model") as err:
        load_model(tmp_path / "p", other)
    assert "blocks: the model has 3" in str(err.value) and "expected shape (48," in str(err.value)
    after = params_of(other)
    assert all(np.array_equal(before[k], after[k]) for k in before)
