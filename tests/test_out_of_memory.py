"""A step that runs out of GPU memory (issue 31), injected on the CPU at each phase of the step.

Before the update begins (forward, head, backward, the global norm) nothing of the step is applied: the
engine holds the state of the last whole step, ``fit`` reports that step's metrics, saves it with the data
before the failed step's batches, and a resumed run ends bit for bit where an uninterrupted one does; an
in-process retry of the step gives the same state as a run that never failed. Once the update began, the
error says so, nothing is saved over the last committed checkpoint, and resuming from it is exact too.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import (Batch, Decoder, DeviceOutOfMemoryError, Engine, EngineConfig, TrainConfig,
                           default_optimizer, fit, preset)
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.cli.commands import main
from megatrain_jax.data import DataConfig
from megatrain_jax.engine import passes

CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
ENGINE = EngineConfig(micro_batches=2)
XLA_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9013495808 bytes."


def data():
    return DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=0, demo_tokens=1 << 14).build(CFG.vocab_size)


def params_of(model) -> dict:
    return {k: np.asarray(v) for k, v in
            traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def run(steps: int, ckpt: Path | None = None, engine: EngineConfig = ENGINE, **train):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    h = fit(model, data(), default_optimizer(1e-3), engine=engine,
            train=TrainConfig(steps=steps, log_every=0, checkpoint_dir=None if ckpt is None else str(ckpt),
                              checkpoint_every=2, checkpoint_keep=10, **train))
    return params_of(model), h


def inject(monkeypatch, kind: str, during_step: int, nth: int = 0) -> list:
    """XLA's allocation failure, raised by the ``nth`` op of ``kind`` of optimizer step ``during_step`` (once)."""
    real, calls, raised = passes.HANDLERS[kind], [], []

    def failing(runner, p, op):
        if runner.state.step == during_step - 1 and not raised:
            calls.append(op)
            if len(calls) > nth:
                raised.append(op)
                raise jax.errors.JaxRuntimeError(XLA_OOM)
        return real(runner, p, op)
    monkeypatch.setitem(passes.HANDLERS, kind, failing)
    return raised


def train_args(run_dir: Path, steps: int) -> list[str]:
    """``megatrain-jax train`` of CFG's shape into ``run_dir``, checkpointing every 10 steps."""
    return ["train", "model.preset=tiny", "model.layers=2", "model.hidden=32", "model.ffn=64", "model.heads=2",
            "model.kv_heads=1", "data.seq_len=16", "data.batch_size=4", f"train.steps={steps}", "train.eval_every=0",
            "train.checkpoint_every=10", f"train.run_dir={run_dir}"]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted 6-step run."""
    return run(6)


@pytest.mark.parametrize("kind,nth,phase", [("forward", 1, "the forward"), ("head", 1, "the head"),
                                            ("backward", 2, "the backward"), ("grad_norm", 0, "the global norm")])
def test_before_the_update_the_last_whole_step_is_saved_and_resumes_exactly(tmp_path, monkeypatch, reference,
                                                                            kind, nth, phase):
    raised = inject(monkeypatch, kind, during_step=4, nth=nth)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        run(6, tmp_path)
    err = info.value
    assert raised and (err.updated, err.step, err.phase, err.requested) == (False, 3, phase, 9013495808)
    notes = "\n".join(err.__notes__)
    assert "before any part was updated: the state is that of step 3" in notes
    assert f"saved to {tmp_path / '3'}" in notes
    # step 3's metrics arrived with the failure of step 4 and were reported, then step 3 was saved
    assert err.history["step"] == [1, 2, 3] and err.history["loss"] == reference[1]["loss"][:3]
    assert committed_steps(tmp_path) == [3, 2]
    monkeypatch.undo()
    params, h = run(6, tmp_path, resume=True)  # trains step 4 (its batches were not counted as read) to 6
    assert h["step"] == [4, 5, 6] and h["loss"] == reference[1]["loss"][3:]
    assert_same(params, reference[0])


def test_after_the_update_began_nothing_is_saved_over_the_last_checkpoint(tmp_path, monkeypatch, reference):
    raised = inject(monkeypatch, "update", during_step=4, nth=1)  # io updated, block 0's update fails
    with pytest.raises(DeviceOutOfMemoryError) as info:
        run(6, tmp_path)
    err = info.value
    assert raised and err.updated and err.phase == "the update"
    notes = "\n".join(err.__notes__)
    assert "after its update began" in notes and "nothing was written back or saved" in notes
    assert f"the last committed checkpoint is {tmp_path / '2'}" in notes
    assert committed_steps(tmp_path) == [2]
    monkeypatch.undo()
    params, h = run(6, tmp_path, resume=True)
    assert h["step"] == [3, 4, 5, 6] and h["loss"] == reference[1]["loss"][2:]
    assert_same(params, reference[0])


def test_without_checkpoints_the_model_gets_the_last_whole_step(monkeypatch, reference):
    inject(monkeypatch, "backward", during_step=3)
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(DeviceOutOfMemoryError) as info:
        fit(model, data(), default_optimizer(1e-3), engine=ENGINE, train=TrainConfig(steps=6, log_every=0))
    assert "the parameters after step 2 were written back to the model" in "\n".join(info.value.__notes__)
    monkeypatch.undo()
    two, _ = run(2)
    assert_same(params_of(model), two)


RESIDENT = EngineConfig(micro_batches=2, resident_layers=1, resident_io=True, accumulate_steps=2)


def retry_batches() -> list[Batch]:
    rng = np.random.default_rng(0)
    return [Batch.from_windows(rng.integers(0, CFG.vocab_size, (4, 17))) for _ in range(6)]


def retry_engine(engine_cfg: EngineConfig) -> Engine:
    return Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3), engine_cfg)


def arrays(e: Engine) -> dict:
    e.sync()
    return {jax.tree_util.keystr(p): np.array(v) for p, v in
            jax.tree_util.tree_flatten_with_path([(part.params, part.opt) for part in e.state.parts])[0]}


@functools.cache
def never_failed(engine_cfg: EngineConfig) -> dict:
    """The state after every batch of ``retry_batches``, trained without a failure (once per layout)."""
    clean, batches, group = retry_engine(engine_cfg), retry_batches(), engine_cfg.accumulate_steps
    for i in range(0, len(batches), group):
        clean.step(batches[i:i + group]).resolve()
    return arrays(clean)


@pytest.mark.parametrize("engine_cfg", [ENGINE, RESIDENT], ids=["streamed", "resident-accumulating"])
@pytest.mark.parametrize("kind,nth", [("forward", 1), ("head", 1), ("backward", 2), ("send_grads", 1),
                                      ("grad_norm", 0)])
def test_an_in_process_retry_equals_a_run_that_never_failed(monkeypatch, engine_cfg, kind, nth):
    """The engine after the failure holds the last whole step; running the step again gives the state of an
    engine that never failed (partial gradients and norms of the failed step are forgotten)."""
    batches, group = retry_batches(), engine_cfg.accumulate_steps
    failing, want = retry_engine(engine_cfg), never_failed(engine_cfg)  # the clean run, before the injection
    raised = inject(monkeypatch, kind, during_step=2, nth=nth)
    failing.step(batches[:group]).resolve()
    before = arrays(failing)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        failing.step(batches[group:2 * group])
    assert raised and not info.value.updated and info.value.step == 1
    assert_same(arrays(failing), before)  # nothing of the failed step was applied
    for i in range(group, len(batches), group):  # the retry, then the rest
        failing.step(batches[i:i + group]).resolve()
    assert_same(arrays(failing), want)


def test_other_runtime_errors_are_not_taken_for_out_of_memory(monkeypatch):
    def broken(runner, p, op):
        raise jax.errors.JaxRuntimeError("INTERNAL: cuDNN failed")
    monkeypatch.setitem(passes.HANDLERS, "forward", broken)
    e = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3), ENGINE)
    with pytest.raises(jax.errors.JaxRuntimeError, match="cuDNN failed") as info:
        e.step(Batch.from_windows(np.zeros((4, 17), np.int32)))
    assert not isinstance(info.value, DeviceOutOfMemoryError)


def test_the_command_line_exits_4_saying_where_the_run_goes_on(tmp_path, monkeypatch, capsys):
    inject(monkeypatch, "head", during_step=3)
    args = train_args(tmp_path, 5)
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "out of device memory in head(0) (the head)" in err and "RESOURCE_EXHAUSTED" in err
    assert "train.resume=true continues from step 2" in err
    assert committed_steps(tmp_path / "checkpoints") == [2]
    monkeypatch.undo()
    assert main([*args, "train.resume=true"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]


def test_the_advice_replans_for_less_gpu_memory():
    from megatrain_jax.cli.run import _out_of_memory_advice
    from megatrain_jax.plan import GiB, options, plan
    p = plan(preset("7b", layers=16), EngineConfig(micro_batches=2, resident_layers=8, resident_io=True), 16, 2048,
             host_ram_bytes=125 * GiB, gpu_bytes=60 * GiB, detect=False)
    assert p.fits
    err = DeviceOutOfMemoryError("x", op="backward(block_00003, 1)", phase="the backward", updated=False, step=7,
                                 requested=int(p.gpu_available - p.gpu_total) + 4 * GiB)
    text = _out_of_memory_advice(p, err)
    assert "train.resume=true continues from step 7" in text and "re-planned for" in text
    smaller = p.replace(gpu_bytes=p.gpu_available - err.requested)
    assert not smaller.fits
    offered = options(smaller)
    assert offered and text.splitlines()[1:] == [f"  - {o}" for o in offered]
    assert all(smaller.applied(o.changes).fits for o in offered)
    assert "keeps no checkpoints" in _out_of_memory_advice(p, err, checkpoints=False)


# XLA's words when its pinned host pool (what crosses PCIe) is full, as a 7B run capped at 32 GiB met them
# (experiments/results/h100_pool_cap_32_h100_7b_32k.json)
HOST_POOL_OOM = ("RESOURCE_EXHAUSTED: Out of host memory while trying to allocate 64.00MiB with allocator "
                 "xla_gpu_host_bfc on device 0.")


def test_a_full_pinned_host_pool_is_named_and_the_advice_is_its_cap(tmp_path, monkeypatch, capsys):
    """Not the GPU's memory: the message names XLA's pinned host pool, and the advice is a higher cap (the one in
    force, +4 GiB; the user's own cap may also be unset), not a GPU layout."""
    monkeypatch.setitem(globals(), "XLA_OOM", HOST_POOL_OOM)  # what inject raises
    inject(monkeypatch, "backward", during_step=2)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "32")  # train may fit it again (JAX not started yet)
    monkeypatch.setenv("MEGATRAIN_HOST_RAM_GIB", "512")  # room for a higher cap, whatever this machine has
    args = train_args(tmp_path, 3)
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "out of pinned host memory in backward(" in err and "ran out of XLA's pinned host memory" in err
    cap = int(re.search(r"XLA's pinned host pool ran out: it is capped at (\d+) GiB", err).group(1))
    assert f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={cap + 4}" in err and "device memory" not in err


def test_a_full_pinned_host_pool_says_what_is_live_in_pinned_memory():
    """The error of a full pinned pool counts the live arrays in pinned host memory (total, and the largest
    groups by dtype and shape), so that what outgrew the plan's count shows; a GPU memory error does not."""
    from megatrain_jax.engine.out_of_memory import pinned_census
    from megatrain_jax.engine.transfer import Placement, select_devices
    pl = Placement(select_devices(1))
    before = pinned_census()  # "none" where no earlier test left pinned arrays alive (run alone, or first)
    total_before = 0.0 if before == "live pinned arrays: none" else float(
        re.search(r"([\d.]+) GiB in (\d+)", before).group(1))
    held = [pl.to_host(jax.numpy.zeros((1024, 512), jax.numpy.float32)) for _ in range(3)]  # 3 x 2 MiB
    jax.block_until_ready(held)
    said = pinned_census()
    total, count = re.search(r"([\d.]+) GiB in (\d+)", said).groups()
    assert float(total) == pytest.approx(total_before + 3 * 2 / 1024, abs=0.01)
    assert "3 x float32[1024, 512] 0.01 GiB" in said
    err = DeviceOutOfMemoryError.of(RuntimeError(HOST_POOL_OOM), "visit(block_00003)", op="visit", phase="forward",
                                    updated=False)
    assert err.host_pool and "live pinned arrays:" in str(err) and "float32[1024, 512]" in str(err)
    assert "live pinned arrays" not in str(DeviceOutOfMemoryError.of(RuntimeError(XLA_OOM), "backward", op="b",
                                                                       phase="backward", updated=False))
    del held


def test_the_census_counts_the_failed_passs_own_pinned_arrays(monkeypatch):
    """Offloaded activations are the pass's own pinned arrays: the census is taken before the failed pass lets
    go of them, so a pool that they filled shows them (here the inputs of blocks 0 and 1, [2, 512, 32] for each
    micro-batch, still in host memory at the first backward)."""
    monkeypatch.setitem(globals(), "XLA_OOM", HOST_POOL_OOM)
    inject(monkeypatch, "backward", during_step=2)
    cfg = CFG.replace(layers=4)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, default_optimizer(1e-3), EngineConfig(micro_batches=2, offload_activations=3,
                                                                 prefetch_depth=1))
    rng = np.random.default_rng(0)
    batches = [Batch.from_windows(rng.integers(0, cfg.vocab_size, (4, 513))) for _ in range(2)]  # the largest group
    engine.step(batches[0]).resolve()
    with pytest.raises(DeviceOutOfMemoryError) as caught:
        engine.step(batches[1]).resolve()
    said = str(caught.value)
    assert caught.value.host_pool and "live pinned arrays" in said
    assert f"x {cfg.dtype}[2, 512, 32]" in said, said[-400:]
    engine.close()


def test_the_pinned_host_pool_advice_says_who_set_the_cap(monkeypatch):
    from megatrain_jax import _environment
    from megatrain_jax.cli.run import _out_of_memory_advice
    from megatrain_jax.plan import GiB, fitted_pool_limit, plan
    p = plan(preset("7b", layers=16), EngineConfig(micro_batches=2, resident_layers=8, resident_io=True), 16, 2048,
             host_ram_bytes=125 * GiB, gpu_bytes=60 * GiB, detect=False)
    err = DeviceOutOfMemoryError("x", op="send_grads(block_00008)", phase="the backward", updated=False, step=0,
                                 requested=64 * 2**20, host_pool=True)
    monkeypatch.setattr(_environment, "_USER_LIMIT", None)  # as megatrain-jax train sets it: the plan's fitted cap
    fitted = fitted_pool_limit(p.host_pinned, p.host_available) // GiB
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(fitted))
    text = _out_of_memory_advice(p, err)
    assert f"capped at {fitted} GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, set by megatrain-jax train from the plan's" in text
    assert f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={fitted + 4}" in text and "unset it" not in text
    assert "train.resume=true continues from step 0" in text and "re-planned" not in text
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "112")  # import's 90% of RAM: JAX started before train
    text = _out_of_memory_advice(p, err)
    assert "set when megatrain_jax was imported" in text and "LIMIT_GB=116" in text
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "124")  # +4 GiB would pass the host's 125: not offered
    text = _out_of_memory_advice(p, err)
    assert "LIMIT_GB=128" not in text and "a layout that pins less" in text
    monkeypatch.setattr(_environment, "_USER_LIMIT", "18")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "18")
    assert "set by you" in _out_of_memory_advice(p, err) and "unset it" in _out_of_memory_advice(p, err)


def test_a_failure_reported_late_is_not_taken_for_a_whole_state(tmp_path, monkeypatch, reference):
    """Device work that fails after its dispatch reaches the host when it next waits (here: the step's
    decision, read by the update worker): which step failed is unknown, so nothing is saved over the last
    checkpoint and the error says so."""
    from megatrain_jax.engine.update import policy
    real, seen = policy.local_array, []

    class Failed:  # the host's copy of a verdict whose device work failed: reading it raises
        def __array__(self, *args, **kwargs):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.39GiB "
                                             "with allocator GPU_0_bfc on device 0. [executable_name='jit__lambda']")

    def local_array(x):  # the third step's verdict (``ok``, the decision's boolean) is such a copy
        if np.dtype(x.dtype) == np.bool_:
            seen.append(x)
            if len(seen) == 3:
                return Failed()
        return real(x)
    monkeypatch.setattr(policy, "local_array", local_array)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        run(6, tmp_path)
    err = info.value
    assert err.updated and err.phase == "the GPU's queued work" and err.requested == int(8.39 * 2**30)
    assert "nothing was written back or saved" in "\n".join(err.__notes__)
    assert committed_steps(tmp_path) == [2]
    monkeypatch.undo()
    params, h = run(6, tmp_path, resume=True)
    assert h["step"] == [3, 4, 5, 6] and h["loss"] == reference[1]["loss"][2:]
    assert_same(params, reference[0])


def test_a_visit_that_fails_running_the_step_befores_update_says_the_update_began(monkeypatch):
    """A part updated on the GPU (here the io part, ``gpu_updated_io``) runs the step before's update at the next
    forward's visit: an allocation failure there leaves that part a step behind the others, so the error says the
    update had begun (nothing is whole) instead of offering the state as the last step's. A visit with nothing
    pending (the first step) fails as any fetch does: the state is whole."""
    engine = retry_engine(EngineConfig(micro_batches=2, gpu_updated_io=True))
    batches = retry_batches()

    def fail(*args, **kw):
        raise jax.errors.JaxRuntimeError(XLA_OOM)

    first = inject(monkeypatch, "visit", during_step=1)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        engine.step(batches[:1])
    assert first and not info.value.updated
    monkeypatch.setitem(passes.HANDLERS, "visit", passes.PassRunner.visit)
    engine.step(batches[:1]).resolve()
    monkeypatch.setattr(engine.policy, "update_visiting", fail)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        engine.step(batches[1:2])
    assert info.value.updated and "visit(io)" in str(info.value)
