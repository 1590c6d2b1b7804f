"""The optimizer update, applied part by part to host-memory arrays.

Two paths:
- **fused**: for ``megatrain_jax.adamw`` the C++ kernel (``kernels/host_adamw``) updates the pinned-host
  parameters and moments in place and writes the bfloat16 stream copy in the same pass;
- **generic**: any optax ``GradientTransformation`` that acts leaf by leaf (SGD, Lion, schedules,
  callable weight-decay masks) runs as a jitted computation whose inputs and outputs are pinned-host
  arrays, which XLA executes on the host.

Transforms that look across the whole tree, like ``clip_by_global_norm``, must not be part of the
optimizer: the engine clips exactly, from the norm of the whole gradient, and hands each part's update
the resulting scale factor.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kernels import host_adamw
from megatrain_jax.layered import Params
from megatrain_jax.optim import AdamWState, fused_spec
from megatrain_jax.transfer import Placement


def clip_scale(sq_norms: list[jax.Array], clip_norm: float | None, accumulate: int) -> tuple[jax.Array, jax.Array]:
    """Global norm of the mean gradient (the host holds the sum of ``accumulate`` gradients) and the factor
    that turns the summed gradient into the clipped mean: ``min(1, clip / norm) / accumulate``."""
    norm = jnp.sqrt(sum(jnp.asarray(s, jnp.float32) for s in sq_norms)) / accumulate
    scale = jnp.float32(1.0 / accumulate)
    if clip_norm is not None:
        scale = jnp.where(norm < clip_norm, scale, scale * clip_norm / norm)
    return norm, scale


def apply_scaled_update(tx: optax.GradientTransformation, params: Params, opt_state: Any, grads: Params,
                        scale: jax.Array) -> tuple[Params, Any]:
    """One optimizer update of a part with its gradient scaled (clipping and accumulation averaging)."""
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _pointers_writable(placement: Placement) -> bool:
    """Whether a write through a pinned-host array's buffer address is what the array then holds."""
    x = placement.copy_to_host(jnp.zeros((4,), jnp.float32))
    jax.block_until_ready(x)
    ctypes.memmove(x.unsafe_buffer_pointer(), np.arange(1, 5, dtype=np.float32).ctypes.data, 16)
    return bool(np.array_equal(np.asarray(jax.device_get(x)), np.arange(1, 5, dtype=np.float32)))


class HostOptimizer:
    """Init and update of one part's optimizer state, all in pinned host memory."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None,
                 use_kernel: bool = True):
        self.tx = tx
        self.placement = placement
        self.stream_dtype = None if stream_dtype in (None, jnp.float32) else jnp.dtype(stream_dtype)
        host = placement.host
        self._init = jax.jit(tx.init, out_shardings=host)
        # Donating host buffers lets XLA update in place on the GPU client; the CPU client cannot use it.
        donate = (0, 1, 2) if placement.on_gpu else ()
        self._update = jax.jit(self._update_fn, out_shardings=host, donate_argnums=donate)
        self._cast = jax.jit(self.stream_copy, out_shardings=placement.device)
        self.spec = fused_spec(tx)
        self.kernel = None
        if use_kernel and self.spec is not None and self.stream_dtype in (None, jnp.bfloat16):
            self.kernel = host_adamw.load()
            if self.kernel is not None and not _pointers_writable(placement):
                warnings.warn("pinned-host buffers are not writable in place here; using the JAX host optimizer")
                self.kernel = None

    @property
    def fused(self) -> bool:
        return self.kernel is not None

    def init(self, params: Params) -> Any:
        if self.spec is not None:  # zeros written straight to pinned memory; XLA host compute is slow
            zeros = lambda p: self.placement.copy_to_host(np.zeros(p.shape, np.float32))
            return AdamWState(self.placement.copy_to_host(np.zeros((), np.int32)),
                              jax.tree.map(zeros, params), jax.tree.map(zeros, params))
        return self._init(params)

    def stream_copy(self, params: Params) -> Params | None:
        if self.stream_dtype is None:
            return None
        return jax.tree.map(lambda p: p.astype(self.stream_dtype), params)

    def cast(self, params: Params) -> Params | None:
        """A fresh stream copy of host ``params``, cast on the device (fast) and written back to host."""
        if self.stream_dtype is None:
            return None
        return self.placement.copy_to_host(self._cast(self.placement.to_device(params)))

    def _update_fn(self, params: Params, opt_state: Any, grads: Params, scale: jax.Array):
        params, opt_state = apply_scaled_update(self.tx, params, opt_state, grads, scale)
        return params, opt_state, self.stream_copy(params)

    def update(self, params: Params, opt_state: Any, grads: Params, stream: Params | None, scale: jax.Array):
        """New (params, optimizer state, stream copy), all in host memory. The fused path writes into
        ``params``, the moments and ``stream`` in place and returns them."""
        if self.kernel is None:
            return self._update(params, opt_state, grads, self.placement.to_host(scale))
        t = self._next_count(opt_state)
        self._run_kernel(host_adamw.adamw_inplace, params, opt_state, grads, stream, float(scale), t)
        return params, self._counted(opt_state, t), stream

    @property
    def splits(self) -> bool:
        """Whether ``update_stream`` + ``commit`` can stand in for ``update`` (fused kernel, bf16 stream copy)."""
        return self.kernel is not None and self.stream_dtype == jnp.bfloat16

    def update_stream(self, params: Params, opt_state: AdamWState, grads: Params, stream: Params,
                      scale: jax.Array) -> int:
        """First half of a split update: only the stream copy of the new parameters (2 of the 14 bytes per
        parameter an update writes), the part the next forward needs. Returns the step count for ``commit``."""
        assert self.splits, "split updates need the fused kernel and a bfloat16 stream copy"
        t = self._next_count(opt_state)
        self._run_kernel(host_adamw.adamw_stream_inplace, params, opt_state, grads, stream, float(scale), t)
        return t

    def commit(self, params: Params, opt_state: AdamWState, grads: Params, scale: jax.Array,
               t: int) -> tuple[Params, AdamWState]:
        """Second half: the master parameters and moments, in place, bit for bit what ``update`` writes (the
        stream copy ``update_stream`` wrote already holds their bfloat16 rounding)."""
        self._run_kernel(host_adamw.adamw_inplace, params, opt_state, grads, None, float(scale), t)
        return params, self._counted(opt_state, t)

    @staticmethod
    def _next_count(state: AdamWState) -> int:
        return int(np.asarray(jax.device_get(state.count))) + 1

    def _counted(self, state: AdamWState, t: int) -> AdamWState:
        # From numpy straight into pinned memory: no accelerator round trip per part and step.
        return AdamWState(self.placement.to_host(np.asarray(t, np.int32)), state.mu, state.nu)

    def _run_kernel(self, kernel_fn, params: Params, state: AdamWState, grads: Params, stream: Params | None,
                    scale: float, t: int) -> None:
        spec = self.spec
        bc1, bc2 = spec.bias_corrections(float(t))
        lr = float(spec.lr_at(t - 1))
        jax.block_until_ready(grads)
        streams = jax.tree.leaves(stream) if stream is not None else [None] * len(jax.tree.leaves(params))
        for p, m, v, g, s, decay in zip(jax.tree.leaves(params), jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
                                        jax.tree.leaves(grads), streams, jax.tree.leaves(spec.decays(params))):
            kernel_fn(self.kernel, p.unsafe_buffer_pointer(), m.unsafe_buffer_pointer(), v.unsafe_buffer_pointer(),
                      g.unsafe_buffer_pointer(), None if s is None else s.unsafe_buffer_pointer(), p.size,
                      lr=lr, b1=spec.b1, b2=spec.b2, eps=spec.eps, wd=spec.weight_decay if decay else 0.0,
                      grad_scale=scale, bc1=bc1, bc2=bc2)
