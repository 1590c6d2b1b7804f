"""The disk tier: the Adam moments of some blocks in files on local disk (``EngineConfig.disk_parts``).

Each leaf of a tier part's moments is one zarr3 array (uncompressed, chunked by rows) under
``EngineConfig.disk_dir``, read and written through tensorstore. Between updates the host state holds an
``OnDisk`` record in its place: shape, dtype, and where the array lives. A part's update on the host
worker:

1. takes the part's moments, read ahead: when one tier part's moments are taken, the reads of the next
   ``read_ahead`` tier parts in update order start (after any write of theirs still in flight); the
   first ``read_ahead`` parts of the next step are read as soon as this step's last write is queued;
2. runs the fused kernel on them in place (``HostOptimizer.update``);
3. starts writing them back (write-behind) and puts ``OnDisk`` records back in the state.

So host memory holds the moments of a few parts at a time, and disk reads and writes overlap the other
parts' updates and the GPU's work.

The files are the live state, rewritten every step. A checkpoint copies them (``np.asarray`` of an
``OnDisk`` reads it, after its pending write), so a run killed mid-step resumes from its last committed
checkpoint with nothing committed lost. A new engine, and a restore, write the files anew. A fresh state's
moments are zero: its arrays are created empty and read as zeros until their first write, so nothing is
written before the first update.

Once written, an array is read strictly: a chunk missing (the folder cleaned up under a running engine) or
short (truncated) raises ``DiskTierError``, as a failed write does, rather than reading as zeros, which the next
update, and a checkpoint, would take for the moments. Chunks equal to the fill value are stored for that.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
import tensorstore as ts

from megatrain_jax.engine.parts import Part, PartId
from megatrain_jax.optim import AdamWState

CHUNK_BYTES = 64 * 2**20  # rows per zarr chunk: about this many bytes

# How the files are read and written. Direct I/O (O_DIRECT, where the file system has it; tensorstore falls
# back to buffered I/O where not): the tier exists because host memory is short, so its bytes should not
# also sit in the page cache, and the step's speed is then the disk's, not whatever memory is left over.
# No fsync per write: the files are the live state, rewritten every step, and never what a resume starts
# from (a checkpoint copies them, and a restore writes them anew), so durability at each write buys nothing
# and an fsync per chunk cost 4x the write rate on the development machine.
IO_CONTEXT = {"file_io_mode": {"mode": "direct"}, "file_io_sync": False}
LOST = ("the disk tier's files no longer hold the moments this run wrote there (deleted, truncated or replaced "
        "while it ran?), so training stops here. Keep clean-ups and other programs away from {root} while a run "
        "uses it, then resume from the last checkpoint (a resume writes the files anew)")


def _said(error: BaseException) -> str:
    """``error`` for a message: its type and text, without the spec JSON tensorstore appends to some."""
    return f"{type(error).__name__}: " + re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", str(error))


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows of a leaf of ``shape`` per zarr chunk: whole rows, about ``CHUNK_BYTES`` (the last chunk is stored
    whole)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    return max(1, min(shape[0], CHUNK_BYTES // max(row, 1))) if shape else 1


def held_bytes(root: str | os.PathLike, parts: Sequence[PartId]) -> int:
    """Bytes the files of ``parts``' moments already take under ``root`` (a stopped run's, left for its resume): a
    new tier deletes each array before it writes it again, so they are room for it (``cli/disk_room.py``)."""
    total = 0
    for part in parts:
        for path in (Path(root) / part.name).rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:  # gone meanwhile
                pass
    return total


@dataclasses.dataclass(frozen=True, eq=False)
class OnDisk:
    """A leaf of the host state kept in a file of the disk tier. ``np.asarray`` reads it (after its pending
    write); ``block_until_ready`` waits for that write."""

    tier: "DiskTier"
    key: str  # the array's path under the tier's folder
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.tier.read(self)
        return out if dtype is None else out.astype(dtype)

    def block_until_ready(self) -> "OnDisk":
        self.tier.wait_written(self.key)
        return self

    def __repr__(self) -> str:
        return f"OnDisk({self.key!r}, shape={self.shape}, dtype={np.dtype(self.dtype).name})"


class DiskTier:
    """The files of the tier parts' moments, and the reads and writes in flight."""

    def __init__(self, root: str | os.PathLike, parts: Sequence[PartId], read_ahead: int = 2):
        if jax.process_count() > 1:
            raise ValueError("the disk tier (engine.disk_parts) runs in one process (it reads and writes whole "
                             "arrays); with several processes keep the moments in host memory")
        self.root = Path(root)
        self.parts = list(parts)  # in update order
        self.read_ahead = read_ahead
        self._lock_file = _claim(self.root)  # one engine per folder: the files are its live state
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-disk")
        self._lock = threading.Lock()
        self._stores: dict[str, ts.TensorStore] = {}
        self._writes: dict[str, Future] = {}  # key -> the write in flight
        self._reads: dict[PartId, Future] = {}  # part -> its moments (mu, nu), read ahead
        self._markers: dict[PartId, tuple[Any, Any]] = {}  # part -> its OnDisk trees (mu, nu)
        self.bytes_read = self.bytes_written = 0  # totals since the tier was made
        self.read_s = self.write_s = 0.0  # seconds the I/O thread spent reading and writing
        self._failed: dict[str, BaseException] = {}  # key -> the first failed write: its file is stale
        self._fresh: set[str] = set()  # arrays created empty and never written since: they read as zeros
        weakref.finalize(self, _release, self._io, self._lock_file)

    # ------------------------------------------------------------------ moving a part's moments
    def spill(self, part: PartId, record: Part, fresh: bool = False) -> Part:
        """``record`` with its moments in files (written from it, or created empty when ``fresh``: zero
        moments, as a new optimizer state has) and ``OnDisk`` records in their place."""
        self._check(record)
        stale = self._reads.pop(part, None)  # a read ahead of the old contents
        if stale is not None:
            stale.cancel()
        markers = []
        for name, tree in (("mu", record.opt.mu), ("nu", record.opt.nu)):
            on_disk = []
            for i, leaf in enumerate(jax.tree.leaves(tree)):
                key = f"{part.name}/{name}_{i:03d}"
                self.wait_written(key)
                dtype = np.dtype(leaf.dtype)
                self._open(key, tuple(leaf.shape), dtype)
                if fresh:
                    with self._lock:
                        self._fresh.add(key)
                else:  # written before the next part arrives: a restore holds one part at a time
                    self._write([key], [np.asarray(leaf)])
                    self.wait_written(key)
                on_disk.append(OnDisk(self, key, tuple(leaf.shape), dtype))
            markers.append(jax.tree.unflatten(jax.tree.structure(tree), on_disk))
        self._markers[part] = tuple(markers)
        return self._with_moments(record, *markers)

    def start_step(self) -> None:
        """Start reading the first ``read_ahead`` tier parts' moments for the next updates, unless already
        under way: called when a step's last tier part has been stored (its reads queue behind the writes)
        and again when the next updates are decided (a fresh or restored tier)."""
        for part in self.parts[:self.read_ahead]:
            if part not in self._reads:
                self._reads[part] = self._read_part(part)

    def load(self, part: PartId, record: Part) -> Part:
        """``record`` with its moments in host memory (read ahead when possible); the reads of the next
        ``read_ahead`` tier parts in update order start."""
        future = self._reads.pop(part, None) or self._read_part(part)
        i = self.parts.index(part)
        for nxt in self.parts[i + 1:i + 1 + self.read_ahead]:
            if nxt not in self._reads:
                self._reads[nxt] = self._read_part(nxt)
        return self._with_moments(record, *future.result())

    def store(self, part: PartId, record: Part) -> Part:
        """Start writing ``record``'s moments back (write-behind); the state gets ``OnDisk`` records again.
        After the step's last tier part, the next step's first ``read_ahead`` reads are queued behind the
        writes, so that the disk works through the backward pass instead of waiting for the next step's
        updates (the same number of parts' moments in memory as reading ahead within a step)."""
        markers = self._markers[part]
        keys = [m.key for m in jax.tree.leaves(markers)]
        self._write(keys, jax.tree.leaves((record.opt.mu, record.opt.nu)))
        if part == self.parts[-1]:
            self.start_step()
        return self._with_moments(record, *markers)

    @staticmethod
    def _with_moments(record: Part, mu: Any, nu: Any) -> Part:
        return Part(record.params, AdamWState(record.opt.count, mu, nu), record.stream)

    # ------------------------------------------------------------------ whole arrays
    def read(self, leaf: OnDisk) -> np.ndarray:
        """The array's current contents (after its pending write), as a new numpy array. Not on the I/O
        thread, where the queue order already puts each read after the writes before it."""
        self.wait_written(leaf.key)
        return self._read_now(leaf)

    def _read_now(self, leaf: OnDisk) -> np.ndarray:
        start = time.perf_counter()
        unwritten = self._unwritten([leaf])
        out = self._finish_reads([leaf], self._start_reads([leaf], unwritten))[0]
        with self._lock:
            self.bytes_read += 0 if unwritten else out.nbytes
            self.read_s += time.perf_counter() - start
        return out

    def wait_written(self, key: str) -> None:
        with self._lock:
            pending = self._writes.get(key)
        if pending is not None:
            pending.result()
        self._raise_if_failed([key])

    def flush(self) -> None:
        """Wait for every write in flight; raise if any write has failed."""
        with self._lock:
            pending = list(self._writes.values())
        for f in pending:
            f.result()
        self._raise_if_failed(list(self._failed))

    def _unwritten(self, leaves: Sequence[OnDisk]) -> set[str]:
        """The keys of ``leaves`` never written so far (created empty): asked when their read is queued, which
        runs before any write queued after it."""
        with self._lock:
            return {leaf.key for leaf in leaves if leaf.key in self._fresh}

    def _start_reads(self, leaves: Sequence[OnDisk], unwritten: set[str]) -> list:
        """Start reading ``leaves``: a tensorstore read each, or None for an array never written (zeros)."""
        return [None if leaf.key in unwritten else self._stores[leaf.key].read() for leaf in leaves]

    def _finish_reads(self, leaves: Sequence[OnDisk], reads: list) -> list[np.ndarray]:
        """The arrays of ``_start_reads``; a read that fails (a file missing or short) raises ``DiskTierError``."""
        out = []
        for leaf, read in zip(leaves, reads):
            if read is None:
                out.append(np.zeros(leaf.shape, leaf.dtype))
                continue
            try:
                out.append(read.result())
            except Exception as error:
                raise DiskTierError(f"reading {self.root / leaf.key} failed ({_said(error)}); "
                                    + LOST.format(root=self.root)) from error
        return out

    def _raise_if_failed(self, keys: Sequence[str]) -> None:
        """A failed write leaves its file older than the state: training cannot go on from it (a later
        write of the same array replacing the failure in ``_writes`` must not hide it)."""
        with self._lock:
            failed = [(k, self._failed[k]) for k in keys if k in self._failed]
        if failed:
            key, error = failed[0]
            raise DiskTierError(f"writing {self.root / key} failed ({_said(error)}); the disk tier's "
                                f"copy of those moments is stale, so training stops here. Free space or fix the "
                                f"disk under {self.root}, then resume from the last checkpoint") from error

    def close(self) -> None:
        """Wait for the writes in flight, stop the I/O thread and give the folder up (reads queued ahead for
        a next step are cancelled)."""
        for future in self._reads.values():
            future.cancel()
        self._reads.clear()
        try:
            self.flush()
        finally:
            _release(self._io, self._lock_file)

    def remove(self) -> None:
        """Delete the tier's files (they are the live state of this engine only), and its folder where nothing
        else is in it: a ``disk_dir`` that holds other files keeps them."""
        self.close()
        for part in self.parts:
            shutil.rmtree(self.root / part.name, ignore_errors=True)
        (self.root / ".lock").unlink(missing_ok=True)
        try:
            self.root.rmdir()
        except OSError:  # not empty: the rest is not the tier's
            pass

    # ------------------------------------------------------------------ internals
    def _check(self, record: Part) -> None:
        if not isinstance(record.opt, AdamWState) or record.opt.mu is None:
            raise ValueError("the disk tier holds the moments of megatrain_jax.adamw run by the fused host kernel "
                             "(engine.disk_parts needs that optimizer and host_kernel = true)")

    def _open(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Create the array ``key`` (replacing any earlier one): uncompressed, in chunks of whole rows."""
        rows = chunk_rows(shape, dtype.itemsize)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(self.root / key)},
                "metadata": {"shape": list(shape), "data_type": dtype.name,
                             "chunk_grid": {"name": "regular",
                                            "configuration": {"chunk_shape": [rows, *shape[1:]] if shape else []}},
                             "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                             "fill_value": 0},
                # a missing chunk is lost data, not zeros (``_fresh`` arrays are not read), so every chunk is stored
                "fill_missing_data_reads": False, "store_data_equal_to_fill_value": True,
                "context": IO_CONTEXT}
        try:
            self._stores[key] = ts.open(spec, create=True, delete_existing=True).result()
        except Exception as error:
            raise DiskTierError(f"creating {self.root / key} failed ({_said(error)}); the disk tier "
                                f"cannot keep its files in {self.root}. Fix what the error names there (free space, "
                                f"move away what is in the way), or set engine.disk_dir to another folder") from error

    def _write(self, keys: list[str], arrays: list[np.ndarray]) -> None:
        """Write ``arrays`` to the arrays ``keys``, all at once (tensorstore spreads the chunks over its
        threads), as one task of the I/O thread."""
        arrays = [np.asarray(a) for a in arrays]

        def run() -> None:
            start = time.perf_counter()
            try:
                for f in [self._stores[key].write(a) for key, a in zip(keys, arrays)]:
                    f.result()
            except BaseException as e:
                with self._lock:
                    for key in keys:
                        self._failed.setdefault(key, e)
                raise
            with self._lock:
                self.bytes_written += sum(a.nbytes for a in arrays)
                self.write_s += time.perf_counter() - start

        with self._lock:
            task = self._io.submit(run)
            self._writes.update({key: task for key in keys})
            self._fresh.difference_update(keys)  # reads queued from now on run after this write

    def _read_part(self, part: PartId) -> Future:
        """The part's moments, every array read at once, after its writes in flight (queued before this on
        the one I/O thread)."""
        markers = self._markers[part]
        leaves = jax.tree.leaves(markers)
        unwritten = self._unwritten(leaves)

        def run() -> tuple[Any, Any]:
            start = time.perf_counter()
            self._raise_if_failed([m.key for m in leaves])
            arrays = self._finish_reads(leaves, self._start_reads(leaves, unwritten))
            with self._lock:
                self.bytes_read += sum(a.nbytes for m, a in zip(leaves, arrays) if m.key not in unwritten)
                self.read_s += time.perf_counter() - start
            return jax.tree.unflatten(jax.tree.structure(markers), arrays)

        return self._io.submit(run)


class DiskTierError(RuntimeError):
    """A read or write of the disk tier failed: its files no longer hold the state. The message names the file
    and says what to do (resume from the last checkpoint)."""


def _claim(root: Path):
    """Lock ``root`` for this tier (an exclusive ``flock`` on ``root/.lock``, held until the tier is
    closed or collected): two engines on one folder would overwrite each other's live state."""
    import fcntl
    import gc
    try:
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / ".lock", "a+")
    except OSError as error:
        on_way = next((p for p in (root, *root.parents) if p.exists()), None)
        why = (f"{on_way} is a file, not a folder" if on_way is not None and not on_way.is_dir() else
               f"{type(error).__name__}: {error}")
        raise ValueError(f"the disk tier's files cannot be kept in {root} (engine.disk_dir): {why}. Set "
                         f"engine.disk_dir to a folder on a local disk that this user can write") from error
    for attempt in range(2):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except OSError:
            if attempt == 0:  # an engine of this process that is garbage but not yet collected holds it
                gc.collect()
    f.close()
    raise ValueError(f"disk_dir {root} is in use by another engine (its files are that engine's live state); give "
                     f"each run its own disk_dir, or close the other engine first (Engine.close())")


def _release(io: ThreadPoolExecutor, lock_file) -> None:
    io.shutdown(wait=True)
    if not lock_file.closed:
        lock_file.close()  # closing the file drops the flock
