"""The optimizer update of one part whose state lives in pinned host memory. Three routes, chosen per
part structure when the engine is built:

- **fused**: ``megatrain_jax.adamw`` runs as the C++ kernel (``kernels/host_adamw.cpp``), in place on the
  host parameters and moments, writing the bfloat16 stream copy in the same pass. With a bfloat16
  stream copy it runs in two halves (``update_stream`` then ``commit``): the update policy puts the first
  on the next forward's critical path and the second after it. Only the kernel ever touches the moments,
  and the masters when a stream copy is what crosses PCIe, so these live in pageable memory (numpy
  arrays: ``home``); the gradients, the stream copy (or the masters, when they are streamed) stay pinned;
- **host**: any other optax transformation that XLA can run on pinned-host operands (SGD, Lion,
  optax.adamw, schedules, callable weight-decay masks) runs as one jitted computation whose inputs and
  outputs are pinned-host arrays, which XLA executes on the host;
- **device**: transformations XLA cannot run on host operands (adafactor, lamb, lars, adagrad,
  apply_if_finite, MultiSteps: their ``select``/``cond`` mix host operands with device constants) run in
  one jitted computation that moves the part's state to the accelerator, updates it there and writes it
  back to pinned host memory. It costs PCIe traffic (about 16 bytes per parameter each way for Adam-like
  state) but runs anything the reference trainer runs.

The precision mode (``megatrain_jax.engine.precision``: its record is handed in) says what is kept in
which dtype and which kernel entry point runs (``KERNELS``).

**Capacity mode** (``EngineConfig.master_dtype="bfloat16"``) is the fused route with bfloat16 masters and
moments: the kernel updates them in float32 arithmetic and writes each back with stochastic rounding, from
random bits that depend only on the step, the part, the leaf and the element's index (so a run is
reproducible, a resume continues it bit for bit, and a part spread over several devices rounds as it
would on one). The masters are pinned (they cross PCIe: no stream copy); the moments pageable.

**Quantized moments** (``EngineConfig.moment_dtype`` "q8" or "m7v5", in capacity mode): each matrix's m and v are
``QuantizedMoment``s, codes (a byte per element in 8 bits; 7 and 5 bits packed eight to a group in m7v5) and one
float32 scale per block of a row, in the format of ``moment_formats.FORMATS``, updated by that format's kernel entry
point with the masters' rounding bits; vectors and small leaves keep bfloat16 moments (the format's ``leaf``). The
gradient the kernel reads may be float32 or bfloat16 (``precision.home_grad_dtype``), in every mode.

Transformations that look across parameters (``clip_by_global_norm``) are refused at engine build by
``megatrain_jax.optim.check_partwise``: the engine clips exactly, from the norm of the whole gradient,
and hands each part's update the resulting scale factor.
"""

from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.contract.layered import Params
from megatrain_jax.engine.parts import Part
from megatrain_jax.engine.precision import FULL, LEAN, SIXTEEN_BITS, Kernel, Precision
from megatrain_jax.engine.transfer import Placement, host_view, local_value, pageable_zeros
from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.moment_formats import FORMATS, MomentFormat
from megatrain_jax.engine.update.resident import apply_scaled_update, stream_copy
from megatrain_jax.optim import AdamWState, fused_spec

Route = Literal["fused", "host", "device"]

# A mode's fused entry point (``Precision.kernel``); a quantized moment's leaf (``QuantizedMoment``) runs its
# format's own (``_run_quantized``).
KERNELS: dict[Kernel, Any] = {"adamw": host_kernel.adamw_inplace, "adamw_sr": host_kernel.adamw_sr_inplace,
                              "adamw_q8": host_kernel.adamw_sr_inplace, "adamw_m7v5": host_kernel.adamw_sr_inplace}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedMoment:
    """One leaf's Adam moment in a quantized format (the engine's ``moment_dtype``, ``moment_formats.FORMATS``):
    ``codes`` (uint8, the format's ``codes_shape`` of the moment) and ``absmax`` (float32, one per block of a row: its
    ``scale_shape``), both pageable."""
    codes: Any
    absmax: Any


def quantized_zeros(fmt: MomentFormat, params: Params, kind: str) -> Params:
    """Zero moments ``kind`` ("m" or "v") for ``params`` in format ``fmt``: ``QuantizedMoment``s for the leaves
    it takes, bfloat16 arrays for the rest, all fresh pageable pages (``pageable_zeros``: nothing is touched until
    the first update)."""
    def zeros(x):
        if fmt.leaf(x.shape):
            return QuantizedMoment(np.zeros(fmt.codes_shape(x.shape, kind), np.uint8),
                                   np.zeros(fmt.scale_shape(x.shape), np.float32))
        return np.zeros(x.shape, jnp.bfloat16)
    return jax.tree.map(zeros, params)


def _pointers_writable(placement: Placement) -> bool:
    """Whether a write through a pinned-host array's buffer address is what the array then holds."""
    x = placement.copy_to_host(np.zeros((), np.float32))
    jax.block_until_ready(x)
    ctypes.memmove(x.addressable_shards[0].data.unsafe_buffer_pointer(), np.float32(7).tobytes(), 4)
    return float(local_value(x)) == 7.0


class HostOptimizer:
    """Init and update of one part's optimizer state, all in pinned host memory."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any | None,
                 use_kernel: bool = True, precision: Precision | None = None):
        """``stream_dtype``: what the weights cross PCIe in; ``precision``: the mode's record (the engine's
        ``precision.mode_of``), by default full precision with a 16-bit ``stream_dtype``, else lean."""
        self.tx = tx
        self.placement = placement
        sixteen = stream_dtype is not None and jnp.dtype(stream_dtype).name in SIXTEEN_BITS
        self.precision = precision or (FULL if sixteen else LEAN)
        self.master_dtype = jnp.dtype(self.precision.masters)
        # the 16-bit copy the weights cross PCIe in, written by the update; None: the masters are streamed
        self.stream_dtype = jnp.dtype(stream_dtype) if self.precision.stream_copy and sixteen else None
        # Donating host buffers lets XLA update in place on the GPU client; the CPU client cannot use it.
        donate = (0, 1, 2) if placement.on_gpu else ()
        self._host_update = placement.jit_into(self._update_fn, "pinned_host", donate)
        self._device_update = placement.jit_into(lambda *args: self._update_fn(*placement.to_device(args)))
        self._cast = placement.jit_into(lambda p: stream_copy(p, self.stream_dtype), "device")
        self._routes: dict[Any, Route] = {}
        self.spec = fused_spec(tx)
        self.kernel = None
        if use_kernel and self.spec is not None and self.stream_dtype in (None, jnp.bfloat16):
            self.kernel = host_kernel.load()
            if self.kernel is not None and not _pointers_writable(placement):
                warnings.warn("pinned-host buffers are not writable in place here; using the JAX host optimizer")
                self.kernel = None
        if self.precision.needs_kernel and self.kernel is None:
            why = ("the optimizer is not megatrain_jax.adamw" if self.spec is None else
                   "the C++ host kernel is unavailable here (no compiler, the build failed, or pinned buffers are "
                   "not writable in place)")
            raise ValueError(f"{self.precision.title} (master_dtype={self.precision.master_dtype!r}) runs "
                             f"megatrain_jax.adamw in the fused host kernel, and {why}; use master_dtype='float32'")

    @property
    def fused(self) -> bool:
        return self.kernel is not None

    @property
    def splits(self) -> bool:
        """Whether updates run as ``update_stream`` + ``commit`` (fused kernel, bfloat16 stream copy)."""
        return self.kernel is not None and self.stream_dtype == jnp.bfloat16

    def fresh(self, params: Params) -> Part:
        """A part's record at step 0 from its float32 masters: fresh optimizer state (``tx.init``, zeros for
        AdamW) and the stream copy. Traceable: the state builder (``host_state.initial_state``) runs it
        inside the one jitted program per part kind, whose outputs land in pinned host memory, and then
        calls ``home``. On the fused route the moments are left out (``None``): ``home`` makes them as
        zeros in pageable memory, which costs nothing until the first update writes them."""
        opt = self.tx.init(params)
        if self.fused:
            opt = AdamWState(opt.count, None, None)
        if self.master_dtype != jnp.float32:  # the initial masters rounded to nearest; from then on, stochastically
            params = jax.tree.map(lambda x: x.astype(self.master_dtype), params)
        return Part(params, opt, stream_copy(params, self.stream_dtype))

    def home(self, part: Part, adopt: bool = False) -> Part:
        """``part`` with each array where it lives between steps, from wherever it is now (device, pinned
        or pageable host memory): pinned host memory for what crosses PCIe, pageable for what only the
        fused kernel touches (its moments, and its masters when a stream copy is sent). Pinned arrays
        already in place are kept. Numpy arrays are copied, unless ``adopt``: then the caller hands them
        over (a restore's freshly read arrays), and those that are writable and C-contiguous become the
        state's own.

        ``fresh`` leaves the fused route's moments as ``None``: here they become zeros."""
        pinned = self.placement.to_pinned
        pageable = lambda tree: self.placement.to_pageable(tree, adopt=adopt)
        stream = None if self.stream_dtype is None else pinned(part.stream)  # a device part may carry its params
        if not self.fused:
            return Part(pinned(part.params), pinned(part.opt), stream)
        opt = part.opt
        moments = jnp.dtype(self.precision.moments)
        zeros = (lambda params, kind: quantized_zeros(FORMATS[self.precision.moment_dtype], params, kind)) if (
            self.precision.quantized) else (lambda params, kind: pageable_zeros(params, moments))
        mu = zeros(part.params, "m") if opt.mu is None else pageable(opt.mu)
        nu = zeros(part.params, "v") if opt.nu is None else pageable(opt.nu)
        params = pinned(part.params) if stream is None else pageable(part.params)  # pinned if streamed
        return Part(params, AdamWState(pinned(opt.count), mu, nu), stream)

    def home_into(self, host: Part, on_device: Part) -> Part:
        """``home(on_device)`` written into ``host``'s own arrays (a GPU-resident part's host record, brought up
        to date), one leaf at a time through a pinned temporary: the part comes home in one leaf's room, not in a
        second copy of it (at 8B, its 12 resident blocks and io part are 3.7 B params: 44 GiB of masters and
        moments). Written in place only where every array can take it (the fused route, whose pinned buffers are
        writable by address; one process; the same shapes and dtypes: the moments exist); elsewhere ``home``.
        Returns the part that now holds the values. Whoever reads ``host``'s arrays (a checkpoint being written)
        must be done with them first: the engine passes the update gates."""
        src = Part(on_device.params, on_device.opt, None if self.stream_dtype is None else on_device.stream)
        dst_leaves, treedef = jax.tree.flatten(host)
        src_leaves, src_def = jax.tree.flatten(src)
        writable = lambda d, s: (d.shape == s.shape and d.dtype == s.dtype and (  # noqa: E731
            self.placement.is_pinned(d) or (isinstance(d, np.ndarray) and d.flags.writeable and d.flags.c_contiguous)))
        if (not self.fused or self.placement.processes > 1 or treedef != src_def
                or not all(writable(d, s) for d, s in zip(dst_leaves, src_leaves))):
            return self.home(on_device)
        for d, s in zip(dst_leaves, src_leaves):
            staged = jax.block_until_ready(self.placement.copy_to_host(s))  # one leaf in pinned memory
            if isinstance(d, np.ndarray):
                for shard in staged.addressable_shards:
                    d[shard.index] = host_view(shard.data)
            else:
                source = self.placement.pieces(staged)
                for key, addresses in self.placement.pieces(d).items():
                    n = int(np.prod([b - a for a, b in key])) * d.dtype.itemsize
                    for address in addresses:
                        ctypes.memmove(address, source[key][0], n)
            del staged
        return host

    def cast(self, params: Params) -> Params | None:
        """A fresh stream copy of host ``params``, cast on the device (fast) and written back to host."""
        if self.stream_dtype is None:
            return None
        return self.placement.copy_to_host(self._cast(self.placement.to_device(params)))

    def route(self, part: Part) -> Route:
        """How this part's update runs (decided once per part structure, by lowering the host route)."""
        if self.kernel is not None:
            return "fused"
        key = jax.tree.structure(part), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(part))
        if key not in self._routes:
            host = self.placement.host_for
            spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host(x)), t)
            grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=host(x)), part.params)
            scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.placement.host)
            try:
                self._host_update.lower(spec(part.params), spec(part.opt), grads, scale).compile()
                self._routes[key] = "host"
            except (ValueError, TypeError):  # host and device operands meet inside the transformation
                self._routes[key] = "device"
        return self._routes[key]

    def compilations(self) -> dict[str, int]:
        """Compiled programs per route (one per distinct part structure; tests assert this)."""
        return {"host": self._host_update.cache_size(), "device": self._device_update.cache_size()}

    def _update_fn(self, params: Params, opt_state: Any, grads: Params, scale: jax.Array):
        params, opt_state = apply_scaled_update(self.tx, params, opt_state, grads, scale)
        return params, opt_state, stream_copy(params, self.stream_dtype)

    def update(self, part: Part, grads: Params, scale: float, salt: int = 0) -> Part:
        """The whole update: the new part, all in host memory. The fused route writes the masters, the
        moments and the stream copy in place. ``scale``: the factor the gradient is scaled by, a float32 value
        read on the host (``StepDecision.scale_value``). ``salt`` (the part's index) keys stochastic rounding's
        bits."""
        route = self.route(part)
        if route == "fused":
            t = self._next_count(part.opt)
            kernel = KERNELS[self.precision.kernel]
            if self.precision.stochastic:
                self._run_kernel(kernel, part, grads, None, float(scale), t, salt=salt)
            else:
                self._run_kernel(kernel, part, grads, part.stream, float(scale), t)
            return Part(part.params, self._counted(part.opt, t), part.stream)
        update = self._host_update if route == "host" else self._device_update
        return Part(*update(part.params, part.opt, grads, self.placement.to_host(np.float32(scale))))

    def update_stream(self, part: Part, grads: Params, scale: float) -> int:
        """First half of a split update: only the stream copy of the new parameters (2 of the 14 bytes per
        parameter an update writes), the part the next forward needs. Returns the step count for ``commit``."""
        assert self.splits, "split updates need the fused kernel and a bfloat16 stream copy"
        t = self._next_count(part.opt)
        self._run_kernel(host_kernel.adamw_stream_inplace, part, grads, part.stream, float(scale), t)
        return t

    def commit(self, part: Part, grads: Params, scale: float, t: int) -> Part:
        """Second half: the master parameters and moments, in place, bit for bit what ``update`` writes (the
        stream copy ``update_stream`` wrote already holds their bfloat16 rounding)."""
        self._run_kernel(host_kernel.adamw_inplace, part, grads, None, float(scale), t)
        return Part(part.params, self._counted(part.opt, t), part.stream)

    def _next_count(self, state: AdamWState) -> int:
        return int(local_value(state.count)) + 1

    def _counted(self, state: AdamWState, t: int) -> AdamWState:
        # From numpy straight into pinned memory: no accelerator round trip per part and step.
        return AdamWState(self.placement.to_host(np.asarray(t, np.int32)), state.mu, state.nu)

    def _run_kernel(self, kernel_fn, part: Part, grads: Params, stream: Params | None, scale: float, t: int,
                    salt: int | None = None) -> None:
        """The kernel over each leaf, piece by piece (``Placement.pieces``: a device's shard, or the whole
        leaf where it is replicated). A piece held by several devices (a replicated leaf) is updated once,
        from its first copy, and the values written are then copied to the others. With a ``salt``, the
        stochastic-rounding kernel runs: each leaf's bits are keyed by (step, salt, leaf), each piece's by
        its offset in the leaf."""
        spec, state = self.spec, part.opt
        bc1, bc2 = spec.bias_corrections(float(t))
        lr = spec.lr_value(t - 1)  # on the host: no wait behind the GPU's queued work
        # the kernel writes the masters and the stream copy by address: a copy into them still in flight (a part
        # just brought home, whose device_put returns at once) must land first, as the gradients must
        jax.block_until_ready((grads, part.params, stream))
        pieces = self.placement.pieces
        leaves = jax.tree.leaves(part.params)
        structure = jax.tree.structure(part.params)  # a QuantizedMoment is one moment leaf, not two
        streams = jax.tree.leaves(stream) if stream is not None else [None] * len(leaves)
        for leaf, (p, m, v, g, s, decay) in enumerate(zip(
                leaves, structure.flatten_up_to(state.mu), structure.flatten_up_to(state.nu),
                jax.tree.leaves(grads), streams, jax.tree.leaves(spec.decays(part.params)))):
            hyper = dict(lr=lr, b1=spec.b1, b2=spec.b2, eps=spec.eps, wd=spec.weight_decay if decay else 0.0,
                         grad_scale=scale, bc1=bc1, bc2=bc2)
            if isinstance(m, QuantizedMoment):
                self._run_quantized(p, m, v, g, t, salt, leaf, hyper)
                continue
            ps, ms, vs, ss = pieces(p), pieces(m), pieces(v), None if s is None else pieces(s)
            g_bf16 = {"g_bf16": True} if g.dtype == jnp.bfloat16 else {}
            for key, g_at in pieces(g).items():
                n = int(np.prod([b - a for a, b in key]))
                if salt is None:
                    kernel_fn(self.kernel, ps[key][0], ms[key][0], vs[key][0], g_at[0],
                              None if ss is None else ss[key][0], n, **hyper, **g_bf16)
                else:
                    kernel_fn(self.kernel, ps[key][0], ms[key][0], vs[key][0], g_at[0], n,
                              seed=rounding_seed(t, salt, leaf), offset=_flat_offset(key, p.shape), **hyper, **g_bf16)
                for copies, itemsize in ((ps[key], p.dtype.itemsize), (ss[key] if ss is not None else [], 2)):
                    for other in copies[1:]:
                        ctypes.memmove(other, copies[0], n * itemsize)

    def _run_quantized(self, p: Any, m: QuantizedMoment, v: QuantizedMoment, g: Any, t: int, salt: int, leaf: int,
                       hyper: dict) -> None:
        """One matrix with quantized moments, piece by piece: a piece is a run of whole rows (``Placement.spec``
        splits the first axis), and the codes and scales of those rows follow the same rows, so each piece's
        call writes what one call on the whole leaf would."""
        fmt = FORMATS[self.precision.moment_dtype]
        cols = int(np.prod(p.shape[1:]))
        m_row, v_row = (x.codes.size // max(p.shape[0], 1) for x in (m, v))  # a row's codes: cols in 8 bits, / 2 in 4
        blocks = m.absmax.shape[1]
        g_bf16 = g.dtype == jnp.bfloat16
        ps = self.placement.pieces(p)
        for key, g_at in self.placement.pieces(g).items():
            a, rows = key[0][0], key[0][1] - key[0][0]
            scales = a * blocks * 4  # byte offset of the piece's first row's scales (and codes: a * m_row, a * v_row)
            fmt.inplace(
                self.kernel, ps[key][0], m.codes.ctypes.data + a * m_row, v.codes.ctypes.data + a * v_row,
                m.absmax.ctypes.data + scales, v.absmax.ctypes.data + scales, g_at[0], rows, cols,
                block=fmt.block, g_bf16=g_bf16, seed=rounding_seed(t, salt, leaf), offset=a * cols,
                **hyper)
            for other in ps[key][1:]:  # a replicated leaf: the first copy was updated, the others follow
                ctypes.memmove(other, ps[key][0], rows * cols * 2)


def rounding_seed(step: int, part: int, leaf: int) -> int:
    """The 32-bit key of stochastic rounding's bits for one leaf's update at optimizer step ``step``."""
    return (step * 0x9E3779B1 ^ part * 0x85EBCA77 ^ leaf * 0xC2B2AE3D) & 0xFFFFFFFF


def _flat_offset(key: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> int:
    """Where a piece (its start and stop per axis) begins in its leaf's flat order. Pieces split the first
    axis only (``Placement.spec``), so a piece is a contiguous run of rows."""
    if not key:
        return 0
    assert all((a, b) == (0, d) for (a, b), d in zip(key[1:], shape[1:])), "pieces split the first axis only"
    return key[0][0] * int(np.prod(shape[1:], dtype=np.int64))
