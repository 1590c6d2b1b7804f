"""A step's reported time: the gap between its results and the previous step's on the device
(``engine.step_clock.StepClock``), not between the host's reads of them."""

from __future__ import annotations

import threading
import time

import numpy as np
from flax import nnx

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, adamw
from megatrain_jax.engine.step_clock import StepClock


class Result:
    """A step's results, ready when the test says."""

    def __init__(self):
        self.ready = threading.Event()

    def block_until_ready(self):
        self.ready.wait()
        return self


def test_each_step_is_timed_from_the_previous_steps_results_however_late_they_are_read():
    now = [0.0]
    clock = StepClock(now=lambda: now[0])
    first, second, third = Result(), Result(), Result()
    for step, result in ((4, first), (5, second), (6, third)):  # launched together (the host ran ahead)
        clock.watch(step, result)
    now[0] = 7.0
    first.ready.set()
    assert clock.seconds(4) == 7.0  # from the clock's start: the first step watched
    now[0] = 9.5
    second.ready.set()
    assert clock.seconds(5) == 2.5
    now[0] = 100.0  # read again late, the host busy meanwhile: the same time
    assert clock.seconds(5) == 2.5
    third.ready.set()
    assert clock.seconds(6) == 100.0 - 9.5
    clock.close()


def test_the_last_steps_time_leaves_out_the_parts_coming_home(tiny_cfg, monkeypatch):
    """``steps`` ends with ``sync`` (the GPU-resident parts come home): that is not the last step's work. Here the
    sync takes 1,000 s of a shifted clock; no step may report it."""
    shift = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + shift[0])
    engine = Engine(Decoder(tiny_cfg, rngs=nnx.Rngs(0)), adamw(1e-3), EngineConfig(resident_layers=1))
    sync = engine.sync

    def slow_sync():
        shift[0] += 1000.0
        sync()
    monkeypatch.setattr(engine, "sync", slow_sync)
    rng = np.random.default_rng(0)
    batches = [Batch.from_windows(rng.integers(0, tiny_cfg.vocab_size, (2, 9))) for _ in range(3)]
    metrics = list(engine.steps(batches))
    assert [m["step"] for m in metrics] == [1, 2, 3] and shift[0] == 1000.0
    assert all(0 < m["step_time_s"] < 1000.0 for m in metrics), [m["step_time_s"] for m in metrics]


# The dense bfloat16 peak of an H100 SXM and of an H200, in TFLOP/s: no step can do more model work than that.
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
STEP_CLOCK_SINCE = "2026-11-29"  # c44873b: before it the last step of a run could read shorter than its work


def _per_step_model_tflops(run: dict) -> list[float]:
    """Each step's model TFLOP/s of a results file's run: its median figure scaled by the median step over that
    step's time (the steps of a run do the same work)."""
    steps = run.get("step_times") or run.get("step_times_s") or []
    return [run["model_tflops"] * run["step_time_s"] / t for t in steps if t > 0]


def test_no_committed_step_does_more_model_work_than_the_gpu_can():
    """Every step of every run committed on an H100 or H200 since the step clock (each step timed from the
    previous step's results on the device) reads at most the GPU's dense bfloat16 peak; before it, the last step
    of a run could read up to 2.6x the peak (the H100 98K rows of 2026-11-22)."""
    import json
    from pathlib import Path
    checked, over = 0, []
    for path in sorted((Path(__file__).resolve().parents[1] / "experiments" / "results").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(record, dict) or str(record.get("date", "")) < STEP_CLOCK_SINCE:
            continue
        gpu = next((k for k in GPU_PEAK_TFLOPS if k in str((record.get("device") or {}).get("name", ""))), None)
        for run in record.get("runs") if gpu and isinstance(record.get("runs"), list) else []:
            if not isinstance(run, dict) or run.get("system") not in (None, "megatrain_jax"):
                continue
            if not (run.get("model_tflops") and run.get("step_time_s")):
                continue
            checked += 1
            worst = max(_per_step_model_tflops(run), default=0.0)
            if worst > GPU_PEAK_TFLOPS[gpu]:
                over.append((path.name, run.get("config"), round(worst)))
    assert checked >= 10 and not over, (checked, over)
    # the check sees the fault it guards against: a 98K run of 2026-11-22, whose last step read 2.6x the peak
    old = json.loads((path.parent / "h100_3p5b_98k_vs_zero3_v4.json").read_text())
    ours = next(r for r in old["runs"] if r.get("system") == "megatrain_jax" and r.get("config") == "3p5b_98k")
    assert max(_per_step_model_tflops(ours)) > 2 * GPU_PEAK_TFLOPS["H100"]
