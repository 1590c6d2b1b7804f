"""The optimizer update, applied part by part to host-memory arrays.

Any optax ``GradientTransformation`` that acts leaf by leaf works (AdamW, SGD, Lion, schedules, weight
decay masks given as callables of the params tree). Transforms that look across the whole tree, like
``clip_by_global_norm``, must not be part of it: clipping is done by the engine, exactly, from the norm
of the whole gradient, and handed to every part's update as a scale factor.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.layered import Params
from megatrain_jax.transfer import Placement


def clip_scale(sq_norms: list[jax.Array], clip_norm: float | None, accumulate: int) -> tuple[jax.Array, jax.Array]:
    """Global norm of the mean gradient (the host holds the sum of ``accumulate`` gradients) and the factor
    that turns the summed gradient into the clipped mean: ``min(1, clip / norm) / accumulate``."""
    norm = jnp.sqrt(sum(jnp.asarray(s, jnp.float32) for s in sq_norms)) / accumulate
    scale = jnp.float32(1.0 / accumulate)
    if clip_norm is not None:
        scale = jnp.where(norm < clip_norm, scale, scale * clip_norm / norm)
    return norm, scale


class HostOptimizer:
    """Jitted init and update whose inputs and outputs are all pinned-host arrays, so XLA runs them as host
    computation. One compilation serves every block (identical shapes); the io part has its own."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None):
        self.tx = tx
        self.placement = placement
        self.stream_dtype = None if stream_dtype in (None, jnp.float32) else jnp.dtype(stream_dtype)
        host = placement.host
        self._init = jax.jit(tx.init, out_shardings=host)
        # Donating host buffers lets XLA update in place on the GPU client; the CPU client cannot use it.
        donate = (0, 1, 2) if placement.on_gpu else ()
        self._update = jax.jit(self._update_fn, out_shardings=host, donate_argnums=donate)
        self._cast = jax.jit(self.stream_copy, out_shardings=host)

    def init(self, params: Params) -> Any:
        return self._init(params)

    def stream_copy(self, params: Params) -> Params | None:
        if self.stream_dtype is None:
            return None
        return jax.tree.map(lambda p: p.astype(self.stream_dtype), params)

    def cast(self, params: Params) -> Params | None:
        return None if self.stream_dtype is None else self._cast(params)

    def _update_fn(self, params: Params, opt_state: Any, grads: Params, scale: jax.Array):
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, self.stream_copy(params)

    def update(self, params: Params, opt_state: Any, grads: Params, scale: jax.Array):
        """Returns (new params, new optimizer state, new stream copy or None); all in host memory."""
        return self._update(params, opt_state, grads, scale)
