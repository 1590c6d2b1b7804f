"""The export at the end of ``megatrain-jax train``, guarded so that it loses nothing: non-finite weights are
never exported, the trained state is on disk before the export starts (the run's checkpoint of its last step,
else a parameters-only copy written first), and an export that fails names its folder, why, and where the
trained state is (docs/checkpoints_faults.md)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np

from megatrain_jax.checkpoint import committed_steps, save_params
from megatrain_jax.checkpoint.failures import WRITE_ADVICE, format_size, free_space, os_error_behind
from megatrain_jax.engine.engine import Engine, NonFiniteError
from megatrain_jax.engine.transfer import host_view
from megatrain_jax.hf import save_hf
from megatrain_jax.models.config import DecoderConfig


class ExportWriteError(OSError):
    """The export could not be written: the message names the folder, the cause and where the trained state
    is kept; ``errno`` is the failed call's, and the OSError its ``__cause__``."""


def first_nonfinite(engine: Engine) -> str | None:
    """The name of the first parameter holding a NaN or an infinity (``io/...`` or ``blocks/3/...``); None when
    every one is finite. Reads every parameter once."""
    io, blocks = engine.parameters()
    for prefix, tree in [("io", io), *((f"blocks/{i}", b) for i, b in enumerate(blocks))]:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not np.isfinite(host_view(leaf)).all():  # a view: np.asarray would keep a copy on the array
                return "/".join([prefix, *(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)])
    return None


def _params_copy_path(run_dir: Path) -> Path:
    path, n = run_dir / "trained_params", 1
    while path.exists():
        path, n = run_dir / f"trained_params.{n}", n + 1
    return path


def _write_params(engine: Engine, path: Path, model_cfg) -> str:
    """Write ``engine``'s parameters to ``path``: a float32 Hugging Face folder for our decoder (written a
    tensor at a time from views of the host state, as the export is: no second copy of the model in memory,
    where an Orbax save held one), else a parameters-only Orbax checkpoint; '' or why it failed."""
    try:
        if isinstance(model_cfg, DecoderConfig):
            save_hf(path, model_cfg, *engine.parameters(), dtype="float32")
        else:
            save_params(path, model_cfg, *engine.parameters())
    except Exception as err:  # noqa: BLE001 - the export may still succeed (another disk): say it, go on
        return f"writing them to {path} failed ({type(err).__name__}: {err})"
    return ""


def _room_for_copy(engine: Engine, run_dir: Path, target: str) -> tuple[bool, str]:
    """Whether the run folder's disk holds a float32 copy of the parameters beside the bfloat16 export (when
    both go to one disk), and if not, the words saying so."""
    params = sum(leaf.size for leaf in jax.tree.leaves(engine.parameters()))
    copy, export = 4 * params, 2 * params
    here, there = free_space(run_dir), free_space(Path(target).parent)
    if here is None:
        return True, ""
    need = copy + (export if there is not None and there[1] == here[1] else 0)
    if here[0] >= 1.1 * need:  # a tenth to spare: the export must not be the write that fills the disk
        return True, ""
    return False, (f"{run_dir}'s disk has {format_size(here[0])} free, less than the copy "
                   f"({format_size(copy)}) and the export need together ({format_size(need)})")


def _kept_state(engine: Engine, checkpoint_folder: Path | None, run_dir: Path, model_cfg, target: str,
                say: Callable[[str], None]) -> tuple[Path | None, str]:
    """Where the trained state is on disk: the run's checkpoint of its last step, else a parameters-only copy
    written now into ``run_dir`` (said); (None, why) when there is none yet (several processes, no room for
    the copy beside the export, or its write failed)."""
    step = int(engine.state.step)
    if checkpoint_folder is not None and step in committed_steps(checkpoint_folder):
        return checkpoint_folder / str(step), ""
    if jax.process_count() > 1:  # each process holds its own rows: only a checkpoint writes them as one
        return None, "several processes hold them, and only a checkpoint (train.checkpoint_every) writes them whole"
    room, why = _room_for_copy(engine, run_dir, target)
    if not room:
        return None, why + "; they are written there only if the export fails"
    path = _params_copy_path(run_dir)
    failed = _write_params(engine, path, model_cfg)
    if failed:
        return None, failed
    say(f"  the trained weights of step {step} are kept in {path} before the export (this run saves no checkpoint "
        f"of its last step; megatrain-jax convert {path} OUT exports them again)")
    return path, ""


@contextlib.contextmanager
def guarded_export(engine: Engine, target: str, checkpoint_folder: Path | None, run_dir: Path, model_cfg,
                   say: Callable[[str], None]) -> Iterator[None]:
    """Around the export of ``engine``'s parameters to ``target``: refuse non-finite weights (``NonFiniteError``:
    nothing is exported, the run's checkpoints are as they were), keep the trained state on disk first
    (``checkpoint_folder``: the run's, None when it saves none), and raise a failed export as
    ``ExportWriteError`` (an OSError behind it) or with a note (any other failure) naming where the state is."""
    bad = first_nonfinite(engine)
    if bad is not None:
        step = int(engine.state.step)
        kept = committed_steps(checkpoint_folder)[:1] if checkpoint_folder is not None else []
        raise NonFiniteError(f"not exporting to {target}: the parameter {bad} holds a NaN or an infinity after step "
                             f"{step}, and a run never exports non-finite weights; nothing was written there. "
                             + (f"The last good checkpoint is {checkpoint_folder / str(kept[0])}. " if kept else "")
                             + "Check the initial weights and the data, or lower the learning rate")
    kept, failed_too = _kept_state(engine, checkpoint_folder, run_dir, model_cfg, target, say)
    if kept is None:
        say(f"  note: the trained weights are not kept on disk before the export: {failed_too}")
    where = (f"the trained state is kept in {kept}" if kept is not None else
             f"the trained state could not be kept on disk: {failed_too}")
    try:
        yield
    except Exception as err:
        if kept is None and jax.process_count() == 1:  # the copy that had no room beside the export: now
            path = _params_copy_path(run_dir)
            failed = _write_params(engine, path, model_cfg)
            kept, where = (None, where) if failed else (path, f"the trained state is kept in {path}")
        cause = os_error_behind(err)
        if cause is None:
            err.add_note(f"the export to {target} failed; {where}")
            raise
        what, todo = WRITE_ADVICE.get(cause.errno, ("a write failed", "fix what the error names in {root}"))
        out = ExportWriteError(f"could not export the trained model to {target}: {what} ({cause}); {where}. To go "
                               f"on: {todo.format(root=Path(target).parent)}, or export to another folder"
                               + (f" (megatrain-jax convert {kept} NEW_FOLDER)" if kept is not None else ""))
        out.errno = cause.errno  # (not strerror or filename: str() would then show them alone)
        raise out from cause
