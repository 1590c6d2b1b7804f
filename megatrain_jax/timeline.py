"""A timeline of one or more steps, for finding where the GPU waits (diagnosis, not metrics).

Three kinds of events, in seconds since the timeline started:
- ``host``: the main thread's time inside each op (dispatch, plus any wait: a fetch waits on the host
  optimizer);
- ``ready``: when an op's output became ready on the device. One watcher thread per kind (compute,
  host-to-device, device-to-host) blocks on the outputs in issue order, so the main thread never syncs;
  on one in-order stream the gaps between consecutive ``ready`` times bound each op's device time plus
  any wait before it;
- ``task``: start and end of each host-optimizer task on the update thread.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Hashable

import jax

# Ops whose outputs are watched, by stream: each watcher blocks in issue order within its own kind.
STREAMS = {"compute": {"embed", "forward", "head", "backward", "embed_backward", "grad_norm", "update", "update_io"},
           "h2d": {"fetch", "fetch_io"}, "d2h": {"send_grads", "send_io_grads"}}


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

    def op(self, kind: str, layer: int, micro: int, start: float, end: float, out: Any) -> None:
        self._add(ev="host", kind=kind, layer=layer, micro=micro, start=round(start - self.t0, 5),
                  end=round(end - self.t0, 5))
        if out is None:
            return
        for name, kinds in STREAMS.items():
            if kind in kinds:
                self._queues[name].put((kind, layer, micro, out))

    def task(self, key: Hashable, start: float, end: float) -> None:
        self._add(ev="task", key=str(key), start=round(start - self.t0, 5), end=round(end - self.t0, 5))

    def mark(self, name: str) -> None:
        self._add(ev="mark", kind=name, at=self._now())

    def _watch(self, outputs: queue.Queue) -> None:
        while True:
            item = outputs.get()
            if item is None:
                return
            kind, layer, micro, out = item
            try:
                jax.block_until_ready(out)
                self._add(ev="ready", kind=kind, layer=layer, micro=micro, at=self._now())
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
