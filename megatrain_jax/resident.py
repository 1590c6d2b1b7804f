"""Parts kept on the GPU with their optimizer state, when GPU memory allows.

With exact clipping no update can start before the whole backward has produced the gradient norm, and the
next forward needs each layer updated before it runs. Keeping the io part and the first blocks resident
(fp32 master, optimizer state and compute copy on the GPU) lets their update run on the GPU right after
the norm, so the next forward starts at once while the host optimizer updates the later blocks ahead of
the GPU. Their gradients never leave the device. Host memory stays the source of truth: ``to_host``
refreshes the host copies (the engine does so in ``sync``, before anything reads host state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.host_optimizer import apply_scaled_update
from megatrain_jax.layered import Params
from megatrain_jax.transfer import Placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResidentPart:
    params: Params  # float32 master, on the device
    opt: Any  # optimizer state, on the device
    stream: Params  # what the per-part functions consume (compute dtype)


class ResidentUpdater:
    """Loads parts onto the device, updates them there (same optimizer math as the host), and copies them
    back to host memory."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None):
        self.tx = tx
        self.placement = placement
        self.stream_dtype = stream_dtype
        self._update = jax.jit(self._update_fn, donate_argnums=(0,))
        self._cast_jit = jax.jit(self._cast)  # one compilation per part shape, not one per load

    def _cast(self, params: Params) -> Params:
        if self.stream_dtype is None:
            return params
        return jax.tree.map(lambda p: p.astype(self.stream_dtype), params)

    def load(self, params: Params, opt: Any) -> ResidentPart:
        params, opt = self.placement.to_device((params, opt))
        return ResidentPart(params, opt, self._cast_jit(params))

    def _update_fn(self, part: ResidentPart, grads: Params, scale: jax.Array, ok: jax.Array) -> ResidentPart:
        params, opt = apply_scaled_update(self.tx, part.params, part.opt, grads, scale)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # skipped step
        params, opt = keep(params, part.params), keep(opt, part.opt)
        return ResidentPart(params, opt, self._cast(params))

    def update(self, part: ResidentPart, grads: Params, scale: jax.Array, ok: jax.Array) -> ResidentPart:
        return self._update(part, grads, scale, ok)

    def to_host(self, part: ResidentPart) -> tuple[Params, Any, Params | None]:
        """Host copies of (master, optimizer state, stream copy or None)."""
        stream = None if self.stream_dtype is None else self.placement.copy_to_host(part.stream)
        return self.placement.copy_to_host(part.params), self.placement.copy_to_host(part.opt), stream
