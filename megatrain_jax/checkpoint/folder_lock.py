"""One writing process per checkpoint folder. Two runs saving into one folder (a job requeued while the first still
runs) would delete each other's steps (keep-N) and each other's unfinished saves, so each writing ``Checkpointer``
holds an advisory lock on the folder while it lives: ``flock``, which the kernel drops when its process dies, however
it dies. A file system that cannot lock leaves the run unguarded, as before."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

import jax


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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointFolderBusyError(
            f"checkpoint directory {root} is being written by {holder} ({path}): two runs saving there would delete "
            f"each other's checkpoints. Nothing was changed. Wait for that run to end (or stop it), or give this one "
            f"another checkpoint directory") from None
    except OSError as err:
        os.close(fd)
        if err.errno in _NO_LOCKS:
            return None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                  f"{datetime.datetime.now().isoformat(timespec='seconds')}\n".encode(), 0)
    _WRITING[key] = [fd, 1]
    return key


def unlock_folder(key: Path | None) -> None:
    held = _WRITING.get(key) if key is not None else None
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _WRITING[key]
        os.ftruncate(held[0], 0)
        os.close(held[0])  # the lock goes with its last descriptor
