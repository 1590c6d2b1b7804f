"""Observers of a running engine: they see every op as it is dispatched and every host-worker task, and
change nothing. ``Engine.observe(observer)`` adds one; ``Engine.stop_observing(observer)`` removes it.

An observer has ``on_op(op, start, end, out)`` (the main thread's time in the op and what the op
produced: device arrays, or futures of host-worker tasks) and ``on_task(key, start, end)`` (a host-worker
task, on the worker thread). ``Profile`` times op categories; ``megatrain_jax.engine.timeline.Timeline`` records
when ops ran without synchronizing.
"""

from __future__ import annotations

import time
from typing import Any, Hashable, Protocol

from megatrain_jax.engine.passes import CATEGORY, block_until_done
from megatrain_jax.engine.schedule import Op


class Observer(Protocol):
    def on_op(self, op: Op, start: float, end: float, out: Any) -> None: ...

    def on_task(self, key: Hashable, start: float, end: float) -> None: ...


class Profile:
    """Seconds per op category (``h2d``, ``compute``, ``d2h``, ``optimizer``), each op waited for before
    the next is dispatched: every category's own time, at the price of a serialized (slower) step. Also each
    part's ``update`` and ``fetch`` seconds (``update_seconds``, ``fetch_seconds``): a GPU-resident part's update
    is device work, a host part's the host optimizer's; a resident part's fetch is device work too (the cast of
    its compute copy where it keeps none), a host part's a copy over PCIe; and the GPU-updated parts' visits
    (``visit_seconds``: their update on the device, waited for; the copies home that follow are not)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.update_seconds: dict[Any, float] = {}
        self.fetch_seconds: dict[Any, float] = {}
        self.visit_seconds = 0.0

    def on_op(self, op: Op, start: float, end: float, out: Any) -> None:
        category = CATEGORY[op.kind]
        if category == "none":
            return
        block_until_done(out)
        took = time.perf_counter() - start
        self.seconds[category] = self.seconds.get(category, 0.0) + took
        if op.kind in ("update", "fetch"):
            per_part = self.update_seconds if op.kind == "update" else self.fetch_seconds
            per_part[op.part] = per_part.get(op.part, 0.0) + took
        elif op.kind == "visit":
            self.visit_seconds += took

    def on_task(self, key: Hashable, start: float, end: float) -> None:
        pass

    def lanes(self, resident_parts) -> dict[str, float]:
        """The serialized step's seconds per lane of the step-time model (``plan.step_time``'s busy queues):
        ``compute`` (the GPU's programs, with the resident parts' casts), ``h2d`` and ``d2h`` (PCIe each way), ``host_update`` (the host-updated
        parts' update and commit) and ``device_update`` (the GPU-resident parts' update and the GPU-updated parts'
        visits, device work)."""
        device_update = sum(self.update_seconds.get(part, 0.0) for part in resident_parts)
        casts = sum(self.fetch_seconds.get(part, 0.0) for part in resident_parts)
        return {"compute": max(self.seconds.get("compute", 0.0) + casts - self.visit_seconds, 0.0),
                "h2d": max(self.seconds.get("h2d", 0.0) - casts, 0.0),
                "d2h": self.seconds.get("d2h", 0.0),
                "host_update": max(self.seconds.get("optimizer", 0.0) - device_update, 0.0),
                "device_update": device_update + self.visit_seconds}
