"""``fit``: assembles the engine and drains its step iterator. Logging, evaluation and checkpointing are
hooks, so none of them touch the step."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import numbers
import operator
import sys
import warnings
from typing import Any, Callable, Iterable, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from megatrain_jax import fit_history
from megatrain_jax.batch import Batch, check_loss_tokens
from megatrain_jax.checkpoint.session import CheckpointSession, jsonable
from megatrain_jax.contract.layered import is_abstract
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.engine import Engine
from megatrain_jax.engine.out_of_memory import DeviceOutOfMemoryError
from megatrain_jax.engine.transfer import select_devices
from megatrain_jax.fit_checks import check_arguments, check_learning_rate, where_the_data_ended
from megatrain_jax.fit_failure import FailedHook, keep_what_was_trained
from megatrain_jax.flops import format_flops, model_flops_per_token
from megatrain_jax.loss import NextToken, Objective
from megatrain_jax.optim import adamw, decay_mask, learning_rate_of, schedule_value
from megatrain_jax.train_config import TrainConfig

Schedule = Callable[[int], Any]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook is told besides the metrics. ``step`` is the step the metrics belong to;
    ``params_step`` the optimizer steps the engine's parameters hold now. Metrics arrive one step late, so
    ``params_step`` is usually ``step + 1`` (equal after the last step).

    ``stop(reason)`` ends training cleanly: no new step starts, the step in flight finishes and its
    metrics reach every hook, the final checkpoint is saved, and ``fit`` returns a history whose
    ``stopped`` is ``reason`` (early stopping, a target loss, a time budget)."""

    step: int
    params_step: int
    engine: Engine
    stop: Callable[[str], None] = lambda reason="stopped by a hook": None


@dataclasses.dataclass
class Hook:
    """Calls ``fn(metrics, info)`` every ``every`` steps (and after the last step when ``at_end``);
    ``info`` is a ``StepInfo``."""

    fn: Callable[[dict, StepInfo], None]
    every: int = 1
    at_end: bool = False

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Hook takes a function fn(metrics, info), got {type(self.fn).__name__}")
        if isinstance(self.every, bool) or not isinstance(self.every, numbers.Integral) or self.every < 1:
            raise ValueError(f"Hook every must be a whole number of steps >= 1 (1: every step), got {self.every!r}")


@dataclasses.dataclass
class History:
    """Per-step metrics, in order: ``records``, one per step trained by this call (``len``). ``history['loss']``
    is the list of losses. ``stopped`` is the reason a hook or a signal gave for ending early (None when the run
    ran its steps or its data out).

    ``resumed``: with checkpoints, the metrics of the step the run resumed from, as they were recorded when
    that step was trained (``fit_history``; None on a fresh start or where none were kept). A resumed run
    with nothing left to train has no records, and ``history[key]`` reads ``resumed`` instead: a finished run
    run again still ends its history with its last step."""

    records: list[dict] = dataclasses.field(default_factory=list)
    engine: Engine | None = None
    stopped: str | None = None
    resumed: dict | None = None

    def __getitem__(self, key: str) -> list:
        records = self.records or ([self.resumed] if self.resumed is not None else [])
        return [r[key] for r in records if key in r]

    def __len__(self) -> int:
        return len(self.records)


class Feed:
    """The data as ``fit`` hands it to the engine: whole optimizer steps of ``accumulate`` batches, at most
    ``limit`` batches, each passed through ``check`` (bad token ids are the data's failure, found before
    the engine starts the step), ending at the next step boundary once ``stop(reason)`` is called. ``state()`` is
    the data's own state (when it has one) at the last step boundary, which is what a checkpoint of the
    engine's state must record, even when a failure interrupts the data in the middle of a step.

    When the data (or a batch's check) raises, the stream ends there and the exception is kept in ``error``
    for ``fit`` to raise: the engine reports its metrics one step late, and ending the stream is what makes it
    report the last step it trained (the step a checkpoint saved after the failure holds). An interrupt
    (``KeyboardInterrupt``, ``SystemExit``) is kept and raised at once."""

    def __init__(self, data: Iterable[Batch], accumulate: int = 1, limit: int | None = None,
                 check: Callable[[Batch], None] = lambda batch: None):
        self._data, self._it, self._check = data, iter(data), check
        self.accumulate, self.limit = accumulate, limit
        self.batches = 0
        self.stopped: str | None = None
        self.error: BaseException | None = None  # what the data (or a batch's check) raised
        self._boundary = self._previous = self._data_state()

    def _data_state(self) -> Any:
        state = getattr(self._data, "state", None)
        return state() if callable(state) else None

    def state(self) -> Any:
        return self._boundary

    def stop(self, reason: str = "stopped") -> None:
        self.stopped = self.stopped or reason

    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> Batch:
        at_boundary = self.batches % self.accumulate == 0
        if at_boundary and (self.stopped is not None or (self.limit is not None and self.batches >= self.limit)):
            raise StopIteration
        try:
            batch = next(self._it)
            self._check(batch)
        except StopIteration:
            raise
        except Exception as err:
            self.error = err
            raise StopIteration from None
        except BaseException as err:
            self.error = err
            raise
        self.batches += 1
        if self.batches % self.accumulate == 0:
            self._previous, self._boundary = self._boundary, self._data_state()
        return batch

    def unread_step(self) -> None:
        """The engine did not train the step it was given last (it ran out of device memory before any
        update): ``state()`` goes back to the boundary before that step's batches, so that a checkpoint
        records them as not yet read and a resumed run trains them."""
        self._boundary = self._previous


def endless(data: Any) -> bool:
    """Whether ``data`` is known never to end: it says so (``data.endless``, as looping token batches do),
    or it is an unbounded ``itertools.cycle``/``count``/``repeat``. A plain generator cannot tell."""
    if getattr(data, "endless", False):
        return True
    if isinstance(data, (itertools.cycle, itertools.count)):
        return True
    return isinstance(data, itertools.repeat) and operator.length_hint(data, -1) < 0


def default_optimizer(learning_rate: float | Schedule = 3e-4, weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on matrices and the usual LM pre-training betas; the engine runs
    it as a fused in-place host kernel."""
    return adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask)


def print_logger(every: int = 10, stream=None) -> Hook:
    """Print a line of metrics every ``every`` steps to ``stream`` (default: ``sys.stdout`` as it is when the
    line is printed, so a redirected stdout gets it)."""
    def log(m: dict, info: StepInfo) -> None:
        lr = f" lr {m['lr']:.2e}" if "lr" in m else ""
        aux = f" (aux {m['aux_loss']:.4f})" if "aux_loss" in m else ""
        # where tokens are out of the loss (padding, prompts), how many a second the model learns from
        in_loss = (f" ({m['loss_tokens_per_s']:,.0f} in the loss)"
                   if m.get("loss_tokens", m["tokens"]) < m["tokens"] and "loss_tokens_per_s" in m else "")
        print(f"step {m['step']:>6d}  loss {m['loss']:.4f}{aux}  grad_norm {m['grad_norm']:.3f}{lr}  "
              f"{m['tokens_per_s']:,.0f} tok/s{in_loss}  {format_flops(m['model_tflops'])}  {m['step_time_s']:.3f} s",
              file=stream or sys.stdout, flush=True)
    return Hook(log, every=every, at_end=True)


def _session(model: nnx.Module, train: TrainConfig, engine_cfg: EngineConfig, optimizer_name: str) -> CheckpointSession:
    run_config = jsonable({"model": getattr(model, "cfg", None), "engine": engine_cfg, "train": train, "seed": train.seed,
                           "optimizer": optimizer_name})
    resume = {True: "auto", False: None}.get(train.resume, train.resume)
    return CheckpointSession(train.checkpoint_dir, every=train.checkpoint_every or None, keep=train.checkpoint_keep,
                             resume=resume, config=run_config, accumulate=engine_cfg.accumulate_steps)


def fit(model: nnx.Module, data: Iterable[Batch] | Callable[[Engine], Iterable[Batch]],
        optimizer: optax.GradientTransformation | None = None, *,
        train: TrainConfig = TrainConfig(), engine: EngineConfig = EngineConfig(), hooks: Sequence[Hook] = (),
        write_back: bool = True, devices: Sequence[jax.Device] | Mesh | None = None, init_from=None,
        on_start: Callable[[int], None] | None = None, objective: Objective = NextToken()) -> History:
    """Train ``model`` (concrete, or abstract from ``nnx.eval_shape`` and initialized from ``train.seed``) on
    ``data``, an iterable of ``Batch``, for ``train.steps`` optimizer steps (or until the data ends).

    ``optimizer`` defaults to ``default_optimizer()`` (AdamW, lr 3e-4); clipping and micro-batching are
    in ``engine``, the run's length, logging and checkpoints in ``train``. ``devices`` (a list of devices or
    a one-axis ``data`` mesh) overrides ``train.devices``; by default every local GPU is used, and each
    batch's rows are split between them (see ``Engine``). ``init_from`` (e.g. ``megatrain_jax.hf.HFParts``)
    gives an abstract model's initial weights part by part, straight into the engine's state. ``on_start(step)``
    is called once every check has passed (the checkpoint folder, the checkpoint to resume from and its model),
    before the engine is built and the model loaded; ``step`` is the step training starts from (the resumed
    checkpoint's, else 0). ``objective``: the engine's loss (``megatrain_jax.loss``: next-token, or ``DPO``).
    ``data`` may be a function of the engine, called once it is built with the initial weights and before a
    resumed checkpoint is restored: preference training takes its reference log-probabilities there
    (``data.preference.pair_logps``). Returns the metrics history; the
    trained parameters are written into ``model`` at the end unless ``write_back`` is False or the model
    is abstract (then read them from ``history.engine``). With checkpoints, saves happen when the engine's
    step is a multiple of ``checkpoint_every`` (the engine runs one step ahead of the metrics, so never at
    step 1), and a resumed run ends where the uninterrupted one would, bit for bit.

    Arguments of the wrong kind, and a learning rate below 0 or not a number at a step of the run, are refused
    before anything loads; each batch is checked before its step (``batch.check_batch``, and at least one token in
    its loss). Data that runs out before ``train.steps`` (or in the middle of a step) ends the run with a warning.

    A hook ends training early with ``info.stop(reason)``. If anything raises, the exception carries the
    history (``err.history``); when the data fails, the step trained before it is reported first (its metrics
    reach the hooks, as every step's do). When a hook (or the checkpoint session's) raises, the other hooks still
    take that step's metrics, and the step trained meanwhile (metrics come one step late) is reported to every hook
    but the failed one before the first error is raised: no step kept (written back or saved) lacks its metrics row
    unless the metrics writer is what failed. When the failure came from a hook or the data (the engine's state is
    then whole), the trained parameters are written back and, with checkpoints, saved first (not when a hook's write
    failed, an OSError: a checkpoint past the metrics it wrote would leave a hole in a resumed run's history; nor
    when no step trained); a note on the exception says what was kept (and the last step a failed write holds). A
    checkpoint is never saved from a skipped step (a non-finite loss or gradient norm). SIGTERM/SIGINT/SIGHUP with
    checkpoints: the step in flight finishes and is reported, the checkpoint is saved, and ``CheckpointedExit``
    (exit status 128 + the signal) is raised.
    """
    if isinstance(hooks, Hook):
        raise TypeError("fit's hooks= takes a list of hooks: hooks=[hook]")
    hooks = list(hooks)
    check_arguments(data, optimizer, train, engine)
    for hook in hooks:
        if not isinstance(hook, Hook):
            raise TypeError(f"each of fit's hooks must be a megatrain_jax.Hook, got {type(hook).__name__}: wrap a "
                            f"function as Hook(fn, every=1), where fn(metrics, info) is called with each step's "
                            f"metrics")
    if train.steps is None and endless(data):
        raise ValueError(f"{type(data).__name__} never ends, so fit would never return: give the run a "
                         f"length (TrainConfig(steps=N))")
    optimizer_name = "default_optimizer" if optimizer is None else type(optimizer).__name__
    optimizer = optimizer if optimizer is not None else default_optimizer()
    lr_schedule = learning_rate_of(optimizer)
    rising = check_learning_rate(lr_schedule, train.steps)
    if rising is not None:
        warnings.warn(rising, stacklevel=2)
    session = _session(model, train, engine, optimizer_name) if train.checkpointing else None
    try:  # every refusal before the model loads: a start refused after an hour of loading is an hour lost
        stream = None if callable(data) and not hasattr(data, "__iter__") else data  # a function of the engine: later
        start_step = session.check(stream) if session is not None else 0
        if on_start is not None:
            on_start(start_step)
        eng = Engine(model, optimizer, engine, seed=train.seed,
                     devices=devices if devices is not None else select_devices(train.devices), init_from=init_from,
                     objective=objective)
        if callable(data) and not hasattr(data, "__iter__"):  # a function of the engine with its initial weights
            data = data(eng)
            if train.steps is None and endless(data):
                raise ValueError(f"{type(data).__name__} never ends, so fit would never return: give the run a "
                                 f"length (TrainConfig(steps=N))")
    except BaseException:
        if session is not None:
            session.close()
        raise
    history = History(engine=eng)
    hooks = hooks + ([print_logger(train.log_every)] if train.log_every else [])
    step_log = None
    if session is not None:
        data = session.start(eng, data)
        if session.resumed_from is not None:
            history.resumed = fit_history.step_record(session.resumed_from.parent, session.start_step)
        if train.checkpoint_dir is not None:  # each step's metrics beside the checkpoints, for a later resume:
            step_log = fit_history.StepLog(train.checkpoint_dir, session.start_step)  # last, so that it keeps
            hooks.append(Hook(lambda m, info: step_log.write(m)))  # what the hooks added (eval_hook's eval_loss)
    limit = None if train.steps is None else max(0, train.steps - eng.state.step) * engine.accumulate_steps
    def check(batch: Batch) -> None:  # each batch before its step: the model's refusals, and one with no loss
        eng.check_batch(batch)
        if jax.process_count() == 1:  # a process holds its own rows: another's may hold the loss's tokens
            check_loss_tokens(batch)

    feed = Feed(data, engine.accumulate_steps, limit, check)
    if session is not None:
        session.follow(feed.state, feed.stop)
    cfg = model.cfg
    # model FLOPs count the parameters a token uses: a mixture of experts' active ones (docs/results.md)
    active = getattr(cfg, "active_param_count", None)
    params = active() if callable(active) else sum(x.size for x in jax.tree.leaves(eng.state.params()))
    phase = "engine"
    took: dict[int, int] = {}  # hook (its index) -> the last step whose metrics it took
    failed: dict[int, FailedHook] = {}  # hook (its index) -> how it failed; it takes no more steps

    def call_hooks(m: dict, info: StepInfo, due: Callable[[Hook], bool]) -> None:
        """``m`` to each due hook that has not failed. One that raises does not keep the step from the others
        (the metrics writer's row among them): the first error is raised once they all had it."""
        first: Exception | None = None
        for i, hook in enumerate(hooks):
            if i in failed or not due(hook):
                continue
            try:
                hook.fn(m, info)
                took[i] = m["step"]
            except Exception as err:
                failed[i] = FailedHook(m["step"], took.get(i), err)
                if first is None:
                    first = err
                else:
                    first.add_note(f"another hook failed on step {m['step']}'s metrics too: "
                                   f"{type(err).__name__}: {err}")
        if first is not None:
            raise first

    def report(m: dict, save: bool = True) -> None:
        """One step's metrics to the history, the hooks and (``save``) the checkpoint session."""
        nonlocal phase
        fpt = model_flops_per_token(params, getattr(cfg, "layers", 0), getattr(cfg, "hidden", 0), eng.last_seq_len)
        m["model_tflops"] = m["tokens_per_s"] * fpt / 1e12
        if train.peak_tflops:
            m["mfu"] = m["model_tflops"] / train.peak_tflops
        if lr_schedule is not None:
            m["lr"] = schedule_value(lr_schedule, m["step"] - 1)
        history.records.append(m)
        info = StepInfo(m["step"], int(eng.state.step), eng, feed.stop)
        phase = "hook"
        call_hooks(m, info, lambda hook: m["step"] % hook.every == 0)
        phase = "checkpoint"
        if session and save:
            session.after_step(m, info)

    def report_in_flight(err: Exception) -> str:
        """After a hook (or the checkpoint session's) failed: the data is stopped, and the step the engine trained
        meanwhile is reported to the hooks (not to the session: nothing is saved yet) before its state is written
        back or saved. The phase the failure is then kept under: ``engine`` when finishing that step failed."""
        nonlocal phase
        feed.stop("a hook failed")
        failed_in = phase
        try:
            phase = "engine"
            for m in steps:
                report(m, save=False)
                phase = "engine"
        except Exception as late:  # noqa: BLE001 - the first failure is raised, with this one noted
            if phase == "engine":
                err.add_note(f"finishing the step in flight failed too ({type(late).__name__}: {late}), so the "
                             f"state may not be whole")
                return "engine"
            err.add_note(f"reporting the step in flight failed too: {type(late).__name__}: {late}")
        return failed_in

    with session.running() if session else contextlib.nullcontext():  # waits for the save in flight on exit
        try:
            last: dict | None = None
            steps = eng.steps(feed, profile_step=train.profile_step or None)
            try:
                for m in steps:
                    report(m)
                    phase, last = "engine", m
                if feed.error is not None:  # the data failed: the steps trained before it are reported
                    raise feed.error
                if feed.stopped is None:
                    for said in where_the_data_ended(feed.batches, feed.accumulate, train.steps,
                                                      int(eng.state.step)):
                        warnings.warn(said, stacklevel=2)
            except DeviceOutOfMemoryError as err:
                if not err.updated:
                    try:  # what the host holds is read back in full: a failure found now means it is not whole
                        eng.sync()
                    except Exception as late:  # noqa: BLE001
                        err.updated = True
                        err.add_note(f"reading the state back failed too ({type(late).__name__}): it is not whole")
                if err.updated:
                    raise
                # Nothing of the failed step was applied: the state is the last whole step's. Report that
                # step's metrics, then keep the state (saved, with the data before the failed step's batches).
                feed.unread_step()
                if getattr(err, "pending_metrics", None) is not None:
                    report(err.pending_metrics)
                phase = "whole"
                raise
            phase = "hook"
            if last is not None:
                info = StepInfo(last["step"], int(eng.state.step), eng, feed.stop)
                call_hooks(last, info, lambda hook: hook.at_end and last["step"] % hook.every)
            history.stopped = feed.stopped
            phase = "checkpoint"
            if session:
                session.finish(eng)  # after a signal: raises CheckpointedExit once the save is committed
        except BaseException as err:
            if isinstance(err, Exception) and phase in ("hook", "checkpoint"):
                phase = report_in_flight(err)
            if feed.error is not None and err is not feed.error:  # reporting the last step failed in turn
                err.add_note(f"this came while reporting the last step after the data failed: "
                             f"{type(feed.error).__name__}: {feed.error}")
            keep_what_was_trained(err, "data" if err is feed.error else phase, history, model, write_back, session,
                                   list(failed.values()))
            raise
        finally:
            if step_log is not None:
                step_log.close()
    if write_back and not is_abstract(model):
        eng.write_back(model)
    return history
