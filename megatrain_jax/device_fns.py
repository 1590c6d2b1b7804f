"""The jitted per-part computations that run on the accelerators. Each is compiled once per shape and
reused for every layer: blocks share one stateless template (graphdef), only their parameters differ.

Over several devices (a mesh with a ``data`` axis, ``megatrain_jax.transfer.Placement``) a part's host
state is spread over the devices (the first axis of each leaf, where it divides evenly:
``Placement.spec``), and each device fetches only its shard over its own PCIe link. Then, per part:

- ``gather`` all-gathers the fetched shards over the mesh (NVLink on GPUs): every device holds the whole
  part, once per fetch, whatever the number of micro-batches;
- the per-micro-batch functions (``embed``, ``forward``, ``head``, ``backward``, ...) are per-device
  programs (``shard_map``) on the device's rows of the micro-batch; their gradients are each device's
  own, accumulated in float32 over the micro-batches, and stacked over the mesh (a leading axis of one
  entry per device);
- ``reduce`` sums them over the mesh once per part and step, in float32: reduce-scattered to each
  device's shard, or all-reduced for replicated leaves. That shard is what goes back to host memory.

Losses are summed over the mesh. On one device there is nothing to gather, stack or sum: ``gather`` and
``reduce`` return their input and the programs are the plain ones.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.layered import LayeredModel
from megatrain_jax.parts import Params
from megatrain_jax.transfer import DATA, Placement

# Argument and output kinds of the per-device programs (each covers a whole pytree): the device's rows of
# a batch or activation; a value every device holds whole (a gathered part, a scalar); each device's own
# gradient, stacked over the mesh.
ROWS = PartitionSpec(DATA)
WHOLE = PartitionSpec()
STACKED = PartitionSpec(DATA)


def _mask_sum(masks: list) -> jax.Array:
    return sum(jnp.sum(m) for m in masks)


def _sq_norm(tree: Params) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


class DeviceFns:
    """``gather``, ``embed``, ``forward``, ``head``, ``backward``, ``embed_backward``, ``reduce``, ``nll_sum``
    (evaluation) and small helpers (``sq_norm``, ``add``, ``mask_sum``, ``inv_count``)."""

    def __init__(self, lm: LayeredModel, placement: Placement):
        self.lm = lm
        self.mesh: Mesh = placement.mesh
        self.size = placement.size
        self._spec = placement.spec
        self.embed = self._spmd(lm.embed, (WHOLE, ROWS, ROWS, ROWS), ROWS)
        self.forward = self._spmd(lm.block, (WHOLE, ROWS, ROWS, ROWS), ROWS)
        self.head = self._spmd(self._head, (WHOLE, ROWS, ROWS, ROWS, WHOLE, STACKED), (WHOLE, ROWS, STACKED),
                               donate_argnums=(5,))
        self.backward = self._spmd(self._backward, (WHOLE, ROWS, ROWS, ROWS, ROWS, STACKED), (ROWS, STACKED),
                                   donate_argnums=(5,))
        self.embed_backward = self._spmd(self._embed_backward, (WHOLE, ROWS, ROWS, ROWS, ROWS, STACKED), STACKED,
                                         donate_argnums=(5,))
        self.nll_sum = self._spmd(self._nll_sum, (WHOLE, ROWS, ROWS, ROWS), WHOLE)
        self._gathers: dict[Any, Any] = {}
        self._reduces: dict[Any, Any] = {}
        self.sq_norm = jax.jit(_sq_norm)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self.mask_sum = jax.jit(_mask_sum)  # the loss tokens of a batch
        self.inv_count = jax.jit(lambda masks: 1.0 / jnp.maximum(_mask_sum(masks), 1.0))

    # ------------------------------------------------------------------ programs
    def _spmd(self, body: Callable, in_specs: tuple, out_specs: Any, donate_argnums: tuple = ()):
        """``jit(shard_map(body))`` with every argument and output of the given kind; on one device, plain
        ``jit(body)``."""
        if self.size == 1:
            return jax.jit(body, donate_argnums=donate_argnums)

        def program(*args):
            # None (no accumulator yet) has no arrays: any spec fits it. No varying-axis checks: model code
            # (a scan's carry, say) need not know it runs per device; gradients are summed explicitly.
            specs = tuple(WHOLE if a is None else s for a, s in zip(args, in_specs))
            return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)

        named = lambda spec: NamedSharding(self.mesh, spec, memory_kind="device")
        return jax.jit(program, out_shardings=jax.tree.map(named, out_specs), donate_argnums=donate_argnums)

    def _per_structure(self, cache: dict, tree: Params, build: Callable[[Params], Callable], shape=lambda x: x.shape):
        key = jax.tree.structure(tree), tuple(x.shape for x in jax.tree.leaves(tree))
        if key not in cache:
            cache[key] = build(jax.tree.map(lambda x: self._spec(jax.ShapeDtypeStruct(shape(x), x.dtype)), tree))
        return cache[key]

    def gather(self, part: Params) -> Params:
        """A part fetched as shards (``Placement.spec``), whole on every device."""
        if self.size == 1:
            return part

        def build(specs):
            gather = lambda t: jax.tree.map(
                lambda x, s: jax.lax.all_gather(x, DATA, axis=0, tiled=True) if s == ROWS else x, t, specs)
            per_device = jax.shard_map(gather, mesh=self.mesh, in_specs=(specs,), out_specs=WHOLE, check_vma=False)
            return jax.jit(per_device, out_shardings=NamedSharding(self.mesh, WHOLE, memory_kind="device"))
        return self._per_structure(self._gathers, part, build)(part)

    def reduce(self, stacked: Params) -> Params:
        """Each device's gradient of a part, summed over the mesh in float32 and spread like the part's
        state: reduce-scattered to each device's shard, all-reduced where a leaf is replicated."""
        if self.size == 1:
            return stacked

        def build(specs):
            def total(t):
                return jax.tree.map(lambda g, s: jax.lax.psum_scatter(g[0], DATA, scatter_dimension=0, tiled=True)
                                    if s == ROWS else jax.lax.psum(g[0], DATA), t, specs)
            per_device = jax.shard_map(total, mesh=self.mesh, in_specs=STACKED, out_specs=specs, check_vma=False)
            named = jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind="device"), specs)
            return jax.jit(per_device, out_shardings=named)
        return self._per_structure(self._reduces, stacked, build, shape=lambda x: x.shape[1:])(stacked)

    # ------------------------------------------------------------------ per-device bodies
    def _accumulate(self, acc: Params | None, grads: Params) -> Params:
        """Float32 gradient accumulation over micro-batches (the first starts the sum); over several
        devices each device's own, with a leading axis of one entry (the stacking axis)."""
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if self.size > 1:
            grads = jax.tree.map(lambda g: g[None], grads)
        return grads if acc is None else jax.tree.map(jnp.add, acc, grads)

    def _head(self, io: Params, x_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
              inv_count: jax.Array, io_acc: Params | None):
        """Loss contribution of one micro-batch, d(loss)/dx, and the io gradient added to ``io_acc``."""
        def scaled_loss(io, x):
            return self.lm.head_nll_sum(io, x, targets_BT, mask_BT) * inv_count
        loss, (g_io, dx_BTD) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(io, x_BTD)
        return self._sum(loss), dx_BTD, self._accumulate(io_acc, g_io)

    def _backward(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                  segment_ids_BT: jax.Array | None, dy_BTD: jax.Array, acc: Params | None):
        """Recompute the block from its saved input and pull ``dy`` back: (dx, accumulated grads)."""
        _, pullback = jax.vjp(lambda p, x: self.lm.block(p, x, positions_BT, segment_ids_BT), params, x_BTD)
        g_params, dx_BTD = pullback(dy_BTD)
        return dx_BTD, self._accumulate(acc, g_params)

    def _embed_backward(self, io: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array | None, dx_BTD: jax.Array, io_acc: Params) -> Params:
        _, pullback = jax.vjp(lambda p: self.lm.embed(p, tokens_BT, positions_BT, segment_ids_BT), io)
        (g_io,) = pullback(dx_BTD)
        return self._accumulate(io_acc, g_io)

    def _nll_sum(self, io: Params, x_BTD, targets_BT, mask_BT) -> jax.Array:
        return self._sum(self.lm.head_nll_sum(io, x_BTD, targets_BT, mask_BT))

    def _sum(self, x: jax.Array) -> jax.Array:
        return x if self.size == 1 else jax.lax.psum(x, DATA)

    def cache_sizes(self) -> dict[str, Any]:
        """How many compilations each function holds (1 per distinct shape; tests assert this)."""
        return {name: getattr(self, name)._cache_size()
                for name in ("embed", "forward", "head", "backward", "embed_backward")}


_CACHE: dict[tuple, DeviceFns] = {}


def device_fns(lm: LayeredModel, placement: Placement) -> DeviceFns:
    """One set of compiled functions per model structure and mesh, shared by every engine in the process."""
    key = (lm, placement.mesh)
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = DeviceFns(lm, placement)
    return _CACHE[key]
