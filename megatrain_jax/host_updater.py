"""Optimizer updates run on one worker thread, part by part, in submission order (forward order).

The main thread only waits before *fetching* a part whose update is still pending, so the next step's
forward on layer i proceeds while layer i+1 is being updated, and nothing in the layer loop waits on
the GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable


class HostUpdater:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-host-update")
        self._pending: dict[Hashable, list[Future]] = {}  # every unwaited task per key: none is forgotten
        self.timeline = None  # a megatrain_jax.timeline.Timeline records each task's start and end

    def submit(self, part: Hashable, fn: Callable[[], None]) -> None:
        """Queue ``fn`` under a key: ``part`` for what the next forward waits on (-1 the io part, i block i,
        -2 the step's check), ``("commit", part)`` for the second half of a split update."""
        timeline = self.timeline
        if timeline is not None:
            inner = fn

            def fn() -> None:
                start = time.perf_counter()
                try:
                    inner()
                finally:
                    timeline.task(part, start, time.perf_counter())
        futures = [f for f in self._pending.get(part, []) if not f.done() or f.exception() is not None]
        futures.append(self._pool.submit(fn))
        self._pending[part] = futures

    def wait(self, part: Hashable) -> None:
        """Block until every task under ``part`` is done; re-raises the first exception."""
        for fut in self._pending.pop(part, []):
            fut.result()

    def poll(self, part: Hashable) -> None:
        """Re-raise the exception of a finished task under ``part``; never blocks."""
        futures = self._pending.get(part, [])
        for fut in futures:
            if fut.done() and fut.exception() is not None:
                del self._pending[part]
                fut.result()
        self._pending[part] = [f for f in futures if not f.done()]
        if not self._pending[part]:
            del self._pending[part]

    def wait_all(self) -> None:
        for part in list(self._pending):
            self.wait(part)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
