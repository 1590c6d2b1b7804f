"""What moves when: the per-step operation list, as plain data (testable without a GPU).

The engine walks this list and maps each op to a transfer or a jitted call. One step is:

1. fetch the io part; embed every micro-batch;
2. forward, layer-major: layer i is fetched ``depth`` layers ahead, every micro-batch passes through it,
   then it is released (the last ``depth`` layers stay resident for the backward pass);
3. the head (final norm, chunked logits, loss) per micro-batch, giving d(loss)/d(last hidden);
4. backward, layers in reverse, prefetched ``depth`` ahead: recompute + VJP per micro-batch,
   gradients accumulated on the device, then sent to host memory;
5. the embedding's backward; the io gradients go to host;
6. (last sub-step of an optimizer step only) the global gradient norm, then the host optimizer updates
   parts in forward order (io, block 0, block 1, ...), so the next step's forward can begin early;
7. ``commit``: where the optimizer splits its update in two (see ``Engine``), the second halves, which
   only need to finish before the part's next update, are queued after every part's first half.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

OpKind = Literal["fetch_io", "fetch", "release", "embed", "forward", "head", "backward", "send_grads",
                 "embed_backward", "send_io_grads", "release_io", "grad_norm", "update_io", "update", "commit"]


@dataclasses.dataclass(frozen=True)
class Op:
    kind: OpKind
    layer: int = -1
    micro: int = -1

    def __repr__(self) -> str:
        args = [str(a) for a in (self.layer, self.micro) if a >= 0]
        return f"{self.kind}({', '.join(args)})"


def step_ops(n_layers: int, n_micro: int, depth: int = 1, update: bool = True) -> list[Op]:
    """The ops of one forward+backward pass (plus the optimizer update when ``update``)."""
    if n_layers < 1 or n_micro < 1:
        raise ValueError(f"need at least one layer and one micro-batch, got {n_layers}, {n_micro}")
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    ops: list[Op] = [Op("fetch_io")]
    resident: set[int] = set()

    def fetch(i: int) -> None:
        if 0 <= i < n_layers and i not in resident:
            resident.add(i)
            ops.append(Op("fetch", i))

    ops += [Op("embed", micro=m) for m in range(n_micro)]
    for i in range(depth):
        fetch(i)
    keep_for_backward = set(range(max(0, n_layers - depth), n_layers))
    for i in range(n_layers):
        # Dispatch layer i's compute before asking for layer i + depth: fetching may wait on the host
        # optimizer, and the GPU should be busy with layer i meanwhile.
        ops += [Op("forward", i, m) for m in range(n_micro)]
        fetch(i + depth)
        if i not in keep_for_backward:
            resident.discard(i)
            ops.append(Op("release", i))
    ops += [Op("head", micro=m) for m in range(n_micro)]
    for i in reversed(range(n_layers)):
        for j in range(i, i - depth - 1, -1):  # keep `depth` layers in flight ahead of the compute
            fetch(j)
        ops += [Op("backward", i, m) for m in range(n_micro)]
        ops.append(Op("send_grads", i))
        resident.discard(i)
        ops.append(Op("release", i))
    ops += [Op("embed_backward", micro=m) for m in range(n_micro)]
    ops += [Op("send_io_grads"), Op("release_io")]
    if update:
        ops.append(Op("grad_norm"))
        ops.append(Op("update_io"))
        ops += [Op("update", i) for i in range(n_layers)]
        ops.append(Op("commit"))
    return ops


def max_resident_layers(ops: list[Op]) -> int:
    """The most block parameter sets on the device at once under ``ops``."""
    live, peak = set(), 0
    for op in ops:
        if op.kind == "fetch":
            live.add(op.layer)
        elif op.kind == "release":
            live.discard(op.layer)
        peak = max(peak, len(live))
    return peak
