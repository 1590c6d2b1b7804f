"""What moves when: the per-step operation list, as plain data (testable without a GPU).

The engine walks this list and maps each op to a transfer or a jitted call (``megatrain_jax.engine.passes``
holds the table from op kind to handler). One training step is:

1. fetch the io part; embed every micro-batch;
2. forward, layer-major: block i is fetched ``depth`` blocks ahead, every micro-batch passes through it,
   then it is released (the last ``depth`` blocks stay for the backward pass); with activation offload,
   the inputs of the first ``offload`` blocks then go to pinned host memory (``store_acts``);
3. the head (final norm, chunked logits, loss) per micro-batch, giving d(loss)/d(last hidden);
4. backward, blocks in reverse, prefetched ``depth`` ahead (an offloaded block's inputs come back with its
   parameters, ``load_acts``): recompute + VJP per micro-batch, gradients accumulated on the device, then
   sent to host memory;
5. the embedding's backward; the io gradients go to host;
6. (last sub-step of an optimizer step only) the global gradient norm, then the parts' updates in forward
   order (io, block 0, block 1, ...), so the next step's forward can begin early;
7. ``commit``: the second halves of split updates (see ``megatrain_jax.engine.update.policy``).

Blocks updated on the GPU (``EngineConfig.gpu_updated_layers``; ``step_ops``' ``visited``) have their update of
the step before pending (their gradient waited on the GPU; their ``update`` op only recorded it): right after
the io part's fetch, ``bring`` queues the copy of each one's masters and moments to the GPU (the copy engine is
idle there, and the forward's first blocks need no transfer when resident); the forward fetches each by
``visit``, which runs its update on the GPU, sends masters, moments and compute copy home, and hands the forward
the new weights. Where no update is pending (the first step, or after ``Engine.sync`` ran it) a bring does
nothing and a visit is a fetch.

The io part updated on the GPU (``EngineConfig.gpu_updated_io``; ``step_ops``' ``visit_io`` and ``bring_io``) is
the same, except that its visit is the forward's first op: its state is brought during the backward of the step
that updates it (``bring_io``: beside block 0's fetch for that backward, or before the backward's first block
where fewer blocks are fetched), and the next forward starts with ``visit(io)``.

With ``EngineConfig.norm_first`` a step is two passes over its batch: ``norm_ops`` (the same forward and
backward, each part's gradient reduced to its squared norm on the device (``norm``) instead of sent home,
then the global norm), and ``second_pass_ops``: no forward (the first pass's block inputs, kept residuals and
products stay for it, on the device or, for the offloaded blocks, in host memory), the head again from the last
block's output, then the backward again, where each part's ``update`` follows its ``send_grads`` at once and no
norm is taken. The weights cross PCIe three times a step (the forward, two backwards) instead of four.

Evaluation walks ``eval_ops``: the same forward, then the loss of each micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, Sequence

from megatrain_jax.engine.parts import IO, HostRoles, PartId

if TYPE_CHECKING:
    from megatrain_jax.engine.config import EngineConfig

# Offloaded activations: the blocks whose copies to host memory may be queued at once; the host waits for
# older ones (``passes.PassRunner.store_acts``), so the GPU never holds more blocks' inputs waiting to leave.
STORES_AHEAD = 2

# The blocks (a block: one part in one pass's forward or backward) whose compute may be queued on the GPU
# when the host issues a newer block's: the host waits for older ones (``passes.PassRunner.pace``). Without
# the bound the host runs as far ahead as XLA admits, furthest where no transfer slows it (through the
# GPU-resident blocks), and buffers it dropped stay allocated until the GPU has run the work queued on them.
# The memory plan counts what the host dropped for this many blocks as still allocated.
BLOCKS_AHEAD = 3

# With ``norm_first``, the host-updated parts whose gradients may be in host memory beyond the one just sent:
# the host waits for the update of the part sent this many before (``passes.PassRunner.update``), so host
# memory holds at most UPDATES_AHEAD + 1 parts' gradients (the memory plan counts that many, the largest).
UPDATES_AHEAD = 2

OpKind = Literal["fetch", "release", "embed", "forward", "head", "backward", "send_grads", "embed_backward",
                 "grad_norm", "update", "commit", "loss", "store_acts", "load_acts", "norm", "bring", "visit"]


@dataclasses.dataclass(frozen=True)
class Op:
    kind: OpKind
    part: PartId | None = None  # fetch, release, forward, backward, send_grads, update, store/load_acts
    micro: int = -1  # embed, forward, head, backward, embed_backward, loss

    def __repr__(self) -> str:
        args = ([str(self.part)] if self.part is not None else []) + ([str(self.micro)] if self.micro >= 0 else [])
        return f"{self.kind}({', '.join(args)})"


def _check(n_layers: int, n_micro: int, depth: int) -> None:
    if n_layers < 1 or n_micro < 1:
        raise ValueError(f"need at least one layer and one micro-batch, got {n_layers}, {n_micro}")
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")


def _forward(n_layers: int, n_micro: int, depth: int, keep: int, offload: int = 0,
             visited: frozenset[int] = frozenset(), visit_io: bool = False) -> tuple[list[Op], set[int]]:
    """Fetch io (``visit_io``: visit it), embed, then every block layer-major; the last ``keep`` blocks stay
    fetched, and the inputs of the first ``offload`` released blocks go to host memory. The ``visited`` blocks'
    state is brought after the io part's fetch, and they are fetched by ``visit``. Returns the ops and the blocks
    still on the device."""
    ops: list[Op] = [Op("visit" if visit_io else "fetch", IO)] + [Op("bring", PartId.block(i)) for i in sorted(visited)]
    ops += [Op("embed", micro=m) for m in range(n_micro)]
    resident: set[int] = set()

    def fetch(i: int) -> None:
        if 0 <= i < n_layers and i not in resident:
            resident.add(i)
            ops.append(Op("visit" if i in visited else "fetch", PartId.block(i)))

    for i in range(depth):
        fetch(i)
    for i in range(n_layers):
        # Dispatch block i's compute before asking for block i + depth: fetching may wait on the host
        # optimizer, and the GPU should be busy with block i meanwhile.
        ops.extend(Op("forward", PartId.block(i), m) for m in range(n_micro))
        fetch(i + depth)
        if i < n_layers - keep:
            resident.discard(i)
            ops.append(Op("release", PartId.block(i)))
            if i < offload:
                ops.append(Op("store_acts", PartId.block(i)))
    return ops, resident


def step_ops(n_layers: int, n_micro: int, depth: int = 1, update: bool = True, offload: int = 0,
             visited: Sequence[int] = (), visit_io: bool = False, bring_io: bool = False) -> list[Op]:
    """The ops of one forward+backward pass (plus the optimizer update when ``update``). ``offload``: the
    inputs of the first this many blocks wait in host memory between their forward and backward (the last
    ``depth`` blocks' never leave: their backward follows at once). ``visited``: the blocks updated on the GPU
    (``gpu_updated_layers``), whose forward fetch is a ``visit``; ``visit_io``: the io part's too
    (``gpu_updated_io``), and ``bring_io`` (a pass that updates): its state is brought during the backward, with
    block 0's fetch (or before the backward's first block, where block 0 stayed from the forward)."""
    _check(n_layers, n_micro, depth)
    if offload < 0:
        raise ValueError(f"activation offload must be >= 0 blocks, got {offload}")
    if bring_io and not update:
        raise ValueError("bring_io brings the io part's state for the update of this pass: it needs update")
    offload = offloaded_blocks(n_layers, depth, offload)
    ops, resident = _forward(n_layers, n_micro, depth, keep=depth, offload=offload, visited=frozenset(visited),
                             visit_io=visit_io)
    ops += [Op("head", micro=m) for m in range(n_micro)]
    if bring_io and 0 in resident:  # block 0 stays from the forward: no fetch of it to go with
        ops.append(Op("bring", IO))
    return ops + _backward(n_layers, n_micro, depth, offload, resident, bring_io=bring_io, update=update)


def _backward(n_layers: int, n_micro: int, depth: int, offload: int, resident: set[int], bring_io: bool = False,
              update: bool = True, norm_first: bool = False) -> list[Op]:
    """The backward from the last block down, each block fetched ``depth`` ahead unless ``resident`` (on the
    device already; the set is used up), then the embedding's; then the global norm and the updates in forward
    order (``update``), or, with ``norm_first``, each part's update right after its gradient's ``send_grads``."""
    ops: list[Op] = []
    for i in reversed(range(n_layers)):
        for j in range(i, i - depth - 1, -1):  # keep `depth` blocks in flight ahead of the compute
            if 0 <= j and j not in resident:
                resident.add(j)
                ops.append(Op("fetch", PartId.block(j)))
                if j < offload:
                    ops.append(Op("load_acts", PartId.block(j)))
                if j == 0 and bring_io:
                    ops.append(Op("bring", IO))
        ops += [Op("backward", PartId.block(i), m) for m in range(n_micro)]
        ops += [Op("send_grads", PartId.block(i)), Op("release", PartId.block(i))]
        if norm_first:
            ops.append(Op("update", PartId.block(i)))
        resident.discard(i)
    ops += [Op("embed_backward", micro=m) for m in range(n_micro)]
    ops += [Op("send_grads", IO), Op("release", IO)]
    if norm_first:
        ops.append(Op("update", IO))
    elif update:
        ops.append(Op("grad_norm"))
        ops += [Op("update", PartId(i)) for i in range(n_layers + 1)]
        ops.append(Op("commit"))
    return ops


def visits(roles: HostRoles, first: bool, last: bool) -> dict:
    """``step_ops``' arguments for the parts updated on the GPU (``roles.gpu_updated``) in one pass of an optimizer
    step: the ``first`` pass visits them (their updates of the step before run there), and the ``last`` (the one
    that updates) brings the io part's state for its next visit."""
    io = roles.io_visited
    return dict(visited=roles.visited_layers if first else (), visit_io=io and first, bring_io=io and last)


def norm_ops(n_layers: int, n_micro: int, depth: int = 1, offload: int = 0) -> list[Op]:
    """The first pass of a ``norm_first`` step: ``step_ops``' forward and backward, each part's gradient
    reduced to its squared norm where it would be sent home, then the global norm."""
    ops = step_ops(n_layers, n_micro, depth, update=False, offload=offload)
    return [Op("norm", op.part) if op.kind == "send_grads" else op for op in ops] + [Op("grad_norm")]


def second_pass_ops(n_layers: int, n_micro: int, depth: int = 1, offload: int = 0) -> list[Op]:
    """The second pass of a ``norm_first`` step, from the first pass's forward (``norm_ops``' block inputs,
    kept residuals and products, still held): the io part and the last ``depth`` blocks fetched, the head of
    every micro-batch again, then the backward, each part's update right after its gradient's ``send_grads``
    (blocks in reverse, io last); no forward, no norm."""
    _check(n_layers, n_micro, depth)
    if offload < 0:
        raise ValueError(f"activation offload must be >= 0 blocks, got {offload}")
    offload = offloaded_blocks(n_layers, depth, offload)
    ops, resident = [Op("fetch", IO)], set()
    for i in range(n_layers - 1, max(n_layers - 1 - depth, -1), -1):  # as the forward leaves them (never offloaded)
        resident.add(i)
        ops.append(Op("fetch", PartId.block(i)))
    ops += [Op("head", micro=m) for m in range(n_micro)]
    return ops + _backward(n_layers, n_micro, depth, offload, resident, update=False, norm_first=True)


def step_passes(n_layers: int, e: EngineConfig, roles: HostRoles) -> list[list[Op]]:
    """The ops of one optimizer step under ``e``, pass by pass, as the engine runs them: ``accumulate_steps``
    passes of ``step_ops`` (the first visiting the GPU-updated parts, the last updating), or with ``norm_first``
    the norm's pass and the updating one (``norm_ops``, ``second_pass_ops``). ``roles``: ``HostRoles.of_config``
    of ``e``. What a step moves and runs is counted from these (the step-time model, the benches' PCIe bytes)."""
    m, depth, offload = e.micro_batches, e.prefetch_depth, e.offload_activations
    if e.norm_first:
        return [norm_ops(n_layers, m, depth, offload), second_pass_ops(n_layers, m, depth, offload)]
    k = e.accumulate_steps
    return [step_ops(n_layers, m, depth, update=j == k - 1, offload=offload, **visits(roles, first=j == 0,
                                                                                      last=j == k - 1))
            for j in range(k)]


def eval_ops(n_layers: int, n_micro: int, depth: int = 1) -> list[Op]:
    """The ops of a forward-only pass ending in each micro-batch's summed loss (evaluation)."""
    _check(n_layers, n_micro, depth)
    ops, _ = _forward(n_layers, n_micro, depth, keep=0)
    return ops + [Op("loss", micro=m) for m in range(n_micro)] + [Op("release", IO)]


def offloaded_blocks(n_layers: int, depth: int, offload: int) -> int:
    """How many blocks' inputs ``step_ops`` sends to host memory for an ``offload`` setting."""
    return max(0, min(offload, n_layers - depth))


def max_resident_layers(ops: list[Op]) -> int:
    """The most block parameter sets on the device at once under ``ops``."""
    live, peak = set(), 0
    for op in ops:
        if op.kind in ("fetch", "visit") and not op.part.is_io:
            live.add(op.part)
        elif op.kind == "release":
            live.discard(op.part)
        peak = max(peak, len(live))
    return peak
