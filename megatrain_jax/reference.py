"""The in-memory reference trainer: plain ``jax.grad`` + optax over the whole model on one device.

It is the ground truth for every engine test, and the path for models that fit on the device anyway.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from megatrain_jax.batch import Batch, check_batch
from megatrain_jax.contract.layered import check_contract, routes
from megatrain_jax.loss import NextToken, Objective, causal_lm_loss, token_nll


def model_loss(model: nnx.Module, batch: Batch, objective: Objective = NextToken()) -> jax.Array:
    """The whole model's loss, logits materialized in full: the mean masked next-token loss, or a pair
    objective's (``DPO``: the mean over the batch's pairs, from each row's summed log-probability), plus the
    model's auxiliary loss (``model.aux_loss`` of the routed blocks' summed statistics) where it has one."""
    if getattr(model, "aux_loss", None) is None:
        logits, aux = model(batch.inputs, batch.positions, batch.segment_ids), 0.0
    else:
        x = model.io.embed(batch.inputs, batch.positions, batch.segment_ids)
        stats = []
        for block in model.blocks:
            if routes(block):
                x, s = block.routed(x, batch.positions, batch.segment_ids)
                stats.append(s)
            else:
                x = block(x, batch.positions, batch.segment_ids)
        logits = model.io.unembed(model.io.final_hidden(x))
        aux = model.aux_loss(jax.tree.map(lambda *xs: sum(xs), *stats))
    if objective.pairs:
        mask = jnp.ones(batch.targets.shape) if batch.loss_mask is None else batch.loss_mask
        logps = -jnp.sum(token_nll(logits, batch.targets) * mask.astype(jnp.float32), axis=-1)
        losses, _, _ = objective.pair_terms(logps, batch.ref_logps)
        return jnp.mean(losses) + aux
    return causal_lm_loss(logits, batch.targets, batch.loss_mask) + aux


class ReferenceTrainer:
    """Whole-model training: ``step(batches)`` averages the gradients of the batches given (the gradient
    of the mean of per-batch mean losses, which the engine's ``accumulate_steps`` matches), clips them by
    global norm and applies ``optimizer``.

    ``clip_norm`` defaults to 1.0, like ``EngineConfig.clip_norm``, so that the two trainers built with
    their defaults do the same thing; None turns clipping off."""

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
                 clip_norm: float | None = 1.0, objective: Objective = NextToken()):
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"ReferenceTrainer clip_norm must be positive or None (no clipping), got {clip_norm!r}")
        check_contract(model)
        self.model = model
        self.objective = objective
        self.vocab_size = model.cfg.vocab_size
        self.max_positions = getattr(model.cfg, "max_positions", None)
        self.segments_per_row = getattr(model.cfg, "segments_per_row", None)
        clip = optax.clip_by_global_norm(clip_norm) if clip_norm is not None else optax.identity()
        self.tx = optax.chain(clip, optimizer)
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.params = params
        self.opt_state = self.tx.init(params)
        self._grad = jax.jit(jax.value_and_grad(self._loss))
        self._apply = jax.jit(self._update)

    def _loss(self, params, batch: Batch) -> jax.Array:
        return model_loss(nnx.merge(self.graphdef, params), batch, self.objective)

    def _update(self, params, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    def step(self, batches: Batch | Sequence[Batch]) -> dict[str, float]:
        batches = [batches] if isinstance(batches, Batch) else list(batches)
        losses, grads = [], None
        for batch in batches:
            check_batch(batch, self.vocab_size, self.max_positions, self.segments_per_row)
            loss, g = self._grad(self.params, batch.filled())
            losses.append(loss)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        grads = jax.tree.map(lambda g: g / len(batches), grads)
        self.params, self.opt_state, gnorm = self._apply(self.params, self.opt_state, grads)
        nnx.update(self.model, self.params)
        return {"loss": float(sum(losses) / len(losses)), "grad_norm": float(gnorm)}
