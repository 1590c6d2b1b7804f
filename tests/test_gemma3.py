"""Gemma 3 text (``family="gemma3"``): sandwich norms whose weights are offsets from 1, GeGLU, embeddings scaled by
sqrt(hidden), per-head q/k norms, scores scaled by query_pre_attn_scalar, and sliding-window layers with their own
unscaled RoPE beside full-attention ones (two kinds of block).

Logits parity with transformers, the HF round trip and the export are covered with the other families by
tests/test_hf.py (fixture ``gemma3_text``). Here: the presets' sizes, the released config.json files, refusals,
the block kinds, what the memory plan and the FLOP count take as a layer's parameters, and the engine against
the in-memory reference.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import EngineConfig
from megatrain_jax.check import check_model
from megatrain_jax.contract.layered import layered
from megatrain_jax.flops import model_flops_per_token
from megatrain_jax.hf import UnsupportedConfig, config_from_hf, config_to_hf
from megatrain_jax.models import Decoder, RopeScaling, preset
from megatrain_jax.plan import io_param_count, layer_param_count
from test_engine import ADAMW, TINY3, run_both

GEMMA3 = dict(family="gemma3", qk_norm=True, norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True,
              mlp_activation="gelu_tanh", query_pre_attn_scalar=12.0, head_dim=32, tie_embeddings=True,
              sliding_window=5, sliding_rope_theta=100.0, rope_scaling=RopeScaling(kind="linear", factor=4.0),
              layer_types=("sliding_attention", "full_attention", "sliding_attention"))
TINY_GEMMA3 = TINY3.replace(**GEMMA3)

# Gemma 3 technical report (arXiv 2503.19786), Table 1: embedding + non-embedding parameters of the language
# model (the vision encoder's 417M left out): 1B 302M + 698M, 4B 675M + 3,209M, 12B 1,012M + 10,759M,
# 27B 1,416M + 25,600M. (The 1B's 999,885,952 on its model page is our count exactly.)
PUBLISHED = {"gemma3-1b": 1000e6, "gemma3-4b": 3884e6, "gemma3-12b": 11771e6, "gemma3-27b": 27016e6}

# google/gemma-3-1b-pt's config.json (transformers 4.50's spelling: rope_local_base_freq, sliding_window_pattern,
# no layer_types), and the text_config of gemma-3-4b/12b/27b-pt with Gemma3TextConfig's defaults written out.
RELEASED_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
               "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
               "pad_token_id": 0, "final_logit_softcapping": None, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
               "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
               "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
               "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
               "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}
TEXT_CONFIGS = {
    name: {"model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "query_pre_attn_scalar": scalar,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "vocab_size": 262208,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "rope_local_base_freq": 10000.0}
    for name, (hidden, ffn, layers, heads, kv, hd, scalar) in {
        "gemma3-4b": (2560, 10240, 34, 8, 4, 256, 256), "gemma3-12b": (3840, 15360, 48, 16, 8, 256, 256),
        "gemma3-27b": (5376, 21504, 62, 32, 16, 128, 168)}.items()}


def _no_ids(cfg):
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    count = preset(name).param_count()
    assert abs(count / PUBLISHED[name] - 1) < 0.01, f"{name}: {count / 1e9:.3f}B against {PUBLISHED[name] / 1e9}B"
    assert preset("gemma3-1b").param_count() == 999_885_952


def test_released_1b_config_reads_as_the_preset_and_writes_back():
    cfg = config_from_hf(RELEASED_1B)
    assert _no_ids(cfg) == preset("gemma3-1b")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, 1, 0)
    assert [cfg.layer_type(i) for i in (4, 5, 6, 11, 25)] == ["sliding_attention", "full_attention",
                                                              "sliding_attention", "full_attention",
                                                              "sliding_attention"]
    written = json.loads(json.dumps(config_to_hf(cfg)))
    assert written["architectures"] == ["Gemma3ForCausalLM"] and written["model_type"] == "gemma3_text"
    assert written["rope_local_base_freq"] == 10000.0 and written["query_pre_attn_scalar"] == 256
    assert "hidden_act" not in written and written["hidden_activation"] == "gelu_pytorch_tanh"
    assert config_from_hf(written) == cfg


@pytest.mark.parametrize("name", list(TEXT_CONFIGS))
def test_multimodal_text_configs_read_as_the_presets(name):
    cfg = config_from_hf(TEXT_CONFIGS[name])
    assert cfg == preset(name)
    assert cfg.rope_of("full_attention") == (1e6, RopeScaling(kind="linear", factor=8.0, original_max_position=131072))
    assert cfg.rope_of("sliding_attention") == (10000.0, None)
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def test_transformers5_rope_parameters_per_layer_type_read_the_same():
    c = {k: v for k, v in TEXT_CONFIGS["gemma3-4b"].items() if k not in ("rope_theta", "rope_scaling",
                                                                         "rope_local_base_freq")}
    c["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    c["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)]
    assert config_from_hf(c) == preset("gemma3-4b")


@pytest.mark.parametrize("change, match", [
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
     r"model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration.*text_config.*'gemma3_text'"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported for Gemma 3"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding_attention rope parameters.*without scaling"),
])
def test_unsupported_gemma3_configs_are_refused(change, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_from_hf(dict(RELEASED_1B, **change))


def test_final_logit_softcapping_is_read():
    assert config_from_hf(dict(RELEASED_1B, final_logit_softcapping=30.0)).final_logit_softcap == 30.0


@pytest.mark.parametrize("cfg, match", [
    (preset("gemma3-1b", norm_placement="pre"), "norm_placement='pre'.*sandwich-norm blocks"),
    (preset("gemma3-1b", norm_unit_offset=False), "norm_unit_offset=False"),
    (preset("gemma3-1b", mlp_activation="silu"), "mlp_activation='silu'"),
    (preset("gemma3-4b", sliding_rope_theta=None), "sliding_rope_theta=None with rope_scaling set"),
    (preset("llama3-8b", query_pre_attn_scalar=64.0), "query_pre_attn_scalar=64.0 .Gemma 3's alone"),
    (preset("llama3-8b", norm_placement="sandwich"), "norm_placement='sandwich'.*pre-norm blocks"),
    (preset("llama3-8b", final_logit_softcap=30.0), "final_logit_softcap=30.0"),
])
def test_export_refuses_what_the_architecture_cannot_express(cfg, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_to_hf(cfg)


def test_bad_switch_values_name_the_allowed_ones():
    with pytest.raises(ValueError, match=r"mlp_activation 'gelu'.*\['silu', 'gelu_tanh'\].*did you mean 'gelu_tanh'"):
        preset("tiny", mlp_activation="gelu")
    with pytest.raises(ValueError, match="query_pre_attn_scalar must be a positive, finite number"):
        preset("tiny", query_pre_attn_scalar=0)


def test_two_kinds_of_block_each_with_its_window_and_rope():
    """Sliding and full layers are two kinds (one compiled program each): the window, the RoPE base and scaling
    are static attributes of a kind's attention."""
    model = Decoder(TINY_GEMMA3, rngs=nnx.Rngs(0))
    lm = layered(model)
    assert lm.block_kinds == (0, 1, 0) and lm.n_kinds == 2
    sliding, full = model.blocks[0].attn, model.blocks[1].attn
    assert (sliding.window, full.window) == (5, None)
    assert TINY_GEMMA3.rope_of(sliding.layer_type) == (100.0, None)
    assert TINY_GEMMA3.rope_of(full.layer_type) == (10000.0, RopeScaling(kind="linear", factor=4.0))
    assert nnx.graphdef(model.blocks[0]) == nnx.graphdef(model.blocks[2])
    assert nnx.graphdef(model.blocks[0]) != nnx.graphdef(model.blocks[1])
    assert check_model(model).ok


def test_counts_equal_the_model_parameters():
    """``param_count`` (and so the memory plan's ``layer_param_count`` and the model FLOPs) counts the four
    norms of a sandwich block and the per-head q/k norms as the model holds them."""
    cfg = TINY_GEMMA3
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    size = lambda part: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(part, nnx.Param)))  # noqa: E731
    assert [size(b) for b in model.blocks] == [layer_param_count(cfg)] * cfg.layers
    assert size(model.io) == io_param_count(cfg)
    assert size(model) == cfg.param_count() == cfg.active_param_count()
    pre = cfg.replace(norm_placement="pre")
    assert cfg.param_count() - pre.param_count() == cfg.layers * 2 * cfg.hidden
    assert model_flops_per_token(cfg.param_count(), cfg.layers, cfg.hidden, 16) == (
        6.0 * size(model) + 6.0 * cfg.layers * cfg.hidden * 16)


def test_norm_weights_start_at_zero_and_act_as_one_plus_weight():
    model = Decoder(TINY_GEMMA3, rngs=nnx.Rngs(0))
    block = model.blocks[0]
    for norm in (block.attn_norm, block.attn_post_norm, block.mlp_norm, block.mlp_post_norm, block.attn.q_norm,
                 model.io.final_norm):
        assert not np.any(np.asarray(norm.scale[...]))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, TINY_GEMMA3.hidden)), jnp.float32)
    block.mlp_norm.scale[...] = jnp.full((TINY_GEMMA3.hidden,), 0.5)
    want = 1.5 * x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + TINY_GEMMA3.norm_eps)
    np.testing.assert_allclose(np.asarray(block.mlp_norm(x)), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_embedding_scale_is_rounded_to_the_compute_dtype():
    """transformers multiplies by sqrt(hidden) cast to the embedding's dtype: sqrt(3072) = 55.4256 is 55.5 in
    bfloat16."""
    cfg = preset("tiny", hidden=3072, heads=24, kv_heads=8, scale_embeddings=True, dtype="bfloat16")
    io = nnx.eval_shape(lambda: Decoder(cfg.replace(layers=1), rngs=nnx.Rngs(0))).io
    io.embedding = nnx.Param(jnp.ones((cfg.vocab_size, cfg.hidden), jnp.float32))
    out = io.embed(jnp.zeros((1, 1), jnp.int32), None, None)
    assert out.dtype == jnp.bfloat16 and float(out[0, 0, 0]) == 55.5


def test_chunked_mlp_keeps_the_sandwich_norms():
    cfg = TINY_GEMMA3
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)))
    whole = Decoder(cfg, rngs=nnx.Rngs(0))
    chunked = Decoder(cfg.replace(mlp_chunk_tokens=12), rngs=nnx.Rngs(0))
    for model in (whole, chunked):  # non-trivial norms: zeros (scale 1) would hide a swapped pair
        for i, block in enumerate(model.blocks):
            block.mlp_post_norm.scale[...] = jnp.full((cfg.hidden,), 0.3 * (i + 1))
    np.testing.assert_allclose(np.asarray(chunked(tokens)), np.asarray(whole(tokens)), rtol=1e-5, atol=1e-5)


def test_engine_equals_reference_with_clipping_and_accumulation():
    """The streamed engine trains a Gemma 3 model (both kinds of block, soft-capped logits) as the in-memory
    jax.grad + optax reference does: three steps of two accumulated groups of two micro-batches, clipped."""
    run_both(TINY_GEMMA3.replace(final_logit_softcap=5.0), ADAMW,
             EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05))


def test_another_depth_keeps_the_layer_pattern():
    """``model.layers=N`` on a preset with per-layer kinds (and the plan's smaller-model option) continues the
    pattern instead of failing on a ``layer_types`` of the old length."""
    from megatrain_jax import preset
    cfg = preset("gemma3-12b")
    for n in (4, 7, 47, 50):
        cut = cfg.replace(layers=n)
        assert cut.layer_types == tuple(cfg.layer_types[i % len(cfg.layer_types)] for i in range(n))
    assert preset("gemma3-12b", layers=7).layer_types[5] == "full_attention"
