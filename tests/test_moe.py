"""Mixture-of-experts blocks (issue 18): the presets' sizes, the dropless dispatch against a dense
computation of every expert, the capacity cut, the load-balancing loss against transformers' formula,
and the streamed engine against the whole-model reference, with the auxiliary loss in the loss."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import EngineConfig
from megatrain_jax.models import Decoder, MoE, MoEConfig, RouterStats, load_balancing_loss, preset


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                               ("qwen2-57b-a14b", 57.4e9, 14.2e9)])
def test_presets_have_the_published_sizes(name, total, active):
    cfg = preset(name)
    assert cfg.param_count() == pytest.approx(total, rel=0.01)
    assert cfg.active_param_count() == pytest.approx(active, rel=0.02)
    assert preset("7b").active_param_count() == preset("7b").param_count()


def dense_moe(moe: MoE, x_TD: jax.Array, capacity: int | None = None) -> jax.Array:
    """Every expert on every token, then each token's chosen experts weighted (and, with ``capacity``,
    each expert's assignments past the first ``capacity`` in token order dropped)."""
    cfg = moe.cfg
    probs = jax.nn.softmax(x_TD @ moe.router.kernel[...], axis=-1)
    w, idx = jax.lax.top_k(probs, cfg.top_k)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    e = moe.experts
    h = jax.nn.silu(jnp.einsum("td,edf->etf", x_TD, e.gate[...])) * jnp.einsum("td,edf->etf", x_TD, e.up[...])
    all_ETD = jnp.einsum("etf,efd->etd", h, e.down[...])
    mask_TKE = jax.nn.one_hot(idx, cfg.experts)
    if capacity is not None:  # rank of each assignment within its expert, in (token, slot) order
        flat = mask_TKE.reshape(-1, cfg.experts)
        rank = (jnp.cumsum(flat, axis=0) - flat).reshape(mask_TKE.shape)
        mask_TKE = mask_TKE * (rank < capacity)
    y = jnp.einsum("tke,tk,etd->td", mask_TKE, w, all_ETD)
    if moe.shared is not None:
        y = y + jax.nn.sigmoid(x_TD @ moe.shared_gate.kernel[...]) * moe.shared(x_TD)
    return y


@pytest.mark.parametrize("moe", [MoEConfig(experts=4, top_k=2, expert_ffn=24),
                                 MoEConfig(experts=6, top_k=3, expert_ffn=16, norm_topk_prob=False,
                                           shared_expert_ffn=40)], ids=["mixtral-like", "qwen2-moe-like"])
def test_dropless_dispatch_equals_every_expert_computed_densely(moe):
    layer = MoE(32, moe, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, 32))
    y, stats = layer(x)
    np.testing.assert_allclose(y.reshape(21, 32), dense_moe(layer, x.reshape(21, 32)), rtol=2e-5, atol=2e-6)
    assert stats.tokens == 21 and float(stats.counts_E.sum()) == 21 * moe.top_k
    np.testing.assert_allclose(stats.prob_sums_E.sum(), 21.0, rtol=1e-5)


def test_capacity_factor_drops_the_assignments_past_each_experts_capacity():
    cfg = MoEConfig(experts=4, top_k=2, expert_ffn=24, capacity_factor=0.5)
    layer = MoE(32, cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (1, 40, 32))
    y, _ = layer(x)
    capacity = math.ceil(0.5 * 40 * 2 / 4)
    want = dense_moe(layer, x[0], capacity)
    np.testing.assert_allclose(y[0], want, rtol=2e-5, atol=2e-6)
    assert not np.allclose(want, dense_moe(layer, x[0]))  # something was dropped


def hf_load_balancing_loss(logits_per_layer, top_k, experts, coef):
    """transformers' ``load_balancing_loss_func`` (no attention mask), written out: the layers' router
    logits concatenated, softmax, top-k one-hot, the mean over tokens of both, times E."""
    logits = jnp.concatenate(logits_per_layer, axis=0)
    probs = jax.nn.softmax(logits, axis=-1)
    _, selected = jax.lax.top_k(probs, top_k)
    mask = jax.nn.one_hot(selected, experts)  # [N, K, E]
    tokens_per_expert = jnp.mean(mask, axis=0)
    prob_per_expert = jnp.mean(probs, axis=0)
    return coef * experts * jnp.sum(tokens_per_expert * prob_per_expert[None, :])


def test_load_balancing_loss_and_its_gradient_equal_transformers_formula():
    E, K, coef = 6, 2, 0.02
    logits = [jax.random.normal(jax.random.key(i), (13, E)) * 2 for i in range(3)]

    def ours(logits):
        stats = []
        for lg in logits:
            probs = jax.nn.softmax(lg, axis=-1)
            idx = jax.lax.top_k(probs, K)[1].reshape(-1)
            stats.append(RouterStats(jnp.bincount(idx, length=E).astype(jnp.float32), probs.sum(0), lg.shape[0]))
        return load_balancing_loss(stats, coef, E)

    theirs = lambda logits: hf_load_balancing_loss(logits, K, E, coef)  # noqa: E731
    np.testing.assert_allclose(ours(logits), theirs(logits), rtol=1e-6)
    for a, b in zip(jax.grad(ours)(logits), jax.grad(theirs)(logits)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_the_training_loss_adds_the_weighted_load_balancing_loss():
    from megatrain_jax.loss import causal_lm_loss
    from megatrain_jax.reference import model_loss
    from test_engine import make_batches
    cfg = preset("tiny-moe")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    batch = make_batches(1, rows=2, seq=24, vocab=cfg.vocab_size)[0].filled()
    logits = model(batch.inputs, batch.positions)
    aux = model_loss(model, batch) - causal_lm_loss(logits, batch.targets, batch.loss_mask)
    assert logits.shape == (2, 24, cfg.vocab_size)
    # balanced routing gives coef * top_k; this is near it
    assert float(aux) == pytest.approx(cfg.moe.aux_loss_coef * cfg.moe.top_k, rel=0.5)
    quiet = Decoder(cfg.replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48)), rngs=nnx.Rngs(0))
    assert quiet.aux_loss is None
    quiet_logits = quiet(batch.inputs, batch.positions)
    assert float(model_loss(quiet, batch)) == float(causal_lm_loss(quiet_logits, batch.targets, batch.loss_mask))


def test_moe_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="top_k=3 exceeds moe.experts=2"):
        MoEConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match="set moe"):
        preset("tiny", family="mixtral")
    with pytest.raises(ValueError, match="leave mlp_chunk_tokens unset"):
        preset("tiny-moe", mlp_chunk_tokens=16)


ENGINE_CFGS = [EngineConfig(), EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05),
               EngineConfig(micro_batches=2, resident_layers=1, prefetch_depth=2),
               EngineConfig(micro_batches=2, norm_first=True, clip_norm=0.05)]
IDS = ["plain", "micro-accum-clip", "resident-prefetch", "two-pass-clip"]


@pytest.mark.parametrize("engine_cfg", ENGINE_CFGS, ids=IDS)
def test_engine_equals_reference_on_the_tiny_moe_without_its_auxiliary_loss(engine_cfg):
    """Dropless routing is per token, so micro-batches route exactly as the whole batch does."""
    from test_engine import ADAMW, run_both
    cfg = preset("tiny-moe").replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48), layers=3)
    run_both(cfg, ADAMW, engine_cfg, shared=True)  # plain's and resident-prefetch's reference: one run


@pytest.mark.parametrize("engine_cfg", ENGINE_CFGS, ids=IDS)
def test_engine_equals_reference_with_the_load_balancing_loss(engine_cfg):
    """The auxiliary loss over the whole batch (its statistics summed over blocks and micro-batches, its
    gradient sent back into every block's backward) equals the reference's. A large coefficient, so that
    the loss visibly moves the routers. The two-pass step's second backward takes the statistics of the first
    pass's forward."""
    from test_engine import ADAMW, run_both
    cfg = preset("tiny-moe").replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.5), layers=3)
    run_both(cfg, ADAMW, engine_cfg, shared=True)  # plain's and resident-prefetch's reference: one run


def test_a_steps_metrics_split_the_loss_into_its_load_balancing_and_next_token_terms():
    """``aux_loss`` and ``lm_loss`` of a routed model's step equal the reference's terms at the same parameters
    (the first step's, over micro-batches); a dense model's metrics have neither."""
    import optax
    from megatrain_jax import Engine
    from megatrain_jax.loss import causal_lm_loss
    from megatrain_jax.reference import model_loss
    from test_engine import TINY3, make_batches
    cfg = preset("tiny-moe").replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.5), layers=3)
    batch = make_batches(1, vocab=cfg.vocab_size)[0]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    full = batch.filled()
    lm = float(causal_lm_loss(model(full.inputs, full.positions), full.targets, full.loss_mask))
    aux = float(model_loss(model, full)) - lm
    m = Engine(model, optax.sgd(0.1), EngineConfig(micro_batches=2)).step(batch).resolve()
    assert m["aux_loss"] == pytest.approx(aux, rel=1e-4) and aux > 0.5  # coef * top_k near balance
    assert m["lm_loss"] == pytest.approx(lm, rel=1e-4)
    assert m["aux_loss"] + m["lm_loss"] == pytest.approx(m["loss"], rel=1e-6)
    dense = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), optax.sgd(0.1), EngineConfig()).step(
        make_batches(1, vocab=TINY3.vocab_size)[0]).resolve()
    assert "aux_loss" not in dense and "lm_loss" not in dense


def test_the_load_balancing_loss_moves_the_routers():
    """The gradient reaching the router from the auxiliary loss is not zero (so the tests above can fail)."""
    from megatrain_jax.reference import model_loss
    from test_engine import make_batches
    on = preset("tiny-moe").replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.5))
    off = on.replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48))
    batch = make_batches(1, vocab=on.vocab_size)[0].filled()
    grads = []
    for cfg in (on, off):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        g = jax.grad(lambda p: model_loss(nnx.merge(graphdef, p), batch))(params)
        grads.append(np.asarray(g["blocks"][0]["mlp"]["router"]["kernel"][...]))
    assert np.abs(grads[0] - grads[1]).max() > 1e-4


def test_a_run_config_amends_the_presets_moe_table_and_trains_it(tmp_path, capsys):
    """``model.moe.aux_loss_coef=0.1`` changes that field of the preset's MoE and keeps the rest; the CLI
    trains the tiny MoE."""
    from megatrain_jax.cli import load_config, main
    cfg = load_config(None, ["model.preset=tiny-moe", "model.moe.aux_loss_coef=0.1"]).model.build()
    assert cfg.moe == MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.1)
    run = ["model.preset=tiny-moe", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
           "log.progress=lines", "log.tensorboard=false", "train.steps=3", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "model.moe.aux_loss_coef=0.1"]) == 0
    out = capsys.readouterr().out
    assert "(aux 0." in out and "next-token loss" in out  # the load-balancing term shown apart
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(abs(r["lm_loss"] + r["aux_loss"] - r["loss"]) < 1e-5 for r in steps)


MOE_FAMILIES = {
    "mixtral": preset("tiny-moe"),
    "qwen3_moe": preset("tiny-moe", family="qwen3_moe", qk_norm=True, head_dim=16),
    "qwen2_moe": preset("tiny-moe", family="qwen2_moe", qkv_bias=True,
                        moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, norm_topk_prob=False, shared_expert_ffn=40,
                                      aux_loss_coef=0.001)),
    # GLM-4.5: a leading dense layer, a sigmoid router with its correction bias, an ungated shared expert
    "glm4_moe": preset("tiny-moe", family="glm4_moe", qkv_bias=True, partial_rotary_factor=0.5, first_k_dense_replace=1,
                       moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, shared_expert_ffn=48, shared_expert_gate=False,
                                     scoring="sigmoid", groups=2, topk_groups=1, routed_scale=2.5)),
}


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_hf_export_and_import_round_trip_per_expert_tensors(tmp_path, family):
    """save_hf writes each expert's matrices as released checkpoints hold them; load_hf, and HFParts into
    an engine's state, read back the same float32 parameters; the config comes back with its MoE."""
    from megatrain_jax.hf import HFParts, load_hf, read_config, save_hf
    from megatrain_jax.hf.safetensors_io import Checkpoint
    from megatrain_jax.contract.layered import block_params, io_params
    from megatrain_jax import Engine, adamw
    cfg = MOE_FAMILIES[family]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    ref = [nnx.to_pure_dict(io_params(model))] + [nnx.to_pure_dict(b) for b in block_params(model)]
    save_hf(tmp_path, cfg, ref[0], ref[1:], dtype="float32", max_shard_bytes=100_000)
    names = Checkpoint(tmp_path).names()
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    expert = "w1" if family == "mixtral" else "gate_proj"
    assert f"model.layers.1.{moe}.experts.3.{expert}.weight" in names and f"model.layers.1.{moe}.gate.weight" in names
    assert (f"model.layers.1.{moe}.shared_expert_gate.weight" in names) == (family == "qwen2_moe")
    assert (f"model.layers.1.{moe}.gate.e_score_correction_bias" in names) == (family == "glm4_moe")
    assert (f"model.layers.0.{moe}.gate.weight" in names) == (family != "glm4_moe")  # GLM's layer 0 is dense
    back = read_config(tmp_path, dtype="float32")
    assert back.moe == cfg.moe and back.family == family
    _, io, blocks = load_hf(tmp_path, dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, [io] + blocks, ref)
    abstract = nnx.eval_shape(lambda: Decoder(back, rngs=nnx.Rngs(0)))
    state = Engine(abstract, adamw(1e-3), init_from=HFParts(tmp_path, cfg)).state
    for part, want in zip(state.parts, ref):
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), nnx.to_pure_dict(part.params), want)


def test_hf_moe_configs_that_cannot_be_reproduced_are_refused():
    from megatrain_jax.hf import config_from_hf, config_to_hf
    from megatrain_jax.hf.config import UnsupportedConfig
    good = config_to_hf(MOE_FAMILIES["qwen3_moe"])
    assert config_from_hf(good).moe == MOE_FAMILIES["qwen3_moe"].moe
    with pytest.raises(UnsupportedConfig, match="decoder_sparse_step"):
        config_from_hf({**good, "decoder_sparse_step": 2})
    with pytest.raises(UnsupportedConfig, match="router_jitter_noise"):
        config_from_hf({**config_to_hf(MOE_FAMILIES["mixtral"]), "router_jitter_noise": 0.1})
    capped = preset("tiny-moe", moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, capacity_factor=1.0))
    assert "capacity" not in str(config_to_hf(capped))  # a training choice: the export is the dropless model
    with pytest.raises(UnsupportedConfig, match="shared_expert_intermediate_size"):
        config_from_hf({k: v for k, v in config_to_hf(MOE_FAMILIES["qwen2_moe"]).items()
                        if k != "shared_expert_intermediate_size"})
    no_norm = {k: v for k, v in good.items() if k != "norm_topk_prob"}
    assert config_from_hf(no_norm).moe.norm_topk_prob is False  # transformers' default


def test_capacity_factor_is_refused_where_a_block_would_see_part_of_the_batch():
    from megatrain_jax import Engine, adamw
    cfg = preset("tiny-moe", moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, capacity_factor=1.0))
    with pytest.raises(ValueError, match="micro_batches = 1 on one device"):
        Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(1e-3), EngineConfig(micro_batches=2))
    Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(1e-3), EngineConfig(), devices=jax.devices()[:1])


def test_engine_equals_reference_with_a_capacity_factor_on_one_routed_group():
    """With micro_batches = 1 on one device a block routes the whole batch, as the reference does, so the
    same assignments are dropped."""
    from test_engine import ADAMW, run_both
    cfg = preset("tiny-moe", layers=2, moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, capacity_factor=0.5,
                                                      aux_loss_coef=0.1))
    run_both(cfg, ADAMW, EngineConfig(clip_norm=0.05))
