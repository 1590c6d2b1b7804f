"""Held-out loss computed from the engine's host state, streamed layer by layer like training.

The model is never whole on the device: the engine walks the schedule's forward-only ops
(``schedule.eval_ops``): the io part stays fetched, each block's parameters are sent ahead and every
evaluation micro-batch passes through it before the next block, so only one layer boundary of
activations exists at a time. Batches are split like training batches (``micro_batches``), so the
per-layer programs compiled for training are reused.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from megatrain_jax.batch import Batch
from megatrain_jax.engine.engine import Engine
from megatrain_jax.fit import Hook, StepInfo


def evaluate(engine: Engine, batches: Iterable[Batch] | Batch) -> dict[str, float]:
    """Mean next-token loss (over tokens whose ``loss_mask`` is 1) and perplexity of the engine's current
    parameters on ``batches`` (or one ``Batch``): ``{'eval_loss', 'eval_ppl', 'eval_tokens'}``."""
    batches = held_out(batches)
    nll, count = engine.eval_nll(batches)
    loss = nll / max(count, 1.0)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(count)}


def held_out(batches: Iterable[Batch] | Batch) -> list[Batch]:
    """The evaluation batches as a list, refused when they hold no token in the loss: their loss would read 0
    and their perplexity 1, a perfect score from nothing."""
    batches = [batches] if isinstance(batches, Batch) else list(batches)
    if not batches:
        raise ValueError("evaluation got no batches; is the held-out split empty (smaller than one batch)?")
    if all(isinstance(b, Batch) and b.loss_mask is not None and not np.any(np.asarray(b.loss_mask)) for b in batches):
        raise ValueError(f"the {len(batches)} evaluation batch(es) hold no token in the loss (every loss_mask is all "
                         f"zero): their loss would read 0; check the held-out data's masking")
    return batches


def eval_hook(batches: Sequence[Batch] | None, every: int, total_steps: int | None = None,
              measure: Callable[[Engine], dict[str, float]] | None = None) -> Hook:
    """A fit hook that evaluates on ``batches`` after every ``every``-th step and after the last, adding
    ``eval_loss``, ``eval_ppl``, ``eval_tokens`` and ``eval_s`` to the metrics of that step. ``measure(engine)``
    replaces the next-token evaluation of ``batches`` where given (preference training's held-out pairs:
    ``data.preference.evaluate_pairs``); its metrics are added instead.

    Because metrics arrive one step late, the parameters after step k are evaluated when the hook for
    step k-1 runs (``info.params_step`` is k then, before step k+1 is dispatched), and the result is
    attached to step k's metrics, so later hooks (writers, progress) see it in the same record. Put this
    hook before them.
    """
    if measure is None:
        batches = held_out(batches)
        measure = lambda engine: evaluate(engine, batches)  # noqa: E731
    if every < 1:
        raise ValueError(f"eval every must be >= 1, got {every}")
    pending: dict[int, dict] = {}

    def run(m: dict, info: StepInfo) -> None:
        at = info.params_step
        due = at % every == 0 or at == total_steps or at == m["step"]  # the last equality: the final step
        if due and at not in pending and at >= m["step"]:
            t = time.perf_counter()
            result = measure(info.engine)
            result["eval_s"] = time.perf_counter() - t
            pending[at] = result
        if m["step"] in pending:
            m.update(pending.pop(m["step"]))

    return Hook(run, every=1)
