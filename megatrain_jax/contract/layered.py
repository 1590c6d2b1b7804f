"""The layered-model contract, and its pure-function view that the engine drives.

A model follows the contract when it has:

- ``model.cfg`` with ``vocab_size`` (and optionally ``max_positions``, ``segments_per_row(seq_len)``,
  ``loss_chunk_tokens``, ``dtype``);
- ``model.io``: a module with ``embed(tokens_BT, positions_BT, segment_ids_BT) -> x_BTD`` (segment ids
  may be None), ``final_hidden(x_BTD) -> h_BTD`` and ``unembed(h_TD) -> logits_TV`` (float32). It owns
  the embedding, final norm and output projection; a tied head simply reads the embedding inside
  ``unembed``;
- ``model.blocks``: an ``nnx.List`` of blocks, ``block(x_BTD, positions_BT, segment_ids_BT)``, of one kind or
  a few: a block may declare ``block.kind`` (a plain hashable value, default None), and blocks of one kind
  must be identical (one stateless template per kind);
- only ``nnx.Param`` variables;
- no active dropout: an ``nnx.Dropout`` must have rate 0 or ``deterministic=True`` and hold no RNG stream
  (the engine calls each part as a pure function of its parameters, with no random key);
- optionally an auxiliary loss (a mixture of experts' load balancing): ``model.aux_loss``, a hashable
  callable of the routed blocks' summed statistics. A block is routed when it has ``block.routed(x_BTD,
  positions_BT, segment_ids_BT) -> (x_BTD, stats)`` (``routes``), with ``stats`` a pytree of sums over
  tokens; blocks of other kinds (dense layers before the MoE ones) have none. The training loss is the
  cross-entropy plus ``aux_loss(sum of every routed block's stats over the batch)``.

For initialization off the GPU (``fit`` given an abstract model from ``nnx.eval_shape``) the model also
provides ``new_io(key)`` and ``new_block(index, key)``, building one part with its own initializers.
docs/model_contract.md describes it in full; ``megatrain_jax.check.check_model`` tests a model against it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.loss import chunked_nll_sum, chunked_token_nll

Params = Any  # an nnx.State of one part's parameters (io or one block)

class ContractError(TypeError):
    """The model does not follow the layered contract."""


@dataclasses.dataclass(frozen=True)
class LayeredModel:
    """Stateless templates: one graphdef for the io part, and one per kind of block shared by every block
    of that kind. ``block_kinds[i]`` is block i's kind: an index into ``block_graphdefs`` (kinds numbered in
    the order they first appear, so block 0 is of kind 0; a model with one kind has only kind 0)."""

    io_graphdef: Any
    block_graphdefs: tuple[Any, ...]
    block_kinds: tuple[int, ...]
    vocab_size: int
    max_positions: int | None
    loss_chunk_tokens: int
    aux_loss: Any = None  # the model's auxiliary loss of the blocks' summed statistics, or None
    routed_kinds: frozenset[int] = frozenset()  # with aux_loss: the kinds whose blocks feed it (``routes``)
    segments_per_row: Any = None  # seq_len -> the most packed documents a row may hold, or None (no bound)

    @property
    def n_blocks(self) -> int:
        return len(self.block_kinds)

    @property
    def n_kinds(self) -> int:
        return len(self.block_graphdefs)

    def first_of_kind(self, kind: int) -> int:
        """The first block of ``kind``: the one whose module stands for the kind (its template)."""
        return self.block_kinds.index(kind)

    def routes(self, kind: int) -> bool:
        """Whether blocks of ``kind`` return statistics for ``aux_loss`` (``block_routed``)."""
        return kind in self.routed_kinds

    def embed(self, io_params: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None) -> jax.Array:
        return nnx.merge(self.io_graphdef, io_params).embed(tokens_BT, positions_BT, segment_ids_BT)

    def block(self, block_params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None, kind: int = 0) -> jax.Array:
        """A block of ``kind`` with these parameters."""
        return nnx.merge(self.block_graphdefs[kind], block_params)(x_BTD, positions_BT, segment_ids_BT)

    def block_routed(self, block_params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                     segment_ids_BT: jax.Array | None, kind: int = 0) -> tuple[jax.Array, Any]:
        """The block's output and the statistics its ``aux_loss`` share is computed from."""
        return nnx.merge(self.block_graphdefs[kind], block_params).routed(x_BTD, positions_BT, segment_ids_BT)

    def head_nll_sum(self, io_params: Params, x_BTD: jax.Array, targets_BT: jax.Array,
                     mask_BT: jax.Array) -> jax.Array:
        """Masked NLL summed over tokens, logits built ``loss_chunk_tokens`` at a time."""
        io = nnx.merge(self.io_graphdef, io_params)
        h_BTD = io.final_hidden(x_BTD)
        D = h_BTD.shape[-1]
        return chunked_nll_sum(io.unembed, h_BTD.reshape(-1, D), targets_BT.reshape(-1),
                               mask_BT.reshape(-1), self.loss_chunk_tokens)

    def head_row_nll(self, io_params: Params, x_BTD: jax.Array, targets_BT: jax.Array,
                     mask_BT: jax.Array) -> jax.Array:
        """Each row's masked NLL summed over its tokens (float32 [B]), logits built ``loss_chunk_tokens`` at a
        time: minus the row's log-probability of its masked targets (preference training's input)."""
        io = nnx.merge(self.io_graphdef, io_params)
        h_BTD = io.final_hidden(x_BTD)
        B, T, D = h_BTD.shape
        nll = chunked_token_nll(io.unembed, h_BTD.reshape(-1, D), targets_BT.reshape(-1), self.loss_chunk_tokens)
        return jnp.sum(nll.reshape(B, T) * mask_BT.astype(jnp.float32), axis=-1)


_NEED = "see docs/model_contract.md (or megatrain_jax.contract.layered) for the contract"


def path_name(where: str, path: tuple) -> str:
    """``('blocks', 2, 'attn', 'q')`` under ``model`` -> ``model.blocks[2].attn.q``."""
    out = where
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _check_only_params(module: nnx.Module, where: str) -> None:
    """Our message (naming the first offending variable) before Flax's 'Non-exhaustive filters'."""
    _, _, rest = nnx.split(module, nnx.Param, ...)
    flat = list(nnx.to_flat_state(rest))
    if flat:
        path, var = flat[0]
        more = f" (and {len(flat) - 1} more)" if len(flat) > 1 else ""
        raise ContractError(f"{path_name(where, path)} is an nnx.{type(var).__name__}, not an nnx.Param{more}: "
                            f"the model may hold only nnx.Param variables (the engine streams and updates "
                            f"parameters only). Keep RNG state, batch statistics and other variables out of "
                            f"the model (pass rngs to __init__ without storing them), or make them nnx.Param; "
                            f"{_NEED}")


def _names(paths: list[tuple]) -> str:
    shown = ", ".join(path_name("model", p) for p in paths[:3])
    return shown + (f" (and {len(paths) - 3} more)" if len(paths) > 3 else "")


def _check_no_dropout(model: nnx.Module) -> None:
    """Refuse ``nnx.Dropout`` that would drop anything, or that stores an RNG stream: the engine runs every
    part as a pure function of its parameters, with no per-step random key and no train/eval switch."""
    active, with_rngs = [], []
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Dropout):
            continue
        if module.rate > 0 and module.deterministic is not True:
            active.append(tuple(path))
        elif getattr(module, "rngs", None) is not None:
            with_rngs.append(tuple(path))
    if active:
        raise ContractError(
            f"dropout is not supported: nnx.Dropout with rate > 0 that may drop (deterministic is not True) "
            f"at {_names(active)}. The engine and the reference trainer give a model no per-step random key "
            f"and no train/eval switch. Set the rate to 0 (nnx.Dropout(0.0)) or make it deterministic "
            f"(nnx.Dropout(rate, deterministic=True)), and create it without rngs; {_NEED}")
    if with_rngs:
        raise ContractError(
            f"nnx.Dropout at {_names(with_rngs)} stores an RNG stream (it was created with rngs=...), but the "
            f"model may hold only nnx.Param variables. Create it without rngs, e.g. nnx.Dropout(0.0): it never "
            f"drops, so it needs no key; {_NEED}")


def _takes_positional(fn: Any, n: int) -> bool | None:
    """Whether ``fn`` can be called with ``n`` positional arguments (None: signature unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*([None] * n))
    except TypeError:
        return False
    return True


def check_contract(model: Any) -> None:
    """Raise ContractError explaining what is missing or wrong (structure only; ``layered`` also checks
    that the blocks are identical)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not isinstance(getattr(cfg, "vocab_size", None), int):
        raise ContractError(f"model.cfg.vocab_size (int) is required; {_NEED}")
    io = getattr(model, "io", None)
    for method in ("embed", "final_hidden", "unembed"):
        if not callable(getattr(io, method, None)):
            raise ContractError(f"model.io.{method} is missing: the model needs an 'io' module with embed, "
                                f"final_hidden and unembed; {_NEED}")
    if _takes_positional(io.embed, 3) is False:
        raise ContractError(f"model.io.embed{inspect.signature(io.embed)} cannot be called as "
                            f"embed(tokens_BT, positions_BT, segment_ids_BT): add `positions_BT, "
                            f"segment_ids_BT` parameters (segment_ids_BT may be None; a model with no "
                            f"position embedding simply ignores them); {_NEED}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nnx.List) or len(blocks) == 0:
        raise ContractError(f"model.blocks must be a non-empty nnx.List of blocks, got "
                            f"{type(blocks).__name__}; {_NEED}")
    if not callable(blocks[0]) or _takes_positional(blocks[0], 3) is False:
        raise ContractError(f"model.blocks[0] must be callable as block(x_BTD, positions_BT, segment_ids_BT) "
                            f"(segment_ids_BT may be None); {_NEED}")
    if not isinstance(model, nnx.Module):
        raise ContractError(f"the model must be a flax.nnx.Module, got {type(model).__name__}; {_NEED}")
    _check_no_dropout(model)  # before _check_only_params: a Dropout's RNG stream gets its own message
    _check_only_params(model, "model")
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[0] not in ("io", "blocks"):
            raise ContractError(f"{path_name('model', path)} is a parameter outside model.io and model.blocks: "
                                f"the engine streams and trains only those parts (the reference would train it, "
                                f"the engine would not). Move it into model.io, or into every block; {_NEED}")


def _static_attrs(module: nnx.Module) -> dict[tuple, Any]:
    """Plain (non-variable, non-module) attributes of a module and its submodules, by path."""
    out = {}
    for path, value in nnx.iter_graph(module):
        if any(isinstance(p, str) and p.startswith("_pytree__") for p in path):
            continue
        if isinstance(value, (nnx.Variable, nnx.Module)) or hasattr(value, "shape") or not path:
            continue
        if len(path) > 1 and tuple(path[:-1]) in out:  # an element of a tuple/list already compared whole
            continue
        out[tuple(path)] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (values that cannot be compared are taken as different)
        return False


def _param_shapes(module: nnx.Module) -> dict[tuple, tuple]:
    return {tuple(path): (tuple(v.shape), jnp.dtype(v.dtype))
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _describe_difference(block: nnx.Module, first: nnx.Module, index: int = 0) -> str:
    """What makes ``block`` differ from ``first`` (``model.blocks[index]``): a parameter path, a
    shape/dtype, or a plain attribute."""
    name = lambda path: path_name("", path).lstrip(".")
    a, b = _param_shapes(block), _param_shapes(first)
    for path in a:
        if path not in b:
            return f"it has parameter {name(path)}, which model.blocks[{index}] lacks"
    for path in b:
        if path not in a:
            return f"it lacks parameter {name(path)}"
    for path, (shape, dtype) in a.items():
        shape0, dtype0 = b[path]
        if shape != shape0:
            return f"{name(path)} has shape {shape} vs {shape0}"
        if dtype != dtype0:
            return f"{name(path)} has dtype {dtype} vs {dtype0}"
    sa, sb = _static_attrs(block), _static_attrs(first)
    for path in list(sa) + [p for p in sb if p not in sa]:
        if path not in sb:
            return f"it has attribute {name(path)} = {_short(sa[path])}, which model.blocks[{index}] lacks"
        if path not in sa:
            return f"it lacks attribute {name(path)} (= {_short(sb[path])} in model.blocks[{index}])"
        if not _same(sa[path], sb[path]):
            sub, va, vb = _first_field_difference(sa[path], sb[path])
            return f"{name(path + sub)} = {_short(va)} vs {_short(vb)}"
    return "their module structure differs"


def _first_field_difference(a: Any, b: Any) -> tuple[tuple, Any, Any]:
    """Descend into dataclasses (configs) of one type to the first differing field."""
    if type(a) is type(b) and dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            fa, fb = getattr(a, f.name), getattr(b, f.name)
            if not _same(fa, fb):
                sub, va, vb = _first_field_difference(fa, fb)
                return (f.name,) + sub, va, vb
    return (), a, b


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _template(module: nnx.Module):
    gd, params = nnx.split(module, nnx.Param)
    return gd, [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(params)]


def block_kinds(model: nnx.Module) -> tuple[int, ...]:
    """Each block's kind, numbered in the order the kinds (``block.kind``, None where a block declares
    none) first appear."""
    seen: dict[Any, int] = {}
    out = []
    for i, block in enumerate(model.blocks):
        kind = getattr(block, "kind", None)
        try:
            out.append(seen.setdefault(kind, len(seen)))
        except TypeError:
            raise ContractError(f"model.blocks[{i}].kind = {_short(kind)} is not hashable: a block's kind is a plain "
                                f"value (a string, an int, a tuple) that blocks of one kind share; {_NEED}") from None
    return tuple(out)


def routes(block: nnx.Module) -> bool:
    """Whether a block feeds the model's ``aux_loss``: it has ``routed(x, positions, segment_ids) -> (x,
    stats)``. The one test of it (``LayeredModel.routed_kinds``, the reference's loss)."""
    return callable(getattr(block, "routed", None))


def _kind_name(block: nnx.Module) -> str:
    kind = getattr(block, "kind", None)
    return "" if kind is None else f" of kind {_short(kind)}"


def layered(model: nnx.Module, check_blocks: bool = True) -> LayeredModel:
    """The pure-function view of a (concrete or abstract) model. Raises ContractError (ours, before any
    Flax error) when the model does not follow the contract or, with ``check_blocks``, when a block
    differs from the first block of its kind."""
    check_contract(model)
    io_gd, _ = nnx.split(model.io, nnx.Param)
    kinds = block_kinds(model)
    firsts = [kinds.index(k) for k in range(max(kinds) + 1)]
    templates = [_template(model.blocks[i]) for i in firsts]
    if check_blocks:
        for i, block in enumerate(model.blocks):
            first = firsts[kinds[i]]
            if i != first and _template(block) != templates[kinds[i]]:
                raise ContractError(
                    f"model.blocks[{i}] differs from model.blocks[{first}]{_kind_name(block) if len(firsts) > 1 else ''}: "
                    f"{_describe_difference(block, model.blocks[first], first)}. Blocks of one kind must be "
                    f"identical in structure, parameter shapes and attributes (one stateless template serves "
                    f"every block of a kind); blocks that should differ declare different kinds (block.kind); "
                    f"{_NEED}")
    cfg = model.cfg
    aux = getattr(model, "aux_loss", None)
    routed = frozenset(k for k, i in enumerate(firsts) if aux is not None and routes(model.blocks[i]))
    if aux is not None and not routed:
        raise ContractError(f"the model has an aux_loss, but no block has routed(x, positions, segment_ids) -> "
                            f"(x, stats) to feed it; {_NEED}")
    return LayeredModel(io_gd, tuple(gd for gd, _ in templates), kinds, cfg.vocab_size,
                        getattr(cfg, "max_positions", None), getattr(cfg, "loss_chunk_tokens", 8192), aux,
                        routed, getattr(cfg, "segments_per_row", None))


def io_params(model: nnx.Module) -> Params:
    return nnx.state(model.io, nnx.Param)


def block_params(model: nnx.Module) -> list[Params]:
    return [nnx.state(block, nnx.Param) for block in model.blocks]


def write_back(model: nnx.Module, io: Params, blocks: list[Params], to_device) -> None:
    """Copy parameters into the user's model, each part moved by ``to_device``."""
    nnx.update(model.io, to_device(io))
    for block, params in zip(model.blocks, blocks):
        nnx.update(block, to_device(params))


def is_abstract(model: nnx.Module) -> bool:
    """True for a model from ``nnx.eval_shape`` (shapes only, no arrays)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)


def tree_bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
