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
        self._pending: dict[Hashable, Future] = {}
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
        self._pending[part] = self._pool.submit(fn)

    def wait(self, part: Hashable) -> None:
        """Block until ``part``'s latest update is done; re-raises its exception."""
        fut = self._pending.pop(part, None)
        if fut is not None:
            fut.result()

    def poll(self, part: Hashable) -> None:
        """Re-raise ``part``'s exception if its task has already failed; never blocks."""
        fut = self._pending.get(part)
        if fut is not None and fut.done():
            del self._pending[part]
            fut.result()

    def wait_all(self) -> None:
        for part in list(self._pending):
            self.wait(part)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
