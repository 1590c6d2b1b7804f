"""The GPU side of the plan: one optimizer step of the engine's own schedule (``schedule.step_ops``),
walked with a ledger of the device buffers each op creates and frees.

What the ledger holds: the GPU-resident parts (fp32 master, Adam moments, compute copy), streamed weights
between ``fetch`` and ``release``, the boundary activation of every layer and micro-batch until its
backward, d(loss)/d(hidden) per micro-batch, the float32 gradient accumulator of the part in backward, the
gradients of GPU-resident parts until their update, and those of GPU-updated parts until the next forward's
visit, where their update runs on the masters and moments brought over at the step's start (the io part's:
during the backward before). Each op kind has one rule in ``RULES``, keyed like
``passes.HANDLERS`` (a test checks that every ``OpKind`` has both). Two effects come on top of what the host
program holds:

- *run-ahead*: JAX dispatches asynchronously, so a buffer the host has dropped stays allocated until the
  GPU has run the work queued on it: streamed weights after ``release``, gradients whose copy to host
  memory is queued, offloaded activations whose copy is queued. XLA's GPU client would admit 32
  computations ahead of the GPU (``max_inflight_computations``); measured on the H100 box
  (experiments/studies/host_lead.py, op_memory.py) it ran 10-17 ops ahead with 2-6 released blocks' buffers
  still in use, and through GPU-resident blocks, where no transfer slows it, further. The engine bounds it:
  before the host issues a block's compute it waits for all but the newest ``schedule.BLOCKS_AHEAD`` blocks
  (``passes.PassRunner.pace``). The ledger counts what the host dropped for its newest ``QUEUED_BLOCKS``
  (that bound) blocks as still allocated (experiments/studies/plan_queue_sensitivity.py has the error
  against every measured run for other depths). Not all of it: PJRT orders the GPU's allocations on its compute
  stream, so a buffer whose last reader is a program on that stream is free for the programs queued after it as
  soon as the host drops it; what a copy reads (on a copy stream: a gradient going home, an activation offloaded)
  is held until the copy has run. The ledger holds the float32 gradient sums that are read only by programs (cast
  to bfloat16 for the copy home, or reduced to the norm by a ``norm_first`` step's first pass) for no block:
  measured on one H200 (the x4 job's rehearsals, experiments/studies/NOTES.md, 2026-12-02) the GPU peaks of three
  streamed layouts with bfloat16 gradients were 31-68% under a walk that held them for ``QUEUED_BLOCKS`` blocks,
  and 0.5-15% under one that does not;
- *transients*: the scratch memory of the compiled function that is running (block forward, recompute +
  VJP, head, the embedding's VJP): XLA's memory analysis of the compiled program where the GPU is at hand,
  else a rule of thumb (``activations.transient``).

The GPU total is the ledger's peak over one optimizer step, plus the running op's transient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Any, Callable

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import IO, PartId
from megatrain_jax.engine.program_memory import ProgramMemory
from megatrain_jax.engine.schedule import (BLOCKS_AHEAD, STORES_AHEAD, Op, OpKind, norm_ops, second_pass_ops, step_ops,
                                           visits)
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.plan.activations import kept_bytes, products_bytes, transient
from megatrain_jax.plan.counts import (BATCH_BYTES_PER_TOKEN, activation_bytes, blocks_param_count,
                                       device_grad_bytes, host_grad_bytes, host_roles, io_param_count,
                                       part_param_count)

QUEUED_BLOCKS = BLOCKS_AHEAD  # blocks of work the GPU may trail the host by (the engine waits for older ones)

# XLA's allocator (BFC) counts a whole free chunk as in use when it does not split it: it splits only where
# the rest is at least the request or 128 MiB. GPU-resident parts and gradients that wait on the GPU are large
# buffers that live across many ops, and gradients and activations are allocated again around them each step:
# the allocator's bytes in use then exceed the live arrays' bytes. Measured on the H100 box with the step
# synchronized after every op (experiments/results/h100_op_memory_3p5b_32k_r8io_watch.json): 0.7 GiB at the
# step's start and 1.6 GiB at its fullest op with 8 blocks + io resident (7.0 GiB of float32 gradients), 0.16
# GiB with nothing resident. The two shares below are fitted to the shipped configs' runs through the command
# line (experiments/studies/NOTES.md, issue 31; since 2026-11-25, commit a6ea108): resident parts 0.19-0.26 GiB
# per part over the plan without it (3.5B, 7B, 8B SFT), waiting gradients 0.068-0.083 of their bytes (Qwen2.5-14B
# capacity, 8B SFT).
# With ``device_grad_dtype="bfloat16"`` the shares are taken of the gradients' bfloat16 bytes: a hypothesis (the
# allocator's slack around smaller buffers), not fitted; the runs so far peaked before most of those gradients existed.
RESIDENT_ALLOCATOR_SLACK = 0.25  # of the GPU-resident parts' gradient bytes (fitted on float32 ones)
WAITING_ALLOCATOR_SLACK = 0.075  # of the bytes of the gradients that wait on the GPU (grads_on_gpu)


@dataclasses.dataclass
class Ledger:
    """Device bytes per category as the schedule runs, and buffers the host dropped but the GPU still uses."""

    live: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # category -> [bytes, buffers]
    held: list = dataclasses.field(default_factory=list)  # (block, category, bytes) queued GPU work still uses
    queue: deque = dataclasses.field(default_factory=deque)  # the blocks the host has moved through, newest last
    bytes: int = 0  # the total of ``live`` and ``held``, kept as they change

    def add(self, cat: str, nbytes: int, n: int = 1) -> None:
        entry = self.live.setdefault(cat, [0, 0])
        entry[0] += nbytes
        entry[1] += n
        self.bytes += nbytes

    def drop(self, cat: str, nbytes: int, n: int = 1, block: Any = None) -> None:
        """``cat``'s buffers the host no longer holds; with ``block``, work queued for that block (a part in
        one pass and phase) still uses them until the host is ``QUEUED_BLOCKS`` blocks further."""
        self.add(cat, -nbytes, -n)
        if block is not None:
            self.reach(block)
            self.held.append((block, cat, nbytes))
            self.bytes += nbytes

    def reach(self, block: Any) -> None:
        """The host has issued ``block``'s work: what the GPU still uses for older blocks than the newest
        ``QUEUED_BLOCKS`` is free."""
        if block in self.queue:
            return
        self.queue.append(block)
        while len(self.queue) > QUEUED_BLOCKS:
            done = self.queue.popleft()
            self._free(lambda h: h[0] == done)

    def settle(self, cat: str, keep: int) -> None:
        """The host waited for all but the newest ``keep`` of ``cat``'s dropped buffers: the rest are free."""
        mine = [h for h in self.held if h[1] == cat]
        gone = set(map(id, mine[:max(len(mine) - keep, 0)]))
        self._free(lambda h: id(h) in gone)

    def _free(self, done: Callable[[tuple], bool]) -> None:
        kept = []
        for h in self.held:
            if done(h):
                self.bytes -= h[2]
            else:
                kept.append(h)
        self.held = kept

    def total(self) -> int:
        return self.bytes

    def snapshot(self) -> tuple[dict[str, tuple[int, int]], list]:
        """What ``breakdown`` reads, as it is now: ``Walk.peak`` keeps it at each new peak, and only the last
        one's items are named."""
        return {cat: (b, n) for cat, (b, n) in self.live.items()}, list(self.held)


def breakdown(live: dict[str, tuple[int, int]], held_now: list) -> dict[str, int]:
    """The items of a ledger's ``snapshot``."""
    held: dict[str, list[int]] = {}
    for block, cat, b in held_now:  # counted in blocks: one entry may hold several micro-batches' buffers
        entry = held.setdefault(f"{cat}: dropped by the host, still used by queued GPU work", [0, set()])
        entry[0] += b
        entry[1].add(block)
    return {**{f"{cat} ({n} buffers)" if n > 1 else cat: b for cat, (b, n) in live.items() if b},
            **{f"{cat} ({len(blocks)} blocks)" if len(blocks) > 1 else cat: b
               for cat, (b, blocks) in held.items() if b}}


# The ledger's categories.
W = "weights in use (streamed, or cast from resident masters)"
A, G = "boundary activations", "gradient accumulators, float32"
K = "kept residuals: attention output and softmax statistics (keep_residuals), matrix products (kept_layers)"
R, DY, B = ("gradients of GPU-resident parts, float32 or device_grad_dtype", "d(loss)/d(hidden) per micro-batch",
           "token batches")
H = "gradients waiting on the GPU for their host update, float32 (grads_on_gpu)"
S = "gradients cast to bfloat16 for the copy home (host_grad_dtype)"
V = "masters and moments visiting the GPU for their update, float32 (gpu_updated_layers, gpu_updated_io)"
U = ("gradients waiting on the GPU for the next forward's update there, float32 or device_grad_dtype "
     "(gpu_updated_layers)")


@dataclasses.dataclass
class Walk:
    """One optimizer step of the schedule on one GPU of ``devices``: the sizes of what the ops create, what
    is live (``led``), and the peak so far. Each GPU holds its rows, its shard of the resident parts and of
    each fetched part, and each fetched part whole once gathered."""

    c: DecoderConfig
    e: EngineConfig
    rows: int  # this GPU's rows per pass
    seq_len: int
    sb: int  # bytes per streamed weight
    flash: bool
    devices: int = 1
    packed: bool = False
    led: Ledger = dataclasses.field(default_factory=Ledger)
    acts: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> micro-batch activations held
    keeps: dict[int, int] = dataclasses.field(default_factory=dict)  # block -> micro-batch kept residuals held
    away: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> activations in host memory
    # a norm_first step's first pass (``keeps_forward``) keeps its forward's values for the second: the offloaded
    # blocks' host copies stay there while their device copies serve the first backward (layer -> micro-batches)
    keeps_forward: bool = False
    back: dict[int, int] = dataclasses.field(default_factory=dict)
    home: set = dataclasses.field(default_factory=set)  # waiting gradients the step before's update took home
    best: tuple = (-1,)  # the peak: bytes, op, outputs, transient, why, the ledger's snapshot (``peak_items``)
    accumulate: bool = False  # this pass adds to an earlier pass's gradients
    pass_index: int = 0
    backward: bool = False  # the pass is past its head
    programs: ProgramMemory | None = None  # XLA's figures for the compiled programs, where known
    temps: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # op kind -> transient, why

    def __post_init__(self) -> None:
        c, e = self.c, self.e
        self.M = e.micro_batches
        self.Pio = io_param_count(c)
        self.Pblock = (c.block_param_count(0), c.block_param_count(c.layers - 1))  # dense first where kinds differ
        # each part's parameters by its index: io, then the blocks, MoE or dense
        self.part_params = [self.Pio] + [self.Pblock[1] if c.is_moe_layer(i) else self.Pblock[0]
                                         for i in range(c.layers)]
        self.fetched = 1 if self.devices == 1 else 1 + 1 / self.devices  # the shard, and the part once gathered
        self.act = self.rows // self.M * self.seq_len * c.hidden * activation_bytes(c)  # one micro-batch's
        self.res = kept_bytes(c, e, self.rows // self.M, self.seq_len, self.flash, self.packed)  # one block's
        self.kept_from = c.layers - e.kept_layers  # blocks from here on keep their matrix products too
        self._kept: dict[int, int] = {}  # a kept block's bytes per micro-batch, by block (``kept``)
        self.on_gpu = {IO} if e.resident_io else set()
        self.on_gpu |= {PartId.block(i) for i in range(e.resident_layers)}
        roles = host_roles(c, e)
        self.waiting = set(roles.grads_on_gpu)
        self.visiting = set(roles.gpu_updated)  # their gradients wait for the next forward's update on the GPU
        resident_params = blocks_param_count(c, range(e.resident_layers)) + (self.Pio if e.resident_io else 0)
        # master + Adam moments in the mode's dtypes (engine/precision.py), and the compute copy where the stream
        # dtype is not the masters' own: kept beside them, or cast at each fetch and held like streamed weights
        # (engine/update/resident.py, EngineConfig.resident_copy)
        copy = self.sb != e.precision.master_bytes
        self.cast = copy and not e.keeps_resident_copy
        kept = self.sb if copy and e.keeps_resident_copy else 0
        self.resident = resident_params * (e.precision.master_bytes + e.precision.moment_bytes + kept) // self.devices
        waiting_params = sum(part_param_count(c, part) for part in self.waiting)
        visiting_params = sum(part_param_count(c, part) for part in self.visiting)
        # bytes a parameter of a gradient kept for an update on the GPU: rounded once summed, so accumulating steps
        # hold the float32 sum of their sub-steps until the last
        self.dgb = device_grad_bytes(e) if e.accumulate_steps == 1 else 4
        self.slack = int((RESIDENT_ALLOCATOR_SLACK * self.dgb * resident_params + WAITING_ALLOCATOR_SLACK
                          * (4 * waiting_params + self.dgb * visiting_params)) / self.devices)  # of their gradients
        self.batches = self.rows * self.seq_len * (BATCH_BYTES_PER_TOKEN + (0 if self.flash else 4))

    # ------------------------------------------------------------------ what an op touches
    def here(self, op: Op) -> tuple:
        """The block whose work ``op`` queues: its part (by index: the ledger compares blocks often) in this
        pass and phase."""
        return (self.pass_index, self.backward, op.kind if op.part is None else op.part.index)

    def params(self, op: Op) -> int:
        """The parameters of the part ``op`` works on (the head's: the io part's; the head and the embedding's
        backward accumulate its gradient)."""
        return self.Pio if op.kind in ("head", "embed", "embed_backward") else self.part_params[op.part.index]

    def weights(self, op: Op) -> int:
        return int(self.params(op) * self.sb * self.fetched)

    def in_use(self, op: Op) -> int:
        """What a part holds on each GPU from its fetch to its release: a streamed part's weights (its shard and,
        over several devices, the part gathered), and as much for a resident part's compute copy cast at the
        fetch; a resident part that keeps its copy, or computes with its masters, is gathered whole over several
        devices (its shard is counted with the resident parts), and on one device adds nothing."""
        if op.part not in self.on_gpu or self.cast:
            return self.weights(op)
        return self.params(op) * self.sb if self.devices > 1 else 0

    def grad(self, op: Op) -> int:
        """A part's float32 gradient, whole: what a device accumulates over the micro-batches."""
        return self.params(op) * 4

    def summed(self, op: Op) -> int:
        """The part's gradient once summed over the devices: each device's shard (the whole on one device)."""
        return self.grad(op) // self.devices

    def kept_grad(self, op: Op) -> int:
        """A gradient kept on the GPU for an update there (a resident part's, a GPU-updated part's until its
        visit), in ``device_grad_dtype``: each device's shard."""
        return self.summed(op) * self.dgb // 4

    def last_micro(self, op: Op) -> bool:
        return op.micro == self.M - 1

    def peak(self, op: Op, out: int = 0, temp: int = 0, why: str = "") -> None:
        """What is allocated while ``op`` runs: the ledger, its transient and its outputs."""
        total = self.resident + self.slack + self.led.bytes + temp + out
        if total > self.best[0]:
            self.best = (total, op, out, temp, why, self.led.snapshot())

    def peak_items(self) -> tuple[dict[str, int], str]:
        """The peak's items (bytes) and the op it happens in."""
        if len(self.best) == 1:
            return {}, ""
        _, op, out, temp, why, snapshot = self.best
        items = {f"GPU-resident parts with their optimizer state ({len(self.on_gpu)} parts)": self.resident,
                 "the allocator's slack around GPU-resident parts and waiting gradients (measured)": self.slack,
                 **breakdown(*snapshot)}
        items[f"transient of {op!r} ({why})"] = temp
        items[f"outputs of {op!r}"] = out
        return {k: v for k, v in items.items() if v}, repr(op)

    def compute(self, op: Op, out: int) -> None:
        """The peak of a compute op (with its program's transient); its work is now queued."""
        if op.kind not in self.temps:
            self.temps[op.kind] = self.compiled_temp(op.kind) or self.rule_of_thumb(op.kind)
        self.peak(op, out, *self.temps[op.kind])
        self.led.reach(self.here(op))  # GPU-resident blocks' and unreleased ones' work counts too

    def compiled_temp(self, kind: str) -> tuple[int, str] | None:
        """The temp of the program behind ``kind`` from XLA's memory analysis (``programs``), where it was
        compiled for this walk's micro-batch shape and layout."""
        p = self.programs
        if p is None or not p.matches(self.rows // self.M, self.seq_len, self.sb, self.packed, self.devices,
                                      self.e.keep_residuals, self.e.kept_layers > 0):
            return None
        temp = p.op_temp(kind)
        return None if temp is None else (temp, "XLA's memory analysis of the compiled program")

    def rule_of_thumb(self, kind: str) -> tuple[int, str]:
        temp, why = transient(self.c, kind, self.rows // self.M, self.seq_len, self.sb, self.flash, self.packed,
                              self.res > 0)
        return temp, f"rule of thumb: {why}"

    def kept(self, layer: int) -> int:
        """What block ``layer``'s forward keeps for its backward per micro-batch: the marked residuals
        (``keep_residuals``), and with ``kept_layers`` its matrix products and cuDNN's marked residuals."""
        if layer < self.kept_from:
            return self.res
        if layer not in self._kept:  # asked for at each of the block's forward and backward ops: counted once
            marked = kept_bytes(self.c, dataclasses.replace(self.e, keep_residuals=True), self.rows // self.M,
                                self.seq_len, self.flash, self.packed)
            self._kept[layer] = marked + products_bytes(self.c, self.rows // self.M, self.seq_len, layer)
        return self._kept[layer]

    def drop_acts(self, layer: int) -> None:
        self.led.drop(A, self.act * self.acts[layer], self.acts.pop(layer))


# ---------------------------------------------------------------------------------------------- the rules
# One rule per op kind: what the op allocates while it runs (``Walk.peak``), then what the host holds after
# it. A new op kind gets a rule here, a handler in ``passes.HANDLERS`` and a name in ``schedule.OpKind``.
def _fetch(w: Walk, op: Op) -> None:
    held = w.in_use(op)
    w.peak(op, out=held)
    if op.part in w.waiting and op.part not in w.home:  # the forward's fetch waited for the update, which
        w.home.add(op.part)                              # took the step before's gradient home
        w.led.drop(H, w.summed(op))
    if held:
        w.led.add(W, held)


def _state(w: Walk, op: Op) -> int:
    """A GPU-updated part's masters and moments, this GPU's shard."""
    return w.params(op) * (w.e.precision.master_bytes + w.e.precision.moment_bytes) // w.devices


def _bring(w: Walk, op: Op) -> None:
    """A GPU-updated part's masters and moments copied over (a block's at the step's start, the io part's in the
    backward before), held until its visit's update and copy home."""
    w.peak(op, out=_state(w, op))
    w.led.add(V, _state(w, op))


def _visit(w: Walk, op: Op) -> None:
    """A GPU-updated part's forward fetch, where its update of the step before runs (the first pass of a step:
    later passes fetch): the update writes the brought masters and moments in place and the compute copy beside
    them (the weights in use); the state is held until its copy home, which the ledger counts as done with the
    block's queued work, and so is the gradient that waited for it. The update's transient: one float32 tree
    (the step before it is applied)."""
    held = w.in_use(op)
    w.peak(op, out=held, temp=w.grad(op) // w.devices, why="the update's float32 step, before it is applied")
    w.led.drop(U, w.kept_grad(op), block=w.here(op))
    w.led.add(W, held)
    w.led.drop(V, _state(w, op), block=w.here(op))


def _release(w: Walk, op: Op) -> None:
    w.peak(op)
    if w.in_use(op):
        w.led.drop(W, w.in_use(op), block=w.here(op))


def _embed(w: Walk, op: Op) -> None:
    w.compute(op, out=w.act)
    w.acts[0] = w.acts.get(0, 0) + 1
    w.led.add(A, w.act)


def _forward(w: Walk, op: Op) -> None:
    res = w.kept(op.part.layer)
    w.compute(op, out=w.act + res)
    layer = op.part.layer + 1
    w.acts[layer] = w.acts.get(layer, 0) + 1
    w.led.add(A, w.act)
    if res:
        w.keeps[op.part.layer] = w.keeps.get(op.part.layer, 0) + 1
        w.led.add(K, res)


def _head(w: Walk, op: Op) -> None:
    w.compute(op, out=w.act + (w.grad(op) if op.micro == 0 else 0))
    if op.micro == 0:
        w.led.add(G, w.grad(op))
    w.led.add(DY, w.act)
    if w.last_micro(op) and not w.keeps_forward:
        w.drop_acts(w.c.layers)


def _new_gradient(w: Walk, op: Op, starts: bool) -> int:
    """The gradient buffer a gradient program allocates (``backward``; for the io part ``embed_backward``, whose
    accumulator the head starts): the first micro-batch's starts the part's float32 accumulator, the others add
    to it in place, and on several devices the last one sums it over them into a new buffer, each device's
    shard."""
    if w.devices > 1 and w.last_micro(op):
        return w.summed(op)
    return w.grad(op) if starts else 0


def _keep_gradient(w: Walk, op: Op, starts: bool) -> None:
    """The accumulators after a gradient program: its new buffer. A whole accumulator it summed over the
    devices is free at once: only programs on the compute stream used it, which run in order (a buffer a
    copy to the host still reads is held until the copy is done: ``_send_grads``)."""
    if w.devices > 1 and w.last_micro(op) and not starts:
        w.led.drop(G, w.grad(op))
    new = _new_gradient(w, op, starts)
    if new:
        w.led.add(G, new)


def _backward(w: Walk, op: Op) -> None:
    starts = op.micro == 0
    w.compute(op, out=w.act + _new_gradient(w, op, starts))
    _keep_gradient(w, op, starts)
    layer = op.part.layer
    if w.keeps_forward and layer not in w.back:  # held for the second pass's backward
        return
    if w.last_micro(op) and layer in w.keeps:
        n = w.keeps.pop(layer)
        w.led.drop(K, w.kept(layer) * n, n)
    if w.last_micro(op) and w.keeps_forward:  # an offloaded block's device copies go; its host copies stay
        w.drop_acts(layer)
        w.away[layer] = w.back.pop(layer)
    elif w.last_micro(op) and layer > 0:  # block 0's inputs are the embeddings, still needed by embed_backward
        w.drop_acts(layer)


def _embed_backward(w: Walk, op: Op) -> None:
    w.compute(op, out=_new_gradient(w, op, starts=False))
    _keep_gradient(w, op, starts=False)
    if w.last_micro(op):
        w.led.drop(DY, w.act * w.M, w.M)
        if not w.keeps_forward:
            n = sum(w.acts.values())
            w.led.drop(A, w.act * n, n)
            w.acts.clear()


def _send_grads(w: Walk, op: Op) -> None:
    """A gradient bound for host memory crosses in ``host_grad_dtype``: a bfloat16 one is a copy cast beside
    the float32 accumulator, and both are held until the copy home has read it."""
    kept, waits, visits = op.part in w.on_gpu, op.part in w.waiting, op.part in w.visiting
    home = not (kept or waits or visits)
    sent = w.summed(op) * host_grad_bytes(w.e) // 4 if home else 0  # in the host's dtype
    cast = sent if home and host_grad_bytes(w.e) < 4 else 0  # the bfloat16 copy that is sent
    # a gradient updated on the GPU is rounded once the step's sum is complete (``device_grad_dtype``): at the last
    # pass, which the walk's second stands for when it accumulates; the queued cast reads the float32 sum
    rounded = (kept or visits) and device_grad_bytes(w.e) < 4 and (w.e.accumulate_steps == 1 or w.accumulate)
    if rounded:
        cast = w.summed(op) * device_grad_bytes(w.e) // 4
    back = sent if w.accumulate else 0
    w.peak(op, out=cast, temp=back, why="the earlier passes' sum, back from host memory to be added")
    # the float32 sum is held for queued work where a copy home reads it; a cast read it instead, on the compute
    # stream, whose later programs may take its memory at once (the module docstring)
    w.led.drop(G, w.summed(op), block=w.here(op) if (home and not cast) or rounded else None)
    if cast and home:
        w.led.add(S, cast)
        w.led.drop(S, cast, block=w.here(op))
    if kept and not w.accumulate:
        w.led.add(R, w.kept_grad(op))
    elif waits and not w.accumulate:
        w.led.add(H, w.summed(op))
    elif visits and not w.accumulate:
        w.led.add(U, w.kept_grad(op))


def _update(w: Walk, op: Op) -> None:
    w.peak(op)
    if op.part in w.on_gpu:
        w.led.drop(R, w.kept_grad(op))


def _store_acts(w: Walk, op: Op) -> None:
    """Freed once the queued copies have read them; the host waits for all but the last ``STORES_AHEAD``
    blocks' copies. The block's kept residuals go with its inputs."""
    w.peak(op)
    layer = op.part.layer
    n, nk = w.acts.pop(layer), w.keeps.pop(layer, 0)
    w.led.add(K, -w.res * nk, -nk)
    w.led.add(A, w.res * nk, 0)
    w.led.drop(A, (w.act + w.res) * n, n, block=w.here(op))
    w.led.settle(A, keep=STORES_AHEAD)
    w.away[layer] = n


def _load_acts(w: Walk, op: Op) -> None:
    w.peak(op, out=(w.act + w.res) * w.M)  # one copy per micro-batch (and one of its kept residuals)
    layer = op.part.layer
    w.acts[layer] = n = w.away.pop(layer)
    if w.keeps_forward:
        w.back[layer] = n
    w.led.add(A, w.act * n, n)
    if w.res:
        w.keeps[layer] = n
        w.led.add(K, w.res * n, n)


def _norm(w: Walk, op: Op) -> None:
    """A ``norm_first`` step's first pass: the part's gradient reduced to a scalar on the device, and dropped: only
    programs on the compute stream read it, so the programs queued after them may take its memory at once."""
    w.peak(op)
    w.led.drop(G, w.summed(op))


def _nothing_held(w: Walk, op: Op) -> None:
    """The global norm, the commit of split updates, and evaluation's loss: a scalar each."""
    w.peak(op)


RULES: dict[OpKind, Callable[[Walk, Op], None]] = {
    "fetch": _fetch, "release": _release, "embed": _embed, "forward": _forward, "head": _head,
    "backward": _backward, "send_grads": _send_grads, "embed_backward": _embed_backward,
    "grad_norm": _nothing_held, "update": _update, "commit": _nothing_held, "loss": _nothing_held,
    "store_acts": _store_acts, "load_acts": _load_acts, "norm": _norm, "bring": _bring, "visit": _visit,
}


_step_ops = functools.lru_cache(maxsize=64)(step_ops)  # the plan's search walks the same schedules many times
_norm_ops = functools.lru_cache(maxsize=64)(norm_ops)
_second_pass_ops = functools.lru_cache(maxsize=64)(second_pass_ops)


def gpu_peak(c: DecoderConfig, e: EngineConfig, rows: int, seq_len: int, sb: int, flash: bool,
             devices: int = 1, packed: bool = False,
             programs: ProgramMemory | None = None) -> tuple[dict[str, int], str]:
    """Walk one optimizer step of the engine's schedule: the peak's items (bytes) and the op it happens in.
    The step is a steady-state one: the gradients that wait on the GPU (``grads_on_gpu``) from the step
    before are there when it starts, each until its part's fetch (which waits for the part's update, which
    copies the gradient home).

    The plan's search (``plan.levers``, ``plan.layout``) plans the same configuration many times: a walk is
    kept (``_walked``), keyed by its arguments and the module's constants it reads (a study may change
    ``QUEUED_BLOCKS``), and each caller gets its own copy of the items."""
    items, at = _walked(c, e, rows, seq_len, sb, flash, devices, packed, programs, QUEUED_BLOCKS,
                        RESIDENT_ALLOCATOR_SLACK, WAITING_ALLOCATOR_SLACK, STORES_AHEAD, BATCH_BYTES_PER_TOKEN)
    return dict(items), at


@functools.lru_cache(maxsize=4096, typed=True)
def _walked(c: DecoderConfig, e: EngineConfig, rows: int, seq_len: int, sb: int, flash: bool, devices: int,
            packed: bool, programs: ProgramMemory | None, *constants: Any) -> tuple[dict[str, int], str]:
    """``gpu_peak``'s walk; ``constants``: the module's, for the key only (the walk reads them itself)."""
    w = Walk(c, e, rows // devices, seq_len, sb, flash, devices, packed, programs=programs)
    for part in w.waiting:  # the step before's, copied home by each part's update before its fetch
        w.led.add(H, part_param_count(c, part) * 4 // devices)
    for part in w.visiting:  # the step before's, used by each part's update at its visit
        w.led.add(U, part_param_count(c, part) * w.dgb // devices)
    roles = host_roles(c, e)
    if roles.io_visited:  # the io part's masters and moments, brought during the step before's backward
        w.led.add(V, part_param_count(c, IO) * (e.precision.master_bytes + e.precision.moment_bytes) // devices)
    if e.norm_first:  # the norm's pass, holding its forward's values for the second, which runs no forward
        w.led.add(B, w.batches)
        for j, ops in enumerate((_norm_ops(c.layers, w.M, e.prefetch_depth, e.offload_activations),
                                 _second_pass_ops(c.layers, w.M, e.prefetch_depth, e.offload_activations))):
            w.pass_index, w.keeps_forward, w.backward = j, j == 0, False
            for op in ops:
                w.backward |= op.kind == "head"
                RULES[op.kind](w, op)
        w.led.drop(B, w.batches)
        return w.peak_items()
    passes = min(e.accumulate_steps, 2)  # later accumulating passes repeat the second
    for j in range(passes):
        w.pass_index, w.accumulate, w.backward = j, j > 0, False
        w.led.add(B, w.batches)
        for op in _step_ops(c.layers, w.M, e.prefetch_depth, j == passes - 1, e.offload_activations,
                            **visits(roles, first=j == 0, last=j == passes - 1)):
            w.backward |= op.kind == "head"
            RULES[op.kind](w, op)
        w.led.drop(B, w.batches)
    return w.peak_items()
