"""Whether the disks a run writes to have room for what it will write there, checked when ``train`` starts: a
run whose first checkpoint, or whose export at the end, cannot fit is refused before it trains, saying the
bytes, rather than failing hours later (the failure paths still hold: ``checkpoint.failures``, ``export_guard``).

What is counted, per file system (the free space of each, once):

- checkpoints (``train.checkpoint_every``, ``resume`` or ``checkpoint_dir``): each holds the masters and the
  moments as the precision mode keeps them (``Precision.bytes_per_param``); one more than ``checkpoint_keep``
  may be on disk while the newest is written and before the oldest goes, less those already there, and no more
  than the run will save;
- the Hugging Face export (``train.export_hf``): bfloat16 weights, 2 bytes per parameter. (Not the float32 copy
  of the weights ``export_guard`` keeps in the run folder before an export without a checkpoint of the last
  step: it writes that only where there is room, and says so.)
"""

from __future__ import annotations

import math
from pathlib import Path

from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.checkpoint.failures import free_space
from megatrain_jax.cli.run_config import TrainSection
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models.config import DecoderConfig

GiB = 2**30


def checkpoint_bytes(model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> int:
    """About the bytes of one checkpoint: masters and moments as the precision mode keeps them."""
    per = engine_cfg.precision.bytes_per_param()
    return int(model_cfg.param_count() * (per["masters"] + per["moments"]))


def writes(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> list[tuple[Path, int, str]]:
    """(folder, bytes, what) of everything this run may hold on disk at once beyond what is there now."""
    out = []
    fit = t.for_fit()
    if fit.checkpoint_dir is not None:
        folder = Path(fit.checkpoint_dir)
        size = checkpoint_bytes(model_cfg, engine_cfg)
        there = len(committed_steps(folder)) if folder.is_dir() else 0
        saves = math.ceil(t.steps / t.checkpoint_every) + 1 if t.checkpoint_every else 1  # and one at the end
        count = max(1, min(saves, t.checkpoint_keep + 1 - min(there, t.checkpoint_keep)))
        out.append((folder, count * size, f"{count} checkpoint{'s' if count > 1 else ''} of about "
                                          f"{size / GiB:.1f} GiB (train.checkpoint_keep = {t.checkpoint_keep}, "
                                          f"{there} already there)"))
    if t.export_hf:
        params = model_cfg.param_count()
        out.append((Path(t.export_hf).parent, 2 * params, "the Hugging Face export (bfloat16)"))
    return out


def disk_lines(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> list[str]:
    """What this run would write on disk, a line each, with the free space there (``megatrain-jax plan``)."""
    lines = []
    for folder, size, what in writes(t, model_cfg, engine_cfg):
        space = free_space(folder)
        room = ("free space unknown" if space is None else
                f"{space[0] / GiB:.1f} GiB free there: {'fits' if size <= space[0] else 'DOES NOT FIT'}")
        lines.append(f"  disk: {what} in {folder}: {size / GiB:.1f} GiB; {room}")
    return lines


def check_disk_room(t: TrainSection, model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> None:
    """Raise ValueError, saying the bytes and what to change, where a disk this run writes to has less free space
    than what it will write there; nothing is checked where the system does not say its free space."""
    need: dict[int, list] = {}
    for folder, size, what in writes(t, model_cfg, engine_cfg):
        space = free_space(folder)
        if space is None:
            continue
        entry = need.setdefault(space[1], [space[0], 0, []])
        entry[1] += size
        entry[2].append(f"{what} in {folder}")
    for free, total, whats in need.values():
        if total > free:
            raise ValueError(
                f"not enough disk for this run: {'; '.join(whats)} need {total / GiB:.1f} GiB on one disk, which has "
                f"{free / GiB:.1f} GiB free. Free space there, or point train.checkpoint_dir, train.export_hf or "
                f"train.run_dir at a disk with room, or keep fewer checkpoints (train.checkpoint_keep); nothing "
                f"was trained")
