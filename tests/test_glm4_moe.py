"""GLM-4.5 (``family="glm4_moe"``): a sigmoid router with a correction bias and grouped top-k, routed weights
scaled, an ungated shared expert, leading dense layers, q/k/v biases, optional per-head q/k norms, RoPE on half
of each head.

Logits parity with transformers' Glm4MoeForCausalLM, the HF round trip and the export are covered with the
other families by tests/test_hf.py (fixture ``glm4_moe``: the correction bias, the groups, the routed scale,
the renormalization and the partial RoPE each change its logits by 17-71%). Here: the presets' sizes, the
released config.json, refusals, the multi-token-prediction layer of the released checkpoints, counts, the
untrained correction bias, and the engine against the in-memory reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import EngineConfig, adamw
from megatrain_jax.flops import model_flops_per_token
from megatrain_jax.hf import UnsupportedConfig, config_from_hf, config_to_hf, load_hf, write_safetensors
from megatrain_jax.models import Decoder, MoEConfig, preset
from megatrain_jax.plan import io_param_count
from megatrain_jax.reference import model_loss
from test_engine import make_batches, run_both
from test_hf import assert_mtp_layer_skipped

# Published sizes (the GLM-4.5 model cards and technical report: 106B total / 12B active, 355B / 32B). Our
# count leaves out the multi-token-prediction layer the checkpoints also hold (not part of the causal LM);
# the published active figures leave out the embedding and the output head (with them: 13.4B and 33.6B) and are
# rounded to whole billions: ours are 12.18B (1.5% over "12B") and 32.08B (0.25%).
PUBLISHED = {"glm4.5-air": (106e9, 12e9), "glm4.5": (355e9, 32e9)}

# The fields of the released config.json files (zai-org/GLM-4.5-Air, zai-org/GLM-4.5) that decide the model,
# in transformers 4.x's spelling; the shapes agree with NVIDIA Megatron-Bridge's GLM 4.5 page.
RELEASED = {name: {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden, "partial_rotary_factor": 0.5,
    "intermediate_size": ffn, "max_position_embeddings": 131072, "moe_intermediate_size": moe_ffn,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": experts,
    "n_shared_experts": 1, "routed_scaling_factor": scale, "num_experts_per_tok": 8, "first_k_dense_replace": dense,
    "num_hidden_layers": layers, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "use_qk_norm": qk_norm,
    "vocab_size": 151552, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}
    for name, (hidden, ffn, moe_ffn, experts, scale, dense, layers, qk_norm) in {
        "glm4.5-air": (4096, 10944, 1408, 128, 1.0, 1, 46, False),
        "glm4.5": (5120, 12288, 1536, 160, 2.5, 3, 92, True)}.items()}

# A tiny GLM-4.5: one dense layer, two routed ones over 8 experts in 4 groups (2 kept), 2 per token.
GLM = preset("tiny", layers=3, family="glm4_moe", qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5,
             first_k_dense_replace=1,
             moe=MoEConfig(experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, shared_expert_gate=False,
                           scoring="sigmoid", groups=4, topk_groups=2, routed_scale=2.5))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    cfg = preset(name)
    total, active = PUBLISHED[name]
    embeddings = 2 * cfg.vocab_size * cfg.hidden
    assert abs(cfg.param_count() / total - 1) < 0.015, cfg.param_count()
    active_ours = cfg.active_param_count() - embeddings
    assert round(active_ours / 1e9) == active / 1e9 and abs(active_ours / active - 1) < 0.016, active_ours


def _without_ids(cfg):
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("spelling", ["4.x", "5.x"])
@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_json_reads_as_the_preset_and_writes_back(name, spelling):
    c = dict(RELEASED[name])
    if spelling == "5.x":  # transformers 5 keeps RoPE's fields in rope_parameters
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c.pop("rope_theta"),
                                "partial_rotary_factor": c.pop("partial_rotary_factor")}
        del c["rope_scaling"]
    cfg = config_from_hf(c)
    assert _without_ids(cfg) == preset(name)
    assert cfg.eos_token_id == (151329, 151336, 151338) and cfg.moe.aux_loss_coef == 0
    written = config_to_hf(cfg)
    assert written["num_nextn_predict_layers"] == 0  # the MTP layer is neither trained nor written
    assert (written["n_shared_experts"], written["first_k_dense_replace"]) == (1, RELEASED[name]["first_k_dense_replace"])
    assert config_from_hf(written) == cfg


def test_config_json_fields_left_out_take_transformers_defaults():
    c = {k: v for k, v in RELEASED["glm4.5-air"].items()
         if k not in ("partial_rotary_factor", "rms_norm_eps", "first_k_dense_replace", "n_shared_experts",
                      "n_group", "topk_group", "routed_scaling_factor", "attention_bias", "use_qk_norm")}
    cfg = config_from_hf(c)  # Glm4MoeConfig's defaults
    assert (cfg.partial_rotary_factor, cfg.norm_eps, cfg.first_k_dense_replace) == (0.5, 1e-5, 1)
    assert (cfg.moe.shared_expert_ffn, cfg.moe.groups, cfg.moe.routed_scale) == (1408, 1, 1.0)
    assert (cfg.qkv_bias, cfg.qk_norm) == (False, False)


@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(first_k_dense_replace=46), "leaves none of the 46 layers a mixture of experts"),
])
def test_unsupported_glm_configs_are_refused(change, match):
    with pytest.raises((UnsupportedConfig, ValueError), match=match):
        config_from_hf(dict(RELEASED["glm4.5-air"], **change))


@pytest.mark.parametrize("change, match", [
    (dict(groups=2), "grouped top-k .* only with scoring='sigmoid'"),
    (dict(scoring="sigmoid", groups=3), "must divide moe.experts=8"),
    (dict(scoring="sigmoid", groups=4, topk_groups=1, top_k=3), "must hold moe.top_k=3"),
    (dict(scoring="sigmoid", aux_loss_coef=0.01), "train without one: set aux_loss_coef=0"),
    (dict(scoring="sigm"), r"moe.scoring 'sigm' not supported"),
])
def test_router_config_errors_say_what_to_do(change, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**dict(experts=8, top_k=2, expert_ffn=16), **change})


@pytest.mark.parametrize("cfg, match", [
    (GLM.replace(moe=dataclasses.replace(GLM.moe, shared_expert_gate=True)), "ungated shared experts"),
    (GLM.replace(moe=dataclasses.replace(GLM.moe, shared_expert_ffn=48)), "ungated shared experts"),
    (GLM.replace(moe=dataclasses.replace(GLM.moe, scoring="softmax", groups=1, topk_groups=1)),
     "router scores by sigmoid"),
    (preset("qwen3-30b-a3b").replace(moe=dataclasses.replace(preset("qwen3-30b-a3b").moe, scoring="sigmoid",
                                                              aux_loss_coef=0.0)), "router scores by softmax"),
])
def test_export_refuses_what_the_architecture_cannot_express(cfg, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_to_hf(cfg)


def test_the_multi_token_prediction_layer_of_a_checkpoint_is_skipped_with_a_warning(tmp_path):
    """The released checkpoints hold the MTP layer as ``model.layers.{num_hidden_layers}.*`` (transformers
    ignores those keys on load): read the same model, and say so; any other stray tensor is still refused."""
    folder, tensors = assert_mtp_layer_skipped(tmp_path, "glm4_moe", {
        "model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
        "model.layers.3.mlp.gate.e_score_correction_bias": np.ones((8,), np.float32)})
    write_safetensors(folder / "model.safetensors", {**tensors, "model.layers.1.mlp.stray": np.ones((2,), np.float32)})
    with pytest.raises(ValueError, match="unexpected: model.layers.1.mlp.stray"):
        load_hf(folder, dtype="float32")


def test_counts_equal_the_model_parameters():
    """``param_count`` holds what the model holds (the correction bias included, no shared-expert gate);
    ``active_param_count`` leaves out the experts a token does not visit; the model FLOPs count the active ones."""
    model = nnx.eval_shape(lambda: Decoder(GLM, rngs=nnx.Rngs(0)))
    size = lambda part: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(part, nnx.Param)))  # noqa: E731
    assert [b.kind for b in model.blocks] == ["dense", "moe", "moe"]
    assert size(model) == GLM.param_count() and size(model.io) == io_param_count(GLM)
    moe = model.blocks[1].mlp
    assert moe.shared_gate is None and moe.correction_bias.shape == (8,)
    m, D = GLM.moe, GLM.hidden
    assert size(model.blocks[1]) - size(model.blocks[0]) == (
        D * m.experts + m.experts + 3 * D * m.expert_ffn * m.experts + 3 * D * m.shared_expert_ffn - 3 * D * GLM.ffn)
    unvisited = 2 * (m.experts - m.top_k) * 3 * D * m.expert_ffn
    assert GLM.active_param_count() == size(model) - unvisited
    assert model_flops_per_token(GLM.active_param_count(), GLM.layers, GLM.hidden, 16) == (
        6.0 * (size(model) - unvisited) + 6.0 * GLM.layers * GLM.hidden * 16)


def _random_correction_bias(model: Decoder) -> None:
    rng = np.random.default_rng(7)
    for block in model.blocks:
        if block.kind == "moe":
            block.mlp.correction_bias[...] = jnp.asarray(0.3 * rng.standard_normal(GLM.moe.experts), jnp.float32)


def _biases(model: Decoder) -> list[np.ndarray]:
    return [np.asarray(b.mlp.correction_bias[...]) for b in model.blocks if b.kind == "moe"]


def test_the_correction_bias_chooses_experts_and_takes_no_gradient():
    model = Decoder(GLM, rngs=nnx.Rngs(0))
    _random_correction_bias(model)
    batch = make_batches(1, vocab=GLM.vocab_size)[0]
    graphdef, params = nnx.split(model, nnx.Param)
    grads = jax.grad(lambda p: model_loss(nnx.merge(graphdef, p), batch))(params)
    for block in (1, 2):
        assert not np.any(np.asarray(grads["blocks"][block]["mlp"]["correction_bias"][...]))
        assert np.any(np.asarray(grads["blocks"][block]["mlp"]["router"]["kernel"][...]))
    x = jax.random.normal(jax.random.key(0), (32, GLM.hidden))
    moe = model.blocks[1].mlp
    chosen = moe.route(x)[1]
    moe.correction_bias[...] = jnp.zeros((8,), jnp.float32)
    assert not np.array_equal(np.asarray(moe.route(x)[1]), np.asarray(chosen))
    groups = np.asarray(chosen) // 2  # both experts of a token in the 2 groups kept
    assert all(len(set(g)) <= 2 for g in groups)


def test_engine_equals_reference_and_leaves_the_correction_bias_as_loaded():
    """The streamed engine trains a GLM-4.5 of both kinds (dense, routed) as the in-memory jax.grad + optax
    reference does: three steps of two accumulated groups of two micro-batches, gradients clipped. The
    correction bias, drawn at random as a checkpoint's would be, takes no gradient and, a vector, no weight
    decay (``megatrain_jax.adamw``'s default mask): it is exactly as loaded in both."""
    tx = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731
    loaded, refs = _random_correction_bias, []
    before = Decoder(GLM, rngs=nnx.Rngs(0))
    loaded(before)
    engine = run_both(GLM, tx, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05), prepare=loaded,
                      reference_out=refs)
    model = Decoder(GLM, rngs=nnx.Rngs(0))
    engine.write_back(model)
    for trained in (model, refs[0].model):
        for got, want in zip(_biases(trained), _biases(before)):
            np.testing.assert_array_equal(got, want)
        assert not np.array_equal(np.asarray(trained.blocks[1].mlp.router.kernel[...]),
                                  np.asarray(before.blocks[1].mlp.router.kernel[...]))
