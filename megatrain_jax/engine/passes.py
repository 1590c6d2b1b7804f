"""How each op of the schedule runs: one handler per op kind, in one table (``HANDLERS``).

A ``PassRunner`` walks a list of ops (``megatrain_jax.engine.schedule``) over one batch's micro-batches: it moves
parts with ``Placement``, runs the jitted per-part functions (``DeviceFns``), sends gradients to host
memory and hands the updates to the ``UpdatePolicy``. The values of one pass live in a ``Pass``; what
outlives a pass (GPU-resident parts, gradients being accumulated over sub-steps) lives in the runner.

Each handler returns what the op produced (device arrays, or the futures of host-worker tasks), which is
what observers (``megatrain_jax.engine.observers``) may wait on.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax

from megatrain_jax.batch import Batch
from megatrain_jax.engine.device_fns import DeviceFns
from megatrain_jax.engine.host_state import HostState
from megatrain_jax.engine.out_of_memory import (DeviceOutOfMemoryError, in_host_pool, is_out_of_memory, pinned_census,
                                               reported_late)
from megatrain_jax.engine.parts import IO, Part, PartId
from megatrain_jax.engine.schedule import BLOCKS_AHEAD, STORES_AHEAD, UPDATES_AHEAD, Op, OpKind
from megatrain_jax.engine.transfer import Placement
from megatrain_jax.engine.update.policy import StepDecision, UpdatePolicy


@dataclasses.dataclass
class Pass:
    """Device-side values of one pass over a batch."""

    batches: list[Batch]  # micro-batches, on the devices (spread by row)
    inv_count: Any = 1.0  # 1 / the loss tokens of the whole batch (a device scalar)
    accumulate: bool = False  # add the gradients to those of earlier sub-steps
    last: bool = True  # the last sub-step of an optimizer step: norms and updates follow
    norm_known: bool = False  # a norm_first step's second pass: the decision is made, each update follows its send
    keeps_forward: bool = False  # a norm_first step's first pass: its forward's values stay for the second
    keep_inputs: bool = True  # keep each block's inputs for the backward (False: evaluation)
    keep_residuals: bool = False  # and the residuals the model marked to keep (``megatrain_jax.contract.remat``)
    kept_from: int | None = None  # blocks from this one on keep every matrix product too (``kept_layers``)
    params: dict[PartId, Any] = dataclasses.field(default_factory=dict)  # parts on the device
    acts: dict[int, list] = dataclasses.field(default_factory=dict)  # block -> its input per micro-batch
    kept: dict[int, list] = dataclasses.field(default_factory=dict)  # block -> its kept residuals per micro-batch
    dy: list = dataclasses.field(default_factory=list)
    grads: Any = None  # the accumulator of the block in backward
    io_grads: Any = None
    losses: list = dataclasses.field(default_factory=list)
    decision: StepDecision | None = None
    stats: Any = None  # the routed blocks' statistics summed over them and micro-batches (an auxiliary loss's input)
    d_stats: Any = None  # the auxiliary loss's gradient with respect to them
    aux: Any = None  # the auxiliary (load-balancing) loss, also a term of ``losses``
    pair_stats: Any = None  # a pair objective's statistics (``DPO.stats``) summed over the micro-batches
    inv_pairs: Any = None  # a pair objective's 1 / the pairs of the whole batch (instead of ``inv_count``)
    per_row: bool = False  # evaluation: each row's summed NLL (``row_nll``) instead of the batch's sum
    stores: list = dataclasses.field(default_factory=list)  # offloaded activations whose copies may be queued
    # ``keeps_forward``: an offloaded block's inputs and kept residuals in host memory while their device copies
    # serve its backward (block -> (inputs, kept residuals or None)), back in ``acts`` and ``kept`` after it
    away: dict[int, tuple] = dataclasses.field(default_factory=dict)

    def drop(self) -> None:
        """Let go of the pass's device values (a pass cut short: the exception's traceback would hold them)."""
        self.params, self.acts, self.kept, self.dy, self.stores, self.away = {}, {}, {}, [], [], {}
        self.grads = self.io_grads = None

    def hand_on(self) -> dict:
        """What this first pass's forward made, for the second pass of its ``norm_first`` step
        (``Pass(..., **hand_on())``, which runs ``schedule.second_pass_ops``): every block's inputs and kept
        residuals and products (the offloaded blocks' in host memory) and the routed blocks' statistics. This pass
        lets go of the first two."""
        out = dict(acts=self.acts, kept=self.kept, stats=self.stats)
        self.acts, self.kept = {}, {}
        return out

    def take_grads(self, part: PartId) -> Any:
        """The gradient the backward accumulated for ``part`` (the io part's, or the block's just run); the
        pass lets go of it."""
        if part.is_io:
            grads, self.io_grads = self.io_grads, None
        else:
            grads, self.grads = self.grads, None
        return grads

    def keeps_products(self, layer: int) -> bool:
        """Whether block ``layer``'s forward keeps its matrix products for its backward."""
        return self.keep_inputs and self.kept_from is not None and layer >= self.kept_from


# The phase of the step an op belongs to, as an out-of-memory report names it.
PHASE: dict[OpKind, str] = {
    "fetch": "a transfer to the device", "release": "a transfer to the device", "embed": "the forward",
    "forward": "the forward", "head": "the head", "backward": "the backward", "send_grads": "the backward",
    "embed_backward": "the backward", "grad_norm": "the global norm", "update": "the update",
    "commit": "the update", "loss": "evaluation", "store_acts": "the forward", "load_acts": "the backward",
    "norm": "the backward", "bring": "a transfer to the device", "visit": "a GPU-updated part's update at its fetch",
}


class PassRunner:
    """Runs ops against the host state, the GPU-resident parts and the update policy."""

    def __init__(self, fns: DeviceFns, placement: Placement, state: HostState, policy: UpdatePolicy,
                 resident: dict[PartId, Part], observers: Sequence, grads_on_gpu: Sequence[PartId] = (),
                 host_grad_dtype: str = "float32", gpu_updated: Sequence[PartId] = (),
                 device_grad_dtype: str = "float32"):
        self.fns, self.placement, self.state, self.policy = fns, placement, state, policy
        self.resident = resident  # GPU-resident parts, updated on the device
        self.grads_on_gpu = set(grads_on_gpu)  # host-updated parts whose gradients wait on the device
        self.gpu_updated = set(gpu_updated)  # streamed parts updated on the device at their next visit
        # a GPU-updated part's update waiting for its visit: its gradient (on the device) and its step's decision
        self.pending: dict[PartId, tuple[Any, StepDecision]] = {}
        # a pending part's masters and moments on their way to the device (``_bring_landed``'s future), issued on a
        # thread of their own one after another: copies in flight at once share the link and land together near
        # the end, so the first visit would wait for all of them (h200x2_transfer_queues_2b81da0.json), and a
        # program that reads a copy still in flight holds every later program on the GPU behind it
        self.brought: dict[PartId, Future] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-bring")
        self.bfloat16_home = host_grad_dtype == "bfloat16"  # gradients sent home are rounded on the device first
        self.bfloat16_device = device_grad_dtype == "bfloat16"  # and those updated on the device, once summed
        self.observers = observers
        self.n_blocks = len(state.parts) - 1
        self.kinds = fns.lm.block_kinds  # each block's kind: which template its programs run
        self._grads: dict[PartId, Any] = {}  # each part's gradient of this optimizer step so far
        self._sq_norms: dict[PartId, Any] = {}
        self.decision: StepDecision | None = None  # of the last optimizer step
        self.updating = False  # the optimizer step's update has begun (parts may hold the new step)
        self._passes = 0  # passes run: a block is one part in one pass's forward or backward
        self._ahead: deque[list] = deque()  # [block, its newest output, or its fence once sealed] issued last
        self._updating: deque[PartId] = deque()  # norm_first: host parts whose updates were queued, oldest first

    def begin_step(self) -> None:
        """Forget what an optimizer step that did not finish left: its partial gradients and norms."""
        self._grads.clear()
        self._sq_norms.clear()
        self._updating.clear()
        self.updating = False

    def run(self, p: Pass, ops: Sequence[Op]) -> None:
        """Run ``ops``. An allocation failure on the device becomes ``DeviceOutOfMemoryError``, saying in which
        op and whether the optimizer step's update had begun (``updating``)."""
        op = None
        self._passes += 1
        backward = False
        lost = False  # a visit running the step before's update on the GPU: failing, it leaves that part behind
        try:
            for op in ops:
                self.updating |= op.kind in ("update", "commit")
                lost = op.kind == "visit" and op.part in self.pending
                backward |= op.kind == "head"
                compute = op.kind in COMPUTE
                if compute:
                    self.pace((self._passes, backward, op.part or op.kind))
                start = time.perf_counter()
                out = HANDLERS[op.kind](self, p, op)
                end = time.perf_counter()
                if compute:
                    self._ahead[-1][1] = out
                for o in self.observers:
                    o.on_op(op, start, end, out)
            self._seal()
        except Exception as err:
            self._ahead.clear()  # the fences of a step cut short may hold its failure
            # what fills the pinned pool, counted before the pass lets go of its own (offloaded activations)
            census = pinned_census() if op is not None and is_out_of_memory(err) and in_host_pool(err) else None
            p.drop()  # its device buffers, before whatever runs next (a sync's pending updates) needs the room
            if op is None or not is_out_of_memory(err):
                raise
            raise DeviceOutOfMemoryError.of(err, f"{op!r} ({PHASE[op.kind]})", op=repr(op), phase=PHASE[op.kind],
                                            updated=self.updating or lost, census=census) from err
        finally:
            # A step cut short after some first halves were queued still queues their second halves, so
            # masters, moments and stream copies never disagree (and no stale task joins a later step).
            if self.policy.commits_pending:
                self.policy.commit(self.state)

    def pace(self, block: tuple) -> None:
        """Before the host issues ``block``'s first compute, wait until the GPU has run the work of all but
        the newest ``BLOCKS_AHEAD`` blocks before it: what the host dropped for older blocks is then free, as
        the memory plan counts it. The wait is on a fence queued after a block's last compute (one element
        of its output, on each device: in the device's order it runs after the block's work), since
        the outputs themselves may be donated to later programs."""
        if self._ahead and self._ahead[-1][0] == block:
            return
        self._seal()
        while len(self._ahead) > BLOCKS_AHEAD:
            fence = self._ahead.popleft()[1]
            if fence:
                with reported_late():
                    jax.block_until_ready(fence)
        self._ahead.append([block, None, False])

    def _seal(self) -> None:
        """The newest block's work is all queued: keep a fence of it in place of its output."""
        if not self._ahead or self._ahead[-1][2]:
            return
        entry = self._ahead[-1]
        arrays = [a for a in jax.tree.leaves(entry[1]) if isinstance(a, jax.Array) and not a.is_deleted()]
        entry[1] = [self.fns.fence(s.data) for s in arrays[0].addressable_shards] if arrays else []
        entry[2] = True

    # ------------------------------------------------------------------ moving parts
    def fetch(self, p: Pass, op: Op):
        """A part onto the devices (each its shard, over its own PCIe link), then whole on each of them."""
        if op.part in self.resident:
            shards = self.policy.device.weights(self.resident[op.part])  # its copy, or its masters cast now
        else:
            with reported_late():  # waits for the part's update: earlier device work's failure surfaces here
                self.policy.ready(op.part)
            shards = self.placement.to_device(self.state[op.part].streamed())
        p.params[op.part] = self.fns.fetched(shards)  # gathered by the first program that uses it
        return shards

    def bring(self, p: Pass, op: Op):
        """A GPU-updated part's masters and moments on their way to the device for its update: a block's at the
        step's start for its pending update (none pending: nothing), the io part's during the backward of the pass
        whose update it serves (``schedule.step_ops``' ``bring_io``; its visit is the next forward's first op).
        What it brings is the part's record as it stands; only the part's visit (or a restore, ``forget``) changes
        that record, and either lets go of what was brought."""
        if op.part in self.brought or (op.part not in self.pending and not op.part.is_io):
            return None
        self.brought[op.part] = self._copier.submit(self._bring_landed, self.state[op.part])
        return self.brought[op.part]

    def _bring_landed(self, record: Part):
        """On the bring thread: a part's state copied to the device, returned once it is there (the next copy
        starts then)."""
        return jax.block_until_ready(self.policy.device.bring(record))

    def visit(self, p: Pass, op: Op):
        """A GPU-updated part's fetch for the forward: its pending update (the step before's) runs on the device
        from the state ``bring`` sent, and the forward takes the new weights; with none pending, a fetch."""
        if op.part not in self.pending:
            self._drop_brought(op.part)  # no update to run on it (a step cut short before its update)
            return self.fetch(p, op)
        weights = self._update_visiting(op.part)
        p.params[op.part] = self.fns.fetched(weights)
        return weights

    def flush(self) -> None:
        """Run every pending update of GPU-updated parts (``Engine.sync``): their host records are then the
        step's. State brought for no pending update (a step cut short after the io part's bring) is let go."""
        for part in sorted(self.pending, key=lambda q: q.index):
            self._update_visiting(part)
        for part in list(self.brought):
            self._drop_brought(part)

    def _update_visiting(self, part: PartId):
        """A pending update, run once: taken off the list first, so that a failure is raised once (as a host
        update's is), not by every later sync."""
        grads, decision = self.pending.pop(part)
        on_the_way = self.brought.pop(part, None)
        brought = self.policy.device.bring(self.state[part]) if on_the_way is None else on_the_way.result()
        return self.policy.update_visiting(self.state, part, brought, grads, decision)

    def forget(self, part: PartId) -> None:
        """Drop ``part``'s pending update and its state on the way (its record is being replaced: a restore)."""
        self.pending.pop(part, None)
        self._drop_brought(part)

    def _drop_brought(self, part: PartId) -> None:
        """Let go of the state brought for ``part``, once its copy is done or cancelled."""
        on_the_way = self.brought.pop(part, None)
        if on_the_way is not None:
            on_the_way.cancel() or on_the_way.exception()  # waited for: nothing copies the old record afterwards

    def close(self) -> None:
        """Run the pending updates and stop the thread that brings state over; where one fails, the state brought
        for the others is let go (their device buffers with it) before the failure is raised."""
        try:
            self.flush()
        finally:
            self._copier.shutdown(wait=True)
            self.brought.clear()

    def release(self, p: Pass, op: Op):
        del p.params[op.part]

    # ------------------------------------------------------------------ compute
    def embed(self, p: Pass, op: Op):
        b = p.batches[op.micro]
        x, p.params[IO] = self.fns.embed(p.params[IO], b.inputs, b.positions, b.segment_ids)
        p.acts.setdefault(0, []).append(x)
        return x

    def forward(self, p: Pass, op: Op):
        b, layer = p.batches[op.micro], op.part.layer
        products = p.keeps_products(layer)
        keep = (p.keep_residuals or products) and p.keep_inputs
        kind = self.kinds[layer]
        y, p.params[op.part] = self.fns.forward(p.params[op.part], p.acts[layer][op.micro], b.positions,
                                                b.segment_ids, keep=keep, kind=kind, products=products)
        if keep:
            y, kept = y
            p.kept.setdefault(layer, []).append(kept)
        if self.fns.lm.routes(kind):
            y, stats = y
            if p.keep_inputs:  # training: the auxiliary loss is over every routed block of every micro-batch
                p.stats = stats if p.stats is None else self.fns.add(p.stats, stats)
        p.acts.setdefault(layer + 1, []).append(y)
        if not p.keep_inputs and op.micro == len(p.batches) - 1:
            del p.acts[layer]  # evaluation: no backward reads them
        return y

    def head(self, p: Pass, op: Op):
        b = p.batches[op.micro]
        if self.fns.routed and op.micro == 0:  # every forward has run (layer-major): the auxiliary loss
            p.aux, p.d_stats = self.fns.aux(p.stats)
            p.losses.append(p.aux)
        x = p.acts[self.n_blocks][op.micro]
        if self.fns.objective.pairs:
            (loss, stats, dx, p.io_grads), p.params[IO] = self.fns.head_pairs(
                p.params[IO], x, b.targets, b.loss_mask, b.ref_logps, p.inv_pairs, p.io_grads)
            p.pair_stats = stats if p.pair_stats is None else p.pair_stats + stats
        else:
            (loss, dx, p.io_grads), p.params[IO] = self.fns.head(p.params[IO], x, b.targets, b.loss_mask,
                                                                 p.inv_count, p.io_grads)
        p.losses.append(loss)
        p.dy.append(dx)
        if op.micro == len(p.batches) - 1 and not p.keeps_forward:
            del p.acts[self.n_blocks]
        return dx

    def backward(self, p: Pass, op: Op):
        b, layer = p.batches[op.micro], op.part.layer
        last = op.micro == len(p.batches) - 1  # the gradient comes back summed over the devices
        kept = p.kept[layer][op.micro] if layer in p.kept else None
        (p.dy[op.micro], p.grads), p.params[op.part] = self.fns.backward(
            p.params[op.part], p.acts[layer][op.micro], b.positions, b.segment_ids, p.dy[op.micro], p.grads,
            p.d_stats, last=last, kept=kept, kind=self.kinds[layer], products=p.keeps_products(layer))
        if p.keeps_forward:  # all of it again in the second pass's backward; an offloaded block's from host memory
            if last and layer in p.away:
                p.acts[layer], kept_home = p.away.pop(layer)
                if kept_home is not None:
                    p.kept[layer] = kept_home
            return p.dy[op.micro]
        if kept is not None:
            p.kept[layer][op.micro] = None  # used once
            if last:
                del p.kept[layer]
        if layer > 0 and last:
            del p.acts[layer]  # block 0's inputs are the embeddings, still needed by embed_backward
        return p.dy[op.micro]

    def store_acts(self, p: Pass, op: Op):
        """A block's inputs and kept residuals (every micro-batch's) to pinned host memory until its
        backward: the device copies are freed once the copy has read them. The host waits for the copies
        of the block ``STORES_AHEAD`` before: it may otherwise run so far ahead of the GPU that the
        activations of many blocks wait on the GPU for their copies at once."""
        layer = op.part.layer
        p.acts[layer] = [self.placement.to_host(x) for x in p.acts[layer]]
        if layer in p.kept:
            p.kept[layer] = [self.placement.to_host(k) for k in p.kept[layer]]
        p.stores.append((p.acts[layer], p.kept.get(layer)))
        if len(p.stores) > STORES_AHEAD:
            with reported_late():
                jax.block_until_ready(p.stores.pop(0))
        return [*p.acts[layer], *p.kept.get(layer, [])]

    def load_acts(self, p: Pass, op: Op):
        """An offloaded block's inputs and kept residuals back onto the devices, ahead of its backward."""
        layer = op.part.layer
        p.stores = [s for s in p.stores if s[0] is not p.acts[layer]]  # its host copies go with it
        if p.keeps_forward:  # unless the second pass needs them again
            p.away[layer] = (p.acts[layer], p.kept.get(layer))
        p.acts[layer] = [self.placement.to_device(x) for x in p.acts[layer]]
        if layer in p.kept:
            p.kept[layer] = [self.placement.to_device(k) for k in p.kept[layer]]
        return [*p.acts[layer], *p.kept.get(layer, [])]

    def embed_backward(self, p: Pass, op: Op):
        b = p.batches[op.micro]
        last = op.micro == len(p.batches) - 1
        p.io_grads, p.params[IO] = self.fns.embed_backward(p.params[IO], b.inputs, b.positions, b.segment_ids,
                                                           p.dy[op.micro], p.io_grads, last=last)
        if last:
            if not p.keeps_forward:
                p.acts.clear()
                p.kept.clear()
            p.dy = []
        return p.io_grads

    def loss(self, p: Pass, op: Op):
        """Evaluation: the summed masked NLL of one micro-batch (``per_row``: of each of its rows)."""
        b = p.batches[op.micro]
        nll = self.fns.row_nll if p.per_row else self.fns.nll_sum
        out, p.params[IO] = nll(p.params[IO], p.acts[self.n_blocks][op.micro], b.targets, b.loss_mask)
        p.losses.append(out)
        return out

    # ------------------------------------------------------------------ gradients and updates
    def send_grads(self, p: Pass, op: Op):
        """A part's gradient to host memory (GPU-resident parts keep it on the device), summed with earlier
        sub-steps' when accumulating; its squared norm once the optimizer step's gradient is complete. The
        last backward program has summed it over the devices: each device holds its shard. The parts of
        ``grads_on_gpu`` keep it on the device too, until their update copies it home. With
        ``host_grad_dtype="bfloat16"`` a gradient sent home is rounded to bfloat16 on the device, and its norm
        is the rounded gradient's: the clipping is exact over what the update reads. With
        ``device_grad_dtype="bfloat16"`` so is the gradient of a part updated on the device, once the step's
        sum is complete (the earlier sub-steps' sum stays float32)."""
        part = op.part
        # the gradient stays on the device: a resident part's, and one whose update waits there or runs there
        resident = part in self.resident or part in self.grads_on_gpu or part in self.gpu_updated
        grads = p.take_grads(part)
        if p.accumulate:
            earlier = self._grads[part]
            grads = self.fns.add(grads, earlier if resident else self.placement.to_device(earlier))
        if self._rounds(part) and (p.last or not resident):
            grads = self.fns.to_bfloat16(grads)
        if p.last and not p.norm_known:
            self._sq_norms[part] = self.fns.sq_norm(grads)
        self._grads[part] = grads if resident else self.placement.to_host(grads)
        return self._grads[part]

    def _rounds(self, part: PartId) -> bool:
        """Whether ``part``'s gradient is rounded to bfloat16 before its update: one sent home, by
        ``host_grad_dtype``; one updated on the device (resident, or at its visit), by ``device_grad_dtype``;
        one that waits on the device for a host update (``grads_on_gpu``) stays float32."""
        if part in self.resident or part in self.gpu_updated:
            return self.bfloat16_device
        return self.bfloat16_home and part not in self.grads_on_gpu

    def norm(self, p: Pass, op: Op):
        """A ``norm_first`` step's first pass: the part's gradient (summed over the devices, each its shard)
        reduced to its squared norm on the device, then dropped: none goes home. A gradient that the second
        pass rounds to bfloat16 (``send_grads``) is rounded first, so that the norm is that of what the
        update reads, as in one pass."""
        grads = p.take_grads(op.part)
        if self._rounds(op.part):
            grads = self.fns.to_bfloat16(grads)
        self._sq_norms[op.part] = self.fns.sq_norm(grads)
        return self._sq_norms[op.part]

    def grad_norm(self, p: Pass, op: Op):
        norms = [self._sq_norms.pop(part) for part in self.state.ids()]
        p.decision = self.decision = self.policy.decide(norms, sum(p.losses))
        return p.decision.scale

    def update(self, p: Pass, op: Op):
        """A part's update. In a ``norm_first`` step's second pass it follows the part's gradient home, and
        the host then waits for the update queued ``UPDATES_AHEAD`` host parts before: host memory holds
        at most that many more parts' gradients than the one just sent."""
        grads = self._grads.pop(op.part)
        if op.part in self.gpu_updated:  # runs at the part's next visit, on the device
            self.pending[op.part] = (grads, p.decision)
            return grads
        if op.part in self.resident:
            self.resident[op.part] = self.policy.update_device(self.resident[op.part], grads, p.decision)
            return self.resident[op.part]
        done = self.policy.update_host(self.state, op.part, grads, p.decision,
                                       on_device=op.part in self.grads_on_gpu)
        if p.norm_known:
            self._updating.append(op.part)
            if len(self._updating) > UPDATES_AHEAD:
                with reported_late():
                    self.policy.ready(self._updating.popleft())
        return done

    def commit(self, p: Pass, op: Op):
        return self.policy.commit(self.state)


# Every op kind and its handler: a new kind of op is added here and in ``schedule.OpKind``.
HANDLERS: dict[OpKind, Callable[[PassRunner, Pass, Op], Any]] = {
    "fetch": PassRunner.fetch, "release": PassRunner.release, "embed": PassRunner.embed,
    "forward": PassRunner.forward, "head": PassRunner.head, "backward": PassRunner.backward,
    "send_grads": PassRunner.send_grads, "embed_backward": PassRunner.embed_backward,
    "grad_norm": PassRunner.grad_norm, "update": PassRunner.update, "commit": PassRunner.commit,
    "loss": PassRunner.loss, "store_acts": PassRunner.store_acts, "load_acts": PassRunner.load_acts,
    "norm": PassRunner.norm, "bring": PassRunner.bring, "visit": PassRunner.visit,
}

# The op kinds that run a block's (or the io part's) compute: the host paces these (``PassRunner.pace``).
COMPUTE = frozenset({"embed", "forward", "head", "backward", "embed_backward", "loss"})

# What each op kind is, for time breakdowns and timelines.
CATEGORY: dict[OpKind, str] = {
    "fetch": "h2d", "release": "none", "embed": "compute", "forward": "compute", "head": "compute",
    "backward": "compute", "send_grads": "d2h", "embed_backward": "compute", "grad_norm": "compute",
    "update": "optimizer", "commit": "optimizer", "loss": "compute", "store_acts": "d2h", "load_acts": "h2d",
    "norm": "compute", "bring": "h2d", "visit": "compute",
}


def device_batches(placement: Placement, batch: Batch, n_micro: int) -> list[Batch]:
    """This process's rows of ``batch``, as ``n_micro`` micro-batches spread by row over the devices."""
    return [placement.rows_to_device(m) for m in batch.split(n_micro)]


def block_until_done(out: Any) -> None:
    """Wait for what a handler returned: device arrays, or futures (of host-worker tasks, or of a ``bring``, done
    once its copies have landed)."""
    futures = out if isinstance(out, list) else [out]
    if futures and all(hasattr(f, "result") for f in futures):
        for f in futures:
            f.result()
    elif out is not None:
        jax.block_until_ready(out)
