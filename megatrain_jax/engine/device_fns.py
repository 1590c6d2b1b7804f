"""The jitted per-part computations that run on the accelerators. Each is compiled once per shape and
reused for every layer: the blocks of one kind share one stateless template (graphdef), only their
parameters differ; a block program is compiled once per kind of block (``LayeredModel.block_kinds``).

Over several devices (a mesh with a ``data`` axis, ``megatrain_jax.engine.transfer.Placement``) a part's host
state is spread over the devices (the first axis of each leaf, where it divides evenly:
``Placement.spec``), and each device fetches only its shard over its own PCIe link. Then, per part:

- a fetched part is ``Shards`` until its first use: the first micro-batch's program (``embed``, ``forward``,
  a ``backward``) all-gathers it inside itself over the mesh (NVLink on GPUs) and also returns it whole for
  the other micro-batches: once per fetch, whatever the number of micro-batches;
- the per-micro-batch programs are per-device programs (``shard_map``) on the device's rows of the
  micro-batch; their gradients are each device's own, accumulated in float32 over the micro-batches, and
  stacked over the mesh (a leading axis of one entry per device);
- the last micro-batch's ``backward`` (or ``embed_backward``, for the io part) sums them over the mesh
  inside itself, in float32: reduce-scattered to each device's shard, or all-reduced for replicated
  leaves. That shard is what goes back to host memory.

Inside one program XLA's latency-hiding scheduler overlaps the collectives with the compute that does not
need them: the MLP weights' gather with the attention, the MLP gradients' reduce-scatter with the
attention's backward (experiments/studies/NOTES.md, issue 14). Losses are summed over the mesh. On one device
there is nothing to gather, stack or sum: the programs are the plain ones.

Training's forward can also return each block's kept residuals (``megatrain_jax.contract.remat``: what the model
marked with ``keep_residuals``, e.g. flash attention's output and statistics), which its backward then
takes instead of recomputing them (``forward(..., keep=True)``, ``backward(..., kept=...)``); with
``products=True`` also every matrix product's output (``KEEP_PRODUCTS_POLICY``), so that the backward
recomputes no matrix product (``EngineConfig.kept_layers``). Over several devices they are per-device
values, stacked over the mesh like the gradients.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.contract.layered import LayeredModel, Params
from megatrain_jax.contract.remat import KEEP_POLICY, KEEP_PRODUCTS_POLICY, SplitVJP
from megatrain_jax.engine.transfer import DATA, Placement
from megatrain_jax.loss import NextToken, Objective

# Argument and output kinds of the per-device programs (each covers a whole pytree): the device's rows of
# a batch or activation; a value every device holds whole (a gathered part, a scalar); each device's own
# gradient, stacked over the mesh.
ROWS = PartitionSpec(DATA)
WHOLE = PartitionSpec()
STACKED = PartitionSpec(DATA)


# XLA's latency-hiding scheduler (off by default on GPUs) is what moves a collective's start before, and its
# end after, the compute that does not need it; without it the gathers and reduce-scatters run exposed.
_OVERLAP = {"xla_gpu_enable_latency_hiding_scheduler": True}
# The matrix products on cuBLAS rather than XLA's Triton emitter: the 32B row through `train` ran a 2.3% shorter
# step so (12.96 against 13.26 s, one H200 of nvidia-h200-x2; experiments/results/
# h200x2_32b_32k_cli_triton_off_fca06c7.json beside h200x2_32b_32k_cli_fca06c7.json), one 13B block +0.3% to
# +2.1%. A setting of the same flag in XLA_FLAGS wins.
_PRODUCTS_FLAG = "xla_gpu_enable_triton_gemm"


def compiler_options(devices: int) -> dict:
    """The XLA options the per-part programs compile with: the products on cuBLAS (unless ``XLA_FLAGS`` sets
    the flag itself), and on several devices the latency-hiding scheduler. Keys are XLA's debug options, which
    a backend other than the GPU's ignores."""
    options = {} if _PRODUCTS_FLAG in os.environ.get("XLA_FLAGS", "") else {_PRODUCTS_FLAG: False}
    return {**options, **(_OVERLAP if devices > 1 else {})}


def _mask_sum(masks: list) -> jax.Array:
    return sum(jnp.sum(m) for m in masks)


def _sq_norm(tree: Params) -> jax.Array:
    # On the CPU each leaf is widened to float32 behind a barrier before it is summed: XLA's CPU code sums a bfloat16
    # array converted inside the reduction in another order than a float32 one (on AVX-512 hosts), and there the
    # norm of a bfloat16 gradient is its float32 widening's, bit for bit, as engine_options.md says of
    # host_grad_dtype and device_grad_dtype. Not on a GPU: the barrier would hold a float32 copy of a part's gradient
    # (twice its bfloat16 bytes, 13 GB for a GPT-OSS-120B block) that the memory plan does not count.
    widen = (lambda g: jax.lax.optimization_barrier(g.astype(jnp.float32))) if jax.default_backend() == "cpu" else (
        lambda g: g.astype(jnp.float32))
    return sum(jnp.sum(jnp.square(widen(g))) for g in jax.tree.leaves(tree))


class Shards:
    """A part as fetched onto several devices: each holds its shard (``Placement.spec``); the first program
    that uses it gathers it."""

    def __init__(self, tree: Params):
        self.tree = tree


class DeviceFns:
    """The per-micro-batch programs ``embed``, ``forward``, ``head``, ``backward``, ``embed_backward`` and
    ``nll_sum`` (evaluation), each taking a part's parameters first and returning ``(result, params)``
    (``forward_keep`` and ``backward_kept`` are the variants with kept residuals; the block programs take the
    block's ``kind`` and run that kind's template):
    ``params`` whole on every device, gathered by this call when they came as ``Shards``. ``backward`` and
    ``embed_backward`` with ``last=True`` return the part's gradient summed over the mesh, spread like its
    host state. Small helpers: ``fetched``, ``sq_norm``, ``add``, ``mask_sum``, ``inv_count``."""

    # name: (per-device body, kinds of the arguments after the params, kinds of the outputs, donated
    # arguments, which output is the gradient accumulator that ``last`` sums over the mesh). A block
    # program's body takes the kind of block as a keyword (``kind``), bound when its program is built; a
    # routed kind's block programs (``_routed_calls``) also return its statistics, and its backward takes
    # the auxiliary loss's gradient with respect to them.
    def __init__(self, lm: LayeredModel, placement: Placement, objective: Objective = NextToken()):
        self.lm = lm
        self.objective = objective  # what the head's loss is (``megatrain_jax.loss``): next-token, or pairs (DPO)
        self.mesh: Mesh = placement.mesh
        self.size = placement.size
        self._spec = placement.spec
        self.routed = bool(lm.routed_kinds)  # some blocks return statistics for the auxiliary loss
        self._calls = {
            "embed": (lm.embed, (ROWS, ROWS, ROWS), ROWS, (), None),
            "forward": (lm.block, (ROWS, ROWS, ROWS), ROWS, (), None),
            "head": (self._head, (ROWS, ROWS, ROWS, WHOLE, STACKED), (WHOLE, ROWS, STACKED), (5,), None),
            "backward": (self._backward, (ROWS, ROWS, ROWS, ROWS, STACKED), (ROWS, STACKED), (5,), 1),
            "forward_keep": (self._forward_keep, (ROWS, ROWS, ROWS), (ROWS, STACKED), (), None),
            "backward_kept": (self._backward_kept, (ROWS, ROWS, ROWS, STACKED, ROWS, STACKED), (ROWS, STACKED), (6,), 1),
            "forward_products": (functools.partial(self._forward_keep, products=True), (ROWS, ROWS, ROWS),
                                 (ROWS, STACKED), (), None),
            "backward_products": (functools.partial(self._backward_kept, products=True),
                                  (ROWS, ROWS, ROWS, STACKED, ROWS, STACKED), (ROWS, STACKED), (6,), 1),
            "embed_backward": (self._embed_backward, (ROWS, ROWS, ROWS, ROWS, STACKED), (STACKED,), (5,), 0),
            "nll_sum": (self._nll_sum, (ROWS, ROWS, ROWS), WHOLE, (), None),
            "head_pairs": (self._head_pairs, (ROWS, ROWS, ROWS, ROWS, WHOLE, STACKED), (WHOLE, WHOLE, ROWS, STACKED),
                           (6,), None),
            "row_nll": (self._row_nll, (ROWS, ROWS, ROWS), ROWS, (), None),
        }
        self._routed_calls = {
            "forward": (self._forward_routed, (ROWS, ROWS, ROWS), (ROWS, WHOLE), (), None),
            "backward": (self._backward, (ROWS, ROWS, ROWS, ROWS, WHOLE, STACKED), (ROWS, STACKED), (6,), 1),
            "forward_keep": (self._forward_keep, (ROWS, ROWS, ROWS), ((ROWS, WHOLE), STACKED), (), None),
            "backward_kept": (self._backward_kept, (ROWS, ROWS, ROWS, STACKED, ROWS, WHOLE, STACKED), (ROWS, STACKED),
                              (7,), 1),
            "forward_products": (functools.partial(self._forward_keep, products=True), (ROWS, ROWS, ROWS),
                                 ((ROWS, WHOLE), STACKED), (), None),
            "backward_products": (functools.partial(self._backward_kept, products=True),
                                  (ROWS, ROWS, ROWS, STACKED, ROWS, WHOLE, STACKED), (ROWS, STACKED), (7,), 1),
        }
        self._programs: dict[tuple[str, int | None, bool, bool], Callable] = {}
        self._split = SplitVJP()  # the block's VJP closure between forward_keep and backward_kept
        self.sq_norm = jax.jit(_sq_norm)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self.to_bfloat16 = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))  # gradients sent home
        # one element of a single-device array: ready once the work queued before it on that device has run
        self.fence = jax.jit(lambda a: a.reshape(-1)[:1])
        self.mask_sum = jax.jit(_mask_sum)  # the loss tokens of a batch
        self.inv_count = jax.jit(lambda masks: 1.0 / jnp.maximum(_mask_sum(masks), 1.0))
        # the auxiliary loss of the batch's summed block statistics, and its gradient with respect to them
        self.aux = jax.jit(jax.value_and_grad(lm.aux_loss)) if self.routed else None

    # ------------------------------------------------------------------ calls
    def fetched(self, shards: Params) -> Params | Shards:
        """A part just fetched as each device's shard: ``Shards`` for the first program to gather (on one
        device the part itself)."""
        return Shards(shards) if self.size > 1 else shards

    def embed(self, io, tokens_BT, positions_BT, segment_ids_BT):
        return self._call("embed", io, tokens_BT, positions_BT, segment_ids_BT)

    def forward(self, params, x_BTD, positions_BT, segment_ids_BT, keep: bool = False, kind: int = 0,
                products: bool = False):
        """(y, params) of a block of ``kind``; of a routed kind (``lm.routes(kind)``) ((y, the block's statistics summed over the
        mesh), params). With ``keep``, ((that, the block's kept residuals), params): a tuple of arrays for
        ``backward``'s ``kept`` (empty when the model marks nothing, or marks nothing on this backend). With
        ``products`` too, the kept residuals include every matrix product's output (``KEEP_PRODUCTS_POLICY``):
        pass ``products`` to ``backward`` as well."""
        name = ("forward_products" if products else "forward_keep") if keep else "forward"
        return self._call(name, params, x_BTD, positions_BT, segment_ids_BT, kind=kind)

    def head(self, io, x_BTD, targets_BT, mask_BT, inv_count, io_acc):
        """((loss, d(loss)/dx, io_acc), io)."""
        return self._call("head", io, x_BTD, targets_BT, mask_BT, inv_count, io_acc)

    def head_pairs(self, io, x_BTD, targets_BT, mask_BT, ref_B, inv_pairs, io_acc):
        """A pair objective's head (``objective.pairs``, DPO): ((loss, the pairs' summed statistics,
        d(loss)/dx, io_acc), io). Each device's rows hold whole pairs."""
        return self._call("head_pairs", io, x_BTD, targets_BT, mask_BT, ref_B, inv_pairs, io_acc)

    def row_nll(self, io, x_BTD, targets_BT, mask_BT):
        """Each row's summed masked NLL ([B], spread by row like the batch)."""
        return self._call("row_nll", io, x_BTD, targets_BT, mask_BT)

    def backward(self, params, x_BTD, positions_BT, segment_ids_BT, dy_BTD, acc, d_stats=None, last: bool = False,
                 kept: tuple | None = None, kind: int = 0, products: bool = False):
        """((dx, acc), params) of a block of ``kind``; with ``last`` the accumulated gradient comes back
        summed over the mesh. For a routed kind, ``d_stats`` is the auxiliary loss's gradient with respect to
        the block's statistics (other kinds take none). ``kept``: what ``forward(..., keep=True)`` returned for
        this block and micro-batch, and ``products`` as given to that call."""
        extra = (d_stats,) if self.lm.routes(kind) else ()
        if kept is not None:
            return self._call("backward_products" if products else "backward_kept", params, x_BTD, positions_BT,
                              segment_ids_BT, kept, dy_BTD, *extra, acc, last=last, kind=kind)
        return self._call("backward", params, x_BTD, positions_BT, segment_ids_BT, dy_BTD, *extra, acc, last=last,
                          kind=kind)

    def embed_backward(self, io, tokens_BT, positions_BT, segment_ids_BT, dx_BTD, io_acc, last: bool = False):
        (acc,), io = self._call("embed_backward", io, tokens_BT, positions_BT, segment_ids_BT, dx_BTD, io_acc,
                                last=last)
        return acc, io

    def nll_sum(self, io, x_BTD, targets_BT, mask_BT):
        return self._call("nll_sum", io, x_BTD, targets_BT, mask_BT)

    def compiled(self, name: str, params, *args, last: bool = False, kind: int = 0) -> jax.stages.Compiled:
        """The program a call of ``name`` (for a block program: on a block of ``kind``) with these arguments
        runs (``jax.ShapeDtypeStruct`` leaves, with the shardings the engine's arrays will have), compiled
        but not run: its memory analysis and output shapes (``megatrain_jax.engine.program_memory``). The
        engine's call with such arrays then finds the compilation done."""
        gather = isinstance(params, Shards)
        program = self._program(name, kind, gather, last and self.size > 1)
        return program.lower(params.tree if gather else params, *args).compile()

    def _call(self, name: str, params, *args, last: bool = False, kind: int = 0):
        gather = isinstance(params, Shards)
        program = self._program(name, kind, gather, last and self.size > 1)
        out = program(params.tree if gather else params, *args)
        return (out[0], out[1]) if gather else (out, params)

    # ------------------------------------------------------------------ programs
    def _program(self, name: str, kind: int, gather: bool, reduce: bool) -> Callable:
        """``jit(shard_map(body))`` for one kind of call (a block program: on a block of ``kind``): its
        parameters gathered first when ``gather``, and its accumulator summed over the mesh last when
        ``reduce``; on one device, plain ``jit(body)``."""
        if name not in BLOCK_PROGRAMS:
            kind = None  # the io part's programs: one whatever the kinds of block
        key = name, kind, gather, reduce
        if key in self._programs:
            return self._programs[key]
        routed = kind is not None and self.lm.routes(kind)
        body, in_specs, out_specs, donate, acc_out = (self._routed_calls if routed else self._calls)[name]
        if kind is not None:
            body = functools.partial(body, kind=kind)
        if self.size == 1:
            self._programs[key] = jax.jit(body, donate_argnums=donate, compiler_options=compiler_options(1))
            return self._programs[key]

        def program(params, *args):
            pspecs = jax.tree.map(self._spec, params)  # how the part's state is spread (global shapes)

            def per_device(params, *args):
                if gather:
                    params = jax.tree.map(lambda x, s: jax.lax.all_gather(x, DATA, axis=0, tiled=True)
                                          if s == ROWS else x, params, pspecs)
                out = body(params, *args)
                if reduce:
                    out = list(out) if isinstance(out, tuple) else [out]
                    out[acc_out] = self._reduce(out[acc_out], pspecs)
                    out = tuple(out)
                return (out, params) if gather else out

            # None (no accumulator yet) has no arrays: any spec fits it. No varying-axis checks: model code
            # (a scan's carry, say) need not know it runs per device; gradients are summed explicitly.
            specs = tuple(WHOLE if a is None else s for a, s in zip(args, in_specs))
            outs = out_specs
            if reduce:
                outs = tuple(pspecs if i == acc_out else o for i, o in enumerate(outs))
            if gather:
                outs = (outs, WHOLE)
            return jax.shard_map(per_device, mesh=self.mesh, in_specs=(pspecs if gather else WHOLE, *specs),
                                 out_specs=outs, check_vma=False)(params, *args)

        self._programs[key] = jax.jit(program, donate_argnums=donate, compiler_options=compiler_options(self.size))
        return self._programs[key]

    def _reduce(self, stacked: Params, specs: Params) -> Params:
        """Per device, inside a program: each device's gradient (stacked), summed over the mesh in float32
        and spread like the part's state (reduce-scattered, or all-reduced where a leaf is replicated)."""
        return jax.tree.map(lambda g, s: jax.lax.psum_scatter(g[0], DATA, scatter_dimension=0, tiled=True)
                            if s == ROWS else jax.lax.psum(g[0], DATA), stacked, specs)

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

    def _head_pairs(self, io: Params, x_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array, ref_B: jax.Array,
                    inv_pairs: jax.Array, io_acc: Params | None):
        """A pair objective's contribution of one micro-batch (its pairs' summed losses over the batch's
        pairs), the pairs' summed statistics, d(loss)/dx and the io gradient added to ``io_acc``."""
        def scaled_loss(io, x):
            logps = -self.lm.head_row_nll(io, x, targets_BT, mask_BT)
            losses, chosen, rejected = self.objective.pair_terms(logps, ref_B)
            return jnp.sum(losses) * inv_pairs, self.objective.stats(chosen, rejected)
        (loss, stats), (g_io, dx_BTD) = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)(io, x_BTD)
        return self._sum(loss), self._sum(stats), dx_BTD, self._accumulate(io_acc, g_io)

    def _row_nll(self, io: Params, x_BTD, targets_BT, mask_BT) -> jax.Array:
        return self.lm.head_row_nll(io, x_BTD, targets_BT, mask_BT)

    def _backward(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                  segment_ids_BT: jax.Array | None, dy_BTD: jax.Array, *rest, kind: int):
        """Recompute the block from its saved input and pull ``dy`` back: (dx, accumulated grads). ``rest``:
        for a routed kind ``d_stats``, then the accumulator."""
        _, pullback = jax.vjp(self._block_fn(positions_BT, segment_ids_BT, kind), params, x_BTD)
        return self._pull(pullback, dy_BTD, rest, kind)

    def _pull(self, pullback: Callable, dy_BTD: jax.Array, rest: tuple, kind: int):
        """A block's VJP applied: ``dy`` (and for a routed kind the auxiliary loss's gradient ``rest[0]`` with
        respect to the block's statistics: every device's share of the summed statistics has the same
        gradient as the sum); the parameters' gradient added to the accumulator ``rest[-1]``."""
        g_params, dx_BTD = pullback((dy_BTD, rest[0]) if self.lm.routes(kind) else dy_BTD)
        return dx_BTD, self._accumulate(rest[-1], g_params)

    def _forward_routed(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array | None, kind: int):
        y_BTD, stats = self.lm.block_routed(params, x_BTD, positions_BT, segment_ids_BT, kind)
        return y_BTD, jax.tree.map(self._sum, stats)

    def _block_fn(self, positions_BT: jax.Array, segment_ids_BT: jax.Array | None, kind: int) -> Callable:
        """The block of ``kind`` as a function of (params, x): its output, and for a routed kind its
        statistics too."""
        block = self.lm.block_routed if self.lm.routes(kind) else self.lm.block
        return lambda p, x: block(p, x, positions_BT, segment_ids_BT, kind)

    def _kept_key(self, kind: int, products: bool, params: Params, *args) -> tuple:
        """What identifies a block program (its kind, what it keeps and its shapes), the same in its forward
        and its backward."""
        return (kind, products) + tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves((params, args)))

    def _forward_keep(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                      segment_ids_BT: jax.Array | None, kind: int, products: bool = False):
        """The block's output (and statistics), and the residuals the model marked to keep (with
        ``products``, every matrix product's output too): the block is rematerialized under ``KEEP_POLICY``
        (``KEEP_PRODUCTS_POLICY``), and its VJP closure split into this program's inputs and the rest
        (``SplitVJP``), which is returned."""
        policy = KEEP_PRODUCTS_POLICY if products else KEEP_POLICY
        block = jax.checkpoint(self._block_fn(positions_BT, segment_ids_BT, kind), policy=policy)
        out, pullback = jax.vjp(block, params, x_BTD)
        kept = self._split.split(self._kept_key(kind, products, params, x_BTD, positions_BT, segment_ids_BT),
                                 pullback, (params, x_BTD, positions_BT, segment_ids_BT))
        if self.lm.routes(kind):
            out = out[0], jax.tree.map(self._sum, out[1])
        if self.size > 1:  # per-device values: stacked over the mesh
            kept = tuple(k[None] for k in kept)
        return out, kept

    def _backward_kept(self, params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                       segment_ids_BT: jax.Array | None, kept: tuple, dy_BTD: jax.Array, *rest, kind: int,
                       products: bool = False):
        """As ``_backward``, through the VJP closure ``_forward_keep`` split: rebuilt from this program's
        inputs and the kept residuals, it recomputes only what was not kept."""
        if self.size > 1:
            kept = tuple(k[0] for k in kept)
        pullback = self._split.join(self._kept_key(kind, products, params, x_BTD, positions_BT, segment_ids_BT),
                                    kept, (params, x_BTD, positions_BT, segment_ids_BT))
        return self._pull(pullback, dy_BTD, rest, kind)

    def _embed_backward(self, io: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array | None, dx_BTD: jax.Array, io_acc: Params) -> tuple[Params]:
        _, pullback = jax.vjp(lambda p: self.lm.embed(p, tokens_BT, positions_BT, segment_ids_BT), io)
        (g_io,) = pullback(dx_BTD)
        return (self._accumulate(io_acc, g_io),)

    def _nll_sum(self, io: Params, x_BTD, targets_BT, mask_BT) -> jax.Array:
        return self._sum(self.lm.head_nll_sum(io, x_BTD, targets_BT, mask_BT))

    def _sum(self, x: jax.Array) -> jax.Array:
        return x if self.size == 1 else jax.lax.psum(x, DATA)

    def cache_sizes(self) -> dict[str, Any]:
        """How many compilations each per-micro-batch function holds (1 per distinct shape, variant and kind
        of block; tests assert this)."""
        sizes = dict.fromkeys(("embed", "forward", "head", "backward", "embed_backward"), 0)
        for (name, _, _, _), program in self._programs.items():
            name = {"forward_keep": "forward", "backward_kept": "backward", "forward_products": "forward",
                    "backward_products": "backward"}.get(name, name)
            if name in sizes:
                sizes[name] += program._cache_size()
        return sizes


# The programs that run a block, built once per kind of block.
BLOCK_PROGRAMS = frozenset({"forward", "forward_keep", "backward", "backward_kept", "forward_products",
                            "backward_products"})

_CACHE: dict[tuple, DeviceFns] = {}


def device_fns(lm: LayeredModel, placement: Placement, objective: Objective = NextToken()) -> DeviceFns:
    """One set of compiled functions per model structure, mesh and objective, shared by every engine in the
    process."""
    key = (lm, placement.mesh, objective)
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = DeviceFns(lm, placement, objective)
    return _CACHE[key]
