"""``fit``: assembles the engine and drains its step iterator. Logging, evaluation and checkpointing are
hooks, so none of them touch the step."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
from typing import Any, Callable, Iterable, Sequence

import jax
import optax
from flax import nnx

from megatrain_jax.batch import Batch
from megatrain_jax.checkpoint.session import CheckpointSession, jsonable
from megatrain_jax.engine import Engine
from megatrain_jax.engine_config import EngineConfig
from megatrain_jax.flops import model_flops_per_token
from megatrain_jax.layered import is_abstract
from megatrain_jax.optim import adamw, decay_mask, learning_rate_of
from megatrain_jax.train_config import TrainConfig

Schedule = Callable[[int], Any]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook is told besides the metrics. ``step`` is the step the metrics belong to;
    ``params_step`` the optimizer steps the engine's parameters hold now. Metrics arrive one step late, so
    ``params_step`` is usually ``step + 1`` (equal after the last step)."""

    step: int
    params_step: int
    engine: Engine


@dataclasses.dataclass
class Hook:
    """Calls ``fn(metrics, info)`` every ``every`` steps (and after the last step when ``at_end``);
    ``info`` is a ``StepInfo``."""

    fn: Callable[[dict, StepInfo], None]
    every: int = 1
    at_end: bool = False


@dataclasses.dataclass
class History:
    """Per-step metrics, in order. ``history['loss']`` is the list of losses."""

    records: list[dict] = dataclasses.field(default_factory=list)
    engine: Engine | None = None

    def __getitem__(self, key: str) -> list:
        return [r[key] for r in self.records if key in r]

    def __len__(self) -> int:
        return len(self.records)


def default_optimizer(learning_rate: float | Schedule = 3e-4, weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on matrices and the usual LM pre-training betas; the engine runs
    it as a fused in-place host kernel."""
    return adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask)


def print_logger(every: int = 10, stream=sys.stdout) -> Hook:
    def log(m: dict, info: StepInfo) -> None:
        lr = f" lr {m['lr']:.2e}" if "lr" in m else ""
        print(f"step {m['step']:>6d}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}{lr}  "
              f"{m['tokens_per_s']:,.0f} tok/s  {m['model_tflops']:.1f} TFLOP/s  {m['step_time_s']:.3f} s",
              file=stream, flush=True)
    return Hook(log, every=every, at_end=True)


def _session(model: nnx.Module, train: TrainConfig, engine_cfg: EngineConfig, optimizer_name: str) -> CheckpointSession:
    run_config = jsonable({"model": getattr(model, "cfg", None), "engine": engine_cfg, "train": train, "seed": train.seed,
                           "optimizer": optimizer_name})
    resume = {True: "auto", False: None}.get(train.resume, train.resume)
    return CheckpointSession(train.checkpoint_dir, every=train.checkpoint_every or None, keep=train.checkpoint_keep,
                             resume=resume, config=run_config, accumulate=engine_cfg.accumulate_steps)


def fit(model: nnx.Module, data: Iterable[Batch], optimizer: optax.GradientTransformation | None = None, *,
        train: TrainConfig = TrainConfig(), engine: EngineConfig = EngineConfig(), hooks: Sequence[Hook] = (),
        write_back: bool = True) -> History:
    """Train ``model`` (concrete, or abstract from ``nnx.eval_shape`` and initialized from ``train.seed``) on
    ``data``, an iterable of ``Batch``, for ``train.steps`` optimizer steps (or until the data ends).

    ``optimizer`` defaults to ``default_optimizer()`` (AdamW, lr 3e-4); clipping and micro-batching are
    in ``engine``, the run's length, logging and checkpoints in ``train``. Returns the metrics history; the
    trained parameters are written into ``model`` at the end unless ``write_back`` is False or the model
    is abstract (then read them from ``history.engine``). With checkpoints, saves happen when the engine's
    step is a multiple of ``checkpoint_every`` (the engine runs one step ahead of the metrics, so never at
    step 1), and a resumed run ends where the uninterrupted one would, bit for bit.
    """
    optimizer_name = "default_optimizer" if optimizer is None else type(optimizer).__name__
    optimizer = optimizer if optimizer is not None else default_optimizer()
    lr_schedule = learning_rate_of(optimizer)
    eng = Engine(model, optimizer, engine, seed=train.seed)
    history = History(engine=eng)
    hooks = list(hooks) + ([print_logger(train.log_every)] if train.log_every else [])
    session = _session(model, train, engine, optimizer_name) if train.checkpointing else None
    if session is not None:
        data = session.start(eng, data)
        hooks.append(Hook(session.after_step))
    if train.steps is not None:
        data = itertools.islice(iter(data), max(0, train.steps - eng.state.step) * engine.accumulate_steps)
    params = sum(x.size for x in jax.tree.leaves(eng.state.params()))
    cfg = model.cfg
    last: dict | None = None
    with session.running() if session else contextlib.nullcontext():  # waits for the save in flight on exit
        for m in eng.steps(data):
            fpt = model_flops_per_token(params, getattr(cfg, "layers", 0), getattr(cfg, "hidden", 0), eng.last_seq_len)
            m["model_tflops"] = m["tokens_per_s"] * fpt / 1e12
            if train.peak_tflops:
                m["mfu"] = m["model_tflops"] / train.peak_tflops
            if lr_schedule is not None:
                m["lr"] = float(lr_schedule(m["step"] - 1))
            history.records.append(m)
            info = StepInfo(m["step"], int(eng.state.step), eng)
            for hook in hooks:
                if m["step"] % hook.every == 0:
                    hook.fn(m, info)
            last = m
        if last is not None:
            info = StepInfo(last["step"], int(eng.state.step), eng)
            for hook in hooks:
                if hook.at_end and last["step"] % hook.every:
                    hook.fn(last, info)
        if session:
            session.finish(eng)
    if write_back and not is_abstract(model):
        eng.write_back(model)
    return history

