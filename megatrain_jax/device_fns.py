"""The jitted per-part computations that run on the accelerator. Each is compiled once per shape and
reused for every layer: blocks share one stateless template (graphdef), only their parameters differ."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.layered import LayeredModel
from megatrain_jax.parts import Params


def _accumulate(acc: Params | None, grads: Params) -> Params:
    """Float32 gradient accumulation (the first micro-batch starts the sum)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


def _sq_norm(tree: Params) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


class DeviceFns:
    """``embed``, ``forward``, ``head``, ``backward``, ``embed_backward``, ``nll_sum`` (evaluation) and small
    helpers."""

    def __init__(self, lm: LayeredModel):
        self.lm = lm
        self.embed = jax.jit(lm.embed)
        self.forward = jax.jit(lm.block)
        self.head = jax.jit(self._head, donate_argnums=(5,))
        self.backward = jax.jit(self._backward, donate_argnums=(5,))
        self.embed_backward = jax.jit(self._embed_backward, donate_argnums=(5,))
        self.nll_sum = jax.jit(lm.head_nll_sum)
        self.sq_norm = jax.jit(_sq_norm)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))

    def _head(self, io: Params, x_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
              inv_count: jax.Array, io_acc: Params | None):
        """Loss contribution of one micro-batch, d(loss)/dx, and the io gradient added to ``io_acc``."""
        def scaled_loss(io, x):
            return self.lm.head_nll_sum(io, x, targets_BT, mask_BT) * inv_count
        loss, (g_io, dx_BTD) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(io, x_BTD)
        return loss, dx_BTD, _accumulate(io_acc, g_io)

    def _backward(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                  segment_ids_BT: jax.Array | None, dy_BTD: jax.Array, acc: Params | None):
        """Recompute the block from its saved input and pull ``dy`` back: (dx, accumulated grads)."""
        _, pullback = jax.vjp(lambda p, x: self.lm.block(p, x, positions_BT, segment_ids_BT), params, x_BTD)
        g_params, dx_BTD = pullback(dy_BTD)
        return dx_BTD, _accumulate(acc, g_params)

    def _embed_backward(self, io: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array | None, dx_BTD: jax.Array, io_acc: Params) -> Params:
        _, pullback = jax.vjp(lambda p: self.lm.embed(p, tokens_BT, positions_BT, segment_ids_BT), io)
        (g_io,) = pullback(dx_BTD)
        return _accumulate(io_acc, g_io)

    def cache_sizes(self) -> dict[str, Any]:
        """How many compilations each function holds (1 per distinct shape; tests assert this)."""
        return {name: getattr(self, name)._cache_size()
                for name in ("embed", "forward", "head", "backward", "embed_backward")}


@functools.lru_cache(maxsize=8)
def device_fns(lm: LayeredModel) -> DeviceFns:
    """One set of compiled functions per model structure, shared by every engine in the process."""
    return DeviceFns(lm)
