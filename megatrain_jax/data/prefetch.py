"""Read-ahead for any batch iterator: the next items are produced on a daemon thread while the consumer
(the training loop) works, and ``state()`` stays that of the last item handed out, so checkpoints taken
with read-ahead in flight still resume at the right batch."""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator


class Prefetcher:
    """Produces the next ``n`` items of ``iterator`` on a daemon thread while the consumer works.

    Exceptions raised by the producer re-raise in the consumer at the point they occurred in the stream.
    ``state()`` (when the wrapped iterator has one) is the state after the last item the *consumer*
    received, not after what the thread has read ahead, so checkpoints resume at the right batch.
    """

    _END = object()
    JOIN_S = 5.0  # how long ``close`` waits for the thread (a batch being read may take longer: ``restore`` waits on)

    def __init__(self, iterator: Iterator, n: int = 2):
        if n < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {n}")
        self._source, self._depth = iterator, n
        self._has_state = callable(getattr(iterator, "state", None))
        self._start()

    def _start(self) -> None:
        self._state = self._source.state() if self._has_state else None
        self._queue: queue.Queue = queue.Queue(maxsize=self._depth)
        self._stop, self._done = threading.Event(), False
        # the thread gets its own queue and stop event: one left from before a restore never feeds the new queue
        self._thread = threading.Thread(target=self._produce, args=(iter(self._source), self._queue, self._stop),
                                        name="megatrain-data-prefetch", daemon=True)
        self._thread.start()

    @property
    def endless(self) -> bool:
        """Whether the wrapped iterator says it never ends."""
        return bool(getattr(self._source, "endless", False))

    @property
    def producing(self) -> bool:
        """Whether the read-ahead thread is running (False once the stream ended or was closed)."""
        return self._thread.is_alive()

    @property
    def restorable(self) -> bool:
        """Whether ``restore`` works: the wrapped iterator has ``restore(state)``."""
        return callable(getattr(self._source, "restore", None))

    def resume_problem(self, state: dict) -> str | None:
        """The wrapped stream's ``resume_problem(state)``; None where it has none."""
        check = getattr(self._source, "resume_problem", None)
        return check(state) if callable(check) else None

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (a ``state()`` of this stream): the read-ahead is dropped, the wrapped
        iterator restored, and production restarts from there."""
        if not self.restorable:
            raise TypeError(f"{type(self._source).__name__} has no restore(state): this stream cannot be resumed")
        self.close()
        self._thread.join()  # however long the batch it is reading takes: the stream is not restored under it
        self._source.restore(state)
        self._start()

    def _produce(self, it: Iterator, out: queue.Queue, stop: threading.Event) -> None:
        try:
            for item in it:
                if not self._put((item, self._source.state() if self._has_state else None), out, stop):
                    return
            self._put(self._END, out, stop)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who decides
            self._put(e, out, stop)

    @staticmethod
    def _put(item: Any, out: queue.Queue, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:  # poll, so a close() from another thread cannot leave this call blocked forever
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._done or (not self._thread.is_alive() and self._queue.empty()):
                    self._done = True
                    raise StopIteration from None
        if item is self._END or isinstance(item, BaseException):
            self.close()
            if item is self._END:
                raise StopIteration
            raise item
        value, self._state = item
        return value

    def state(self) -> dict | None:
        return None if self._state is None else dict(self._state)

    def close(self) -> None:
        """Stop the producer thread; safe to call twice."""
        self._done = True
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=self.JOIN_S)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefetch(iterator: Iterator, n: int = 2) -> Prefetcher:
    """Wrap ``iterator`` so its next ``n`` items are produced on a background thread."""
    return Prefetcher(iterator, n)
