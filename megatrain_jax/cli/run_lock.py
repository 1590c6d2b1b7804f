"""One run per run folder at a time: an advisory lock (``fcntl.flock``) on ``<run_dir>/.lock``, held for the
run's life by ``megatrain-jax train``; and one per checkpoint folder (``<checkpoint_dir>/.lock``), which another
run may name as its own ``train.checkpoint_dir`` from a different run folder.

The kernel drops a ``flock`` when its process dies, however it dies (SIGKILL included), so a lock left by a
dead run is never stale in the kernel's eyes: the file still names the dead holder, and the next run takes
it over and says whose it was. A second live run is refused at once, naming the holder's pid, host and
start time. Under ``jax.distributed`` each process locks its own file (``.lock`` for process 0,
``.lock.process-N`` for the others), so that one multi-process run can share a folder while a second one
cannot. ``flock`` is local to one machine: on a network file system the lock keeps out runs on the same
host only (NFS may not implement it at all); give runs on different hosts different folders.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_jax.checkpoint.folder_lock import HeldElsewhere, hold, let_go


class RunFolderBusyError(FileExistsError):
    """Another live process holds the run folder's lock."""


class RunLock:
    """The run folder's lock; ``acquire()`` returns a note when it took over a dead run's lock, or when the folder's
    file system cannot lock (the run goes on unlocked), else None."""

    def __init__(self, run_dir: Path, process: int = 0, what: str = "run folder", key: str = "train.run_dir"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / (".lock" if process == 0 else f".lock.process-{process}")
        self.what, self.key = what, key  # what the folder is to the run, and the setting that picks another
        self._fd: int | None = None
        self._made = False

    def acquire(self) -> str | None:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise FileExistsError(f"{self.what} {self.run_dir} is a file, not a folder; nothing was changed. Set "
                                  f"{self.key} to a folder (a new one for a new run), or move the file away")
        self._made = not self.run_dir.exists()  # a folder this lock made, removed on release if the run left it empty
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._fd, before = hold(self.path)
        except HeldElsewhere as held:
            raise RunFolderBusyError(
                f"{self.what} {self.run_dir} is in use by {held.holder or 'another process (it wrote no details yet)'}"
                f" ({self.path}); nothing was changed. Wait for that run to end, or set {self.key} to another "
                f"folder") from None
        except OSError as err:  # a file system without locks (some network and FUSE mounts): ENOLCK, EOPNOTSUPP
            return (f"{self.what} {self.run_dir} cannot be locked ({err.strerror or err}: its file system does not "
                    f"support locks), so a second run into it would not be refused: make sure no other run uses it "
                    f"while this one runs")
        return None if not before else f"took over the lock of a run that is no longer running ({before})"

    def release(self) -> None:
        if self._fd is not None:
            let_go(self._fd)  # unlocked and empty: nobody holds it
            self._fd = None
        if self._made and [p.name for p in self.run_dir.iterdir()] == [self.path.name]:
            # a start refused before it wrote anything leaves no folder behind
            self.path.unlink(missing_ok=True)
            try:
                self.run_dir.rmdir()
            except OSError:  # something was written there meanwhile: it stays
                pass
        self._made = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
