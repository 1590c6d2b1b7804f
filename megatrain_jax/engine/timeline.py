"""A timeline of one or more steps, for finding where the GPU waits (diagnosis, not metrics).

Three kinds of events, in seconds since the timeline started:
- ``host``: the main thread's time inside each op (dispatch, plus any wait: a fetch waits on the host
  optimizer);
- ``ready``: when an op's output became ready on the device. One watcher thread per kind (compute,
  host-to-device, device-to-host) blocks on the outputs in issue order, so the main thread never syncs;
  on one in-order stream the gaps between consecutive ``ready`` times bound each op's device time plus
  any wait before it;
- ``task``: start and end of each host-optimizer task on the update thread.

It is an engine observer (``megatrain_jax.engine.observers``): ``engine.observe(Timeline())``.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable

import jax

from megatrain_jax.engine.passes import CATEGORY
from megatrain_jax.engine.schedule import Op

# Outputs are watched by category: each watcher blocks in issue order within its own. Host-worker
# updates are recorded as tasks instead.
STREAMS = ("compute", "h2d", "d2h", "optimizer")


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._queues = {name: queue.Queue() for name in STREAMS}
        self._watchers = [threading.Thread(target=self._watch, args=(q,), name=f"megatrain-timeline-{n}", daemon=True)
                          for n, q in self._queues.items()]
        for w in self._watchers:
            w.start()

    def _add(self, **event: Any) -> None:
        with self._lock:
            self.events.append(event)

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 5)

    def on_op(self, op: Op, start: float, end: float, out: Any) -> None:
        part = None if op.part is None else str(op.part)
        self._add(ev="host", kind=op.kind, part=part, micro=op.micro, start=round(start - self.t0, 5),
                  end=round(end - self.t0, 5))
        stream = CATEGORY[op.kind]
        if out is not None and stream in self._queues and not isinstance(out, (Future, list)):  # host tasks: on_task
            self._queues[stream].put((op.kind, part, op.micro, out))

    def on_task(self, key: Hashable, start: float, end: float) -> None:
        self._add(ev="task", key=str(key), start=round(start - self.t0, 5), end=round(end - self.t0, 5))

    def mark(self, name: str) -> None:
        self._add(ev="mark", kind=name, at=self._now())

    def _watch(self, outputs: queue.Queue) -> None:
        while True:
            item = outputs.get()
            if item is None:
                return
            kind, part, micro, out = item
            try:
                jax.block_until_ready(out)
                self._add(ev="ready", kind=kind, part=part, micro=micro, at=self._now())
            except Exception:  # donated to a later op before we looked (an accumulator): no event
                pass
            del item, out  # hold no device buffer past its release

    def close(self) -> list[dict[str, Any]]:
        """Wait for the watcher to see every output; return the events sorted by time."""
        for q in self._queues.values():
            q.put(None)
        for w in self._watchers:
            w.join()
        return sorted(self.events, key=lambda e: e.get("start", e.get("at", 0.0)))
