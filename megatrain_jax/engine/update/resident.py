"""Parts kept on the GPU with their optimizer state, when GPU memory allows.

With exact clipping no update can start before the whole backward has produced the gradient norm, and the
next forward needs each layer updated before it runs. Keeping the io part and the first blocks resident
(fp32 master, optimizer state and compute copy on the GPU, in the same ``Part`` record as host parts) lets
their update run on the GPU right after the norm, so the next forward starts at once while the host
optimizer updates the later blocks ahead of the GPU. Their gradients never leave the device. Host memory
stays the source of truth: the engine's ``sync`` refreshes the host copies (``HostOptimizer.home``) before
anything reads host state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.contract.layered import Params
from megatrain_jax.engine.parts import Part
from megatrain_jax.engine.transfer import Placement


def apply_scaled_update(tx: optax.GradientTransformation, params: Params, opt_state: Any, grads: Params,
                        scale: jax.Array) -> tuple[Params, Any]:
    """One optimizer update of a part with its gradient scaled (clipping and accumulation averaging)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)  # a bfloat16 gradient widened first
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def stream_copy(params: Params, stream_dtype: Any | None) -> Params | None:
    """The compute-dtype copy of ``params`` that is sent to the device (None: the masters are sent)."""
    if stream_dtype is None:
        return None
    return jax.tree.map(lambda p: p.astype(stream_dtype), params)


class DeviceUpdater:
    """Loads parts onto the device, updates them there (the same optimizer math as the host), and copies
    them back to host memory."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None):
        self.tx = tx
        self.placement = placement
        self.stream_dtype = stream_dtype
        self._update = jax.jit(self._update_fn, donate_argnums=(0,))
        self._cast = jax.jit(lambda p: p if stream_dtype is None else stream_copy(p, stream_dtype))

    def load(self, part: Part) -> Part:
        """A device copy of a host part; its ``stream`` is what the per-part functions consume."""
        params, opt = self.placement.to_device((part.params, part.opt))
        return Part(params, opt, self._cast(params))

    def _update_fn(self, part: Part, grads: Params, scale: jax.Array, ok: jax.Array) -> Part:
        params, opt = apply_scaled_update(self.tx, part.params, part.opt, grads, scale)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # a skipped step
        params, opt = keep(params, part.params), keep(opt, part.opt)
        return Part(params, opt, params if self.stream_dtype is None else stream_copy(params, self.stream_dtype))

    def update(self, part: Part, grads: Params, scale: jax.Array, ok: jax.Array) -> Part:
        """The updated part; where ``ok`` is false (a skipped step) the old values."""
        return self._update(part, grads, scale, ok)
