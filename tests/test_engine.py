"""The streamed engine must equal a plain in-memory jax.grad + optax step (the project's most important test)."""

from __future__ import annotations

import collections

import hashlib
import re
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, NonFiniteError, ReferenceTrainer, adamw, preset
from megatrain_jax.contract.layered import ContractError
from megatrain_jax.engine.parts import IO, PartId
from megatrain_jax.engine.schedule import Op

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
            b = Batch(b.inputs, b.targets, loss_mask=b.loss_mask, positions=pos, segment_ids=seg)  # mask kept
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


def train_reference(cfg, tx_fn, clip_norm, batches, steps=3, prepare=None):
    """The in-memory reference trained ``steps`` optimizer steps over ``batches`` (split evenly into the steps'
    accumulated groups) from ``Decoder(cfg)`` seeded 0, changed by ``prepare(model)`` first (optional):
    ``(trainer, [each step's metrics])``."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    if prepare is not None:
        prepare(model)
    ref, k = ReferenceTrainer(model, tx_fn(), clip_norm=clip_norm), len(batches) // steps
    return ref, [ref.step(batches[s * k:(s + 1) * k]) for s in range(steps)]


_SHARED_REFERENCES: dict = {}


def shared_reference(cfg, tx_fn, clip_norm, batches, steps=3, prepare=None, patched=""):
    """``train_reference``, trained once per process for the same arguments (``batches`` compared by their arrays):
    many engine layouts are checked against one model, optimizer and data, whose reference is the same run each
    time. ``patched`` names what the caller patches in the code the reference runs through ("": nothing; a test
    that monkeypatches the model, as test_remat's cuDNN stand-in does, shares runs only with tests patching it
    alike). Keeps the trained model (``.model``) and the metrics, not the trainer's compiled programs."""
    digest = hashlib.sha256()
    for batch in batches:
        for x in (batch.inputs, batch.targets, batch.loss_mask, batch.positions, batch.segment_ids):
            digest.update(b"none" if x is None else f"{x.dtype}{x.shape}".encode() + np.ascontiguousarray(x).tobytes())
    key = (cfg, tx_fn, clip_norm, steps, prepare, patched, digest.hexdigest())
    if key not in _SHARED_REFERENCES:
        ref, metrics = train_reference(cfg, tx_fn, clip_norm, batches, steps, prepare)
        _SHARED_REFERENCES[key] = (SimpleNamespace(model=ref.model), metrics)
    return _SHARED_REFERENCES[key]


def run_both(cfg, tx_fn, engine_cfg, steps=3, batch_kw=None, prepare=None, reference_out=None, batches=None,
             devices=None, reference=None, observers=(), shared: bool | str = False):
    """Train a reference and an engine copy of the same model; compare every step's loss and the end.
    ``prepare(model)`` (optional) changes both fresh models alike before training; ``reference_out`` (a list,
    optional) receives the reference's trained model; ``batches`` (optional) replaces ``make_batches``'s
    (``steps * accumulate_steps`` of them); ``devices`` (optional) the engine's devices; ``reference``
    (optional) what ``train_reference`` gave for these arguments, to compare with instead of training it;
    ``observers`` watch the engine's steps (``Engine.observe``); ``shared``: the reference is ``shared_reference``'s,
    True where the caller patches nothing it runs through, else the name of the patch (its ``patched``)."""
    batch_kw = batch_kw or {}
    k = engine_cfg.accumulate_steps
    batches = batches if batches is not None else make_batches(steps * k, vocab=cfg.vocab_size, **batch_kw)
    assert len(batches) == steps * k, (len(batches), steps, k)
    if reference is None and shared:
        reference = shared_reference(cfg, tx_fn, engine_cfg.clip_norm, batches, steps, prepare,
                                     patched="" if shared is True else shared)
    ref, ref_metrics = reference or train_reference(cfg, tx_fn, engine_cfg.clip_norm, batches, steps, prepare)
    if reference_out is not None:
        reference_out.append(ref)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    if prepare is not None:
        prepare(model)
    engine = Engine(model, tx_fn(), engine_cfg, devices=devices)
    for observer in observers:
        engine.observe(observer)
    for s, r in enumerate(ref_metrics):
        e = engine.step(batches[s * k:(s + 1) * k]).resolve()
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
    run_both(TINY3, tx, EngineConfig(clip_norm=clip), shared=True)


@pytest.mark.parametrize("micro,accum", [(4, 1), (2, 2)])
def test_engine_equals_reference_microbatch_and_accumulation(micro, accum):
    run_both(TINY3, ADAMW, EngineConfig(micro_batches=micro, accumulate_steps=accum, clip_norm=0.05), shared=True)


@pytest.mark.parametrize("depth", [1, 2, 5])  # 5 > layers: everything prefetched at once
def test_engine_equals_reference_prefetch_depth(depth):
    run_both(TINY3, ADAMW, EngineConfig(prefetch_depth=depth, micro_batches=2), shared=True)


def test_engine_equals_reference_tied_embeddings():
    """The tied table gets gradient from both the head and the embedding lookup (untied: every other test)."""
    run_both(TINY3.replace(tie_embeddings=True), ADAMW, EngineConfig(micro_batches=2, clip_norm=0.05))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_engine_equals_reference_other_families(family):
    extra = {"mistral": dict(sliding_window=5), "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True)}
    run_both(TINY3.replace(family=family, **extra[family]), ADAMW, EngineConfig(micro_batches=2))


def test_engine_equals_reference_phi3_longrope_clip_and_accumulation():
    """Phi-3 as its checkpoints configure it (a sliding window; Phi-4-mini's longrope over 3/4 of each head): the
    16-token rows exceed the original length of 8, so the long factors and the attention factor are in play."""
    from megatrain_jax.models import RopeScaling
    rope = RopeScaling(kind="longrope", factor=16.0, original_max_position=8,
                       short_factor=(1.0, 1.1, 1.3, 1.7, 2.2, 3.0), long_factor=(1.0, 1.5, 3.0, 6.0, 12.0, 24.0))
    cfg = TINY3.replace(family="phi3", sliding_window=5, rope_scaling=rope, partial_rotary_factor=0.75)
    run_both(cfg, ADAMW, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05))


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
    assert engine.policy.opt.compilations() == {"host": 2, "device": 0}  # blocks share one; the io part has its own


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "optax"])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_lives_in_pinned_or_pageable_host_memory(fused, resident, dtype):
    """What crosses PCIe is pinned, what only the fused kernel touches is pageable: after the build,
    after steps, and after ``sync`` has brought GPU-resident parts back."""
    from test_startup import assert_homes
    tx = adamw(1e-3) if fused else ADAMW()
    model = Decoder(preset("tiny", layers=3, dtype=dtype), rngs=nnx.Rngs(0))
    engine = Engine(model, tx, EngineConfig(resident_layers=resident))
    assert engine.update_route == ("fused" if fused else "host")
    for _ in range(2):
        for part in engine.state.parts:
            assert_homes(part, engine.placement, fused)
        engine.step(make_batches(1)[0]).resolve()
        engine.sync()


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
    with pytest.raises(ValueError, match="micro_batches = 3"):
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
    engine = run_both(TINY3, FUSED, EngineConfig(micro_batches=2, clip_norm=0.05), shared=True)
    assert engine.update_route == "fused", "the C++ kernel should be built and used on this machine"


def test_fused_bf16_stream_copy_tracks_masters():
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    assert engine.update_route == "fused"
    for b in make_batches(2):
        engine.step(b)
    engine.sync()
    assert_stream_copies_track_masters(engine)


def assert_stream_copies_track_masters(engine):
    import jax
    for part in engine.state.parts:
        for master, stream in zip(jax.tree.leaves(part.params), jax.tree.leaves(part.stream)):
            np.testing.assert_array_equal(np.asarray(master.astype("bfloat16")), np.asarray(stream))


def poison_and_step(engine):
    """Make the loss NaN (final norm scale, an io part master) and run a step: returns (metrics, whether the
    blocks' parameters and optimizer state stayed exactly as they were)."""
    import jax
    good, = make_batches(1)
    engine.step(good).resolve()
    engine.sync()
    io = engine.state[IO]
    params = jax.tree.map(lambda a: a, io.params)
    nan = engine.placement.to_host(np.full((TINY3.hidden,), np.nan, np.float32))
    old = params["final_norm"]["scale"]
    params["final_norm"]["scale"] = old.replace(nan) if hasattr(old, "replace") else nan  # the same tree
    engine.restore_part(IO, params, io.opt)
    engine.restored(engine.state.step)
    blocks = lambda: [(p.params, p.opt) for p in engine.state.parts[1:]]
    before = [np.asarray(x).copy() for x in jax.tree.leaves(blocks())]
    m = engine.step(good).resolve()
    engine.sync()
    after = [np.asarray(x) for x in jax.tree.leaves(blocks())]
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
    engine = run_both(TINY3, tx, EngineConfig(micro_batches=2, clip_norm=0.05, resident_layers=2, resident_io=True),
                      shared=True)
    assert engine.resident_parts == [IO, PartId.block(0), PartId.block(1)]


def test_gpu_resident_parts_with_accumulation():
    run_both(TINY3, FUSED, EngineConfig(accumulate_steps=2, resident_layers=1), shared=True)


def test_nonfinite_step_skipped_on_resident_parts_too():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(resident_layers=1))
    m, unchanged = poison_and_step(engine)
    assert m["skipped"] and unchanged


def test_a_step_decision_is_written_home_by_the_program_that_makes_it():
    """The host reads the decision later, on the worker; the program that makes it writes its scale and verdict
    to host memory too, so that no copy issued later (behind the next forward's copies home) is waited for. The
    host's readings are the device's values; a step whose loss is not finite does not apply."""
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(clip_norm=0.05))
    sq = [jax.numpy.float32(4.0), jax.numpy.float32(5.0)]  # norm 3: clipped to 0.05
    decision = engine.policy.decide(sq, jax.numpy.float32(1.0))
    assert {x.sharding.memory_kind for x in (decision.scale, decision.ok)} == {"device"}
    assert {x.sharding.memory_kind for x in decision.home} == {"pinned_host"}
    assert decision.resolve() and decision.applies
    assert decision.scale_value == float(np.asarray(decision.scale)) == np.float32(0.05) / np.float32(3.0)
    assert not engine.policy.decide(sq, jax.numpy.float32(np.nan)).resolve()
    engine.close()


@pytest.mark.parametrize("engine_cfg", [
    EngineConfig(micro_batches=2, clip_norm=0.05, grads_on_gpu=2),
    EngineConfig(accumulate_steps=2, grads_on_gpu=4),  # every part: the 3 blocks and io
    EngineConfig(resident_layers=1, grads_on_gpu=2, stream_dtype="float32"),  # blocks 1 and 2 (0 is resident)
], ids=["clip", "accumulate-all", "after-resident"])
@pytest.mark.parametrize("tx", [FUSED, SGD], ids=["fused-adamw", "sgd"])
def test_gradients_waiting_on_the_gpu_equal_reference(tx, engine_cfg):
    """Gradients kept on the device until the update (``grads_on_gpu``) give the same training, whatever
    the optimizer route, clipping, accumulation and GPU-resident parts."""
    engine = run_both(TINY3, tx, engine_cfg, shared=True)
    expected = [p for p in [PartId.block(i) for i in range(3)] + [IO] if p not in engine.resident_parts]
    assert engine.grads_on_gpu_parts == expected[:engine_cfg.grads_on_gpu]


def test_gradients_waiting_on_the_gpu_with_a_bfloat16_stream_copy():
    """With a 16-bit stream copy the fused update is split in two halves, except for the parts whose
    gradient waits on the GPU: these update in one pass. Masters and moments equal the all-split run's."""
    split = _trained(EngineConfig())
    held = _trained(EngineConfig(grads_on_gpu=2))
    for a, b in zip(jax.tree.leaves(split.state), jax.tree.leaves(held.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("split_parts", [0, 2])
def test_updates_in_one_pass_train_exactly_as_split_ones(split_parts):
    """``split_parts``: the last parts in update order split, the others update in one pass; masters,
    moments and stream copies are bitwise the all-split run's."""
    split = _trained(EngineConfig(clip_norm=0.05))
    mixed = _trained(EngineConfig(clip_norm=0.05, split_parts=split_parts))
    assert mixed.policy.split == {PartId.block(i) for i in range(3 - split_parts, 3)}
    for a, b in zip(jax.tree.leaves(split.state), jax.tree.leaves(mixed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_stream_copies_track_masters(mixed)

    class Commits:  # the host worker's second passes of one step
        def __init__(self):
            self.keys = []

        def on_op(self, op, start, end, out):
            pass

        def on_task(self, key, start, end):
            if key.stage == "commit":
                self.keys.append(key.part)
    seen = Commits()
    mixed.observe(seen)
    mixed.step(make_batches(1)[0]).resolve()
    mixed.sync()
    assert sorted(seen.keys, key=lambda p: p.index) == sorted(mixed.policy.split, key=lambda p: p.index)


@pytest.mark.parametrize("bad", [-1, True, "all"])
def test_a_split_count_that_is_not_a_count_is_refused(bad):
    with pytest.raises(ValueError, match=re.escape("split_parts must be an integer >= 0 or 'auto'")):
        EngineConfig(split_parts=bad)


def test_a_split_count_above_the_parts_that_can_split_splits_them_all():
    """The count is of the parts that can split (not those whose gradient waits on the GPU): above it, all."""
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(),
                    EngineConfig(split_parts=9, grads_on_gpu=1))
    assert engine.policy.split == {PartId.block(1), PartId.block(2), IO}
    one = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(),
                 EngineConfig(split_parts=1, grads_on_gpu=1))
    assert one.policy.split == {PartId.block(2)}


def test_more_gradients_on_the_gpu_than_host_updated_parts_is_refused():
    with pytest.raises(ValueError, match="grads_on_gpu=4 exceeds the 3 parts updated on the host"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(resident_io=True, grads_on_gpu=4))


def _trained(engine_cfg, steps=3, **batch_kw):
    model = Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    engine = Engine(model, FUSED(), engine_cfg)
    k = engine_cfg.accumulate_steps
    batches = make_batches(steps * k, **batch_kw)
    for s in range(steps):
        engine.step(batches[s * k:(s + 1) * k]).resolve()
    engine.sync()
    return engine


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_resident_parts_without_their_compute_copy_train_bit_for_bit_as_with_it(micro_batches):
    """``resident_copy=False``: a GPU-resident part keeps only its masters and moments on the device, and each fetch
    casts the masters to the stream dtype (engine/update/resident.py). The same cast the update stored before, so
    masters, moments and stream copies are those of the copies kept, bit for bit; the host records come home with
    their stream copy as before."""
    layout = dict(micro_batches=micro_batches, clip_norm=0.05, resident_layers=2, resident_io=True)
    kept, cast = _trained(EngineConfig(**layout)), _trained(EngineConfig(**layout, resident_copy=False))
    assert kept.policy.device.keep_copy and not cast.policy.device.keep_copy
    assert kept.resident_parts == cast.resident_parts == [IO, PartId.block(0), PartId.block(1)]
    for a, b in zip(jax.tree.leaves(kept.state), jax.tree.leaves(cast.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    io = cast.state[IO]
    assert io.stream is not None
    for master, stream in zip(jax.tree.leaves(io.params), jax.tree.leaves(io.stream)):
        np.testing.assert_array_equal(np.asarray(master.astype("bfloat16")), np.asarray(stream))
    # float32 masters streamed as they are: nothing to cast, whatever the setting
    f32 = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(resident_layers=1, resident_copy=True))
    assert not f32.policy.device.keep_copy
    with pytest.raises(ValueError, match="resident_copy must be true, false or 'auto'"):
        EngineConfig(resident_copy="yes")


@pytest.mark.parametrize("engine_cfg", [
    EngineConfig(micro_batches=2, clip_norm=0.05, gpu_updated_layers=3),  # every block
    EngineConfig(accumulate_steps=2, resident_layers=1, gpu_updated_layers=1, grads_on_gpu=1),  # 0 resident, 1, 2 host
    EngineConfig(clip_norm=0.05, gpu_updated_layers=2, prefetch_depth=2, stream_dtype="float32"),
], ids=["clip-all", "accumulate-between-roles", "float32-streamed-depth2"])
@pytest.mark.parametrize("tx", [FUSED, SGD], ids=["fused-adamw", "sgd"])
def test_blocks_updated_on_the_gpu_equal_reference(tx, engine_cfg):
    """``gpu_updated_layers``: streamed blocks whose update runs on the device at their next forward (their
    gradient waits there, their masters and moments visit from host memory) train as the reference does, beside
    GPU-resident and host-updated parts, with clipping, accumulation and either optimizer route."""
    engine = run_both(TINY3, tx, engine_cfg, shared=True)
    first = engine_cfg.resident_layers
    assert engine.gpu_updated_parts == [PartId.block(i) for i in range(first, first + engine_cfg.gpu_updated_layers)]
    assert not engine._runner.pending  # write_back synced: every update has run


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_blocks_updated_on_the_gpu_train_bit_for_bit_as_gpu_resident_ones(micro_batches):
    """A block updated on the GPU at its visit runs the GPU-resident parts' update on the same numbers, so
    masters, moments and stream copies are those of the same blocks kept resident, bit for bit; the visiting
    blocks' host records come home with their stream copy."""
    resident = _trained(EngineConfig(micro_batches=micro_batches, clip_norm=0.05, resident_layers=2))
    visiting = _trained(EngineConfig(micro_batches=micro_batches, clip_norm=0.05, gpu_updated_layers=2))
    assert visiting.gpu_updated_parts == [PartId.block(0), PartId.block(1)]
    for part in visiting.gpu_updated_parts:
        for a, b in zip(jax.tree.leaves(resident.state[part]), jax.tree.leaves(visiting.state[part])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_stream_copies_track_masters(visiting)
    for part in visiting.gpu_updated_parts:  # they cross PCIe each step: pinned, from the start
        assert all(visiting.placement.is_pinned(x) for x in jax.tree.leaves((visiting.state[part].params,
                                                                              visiting.state[part].opt)))


def test_blocks_updated_on_the_gpu_complete_their_update_before_the_state_is_read():
    """A step leaves the GPU-updated blocks' update pending (it runs at their next forward); whatever reads the
    state first runs it (``sync``: parameters, evaluation, checkpoints), and the next step's forward then fetches
    what came home. Evaluation between steps changes nothing: the state is the resident run's, bit for bit."""
    batches = make_batches(3)
    resident = _trained(EngineConfig(resident_layers=3), steps=2)
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(),
                    EngineConfig(gpu_updated_layers=3))
    engine.step(batches[0]).resolve()
    assert set(engine._runner.pending) == {PartId.block(i) for i in range(3)}
    before = np.asarray(jax.tree.leaves(engine.state[PartId.block(0)].params)[0]).copy()
    nll, count = engine.eval_nll(batches[2:])  # syncs: the updates run first
    assert not engine._runner.pending and np.isfinite(nll) and count > 0
    assert not np.array_equal(before, np.asarray(jax.tree.leaves(engine.state[PartId.block(0)].params)[0]))
    engine.step(batches[1]).resolve()
    engine.sync()
    for a, b in zip(jax.tree.leaves(resident.state), jax.tree.leaves(engine.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restored_part_drops_its_pending_gpu_update_and_close_runs_the_rest():
    """``restore_part`` replaces a part's record: its pending update (of the record replaced) is dropped, not run on
    the new one; ``close`` runs the other pending updates and stops the thread that brings state over."""
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_layers=2))
    engine.step(make_batches(1)[0]).resolve()
    b0, b1 = PartId.block(0), PartId.block(1)
    assert set(engine._runner.pending) == {b0, b1}
    saved = jax.tree.map(np.array, (engine.state[b0].params, engine.state[b0].opt))
    engine.restore_part(b0, *saved)
    assert set(engine._runner.pending) == {b1}
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves((engine.state[b0].params, engine.state[b0].opt))):
        np.testing.assert_array_equal(a, np.asarray(b))  # as restored: the dropped update did not run on it
    before = np.asarray(jax.tree.leaves(engine.state[b1].params)[0]).copy()
    engine.close()
    assert not engine._runner.pending and engine._runner._copier._shutdown
    assert not np.array_equal(before, np.asarray(jax.tree.leaves(engine.state[b1].params)[0]))


def test_blocks_updated_on_the_gpu_are_brought_one_after_another():
    """Copies in flight at once share the link and land together, so the first visit would wait for all of them:
    the bring thread issues a block's state only once the block before it has landed."""
    import threading

    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_layers=2))
    engine.step(make_batches(1)[0]).resolve()
    runner, b0, b1 = engine._runner, PartId.block(0), PartId.block(1)
    land, issued = threading.Event(), []

    class InFlight:  # a copy that lands when the test says so
        def block_until_ready(self):
            land.wait(10)
            return self

    real = runner.policy.device.bring

    def bring(record):
        issued.append(record)
        return (InFlight(), real(record)) if len(issued) == 1 else real(record)

    runner.policy.device.bring = bring
    try:
        first = runner.bring(None, Op("bring", b0))
        second = runner.bring(None, Op("bring", b1))
        time.sleep(0.2)
        assert len(issued) == 1 and not first.done() and not second.done()  # b1 waits for b0 to land
        land.set()
        first.result(10), second.result(10)
        assert issued == [engine.state[b0], engine.state[b1]]
    finally:
        land.set()
        runner.policy.device.bring = real
        runner.brought.clear()
        engine.close()


def test_a_failed_close_lets_go_of_the_state_brought_for_the_other_blocks():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_layers=2))
    engine.step(make_batches(1)[0]).resolve()
    runner = engine._runner
    for part in list(runner.pending):
        runner.bring(None, Op("bring", part))
    assert len(runner.brought) == 2

    def fail(*args, **kw):
        raise RuntimeError("update failed")

    runner.policy.update_visiting = fail
    with pytest.raises(RuntimeError, match="update failed"):
        runner.close()
    assert not runner.brought and runner._copier._shutdown


def test_nonfinite_step_skipped_on_blocks_updated_on_the_gpu_too():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_layers=2))
    m, unchanged = poison_and_step(engine)
    assert m["skipped"] and unchanged


def test_blocks_updated_on_the_gpu_take_their_place_among_the_roles():
    """After the resident blocks, before the host-updated ones: the gradients that wait on the GPU and the disk
    tier's blocks are host parts'."""
    from megatrain_jax.engine.parts import HostRoles
    roles = HostRoles.of_config(4, EngineConfig(resident_layers=1, gpu_updated_layers=2, grads_on_gpu=1,
                                                disk_parts=1, disk_dir="/tmp"))
    assert roles.gpu_updated == (PartId.block(1), PartId.block(2))
    assert roles.host_updated == (PartId.block(3), IO)
    assert roles.grads_on_gpu == (PartId.block(3),) and roles.disk == (PartId.block(3),)
    with pytest.raises(ValueError, match=re.escape("gpu_updated_layers=4 exceeds the 3 blocks that are not "
                                                   "GPU-resident")):
        HostRoles.of_config(3, EngineConfig(gpu_updated_layers=4))
    with pytest.raises(ValueError, match=re.escape("grads_on_gpu=3 exceeds the 2 parts updated on the host")):
        HostRoles.of_config(3, EngineConfig(resident_layers=1, gpu_updated_layers=1, grads_on_gpu=3))


@pytest.mark.parametrize("settings,match", [
    (dict(gpu_updated_layers=-1), "gpu_updated_layers must be an integer >= 0"),
    (dict(gpu_updated_layers=True), "gpu_updated_layers must be an integer >= 0"),
    (dict(gpu_updated_layers=1, norm_first=True), "set one of them"),
    (dict(gpu_updated_layers=1, master_dtype="bfloat16"), "keeps float32 masters and moments"),
])
def test_blocks_updated_on_the_gpu_refuse_what_they_cannot_run(settings, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        EngineConfig(**settings)


@pytest.mark.parametrize("engine_cfg", [
    EngineConfig(micro_batches=2, clip_norm=0.05, gpu_updated_io=True),
    EngineConfig(clip_norm=0.05, gpu_updated_io=True, gpu_updated_layers=2, prefetch_depth=2),
    EngineConfig(accumulate_steps=2, gpu_updated_io=True, gpu_updated_layers=1, grads_on_gpu=1),
    EngineConfig(clip_norm=0.05, gpu_updated_io=True, prefetch_depth=3),  # block 0 stays from the forward
], ids=["io-alone", "io-and-blocks-depth2", "accumulate-between-roles", "no-backward-fetch-of-block-0"])
@pytest.mark.parametrize("tx", [FUSED, SGD], ids=["fused-adamw", "sgd"])
def test_the_io_part_updated_on_the_gpu_equals_reference(tx, engine_cfg):
    """``gpu_updated_io``: the io part streams but updates on the device at the next forward's first op, from the
    state brought during the backward before; it trains as the reference does beside blocks updated on the GPU
    and on the host, with clipping, accumulation and either optimizer route."""
    engine = run_both(TINY3, tx, engine_cfg, shared=True)
    assert engine.gpu_updated_parts[0] == IO and IO not in engine._runner.pending


def test_the_io_part_updated_on_the_gpu_trains_bit_for_bit_as_the_resident_io_part():
    """The io part's update at its visit is the resident parts' update on the same numbers: its masters, moments
    and stream copy are those of the io part kept resident, bit for bit. Its state comes over during the backward
    (before the step's update exists), and a read of the state (``sync``) runs the pending update on it."""
    resident = _trained(EngineConfig(clip_norm=0.05, resident_io=True))
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(),
                    EngineConfig(clip_norm=0.05, gpu_updated_io=True))
    for batch in make_batches(3):
        engine.step(batch).resolve()
        assert IO in engine._runner.pending and IO in engine._runner.brought  # brought in the backward
    engine.sync()
    assert not engine._runner.pending and not engine._runner.brought
    for a, b in zip(jax.tree.leaves(resident.state[IO]), jax.tree.leaves(engine.state[IO])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_stream_copies_track_masters(engine)
    assert all(engine.placement.is_pinned(x) for x in jax.tree.leaves((engine.state[IO].params, engine.state[IO].opt)))


def test_the_io_part_brought_for_a_step_cut_short_is_let_go_at_the_next_visit():
    """A step cut short after the io part's state came over but before its update leaves nothing pending: the
    next forward fetches the io part as it is at home and lets go of what was brought (it would otherwise stay
    on the GPU through that step, beyond the plan's count), then brings it again in that step's backward."""
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_io=True))
    runner = engine._runner
    runner.bring(None, Op("bring", IO))  # as the backward does, with no update pending yet
    assert IO in runner.brought and IO not in runner.pending
    engine.step(make_batches(1)[0]).resolve()  # its forward's visit finds no update: a fetch
    assert IO in runner.pending and IO in runner.brought  # brought again in this step's backward
    engine.sync()
    runner.bring(None, Op("bring", IO))  # a step cut short after its bring: a read of the state lets go of it too
    assert IO in runner.brought and not runner.pending
    engine.sync()
    assert not runner.brought
    engine.close()
    assert not runner.pending and not runner.brought


def test_the_io_part_updated_on_the_gpu_takes_its_place_among_the_roles():
    from megatrain_jax.engine.parts import HostRoles
    roles = HostRoles.of_config(3, EngineConfig(gpu_updated_layers=1, gpu_updated_io=True))
    assert roles.gpu_updated == (IO, PartId.block(0)) and roles.host_updated == (PartId.block(1), PartId.block(2))
    assert roles.visited_layers == (0,) and roles.io_visited
    assert not HostRoles.of_config(3, EngineConfig(gpu_updated_layers=1)).io_visited
    with pytest.raises(ValueError, match="an Engine takes a value"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(gpu_updated_io="auto"))


@pytest.mark.parametrize("settings,match", [
    (dict(gpu_updated_io=1), "gpu_updated_io must be true, false or 'auto'"),
    (dict(gpu_updated_io=True, resident_io=True), "set one of them"),
    (dict(gpu_updated_io=True, norm_first=True), "set one of them"),
    (dict(gpu_updated_io=True, master_dtype="bfloat16"), "keeps float32 masters and moments"),
])
def test_the_io_part_updated_on_the_gpu_refuses_what_it_cannot_run(settings, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        EngineConfig(**settings)


def test_split_update_halves_are_bitwise_the_single_pass_update():
    """The fused update runs in two halves (the bf16 stream copy first, the fp32 masters and moments later):
    over several steps with real gradients they give exactly the one-pass update's part."""
    import jax
    engine = _trained(EngineConfig())
    opt = engine.policy.opt
    assert opt.splits
    copy = lambda part: engine.placement.copy_to_host(part)
    split, whole = copy(engine.state[PartId.block(1)]), copy(engine.state[PartId.block(1)])
    rng = np.random.default_rng(0)
    for step in range(3):
        grads = engine.placement.to_host(jax.tree.map(
            lambda x: np.asarray(rng.standard_normal(x.shape), np.float32), split.params))
        scale = np.float32(0.3 + step)
        t = opt.update_stream(split, grads, scale)
        split = opt.commit(split, grads, scale, t)
        whole = opt.update(whole, grads, scale)
    for x, y in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("extra", [{}, {"micro_batches": 2, "accumulate_steps": 2},
                                   {"resident_layers": 1, "resident_io": True}],
                         ids=["plain", "accumulate", "resident"])
def test_split_update_keeps_stream_copy_equal_to_masters(extra):
    engine = _trained(EngineConfig(clip_norm=0.05, **extra))
    assert engine.policy.opt.splits
    assert_stream_copies_track_masters(engine)
    counts = [int(np.asarray(p.opt.count)) for p in engine.state.parts]
    assert counts == [3] * len(counts), counts


def _profiled_and_plain(engine_cfg):
    """Three steps of ``engine_cfg`` with step 2 profiled and none: (profiled engine, its metrics), and the plain
    run's; the losses and the states are checked equal here."""
    def run(profile_step):
        engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(), engine_cfg)
        return engine, list(engine.steps(make_batches(3), profile_step=profile_step))
    plain, plain_metrics = run(None)
    profiled, metrics = run(2)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in plain_metrics]
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(profiled.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return profiled, metrics


def test_a_profiled_step_trains_the_same_numbers_and_reports_its_lanes():
    """``Engine.steps(..., profile_step=2)``: step 2 runs serialized under a ``Profile``; its metrics carry its
    seconds per lane and ``profiled``, no other step's do, and the state is bit for bit an unprofiled run's."""
    _, metrics = _profiled_and_plain(EngineConfig(clip_norm=0.05, resident_layers=1))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert ["profiled" in m for m in metrics] == [False, True, False]
    assert not any(k.startswith("profile_") for m in (metrics[0], metrics[2]) for k in m)
    lanes = {k: v for k, v in metrics[1].items() if k.startswith("profile_")}
    assert set(lanes) == {f"profile_{k}_s" for k in ("serialized", "compute", "h2d", "d2h", "host_update",
                                                       "device_update")}
    assert all(v > 0 for v in lanes.values()), lanes  # block 0 is resident: its update is device work
    assert sum(v for k, v in lanes.items() if k != "profile_serialized_s") <= lanes["profile_serialized_s"]


def test_each_step_counts_the_tokens_in_its_loss_beside_its_tokens(capsys):
    """``loss_tokens``: a step's tokens whose loss mask is not 0 (padding and prompts left out), and
    ``loss_tokens_per_s``; with every token in the loss they equal ``tokens``; the printed line names the rate in
    the loss only where some tokens are out of it."""
    from megatrain_jax.fit import StepInfo, print_logger
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(clip_norm=0.05))
    masked, whole = make_batches(2, mask=True), make_batches(1)
    metrics = list(engine.steps(masked + whole))
    for m, b in zip(metrics, masked + whole):
        assert m["tokens"] == b.tokens and m["loss_tokens"] == int(np.count_nonzero(b.filled().loss_mask))
        assert m["loss_tokens_per_s"] == pytest.approx(m["loss_tokens"] / m["step_time_s"])
    assert metrics[0]["loss_tokens"] < metrics[0]["tokens"] and metrics[2]["loss_tokens"] == metrics[2]["tokens"]
    log = print_logger(every=1).fn
    for m in (metrics[0], metrics[2]):
        log({**m, "model_tflops": 0.0}, StepInfo(m["step"], m["step"], engine))
    first, last = capsys.readouterr().out.splitlines()
    assert f"({metrics[0]['loss_tokens_per_s']:,.0f} in the loss)" in first and "in the loss" not in last
    engine.close()


def test_a_profiled_step_counts_the_visits_of_blocks_updated_on_the_gpu_as_device_updates():
    """Nothing resident, blocks 0 and 1 updated on the GPU: the profiled step's ``device_update`` lane is their
    visits' update (the step before's, run at this step's forward), not GPU compute; the numbers are unchanged."""
    _, metrics = _profiled_and_plain(EngineConfig(clip_norm=0.05, gpu_updated_layers=2))
    assert metrics[1]["profile_device_update_s"] > 0 and metrics[1]["profile_compute_s"] > 0


def test_a_profiled_step_does_not_count_the_step_before_it():
    """The step before the profiled one may still have host updates queued (here each takes 0.2 s more); the
    profiled step starts once they are done, so its weights' fetches do not count the wait for them."""
    import time as time_
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED(), EngineConfig(clip_norm=0.05))
    engine.hold_updates(lambda part: time_.sleep(0.2))
    metrics = list(engine.steps(make_batches(3), profile_step=3))
    lanes = metrics[2]
    assert lanes["profile_host_update_s"] >= 0.2 * 4 * 0.9  # its own four host parts' updates
    assert lanes["profile_h2d_s"] < 0.2, lanes  # not the step before's
    assert lanes["profile_serialized_s"] < lanes["profile_host_update_s"] + 0.6, lanes


def test_split_update_second_half_failure_is_not_lost():
    """An error in a second half (a gate, the kernel) stops training instead of being dropped when the
    next step queues its own second halves."""
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    assert engine.policy.opt.splits
    calls = []

    def flaky_gate(part):
        calls.append(part)
        if part == PartId.block(1) and calls.count(part) == 1:
            raise RuntimeError("gate failed once")
    engine.hold_updates(flaky_gate)
    batches = make_batches(4)
    with pytest.raises(RuntimeError, match="gate failed once"):
        for b in batches:
            engine.step(b)
        engine.sync()


class _InterruptAfter:
    """An observer that raises KeyboardInterrupt once ``op`` has been dispatched (as Ctrl-C would)."""

    def __init__(self, op):
        self.op = op

    def on_op(self, op, start, end, out):
        if op == self.op:
            raise KeyboardInterrupt

    def on_task(self, key, start, end):
        pass


def test_split_update_step_cut_short_still_commits_what_it_started():
    """A step interrupted between the first halves leaves masters, moments and bf16 copies consistent."""
    from megatrain_jax.engine.schedule import Op
    engine = Engine(Decoder(TINY3.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), FUSED())
    good, bad = make_batches(2)
    engine.step(good)
    stop = _InterruptAfter(Op("update", PartId.block(0)))
    engine.observe(stop)
    with pytest.raises(KeyboardInterrupt):
        engine.step(bad)
    engine.stop_observing(stop)
    assert not engine.policy.commits_pending
    engine.sync()
    assert_stream_copies_track_masters(engine)
    counts = [int(np.asarray(p.opt.count)) for p in engine.state.parts]
    assert counts == [2, 2, 1, 1], counts  # io and block 0 took the second step; blocks 1, 2 did not


def test_engine_with_a_chunked_mlp_equals_reference():
    """The model's sequence-chunked MLP (rematerialized per chunk) streams like any block."""
    run_both(TINY3.replace(mlp_chunk_tokens=24), ADAMW, EngineConfig(micro_batches=2))


@pytest.mark.parametrize("offload,depth", [(2, 1), (3, 1), (1, 2)])
def test_offloaded_activations_equal_reference(offload, depth):
    """Block inputs through pinned host memory between forward and backward: the same training."""
    run_both(TINY3, ADAMW, EngineConfig(micro_batches=2, clip_norm=0.05, prefetch_depth=depth,
                                        offload_activations=offload), batch_kw=dict(packed=True), shared=True)


def test_offload_of_more_blocks_than_the_model_has_is_refused():
    with pytest.raises(ValueError, match="offload_activations=4 exceeds the model's 3 blocks"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(offload_activations=4))


def test_offloaded_activations_wait_in_pinned_host_memory():
    seen = {}

    class Watch:
        def on_op(self, op, start, end, out):
            if op.kind in ("store_acts", "load_acts"):
                seen.setdefault(op.kind, []).extend(x.sharding.memory_kind for x in jax.tree.leaves(out))

        def on_task(self, *a, **k):
            pass

    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(micro_batches=2, offload_activations=2,
                                                                            prefetch_depth=1))
    engine.observe(Watch())
    engine.step(make_batches(1, vocab=TINY3.vocab_size)).resolve()
    assert seen == {"store_acts": ["pinned_host"] * 4, "load_acts": ["device"] * 4}  # 2 blocks x 2 micro-batches


# ---------------------------------------------------------------------------------------------- norm_first
@pytest.mark.parametrize("tx,engine_cfg", [
    (ADAMW, EngineConfig(norm_first=True, clip_norm=0.05)),
    (SGD, EngineConfig(norm_first=True, clip_norm=0.05, micro_batches=2)),
    (FUSED, EngineConfig(norm_first=True, clip_norm=0.05, prefetch_depth=2)),
    (FUSED, EngineConfig(norm_first=True, resident_layers=1, resident_io=True, clip_norm=0.05)),
    (FUSED, EngineConfig(norm_first=True, micro_batches=2, offload_activations=2, clip_norm=0.05)),
    (ADAMW, EngineConfig(norm_first=True, kept_layers=2, keep_residuals=True, offload_activations=1,
                         clip_norm=0.05)),
], ids=["adamw-clip", "sgd-micro", "fused-depth2", "fused-resident", "fused-offload", "adamw-kept-offload"])
def test_norm_first_equals_reference(tx, engine_cfg):
    """A first pass takes the global norm, a second sends each gradient home and updates its part at once:
    the same training as the reference, whatever the optimizer route, micro-batches and resident parts, and
    with the second pass's backward reading the first's block inputs, kept residuals and products (offloaded
    ones from host memory)."""
    engine = run_both(TINY3, tx, engine_cfg, shared=True)
    assert engine.policy.split == set()  # updates run whole as gradients come home


class _Kinds:
    """The ops a step runs, by kind."""

    def __init__(self):
        self.seen = collections.Counter()

    def on_op(self, op, start, end, out):
        self.seen[op.kind] += 1

    def on_task(self, *a, **k):
        pass


def test_norm_first_runs_one_forward_and_two_backwards():
    """The second pass takes the first's forward as it was: one forward a step, two heads and two backwards, the
    offloaded blocks' inputs brought back for each backward, and every block fetched three times but the last,
    which stays from the forward for the first backward."""
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(),
                    EngineConfig(norm_first=True, micro_batches=2, offload_activations=1, prefetch_depth=1))
    kinds = _Kinds()
    engine.observe(kinds)
    engine.step(make_batches(1, vocab=TINY3.vocab_size)).resolve()
    n, m = TINY3.layers, 2
    assert kinds.seen["forward"] == n * m and kinds.seen["embed"] == m
    assert kinds.seen["head"] == kinds.seen["embed_backward"] == 2 * m and kinds.seen["backward"] == 2 * n * m
    assert kinds.seen["store_acts"] == 1 and kinds.seen["load_acts"] == 2
    assert kinds.seen["fetch"] == 3 * n - 1 + 2  # the blocks in the forward and both backwards, io in each pass


@pytest.mark.parametrize("mode", [{}, dict(master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")],
                         ids=["full", "capacity-q8"])
def test_norm_first_trains_bitwise_as_one_pass(mode):
    """On this backend the second backward repeats the first bit for bit, so masters, moments and stream
    copies are exactly those of the one-pass step (updates in one pass there too), in full precision and in
    capacity mode with 8-bit moments (its stochastic rounding keyed by part and step, not by update order)."""
    one = _trained(EngineConfig(clip_norm=0.05, split_parts=0, **mode))
    two = _trained(EngineConfig(clip_norm=0.05, norm_first=True, **mode))
    for a, b in zip(jax.tree.leaves(one.state), jax.tree.leaves(two.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not mode:
        assert_stream_copies_track_masters(two)


class _Outstanding:
    """At each host part's ``update`` op: how many host updates are queued and not done, this one included."""

    def __init__(self):
        self.sent, self.futures, self.most = [], [], 0

    def on_op(self, op, start, end, out):
        if op.kind == "send_grads":
            self.sent.append(op.part)
        elif op.kind == "update" and hasattr(out, "done"):
            self.futures.append(out)
            self.most = max(self.most, sum(1 for f in self.futures if not f.done()))

    def on_task(self, *a, **k):
        pass


def test_norm_first_holds_few_gradients_at_a_time():
    """The host waits for the update queued UPDATES_AHEAD host parts before: with a slow host optimizer (a gate
    that sleeps before each update) at most UPDATES_AHEAD updates are outstanding once a part's is queued, so
    host memory holds at most UPDATES_AHEAD + 1 gradients (theirs, and the next part's on its way home)."""
    import time
    from megatrain_jax.engine.schedule import UPDATES_AHEAD
    engine = Engine(Decoder(preset("tiny", layers=6), rngs=nnx.Rngs(0)), FUSED(), EngineConfig(norm_first=True))
    watch = _Outstanding()
    engine.observe(watch)
    engine.hold_updates(lambda part: time.sleep(0.05))
    for batch in make_batches(2):
        engine.step(batch).resolve()
    engine.sync()
    assert watch.sent[:7] == [PartId.block(i) for i in reversed(range(6))] + [IO]
    assert watch.most == UPDATES_AHEAD, watch.most


def test_norm_first_skips_a_nonfinite_step():
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), FUSED(), EngineConfig(norm_first=True, max_nonfinite_steps=1))
    m, unchanged = poison_and_step(engine)
    assert m["skipped"] and engine.skipped_steps == 1 and unchanged


@pytest.mark.parametrize("settings,match", [(dict(norm_first=True, accumulate_steps=2), "accumulate_steps = 1"),
                                            (dict(norm_first=True, grads_on_gpu=1), "grads_on_gpu = 0"),
                                            (dict(norm_first="yes"), "true or false")])
def test_norm_first_refuses_what_it_cannot_run(settings, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**settings)


def test_a_bfloat16_gradients_squared_norm_is_its_float32_widenings_bit_for_bit():
    """XLA's CPU code sums a bfloat16 array converted inside the reduction in another order than a float32 one (on
    AVX-512 hosts): the engine's norm widens first there, so that the clipping of rounded gradients is their
    widening's."""
    import jax.numpy as jnp

    from megatrain_jax.engine.device_fns import _sq_norm
    sq_norm = jax.jit(_sq_norm)
    rng = np.random.default_rng(0)
    for n in (128 * 128, 128 * 512, 12288, 1000):
        for _ in range(4):
            g = jnp.asarray(rng.standard_normal(n, dtype=np.float32) * 0.01).astype(jnp.bfloat16)
            assert sq_norm({"w": g}) == sq_norm({"w": g.astype(jnp.float32)})


@pytest.mark.parametrize("kernel", [True, False], ids=["fused", "jax"])
def test_bfloat16_gradients_home_train_full_precision_bitwise_at_one_micro_batch(kernel):
    """Full precision with ``host_grad_dtype="bfloat16"``: with one micro-batch on one device each gradient is
    one backward's cotangent of the bfloat16 weights, which the float32 path only widens, so masters, moments
    and stream copies are bit for bit the float32 gradients' run's (the fused kernel's two passes, or the JAX
    update, and the norm read the bfloat16 gradient); with two micro-batches the sum is rounded, and the runs
    differ."""
    full = _trained(EngineConfig(clip_norm=0.05, host_kernel=kernel))
    half = _trained(EngineConfig(clip_norm=0.05, host_kernel=kernel, host_grad_dtype="bfloat16"))
    assert half.update_route == ("fused" if kernel else "host")
    assert half.policy.opt.splits == kernel  # the fused kernel splits its updates
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(half.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_stream_copies_track_masters(half)
    summed = [_trained(EngineConfig(clip_norm=0.05, micro_batches=2, host_kernel=kernel, host_grad_dtype=d))
              for d in ("float32", "bfloat16")]
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(summed[0].state), jax.tree.leaves(summed[1].state)))


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("layout", [dict(resident_layers=1, resident_io=True, gpu_updated_layers=1),
                                    dict(resident_layers=2, resident_io=True, norm_first=True)],
                         ids=["resident_and_visiting", "two_pass"])
def test_gradients_updated_on_the_device_in_bfloat16_train_as_those_sent_home(micro_batches, layout):
    """``device_grad_dtype="bfloat16"``: the gradients of the parts updated on the GPU (resident, or at their
    visit) are rounded once the step's sum is complete, as ``host_grad_dtype="bfloat16"`` rounds those sent
    home, and the norm is the rounded gradients': with both set, the run is bit for bit the run that streams
    every part and sends every gradient home in bfloat16 (the JAX update on both sides), with one micro-batch
    and with two, whose sum the rounding changes (against float32 gradients on the device)."""
    both = dict(clip_norm=0.05, micro_batches=micro_batches, host_kernel=False, host_grad_dtype="bfloat16")
    streamed = _trained(EngineConfig(**both))
    device = _trained(EngineConfig(**both, **layout, device_grad_dtype="bfloat16"))
    for a, b in zip(jax.tree.leaves(streamed.state), jax.tree.leaves(device.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if micro_batches > 1:
        wide = _trained(EngineConfig(**both, **layout))
        assert any(not np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(wide.state), jax.tree.leaves(device.state)))


def test_device_grad_dtype_refuses_other_dtypes():
    with pytest.raises(ValueError, match="device_grad_dtype must be 'float32' or 'bfloat16'"):
        EngineConfig(device_grad_dtype="float16")


def test_programs_compile_products_on_cublas_unless_xla_flags_say(monkeypatch):
    """The per-part programs ask XLA for cuBLAS products (Triton's emitter off); a setting of that flag in
    XLA_FLAGS is left to win, and the latency-hiding scheduler is asked for only on several devices."""
    from megatrain_jax.engine.device_fns import compiler_options

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert compiler_options(1) == {"xla_gpu_enable_triton_gemm": False}
    assert compiler_options(2) == {"xla_gpu_enable_triton_gemm": False,
                                   "xla_gpu_enable_latency_hiding_scheduler": True}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x")
    assert compiler_options(1) == {}
    assert compiler_options(2) == {"xla_gpu_enable_latency_hiding_scheduler": True}
