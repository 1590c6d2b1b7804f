"""Every path ``megatrain-jax train`` writes, checked before the run starts: a run must never train for hours and
then find that its export folder's parent is a file or its metrics file cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

from megatrain_jax.cli.run_config import TrainSection


class OutputPathError(ValueError):
    """A path the run would write cannot be written; the message names the path and its config field."""


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
    folder goes, or the other way round) or without write permission, or the nearest part of it that exists is a
    file or cannot be written into."""
    path, key = path.absolute(), field.split()[0]
    if path.exists():
        if path.is_dir() != is_folder:
            wrong, kind = ("file", "folder") if is_folder else ("folder", "file")
            raise OutputPathError(f"{field} = {path}: {path} is a {wrong}, not a {kind}; nothing was changed. "
                                  + (f"Set {key} to a folder, or move the file away" if is_folder else
                                     f"Move the folder away, or set {key} to another folder"))
        if not os.access(path, os.W_OK):
            raise OutputPathError(f"{field} = {path}: it cannot be written (no permission); nothing was changed. "
                                  f"Make it writable, or set {key} to another path")
        return
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
        raise OutputPathError(f"{field} = {path}: its parent {parent} is a file, not a folder, so it cannot be "
                              f"created; nothing was changed. Set {key} to another path, or move the file away")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{field} = {path}: it would be created in {parent}, which cannot be written (no "
                              f"permission); nothing was changed. Make it writable, or set {key} to another path")


def check_output_paths(t: TrainSection) -> None:
    """``check_output_path`` for each of ``output_paths(t)``."""
    for field, path, is_folder in output_paths(t):
        check_output_path(field, path, is_folder)
