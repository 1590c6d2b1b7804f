"""What ``fit`` refuses or warns of before and after a run, apart from the run itself: arguments of the wrong kind
(each would fail later, in words about something else), a learning rate below 0 or not a number at a step of the
run, and data that ended before the run did."""

from __future__ import annotations

import math
from typing import Any, Callable

from megatrain_jax.batch import Batch
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.optim import schedule_value
from megatrain_jax.train_config import TrainConfig

Schedule = Callable[[int], Any]


def check_arguments(data: Any, optimizer: Any, train: Any, engine: Any) -> None:
    """Refuse arguments of the wrong kind before anything loads: each would otherwise fail later (after the
    model loaded, or after steps trained) in words about something else."""
    if not isinstance(train, TrainConfig):
        raise TypeError(f"fit's train= takes a TrainConfig (the run's length, logging, checkpoints), got "
                        f"{type(train).__name__}")
    if not isinstance(engine, EngineConfig):
        raise TypeError(f"fit's engine= takes an EngineConfig (how a step runs), got {type(engine).__name__}")
    if optimizer is not None and not (callable(getattr(optimizer, "init", None))
                                      and callable(getattr(optimizer, "update", None))):
        named = {TrainConfig: "train", EngineConfig: "engine"}.get(type(optimizer))
        raise TypeError(f"fit's third argument is the optimizer, an optax GradientTransformation (e.g. "
                        f"megatrain_jax.adamw(3e-4)), got {type(optimizer).__name__}"
                        + (f": pass it by name, {named}=..." if named else ""))
    if isinstance(data, Batch) or not (callable(data) or hasattr(data, "__iter__")):
        again = "; to train on one batch again and again give itertools.repeat(batch, steps)"
        raise TypeError(f"fit's data is an iterable of Batch (a list, a generator, DataConfig(...).build(vocab)), "
                        f"got {type(data).__name__}" + (again if isinstance(data, Batch) else ""))


def check_learning_rate(schedule: Schedule | None, steps: int | None) -> str | None:
    """Refuse a learning rate that is negative or not a number at a step of the run (read at the first, the last
    and 64 steps between); return a warning when it is still rising at the run's last step: a warmup longer than
    the run, which never trains at its peak rate."""
    if schedule is None:
        return None
    last = max((steps or 1) - 1, 0)
    at = sorted({0, last, *range(0, last, max(1, last // 64))})
    values = [schedule_value(schedule, k) for k in at]
    for k, lr in zip(at, values):
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"the optimizer's learning rate at step {k} is {lr}: it must be a finite number >= 0 at "
                             f"every step (a negative one climbs the loss); give a positive rate, or a schedule that "
                             f"stays >= 0 (e.g. optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, steps))")
    if steps is None or last == 0 or not values[-1] > values[0] or values[-1] < max(values):
        return None
    after = schedule_value(schedule, steps)
    if after <= values[-1]:
        return None
    return (f"the learning rate is still rising at the run's last step ({values[0]:.3g} at step 0, {values[-1]:.3g} "
            f"at step {last}, {after:.3g} after it): the run ends inside the schedule's warmup and never trains at its "
            f"peak rate; make the warmup shorter than TrainConfig(steps={steps}), or train longer")


def where_the_data_ended(batches: int, accumulate: int, steps: int | None, step: int) -> list[str]:
    """Warnings for data that ended before the run did, after ``batches`` batches of ``accumulate`` a step, at
    optimizer step ``step``: before ``steps`` steps, in the middle of a step (its batches were not trained) or, on a
    fresh start, before its first batch."""
    said = []
    left = batches % accumulate
    if left:
        said.append(f"the data ended in the middle of an optimizer step: its last {left} batch(es), of the "
                    f"{accumulate} a step takes (EngineConfig.accumulate_steps), were not trained")
    if steps is not None and step < steps:
        said.append(f"the data ran out at step {step} of the {steps} asked for (TrainConfig(steps={steps})): training "
                    f"ended there; give more data (or data that loops), or fewer steps")
    elif steps is None and batches == 0 and step == 0:
        said.append("the data gave no batch, so nothing was trained: is it empty, or an iterator already used up?")
    return said
