"""Residuals kept from a block's forward for its backward, instead of recomputed.

The engine's backward program recomputes each block from its input (one forward of compute for the
memory of one activation per block). Where a part of the block is expensive to recompute and its residuals
are cheap to keep, the model marks it with ``keep_residuals``: flash attention is the case in point (its
output and softmax statistics are one activation's worth; recomputing them is a second attention forward,
the larger part of a long-context block's time).

- ``keep_residuals(fn)`` is ``fn`` with its output and its VJP's residuals (what its backward needs other
  than its own inputs) named ``KEPT``. It changes nothing by itself: ``fn``'s value and gradient are ``fn``'s.
- ``KEEP_POLICY`` is the ``jax.checkpoint`` policy that saves exactly those values.
- ``KEEP_PRODUCTS_POLICY`` saves those and every matrix product's output (a ``dot_general`` without batch
  dimensions: the projections, not attention's scores): the backward then recomputes only elementwise work
  (norms, rotary embedding, the MLP's gate), no matrix product. About 25% less compute for the block, for
  one activation-sized tensor per projection (``EngineConfig.kept_layers``).
- ``SplitVJP`` takes the VJP closure of a block rematerialized under that policy apart, inside one jitted
  program, into the program's own inputs and the rest (the kept residuals), and puts it together again
  inside another program from that program's inputs and the kept residuals. So the forward program
  returns only the kept residuals (the parameters and the block input are not kept alive by them: the
  backward program is given those anyway), and the backward program runs ``fn``'s backward alone.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import jax
from jax.ad_checkpoint import checkpoint_name

KEPT = "megatrain_kept"
KEEP_POLICY = jax.checkpoint_policies.save_only_these_names(KEPT)
KEEP_PRODUCTS_POLICY = jax.checkpoint_policies.save_from_both_policies(
    KEEP_POLICY, jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def keep_residuals(fn: Callable) -> Callable:
    """``fn`` (positional array arguments, array outputs), whose output and backward's residuals other than
    its inputs are named ``KEPT``: under ``KEEP_POLICY`` they are saved and ``fn`` is not recomputed for the
    backward.
    Integer arguments (offsets, segment ids) are allowed; their cotangents are float0 zeros."""

    @jax.custom_vjp
    def kept(*args):
        return fn(*args)

    def forward(*args):
        out, pullback = jax.vjp(fn, *args)
        # The output too: what follows ``fn`` needs it for its own backward (attention's output is the
        # o-projection's input), and recomputing it would mean running ``fn`` again. A residual that is the
        # output (cuDNN keeps its output) is the same named value, kept once.
        named = {id(o): checkpoint_name(o, KEPT) for o in jax.tree.leaves(out)}
        inputs = {id(a) for a in jax.tree.leaves(args)}
        leaves, tree = jax.tree.flatten(pullback)
        leaves = [x if id(x) in inputs else named[id(x)] if id(x) in named else checkpoint_name(x, KEPT)
                  for x in leaves]
        return jax.tree.map(lambda o: named[id(o)], out), jax.tree.unflatten(tree, leaves)

    def backward(pullback, cotangent):
        return pullback(cotangent)

    kept.defvjp(forward, backward)
    return kept


class SplitVJP:
    """A VJP closure split into a program's inputs and kept residuals, and joined again in another program.

    ``split`` runs while the forward program is traced: it records, under ``key`` (whatever identifies the
    program's shapes), the closure's structure and which of its leaves are which of the program's inputs
    (by identity: the closure holds the very input arrays it was built from) or constants of the trace,
    and returns the other leaves. ``join`` runs while the backward program is traced, after a ``split``
    under the same key. A key whose layout changes between traces, or kept values that do not match it,
    are refused: they would pair residuals with the wrong slots."""

    def __init__(self):
        self._layouts: dict[Hashable, tuple[Any, tuple, tuple]] = {}

    def split(self, key: Hashable, pullback: Callable, inputs: Any) -> tuple[jax.Array, ...]:
        where = {id(x): i for i, x in enumerate(jax.tree.leaves(inputs))}
        leaves, tree = jax.tree.flatten(pullback)
        # each leaf: ("in", index of the input), ("const", value) for a constant of the trace, or ("kept",)
        layout = tuple(("in", where[id(x)]) if id(x) in where else
                       ("kept",) if isinstance(x, jax.core.Tracer) else ("const", x) for x in leaves)
        kept = tuple(x for x, w in zip(leaves, layout) if w[0] == "kept")
        avals = tuple((x.shape, str(x.dtype)) for x in kept)
        if key in self._layouts:
            _, known, known_avals = self._layouts[key]
            if [w[:1] if w[0] == "const" else w for w in known] != [w[:1] if w[0] == "const" else w for w in layout] \
                    or known_avals != avals:
                raise RuntimeError(f"the VJP closure under {key} changed between traces: kept residuals would "
                                   f"be paired with the wrong slots")
        self._layouts[key] = tree, layout, avals
        return kept

    def join(self, key: Hashable, kept: tuple[jax.Array, ...], inputs: Any) -> Callable:
        if key not in self._layouts:
            raise RuntimeError(f"no forward program was traced for {key}: the backward that uses kept residuals "
                               f"must follow the forward that made them")
        tree, layout, avals = self._layouts[key]
        if tuple((x.shape, str(x.dtype)) for x in kept) != avals:
            raise RuntimeError(f"kept residuals {[(x.shape, str(x.dtype)) for x in kept]} do not match what the "
                               f"forward under {key} kept: {list(avals)}")
        ins, rest = jax.tree.leaves(inputs), iter(kept)
        return jax.tree.unflatten(tree, [next(rest) if w[0] == "kept" else ins[w[1]] if w[0] == "in" else w[1]
                                         for w in layout])
