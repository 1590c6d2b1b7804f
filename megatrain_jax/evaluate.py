"""Held-out loss computed from the engine's host state, streamed layer by layer like training.

The model is never whole on the device: the io part stays resident, each block's parameters are sent
(one layer ahead) and every evaluation micro-batch passes through it before the next layer, so only one
layer boundary of activations exists at a time. Batches are split like training batches
(``engine.cfg.micro_batches``), so the per-layer programs compiled for training are reused.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Iterable, Sequence

import jax
import numpy as np

from megatrain_jax.batch import Batch, check_batch
from megatrain_jax.engine import Engine
from megatrain_jax.fit import Hook
from megatrain_jax.layered import LayeredModel


@functools.lru_cache(maxsize=8)
def _nll_sum(lm: LayeredModel):
    return jax.jit(lm.head_nll_sum)


def evaluate(engine: Engine, batches: Iterable[Batch]) -> dict[str, float]:
    """Mean next-token loss (over tokens whose ``loss_mask`` is 1) and perplexity of the engine's current
    parameters on ``batches``: ``{'eval_loss', 'eval_ppl', 'eval_tokens'}``."""
    lm, place, state = engine.lm, engine.placement, engine.state
    micro: list[Batch] = []
    for batch in batches:
        check_batch(batch, lm.vocab_size, lm.max_positions)
        micro += batch.filled().split(engine.cfg.micro_batches if batch.shape[0] % engine.cfg.micro_batches == 0
                                      else 1)
    if not micro:
        raise ValueError("evaluate() got no batches; is the held-out split empty?")
    count = sum(float(np.sum(m.loss_mask)) for m in micro)
    if callable(getattr(engine, "sync", None)):
        engine.sync()  # host updates may run in place on a worker thread: read the parameters once they are done
    dev = [place.to_device(m) for m in micro]
    io = place.to_device(state.params_for_stream(None))
    xs = [engine.fns.embed(io, b.inputs) for b in dev]
    nxt = place.to_device(state.params_for_stream(0))
    for i in range(lm.n_blocks):
        params, nxt = nxt, (place.to_device(state.params_for_stream(i + 1)) if i + 1 < lm.n_blocks else None)
        xs = [engine.fns.forward(params, x, b.positions, b.segment_ids) for x, b in zip(xs, dev)]
    nll = _nll_sum(lm)
    total = sum(float(nll(io, x, b.targets, b.loss_mask)) for x, b in zip(xs, dev))
    loss = total / max(count, 1.0)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(count)}


def _params_step(m: dict, engine: Engine, total_steps: int | None) -> int:
    """The step whose parameters the engine holds when the hook for ``m`` runs: metrics arrive one step
    late, so this is ``m['step'] + 1`` except after the last step."""
    s = getattr(engine.state, "step", None)
    if isinstance(s, (int, np.integer)):
        return int(s)
    return m["step"] if total_steps is not None and m["step"] >= total_steps else m["step"] + 1


def eval_hook(batches: Sequence[Batch], every: int, total_steps: int | None = None) -> Hook:
    """A fit hook that evaluates on ``batches`` after every ``every``-th step and after the last, adding
    ``eval_loss``, ``eval_ppl``, ``eval_tokens`` and ``eval_s`` to the metrics of that step.

    Because metrics arrive one step late, the parameters after step k are evaluated when the hook for
    step k-1 runs (before step k+1 is dispatched), and the result is attached to step k's metrics, so
    later hooks (writers, progress) see it in the same record. Put this hook before them.
    """
    batches = list(batches)
    if every < 1:
        raise ValueError(f"eval every must be >= 1, got {every}")
    pending: dict[int, dict] = {}

    def run(m: dict, engine: Engine) -> None:
        at = _params_step(m, engine, total_steps)
        due = at % every == 0 or at == total_steps or at == m["step"]  # the last equality: the final step
        if due and at not in pending and at >= m["step"]:
            t = time.perf_counter()
            result = evaluate(engine, batches)
            result["eval_s"] = time.perf_counter() - t
            pending[at] = result
        if m["step"] in pending:
            m.update(pending.pop(m["step"]))

    return Hook(run, every=1)
