"""Every path ``megatrain-jax train`` writes, checked before the run starts: a run must never train for hours and
then find that its export folder's parent is a file or its metrics file cannot be written. A refusal says why: no
permission, a read-only file system, a special one such as /proc; never a full disk that is not one."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from megatrain_jax.cli.run_config import TrainSection


class OutputPathError(ValueError):
    """A path the run would write cannot be written; the message names the path and its config field."""


# Why a path cannot be written, and what to do ({key}: its config field). A read-only mount and a special file
# system (no blocks: /proc, /sys) are told by the file system itself (``os.statvfs``), whatever errno its refusal
# carries (/proc says ENOENT, /sys EPERM); the rest by the errno.
READ_ONLY = ("read-only file system", "Set {key} to a folder on a writable disk, or remount that one read-write")
SPECIAL = ("a special file system such as /proc or /sys, not a disk", "Set {key} to a folder on a disk")
NO_PERMISSION = ("no permission", "Make it writable, or set {key} to another path")
NO_SPACE = ("no space or inodes left on its disk", "Free space there, or set {key} to a folder on another disk")
BY_ERRNO = {errno.EROFS: READ_ONLY, errno.EACCES: NO_PERMISSION, errno.EPERM: NO_PERMISSION, errno.ENOSPC: NO_SPACE,
            errno.EDQUOT: ("its disk quota is used up", NO_SPACE[1])}


def _cause(path: Path, err: OSError) -> tuple[str, str]:
    """(why, what to do) for ``err``, met writing at ``path``."""
    try:
        fs = os.statvfs(path)
    except OSError:
        fs = None
    if err.errno == errno.EROFS or (fs is not None and fs.f_flag & os.ST_RDONLY):
        return READ_ONLY
    if fs is not None and fs.f_blocks == 0:
        return SPECIAL
    return BY_ERRNO.get(err.errno, (err.strerror or str(err), "Set {key} to another path"))


def write_problem(folder: Path) -> tuple[str, str] | None:
    """Why nothing can be created in the existing folder ``folder``, and what to do (``{key}`` left to fill in);
    None when it can. The kernel is asked: a folder is created there and removed at once, so nothing is left, and
    every cause (a read-only mount, /proc, permissions, ACLs, no inodes) is met as a save would meet it."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatrain-path-probe-", dir=folder))
    except OSError as err:
        return _cause(folder, err)
    return None


def output_paths(t: TrainSection) -> list[tuple[str, Path, bool]]:
    """``(field, path, is_folder)`` of what the run writes: its folder, its metrics file, its checkpoint folder
    (when it saves or resumes checkpoints) and its export folder."""
    run_dir = Path(t.run_dir)
    out = [("train.run_dir", run_dir, True), ("train.run_dir (its metrics.jsonl)", run_dir / "metrics.jsonl", False)]
    if t.for_fit().checkpointing:
        out.append(("train.checkpoint_dir" if t.checkpoint_dir else "train.run_dir (its checkpoints/)",
                    t.checkpoint_folder(), True))
    if t.export_hf:
        out.append(("train.export_hf", Path(t.export_hf), True))
    return out


def check_output_path(field: str, path: Path, is_folder: bool) -> None:
    """Refuse ``path`` (``field``'s) when the run could not write it: it exists as the wrong kind (a file where a
    folder goes, or the other way round) or cannot be written (no permission, a read-only file system), or the
    nearest part of it that exists is a file or cannot be written into (``write_problem``: also a special file
    system such as /proc). Each refusal says which, never a lack of space that is not one."""
    path, key = path.absolute(), field.split()[0]
    if path.exists():
        if path.is_dir() != is_folder:
            wrong, kind = ("file", "folder") if is_folder else ("folder", "file")
            raise OutputPathError(f"{field} = {path}: {path} is a {wrong}, not a {kind}; nothing was changed. "
                                  + (f"Set {key} to a folder, or move the file away" if is_folder else
                                     f"Move the folder away, or set {key} to another folder"))
        problem = write_problem(path) if is_folder else (
            None if os.access(path, os.W_OK) else _cause(path, PermissionError(errno.EACCES, "no permission")))
        if problem is not None:
            raise OutputPathError(f"{field} = {path}: it cannot be written ({problem[0]}); nothing was changed. "
                                  f"{problem[1].format(key=key)}")
        return
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
        raise OutputPathError(f"{field} = {path}: its parent {parent} is a file, not a folder, so it cannot be "
                              f"created; nothing was changed. Set {key} to another path, or move the file away")
    problem = write_problem(parent)
    if problem is not None:
        raise OutputPathError(f"{field} = {path}: it cannot be created in {parent} ({problem[0]}); nothing was "
                              f"changed. {problem[1].format(key=key)}")


def check_export_apart(t: TrainSection) -> None:
    """Refuse an export folder that is the run's folder or its checkpoint folder: the model's ``config.json`` and
    weights would lie among the run's own files, and ``convert`` of that folder would read the export."""
    if not t.export_hf:
        return
    export = Path(t.export_hf).resolve()
    for field, folder, is_folder in output_paths(t):
        if is_folder and field != "train.export_hf" and export == folder.resolve():
            raise OutputPathError(f"train.export_hf = {t.export_hf} is the folder of {field}: the exported model "
                                  f"would lie among the run's own files; nothing was changed. Set train.export_hf "
                                  f"to a folder of its own, such as {folder / 'hf'}")


def check_output_paths(t: TrainSection) -> None:
    """``check_export_apart``, then ``check_output_path`` for each of ``output_paths(t)``."""
    check_export_apart(t)
    for field, path, is_folder in output_paths(t):
        check_output_path(field, path, is_folder)
