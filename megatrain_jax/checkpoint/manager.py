"""``Checkpointer``: asynchronous Orbax checkpoints of an ``Engine``'s host state, the newest ``keep`` kept (and the
last known good: ``prune``).

A checkpoint is one Orbax ``CheckpointManager`` step with three items (composite args):

- ``state``: every part's master parameters and optimizer state (``PartsSave``: one ``PyTreeSave`` per
  part, written part by part in the background, then ``MANIFEST.json`` with each file's size and CRC-32);
- ``meta``: ``JsonSave`` of the step, the data iterator's state, the seed and the part names;
- ``config``: ``JsonSave`` of the run configuration.

A checkpoint is *complete* when Orbax has committed it (renamed its temporary directory) and every file
matches the manifest; ``latest_complete`` skips others with a ``CheckpointWarning`` that names them.
Loading reads JSON and TensorStore arrays only: nothing is unpickled and no code runs.

No save can hang the run: a thread per save waits for Orbax to end it and then releases the snapshot, so a
save that failed anywhere (also before the ``state`` item's writer ran) never holds the engine. Its error
is raised on the training thread at the next ``check``, ``wait`` or ``save``; a failed write (read-only
folder, no permission, full disk, quota, I/O error) as ``CheckpointWriteError``, which says what to do.
Committed checkpoints are never touched by a failed save. After ``limit_stall`` (a stop signal) a save that
makes no progress for that long is abandoned instead of waited for (docs/checkpoints_faults.md).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from megatrain_jax.checkpoint.folder_lock import CheckpointFolderBusyError, lock_folder, unlock_folder
from megatrain_jax.checkpoint.failures import probe_writable, write_error
from megatrain_jax.checkpoint.parts import expected_layout, rebuild_part
from megatrain_jax.engine.parts import PartId
from megatrain_jax.checkpoint.store import (POLL_S, PartsHandler, PartsRestore, PartsSave, SaveAbandoned, Snapshot,
                                            barrier, verify_state_item)

TMP_MARK = ".orbax-checkpoint-tmp"
_ITEMS = {"meta": "meta.json", "config": "config.json"}


class CheckpointWarning(UserWarning):
    """An incomplete or corrupt checkpoint was found and skipped."""


class CorruptCheckpointError(RuntimeError):
    """The checkpoint asked for is incomplete or fails its manifest."""


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {"state": PartsHandler(), **{k: ocp.JsonCheckpointHandler(filename=f) for k, f in _ITEMS.items()}}


def committed_steps(root: Path) -> list[int]:
    """Steps Orbax has committed under ``root`` (directories named by the step), newest first."""
    if not root.is_dir():
        return []
    return sorted((int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)


def unfinished_saves(root: Path) -> list[Path]:
    """Temporary directories of saves that never committed (the process died while writing)."""
    return sorted(p for p in root.iterdir() if TMP_MARK in p.name) if root.is_dir() else []


def check_step(step_dir: Path, checksum: bool = True) -> str | None:
    """None when ``step_dir`` is a complete checkpoint; otherwise why it is not."""
    if not step_dir.is_dir():
        return f"{step_dir} does not exist"
    if not ocp.utils.is_checkpoint_finalized(step_dir):
        return f"{step_dir} was never committed by Orbax"
    problem = verify_state_item(step_dir, checksum)
    if problem:
        return problem
    for item, filename in _ITEMS.items():
        path = step_dir / item / filename
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            return f"unreadable {path}: {e}"
        # JSON of another shape would fail the resume later, after the model has loaded (``meta``'s step is what
        # the engine's state is set to)
        if not isinstance(record, dict):
            return f"{path} holds a JSON {type(record).__name__}, not an object"
        step = record.get("step")
        if item == "meta" and (type(step) is not int or step_dir.name.isdigit() and step != int(step_dir.name)):
            return f"{path} says step {step!r}, not {step_dir.name} (its folder's name)"
    return None


def split_step_dir(path: str | Path) -> tuple[Path, int | None]:
    """``root/<step>`` -> (root, step); a checkpoint root -> (root, None)."""
    path = Path(path).absolute()
    return (path.parent, int(path.name)) if path.name.isdigit() else (path, None)


class Checkpointer:
    """Saves an engine's host state asynchronously and restores it into host memory.

    ``save`` returns once the snapshot is taken; parts are written in the background while training
    continues. Arrays go to Orbax as zero-copy views of their host buffers, and the engine is held
    before updating a part that is not yet written (see ``store``), so a save adds no copy of the state
    (at most one part where buffers cannot be viewed). ``checksum=False`` checks file sizes only, which
    spares reading a large checkpoint once more before resuming from it.

    A writer (not ``read_only``) checks that it can write into ``directory`` when created and before every
    save; a failed write is a ``CheckpointWriteError`` (see the module's docstring).
    """

    def __init__(self, directory: str | Path, *, keep: int | None = 3, checksum: bool = True,
                 read_only: bool = False):
        if keep is not None and not read_only and keep < 1:
            raise ValueError(f"keep={keep!r}: a Checkpointer keeps the newest keep >= 1 checkpoints (and the last "
                             f"known good), or every one with keep=None; with {keep!r} each save would delete itself "
                             f"once committed")
        self.root = Path(directory).absolute()
        self.checksum = checksum
        self.keep = None if read_only else keep
        # The newest step known good (``CheckpointSession``: a finite step trained from it); None: every step is
        # taken as good. ``prune`` never deletes it, nor a newer step not yet known either way.
        self.known_good: int | None = None
        self.last_committed: int | None = None  # the step of the last save committed by this Checkpointer
        # The steps of this writer's run, the only ones ``prune`` deletes: those it saved, and those of the run it
        # continues up to the step it resumed from (``continues``). Another run's steps in the folder are left alone.
        self._saved_steps: set[int] = set()
        self._continued: int | None = None
        self._not_deleted: list[str] = []  # old steps ``prune`` failed to delete, said by ``check``
        self._probe_name = f".megatrain-write-probe-{jax.process_index()}"
        self._lock: Path | None = None
        # what a killed save left behind: said now, removed by this writer's first save (``save``), so that a run
        # refused before it saves (a resume that does not go ahead) leaves the directory as it was
        try:
            if not read_only:  # before the folder is looked at: a live writer's unfinished save is not a dead one's
                self.root.mkdir(parents=True, exist_ok=True)
                self._lock = lock_folder(self.root)
            self._unfinished = [] if read_only else unfinished_saves(self.root)
            for tmp in self._unfinished:
                warnings.warn(f"skipping incomplete checkpoint {tmp} (its save never finished); it is removed when "
                              f"this run saves its first checkpoint", CheckpointWarning, stacklevel=2)
            options = ocp.CheckpointManagerOptions(  # keep-N is ours (``prune``): it spares the last good step
                max_to_keep=None, create=not read_only, read_only=read_only,
                save_interval_steps=0 if read_only else 1,
                enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(timeout_secs=7 * 24 * 3600))  # a save may take long: never time out
            self._manager = ocp.CheckpointManager(self.root, item_handlers=_handlers(), options=options)
            if not read_only:  # a folder that cannot be written is said now, not at the first save
                probe_writable(self.root, self._probe_name)
        except OSError as err:  # the directory cannot be created or written, a killed save's files removed
            unlock_folder(self._lock)
            if read_only or isinstance(err, CheckpointFolderBusyError):
                raise
            raise write_error(err, self.root, self.root, self.last_good()) or err
        self._snapshot: Snapshot | None = None
        self._release_gate: Callable[[], None] | None = None
        self._watcher: threading.Thread | None = None  # waits for the save in flight to end (``_watch``)
        self._failure: BaseException | None = None  # the last save's error, until raised by ``check``
        self._failed = False
        self._stall_s: float | None = None
        self.last_step: int | None = None  # the step of the last save started

    # ------------------------------------------------------------------ saving
    def save(self, engine, *, meta: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
             wait: bool = False) -> int:
        """Checkpoint ``engine.state`` at its current step; returns the step. ``meta`` (e.g. the data
        iterator's state) and ``config`` (the run configuration) are stored as JSON."""
        self.wait()  # one save at a time: the previous snapshot must be released before the next is gated
        if self.abandoned:  # its writer may be stuck inside Orbax, which would hold this save behind it
            raise SaveAbandoned(f"the save of step {self._snapshot.step} into {self.root} was abandoned; "
                                f"this Checkpointer saves no more")
        step = int(engine.state.step)
        try:
            probe_writable(self.root, self._probe_name)
            first = self._unfinished is not None
            self._remove_unfinished()
        except OSError as err:
            raise write_error(err, self.root / str(step), self.root, self.last_good()) from err
        if first:
            self._say_others()
        engine.sync()  # the step's host updates run on a worker thread: let them land first
        # With several processes each holds only its devices' rows of the pageable arrays: Orbax writes
        # global arrays, each process its own pieces (see store.Snapshot).
        snapshot = Snapshot(engine.state, engine.placement.copy_to_host if jax.process_count() > 1 else None,
                            stall_s=self._stall_s)
        if self._release_gate is not None:  # the previous save is committed: its gate has nothing left to hold
            self._release_gate()
        # The engine waits for a part to be written before it updates that part's host arrays (in place,
        # or by replacing and donating them); engine.sync() too, before it writes a GPU-resident part's device
        # values into that part's host arrays.
        self._release_gate = engine.hold_updates(snapshot.wait_part)
        self._snapshot = snapshot
        meta = {"format": 1, "step": snapshot.step, "parts": snapshot.names, "saved_at": time.time(), **(meta or {})}
        try:
            self._manager.save(snapshot.step, force=True, args=ocp.args.Composite(
                state=PartsSave(snapshot, self.checksum), meta=ocp.args.JsonSave(meta),
                config=ocp.args.JsonSave(config or {})))
        except BaseException as err:
            snapshot.release_all()
            raise write_error(err, self.root / str(snapshot.step), self.root, self.last_good(), snapshot.nbytes) or err
        self.last_step = snapshot.step
        self._saved_steps.add(snapshot.step)
        self._watcher = threading.Thread(target=self._watch, args=(snapshot,), name="megatrain-save-end", daemon=True)
        self._watcher.start()
        if wait:
            self.wait()
        return snapshot.step

    def _remove_unfinished(self) -> None:
        """Remove the killed saves' temporary directories found when this writer was made; once."""
        if self._unfinished is None:
            return
        if jax.process_index() == 0:
            for tmp in self._unfinished:
                if tmp.exists():
                    shutil.rmtree(tmp)
        barrier("megatrain_cleaned")
        self._unfinished = None

    def continues(self, step: int) -> None:
        """This writer goes on with the run whose checkpoint ``step`` of its folder it resumed from: that run's steps
        up to ``step`` are its own, which the keep-N rule prunes (``restore`` says so itself)."""
        self._continued = step if self._continued is None else max(self._continued, step)

    def _own(self, step: int) -> bool:
        return step in self._saved_steps or (self._continued is not None and step <= self._continued)

    def _say_others(self) -> None:
        """At the first save: the steps in the folder that are not this writer's run's, which it never deletes."""
        others = [step for step in committed_steps(self.root) if not self._own(step)]
        if others and self.keep is not None:
            warnings.warn(f"{self.root} holds steps {others} that this Checkpointer neither saved nor resumed from "
                          f"(another run's): keep={self.keep} applies to this run's own checkpoints and never deletes "
                          f"those. To continue that run instead, restore its step with this Checkpointer first; to "
                          f"keep the runs apart, give this one its own folder", CheckpointWarning, stacklevel=3)

    def _watch(self, snapshot: Snapshot) -> None:
        """On a thread of its own: wait for Orbax to end the save, keep its outcome, and release the snapshot
        however it ended (Orbax may fail before the state's writer runs, which alone releases it)."""
        try:
            self._manager.wait_until_finished()
            if not snapshot.abandoned:
                self.last_committed = snapshot.step
                self.prune()
        except BaseException as err:  # noqa: BLE001 - raised on the training thread by check()
            self._failure, self._failed = err, True
        finally:
            snapshot.release_all()

    def wait(self) -> None:
        """Block until the save in flight (if any) has ended, and raise its failure (see ``check``). After
        ``limit_stall``, a save that makes no progress for that long is abandoned instead."""
        watcher, snapshot = self._watcher, self._snapshot
        while watcher is not None and watcher.is_alive() and not snapshot.abandoned:
            watcher.join(POLL_S)  # in slices: a signal's handler runs between them
            if snapshot.stalled():
                snapshot.abandon()
        self.check()

    def check(self) -> None:
        """Raise the error of the last save, once, if it failed; never blocks. A failed write is raised as
        ``CheckpointWriteError``; an abandoned save raises nothing (``abandoned`` says so)."""
        failure, self._failure = self._failure, None
        notes, self._not_deleted = self._not_deleted, []
        for note in notes:
            warnings.warn(note, CheckpointWarning, stacklevel=2)
        if failure is not None and not self.abandoned:
            step_dir = self.root / str(self._snapshot.step)
            raise write_error(failure, step_dir, self.root, self.last_good(), self._snapshot.nbytes) or failure

    def prune(self) -> None:
        """Delete this run's committed steps older than its newest ``keep``, except ``known_good`` and any newer step
        (not yet known good or bad): a diverging run's last checkpoints never push its last good one out. Another
        run's steps in the folder are never deleted (``_own``). Runs after each save commits, when no save is in
        flight. A step that cannot be deleted is said by the next ``check`` (a warning): the save is committed,
        and the run goes on."""
        if self.keep is None:
            return
        steps = [step for step in committed_steps(self.root) if self._own(step)]
        for step in steps[self.keep:]:
            if self.known_good is None or step < self.known_good:
                self._delete(step)

    def _delete(self, step: int) -> None:
        try:
            self._manager.delete(step)
        except OSError as err:
            last = self.last_committed
            saved = "" if last is None else f"checkpoint {self.root / str(last)} was saved; "
            self._not_deleted.append(
                f"could not delete the old checkpoint {self.root / str(step)} (keep={self.keep}): {err}. Nothing else "
                f"is affected: {saved}the run goes on, and the next save tries again. Its space stays used until "
                f"then: where it cannot be deleted, free it by hand (rm -r {self.root / str(step)})")

    def limit_stall(self, stall_s: float) -> None:
        """From now on, abandon a save (the one in flight, and later ones) that makes no progress for
        ``stall_s`` seconds: the engine gets its state back and the save never commits. For a stop signal,
        so that a save that cannot finish does not keep the process alive."""
        self._stall_s = stall_s
        if self._snapshot is not None:
            self._snapshot.limit_stall(stall_s)

    @property
    def abandoned(self) -> bool:
        """Whether the last save was abandoned (``limit_stall``); this Checkpointer then saves no more."""
        return self._snapshot is not None and self._snapshot.abandoned

    def last_good(self) -> Path | None:
        """The newest checkpoint committed: this Checkpointer's last, else the newest step on disk."""
        if self.last_committed is not None:
            return self.root / str(self.last_committed)
        try:
            steps = committed_steps(self.root)
        except OSError:
            return None
        return self.root / str(steps[0]) if steps else None

    @property
    def engine_wait_s(self) -> float:
        """Seconds the engine was held by the last save (writer slower than training)."""
        return 0.0 if self._snapshot is None else self._snapshot.wait_s

    def close(self) -> None:
        """Wait for the save in flight (raising its failure) and close the manager. After a failed or an
        abandoned save the manager is left as it is: its writer may never return."""
        try:
            self.wait()
        finally:
            if not self.abandoned and not self._failed:  # Orbax would raise a failed save's error again
                self._manager.close()
            unlock_folder(self._lock)
            self._lock = None

    # ------------------------------------------------------------------ finding
    def scan(self) -> list[tuple[int, str | None]]:
        """Every committed step, newest first, with what is wrong with it (None: complete)."""
        return [(step, check_step(self.root / str(step), self.checksum)) for step in committed_steps(self.root)]

    def latest_complete(self, *, quarantine: bool = False,
                        found: list[tuple[int, str | None]] | None = None) -> int | None:
        """The newest complete step, warning about every newer one that is incomplete or corrupt. With
        ``quarantine`` those are renamed aside (``N.corrupt``), so that step N can be written again; only
        when an older complete step exists, so a run never moves its last checkpoints out of sight. ``found``:
        this directory's ``scan()`` when the caller made it already (each step is verified once)."""
        found = self.scan() if found is None else found
        if quarantine:
            barrier("megatrain_scanned")  # every process has looked before any moves a step aside
        good = next((step for step, problem in found if problem is None), None)
        for step, problem in found:
            if problem is None:
                break
            step_dir, note = self.root / str(step), ""
            if quarantine and good is not None:
                # Every process found the same (the directory is shared); the first moves it.
                aside = _free_name(step_dir.with_name(f"{step}.corrupt"))
                if jax.process_index() == 0:
                    step_dir.rename(aside)
                barrier("megatrain_quarantined")
                self._manager.reload()  # forget the step, so that it can be saved again
                note = f"; moved aside to {aside.name}"
            warnings.warn(f"skipping corrupt checkpoint {step_dir}: {problem}{note}", CheckpointWarning,
                          stacklevel=2)
        return good

    # ------------------------------------------------------------------ restoring
    def restore(self, engine, step: int | None = None, *, verified: bool = False) -> tuple[dict, dict]:
        """Load checkpoint ``step`` (default: the newest complete one) into ``engine.state``, part by
        part (``Engine.restore_part`` places each array and recomputes the stream copy). Returns the
        ``(meta, config)`` JSON. Raises ``ShapeMismatchError`` listing every tensor that does not fit."""
        if step is None:
            step = self.latest_complete()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.root}")
        elif not verified:
            problem = check_step(self.root / str(step), self.checksum)
            if problem:
                raise CorruptCheckpointError(f"cannot restore {self.root / str(step)}: {problem}")
        engine.sync()
        state = engine.state

        def sink(name: str, tree: dict[str, Any]) -> None:
            part = PartId.from_name(name)
            engine.restore_part(part, *rebuild_part(state, part, tree))

        out = self._manager.restore(step, args=ocp.args.Composite(
            state=PartsRestore(expected_layout(state), sink), meta=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore()))
        engine.restored(int(out.meta["step"]))  # GPU-resident parts reload from the restored host arrays
        self.continues(step)
        return dict(out.meta), dict(out.config)


def _free_name(path: Path) -> Path:
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{n}")
    return candidate
