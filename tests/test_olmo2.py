"""OLMo 2 (``family="olmo2"``): post-norm blocks and q/k RMSNorm over all heads at once.

Logits parity with transformers, the HF round trip and the export are covered with the other families by
tests/test_hf.py (fixture ``olmo2``); the forward against an independent implementation by
tests/test_models.py (``olmo2-post-norm``). Here: the presets' sizes, config.json, what the memory plan and
the FLOP count take as a layer's parameters, and the engine against the in-memory reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import EngineConfig
from megatrain_jax.flops import model_flops_per_token
from megatrain_jax.hf import UnsupportedConfig, config_from_hf, config_to_hf
from megatrain_jax.models import Decoder, preset
from megatrain_jax.plan import io_param_count, layer_param_count
from test_engine import ADAMW, TINY3, run_both

OLMO2 = dict(family="olmo2", qk_norm=True, qk_norm_width="all_heads", norm_placement="post")

# Sizes the model cards give (allenai/OLMo-2-0425-1B, OLMo-2-1124-7B, OLMo-2-1124-13B).
PUBLISHED = {"olmo2-1b": 1.48e9, "olmo2-7b": 7.30e9, "olmo2-13b": 13.7e9}

# The fields of the released config.json files that decide the model.
RELEASED = {name: {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
                   "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": hidden,
                   "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": heads, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06,
                   "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
                   "vocab_size": 100352, "pad_token_id": 100277, "eos_token_id": 100257}
            for name, (hidden, ffn, layers, heads) in {"olmo2-1b": (2048, 8192, 16, 16),
                                                       "olmo2-7b": (4096, 11008, 32, 32),
                                                       "olmo2-13b": (5120, 13824, 40, 40)}.items()}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    count = preset(name).param_count()
    assert abs(count / PUBLISHED[name] - 1) < 0.005, f"{name}: {count / 1e9:.3f}B against {PUBLISHED[name] / 1e9}B"


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_json_reads_as_the_preset_and_writes_back(name):
    cfg = config_from_hf(RELEASED[name])
    assert dataclasses.replace(cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None) == preset(name)
    assert (cfg.norm_placement, cfg.qk_norm, cfg.qk_norm_width) == ("post", True, "all_heads")
    written = config_to_hf(cfg)
    assert written["architectures"] == ["Olmo2ForCausalLM"] and not written["attention_bias"]
    assert config_from_hf(written) == cfg


def test_config_json_without_rms_norm_eps_takes_transformers_default():
    c = {k: v for k, v in RELEASED["olmo2-1b"].items() if k != "rms_norm_eps"}
    assert config_from_hf(c).norm_eps == 1e-5  # Olmo2Config's default (Llama's is 1e-6)


@pytest.mark.parametrize("change, match", [
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_olmo2_configs_are_refused(change, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_from_hf(dict(RELEASED["olmo2-1b"], **change))


@pytest.mark.parametrize("family, change, match", [
    ("olmo2", dict(norm_placement="pre"), "norm_placement='pre'.*post-norm blocks"),
    ("olmo2", dict(qk_norm_width="head"), "qk_norm_width='head'.*all heads at once"),
    ("olmo2", dict(qk_norm=False), "qk_norm=False"),
    ("qwen3", dict(norm_placement="post"), "norm_placement='post'.*pre-norm blocks"),
])
def test_export_refuses_what_the_architecture_cannot_express(family, change, match):
    cfg = preset("olmo2-1b") if family == "olmo2" else preset("qwen3-8b")
    with pytest.raises(UnsupportedConfig, match=match):
        config_to_hf(cfg.replace(**change))


def test_bad_switch_values_name_the_allowed_ones():
    with pytest.raises(ValueError, match=r"norm_placement 'postt'.*\['pre', 'post', 'sandwich'\].*did you mean 'post'"):
        preset("tiny", norm_placement="postt")
    with pytest.raises(ValueError, match=r"qk_norm_width 'all'.*\['head', 'all_heads'\]"):
        preset("tiny", qk_norm_width="all")


def test_counts_equal_the_model_parameters():
    """``param_count`` (and so the memory plan's ``layer_param_count`` and the model FLOPs) counts the
    full-width q/k norms and the post-norms as the model holds them."""
    cfg = preset("tiny", **OLMO2)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    size = lambda part: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(part, nnx.Param)))  # noqa: E731
    blocks = [size(b) for b in model.blocks]
    assert blocks == [layer_param_count(cfg)] * cfg.layers
    assert size(model.io) == io_param_count(cfg)
    assert size(model) == cfg.param_count() == cfg.active_param_count()
    norms = model.blocks[0].attn
    assert (norms.q_norm.scale.shape, norms.k_norm.scale.shape) == ((cfg.heads * cfg.dim_per_head,),
                                                                    (cfg.kv_heads * cfg.dim_per_head,))
    per_head = preset("tiny", family="qwen3", qk_norm=True)  # one scale of head_dim for all heads
    assert cfg.param_count() - per_head.param_count() == cfg.layers * (cfg.heads + cfg.kv_heads - 2) * cfg.dim_per_head
    assert model_flops_per_token(cfg.param_count(), cfg.layers, cfg.hidden, 16) == (
        6.0 * size(model) + 6.0 * cfg.layers * cfg.hidden * 16)


def test_chunked_mlp_keeps_the_post_norm():
    """``mlp_chunk_tokens`` runs the post-norm MLP residual chunk by chunk: the same logits."""
    cfg = preset("tiny", **OLMO2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)))
    whole = Decoder(cfg, rngs=nnx.Rngs(0))(tokens)
    chunked = Decoder(cfg.replace(mlp_chunk_tokens=12), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_engine_equals_reference_with_clipping_and_accumulation():
    """The streamed engine trains an OLMo 2 model as the in-memory jax.grad + optax reference does: three
    steps of two accumulated groups of two micro-batches, gradients clipped."""
    run_both(TINY3.replace(**OLMO2), ADAMW, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05))
