"""Whether the disks a run writes to have room for what it will write there, checked when ``train`` starts: a
run whose checkpoints, disk tier or export cannot fit is refused before it trains, saying the bytes, rather than
failing hours later (the failure paths still hold: ``checkpoint.failures``, ``export_guard``).

What is counted, per file system (the free space of each, once):

- checkpoints (``train.checkpoint_every``, ``resume`` or ``checkpoint_dir``): each holds the masters and the
  moments as the precision mode keeps them (``Precision.bytes_per_param``); as many as can be on disk at once
  (``peak_checkpoints``), less those already there, and no more than the run will save;
- the disk tier (``engine.disk_parts``): its blocks' Adam moments in files under ``engine.disk_dir``, as they are
  laid out there (``disk_tier_bytes``), less those files already there (a stopped run's, which a resume replaces
  array by array: ``disk_tier.held_bytes``);
- the Hugging Face export (``train.export_hf``): bfloat16 weights, 2 bytes per parameter. (Not the float32 copy
  of the weights ``export_guard`` keeps in the run folder before an export without a checkpoint of the last
  step: it writes that only where there is room, and says so.)

A folder that cannot be written at all (a read-only file system, /proc, a file on the way) is said as that, not as
a full disk (``output_paths.write_problem``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.checkpoint.failures import format_size, free_space
from megatrain_jax.cli.output_paths import OutputPathError, write_problem
from megatrain_jax.cli.run_config import TrainSection
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.precision import DTYPE_BYTES
from megatrain_jax.engine.update import disk_tier
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.plan.counts import host_roles, leaf_shapes


class Write(NamedTuple):
    """What a run may hold on disk at once in one folder, beyond what is there now; ``key``: the setting that
    puts it there."""

    folder: Path
    nbytes: int
    what: str
    key: str


def checkpoint_bytes(model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> int:
    """About the bytes of one checkpoint: masters and moments as the precision mode keeps them."""
    per = engine_cfg.precision.bytes_per_param()
    return int(model_cfg.param_count() * (per["masters"] + per["moments"]))


def peak_checkpoints(keep: int, every: int) -> int:
    """The most checkpoints on disk at once while the run trains with ``checkpoint_keep = keep`` and
    ``checkpoint_every = every``, the one being written included.

    ``Checkpointer.prune`` runs only when a save commits, and the next save starts only after that, so the peak is
    what a prune kept plus the save in flight. A prune keeps the newest ``keep`` and every step from the newest
    known-good one on. A checkpoint is known good once the step after it trained finite, which the session learns
    from that step's metrics, reported one step late (``CheckpointSession.after_step``). The save of step s starts
    at the hook that reports step s - 1 and may commit, and prune, before step s + 1 is reported: with only
    s - every known good (every >= 2), which keeps s - every and s (2), or s - 2 (every = 1), which keeps s - 2,
    s - 1 and s (3). So ``keep = 1`` holds 2 (3 with ``every = 1``) plus the one written; the run's end prunes back
    to ``keep``. (Steps skipped as non-finite hold a known-good one longer; such a run stops.)"""
    return max(keep, 3 if every == 1 else 2) + 1


def disk_tier_bytes(model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> int:
    """Bytes of the disk tier's files: m and v of each leaf of the ``engine.disk_parts`` blocks, in the mode's
    moment dtype, as ``disk_tier.DiskTier`` lays them out: zarr chunks of whole rows (about ``CHUNK_BYTES``), the
    last chunk stored whole. (The memory plan's ``disk`` figure, plus that padding.)"""
    parts = host_roles(model_cfg, engine_cfg).disk
    if not parts:
        return 0
    itemsize = DTYPE_BYTES[engine_cfg.precision.moments]
    total = 0
    for part in parts:
        for shape in leaf_shapes(model_cfg, part):
            rows = disk_tier.chunk_rows(shape, itemsize)
            total += 2 * math.ceil(shape[0] / rows) * rows * math.prod(shape[1:]) * itemsize  # m and v
    return total


def writes(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> list[Write]:
    """(folder, bytes, what, key) of everything this run may hold on disk at once beyond what is there now."""
    out = []
    fit = t.for_fit()
    if fit.checkpoint_dir is not None:
        folder = Path(fit.checkpoint_dir)
        size = checkpoint_bytes(model_cfg, engine_cfg)
        there = len(committed_steps(folder)) if folder.is_dir() else 0
        saves = math.ceil(t.steps / t.checkpoint_every) + 1 if t.checkpoint_every else 1  # and one at the end
        peak = peak_checkpoints(t.checkpoint_keep, t.checkpoint_every)
        # those there stay until the first save commits: that save needs room for one more at least
        count = max(1, min(saves, peak - there))
        out.append(Write(folder, count * size, f"{count} checkpoint{'s' if count > 1 else ''} of about "
                                               f"{format_size(size)} (train.checkpoint_keep = {t.checkpoint_keep}, "
                                               f"train.checkpoint_every = {t.checkpoint_every}: up to {peak} on disk "
                                               f"at once; {there} already there)", "train.checkpoint_dir"))
    tier = disk_tier_bytes(model_cfg, engine_cfg)
    if tier:
        n = engine_cfg.disk_parts
        there = disk_tier.held_bytes(engine_cfg.disk_dir, host_roles(model_cfg, engine_cfg).disk)
        what = f"the disk tier's files (the Adam moments of {n} block{'s' if n > 1 else ''}, engine.disk_parts" + (
            f": {format_size(tier)}, {format_size(there)} of it already there, which it replaces)" if there else ")")
        out.append(Write(Path(engine_cfg.disk_dir), max(0, tier - there), what, "engine.disk_dir"))
    if t.export_hf:
        params = model_cfg.param_count()
        out.append(Write(Path(t.export_hf).parent, 2 * params, "the Hugging Face export (bfloat16)",
                         "train.export_hf"))
    return out


def _write_problem(folder: Path) -> tuple[Path, tuple[str, str]] | None:
    """(the folder that cannot be written, why and what to do) where nothing can be created in ``folder``, or in
    its nearest parent that exists when it does not: a file there too (``check_output_paths`` says it first for
    the train section's paths; engine.disk_dir is said here)."""
    at = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    problem = (write_problem(at) if at.is_dir() else
               ("a file, not a folder", "Set {key} to a folder, or move the file away"))
    return None if problem is None else (at, problem)


def disk_lines(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> list[str]:
    """What this run would write on disk, a line each, with the free space there (``megatrain-jax plan``)."""
    lines = []
    for folder, size, what, _ in writes(t, model_cfg, engine_cfg):
        problem = _write_problem(folder)
        space = free_space(folder)
        room = (f"CANNOT BE WRITTEN ({problem[1][0]})" if problem is not None else
                "free space unknown" if space is None else
                f"{format_size(space[0])} free there: {'fits' if size <= space[0] else 'DOES NOT FIT'}")
        lines.append(f"  disk: {what} in {folder}: {format_size(size)}; {room}")
    return lines


def check_disk_room(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> None:
    """Raise ValueError, saying the bytes and what to change, where a disk this run writes to has less free space
    than what it will write there (``OutputPathError`` where a folder cannot be written at all: a read-only file
    system, /proc, a file on the way); the space is not checked where the system does not say it."""
    need: dict[int, list] = {}
    for folder, size, what, key in writes(t, model_cfg, engine_cfg):
        problem = _write_problem(folder)
        if problem is not None:  # never said as a full disk
            at, (why, todo) = problem
            raise OutputPathError(f"{what} would be written in {folder} ({key}), but nothing can be created in {at} "
                                  f"({why}); nothing was trained. {todo.format(key=key)}")
        space = free_space(folder)
        if space is None:
            continue
        entry = need.setdefault(space[1], [space[0], 0, []])
        entry[1] += size
        entry[2].append(f"{what} in {folder}")
    for free, total, whats in need.values():
        if total > free:
            raise ValueError(
                f"not enough disk for this run: {'; '.join(whats)} need {format_size(total)} on one disk, which "
                f"has {format_size(free)} free. Free space there, or point train.checkpoint_dir, train.export_hf, "
                f"train.run_dir or engine.disk_dir at a disk with room, or keep fewer checkpoints "
                f"(train.checkpoint_keep); nothing was trained")
