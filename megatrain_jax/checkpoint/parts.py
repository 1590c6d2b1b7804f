"""The host state as checkpoint *parts*: ``io`` and one ``block_NNNNN`` per block (``PartId.name``), each
holding that part's master parameters and optimizer state as a nested dict of plain string keys, in the
dtypes of the precision mode that wrote them (``Precision.checkpoint`` in ``megatrain_jax.engine.precision``
says what each mode saves and which conversions a restore makes: ``moment_formats``).

Parts are what the writer snapshots, writes and releases one at a time (so a save holds at most about one
part of extra memory), and what a restore reads back one at a time. Names come from the pytree paths
(``params.attn.q.kernel.value``, ``opt.mu.attn.q.kernel.value``, ``opt.count``), so the files do not depend
on Python classes: a restore rebuilds the optimizer's structure from the engine's own state and only
takes the leaves, by name, from the checkpoint. The bf16 stream copies are not saved; a restore
recomputes them from the masters.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import numpy as np

from megatrain_jax.engine.host_state import HostState
from megatrain_jax.engine.parts import PartId
from megatrain_jax.engine.precision import MODES


def _segment(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{"params.attn.q.kernel.value": leaf, ...}`` in flattening order."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(_segment(k) for k in path)
        if name in out:
            raise ValueError(f"two state leaves share the checkpoint name {name!r}")
        out[name] = leaf
    return out


def nest(flat: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``: the tree orbax writes (one array file per leaf)."""
    root: dict[str, Any] = {}
    for name, leaf in flat.items():
        *outer, last = name.split(sep)
        node = root
        for k in outer:
            node = node.setdefault(k, {})
        node[last] = leaf
    return root


def flatten_nested(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of ``nest``; works on orbax metadata trees too."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten_nested(v, name))
        else:
            out[name] = v
    return out


def part_trees(state: HostState) -> Iterator[tuple[PartId, dict[str, Any]]]:
    """``(part, {"params": ..., "opt": ...})`` for every part, in update order, as the state holds them now."""
    for part in state.ids():
        yield part, {"params": state[part].params, "opt": state[part].opt}


def expected_layout(state: HostState) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """``{part: {leaf name: (shape, dtype)}}`` of an engine's state: what a checkpoint must hold."""
    return {part.name: {k: (tuple(v.shape), str(np.dtype(v.dtype))) for k, v in named_leaves(tree).items()}
            for part, tree in part_trees(state)}


class ShapeMismatchError(ValueError):
    """The checkpoint was written for a model (or optimizer) of other shapes."""


QUANTIZED_PARTS = (".codes", ".absmax")  # a quantized moment's two leaves (``QuantizedMoment``)


class MomentFormatWarning(UserWarning):
    """A checkpoint's Adam moments were converted on restore (bfloat16, 8-bit, m7v5: ``moment_dtype``)."""


def moment_formats(expected: dict[str, dict], found: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """The layout to read from a checkpoint whose Adam moments are in another format than this engine's
    (``EngineConfig.moment_dtype``): a bfloat16 moment where the engine holds a quantized one (``name.codes``
    and ``name.absmax``) is read as written, and the other way round, and so is a quantized one of another
    format (codes and scales of other shapes: 8 bits against m7v5's); ``rebuild_part`` converts them. Returns that
    layout (``expected`` where nothing differs) and the names converted."""
    read, converted = {}, []
    for part, e in expected.items():
        f = found.get(part, {})
        layout = dict(e)
        for name in [k for k in e if k.endswith(".codes")]:
            base = name[:-len(".codes")]
            if name not in f and base in f and base + ".absmax" not in f:  # bf16 written, quantized wanted
                del layout[name], layout[base + ".absmax"]
                layout[base] = f[base]
                converted.append(f"{part}/{base}")
            elif name in f and base + ".absmax" in f and (f[name], f[base + ".absmax"]) != (
                    e[name], e[base + ".absmax"]):  # another quantized format
                layout[name], layout[base + ".absmax"] = f[name], f[base + ".absmax"]
                converted.append(f"{part}/{base}")
        for base in [k for k in e if k.startswith("opt.") and k not in f and k + ".codes" in f]:
            del layout[base]  # 8-bit written, bf16 wanted
            layout.update({base + q: f[base + q] for q in QUANTIZED_PARTS if base + q in f})
            converted.append(f"{part}/{base}")
        read[part] = layout
    return read, converted


def check_layout(expected: dict[str, dict], found: dict[str, dict], where: str) -> None:
    """Raise ShapeMismatchError listing *every* difference: missing or extra parts and tensors, and each
    tensor whose shape or dtype differs, as ``path: expected ..., found ...``."""
    problems = []
    for part in expected.keys() | found.keys():
        if part not in found:
            problems.append(f"{part}: missing from the checkpoint")
            continue
        if part not in expected:
            problems.append(f"{part}: in the checkpoint but not in this model")
            continue
        e, f = expected[part], found[part]
        for leaf in sorted(e.keys() | f.keys()):
            if leaf not in f:
                problems.append(f"{part}/{leaf}: missing from the checkpoint (expected shape {e[leaf][0]})")
            elif leaf not in e:
                problems.append(f"{part}/{leaf}: in the checkpoint (shape {f[leaf][0]}) but not in this model")
            elif e[leaf] != f[leaf]:
                problems.append(f"{part}/{leaf}: expected shape {e[leaf][0]} {e[leaf][1]}, "
                                f"found shape {f[leaf][0]} {f[leaf][1]}")
    if problems:
        problems.sort()  # part names are zero-padded: blocks in order
        dtypes = {(expected[p][leaf][1], found[p][leaf][1]) for p in expected.keys() & found.keys()
                  for leaf in expected[p].keys() & found[p].keys() if expected[p][leaf][1] != found[p][leaf][1]}
        hint = ""
        masters = {mode.masters: mode for mode in reversed(MODES.values())}  # the first mode of each dtype
        clash = next(((masters[a], masters[b]) for a, b in sorted(dtypes) if a in masters and b in masters), None)
        if clash is not None and not clash[0].resumes(clash[1]):
            hint = (f"\n({clash[0].masters} against {clash[1].masters} state: the checkpoint was written with another "
                    f"engine.master_dtype ({clash[1].title}); resume with the one it was written with)")
        raise ShapeMismatchError(f"checkpoint {where} does not fit this model and optimizer "
                                 f"({len(problems)} mismatches):\n  " + "\n  ".join(problems) + hint
                                 + "\nNothing was loaded. To resume it, use the model, optimizer and engine settings "
                                   "it was saved with (its step's config/config.json holds them); to train this model "
                                   "afresh, give it a checkpoint folder of its own")


def rebuild_part(state: HostState, part: PartId, restored: dict[str, Any]) -> tuple[Any, Any]:
    """A restored part's ``(params, opt)``: the leaves are matched by name into the state's own trees, so
    the optimizer's structure comes from the engine, not from the files."""
    flat = flatten_nested(restored)
    current = state[part]

    def rebuild(tree: Any, prefix: str) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        names = [f"{prefix}.{k}" for k in named_leaves(tree)]
        assert len(names) == len(leaves)
        return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in names])

    quantized_formats(current.params, current.opt, flat, part.index)
    return rebuild(current.params, "params"), rebuild(current.opt, "opt")


def _format_of(codes: Any, absmax: Any, shape: tuple[int, ...], kind: str):
    """The quantized format whose codes and scales of moment ``kind`` for a leaf of ``shape`` have these shapes.
    No two formats share a moment's shapes (m7v5's codes are 7/8 and 5/8 of q8's)."""
    from megatrain_jax.engine.precision import CONVERT_REMOVED, REMOVED_MOMENT_DTYPES
    from megatrain_jax.engine.update.moment_formats import FORMATS
    for fmt in FORMATS.values():
        if fmt.leaf(shape) and (tuple(np.shape(codes)), tuple(np.shape(absmax))) == (
                tuple(fmt.codes_shape(shape, kind)), tuple(fmt.scale_shape(shape))):
            return fmt
    removed = " or ".join(REMOVED_MOMENT_DTYPES)
    raise ValueError(f"quantized moment codes of shape {np.shape(codes)} with scales of shape {np.shape(absmax)} "
                     f"match no moment format for a leaf of shape {shape}. If the checkpoint was saved with "
                     f"engine.moment_dtype {removed} (formats since removed), {CONVERT_REMOVED}")


def quantized_formats(params: Any, opt: Any, flat: dict[str, Any], salt: int) -> None:
    """Moments read in another format than ``opt`` holds (``moment_formats``), converted in ``flat``: a bfloat16
    moment quantized to the engine's format (stochastically rounded, from bits keyed by the part and the leaf,
    as the kernel would write it), a quantized one dequantized (and rounded to bfloat16, or quantized again
    in the engine's format where that is another)."""
    from megatrain_jax.engine.update.host_optimizer import rounding_seed

    leaves = named_leaves({"opt": opt})
    shapes = {name: np.shape(x) for name, x in named_leaves({"params": params}).items()}
    param_shape = lambda name: shapes["params." + name.split(".", 2)[2]]  # noqa: E731  opt.mu.<leaf> -> params.<leaf>

    def read_quantized(base: str, shape: tuple[int, ...]) -> np.ndarray:
        codes, absmax = flat.pop(base + ".codes"), flat.pop(base + ".absmax")
        kind = "m" if ".mu." in base else "v"
        return _format_of(codes, absmax, shape, kind).dequantize(codes, absmax, kind, shape)

    for leaf, name in enumerate(leaves):
        kind = "m" if ".mu." in name else "v"
        if name.endswith(".codes"):
            base = name[:-len(".codes")]
            shape = param_shape(base)
            if base in flat:  # bfloat16 written
                x = np.asarray(flat.pop(base), np.float32)
            elif (np.shape(flat[name]), np.shape(flat[base + ".absmax"])) != (
                    np.shape(leaves[name]), np.shape(leaves[base + ".absmax"])):  # another quantized format written
                x = read_quantized(base, shape)
            else:
                continue
            fmt = _format_of(leaves[name], leaves[base + ".absmax"], shape, kind)  # the engine's
            flat[name], flat[base + ".absmax"] = fmt.quantize(x.reshape(shape), kind, rounding_seed(0, salt, leaf))
        elif name not in flat and name + ".codes" in flat and not name.endswith(QUANTIZED_PARTS):
            flat[name] = read_quantized(name, param_shape(name)).astype(leaves[name].dtype)
