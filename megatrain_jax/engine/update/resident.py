"""Parts kept on the GPU with their optimizer state, when GPU memory allows, and streamed parts updated there.

With exact clipping no update can start before the whole backward has produced the gradient norm, and the
next forward needs each layer updated before it runs. Keeping the io part and the first blocks resident
(fp32 master and optimizer state on the GPU, in the same ``Part`` record as host parts) lets
their update run on the GPU right after the norm, so the next forward starts at once while the host
optimizer updates the later blocks ahead of the GPU. Their gradients never leave the device. Host memory
stays the source of truth: the engine's ``sync`` refreshes the host copies (``HostOptimizer.home``) before
anything reads host state.

A resident part's compute-dtype copy (bfloat16 beside float32 masters) is kept on the GPU between its uses,
written by the update (``EngineConfig.resident_copy`` true, the default), or not kept (false: ``Part.stream``
is None on the device): then each fetch casts the masters (``DeviceUpdater.weights``), the same cast the update
would have stored, so the numbers are the same and the GPU holds 2 bytes a parameter less of every resident part
(12 instead of 14 in full precision: more blocks fit). The cast reads 4 and writes 2 bytes a parameter of GPU
memory at each fetch, and its copy is dropped with the block's release, as a streamed block's weights are.
"""

from __future__ import annotations

import functools
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

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None,
                 keep_copy: bool = True):
        self.tx = tx
        self.placement = placement
        self.stream_dtype = stream_dtype
        self.keep_copy = keep_copy and stream_dtype is not None  # without a stream dtype the masters are used
        self._update = jax.jit(self._update_fn, donate_argnums=(0,))
        self._visit = jax.jit(functools.partial(self._update_fn, copy=True), donate_argnums=(0,))
        self._cast = jax.jit(lambda p: stream_copy(p, stream_dtype))  # only where a stream dtype is set

    def load(self, part: Part) -> Part:
        """A device copy of a host part: masters and optimizer state, and its compute copy where kept."""
        params, opt = self.bring(part)
        return Part(params, opt, self._cast(params) if self.keep_copy else None)

    def weights(self, part: Part) -> Params:
        """What the per-part functions consume of a resident part: its kept compute copy, else its masters cast
        to the stream dtype at this use (the masters themselves where no stream dtype is set)."""
        return part.streamed() if part.stream is not None or self.stream_dtype is None else self._cast(part.params)

    def with_copy(self, part: Part) -> Part:
        """``part`` with its compute copy, as a host part holds one (for the copy home, ``HostOptimizer.home``)."""
        if part.stream is not None or self.stream_dtype is None:
            return part
        return Part(part.params, part.opt, self._cast(part.params))

    def _update_fn(self, part: Part, grads: Params, scale: jax.Array, ok: jax.Array, copy: bool | None = None) -> Part:
        params, opt = apply_scaled_update(self.tx, part.params, part.opt, grads, scale)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # a skipped step
        params, opt = keep(params, part.params), keep(opt, part.opt)
        copy = self.keep_copy if copy is None else copy
        return Part(params, opt, stream_copy(params, self.stream_dtype) if copy else None)

    def bring(self, part: Part) -> tuple[Params, Any]:
        """A streamed part's masters and moments copied to the device for its update there
        (``EngineConfig.gpu_updated_layers``; queued, not waited for, except pageable leaves, each copied through
        pinned memory and waited for: ``Placement.to_device``)."""
        return self.placement.to_device((part.params, part.opt))

    def visit(self, brought: tuple[Params, Any], grads: Params, scale: jax.Array, ok: jax.Array) -> tuple[Part, Params]:
        """A streamed part updated here from its ``brought`` state, as a resident part is, and sent back.
        Returns the updated record in pinned host memory (masters, moments, compute copy; the copies home are
        queued, not waited for) and the part's new weights on the device, for the forward that asked for them."""
        new = self._visit(Part(*brought, None), grads, scale, ok)
        home = Part(*self.placement.to_host((new.params, new.opt, new.stream)))  # one batched copy home
        return home, new.streamed()

    def update(self, part: Part, grads: Params, scale: jax.Array, ok: jax.Array) -> Part:
        """The updated part; where ``ok`` is false (a skipped step) the old values."""
        return self._update(part, grads, scale, ok)
