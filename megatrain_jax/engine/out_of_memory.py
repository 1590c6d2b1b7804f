"""A training step that runs out of accelerator memory, as one error that says what was kept.

XLA reports an allocation failure (``RESOURCE_EXHAUSTED``) in one of two ways. Where the program's
dispatch fails, the op is known and so is whether the optimizer step's update had begun
(``passes.PassRunner.run``). Where the program failed after dispatch, on the device, the failure reaches the
host only when it next waits on that work or on anything computed from it (a part's update, a loss, the
step's decision): then which step failed is not known, and GPU-resident parts or the update may hold failed
results, so the error says the update may have begun (``reported_late``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import jax


class DeviceOutOfMemoryError(RuntimeError):
    """A training step ran out of accelerator memory (XLA's ``RESOURCE_EXHAUSTED``), in op ``op``; with
    ``host_pool`` it was XLA's pool of pinned host memory (what crosses PCIe lives there), not the GPU's.

    ``updated`` says whether the step's optimizer update may have begun. When not (the dispatch of an op of
    the forward, the head, the backward or the global norm failed), no part of the step changed the state:
    the engine holds the state of the last whole step (``step``), which can be saved, resumed from, or the
    step run again. Otherwise (the update began, or the failure was reported late) some parts may hold the
    new step or a failed result: resume from the last saved checkpoint. ``requested``: the bytes asked for."""

    def __init__(self, message: str, *, op: str, phase: str, updated: bool, step: int | None = None,
                 requested: int | None = None, host_pool: bool = False):
        super().__init__(message)
        self.op, self.phase, self.updated, self.step, self.requested = op, phase, updated, step, requested
        self.host_pool = host_pool

    @classmethod
    def of(cls, err: BaseException, where: str, *, op: str, phase: str, updated: bool,
           census: str | None = None) -> DeviceOutOfMemoryError:
        """XLA's allocation failure ``err`` in ``where``: which memory ran out and the bytes asked for, read
        from its message; for the pinned pool, what was live in pinned memory (``census``, taken now if not
        given: the caller takes it before letting go of arrays of its own)."""
        host = in_host_pool(err)
        if host and census is None:
            census = pinned_census()
        said = f" ({census})" if host and census else ""
        return cls(f"out of {'pinned host' if host else 'device'} memory in {where}: {err}{said}", op=op,
                   phase=phase, updated=updated, requested=requested_bytes(err), host_pool=host)

    @property
    def memory(self) -> str:
        """The memory that ran out, in words."""
        return "XLA's pinned host memory" if self.host_pool else "device memory"


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is XLA's allocation failure on the device (``RESOURCE_EXHAUSTED: Out of memory``)."""
    text = str(err)
    return isinstance(err, jax.errors.JaxRuntimeError) and ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text)


def in_host_pool(err: BaseException) -> bool:
    """Whether an out-of-memory error is XLA's pinned host pool's (its allocator ``xla_gpu_host_bfc``, capped by
    ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``) rather than the GPU's."""
    text = str(err)
    return "xla_gpu_host_bfc" in text or "Out of host memory" in text


def pinned_census(largest: int = 5) -> str:
    """What this process holds in pinned host memory now, in words: the live jax arrays of memory kind
    ``pinned_host``, per GPU's pool (XLA keeps one per device, each under the cap: a replicated array counts in
    each), the largest pool's total and its largest groups by dtype and shape. Said when XLA's pinned pool runs
    out, against the memory plan's count of pinned arrays: what outgrew its count shows there. Arrays freed but
    not yet back in the pool, and the pool's fragmentation, do not show. Never raises: a census that fails says
    so instead."""
    try:
        pools: dict[Any, dict[tuple[str, tuple[int, ...]], list[int]]] = {}
        for x in jax.live_arrays():
            try:
                if getattr(x.sharding, "memory_kind", None) != "pinned_host" or x.is_deleted():
                    continue
                key = (str(x.dtype), tuple(x.shape))
                for shard in x.addressable_shards:
                    group = pools.setdefault(shard.device, {}).setdefault(key, [0, 0])
                    group[0] += 1
                    group[1] += int(shard.data.nbytes)
            except Exception:  # an array being deleted by another thread
                continue
    except Exception as e:  # the out-of-memory error matters more than its census
        return f"live pinned arrays not counted: {type(e).__name__}: {e}"
    if not pools:
        return "live pinned arrays: none"
    totals = {d: sum(b for _, b in groups.values()) for d, groups in pools.items()}
    device = max(totals, key=totals.get)
    top = sorted(pools[device].items(), key=lambda kv: -kv[1][1])[:largest]
    words = ", ".join(f"{n} x {dtype}{list(shape)} {b / 2**30:.2f} GiB" for (dtype, shape), (n, b) in top)
    where = "" if len(pools) == 1 else f" on {device}, the fullest of {len(pools)} devices' pools"
    count = sum(n for n, _ in pools[device].values())
    return f"live pinned arrays{where}: {totals[device] / 2**30:.2f} GiB in {count}; the largest groups: {words}"


_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(err: BaseException) -> int | None:
    """The allocation an out-of-memory error names (``allocate 9013495808 bytes``, ``allocate 8.39GiB``)."""
    m = re.search(r"allocate ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", str(err))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


@contextlib.contextmanager
def reported_late() -> Iterator[None]:
    """Turn an allocation failure of device work that surfaces when the host waits on it into
    ``DeviceOutOfMemoryError`` with ``updated`` True (nothing is known to be whole)."""
    try:
        yield
    except DeviceOutOfMemoryError:
        raise
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        raise DeviceOutOfMemoryError.of(err, "work queued earlier, reported when the host waited on it",
                                        op="queued device work", phase="the GPU's queued work", updated=True) from err
