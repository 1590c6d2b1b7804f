"""Host memory is the source of truth: the one state pytree that holds every persistent array.

Master parameters (float32), optimizer state and the optional compute-dtype stream copy live in host
memory, one ``Part`` per part of the model (the io part, then one per block): pinned where they cross
PCIe, pageable where only the host optimizer touches them (``HostOptimizer.home``).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.contract.layered import Params, block_kinds, block_params, io_params, is_abstract, tree_bytes
from megatrain_jax.engine.parts import IO, Part, PartId, part_ids
from megatrain_jax.engine.transfer import Placement


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


def initial_state(model: nnx.Module, placement: Placement, key: jax.Array | None,
                  fresh: Callable[[Params], Part], home: Callable[[Part], Part],
                  workers: int | None = None, init_from=None) -> HostState:
    """The state at step 0, built in host memory one part at a time (the whole model is never on the
    device). ``fresh`` makes a part's record from its float32 masters (optimizer state and stream copy;
    ``HostOptimizer.fresh``), and ``home`` moves each of its arrays where it lives (``HostOptimizer.home``:
    what only the host optimizer touches goes to pageable memory).

    Each part is one jitted program whose outputs (masters, optimizer state, stream copy) land in pinned
    host memory, each leaf spread over the devices as ``Placement.spec`` says: no second trip through the
    device for the cast. There is one program for the io part and one shared by every block of a kind
    (``contract.layered.block_kinds``), so the number of compilations does not depend on the number of
    blocks; except that an abstract model of several kinds builds each block by its own program: its
    ``new_block`` is given a Python int index, from which it may derive the block's kind.
    Parts are built by ``workers`` threads (default 4 on a GPU), so that one part's host copies overlap
    another's device work; returns once every part is in host memory. On the CPU backend the default is 1:
    there the programs run on the host, and parts side by side would multiply their temporaries.

    On a GPU the time goes to pinning: XLA's pinned pool grows (by doubling regions, under one lock) at
    about 1.7 GiB/s on the H100 machines. Pageable memory costs nothing to create, so the less of the state
    is pinned, the faster this is (experiments/studies/NOTES.md, issue 13).

    A concrete model's parameters are copied (as float32). An abstract one (``nnx.eval_shape``) is
    initialized part by part with its own initializers (``new_io``/``new_block``), from ``key``, or read
    part by part from ``init_from`` (e.g. ``megatrain_jax.hf.HFParts``): an object whose ``io()`` and
    ``block(i)`` return a part's arrays as stored, and whose ``to_params(tree)`` (traceable) turns them into
    that part's pure dict of parameters inside the builder's program; its ``release()``, where it has one, is
    called once every part is built. Each worker reads its part when it builds it."""
    kinds = block_kinds(model)
    if init_from is not None:
        def from_stored(template: nnx.Module):
            def make(tree: Any) -> Any:
                state = nnx.state(template, nnx.Param)
                nnx.replace_by_pure_dict(state, init_from.to_params(tree))
                return fresh(cast_tree(state, jnp.float32))
            return placement.jit_into(make)

        # the blocks of one kind have the same structure: one program for all of them, as below
        makes = [from_stored(model.blocks[kinds.index(k)]) for k in range(max(kinds) + 1)]
        make_io, make_block = from_stored(model.io), lambda kind, *args: makes[kind](*args)
        io_args = _Lazy(lambda: (init_from.io(),))
        block_args = [_Lazy(lambda i=i: (init_from.block(i),)) for i in range(len(model.blocks))]
    elif is_abstract(model):
        if key is None:
            raise ValueError("an abstract model needs an RNG seed to be initialized")
        for method in ("new_io", "new_block"):
            if not callable(getattr(model, method, None)):
                raise TypeError(f"an abstract model must provide {method}(...) to be initialized part by part; "
                                f"pass a concrete model instead, or see docs/model_contract.md")
        make_io = placement.jit_into(lambda k: fresh(nnx.state(model.new_io(k), nnx.Param)))
        if max(kinds) == 0:  # one kind: one program, the index traced
            new_block = placement.jit_into(lambda k, i: fresh(nnx.state(model.new_block(i, k), nnx.Param)))
            make_block = lambda kind, *args: new_block(*args)
            block_args = [(key, np.int32(i)) for i in range(len(model.blocks))]
        else:  # a program per block: new_block's structure may depend on its (Python int) index
            make_block = lambda kind, k, i: placement.jit_into(
                lambda k: fresh(nnx.state(model.new_block(i, k), nnx.Param)))(k)
            block_args = [(key, i) for i in range(len(model.blocks))]
        io_args = (key,)
    else:
        make_io = placement.jit_into(lambda p: fresh(cast_tree(p, jnp.float32)))
        make_block = lambda kind, *args: make_io(*args)  # retraced (once) per structure: once per kind
        # Over several devices the model's arrays (on one device) enter the program as host values.
        local = (lambda p: p) if placement.size == 1 else jax.device_get
        io_args = (local(io_params(model)),)
        block_args = [(local(p),) for p in block_params(model)]
    if workers is None:
        workers = 4 if placement.on_gpu else 1
    # Each worker waits for its part to be in host memory before taking the next: at most ``workers`` parts
    # hold device temporaries at once (a 7B block's program ≈ 4 GB), whatever the number of blocks.
    build_io = lambda: home(jax.block_until_ready(make_io(*_resolved(io_args))))
    build_block = lambda i: home(jax.block_until_ready(make_block(kinds[i], *_resolved(block_args[i]))))
    firsts = [kinds.index(k) for k in range(max(kinds) + 1)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        # The first call of each program compiles it; the io part and the first block of each kind
        # compile side by side, and the other blocks start once those programs exist (no thread compiles a
        # program twice).
        io = pool.submit(build_io)
        first = {i: pool.submit(build_block, i) for i in firsts}
        first = {i: f.result() for i, f in first.items()}
        rest = [i for i in range(len(kinds)) if i not in first]
        blocks = dict(zip(rest, pool.map(build_block, rest))) | first
        state = HostState([io.result()] + [blocks[i] for i in range(len(kinds))], step=0)
    if callable(getattr(init_from, "release", None)):
        init_from.release()  # every part is read: e.g. a checkpoint's files unmapped
    return state


class _Lazy:
    """Arguments read only when a worker builds the part (one part's weights in memory per worker)."""

    def __init__(self, read: Callable[[], tuple]):
        self.read = read


def _resolved(args: Any) -> tuple:
    return args.read() if isinstance(args, _Lazy) else args
