"""One writing process per checkpoint folder. Two runs saving into one folder (a job requeued while the first still
runs) would delete each other's steps (keep-N) and each other's unfinished saves, so each writing ``Checkpointer``
holds an advisory lock on the folder while it lives: ``flock``, which the kernel drops when its process dies, however
it dies. A file system that cannot lock leaves the run unguarded, as before. ``hold`` and ``let_go`` are the lock
itself, which the command line's run-folder lock (``cli/run_lock``) takes too."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

import jax


class HeldElsewhere(Exception):
    """A live process holds the lock; ``holder`` is the line it wrote ("" where it wrote none yet)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def hold(path: Path) -> tuple[int, str]:
    """An exclusive advisory lock (``flock``) on the file ``path``, not waiting: its descriptor, and the line the last
    holder wrote ("" where none: a dead holder's stays, as the kernel dropped its lock), this process's line written
    in its place (pid, host, time). Raises ``HeldElsewhere`` where a live process holds it, and the ``OSError`` of a
    file system that cannot lock; the descriptor is closed either way. ``let_go`` ends it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise HeldElsewhere(holder) from None
    except OSError:
        os.close(fd)
        raise
    before = _read(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started "
                  f"{datetime.datetime.now().isoformat(timespec='seconds')}\n".encode(), 0)
    return fd, before


def let_go(fd: int) -> None:
    """End ``hold``'s lock: the file emptied (nobody holds it), unlocked, closed."""
    os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


class CheckpointFolderBusyError(FileExistsError):
    """Another live process writes checkpoints into the folder."""


# Checkpoint folders this process writes into: resolved root -> [lock file descriptor, writers]. A second writer of
# the same process shares the lock (a run that made a new Checkpointer after an abandoned one); another process is
# refused.
_WRITING: dict[Path, list[int]] = {}
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # file systems that cannot lock


def lock_folder(root: Path) -> Path | None:
    """One writing process per checkpoint folder: an advisory lock (``flock``, dropped by the kernel when its process
    dies, however it dies) on ``root/.megatrain-writer-<process>.lock``. Two runs saving into one folder (a job
    requeued while the first still runs) would delete each other's steps (keep-N) and unfinished saves. Returns the
    key to ``unlock_folder`` (None where the file system cannot lock: the run goes on unguarded)."""
    key = root.resolve()
    if key in _WRITING:
        _WRITING[key][1] += 1
        return key
    path = root / f".megatrain-writer-{jax.process_index()}.lock"
    try:
        fd, _ = hold(path)
    except HeldElsewhere as held:
        raise CheckpointFolderBusyError(
            f"checkpoint directory {root} is being written by {held.holder or 'another process'} ({path}): two runs "
            f"saving there would delete each other's checkpoints. Nothing was changed. Wait for that run to end (or "
            f"stop it), or give this one another checkpoint directory") from None
    except OSError as err:
        if err.errno in _NO_LOCKS:
            return None
        raise
    _WRITING[key] = [fd, 1]
    return key


def unlock_folder(key: Path | None) -> None:
    held = _WRITING.get(key) if key is not None else None
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _WRITING[key]
        let_go(held[0])
