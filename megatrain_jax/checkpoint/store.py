"""Writing and reading the host state part by part, as one Orbax item.

Why not hand Orbax the whole state? Its async save first makes every array host-resident numpy and
keeps all of it until the write ends: ``NumpyHandler`` deep-copies numpy input (unless
``deepcopy_host_arrays=False``), and ``ArrayHandler`` turns a ``pinned_host`` array into a numpy copy on
a GPU (``replica_slices.transfer_arrays_to_host``). Host memory would double while an offloaded state is
saved. And the engine updates host arrays in place (fused AdamW) or replaces and donates them, so a
reference alone is no snapshot.

So ``PartsHandler`` is an Orbax ``AsyncCheckpointHandler`` whose background commit writes the parts in
turn (io, block 0, block 1, ...), each with an ordinary ``PyTreeCheckpointHandler`` into its own
subdirectory, then the manifest. Each array is handed to Orbax as a zero-copy numpy view of its host
buffer (pinned or pageable), through a ``NumpyHandler`` that does not deep-copy. The snapshot is a ``Snapshot``: the
engine's part trees, taken after its pending updates finish. Before the engine updates a part in place
it calls the gate the checkpointer installed (``Engine.hold_updates(snapshot.wait_part)``), which holds
it until that part is written and released. So a save needs no
extra copy of the state (at most one part, where pinned buffers cannot be viewed), and training
overlaps the write until the next step's updates catch up with the writer.

With several processes (``jax.distributed``) each holds only its devices' rows of the state. Each leaf is
then written as one global array: pinned leaves already are global ``jax.Array``s, and numpy leaves are
copied, one part at a time, into global pinned arrays (``Snapshot``'s ``to_global``). Orbax's array handler
writes each process's own pieces into a per-process OCDBT database; after a barrier (the distributed
runtime's key-value service, not a device collective: the writer runs beside training) the first process
merges them and, at the end, writes the manifest. The files are the same as from one process, so a
checkpoint restores under any process layout: a restore reads each part whole and keeps this process's rows.

A save never holds the engine past its end, however it ends: the ``Checkpointer`` releases the snapshot once
Orbax has finished with it, also when Orbax failed before this handler ran (a read-only folder fails when
Orbax creates the step's temporary directory). A save that makes no progress for ``stall_s`` seconds after
a stop signal is *abandoned*: the engine is let go, and the writer, should it ever wake, stops before the
manifest, so the step never becomes a complete checkpoint (docs/checkpoints_faults.md).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from megatrain_jax.checkpoint.manifest import file_entries, verify_manifest, write_manifest
from megatrain_jax.checkpoint.parts import (MomentFormatWarning, ShapeMismatchError, check_layout, flatten_nested,
                                            moment_formats, named_leaves, nest, part_trees)
from megatrain_jax.engine.host_state import HostState
from megatrain_jax.engine.parts import PartId
from megatrain_jax.engine.transfer import host_view


POLL_S = 0.2  # how often a wait on a save looks whether it stalled


class SaveAbandoned(RuntimeError):
    """The save was abandoned (it made no progress for ``stall_s`` after a stop signal): it never commits."""


class Snapshot:
    """One step's host state, held by reference part by part until the writer has written each part.

    ``to_global``: with several processes, what turns a numpy leaf (of which this process holds only its
    devices' rows) into a global array in pinned memory, a copy of one part at a time; pinned leaves
    already are global arrays. Orbax then writes each process's own pieces of every leaf.

    ``stall_s`` (None: no limit; ``limit_stall`` sets it on a stop signal): a save whose writer makes no
    progress (``progressed``: a part written, a file checksummed) for that long is abandoned by whoever
    waits on it (``stalled``, ``abandon``)."""

    def __init__(self, state: HostState, to_global: Callable[[np.ndarray], jax.Array] | None = None,
                 stall_s: float | None = None):
        self.step = int(state.step)
        self._to_global = to_global
        self._lock = threading.Lock()
        self._parts: dict[str, dict[str, Any]] = {part.name: named_leaves(tree) for part, tree in part_trees(state)}
        self._done = {name: threading.Event() for name in self._parts}
        self.names = list(self._parts)
        self.nbytes = sum(int(getattr(leaf, "nbytes", 0)) for leaves in self._parts.values() for leaf in leaves.values())
        self.wait_s = 0.0  # time the engine spent held by this snapshot
        self.stall_s = stall_s
        self.abandoned = False
        self._progress_t = time.monotonic()  # when the writer last released a part (or the limit was set)

    def limit_stall(self, stall_s: float) -> None:
        """From now on, abandon this save if its writer makes no progress for ``stall_s`` seconds."""
        self.stall_s = stall_s
        self._progress_t = max(self._progress_t, time.monotonic())

    def progressed(self) -> None:
        """The writer moved on (a part written, a file checksummed): the stall clock starts again."""
        self._progress_t = time.monotonic()

    def stalled(self) -> bool:
        """Whether the save made no progress for ``stall_s`` seconds (never without a limit)."""
        return self.stall_s is not None and time.monotonic() - self._progress_t > self.stall_s

    def abandon(self) -> None:
        """Give the engine its state back now; the writer stops at its next part, before the manifest."""
        self.abandoned = True
        self.release_all()

    def take(self, name: str) -> dict[str, Any]:
        """The nested tree of part ``name`` for the writer."""
        if self.abandoned:
            raise SaveAbandoned(f"the save of step {self.step} was abandoned")
        with self._lock:
            leaves = self._parts[name]
        deleted = [k for k, v in leaves.items() if getattr(v, "is_deleted", lambda: False)()]
        if deleted:
            raise RuntimeError(f"part {name} of step {self.step} was overwritten during its save ({deleted[0]} "
                               f"was donated): the engine updated it without passing its update gate")
        if self._to_global is not None:
            return nest({k: v if isinstance(v, jax.Array) else self._to_global(v) for k, v in leaves.items()})
        return nest({k: host_view(v) for k, v in leaves.items()})

    def release(self, name: str) -> None:
        """Drop the references of a written part and let the engine update it."""
        with self._lock:
            self._parts.pop(name, None)
        self.progressed()
        self._done[name].set()

    def release_all(self) -> None:
        for name in list(self._done):
            self.release(name)

    def wait_part(self, part: PartId) -> None:
        """Block until ``part`` is written (no-op for a part already written): the engine's update gate.
        The save's end releases every part, whether it failed or not; a stalled save is abandoned here."""
        event = self._done.get(part.name)
        if event is not None and not event.is_set():
            t = time.perf_counter()
            while not event.wait(POLL_S):
                if self.stalled():
                    self.abandon()
            self.wait_s += time.perf_counter() - t


@dataclasses.dataclass
class PartsSave(ocp.args.CheckpointArgs):
    """What to write: a ``Snapshot``; ``checksum`` adds a CRC-32 of every file to the manifest."""

    snapshot: Snapshot
    checksum: bool = True


@dataclasses.dataclass
class PartsRestore(ocp.args.CheckpointArgs):
    """``layout``: ``{part: {leaf: (shape, dtype)}}`` expected; ``sink(name, tree)`` receives each part as
    soon as it is read, as new numpy arrays that become the sink's own (the engine places each in pinned
    or pageable memory), so the state is never held twice."""

    layout: dict[str, dict[str, tuple]]
    sink: Callable[[str, dict[str, Any]], None]


class PartsHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler of the ``state`` item: one PyTree subdirectory per part, then ``MANIFEST.json``."""

    def __init__(self):
        registry = ocp.type_handlers.create_type_handler_registry(
            (np.ndarray, _numpy_handler_without_copy()), (jax.Array, ocp.type_handlers.ArrayHandler()))
        # Uncompressed: float32 weights and moments hardly compress, and zstd buffers would cost memory and time.
        self._tree = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False,
                                                 type_handler_registry=registry)

    async def async_save(self, directory, args: PartsSave):
        return [ocp_future.CommitFutureAwaitingContractedSignals(self._commit(directory, args),
                                                                 name="megatrain_parts")]

    async def _commit(self, directory, args: PartsSave) -> None:
        await asyncio.to_thread(self._write_parts, Path(directory), args)

    def _write_parts(self, directory: Path, args: PartsSave) -> None:
        snap = args.snapshot
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name in snap.names:
                path = epath.Path(directory / name)
                self._tree.save(path, args=ocp.args.PyTreeSave(snap.take(name)))
                # With several processes each has written its own pieces into its own OCDBT database;
                # the first merges them into the part's root once all are done. Only the first: Orbax's
                # finalize merges on every process that calls it, and two merges into one root race (the
                # manifest would list a root file another process then rewrites).
                barrier("megatrain_part_written")
                if jax.process_index() == 0:
                    self._tree.finalize(path)
                snap.release(name)
            if snap.abandoned:  # a part may have changed while it was written: never a complete checkpoint
                raise SaveAbandoned(f"the save of step {snap.step} was abandoned")
            if jax.process_index() == 0:
                entries = file_entries(directory, args.checksum, progress=snap.progressed)
                write_manifest(directory, entries, step=snap.step, parts=snap.names)
        finally:
            snap.release_all()  # a failed save must never leave the engine waiting

    def save(self, directory, args: PartsSave) -> None:
        self._write_parts(Path(directory), args)

    def restore(self, directory, args: PartsRestore) -> None:
        directory = Path(directory)
        found = self.layout(directory)
        expected, converted = moment_formats(args.layout, found)
        check_layout(expected, found, str(directory.parent))
        if converted:
            warnings.warn(f"the checkpoint's Adam moments are in another format than this run's "
                          f"(engine.moment_dtype): {len(converted)} moments converted on restore (first: "
                          f"{converted[0]}); the run goes on in its own format", MomentFormatWarning)
        for name, layout in expected.items():
            restore_args = nest({k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(dtype))
                                 for k, (_, dtype) in layout.items()})
            tree = self._tree.restore(epath.Path(directory / name),
                                      args=ocp.args.PyTreeRestore(restore_args=restore_args))
            bad = non_finite(flatten_nested(tree))
            if bad:
                raise NonFiniteCheckpointError(
                    f"checkpoint {directory.parent} holds NaN or infinite values in {name}/{bad[0]}"
                    f"{f' and {len(bad) - 1} more of its tensors' if len(bad) > 1 else ''}: the state of a run that "
                    f"diverged, which would train on without a word (a weight no token reaches keeps its NaN) and "
                    f"never export. Nothing was trained from it. Resume from an earlier checkpoint: give its step "
                    f"folder (train.resume={directory.parent.parent}/<step>)")
            args.sink(name, tree)
            del tree

    def layout(self, directory: Path) -> dict[str, dict[str, tuple]]:
        """``{part: {leaf: (shape, dtype)}}`` as written, from the array metadata (no array is read)."""
        out = {}
        for sub in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
            meta = self._tree.metadata(epath.Path(sub))
            tree = getattr(meta, "tree", meta)
            out[sub.name] = {k: (tuple(v.shape), str(v.dtype)) for k, v in flatten_nested(tree).items()}
        return out

    def metadata(self, directory) -> dict[str, dict[str, tuple]]:
        return self.layout(Path(directory))

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        self._tree.close()


_barriers: collections.Counter = collections.Counter()


def barrier(name: str, timeout_s: int = 24 * 3600) -> None:
    """Wait until every process reaches barrier ``name`` (a no-op in one process). Every process passes
    the same barriers in the same order, so the n-th passage of a name is one barrier everywhere. It goes
    through the distributed runtime's key-value service, never a device collective, so it is safe on the
    writer thread while the main thread runs training programs."""
    if jax.process_count() > 1:
        _barriers[name] += 1
        ocp.multihost.get_barrier_sync_fn()(key=f"{name}.{_barriers[name]}", timeout_ms=timeout_s * 1000)


def _numpy_handler_without_copy() -> ocp.type_handlers.NumpyHandler:
    """Orbax's numpy handler minus its defensive deep copy (the snapshot already guarantees that nothing
    writes an array before its part is written)."""
    try:
        return ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # orbax 0.12.4 (the GPU image) always copies: the same serialize, without the copy
        return _NoCopyNumpyHandler()


class _NoCopyNumpyHandler(ocp.type_handlers.NumpyHandler):
    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        return [ocp_future.CommitFutureAwaitingContractedSignals(self._background_serialize(values, infos, args),
                                                                 name="np_type_handler")]


class NonFiniteCheckpointError(ValueError):
    """A checkpoint's master weights or optimizer state hold a NaN or an infinity."""


_CHECK_CHUNK = 4 << 20  # elements checked at once: a small temporary, never one the size of an embedding
_check_pool: concurrent.futures.ThreadPoolExecutor | None = None  # numpy's tests release the GIL: chunks in parallel


def non_finite(leaves: dict[str, Any]) -> list[str]:
    """The names of the floating-point leaves that hold a NaN or an infinity (codes of quantized moments are
    integers: never). One pass, its chunks on up to 8 threads (bfloat16 by its exponent bits: numpy has no fast
    test for it)."""
    return [name for name, leaf in leaves.items() if not _finite(np.asarray(leaf).reshape(-1))]


def _finite(flat: np.ndarray) -> bool:
    if flat.dtype.name == "bfloat16":  # an all-ones exponent is an infinity or a NaN
        return not any(_chunks(flat.view(np.uint16), lambda bits: bool(((bits & 0x7F80) == 0x7F80).any())))
    if not np.issubdtype(flat.dtype, np.floating):
        return True
    return not any(_chunks(flat, lambda x: not np.isfinite(x).all()))


def _chunks(flat: np.ndarray, test: Callable[[np.ndarray], bool]) -> Iterator[bool]:
    global _check_pool
    if _check_pool is None:
        _check_pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), "megatrain-finite")
    return _check_pool.map(test, (flat[i:i + _CHECK_CHUNK] for i in range(0, flat.size, _CHECK_CHUNK)))


ocp.args.register_with_handler(PartsHandler, for_save=True)(PartsSave)
ocp.args.register_with_handler(PartsHandler, for_restore=True)(PartsRestore)


def verify_state_item(step_dir: Path, checksum: bool = True) -> str | None:
    """None if the ``state`` item of a committed step directory matches its manifest."""
    return verify_manifest(step_dir / "state", checksum)


__all__ = ["NonFiniteCheckpointError", "PartsHandler", "PartsRestore", "PartsSave", "SaveAbandoned",
           "ShapeMismatchError", "Snapshot", "non_finite", "verify_state_item"]
