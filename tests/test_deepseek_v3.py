"""DeepSeek-V3 / Kimi K2 (``family="deepseek_v3"``): multi-head latent attention (``MLAConfig``) on GLM-4.5's
sigmoid mixture of experts (correction bias, grouped top-k, routed scale, ungated shared experts, leading dense
layers).

Logits parity with transformers' DeepseekV3ForCausalLM, the HF round trip and the export are covered with the
other families by tests/test_hf.py (fixtures ``deepseek_v3``: low-rank q, interleaved RoPE under YaRN with
mscale_all_dim, values narrower than q/k heads, grouped routing; ``deepseek_v3_noqlora``: full q_proj, attention
biases, rotate-half RoPE, values wider than q/k heads). Here: the presets' sizes, the released config.json,
refusals, the multi-token-prediction layer, counts, what each MLA switch changes, and the engine against the
in-memory reference.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import EngineConfig, adamw
from megatrain_jax.hf import UnsupportedConfig, config_from_hf, config_to_hf, load_hf
from megatrain_jax.models import Decoder, MLAConfig, MoEConfig, RopeScaling, preset
from megatrain_jax.plan import io_param_count
from megatrain_jax.plan.counts import leaf_shapes
from test_hf import FIXTURES, assert_mtp_layer_skipped, logits_of, model_from, rel_err
from test_engine import run_both

# Published sizes: DeepSeek-V3's technical report and model card, 671B total (the 685B on the hub adds the 14B
# multi-token-prediction module) and 37B active; Kimi K2's model card, "1T" total (the technical report: 1.04T)
# and 32B active. Counted from the released config.json: 671.03B and 1,026.4B total. Kimi K2's config gives 1.3%
# less than the report's 1.04T (and 2.6% more than "1T"): no config value we know of makes up the difference,
# so its total is checked against our count of its config within 1.5% of 1.04T. The active figures count the
# routed, shared and dense MLPs a token passes, attention, the output head, but not the input embedding (a
# lookup): 36.62B and 31.69B, which round to the published 37B and 32B.
PUBLISHED = {"deepseek-v3": (671e9, 37e9, 0.005), "kimi-k2": (1.04e12, 32e9, 0.015)}

# The fields of the released config.json files (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Base) that decide the
# model, in transformers 4.x's spelling (the released ones also carry an FP8 quantization_config: see below).
RELEASED = {
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=1, ep_size=1, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
        intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
        num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False, topk_group=4,
        topk_method="noaux_tc", v_head_dim=128, vocab_size=129280),
    "kimi-k2": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", attention_bias=False, attention_dropout=0.0,
        bos_token_id=163584, eos_token_id=163585, ep_size=1, first_k_dense_replace=1, hidden_act="silu",
        hidden_size=7168, intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=131072,
        moe_intermediate_size=2048, moe_layer_freq=1, n_group=1, n_routed_experts=384, n_shared_experts=1,
        norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=8, num_hidden_layers=61,
        num_key_value_heads=64, num_nextn_predict_layers=0, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, rms_norm_eps=1e-06,
        rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=50000.0, routed_scaling_factor=2.827, scoring_func="sigmoid", tie_word_embeddings=False,
        topk_group=1, topk_method="noaux_tc", v_head_dim=128, vocab_size=163840),
}

# A tiny DeepSeek-V3: one dense layer, two routed ones over 8 experts in 4 groups (2 kept), 2 per token; MLA with a
# low-rank q, values narrower than q/k heads, YaRN with mscale_all_dim.
DSV3 = preset("tiny", layers=3, family="deepseek_v3", kv_heads=4, first_k_dense_replace=1,
              rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position=32, mscale=1.0, mscale_all_dim=0.8),
              mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_dim=8, qk_rope_dim=8, v_dim=12),
              moe=MoEConfig(experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, shared_expert_gate=False,
                            scoring="sigmoid", groups=4, topk_groups=2, routed_scale=2.5))


def _without_ids(cfg):
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    cfg = preset(name)
    total, active, tolerance = PUBLISHED[name]
    assert abs(cfg.param_count() / total - 1) < tolerance, cfg.param_count()
    active_ours = cfg.active_param_count() - cfg.vocab_size * cfg.hidden  # the input embedding is a lookup
    assert round(active_ours / 1e9) == active / 1e9, active_ours
    assert abs(preset("deepseek-v3").param_count() - 671.03e9) < 0.01e9
    assert abs(preset("kimi-k2").param_count() - 1026.41e9) < 0.01e9


@pytest.mark.parametrize("spelling", ["4.x", "5.x"])
@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_json_reads_as_the_preset_and_writes_back(name, spelling):
    c = dict(RELEASED[name])
    if spelling == "5.x":  # transformers 5 keeps RoPE's fields in rope_parameters
        rope = dict(c.pop("rope_scaling"))
        rope["rope_type"] = rope.pop("type")
        c["rope_parameters"] = {**rope, "rope_theta": c.pop("rope_theta")}
    cfg = config_from_hf(c)
    assert _without_ids(cfg) == preset(name)
    assert cfg.moe.aux_loss_coef == 0 and cfg.eos_token_id == RELEASED[name]["eos_token_id"]
    written = config_to_hf(cfg)
    assert written["model_type"] == "deepseek_v3" and written["num_nextn_predict_layers"] == 0
    assert "head_dim" not in written  # DeepseekV3Config derives it (qk_rope_head_dim)
    assert config_from_hf(written) == cfg


def test_config_json_fields_left_out_take_transformers_defaults():
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    cfg = config_from_hf({k: v for k, v in RELEASED["deepseek-v3"].items() if k in keep})  # DeepseekV3Config's
    assert _without_ids(cfg).replace(rope_scaling=None, max_positions=4096) == preset("deepseek-v3").replace(
        rope_scaling=None, max_positions=4096)


@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(num_key_value_heads=16), "num_key_value_heads=16"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "dequantize"),
    (dict(first_k_dense_replace=61), "leaves none of the 61 layers a mixture of experts"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(model_type="kimi_k2", architectures=["KimiForCausalLM"]), "not supported"),
])
def test_unsupported_configs_are_refused(change, match):
    with pytest.raises((UnsupportedConfig, ValueError), match=match):
        config_from_hf(dict(RELEASED["deepseek-v3"], **change))


@pytest.mark.parametrize("change, match", [
    (dict(kv_heads=2), "set kv_heads=4"),
    (dict(qk_norm=True), "no q/k norm"),
    (dict(sliding_window=8), "no sliding_window"),
    (dict(mla=None), "set mla"),
])
def test_mla_config_errors_say_what_to_do(change, match):
    with pytest.raises(ValueError, match=match):
        DSV3.replace(**change)


def test_export_refuses_mla_outside_deepseek_v3():
    glm = preset("glm4.5-air", layers=2).replace(partial_rotary_factor=1.0, head_dim=None, kv_heads=32, heads=32,
                                                 mla=DSV3.mla)
    with pytest.raises(UnsupportedConfig, match="multi-head latent attention is DeepSeek-V3's"):
        config_to_hf(glm)


def test_the_multi_token_prediction_layer_of_a_checkpoint_is_skipped_with_a_warning(tmp_path):
    """DeepSeek-V3's checkpoint holds its MTP module as ``model.layers.61.*`` (transformers ignores those keys)."""
    assert_mtp_layer_skipped(tmp_path, "deepseek_v3", {
        "model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
        "model.layers.3.self_attn.kv_a_layernorm.weight": np.ones((16,), np.float32)})


@pytest.mark.parametrize("cfg", [DSV3, DSV3.replace(qkv_bias=True, mla=dataclasses.replace(DSV3.mla, q_lora_rank=None,
                                                                                           v_dim=20))],
                         ids=["q_lora", "q_proj_bias"])
def test_counts_equal_the_model_parameters(cfg):
    """``param_count`` and the memory plan's leaf shapes hold what the model holds."""
    assert_counts_equal_the_model(cfg, ["dense", "moe", "moe"])


def assert_counts_equal_the_model(cfg, kinds: list) -> None:
    """``param_count``, ``block_param_count``, ``io_param_count`` and the memory plan's leaf shapes equal the
    parameters of a model of ``cfg``, whose blocks are of these kinds."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    size = lambda part: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(part, nnx.Param)))  # noqa: E731
    assert [b.kind for b in model.blocks] == kinds
    assert size(model) == cfg.param_count() and size(model.io) == io_param_count(cfg)
    from megatrain_jax.engine.parts import PartId
    for i, block in enumerate(model.blocks):
        assert sorted(leaf_shapes(cfg, PartId.block(i))) == sorted(
            tuple(x.shape) for x in jax.tree.leaves(nnx.state(block, nnx.Param)))
        assert cfg.block_param_count(i) == size(block)


def test_each_mla_switch_changes_the_logits():
    """Interleaved RoPE (113% of the logits) and the YaRN softmax correction (mscale_all_dim: 39%) each matter on
    the fixture: the parity in test_hf checks them."""
    cfg, io, blocks = load_hf(FIXTURES / "deepseek_v3", dtype="float32")
    want = np.load(FIXTURES / "deepseek_v3" / "logits.npy")
    assert rel_err(logits_of(model_from(cfg, io, blocks), FIXTURES / "deepseek_v3"), want) < 1e-5
    for changed in (cfg.replace(mla=dataclasses.replace(cfg.mla, rope_interleave=False)),
                    cfg.replace(rope_scaling=dataclasses.replace(cfg.rope_scaling, mscale_all_dim=None))):
        assert rel_err(logits_of(model_from(changed, io, blocks), FIXTURES / "deepseek_v3"), want) > 1e-3


def test_engine_equals_reference():
    """The streamed engine trains a DeepSeek-V3 of both kinds (dense, routed) as the in-memory jax.grad + optax
    reference does: three steps of two accumulated groups of two micro-batches, gradients clipped."""
    tx = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731
    run_both(DSV3, tx, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05))
