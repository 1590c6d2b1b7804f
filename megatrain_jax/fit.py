"""``fit``: assembles the engine and drains its step iterator. Logging, evaluation and checkpointing are
hooks, so none of them touch the step."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import optax
from flax import nnx

from megatrain_jax.batch import Batch
from megatrain_jax.checkpoint.session import CheckpointSession, jsonable
from megatrain_jax.engine import Engine, EngineConfig
from megatrain_jax.flops import model_flops_per_token
from megatrain_jax.layered import is_abstract
from megatrain_jax.optim import adamw, decay_mask

Schedule = Callable[[int], Any]


@dataclasses.dataclass
class Hook:
    """Calls ``fn(metrics, engine)`` every ``every`` steps (and after the last step when ``at_end``)."""

    fn: Callable[[dict, Engine], None]
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


def default_optimizer(learning_rate: float | Schedule, weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on matrices and the usual LM pre-training betas; the engine runs
    it as a fused in-place host kernel."""
    return adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask)


def print_logger(every: int = 10, stream=sys.stdout) -> Hook:
    def log(m: dict, engine: Engine) -> None:
        lr = f" lr {m['lr']:.2e}" if "lr" in m else ""
        print(f"step {m['step']:>6d}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}{lr}  "
              f"{m['tokens_per_s']:,.0f} tok/s  {m['model_tflops']:.1f} TFLOP/s  {m['step_time_s']:.3f} s",
              file=stream, flush=True)
    return Hook(log, every=every, at_end=True)


def fit(model: nnx.Module, data: Iterable[Batch], optimizer: optax.GradientTransformation | None = None, *,
        steps: int | None = None, config: EngineConfig = EngineConfig(), learning_rate: float | Schedule = 3e-4,
        lr_schedule: Schedule | None = None, seed: int = 0, hooks: Sequence[Hook] = (), log_every: int | None = 10,
        peak_tflops: float | None = None, write_back: bool = True, checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None, keep_checkpoints: int | None = 3,
        resume: str | Path | None = None) -> History:
    """Train ``model`` (concrete, or abstract from ``nnx.eval_shape`` and initialized from ``seed``) on
    ``data``, an iterable of ``Batch``, for ``steps`` optimizer steps (or until the data ends).

    The default optimizer is AdamW (``default_optimizer(learning_rate)``); clipping and micro-batching are
    in ``config``. Returns the metrics history; the trained parameters are written into ``model`` at the
    end unless ``write_back`` is False or the model is abstract (then read them from ``history.engine``).
    ``peak_tflops`` (e.g. 989 for an H100's dense bf16) adds an ``mfu`` metric.

    Checkpoints (``megatrain_jax.checkpoint``): with ``checkpoint_dir``, the whole host state, the data
    position and the run config are saved asynchronously every ``checkpoint_every`` steps and at the end,
    keeping the newest ``keep_checkpoints``; SIGTERM/SIGINT finish the step, save, and exit
    (``CheckpointedExit``, status 0). ``resume='auto'`` continues from the newest complete checkpoint of
    ``checkpoint_dir`` (a path resumes from that checkpoint); ``steps`` counts from step 0, so a resumed
    run ends where the uninterrupted one would, bit for bit. Saves happen when the engine's step is a
    multiple of ``checkpoint_every`` (the engine runs one step ahead of the metrics, so never at step 1).
    """
    optimizer_name = "default_optimizer" if optimizer is None else type(optimizer).__name__
    if optimizer is None:
        optimizer = default_optimizer(learning_rate)
        lr_schedule = lr_schedule or (learning_rate if callable(learning_rate) else (lambda _: learning_rate))
    engine = Engine(model, optimizer, config, seed=seed)
    history = History(engine=engine)
    hooks = list(hooks) + ([print_logger(log_every)] if log_every else [])
    session = None
    if checkpoint_dir is not None or resume is not None:
        run_config = jsonable({"model": getattr(model, "cfg", None), "engine": config, "seed": seed, "steps": steps,
                               "learning_rate": learning_rate, "optimizer": optimizer_name})
        session = CheckpointSession(checkpoint_dir, every=checkpoint_every, keep=keep_checkpoints, resume=resume,
                                    config=run_config, accumulate=config.accumulate_steps)
        data = session.start(engine, data)
        hooks.append(Hook(session.after_step))
    if steps is not None:
        data = itertools.islice(iter(data), max(0, steps - engine.state.step) * config.accumulate_steps)
    params = sum(x.size for x in jax.tree.leaves((engine.state.io, engine.state.blocks)))
    cfg = model.cfg
    last: dict | None = None
    with session.running() if session else contextlib.nullcontext():  # waits for the save in flight on exit
        for m in engine.steps(data):
            fpt = model_flops_per_token(params, getattr(cfg, "layers", 0), getattr(cfg, "hidden", 0),
                                        engine.last_seq_len)
            m["model_tflops"] = m["tokens_per_s"] * fpt / 1e12
            if peak_tflops:
                m["mfu"] = m["model_tflops"] / peak_tflops
            if lr_schedule is not None:
                m["lr"] = float(lr_schedule(m["step"] - 1))
            history.records.append(m)
            for hook in hooks:
                if m["step"] % hook.every == 0:
                    hook.fn(m, engine)
            last = m
        if last is not None:
            for hook in hooks:
                if hook.at_end and last["step"] % hook.every:
                    hook.fn(last, engine)
        if session:
            session.finish(engine)
    if write_back and not is_abstract(model):
        engine.write_back(model)
    return history

