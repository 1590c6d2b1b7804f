"""The host worker: optimizer updates run on one thread, one task at a time, in submission order.

That first-in-first-out order is what the update policy (``megatrain_jax.engine.update.policy``) builds on; it
is a property of this class, not an accident of scheduling. The main thread only waits before *fetching*
a part whose update is still pending, so the next step's forward on layer i proceeds while layer i+1 is
being updated, and nothing in the layer loop waits on the GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Sequence


class HostUpdater:
    """One worker thread; tasks are queued under a key that callers wait on or poll for errors.
    ``observers`` (shared with the engine) get ``on_task(key, start, end)`` for each task."""

    def __init__(self, observers: Sequence = ()) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-host-update")
        self._pending: dict[Hashable, list[Future]] = {}  # every unwaited task per key: none is forgotten
        self._observers = observers

    def submit(self, key: Hashable, fn: Callable[[], object]) -> Future:
        """Queue ``fn`` after every task submitted before it."""
        observers = list(self._observers)
        if observers:
            inner = fn

            def fn() -> object:
                start = time.perf_counter()
                try:
                    return inner()
                finally:
                    for o in observers:
                        o.on_task(key, start, time.perf_counter())
        future = self._pool.submit(fn)
        futures = [f for f in self._pending.get(key, []) if not f.done() or f.exception() is not None]
        self._pending[key] = futures + [future]
        return future

    def wait(self, key: Hashable) -> None:
        """Block until every task under ``key`` is done; re-raises the first exception."""
        for fut in self._pending.pop(key, []):
            fut.result()

    def poll(self, key: Hashable) -> None:
        """Re-raise the exception of a finished task under ``key``; never blocks. Other tasks under the key
        stay pending (a second failure is raised by a later poll or wait)."""
        futures = self._pending.pop(key, [])
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        rest = [f for f in futures if f is not failed and not (f.done() and f.exception() is None)]
        if rest:
            self._pending[key] = rest
        if failed is not None:
            failed.result()

    def wait_all(self) -> None:
        for key in list(self._pending):
            self.wait(key)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
