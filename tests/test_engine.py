"""The streamed engine must equal a plain in-memory jax.grad + optax step (the project's most important test)."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, ReferenceTrainer, preset
from megatrain_jax.layered import ContractError

TOL = 1e-5


def make_batches(n, rows=4, seq=16, vocab=256, seed=0, mask=False, packed=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = Batch.from_windows(rng.integers(0, vocab, (rows, seq + 1)))
        if mask:
            b = Batch(b.inputs, b.targets, loss_mask=(rng.random((rows, seq)) > 0.3).astype(np.float32))
        if packed:  # two documents per row, positions restarting at the boundary
            cut = seq // 3
            seg = np.where(np.arange(seq) < cut, 1, 2)[None].repeat(rows, 0)
            pos = np.where(np.arange(seq) < cut, np.arange(seq), np.arange(seq) - cut)[None].repeat(rows, 0)
            b = Batch(b.inputs, b.targets, positions=pos, segment_ids=seg)
        out.append(b)
    return out


def flat_params(model):
    return traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


# The key bias adds q.b to every score of a query row, which softmax ignores: its true gradient is exactly
# zero, so both trainers move it by rounding noise alone. It is compared in absolute terms.
ZERO_GRADIENT_LEAVES = {("attn", "k", "bias")}


def assert_models_close(ref_model, model, tol=TOL):
    a, b = flat_params(ref_model), flat_params(model)
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if tuple(k[-3:]) in ZERO_GRADIENT_LEAVES:
            assert np.linalg.norm(x - y) < 1e-6, k
            continue
        rel = np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)
        assert rel <= tol, f"{k}: relative difference {rel:.2e}"


def run_both(cfg, tx_fn, engine_cfg, steps=3, batch_kw=None):
    """Train a reference and an engine copy of the same model; compare every step's loss and the end."""
    batch_kw = batch_kw or {}
    k = engine_cfg.accumulate_steps
    batches = make_batches(steps * k, vocab=cfg.vocab_size, **batch_kw)
    ref = ReferenceTrainer(Decoder(cfg, rngs=nnx.Rngs(0)), tx_fn(), clip_norm=engine_cfg.clip_norm)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, tx_fn(), engine_cfg)
    for s in range(steps):
        group = batches[s * k:(s + 1) * k]
        r = ref.step(group)
        e = engine.step(group).resolve()
        assert abs(e["loss"] - r["loss"]) <= TOL * abs(r["loss"]), (s, e, r)
        assert abs(e["grad_norm"] - r["grad_norm"]) <= 1e-4 * r["grad_norm"], (s, e, r)
    engine.write_back(model)
    assert_models_close(ref.model, model)
    return engine


TINY3 = preset("tiny", layers=3)
# Adam divides by sqrt(v): an entry whose gradient is pure fp32 rounding noise (|g| ~ 1e-9) gets an O(lr)
# update of random sign in either implementation. eps=1e-6 bounds that amplification; SGD (no
# normalization) shows the gradients themselves agree to ~2e-7.
ADAMW = lambda: optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)
SGD = lambda: optax.sgd(0.5, momentum=0.9)


@pytest.mark.parametrize("tx,clip", [(ADAMW, None), (ADAMW, 0.05), (SGD, None), (SGD, 0.05)],
                         ids=["adamw-noclip", "adamw-clip", "sgd-noclip", "sgd-clip"])
def test_engine_equals_reference_clip_and_optimizer(tx, clip):
    run_both(TINY3, tx, EngineConfig(clip_norm=clip))


@pytest.mark.parametrize("micro,accum", [(4, 1), (2, 2)])
def test_engine_equals_reference_microbatch_and_accumulation(micro, accum):
    run_both(TINY3, ADAMW, EngineConfig(micro_batches=micro, accumulate_steps=accum, clip_norm=0.05))


@pytest.mark.parametrize("depth", [1, 2, 5])  # 5 > layers: everything prefetched at once
def test_engine_equals_reference_prefetch_depth(depth):
    run_both(TINY3, ADAMW, EngineConfig(prefetch_depth=depth, micro_batches=2))


def test_engine_equals_reference_tied_embeddings():
    """The tied table gets gradient from both the head and the embedding lookup (untied: every other test)."""
    run_both(TINY3.replace(tie_embeddings=True), ADAMW, EngineConfig(micro_batches=2, clip_norm=0.05))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_engine_equals_reference_other_families(family):
    extra = {"mistral": dict(sliding_window=5), "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True)}
    run_both(TINY3.replace(family=family, **extra[family]), ADAMW, EngineConfig(micro_batches=2))


def test_engine_equals_reference_loss_mask_and_packing():
    run_both(TINY3, ADAMW, EngineConfig(micro_batches=2), batch_kw=dict(mask=True))
    run_both(TINY3, ADAMW, EngineConfig(micro_batches=2), batch_kw=dict(packed=True))


def test_engine_with_schedule_and_decay_mask():
    """Leaf-wise transforms with schedules and callable weight-decay masks work part by part."""
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
    tx = lambda: optax.adamw(sched, weight_decay=0.1, mask=lambda p: __import__("jax").tree.map(lambda x: x.ndim > 1, p))
    run_both(TINY3, tx, EngineConfig(clip_norm=1.0))


def test_per_layer_functions_compile_once():
    engine = run_both(preset("tiny", layers=4), ADAMW, EngineConfig(micro_batches=2), steps=2)
    sizes = engine.fns.cache_sizes()
    # embed/forward/embed_backward: one shape each. head/backward: one entry for the first micro-batch
    # (no accumulator yet) and one for the rest.
    assert sizes == {"embed": 1, "forward": 1, "head": 2, "backward": 2, "embed_backward": 1}, sizes
    assert engine.opt._update._cache_size() == 2  # blocks share one compilation; the io part has its own


def test_state_lives_in_pinned_host_memory():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), ADAMW())
    engine.step(make_batches(1)[0]).resolve()
    import jax
    for leaf in jax.tree.leaves((engine.state.io, engine.state.blocks, engine.state.io_opt, engine.state.blocks_opt)):
        if hasattr(leaf, "sharding"):
            assert leaf.sharding.memory_kind == "pinned_host"


def test_abstract_model_initializes_part_by_part_like_concrete():
    """fit/Engine accept an abstract model + seed; its parameters equal those of the concrete model."""
    abstract = nnx.eval_shape(lambda: Decoder(TINY3, rngs=nnx.Rngs(7)))
    engine = Engine(abstract, ADAMW(), seed=7)
    concrete = Decoder(TINY3, rngs=nnx.Rngs(7))
    target = Decoder(TINY3, rngs=nnx.Rngs(0))
    engine.write_back(target)
    assert_models_close(concrete, target, tol=1e-6)  # jitted vs eager init: XLA fuses the scaling


def test_bad_inputs_fail_clearly_before_the_step():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(micro_batches=3))
    good = make_batches(1)[0]
    with pytest.raises(ValueError, match="micro_batches=3"):
        engine.step(good)
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), ADAMW())
    with pytest.raises(ValueError, match="token id 256.*vocabulary"):
        engine.step(Batch(good.inputs.copy() * 0 + 256, good.targets))
    with pytest.raises(ValueError, match="integer token ids"):
        engine.step(Batch(good.inputs.astype(np.float32), good.targets))
    with pytest.raises(ValueError, match="targets has shape"):
        engine.step(Batch(good.inputs, good.targets[:, :-1]))
    with pytest.raises(ValueError, match="accumulate_steps=1"):
        engine.step(make_batches(2))
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        EngineConfig(micro_batches=0)
    with pytest.raises(ContractError, match="contract"):
        Engine(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), ADAMW())
