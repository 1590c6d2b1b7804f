"""Host memory is the source of truth: the one state pytree that holds every persistent array.

Master parameters (float32), optimizer state and the optional compute-dtype stream copy live in pinned
host memory, one ``Part`` per part of the model (the io part, then one per block).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.layered import block_params, io_params, is_abstract, tree_bytes
from megatrain_jax.parts import IO, Params, Part, PartId, part_ids
from megatrain_jax.transfer import Placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HostState:
    parts: list[Part]  # in update order: io, then blocks
    step: int  # optimizer steps taken

    def __getitem__(self, part: PartId) -> Part:
        return self.parts[part.index]

    def __setitem__(self, part: PartId, value: Part) -> None:
        self.parts[part.index] = value

    def ids(self) -> list[PartId]:
        return part_ids(len(self.parts) - 1)

    def params(self) -> tuple[Params, list[Params]]:
        """The float32 masters as ``(io, [block 0, block 1, ...])``."""
        return self[IO].params, [p.params for p in self.parts[1:]]

    def nbytes(self) -> int:
        return tree_bytes(self)


def cast_tree(tree: Params, dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def master_params(model: nnx.Module, placement: Placement, key: jax.Array | None) -> list[Params]:
    """Float32 master parameters in host memory, one part at a time in update order (the whole model is
    never on the device). A concrete model is copied; an abstract one (``nnx.eval_shape``) is initialized
    part by part with its own initializers, each part built on the device and written to host memory."""
    if not is_abstract(model):
        to_host = lambda t: placement.copy_to_host(cast_tree(t, jnp.float32))
        return [to_host(io_params(model))] + [to_host(p) for p in block_params(model)]
    if key is None:
        raise ValueError("an abstract model needs an RNG seed to be initialized")
    for method in ("new_io", "new_block"):
        if not callable(getattr(model, method, None)):
            raise TypeError(f"an abstract model must provide {method}(...) to be initialized part by part; "
                            f"pass a concrete model instead, or see docs/model_contract.md")
    make_io = jax.jit(lambda k: nnx.state(model.new_io(k), nnx.Param), out_shardings=placement.host)
    make_block = jax.jit(lambda k, i: nnx.state(model.new_block(i, k), nnx.Param), out_shardings=placement.host)
    return [make_io(key)] + [make_block(key, jnp.int32(i)) for i in range(len(model.blocks))]


def new_state(masters: list[Params], init: Callable[[Params], Part]) -> HostState:
    """The state at step 0: ``init`` makes each part's record from its masters."""
    return HostState([init(p) for p in masters], step=0)
