"""What a checkpoint write that failed means, and what to do about it.

A save into a read-only folder, without permission, onto a full disk, over a quota or onto a failing disk
raises ``CheckpointWriteError`` on the training thread: an ``OSError`` (``errno`` the failed call's) whose
message names the cause, the newest committed checkpoint (which a failed save never touches) and what to
change. The command line exits with status 2 on it. Behaviour and bounds: docs/checkpoints_faults.md.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: a read-only folder, no permission, a full disk, an exceeded quota
    or an I/O error (``errno`` is the failed call's). The message says which, names the newest committed
    checkpoint (which the failed save did not touch) and what to do. The OSError is its ``__cause__``."""


# errno -> (what it means, what to do); {root} is the checkpoint directory.
WRITE_ADVICE = {
    errno.EROFS: ("the file system is read-only", "make {root} writable"),
    errno.EACCES: ("no permission to write there", "give this user write permission on {root}"),
    errno.EPERM: ("no permission to write there", "give this user write permission on {root}"),
    errno.ENOSPC: ("the disk is full", "free space on the disk of {root}"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space within the quota of {root}, or raise it"),
    errno.EIO: ("the disk reported an I/O error", "check the disk of {root} (dmesg says more)"),
}


# TensorStore, which writes Orbax's arrays, raises a failed write as a ValueError (no errno) whose message ends
# with the OS error's code: 'RESOURCE_EXHAUSTED: Error writing local file "<dir>/d/<id>": Failed writing:
# "<file>": Failed to write 349813 bytes to file 20: No space left on device [os_error_code='28']'.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)'?\]")
_TENSORSTORE_FILE = re.compile(r'(?:local file|Failed writing:) "([^"]+)"')


def tensorstore_os_error(err: BaseException) -> OSError | None:
    """The OSError behind a TensorStore write error (``_TENSORSTORE_OS_ERROR``), naming the file it names; None
    for any other error."""
    found = _TENSORSTORE_OS_ERROR.search(str(err)) if isinstance(err, ValueError) else None
    if found is None:
        return None
    code = int(found.group(1))
    files = _TENSORSTORE_FILE.findall(str(err))
    return OSError(code, os.strerror(code), files[-1]) if files else OSError(code, os.strerror(code))


def os_error_behind(err: BaseException | None) -> OSError | None:
    """The first OSError with an errno in ``err``'s ``__cause__``/``__context__`` chain (``err`` included); a
    TensorStore write error counts as the OSError it reports."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        from_tensorstore = tensorstore_os_error(err)
        if from_tensorstore is not None:
            return from_tensorstore
        err = err.__cause__ or err.__context__
    return None


def format_size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps a figure of at least 1 (``512 B``, ``1.5 KiB``, ``3.0 GiB``):
    a small size never reads as ``0.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def free_space(folder: Path) -> tuple[int, int] | None:
    """(free bytes for this user, file system id) where ``folder`` is or would be (its nearest existing parent);
    None when the system does not say: an error, or a file system that reports no size at all (0 blocks: /proc,
    /sys, some FUSE mounts), whose 0 bytes free mean nothing about room."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        usage = shutil.disk_usage(folder)
        return (usage.free, os.stat(folder).st_dev) if usage.total else None
    except OSError:
        return None


def write_error(err: BaseException, target: Path, root: Path, last_good: Path | None,
                needed: int | None = None) -> CheckpointWriteError | None:
    """``err``, met writing ``target`` under the checkpoint directory ``root``, as a ``CheckpointWriteError``
    when an OSError with an errno is behind it (a TensorStore write error included); None for any other failure
    (a bug: raise it as it is). ``needed``: the bytes the checkpoint takes, said with the free space when the
    disk is full or the quota used up."""
    cause = os_error_behind(err)
    if cause is None:
        return None
    if isinstance(cause, CheckpointWriteError):
        return cause
    what, todo = WRITE_ADVICE.get(cause.errno, ("a write failed", "fix what the error names in {root}"))
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        space = free_space(root)
        free = None if space is None else space[0]
        space = ([f"the checkpoint takes about {format_size(needed)}"] if needed else []) + (
            [f"{format_size(free)} free there now"] if free is not None else [])
        what += f" ({'; '.join(space)})" if space else ""
    kept = (f"the checkpoints committed before are untouched (the newest: {last_good})" if last_good is not None
            else "no checkpoint had been committed")
    again = f"then resume from {last_good} (train.resume)" if last_good is not None else "then run again"
    out = CheckpointWriteError(f"could not write checkpoint {target}: {what} ({cause}); {kept}. To go on: "
                               f"{todo.format(root=root)}, or set train.checkpoint_dir to a writable folder; {again}")
    out.errno = cause.errno  # (not strerror: str() would then show it alone)
    out.__cause__ = cause
    return out


def probe_writable(root: Path, name: str) -> None:
    """Create and remove the directory ``root/name``: raises the OSError a save would meet now (read-only,
    no permission, no space or inodes). Met here, on the training thread, it never reaches Orbax, whose
    writer threads would wait (300 s) for a step directory that was never created."""
    probe = root / name
    if probe.exists():  # left by a process killed between the two calls
        shutil.rmtree(probe)
    probe.mkdir()
    probe.rmdir()


__all__ = ["CheckpointWriteError", "WRITE_ADVICE", "format_size", "free_space", "os_error_behind", "probe_writable",
           "tensorstore_os_error", "write_error"]
