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
