"""When each step's results were ready on the device, noted by a thread that waits for them: a step's time is the
gap between its results and the previous step's, whatever the host was doing when it read them.

``Engine.steps`` reads a step's results one step late, after launching the next; reading times instead (the gap
between two reads) is right in the steady state, but not at the ends: the last step's read waited for the end of
the run's work too (a 13B run's last step read 30.8 s against 5.4), and where launching a step blocks until
the step before is long done (a host-bound step), the last gap holds only the last step's tail (32B and 70B
runs reported more model FLOP/s than the GPU has on their last step)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import jax


class StepClock:
    """Note when each watched step's results are ready; ``seconds(step)``: its time. Close it when done."""

    def __init__(self, now: Callable[[], float] | None = None):
        self._now = now or time.perf_counter  # seconds (a test's own clock)
        self._start = self._now()
        self._ready: dict[int, float] = {}
        self._changed = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._watch, name="megatrain-step-clock", daemon=True)
        self._thread.start()

    def watch(self, step: int, results: Any) -> None:
        """Step ``step`` was launched: note when ``results`` (its arrays; the last it computes) are ready. The
        first step watched is timed from this clock's creation."""
        with self._changed:
            if not self._ready:
                self._ready[step - 1] = self._start
        self._queue.put((step, results))

    def seconds(self, step: int) -> float:
        """The time from the previous step's results to this step's (waits until the thread has seen them)."""
        with self._changed:
            self._changed.wait_for(lambda: step in self._ready)
            return self._ready[step] - self._ready[step - 1]

    def close(self) -> None:
        self._queue.put(None)

    def _watch(self) -> None:
        while (item := self._queue.get()) is not None:
            step, results = item
            try:
                jax.block_until_ready(results)
            except Exception:  # noqa: BLE001 - the step failed: the engine's own read raises it; time is noted
                pass
            with self._changed:
                self._ready[step] = self._now()
                self._changed.notify_all()
