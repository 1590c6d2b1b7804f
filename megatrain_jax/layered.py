"""The layered-model contract, and its pure-function view that the engine drives.

A model follows the contract when it has:

- ``model.cfg`` with ``vocab_size`` (and optionally ``max_positions``, ``loss_chunk_tokens``);
- ``model.io``: a module with ``embed(tokens_BT) -> x_BTD``, ``final_hidden(x_BTD) -> h_BTD`` and
  ``unembed(h_TD) -> logits_TV`` (float32). It owns the embedding, final norm and output projection;
  a tied head simply reads the embedding inside ``unembed``;
- ``model.blocks``: an ``nnx.List`` of identical blocks, ``block(x_BTD, positions_BT, segment_ids_BT)``;
- only ``nnx.Param`` variables.

For initialization off the GPU (``fit`` given an abstract model from ``nnx.eval_shape``) the model also
provides ``new_io(key)`` and ``new_block(index, key)``, building one part with its own initializers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.loss import chunked_nll_sum

Params = Any  # an nnx.State of one part's parameters


class ContractError(TypeError):
    """The model does not follow the layered contract."""


@dataclasses.dataclass(frozen=True)
class LayeredModel:
    """Stateless templates: one graphdef for the io part, one shared by every block."""

    io_graphdef: Any
    block_graphdef: Any
    n_blocks: int
    vocab_size: int
    max_positions: int | None
    loss_chunk_tokens: int

    def embed(self, io_params: Params, tokens_BT: jax.Array) -> jax.Array:
        return nnx.merge(self.io_graphdef, io_params).embed(tokens_BT)

    def block(self, block_params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None) -> jax.Array:
        return nnx.merge(self.block_graphdef, block_params)(x_BTD, positions_BT, segment_ids_BT)

    def head_nll_sum(self, io_params: Params, x_BTD: jax.Array, targets_BT: jax.Array,
                     mask_BT: jax.Array) -> jax.Array:
        """Masked NLL summed over tokens, logits built ``loss_chunk_tokens`` at a time."""
        io = nnx.merge(self.io_graphdef, io_params)
        h_BTD = io.final_hidden(x_BTD)
        D = h_BTD.shape[-1]
        return chunked_nll_sum(io.unembed, h_BTD.reshape(-1, D), targets_BT.reshape(-1),
                               mask_BT.reshape(-1), self.loss_chunk_tokens)


def _check_only_params(module: nnx.Module, where: str) -> None:
    _, _, rest = nnx.split(module, nnx.Param, ...)
    leaves = jax.tree.leaves(rest)
    if leaves:
        raise ContractError(f"{where} holds non-parameter state ({len(leaves)} arrays, e.g. RNG or batch "
                            f"statistics); the engine streams parameters only. Keep such state out of "
                            f"the model or make it an nnx.Param")


def check_contract(model: Any) -> None:
    """Raise ContractError explaining what is missing."""
    need = "see megatrain_jax.layered for the contract"
    cfg = getattr(model, "cfg", None)
    if cfg is None or not isinstance(getattr(cfg, "vocab_size", None), int):
        raise ContractError(f"model.cfg.vocab_size (int) is required; {need}")
    io = getattr(model, "io", None)
    for method in ("embed", "final_hidden", "unembed"):
        if not callable(getattr(io, method, None)):
            raise ContractError(f"model.io.{method} is missing: the model needs an 'io' module with embed, "
                                f"final_hidden and unembed; {need}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nnx.List) or len(blocks) == 0:
        raise ContractError(f"model.blocks must be a non-empty nnx.List of identical blocks, got "
                            f"{type(blocks).__name__}; {need}")


def layered(model: nnx.Module, check_blocks: bool = True) -> LayeredModel:
    """The pure-function view of a (concrete or abstract) model."""
    check_contract(model)
    io_gd, _ = nnx.split(model.io, nnx.Param)
    block_gd, _ = nnx.split(model.blocks[0], nnx.Param)
    if check_blocks:
        _check_only_params(model.io, "model.io")
        for i, block in enumerate(model.blocks):
            gd, _ = nnx.split(block, nnx.Param)
            if gd != block_gd:
                raise ContractError(f"model.blocks[{i}] differs in structure from model.blocks[0]; all "
                                    f"blocks must be identical (one stateless template serves every layer)")
            _check_only_params(block, f"model.blocks[{i}]")
    cfg = model.cfg
    return LayeredModel(io_gd, block_gd, len(model.blocks), cfg.vocab_size,
                        getattr(cfg, "max_positions", None), getattr(cfg, "loss_chunk_tokens", 8192))


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
