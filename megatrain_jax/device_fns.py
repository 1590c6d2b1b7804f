"""The jitted per-part computations that run on the accelerators. Each is compiled once per shape and
reused for every layer: blocks share one stateless template (graphdef), only their parameters differ.

Over several devices (a mesh with a ``data`` axis, ``megatrain_jax.transfer.Placement``) each function is
one SPMD program written per device with ``shard_map``: a device holds its shard of the part's weights
(the first axis spread over the devices where it divides evenly, ``Placement.spec``) and its rows of the
micro-batch. The program all-gathers the weights over the mesh before using them, computes the whole
part's gradient from its rows, and reduce-scatters it in float32, so each device ends with the summed
gradient of exactly its own shard (replicated leaves get the all-reduced sum). Losses are summed over
the mesh. On one device the gathers and sums are no-ops and the programs are the plain ones.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.layered import LayeredModel
from megatrain_jax.parts import Params
from megatrain_jax.transfer import DATA, Placement

ROWS, ONE = PartitionSpec(DATA), PartitionSpec()


def _accumulate(acc: Params | None, grads: Params) -> Params:
    """Float32 gradient accumulation (the first micro-batch starts the sum)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


def _sq_norm(tree: Params) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


def _reduced(grads: Params, specs: Params) -> Params:
    """Inside a per-device program: each device's gradient of the whole part (from its rows), in float32,
    summed over the mesh: reduce-scattered to the device's shard, or all-reduced for replicated leaves.
    Summing in float32 keeps a 16-bit stream's gradients as precise as one device's."""
    def one(g, s):
        g = g.astype(jnp.float32)
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=0, tiled=True) if s == ROWS else jax.lax.psum(g, DATA)
    return jax.tree.map(one, grads, specs)


def _gather(tree: Params, specs: Params) -> Params:
    """Inside a per-device program: each leaf whole, its shards all-gathered along the first axis."""
    return jax.tree.map(lambda x, s: jax.lax.all_gather(x, DATA, axis=0, tiled=True) if s == ROWS else x,
                        tree, specs)


class DeviceFns:
    """``embed``, ``forward``, ``head``, ``backward``, ``embed_backward``, ``nll_sum`` (evaluation) and small
    helpers (``sq_norm``, ``add``, ``mask_sum``, ``inv_count``)."""

    def __init__(self, lm: LayeredModel, placement: Placement):
        self.lm = lm
        self.mesh: Mesh = placement.mesh
        self._spec = placement.spec
        # Argument kinds: "part" (a part's weights or gradient: each leaf by Placement.spec), ROWS (batch
        # rows), ONE (a replicated scalar).
        self.embed = self._spmd(self._embed, ("part", ROWS, ROWS, ROWS), ROWS)
        self.forward = self._spmd(self._forward, ("part", ROWS, ROWS, ROWS), ROWS)
        self.head = self._spmd(self._head, ("part", ROWS, ROWS, ROWS, ONE, "part"), (ONE, ROWS, "part"),
                               donate_argnums=(5,))
        self.backward = self._spmd(self._backward, ("part", ROWS, ROWS, ROWS, ROWS, "part"), (ROWS, "part"),
                                   donate_argnums=(5,))
        self.embed_backward = self._spmd(self._embed_backward, ("part", ROWS, ROWS, ROWS, ROWS, "part"), "part",
                                         donate_argnums=(5,))
        self.nll_sum = self._spmd(self._nll_sum, ("part", ROWS, ROWS, ROWS), ONE)
        self.sq_norm = jax.jit(_sq_norm)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self.mask_sum = jax.jit(lambda masks: sum(jnp.sum(m) for m in masks))  # the loss tokens of a batch
        self.inv_count = jax.jit(lambda masks: 1.0 / jnp.maximum(sum(jnp.sum(m) for m in masks), 1.0))

    def _spmd(self, body: Callable, arg_kinds: tuple, out_kinds: Any, donate_argnums: tuple = ()) -> "_Spmd":
        """``jit(shard_map(body))``: ``body(specs, *args)`` sees each device's share, ``specs`` being the
        first argument's (the part's) leaf specs; outputs of kind "part" are spread like that part."""
        return _Spmd(self, body, arg_kinds, out_kinds, donate_argnums)

    def _embed(self, specs, io: Params, tokens_BT, positions_BT, segment_ids_BT) -> jax.Array:
        return self.lm.embed(_gather(io, specs), tokens_BT, positions_BT, segment_ids_BT)

    def _forward(self, specs, params: Params, x_BTD, positions_BT, segment_ids_BT) -> jax.Array:
        return self.lm.block(_gather(params, specs), x_BTD, positions_BT, segment_ids_BT)

    def _head(self, specs, io: Params, x_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
              inv_count: jax.Array, io_acc: Params | None):
        """Loss contribution of one micro-batch, d(loss)/dx, and the io gradient added to ``io_acc``."""
        def scaled_loss(io, x):
            return self.lm.head_nll_sum(io, x, targets_BT, mask_BT) * inv_count
        loss, (g_io, dx_BTD) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(_gather(io, specs), x_BTD)
        return jax.lax.psum(loss, DATA), dx_BTD, _accumulate(io_acc, _reduced(g_io, specs))

    def _backward(self, specs, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                  segment_ids_BT: jax.Array | None, dy_BTD: jax.Array, acc: Params | None):
        """Recompute the block from its saved input and pull ``dy`` back: (dx, accumulated grads)."""
        block = lambda p, x: self.lm.block(p, x, positions_BT, segment_ids_BT)
        _, pullback = jax.vjp(block, _gather(params, specs), x_BTD)
        g_params, dx_BTD = pullback(dy_BTD)
        return dx_BTD, _accumulate(acc, _reduced(g_params, specs))

    def _embed_backward(self, specs, io: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array | None, dx_BTD: jax.Array, io_acc: Params) -> Params:
        embed = lambda p: self.lm.embed(p, tokens_BT, positions_BT, segment_ids_BT)
        _, pullback = jax.vjp(embed, _gather(io, specs))
        (g_io,) = pullback(dx_BTD)
        return _accumulate(io_acc, _reduced(g_io, specs))

    def _nll_sum(self, specs, io: Params, x_BTD, targets_BT, mask_BT) -> jax.Array:
        return jax.lax.psum(self.lm.head_nll_sum(_gather(io, specs), x_BTD, targets_BT, mask_BT), DATA)

    def cache_sizes(self) -> dict[str, Any]:
        """How many compilations each function holds (1 per distinct shape; tests assert this)."""
        return {name: getattr(self, name)._cache_size()
                for name in ("embed", "forward", "head", "backward", "embed_backward")}


class _Spmd:
    """One per-device function: a jitted ``shard_map`` per part structure (the part's leaf specs fix the
    in and out specs), with the outputs' shardings given explicitly so that feeding an output back as an
    input (gradient accumulators) reuses the same compilation."""

    def __init__(self, fns: DeviceFns, body: Callable, arg_kinds: tuple, out_kinds: Any, donate_argnums: tuple):
        self.fns, self.body, self.arg_kinds, self.out_kinds, self.donate = fns, body, arg_kinds, out_kinds, donate_argnums
        self._jits: dict[Any, Any] = {}

    def __call__(self, *args):
        part = args[0]
        key = jax.tree.structure(part), tuple(x.shape for x in jax.tree.leaves(part))
        if key not in self._jits:
            self._jits[key] = self._build(jax.tree.map(self.fns._spec, part))
        return self._jits[key](*args)

    def _build(self, specs: Params):
        mesh = self.fns.mesh
        kind = lambda k: specs if isinstance(k, str) else k
        outs = tuple(map(kind, self.out_kinds)) if isinstance(self.out_kinds, tuple) else kind(self.out_kinds)

        def program(*args):
            in_specs = tuple(ONE if a is None else kind(k) for a, k in zip(args, self.arg_kinds))  # None: no arrays
            # No varying-axis checks: model code (a scan's carry, say) need not know it runs per device.
            # Gradients are summed over the mesh explicitly (``_reduced``).
            return jax.shard_map(functools.partial(self.body, specs), mesh=mesh, in_specs=in_specs, out_specs=outs,
                                 check_vma=False)(*args)

        named = lambda spec: NamedSharding(mesh, spec, memory_kind="device")
        return jax.jit(program, out_shardings=jax.tree.map(named, outs), donate_argnums=self.donate)

    def _cache_size(self) -> int:
        return sum(f._cache_size() for f in self._jits.values())


def device_fns(lm: LayeredModel, placement: Placement) -> DeviceFns:
    """One set of compiled functions per model structure and mesh, shared by every engine in the process."""
    return _cached(lm, placement.mesh, lambda: DeviceFns(lm, placement))


_CACHE: dict[tuple, DeviceFns] = {}


def _cached(lm: LayeredModel, mesh: Mesh, make: Callable[[], DeviceFns]) -> DeviceFns:
    key = (lm, mesh)
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = make()
    return _CACHE[key]
