"""Checkpointing as ``fit`` uses it: resume (engine state and data position), periodic and final saves,
and save-then-exit on SIGTERM/SIGINT/SIGHUP. ``fit`` only calls ``check``, ``start``, ``after_step``, ``finish`` and
``running``; a researcher driving ``Engine.steps`` directly can call them the same way.

Failures: a save that failed is raised at the next step (``after_step`` checks), a failed write as
``CheckpointWriteError``. After a stop signal a save that makes no progress for ``STOP_STALL_S`` seconds is
abandoned, and ``CheckpointedExit`` names the last complete checkpoint instead (docs/checkpoints_faults.md).

Steps: ``engine.steps`` reports step k after step k+1 is launched, so when a hook runs the engine state
(and the data consumed) are at step k+1 (``StepInfo.params_step``). Saves therefore use that step, never
the metric's, and a save there is consistent with the data iterator's state at that moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from megatrain_jax.models.config import EFFECTIVE_FIELDS, DecoderConfig
from megatrain_jax.checkpoint.manager import (Checkpointer, CorruptCheckpointError, check_step, committed_steps,
                                              split_step_dir)

# SIGHUP too: a closed terminal or ssh session ends the run as a scheduler's SIGTERM does, checkpoint saved
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# After a stop signal, a save whose writer makes no progress (a part written, 16 MiB of the manifest's
# checksums, the commit) for this long is abandoned: a stopped run then ends within this bound plus the step
# in flight, even on a file system that hangs. A part that takes longer to write (over ~6 GB at 100 MB/s)
# needs a larger bound: CheckpointSession(stop_stall_s=...), or this constant for fit.
STOP_STALL_S = 60.0


class CheckpointedExit(SystemExit):
    """Raised by ``fit`` after a SIGTERM/SIGINT/SIGHUP once the stopped step's checkpoint is committed. Its exit
    status is the shell's for the signal, 128 + its number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP), so that a
    scheduler can tell a preempted run from a finished one (0).

    ``abandoned``: the last save made no progress for ``STOP_STALL_S`` after the signal and was given up;
    ``step``/``path`` are then the last complete checkpoint's (``path`` None when there is none), and a
    writer thread may still be stuck in the file system (the CLI ends the process with ``os._exit``)."""

    def __init__(self, signal_name: str, step: int | None, path: Path | None, abandoned: bool = False):
        super().__init__(128 + signal.Signals[signal_name].value)
        self.signal_name, self.step, self.path, self.abandoned = signal_name, step, path, abandoned
        self.history = None  # set by fit: the metrics of the steps trained in this process


def jsonable(x: Any) -> Any:
    """Dataclasses, dicts and sequences of plain values as JSON values; anything else by its repr."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


# Model config fields (a table's as ``table.field``) that a resume may change: how the model is computed or
# bounded (the compute dtype: a checkpoint holds the masters and optimizer state, and the 16-bit stream
# copies are made again from them; the attention kernel, the chunk sizes, max_positions and max_segments, which
# only bound the batches), training choices (a mixture of experts' load-balancing loss weight and token
# dropping), and what only exports read (the family's names, the special token ids). Every other field defines
# the function the model computes. (hf.mapping's _MATCHING_FIELDS is a second list of the same thing, the other
# way round, for loading a Hugging Face checkpoint: a field added to DecoderConfig must be placed in both.)
MAY_CHANGE_ON_RESUME = frozenset({
    "dtype", "attention_impl", "max_positions", "max_segments", "loss_chunk_tokens", "mlp_chunk_tokens",
    "moe.aux_loss_coef", "moe.capacity_factor", "family", "bos_token_id", "eos_token_id", "pad_token_id"})


def _comparable(saved: dict, now: dict) -> tuple[dict, dict]:
    """The two stored model configs as the model reads them, where both are a ``DecoderConfig``'s: each field
    whose default left unset and the same value set explicitly mean the same model (``head_dim`` unset or
    ``hidden // heads``, ...: ``DecoderConfig.effective``) made explicit. Such a field set on neither side, or
    unread on either (``effective`` None), is left out: the fields it follows from are compared. Records that
    are not both a ``DecoderConfig``'s are compared as they are."""
    try:
        a, b = DecoderConfig.from_dict(saved), DecoderConfig.from_dict(now)
    except (TypeError, ValueError):
        return saved, now
    out_a, out_b = dict(saved), dict(now)
    for k in EFFECTIVE_FIELDS:
        if k not in saved or k not in now:
            continue
        ea, eb = jsonable(a.effective(k)), jsonable(b.effective(k))
        if (saved[k] is None and now[k] is None) or ea is None or eb is None:
            del out_a[k], out_b[k]
        else:
            out_a[k], out_b[k] = ea, eb
    return out_a, out_b


def _changes(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{field: (saved value, value now)}`` of the fields the two records hold and set differently; a table
    both hold (``rope_scaling``, ``moe``) key by key. A field one record lacks (added since) is not compared."""
    out: dict[str, tuple[Any, Any]] = {}
    for key, before in saved.items():
        if key not in now or f"{prefix}{key}" in MAY_CHANGE_ON_RESUME:
            continue
        after = now[key]
        if isinstance(before, dict) and isinstance(after, dict):
            out.update(_changes(before, after, f"{prefix}{key}."))
        elif before != after:
            out[f"{prefix}{key}"] = (before, after)
    return out


def _value(v: Any, inner: bool = False) -> str:
    """A config value as a command-line override writes it (TOML; ``none`` for None, a table without its unset
    keys)."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(x, True)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, True) for x in v) + "]"
    return json.dumps(v) if inner and isinstance(v, str) else str(v)


def check_same_model(saved: dict | None, now: dict | None, where: Path) -> None:
    """Refuse to resume from the checkpoint ``where`` when the model it records (``saved``, the JSON of its
    config) differs from this run's (``now``) in a field that defines the model: a changed RoPE base, norm
    epsilon, head split or activation keeps every tensor's shape, and the run would go on training another
    model. The fields of ``MAY_CHANGE_ON_RESUME`` may differ; a default left unset and the same value set
    explicitly are the same model."""
    changed = _changes(*_comparable(saved, now)) if saved and now else {}
    if not changed:
        return
    lines = "\n".join(f"  model.{k}: {_value(a)} in the checkpoint, {_value(b)} now" for k, (a, b) in changed.items())
    back = " ".join(shlex.quote(f"model.{k}={_value(a)}") for k, (a, _) in changed.items())
    raise ValueError(
        f"cannot resume from {where}: this run's model differs from the one the checkpoint holds, and resuming "
        f"would go on training another model:\n{lines}\nNothing was changed. To resume, put the checkpoint's "
        f"values back ({back}). To train the changed model from these weights (the optimizer starting afresh), start a "
        f"new run from them: megatrain-jax convert {where} NEW_DIR --to hf --dtype float32, set the changed values in "
        f"NEW_DIR/config.json (under Hugging Face's names), then train with model.hf_checkpoint=NEW_DIR and a new "
        f"train.run_dir")


def check_same_masters(saved: dict | None, now: dict | None, where: Path) -> None:
    """Refuse to resume from the checkpoint ``where`` when its master weights (``engine.master_dtype`` in ``saved``,
    the JSON of its engine config) are of another dtype than this run's (``now``): the moments convert between
    formats on restore, the masters do not (``Precision.resumes``), and the restore would refuse every tensor, only
    after the model has loaded."""
    before, after = (e.get("master_dtype") if isinstance(e, dict) else None for e in (saved, now))
    if before and after and before != after:
        raise ValueError(f"cannot resume from {where}: it holds {before} master weights (engine.master_dtype="
                         f"{before}), and this run keeps {after} ones. Nothing was changed. To resume, set "
                         f"engine.master_dtype={before} (with the settings its precision mode needs; megatrain-jax "
                         f"plan shows the modes)")


def check_resume_source(resume: str | Path) -> None:
    """Refuse a checkpoint to resume from (``train.resume=PATH``) that is not a folder: a missing path or a file."""
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"train.resume={resume}: {path.absolute()} does not exist. Give a checkpoint folder "
                                f"(a run's checkpoints/, or one step of it: checkpoints/N), or train.resume=true for "
                                f"the newest in this run's checkpoint directory")
    if not path.is_dir():
        raise ValueError(f"train.resume={resume}: {path.absolute()} is a file, not a checkpoint folder. Give a run's "
                         f"checkpoints/ folder, or one step of it (checkpoints/N)")


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Orbax's warnings through absl's logger held back (a read-only manager says "Given directory is read only"
    at every resume from another folder, which is how it is meant to be read)."""
    import logging

    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check_same_data(state: dict | None, data: Iterable | None, where: Path) -> None:
    """Refuse to resume from the checkpoint ``where`` when ``data`` (a stream with ``resume_problem``, as
    ``TokenBatches``) cannot go on from the position ``state`` it saved: another batch size, length, file or seed
    would read other batches than the run's."""
    check = getattr(data, "resume_problem", None)
    problem = check(state) if state is not None and callable(check) else None
    if problem:
        raise ValueError(
            f"cannot resume from {where}: the data differs from the run's, and the position saved with the checkpoint "
            f"would not fit it: {problem}. Nothing was changed. To resume, give the data settings their saved values. "
            f"To train on other data from these weights (the optimizer starting afresh), start a new run from them: "
            f"megatrain-jax convert {where} NEW_DIR --to hf --dtype float32, then train with model.hf_checkpoint=NEW_DIR "
            f"and a new train.run_dir")


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON item; {} where it cannot be read (the restore says what is wrong with it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def position_data(data: Iterable, meta: dict) -> Iterable:
    """``data`` continuing right after the last batch the checkpointed run consumed: through its
    ``restore(state)`` when it has one, else by skipping the ``batches`` already consumed."""
    state = meta.get("data")
    if state is not None and callable(getattr(data, "restore", None)) and getattr(data, "restorable", True):
        data.restore(state)
        return data
    return itertools.islice(iter(data), int(meta.get("batches", 0)), None)


class CheckpointSession:
    """Resume, periodic saves every ``every`` steps (of ``engine.state.step``), a final save, and on
    SIGTERM/SIGINT/SIGHUP: stop the data at the next step boundary (``follow``), let the last step finish and
    report, save, wait for the write, raise ``CheckpointedExit``.

    ``resume``: None (a fresh run: ``directory`` must hold no checkpoint), ``"auto"`` (the newest
    complete checkpoint of ``directory``, or a fresh start when there is none), or a path to a step
    directory or a checkpoint root.
    """

    def __init__(self, directory: str | Path | None, *, every: int | None = None, keep: int | None = 3,
                 resume: str | Path | None = None, config: dict | None = None, accumulate: int = 1,
                 stop_stall_s: float | None = None):
        if every is not None and every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 or None, got {every}")
        if resume == "auto" and directory is None:
            raise ValueError("resume='auto' needs a checkpoint_dir to look in")
        self.every, self.resume, self.config, self.accumulate = every, resume, config or {}, accumulate
        self.ckpt = Checkpointer(directory, keep=keep) if directory is not None else None
        self._open = self.ckpt is not None
        try:
            self._refuse_overwrites(resume)
        except BaseException:
            self.close()  # a refused session leaves no checkpoint manager open
            raise
        self.data: Iterable | None = None
        self._saved: set[int] = set()  # the steps this session saved (or resumed from)
        self._resume_from: tuple[Path | None, bool] | None = None  # (step directory, verified), once ``check`` ran
        self.start_step = 0
        self.resumed_from: Path | None = None
        self.stop_signal: str | None = None
        self.stop_stall_s = STOP_STALL_S if stop_stall_s is None else stop_stall_s
        self._stop: Callable[[str], None] = lambda reason: None
        self._data_state: Callable[[], Any] = lambda: (
            self.data.state() if callable(getattr(self.data, "state", None)) else None)

    def _refuse_overwrites(self, resume: str | Path | None) -> None:
        """Refuse a session that would save over checkpoints it does not continue from."""
        if self.ckpt is not None and resume is None and committed_steps(self.ckpt.root):
            raise ValueError(f"checkpoint directory {self.ckpt.root} already holds checkpoints (steps "
                             f"{committed_steps(self.ckpt.root)}); resume to continue that run (TrainConfig(resume="
                             f"True), or train.resume=true in a run config), or use another directory")
        if resume not in (None, "auto"):
            check_resume_source(resume)
        if self.ckpt is not None and resume not in (None, "auto"):
            root, step = split_step_dir(resume)
            held = committed_steps(self.ckpt.root)
            if step is None and held and (root / "checkpoints").resolve() == Path(self.ckpt.root).resolve():
                raise ValueError(f"train.resume={resume} is this run's folder, not a checkpoint folder: its checkpoints "
                                 f"are in {self.ckpt.root}. Nothing was changed. To go on from the newest of them, "
                                 f"use train.resume=true")
            if held and root.resolve() != Path(self.ckpt.root).resolve():
                raise ValueError(f"resuming from {resume} into checkpoint directory {self.ckpt.root}, which holds "
                                 f"another run's checkpoints (steps {held}): this run's would be mixed with them (and a "
                                 f"later resume=true would adopt and prune theirs). Nothing was changed. To go on from the newest of "
                                 f"those (this run's own, resumed before), use train.resume=true; to start a branch "
                                 f"from {resume}, set train.run_dir (or train.checkpoint_dir) to a new folder")
            newer = [n for n in held if step is not None and n > step]
            if newer:
                raise ValueError(f"resuming from step {step} of {root}, which also holds newer checkpoints (steps "
                                 f"{sorted(newer)}): this run would save over them. Nothing was changed. Move "
                                 f"those aside, resume from the newest (train.resume=true), or set "
                                 f"train.checkpoint_dir to another folder")

    # ------------------------------------------------------------------ resume
    def check(self, data: Iterable | None = None) -> int:
        """Pick the checkpoint to resume from and refuse one whose model differs (``check_same_model``), or whose
        data position ``data`` cannot go on from (its ``resume_problem(state)``, where it has one), before anything
        is loaded or moved; returns the step training starts from (0: a fresh start). ``fit`` calls it before it
        builds the engine, so that every refusal comes before the model loads; ``start`` calls it when it was not
        called."""
        if self._resume_from is None:
            try:
                step_dir, verified, found = self._resume_dir()
                if step_dir is not None:
                    saved, meta = (_read_json(step_dir / item / f"{item}.json") for item in ("config", "meta"))
                    check_same_model(saved.get("model"), self.config.get("model"), step_dir)
                    check_same_masters(saved.get("engine"), self.config.get("engine"), step_dir)
                    check_same_data(meta.get("data"), data, step_dir)
                if found:  # the resume goes ahead: newer broken steps are set aside, so they can be written again
                    self.ckpt.latest_complete(quarantine=True, found=found)
            except BaseException:
                self.close()
                raise
            self._resume_from = (step_dir, verified)
        step_dir = self._resume_from[0]
        return 0 if step_dir is None else int(step_dir.name)

    def start(self, engine, data: Iterable) -> Iterable:
        """Restore the engine and position ``data`` when resuming (``check`` first); returns the data to train on."""
        self.data = data
        self.check(data)
        step_dir, verified = self._resume_from
        try:
            if step_dir is not None:
                own = self.ckpt is not None and step_dir.parent == self.ckpt.root
                with quiet_orbax():
                    reader = self.ckpt if own else Checkpointer(step_dir.parent, read_only=True)
                try:
                    meta, _ = reader.restore(engine, int(step_dir.name), verified=verified)
                finally:
                    if not own:
                        reader.close()
                if self.ckpt is not None and step_dir.parent.resolve() == self.ckpt.root.resolve():
                    self.ckpt.continues(int(step_dir.name))  # its steps up to here are this run's: keep-N prunes them
                self.data = position_data(data, meta)
                self.resumed_from = step_dir
                print(f"resumed from {step_dir} at step {engine.state.step}", file=sys.stderr, flush=True)
        except BaseException:
            self.close()
            raise
        self.start_step = int(engine.state.step)
        if self.ckpt is not None:  # what this run starts from is good; its own saves are not known good until trained on
            self.ckpt.known_good = self.start_step
            self._saved.add(self.start_step)
        return self.data

    def close(self) -> None:
        """Close the checkpoint manager, waiting for the save in flight (``running`` does on its way out, and
        ``check`` and ``start`` when they fail); once."""
        ckpt, self._open = self.ckpt if self._open else None, False
        if ckpt is not None:
            ckpt.close()

    def _resume_dir(self) -> tuple[Path | None, bool, list[tuple[int, str | None]]]:
        """The step directory to resume from (None: a fresh start), whether it was just verified, and the scan
        of this run's checkpoint directory that found it (empty where none was made): nothing is moved yet.
        Every step is verified here, before the model loads."""
        if self.resume is None:
            return None, False, []
        root, step = (None, None) if self.resume == "auto" else split_step_dir(self.resume)
        if self.ckpt is not None and step is None and (root is None or root.resolve() == self.ckpt.root.resolve()):
            # this run's own checkpoints ("auto", or their folder named): as for "auto", newer broken steps are
            # set aside once the resume goes ahead, since this run saves those steps again (a step that exists
            # cannot be saved: the steps trained since the resume would be lost at the first save)
            found = self.ckpt.scan()
            step = next((n for n, problem in found if problem is None), None)
            if step is not None:
                return self.ckpt.root / str(step), True, found
            if found:  # checkpoints exist but none can be used: never silently start over
                self.ckpt.latest_complete(found=found)  # a warning for each (none is moved: none is good)
                raise CorruptCheckpointError(
                    f"no usable checkpoint in {self.ckpt.root}: every one is incomplete or corrupt:\n"
                    + "\n".join(f"  {self.ckpt.root / str(n)}: {problem}" for n, problem in found)
                    + f"\nNothing was changed. To start from scratch, move {self.ckpt.root} aside (its "
                      f"checkpoints stay there), or use another checkpoint directory")
            if root is None:
                print(f"no checkpoint in {self.ckpt.root} yet: starting from scratch", file=sys.stderr)
                return None, False, []
            root = self.ckpt.root
        elif step is not None:  # verified now: a broken one is refused before the model loads, not after
            problem = check_step(root / str(step))
            if problem:
                raise CorruptCheckpointError(
                    f"cannot resume from {root / str(step)}: {problem}. Nothing was changed. Give another step of "
                    f"{root}, or the folder itself (train.resume={root}) for its newest complete one")
            return root / str(step), True, []
        else:
            with quiet_orbax():
                other = Checkpointer(root, read_only=True)
            step = other.latest_complete()
            other.close()
            if step is not None:
                return root / str(step), True, []
        inner = root / "checkpoints"
        if committed_steps(inner):  # a run folder named in place of its checkpoint folder
            raise FileNotFoundError(f"no checkpoint in {root}: it is a run folder, whose checkpoints are in {inner}; "
                                    f"give that folder: train.resume={inner}")
        raise FileNotFoundError(f"no complete checkpoint in {root}. Give a folder that holds some: a run's "
                                f"checkpoints/ folder, or one step of it (checkpoints/N)")

    # ------------------------------------------------------------------ saving
    def follow(self, data_state: Callable[[], Any], stop: Callable[[str], None]) -> None:
        """Take the data's state from ``data_state()`` (the state at the last step boundary) and stop the
        data with ``stop(reason)`` when a signal arrives; ``fit`` passes its ``Feed``'s methods."""
        self._data_state, self._stop = data_state, stop

    def save(self, engine, wait: bool = False) -> int | None:
        """Save now; None (nothing saved) without a checkpoint directory, after an abandoned save (its
        writer may be stuck in Orbax, which would hold any later save behind it), or when the engine's last step
        was skipped (a diverging run: its checkpoint would push a good one out of the newest ``keep``)."""
        if self.ckpt is None:
            return None
        self.ckpt.wait()  # the save before: its failure is raised; after a stop signal it may be abandoned
        if self.ckpt.abandoned:
            return None
        if engine.last_step_skipped():
            print(f"not saving step {int(engine.state.step)}: it was skipped (a non-finite loss or gradient norm), and "
                  f"a checkpoint is never written from a skipped step; the last good checkpoint is "
                  f"{self.last_good() or 'none (this run committed none)'}", file=sys.stderr, flush=True)
            return None
        meta = {"data": self._data_state(), "batches": int(engine.state.step) * self.accumulate,
                "seed": self.config.get("seed")}
        self._saved.add(int(engine.state.step))
        return self.ckpt.save(engine, meta=meta, config=self.config, wait=wait)

    def after_step(self, metrics: dict, info) -> None:
        """A ``Hook`` function (every step; ``info`` a ``fit.StepInfo``): the periodic save, and the error of
        a save that failed since the last step."""
        if self.ckpt is not None:
            self.ckpt.check()
            if not metrics.get("skipped", False) and metrics["step"] - 1 in self._saved:
                # a finite step was trained from the checkpoint of the step before: it is known good, and the
                # keep-N rule spares it until a newer one is (Checkpointer.prune)
                self.ckpt.known_good = max(self.ckpt.known_good or 0, metrics["step"] - 1)
        step = info.params_step
        if self.every and step % self.every == 0 and step != self._last_saved():
            self.save(info.engine)

    def finish(self, engine) -> None:
        """The final save (when the run trained past its start), waited for; after a stop signal, then
        raise ``CheckpointedExit``."""
        step = int(engine.state.step)
        if self.ckpt is not None and step > self.start_step and step != self._last_saved():
            self.save(engine)
        if self.ckpt is not None:
            self.ckpt.wait()
            if self.ckpt.last_committed == step:  # the run's last step, not skipped: its end is taken as good
                self.ckpt.known_good = step
                self.ckpt.prune()
                self.ckpt.check()  # an old step it could not delete is said
        if self.stop_signal is not None and self.ckpt is not None and self.ckpt.abandoned:
            good = self.last_good()
            print(f"{self.stop_signal}: the save of step {self._last_saved()} made no progress for "
                  f"{self.stop_stall_s:g} s: abandoned (it never becomes a checkpoint); the last complete "
                  f"checkpoint is {good or 'none (this run committed none)'}; exiting", file=sys.stderr, flush=True)
            raise CheckpointedExit(self.stop_signal, None if good is None else int(good.name), good, abandoned=True)
        if self.stop_signal is not None and self.ckpt is not None:
            saved = self._last_saved()
            if saved is None:  # stopped before a step finished: what there is to resume from is where it began
                saved = self.start_step
                print(f"{self.stop_signal}: no step finished since step {saved}; nothing new to save; exiting",
                      file=sys.stderr, flush=True)
            else:
                print(f"{self.stop_signal}: saved checkpoint {self.ckpt.root / str(saved)}; exiting",
                      file=sys.stderr, flush=True)
            raise CheckpointedExit(self.stop_signal, saved, self.ckpt.root / str(saved))

    def rescue(self, engine) -> Path | None:
        """After a failure outside the engine (a hook, the data): save the consistent state the engine holds,
        wait for it, and return its path (None without a checkpoint directory)."""
        step = int(engine.state.step)
        if self.ckpt is None or step == self.start_step:  # nothing trained since the start: nothing to keep
            return None
        if step != self._last_saved() and self.save(engine) is None:
            return None
        self.ckpt.wait()
        return None if self.ckpt.abandoned else self.ckpt.root / str(step)

    def _last_saved(self) -> int | None:
        return None if self.ckpt is None else self.ckpt.last_step

    def last_committed(self) -> Path | None:
        """The newest checkpoint this session saved, as a path (None before its first save)."""
        step = self._last_saved()
        return None if step is None else self.ckpt.root / str(step)

    def last_good(self) -> Path | None:
        """The newest checkpoint known complete: the last this session committed, else the one it resumed
        from (the file system is not asked: it may be the thing that hangs)."""
        if self.ckpt is not None and self.ckpt.last_committed is not None:
            return self.ckpt.root / str(self.ckpt.last_committed)
        return self.resumed_from

    # ------------------------------------------------------------------ signals
    @contextlib.contextmanager
    def running(self) -> Iterator["CheckpointSession"]:
        """Install the SIGTERM/SIGINT/SIGHUP handlers (main thread only) and, on the way out, wait for the save
        in flight and close the manager. A signal stops the data at the next step boundary (see ``follow``)
        and bounds the wait for saves (``stop_stall_s`` without progress, then abandoned); a second signal
        gets the previous handler (e.g. Ctrl-C twice)."""
        previous = {}
        if self.ckpt is not None and threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame):
                self.stop_signal = signal.Signals(signum).name
                self.ckpt.limit_stall(self.stop_stall_s)
                self._stop(self.stop_signal)
                for s, h in previous.items():
                    signal.signal(s, h)
            previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for s in STOP_SIGNALS:
                signal.signal(s, on_signal)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.close()
