"""The streamed engine must equal a plain in-memory jax.grad + optax step (the project's most important test)."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, ReferenceTrainer, adamw, preset
from megatrain_jax.engine import NonFiniteError
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


FUSED = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)


def test_fused_host_adamw_engine_equals_reference():
    """megatrain_jax.adamw runs as the in-place C++ kernel in the engine (bf16 stream copy written in the
    same pass) and matches the reference trainer running the same transformation through optax."""
    engine = run_both(TINY3, FUSED, EngineConfig(micro_batches=2, clip_norm=0.05))
    assert engine.opt.fused, "the C++ kernel should be built and used on this machine"


def test_fused_bf16_stream_copy_tracks_masters():
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    assert engine.opt.fused
    for b in make_batches(2):
        engine.step(b)
    engine.sync()
    import jax
    for master, stream in zip(jax.tree.leaves(engine.state.blocks), jax.tree.leaves(engine.state.stream_blocks)):
        np.testing.assert_array_equal(np.asarray(master.astype("bfloat16")), np.asarray(stream))


def poison_and_step(engine):
    """Make the loss NaN (final norm scale, an io part master) and run a step: returns (metrics, whether the
    blocks' parameters and optimizer state stayed exactly as they were)."""
    import jax
    good, = make_batches(1)
    engine.step(good).resolve()
    engine.sync()
    io = jax.tree.map(lambda a: a, engine.state.io)
    io["final_norm"]["scale"] = engine.placement.to_host(np.full((TINY3.hidden,), np.nan, np.float32))
    engine.state.io = io  # fp32 model: the streamed io part is the master itself
    before = [np.asarray(x).copy() for x in jax.tree.leaves((engine.state.blocks, engine.state.blocks_opt))]
    m = engine.step(good).resolve()
    engine.sync()
    after = [np.asarray(x) for x in jax.tree.leaves((engine.state.blocks, engine.state.blocks_opt))]
    return m, all(np.array_equal(a, b) for a, b in zip(before, after))


def test_nonfinite_step_is_skipped_and_too_many_stop_training():
    """A NaN loss skips the step with host state untouched; more than max_nonfinite_steps in a row raise."""
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(max_nonfinite_steps=1))
    m, unchanged = poison_and_step(engine)
    assert m["skipped"] and engine.skipped_steps == 1
    assert unchanged, "a skipped step must not change state"
    engine.step(make_batches(1)[0])
    with pytest.raises(NonFiniteError, match="max_nonfinite_steps=1"):
        engine.sync()


def test_host_kernel_matches_reference_math():
    from kernels.host_adamw import adamw_numpy, adamw_reference, load
    if load() is None:
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(0)
    n = 10_001
    p, m, g = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(np.float32)
    hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.5, bc1=1 - 0.9 ** 3, bc2=1 - 0.95 ** 3)
    ref = [np.asarray(x) for x in adamw_reference(p, m, v, g, **hp)]
    out = np.empty(n, np.uint16)
    adamw_numpy(p, m, v, g, out, **hp)
    for got, want in zip((p, m, v), ref[:3]):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(out, ref[3].view(np.uint16))


def test_host_kernel_work_layouts_agree_bit_for_bit():
    """Chunked and side-by-side layouts (the default) against one static slice per thread, and that against
    the jnp reference, over sizes that end mid-chunk, mid-block, on a chunk boundary and below one block:
    every element is updated exactly once, with the same bits in every layout."""
    from kernels.host_adamw import adamw_numpy, adamw_reference, load
    if load() is None:
        pytest.skip("no C++ compiler")
    layouts = {"default": (), "static": ("MEGATRAIN_CHUNK=0", "MEGATRAIN_SPLIT=1"),
               "small_chunks_split3": ("MEGATRAIN_CHUNK=1000", "MEGATRAIN_SPLIT=3"),
               "no_prefetch_split4": ("MEGATRAIN_PREFETCH=0", "MEGATRAIN_SPLIT=4", "MEGATRAIN_CHUNK=4096")}
    libs = {k: load(d) for k, d in layouts.items()}
    assert all(lib is not None for lib in libs.values()), "a layout variant failed to build"
    for k in ("static", "small_chunks_split3", "no_prefetch_split4"):  # several threads even on a 1-core runner
        libs[k].megatrain_set_threads(4)
    rng = np.random.default_rng(3)
    hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.7, bc1=0.1, bc2=0.05)
    for n in (7, 33, 65_536 * 2, 65_536 * 2 + 37, 300_017):
        src = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
        src[2] = np.abs(src[2])
        results = {}
        for k, lib in libs.items():
            state = [x.copy() for x in src]
            bf16, first_half = np.full(n, 0xFFFF, np.uint16), np.full(n, 0xFFFE, np.uint16)
            adamw_numpy(*state, bf16, lib=lib, **hp)
            adamw_numpy(*[x.copy() for x in src], first_half, stream_only=True, lib=lib, **hp)
            np.testing.assert_array_equal(first_half, bf16, err_msg=f"{k}, n={n}")
            results[k] = state[:3] + [bf16]
        ref = [np.asarray(x) for x in adamw_reference(*src, **hp)]
        for got, want in zip(results["static"][:3], ref[:3]):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=f"n={n}")
        np.testing.assert_array_equal(results["static"][3], ref[3].view(np.uint16))
        for k in ("default", "small_chunks_split3", "no_prefetch_split4"):
            for got, want in zip(results[k], results["static"]):
                np.testing.assert_array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                                              want.view(np.uint32) if want.dtype == np.float32 else want,
                                              err_msg=f"{k}, n={n}")


def test_megatrain_adamw_matches_optax_adamw():
    """Our AdamW transformation is optax.adamw's math (so results carry over from optax users)."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), "b": jnp.zeros(4)}
    ours, theirs = adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1,
                                                               mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    s1, s2, p1, p2 = ours.init(params), theirs.init(params), params, params
    for _ in range(3):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = theirs.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tx", [FUSED, SGD], ids=["fused-adamw", "sgd"])
def test_gpu_resident_parts_equal_reference(tx):
    """The io part and the first blocks updated on the device, the rest on the host: same training."""
    engine = run_both(TINY3, tx, EngineConfig(micro_batches=2, clip_norm=0.05, resident_layers=2, resident_io=True))
    assert sorted(engine.resident) == [-1, 0, 1]


def test_gpu_resident_parts_with_accumulation():
    run_both(TINY3, FUSED, EngineConfig(accumulate_steps=2, resident_layers=1))


def test_nonfinite_step_skipped_on_resident_parts_too():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(resident_layers=1))
    m, unchanged = poison_and_step(engine)
    assert m["skipped"] and unchanged


def _trained_state(engine_cfg, steps=3, **batch_kw):
    import jax
    model = Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    engine = Engine(model, FUSED(), engine_cfg)
    k = engine_cfg.accumulate_steps
    batches = make_batches(steps * k, **batch_kw)
    losses = [engine.step(batches[s * k:(s + 1) * k]).resolve()["loss"] for s in range(steps)]
    engine.sync()
    s = engine.state
    leaves = jax.tree.leaves((s.io, s.blocks, s.io_opt, s.blocks_opt, s.stream_io, s.stream_blocks))
    return engine, losses, [np.asarray(x) for x in leaves]


@pytest.mark.parametrize("extra", [{}, {"micro_batches": 2, "accumulate_steps": 2},
                                   {"resident_layers": 1, "resident_io": True}],
                         ids=["plain", "accumulate", "resident"])
def test_split_update_is_bitwise_the_single_pass_update(extra):
    """The stream copy first and the masters and moments later give exactly the one-pass update's state."""
    split, l1, a = _trained_state(EngineConfig(clip_norm=0.05, split_update=True, **extra))
    whole, l2, b = _trained_state(EngineConfig(clip_norm=0.05, split_update=False, **extra))
    assert split._split and not whole._split
    assert l1 == l2
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_split_update_keeps_stream_copy_equal_to_masters():
    import jax
    engine, _, _ = _trained_state(EngineConfig(split_update=True))
    for master, stream in zip(jax.tree.leaves((engine.state.io, engine.state.blocks)),
                              jax.tree.leaves((engine.state.stream_io, engine.state.stream_blocks))):
        np.testing.assert_array_equal(np.asarray(master.astype("bfloat16")), np.asarray(stream))


def test_split_update_second_half_failure_is_not_lost():
    """An error in a second half (a guard, the kernel) stops training instead of being dropped when the
    next step queues its own second halves."""
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    assert engine._split
    calls = []

    def flaky_guard(part):
        calls.append(part)
        if part == 1 and calls.count(1) == 1:
            raise RuntimeError("guard failed once")
    engine.update_guards.append(flaky_guard)
    batches = make_batches(4)
    with pytest.raises(RuntimeError, match="guard failed once"):
        for b in batches:
            engine.step(b)
        engine.sync()


def test_split_update_step_cut_short_still_commits_what_it_started():
    """A step interrupted between the first halves leaves masters, moments and bf16 copies consistent."""
    import jax
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    good, bad = make_batches(2)
    engine.step(good)
    original = engine._op_update

    def interrupted(p, op):
        if op.layer == 1:
            raise KeyboardInterrupt
        return original(p, op)
    engine._op_update = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step(bad)
    engine._op_update = original
    assert engine._commits == []
    engine.sync()
    s = engine.state
    for master, stream in zip(jax.tree.leaves((s.io, s.blocks)), jax.tree.leaves((s.stream_io, s.stream_blocks))):
        np.testing.assert_array_equal(np.asarray(master.astype("bfloat16")), np.asarray(stream))
    counts = [int(np.asarray(o.count)) for o in [s.io_opt] + list(s.blocks_opt)]
    assert counts == [2, 2, 1, 1], counts  # io and block 0 took the second step; blocks 1, 2 did not
