"""The run folder of ``megatrain-jax train``: what in it belongs to a run, the refusal of a fresh start where one is,
what a resume goes on from (said before it trains), ``metrics.jsonl`` rebuilt where a resumed run lost it
(``rebuild_metrics``), and ``config.toml`` (``config.N.toml`` beside it when a resumed
run's configuration changed)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from megatrain_jax import fit_history
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.cli.run_config import RunConfig, parse_config, to_toml
from megatrain_jax.observe.metrics import free_name, read_metrics, write_whole

# What a resume compares with the run it continues and says where it differs: the optimizer and the schedule's
# length (the learning-rate schedule is laid out over train.steps), and the clipping threshold. Changing them is
# allowed (lowering the rate after a spike, a longer run) but never silent.
SCHEDULE_KEYS = ("optimizer", "train.steps", "engine.clip_norm")


class RunFolderError(FileExistsError):
    """The run folder (or its checkpoint directory) already holds a run that this one would overwrite."""


def run_files(run_dir: Path, ckpt_dir: Path | None = None) -> list[str]:
    """What in ``run_dir`` belongs to a run: ``metrics.jsonl``, ``config.toml``, and the committed checkpoints
    of ``ckpt_dir`` (default ``run_dir/checkpoints``). Empty when the folder holds no run."""
    ckpt_dir = run_dir / "checkpoints" if ckpt_dir is None else ckpt_dir
    steps = committed_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    held = [name for name in ("metrics.jsonl", "config.toml") if (run_dir / name).exists()]
    return held + ([f"checkpoints of steps {steps} in {ckpt_dir}"] if steps else [])


def prepare_run_folder(cfg: RunConfig) -> str | None:
    """Refuse to start a fresh run where one exists; when resuming, refuse a folder whose files the run would
    fail to go on writing, or whose run saved its checkpoints where this command does not look. Creates the
    folder, and changes nothing in it: a refused start leaves it as it was. Returns a note to say before training
    (a resume that starts over, or that changes the optimizer or the schedule), or None.

    A folder holds a run when it has ``metrics.jsonl``, ``config.toml`` or committed checkpoints. Without
    ``train.resume`` that is an error naming the ways on. A resumed run keeps what the earlier ones wrote,
    once it has started: records of ``metrics.jsonl`` it would write anew are kept in ``metrics.N.jsonl``
    (``JsonlWriter``), a changed configuration is written as ``config.N.toml`` (``write_config``)."""
    t = cfg.train
    run_dir, ckpt_dir = Path(t.run_dir), t.checkpoint_folder()
    held = run_files(run_dir, ckpt_dir)
    recorded = last_config(run_dir)
    saved_to = _checkpoint_folder(recorded, run_dir)
    if held and not t.resume:
        if committed_steps(saved_to) or committed_steps(ckpt_dir):
            how = "add train.resume=true" + (f" train.checkpoint_dir={saved_to}" if saved_to != ckpt_dir.absolute()
                                             else "")
            on = f"To continue it, {how}; to start a new run"
        else:
            on = ("It saved no checkpoint (train.checkpoint_every was not set), so it cannot be continued. To train "
                  "again")
        raise RunFolderError(f"run folder {run_dir} already holds a run ({', '.join(held)}); nothing was changed. "
                             f"{on}, set train.run_dir to a new folder")
    if not t.resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        return None
    # what the run goes on writing must be readable before it trains, not after
    _check_readable(run_dir / "config.toml", lambda path: tomllib.loads(path.read_text()))
    _check_readable(run_dir / "metrics.jsonl", read_metrics)
    notes = []
    if t.resume is True and not committed_steps(ckpt_dir):
        if saved_to != ckpt_dir.absolute() and committed_steps(saved_to):
            raise RunFolderError(
                f"train.resume=true looks for checkpoints in {ckpt_dir}, which holds none, but the run in {run_dir} "
                f"saved its checkpoints to {saved_to} (steps {committed_steps(saved_to)}); nothing was changed. To "
                f"continue it, add train.checkpoint_dir={saved_to}")
        trained = _steps_trained(run_dir)
        if trained:
            notes.append(f"the run in {run_dir} trained {trained} step(s) but left no checkpoint in {ckpt_dir} "
                         f"(train.checkpoint_every unset, or stopped before its first save): this run starts from "
                         f"step 0; the earlier metrics are kept in a metrics.N.jsonl beside metrics.jsonl")
    if recorded is not None:
        then = saved_value(recorded, "model", "hf_checkpoint")
        if then and then != cfg.model.hf_checkpoint and not Path(then).exists():
            now = cfg.model.hf_checkpoint or f"the preset {cfg.model.preset!r}"
            gone = ("is not found from this working directory (a relative path, read from where the run started)"
                    if not Path(then).is_absolute() else "no longer exists (moved or deleted since it started)")
            notes.append(f"the run's model.hf_checkpoint {then} {gone}; this run's model is {now}, whose shapes the "
                         f"checkpoint's weights are checked against")
        changed = schedule_changes(recorded, cfg)
        if changed:
            notes.append("resuming with another optimizer or schedule than the run had (the moments go on; the "
                         "settings are this command's): " + "; ".join(
                             f"{k} {a} then, {b} now" for k, (a, b) in changed.items())
                         + (". The learning-rate schedule is laid out over the new train.steps"
                            if "train.steps" in changed else ""))
    run_dir.mkdir(parents=True, exist_ok=True)
    return "\n".join(f"  note: {n}" for n in notes) or None


def rebuild_metrics(run_dir: Path, ckpt_dir: Path, step: int) -> str | None:
    """A resumed run's ``metrics.jsonl`` where its run folder has none (deleted, or made anew beside a checkpoint
    folder that was kept): the records of steps 1 to ``step``, the step it resumes from, out of the steps' log kept
    beside the checkpoints (``fit_history``, cut back to the resumed line at every start, so no step of a line
    given up comes back), so that it goes on holding the line of training being continued. Those rows have no
    ``time`` and ``elapsed_s`` (``metrics.jsonl``'s own). Written whole (a temporary name, then renamed); returns
    the sentence to say, None where nothing was written (a file there, a fresh start, no log)."""
    path = run_dir / "metrics.jsonl"
    if step <= 0 or path.exists():
        return None
    by_step = {r["step"]: r for r in fit_history.read(ckpt_dir) if type(r.get("step")) is int and 0 < r["step"] <= step}
    if not by_step:
        return None
    write_whole(path, "".join(json.dumps(by_step[n]) + "\n" for n in sorted(by_step)))
    held = f"steps {min(by_step)} to {max(by_step)}" if len(by_step) == max(by_step) - min(by_step) + 1 else \
        f"{len(by_step)} steps of 1 to {step}"
    return (f"{path} was missing: its records of {held} were rebuilt from {ckpt_dir / fit_history.FILE} (without "
            f"their time and elapsed_s)")


def last_config(run_dir: Path) -> dict | None:
    """The configuration the last run in ``run_dir`` wrote (the newest of ``config.toml``, ``config.N.toml``), read
    with today's defaults (``_resolved``); None where there is none or it no longer reads."""
    def number(path: Path) -> int:
        m = re.fullmatch(r"config\.(\d+)\.toml", path.name)
        return int(m.group(1)) if m else 0
    found = sorted((p for p in run_dir.glob("config*.toml") if number(p) or p.name == "config.toml"), key=number)
    return _resolved(found[-1].read_text()) if found else None


def schedule_changes(recorded: dict, cfg: RunConfig) -> dict[str, tuple]:
    """``{key: (value then, value now)}`` of ``SCHEDULE_KEYS`` where this run's config differs from ``recorded``
    (``last_config``)."""
    now = _without_resume(tomllib.loads(to_toml(cfg)))
    out = {}
    for key in SCHEDULE_KEYS:
        section, _, name = key.partition(".")
        a, b = recorded.get(section, {}), now.get(section, {})
        pairs = {f"{section}.{k}": (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))} if not name else {
            key: (a.get(name), b.get(name))}
        out.update({k: v for k, v in pairs.items() if v[0] != v[1]})
    return out


def _checkpoint_folder(recorded: dict | None, run_dir: Path) -> Path:
    """Where the run ``recorded`` (``last_config``) saved its checkpoints: its ``checkpoint_dir``, else
    ``run_dir/checkpoints``."""
    where = saved_value(recorded, "train", "checkpoint_dir")
    return Path(where or run_dir / "checkpoints").absolute()


def saved_value(recorded: dict | None, section: str, key: str) -> Any:
    """``[section] key`` of ``recorded`` (a saved config.toml as ``last_config`` reads it), None where it is unset:
    TOML has no null, and ``to_toml`` writes an unset value as "none"."""
    value = (recorded or {}).get(section, {}).get(key)
    return None if value == "none" else value


def _steps_trained(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir / "metrics.jsonl"))
    except FileNotFoundError:
        return 0


def _check_readable(path: Path, read) -> None:
    """Refuse to resume into a run folder whose ``path`` exists but ``read(path)`` fails: the run would train, then
    fail when it writes there."""
    if not path.exists():
        return
    try:
        read(path)
    except (ValueError, UnicodeDecodeError) as e:  # tomllib.TOMLDecodeError and read_metrics' errors are ValueErrors
        raise RunFolderError(f"cannot resume in {path.parent}: {path} is damaged ({e}); nothing was changed. Fix "
                             f"it or move it aside, then run the same command again") from None


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """``config.toml``, or ``config.N.toml`` next to it when a resumed run's configuration differs."""
    path, text = run_dir / "config.toml", to_toml(cfg)
    if path.exists() and _resolved(path.read_text()) != _without_resume(tomllib.loads(text)):
        path = free_name(path)
    if not path.exists():
        path.write_text(text)


def _resolved(text: str) -> dict | None:
    """A saved ``config.toml`` read back with today's defaults, as ``to_toml`` writes it: a file written before a
    section or key existed (``[dpo]``, say) is the same run as long as its values are; None where it no longer
    reads (a key since removed), which counts as a change. A ``model.hf_checkpoint`` folder is not read (what is
    saved of the model is its path and overrides, compared as written): one moved or deleted since the run
    started leaves the rest of its config to compare."""
    try:
        return _without_resume(tomllib.loads(to_toml(parse_config(_without_resume(tomllib.loads(text)),
                                                                   "the run folder's config.toml", hf_folder=False))))
    except (ValueError, OSError):  # ConfigError and TOMLDecodeError are ValueErrors
        return None


def _without_resume(raw: dict) -> dict:
    raw.get("train", {}).pop("resume", None)  # resuming is how the run goes on, not a change of the run
    return raw
