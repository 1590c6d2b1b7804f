"""Host memory is the source of truth: the one state pytree that holds every persistent array.

Master parameters (float32) and optimizer state live in pinned host memory, part by part: the io part
(embedding, final norm, head) and one entry per block. ``stream_*`` are optional compute-dtype copies
(e.g. bfloat16) kept in step with the masters by the optimizer, halving the bytes sent to the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.layered import Params, block_params, io_params, is_abstract, tree_bytes
from megatrain_jax.transfer import Placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HostState:
    io: Params
    blocks: list[Params]
    io_opt: Any
    blocks_opt: list[Any]
    stream_io: Params | None
    stream_blocks: list[Params] | None
    step: int  # optimizer steps taken

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def nbytes(self) -> int:
        return tree_bytes(self)

    def params_for_stream(self, layer: int | None) -> Params:
        """What gets sent to the device for a part: the compute-dtype copy if kept, else the master."""
        if layer is None:
            return self.io if self.stream_io is None else self.stream_io
        return self.blocks[layer] if self.stream_blocks is None else self.stream_blocks[layer]


def cast_tree(tree: Params, dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def master_params(model: nnx.Module, placement: Placement, key: jax.Array | None) -> tuple[Params, list[Params]]:
    """Float32 master parameters in host memory, one part at a time (the whole model is never on the
    device). A concrete model is copied; an abstract one (``nnx.eval_shape``) is initialized part by
    part with its own initializers, each part built on the device and written to host memory."""
    if not is_abstract(model):
        to_host = lambda t: placement.copy_to_host(cast_tree(t, jnp.float32))
        return to_host(io_params(model)), [to_host(p) for p in block_params(model)]
    if key is None:
        raise ValueError("an abstract model needs an RNG seed to be initialized")
    for method in ("new_io", "new_block"):
        if not callable(getattr(model, method, None)):
            raise TypeError(f"an abstract model must provide {method}(...) to be initialized part by part; "
                            f"pass a concrete model instead, or see megatrain_jax.layered")
    make_io = jax.jit(lambda k: nnx.state(model.new_io(k), nnx.Param), out_shardings=placement.host)
    make_block = jax.jit(lambda k, i: nnx.state(model.new_block(i, k), nnx.Param), out_shardings=placement.host)
    io = make_io(key)
    blocks = [make_block(key, jnp.int32(i)) for i in range(len(model.blocks))]
    return io, blocks
