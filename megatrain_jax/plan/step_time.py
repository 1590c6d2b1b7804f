"""How long a step takes: the step-time model. It walks the engine's own op list (``engine.schedule.step_passes``)
over four queues that run at once, each in the order the engine issues to it, with each op's length from the
machine's rates (``speeds.Speeds``):

- the **main thread** issues every op in list order; it waits where the engine waits: a block's fetch for that
  block's host update of the previous step (``UpdatePolicy.ready``), a block's compute for the GPU to be
  within ``BLOCKS_AHEAD`` blocks of it (``passes.PassRunner.pace``), the global norm for the backward's end,
  and in a ``norm_first`` step's second pass each update for the one queued ``UPDATES_AHEAD`` parts before;
- the **GPU** runs compute (forward, backward with or without recompute, head, embedding) and the updates of
  GPU-resident parts;
- the **copy engines**, host to GPU (weights, offloaded activations back) and GPU to host (gradients,
  offloaded activations out), one transfer at a time each, each at its direction's rate; where the link carries
  less both ways at once than twice one way (``Speeds.link_bytes``: the H200's 60 GB/s against 54 each way), a
  transfer also takes the link's time at that rate, in the first gap the link leaves it from when it can start
  (the ``link`` lane), so a fetch issued while copies home are under way waits for them. A copy into new GPU
  memory (a fetch, a GPU-updated part's state brought over, offloaded activations loaded back) starts no
  earlier than the end of the GPU work issued before it: XLA's GPU allocator hands out memory synchronized with
  the compute stream, so with ``prefetch_depth`` 1 a block's copy waits for the forward before it;
- the **host worker** runs each host part's AdamW (split in two halves where the update splits: the stream
  copy first, in forward order, then masters and moments, last part first: ``engine.update.policy``).

A few steps run back to back; the step time is the steady-state gap between two steps' ends. ``predict``
returns it with what bounds it (the busiest queue) and each queue's busy seconds. The model has no notion of
memory: the plan says what fits, this says how fast it runs. One GPU per process (several GPUs: each GPU's
share of the bytes and the work; the host is shared, so its update rate is split among them).
"""

from __future__ import annotations

import dataclasses
import os
from megatrain_jax.batch import RowMix
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import IO, PartId
from megatrain_jax.engine.precision import DTYPE_BYTES, FULL, Precision
from megatrain_jax.engine.schedule import BLOCKS_AHEAD, UPDATES_AHEAD, offloaded_blocks, step_passes
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.plan.activations import assumes_flash, kept_bytes
from megatrain_jax.plan.counts import activation_bytes, host_roles, io_param_count, stream_bytes
from megatrain_jax.plan.machine import Machine
from megatrain_jax.plan.speeds import SPEEDS, SPEEDS_VAR, Speeds, for_gpu, kind_of

QUEUES = ("main", "gpu", "h2d", "d2h", "link", "host")
_STEPS = 4  # simulated back to back; the last gap is the steady state (the first steps start from idle)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A predicted step: ``seconds``, the busiest queue (``bound``), each queue's busy seconds per step, the
    bytes each way over PCIe per step (one GPU's), the share of the parameters that stay on the GPU (resident
    parts), the rates it was predicted with (``speeds.name``), the host update timed on the host at hand that
    they were scaled to (``Speeds.host_measured``; None: not timed) and what the rows hold as it was counted
    (``mix``: packed rows' span, the share no loss reaches; None: whole rows, every token in the loss)."""

    seconds: float
    bound: str
    busy: dict[str, float]
    h2d_bytes: int
    d2h_bytes: int
    resident_share: float
    speeds: str
    host_measured: dict[str, float] | None = None
    mix: RowMix | None = None  # the rows as predict counted them (None: whole rows, all in the loss)

    def as_dict(self) -> dict:
        """For a results file or ``memory_plan.json``: seconds and shares to 4 decimals; the host's timed rates
        where there are any, so that the prediction can be made again (``experiments/step_time_vs_runs.py``)."""
        out = {"seconds": round(self.seconds, 4), "bound": self.bound,
               "busy": {q: round(v, 4) for q, v in self.busy.items()}, "h2d_bytes": self.h2d_bytes,
               "d2h_bytes": self.d2h_bytes, "resident_share": round(self.resident_share, 4), "speeds": self.speeds}
        if self.host_measured is not None:
            out["host_measured"] = {k: float(f"{v:.4g}") for k, v in self.host_measured.items()}
        if self.mix is not None and self.mix.attention_span is not None:
            out["attention_span"] = round(self.mix.attention_span, 1)
        if self.mix is not None and self.mix.no_gradient:
            out["no_gradient"] = round(self.mix.no_gradient, 4)
        return out

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / self.seconds

    def describe(self) -> str:
        parts = ", ".join(f"{QUEUE_WORDS[q]} {s:.2f} s" for q, s in self.busy.items() if s > 0 and q != "main")
        mix = self.mix or RowMix()
        docs = ("" if mix.attention_span is None else
                f"; packed rows' attention within their runs, {mix.attention_span:,.0f} keys a token") + (
            f"; {mix.no_gradient:.0%} of the rows' tokens reached by no loss" if mix.no_gradient else "")
        return (f"{self.seconds:.2f} s per step, bound by {BOUND_WORDS[self.bound]} (busy per step: {parts}; "
                f"PCIe {self.h2d_bytes / 1e9:.1f} GB to the GPU and {self.d2h_bytes / 1e9:.1f} GB back; "
                f"{self.resident_share:.0%} of the parameters stay on the GPU{docs}; rates: {self.speeds})")


QUEUE_WORDS = {"gpu": "GPU", "h2d": "to the GPU", "d2h": "to the host", "host": "host update",
               "memory": "host memory", "link": "PCIe both ways", "main": "issuing"}
BOUND_WORDS = {"gpu": "GPU compute", "h2d": "PCIe to the GPU", "d2h": "PCIe to the host",
               "host": "the host update", "memory": "the host's memory (the host update and the transfers)",
               "link": "PCIe, both directions together",
               "main": "the Python thread issuing ops"}


# ---------------------------------------------------------------------------------------------- op lengths
@dataclasses.dataclass(frozen=True)
class _Lengths:
    """Each op's length for one run (``predict``'s inputs made numbers): compute and updates in seconds,
    transfers in bytes (each queue's rate makes them seconds)."""

    forward: dict[int, float]  # per block, one micro-batch
    backward: dict[int, float]  # per block, one micro-batch (with or without recompute)
    head: float  # one micro-batch: final norm, logits, loss and their backward (the logits made once)
    embed: float
    fetch: dict[PartId, float]  # bytes to the GPU per fetch (0 for GPU-resident parts)
    visit: dict[PartId, tuple[float, float]]  # a GPU-updated part's state: bytes to the GPU, and home with its copy
    cast: dict[PartId, float]  # a GPU-resident part's compute copy cast from its masters at each fetch (seconds)
    grads: dict[PartId, float]  # bytes of the part's gradient sent home at its send_grads (0 where it stays)
    home: dict[PartId, float]  # bytes of a gradient that waited on the GPU, copied home by its update
    acts: float  # bytes of one block's offloaded inputs (and kept residuals), each way
    host_update: dict[PartId, tuple[float, float]]  # (first half, second half); (whole, 0) where it does not split
    device_update: dict[PartId, float]  # GPU-resident parts' update on the GPU
    host_bytes: float  # bytes the host updates read and write in host memory in one step
    host_memory: float  # the host memory's bytes per second as the update moves them (one GPU's share)
    norm: dict[PartId, float]  # a norm_first step's first pass: the part's gradient reduced to its squared norm
    dispatch: dict[str, float]  # the main thread's own seconds per op kind
    mix: RowMix | None  # the rows as counted: packed rows' span where cuDNN runs it, the share no loss reaches


def _block_flops(cfg: DecoderConfig, layer: int, tokens: int, seq_len: int,
                 attention_span: float | None = None) -> tuple[float, float]:
    """(matrix-product FLOPs, attention FLOPs) of one block's forward over ``tokens`` tokens in rows of
    ``seq_len``: 2 per active weight per token; causal attention 2 x (query width) x (keys seen) per token,
    a sliding window seeing at most its width. ``attention_span``: packed rows' causal runs (documents, and each
    row's padding as one run more) as their tokens see them, sum(n**2) / tokens (``RowMix.attention_span``):
    cuDNN's packed layout runs attention within each run (``layers.packed_attention``); None: each row one run of
    ``seq_len``. A sliding window is counted against the mean span, not run by run (over where runs of mixed
    lengths straddle it)."""
    weights = cfg.block_active_param_count(layer)
    width = cfg.heads * cfg.dim_per_head
    w = cfg.sliding_window if cfg.layer_type(layer) != "full_attention" else None
    span = seq_len if attention_span is None else min(float(attention_span), seq_len)
    # keys a sequence's queries see, summed and doubled (causal: span**2 / 2 pairs); a window of w: w*L - w**2/2
    keys = span if w is None or w >= span else 2 * w - w * w / span
    return 2.0 * weights * tokens, 2.0 * width * keys * tokens


def lengths(cfg: DecoderConfig, e: EngineConfig, batch_rows: int, seq_len: int, s: Speeds,
            stream_dtype: str | None = None, devices: int = 1, mix: RowMix | None = None) -> _Lengths:
    """Each op's seconds for ``cfg`` under ``e`` with ``batch_rows`` rows per step on ``devices`` GPUs (one
    GPU's share) at rates ``s``; ``mix``: what the rows hold (None: whole rows, every token in the loss). Packed
    rows' attention is counted over their runs (``_block_flops``) where cuDNN's packed layout runs them
    (``Speeds.packed_flash`` and a model it takes: ``activations.assumes_flash``), else over whole rows (XLA's
    masked attention); the blocks' backward is shortened by the share no loss reaches
    (``Speeds.no_gradient_backward``)."""
    rows = batch_rows // devices
    mix = mix or RowMix()
    if mix.attention_span is not None and not (s.packed_flash and assumes_flash(cfg)):
        mix = dataclasses.replace(mix, attention_span=None)
    if not s.no_gradient_backward:  # not measured on this GPU: not counted
        mix = dataclasses.replace(mix, no_gradient=0.0)
    attention_span = None if mix.attention_span is None else min(float(mix.attention_span), seq_len)
    # a block's backward over gradients that are zeros where no loss reaches runs faster
    # (``Speeds.no_gradient_backward``)
    zeros = 1.0 - s.no_gradient_backward * mix.no_gradient
    tokens = rows * seq_len // e.micro_batches  # one micro-batch on one GPU
    mode = e.precision
    stream = stream_dtype or e.stream_dtype or cfg.dtype
    to_gpu = stream_bytes(mode.to_gpu_dtype(stream, cfg.dtype))
    roles = host_roles(cfg, e)
    host_parts, waiting, visiting = set(roles.host_updated), set(roles.grads_on_gpu), set(roles.gpu_updated)
    splitting = set() if e.norm_first else set(roles.splitting(e.split_parts))  # norm_first never splits
    kept = set(range(cfg.layers - e.kept_layers, cfg.layers))
    fwd, bwd = {}, {}
    for i in range(cfg.layers):
        mm, attn = _block_flops(cfg, i, tokens, seq_len, attention_span)
        f = mm / s.matmul_flops + attn / s.attention_flops
        fwd[i] = f
        # backward: twice the forward's products, attention's backward; then what is recomputed
        b = 2 * mm / s.matmul_flops + s.attention_backward * attn / s.attention_flops
        if i in kept:
            b *= s.kept_backward
        else:
            b += mm / s.matmul_flops + (0.0 if e.keep_residuals else attn / s.attention_flops)
        bwd[i] = b * zeros
    # the head: the logits, and the hidden states' and the weight's gradients, taken together in the loss's
    # forward (loss.chunked_nll_sum): 3 products. A pair objective's (DPO) recomputes the logits, a 4th, which
    # the model leaves out: ~1.6% of an 8B step at 128K words, the predicted step that much short
    head = 6.0 * cfg.hidden * cfg.vocab_size * tokens / s.matmul_flops
    parts = [IO] + [PartId.block(i) for i in range(cfg.layers)]
    count = {p: (io_param_count(cfg) if p.is_io else cfg.block_param_count(p.layer)) / devices for p in parts}
    streamed = host_parts | visiting
    fetch = {p: (count[p] * to_gpu if p in streamed else 0.0) for p in parts}
    state = mode.master_bytes + mode.moment_bytes
    visit = {p: (count[p] * state, count[p] * (state + (to_gpu if to_gpu != mode.master_bytes else 0)))
             for p in visiting}
    # a resident part's masters read and its compute copy written at each fetch, where it keeps none
    copy = to_gpu != mode.master_bytes and not e.keeps_resident_copy
    cast = {p: (count[p] * (mode.master_bytes + to_gpu) / s.hbm_bytes if p not in streamed and copy else 0.0)
            for p in parts}
    grads = {p: (count[p] * DTYPE_BYTES[e.host_grad_dtype] if p in host_parts - waiting else 0.0) for p in parts}
    home = {p: count[p] * 4.0 for p in waiting}  # float32, copied home by the part's update task
    disk = set(roles.disk)
    host_update, host_bytes = {}, 0.0
    for p in parts:
        if p in host_parts:
            # split where the engine splits: fused kernel, 16-bit stream copy, gradient home, moments in memory;
            # where it could but split_parts leaves it whole, one pass at its own rate
            can_split = mode.stream_copy and e.host_kernel and p not in waiting and p not in disk
            split = can_split and p in splitting
            rate = s.host_update_rate(mode.name, one_pass=can_split and not split) / devices  # a shared host
            # the rates are the mode's with its default gradients: a bfloat16 one read instead moves fewer bytes
            rate *= _update_bytes(mode) / _update_bytes(mode, None if p in waiting else e.host_grad_dtype)
            whole = count[p] / rate + s.disk_seconds(p in disk, count[p] * devices, mode.moment_bytes)
            per = mode.bytes_per_param(None if p in waiting else e.host_grad_dtype)
            host_bytes += count[p] * (_update_bytes(mode, None if p in waiting else e.host_grad_dtype) + (
                per["masters"] + per["moments"] + per["host_grads"] if split else 0))  # a split reads them twice
            host_update[p] = (whole * s.first_half_share, whole * (1 - s.first_half_share)) if split else (whole, 0.0)
    device_update = {p: count[p] * s.device_update_bytes_per_param / s.hbm_bytes for p in parts if p not in host_parts}
    micro_rows = rows // e.micro_batches
    acts = e.micro_batches * (micro_rows * seq_len * cfg.hidden * activation_bytes(cfg) + (
        kept_bytes(cfg, e, micro_rows, seq_len, assumes_flash(cfg)) if e.keep_residuals else 0))
    norm = {p: count[p] * 4.0 / s.hbm_bytes for p in parts}  # one read of the float32 gradient
    # the memory's rate: full precision's split update moves 46 bytes a parameter at its measured rate
    full = FULL.bytes_per_param()
    memory = s.host_update_rate(FULL.name) / devices * (_update_bytes(FULL) + full["masters"] + full["moments"]
                                                        + full["host_grads"])
    return _Lengths(fwd, bwd, head, 2 * cfg.hidden * tokens / s.hbm_bytes, fetch, visit, cast, grads, home, acts,
                    host_update, device_update, host_bytes, memory, norm, s.dispatch,
                    None if mix == RowMix() else dataclasses.replace(mix, attention_span=attention_span))


def _update_bytes(mode: Precision, grads: str | None = None) -> float:
    """Host bytes one parameter's whole update reads and writes in ``mode`` with gradients in ``grads`` (the
    mode's default): masters, moments and the gradient read; masters, moments and a stream copy written."""
    per = mode.bytes_per_param(grads)
    return 2 * (per["masters"] + per["moments"]) + per["host_grads"] + per["stream_copy"]


# ---------------------------------------------------------------------------------------------- the walk
def predict(cfg: DecoderConfig, e: EngineConfig, batch_rows: int, seq_len: int, s: Speeds,
            stream_dtype: str | None = None, devices: int = 1, mix: RowMix | None = None) -> StepTime:
    """The steady-state seconds of one optimizer step of ``cfg`` under ``e`` (``resident_layers`` a number)
    with ``batch_rows`` rows of ``seq_len`` tokens, on ``devices`` GPUs of a machine with rates ``s``.
    ``mix``: what the rows hold (``RowMix``: packed rows' span, which attention runs within where cuDNN's packed
    layout runs, and the share of tokens no loss reaches; ``lengths``); None: each row is one sequence, every
    token in the loss."""
    if not isinstance(e.resident_layers, int) or not isinstance(e.kept_layers, int):
        raise ValueError("predict needs resident_layers and kept_layers as numbers: resolve 'auto' first "
                         "(plan.resolve)")
    n = lengths(cfg, e, batch_rows, seq_len, s, stream_dtype, devices, mix)
    free = dict.fromkeys(QUEUES, 0.0)
    busy = dict.fromkeys(QUEUES, 0.0)
    ready_host: dict[PartId, float] = {}  # when a part's weights are written for the next forward (first half)
    ends: list[float] = []
    h2d = d2h = 0.0
    offload = offloaded_blocks(cfg.layers, e.prefetch_depth, e.offload_activations)
    roles = host_roles(cfg, e)
    host_parts = set(roles.host_updated)
    streamed = host_parts | set(roles.gpu_updated)

    rates = {"h2d": s.h2d_bytes, "d2h": s.d2h_bytes}
    link: list[tuple[float, float]] = []  # the link's busy intervals, in time order (``Speeds.link_bytes``)

    def move(queue: str, start: float, nbytes: float) -> float:
        nonlocal h2d, d2h
        if queue == "h2d":
            h2d += nbytes
        else:
            d2h += nbytes
        if not s.link_bytes:
            return run(queue, start, nbytes / rates[queue])
        # a link shared by both directions: a copy takes its bytes at its own direction's rate, in the first time
        # from when it can start that the link has free for them at the link's rate (a copy still waiting for the
        # work it copies holds nothing: a later one may go first)
        begin = _place(link, max(start, free[queue]), nbytes / s.link_bytes)
        busy["link"] += nbytes / s.link_bytes
        return run(queue, begin, nbytes / rates[queue])

    def to_gpu(start: float, nbytes: float) -> float:
        # a copy into new GPU memory: XLA's allocator hands it out once the GPU work issued before it has run
        return move("h2d", max(start, free["gpu"]), nbytes)

    def run(queue: str, start: float, seconds: float) -> float:
        begin = max(start, free[queue])
        free[queue] = begin + seconds
        busy[queue] += seconds
        return free[queue]

    brought: dict[PartId, float] = {}  # when a GPU-updated part's state is on the GPU (io's: brought the step before)
    for _ in range(_STEPS):
        fetched: dict[PartId, float] = {}
        computed: dict[PartId, float] = {}
        visits: list[float] = []  # when each block visit's compute ends (pacing)
        step_busy, bytes_before = dict(busy), (h2d, d2h)
        sent: dict[PartId, float] = {}  # when each part's gradient is home (norm_first: its update waits)
        updating: list[PartId] = []  # norm_first: host parts whose updates were queued, oldest first
        for j, sub in enumerate(step_passes(cfg.layers, e, host_roles(cfg, e))):  # the step's passes
            accumulating = j > 0 and not e.norm_first
            for op in sub:
                t = free["main"] + n.dispatch.get(op.kind, 0.0)
                busy["main"] += n.dispatch.get(op.kind, 0.0)
                if op.kind == "fetch":
                    t = max(t, ready_host.get(op.part, 0.0))  # the engine waits for the part's new weights
                    fetched[op.part] = to_gpu(t, n.fetch[op.part])
                    if n.cast[op.part]:  # a resident part's compute copy, queued after its update
                        fetched[op.part] = run("gpu", t, n.cast[op.part])
                elif op.kind == "bring":  # a GPU-updated part's state over (a block's at the step's start, io's
                    brought[op.part] = to_gpu(t, n.visit[op.part][0])  # in the backward before)
                elif op.kind == "visit":  # the engine waits for the state to land (brought over now where it was
                    # not: the first step), runs the update on the GPU, then sends the state home
                    t = max(t, brought.pop(op.part) if op.part in brought else to_gpu(t, n.visit[op.part][0]))
                    fetched[op.part] = run("gpu", t, n.device_update[op.part])
                    ready_host[op.part] = move("d2h", fetched[op.part], n.visit[op.part][1])
                elif op.kind == "load_acts":
                    fetched[op.part] = max(fetched[op.part], to_gpu(t, n.acts))
                elif op.kind in ("forward", "backward"):
                    if op.micro == 0 and len(visits) >= BLOCKS_AHEAD:
                        t = max(t, visits[-BLOCKS_AHEAD])
                    seconds = (n.forward if op.kind == "forward" else n.backward)[op.part.layer]
                    end = run("gpu", max(t, fetched.get(op.part, 0.0)), seconds)
                    computed[op.part] = end
                    if op.micro == e.micro_batches - 1:
                        visits.append(end)
                elif op.kind in ("embed", "embed_backward"):
                    run("gpu", max(t, fetched.get(IO, 0.0)), n.embed)
                elif op.kind == "head":
                    computed[IO] = run("gpu", max(t, fetched.get(IO, 0.0)), n.head)
                elif op.kind == "store_acts":
                    move("d2h", max(t, computed[op.part]), n.acts)
                elif op.kind == "send_grads":
                    start = max(t, free["gpu"] if op.part.is_io else computed[op.part])
                    if accumulating and n.grads[op.part]:  # the earlier sum comes back to be added
                        start = move("h2d", start, n.grads[op.part])
                    sent[op.part] = move("d2h", start, n.grads[op.part])
                elif op.kind == "norm":
                    run("gpu", max(t, free["gpu"] if op.part.is_io else computed[op.part]), n.norm[op.part])
                elif op.kind == "grad_norm":  # the main thread reads the norm: the backward and its sends done
                    t = max(t, free["gpu"], free["d2h"])
                elif op.kind == "update":
                    if op.part in host_parts:
                        start = t
                        if op.part in n.home:  # the task copies the waiting gradient home, then updates
                            start = move("d2h", max(t, free["host"]), n.home[op.part])
                        ready_host[op.part] = run("host", max(start, sent.get(op.part, 0.0)),
                                                  n.host_update[op.part][0])
                        if e.norm_first:  # the main thread waits for the update queued UPDATES_AHEAD before
                            updating.append(op.part)
                            if len(updating) > UPDATES_AHEAD:
                                t = max(t, ready_host[updating.pop(0)])
                    elif op.part not in n.visit:  # a GPU-updated part's update runs at its next visit
                        run("gpu", t, n.device_update[op.part])
                elif op.kind == "commit":  # the second halves, last part first
                    for part in reversed([p for p in roles.host_updated if n.host_update[p][1]]):
                        run("host", t, n.host_update[part][1])
                free["main"] = t
        ends.append(max(free["gpu"], free["main"]))
        last_busy = {q: busy[q] - step_busy[q] for q in QUEUES}
        step_bytes = {"h2d": h2d - bytes_before[0], "d2h": d2h - bytes_before[1]}
    seconds = ends[-1] - ends[-2]
    per_step = dict(last_busy)
    # the host's memory serves the host updates and both copy engines' transfers at once: a step moves no
    # faster than their bytes at its rate
    per_step["memory"] = (n.host_bytes + step_bytes["h2d"] + step_bytes["d2h"]) / n.host_memory
    seconds = max(seconds, per_step["memory"])
    bound = max(("gpu", "h2d", "d2h", "host", "memory", "link", "main"), key=lambda q: per_step[q])
    resident = 1 - sum(cfg.block_param_count(p.layer) if not p.is_io else io_param_count(cfg)
                       for p in streamed) / cfg.param_count()
    return StepTime(seconds, bound, per_step, round(step_bytes["h2d"]), round(step_bytes["d2h"]), resident, s.name,
                    s.host_measured, n.mix)


def _place(busy: list[tuple[float, float]], start: float, seconds: float) -> float:
    """The first time from ``start`` at which ``busy`` (intervals in time order, not overlapping) leaves
    ``seconds`` free; the interval is added to it."""
    t, at = start, len(busy)
    for i, (a, b) in enumerate(busy):
        if b <= t:
            continue
        if a >= t + seconds:
            at = i
            break
        t = b
    busy.insert(at, (t, t + seconds))
    return t


def machine_speeds(machine: Machine, speeds_file: str | None = None) -> Speeds | None:
    """The rates for ``machine``: its GPU kind's, on its host's cores, with its host update as measured there
    (``Machine.host_measured``) or a calibration file's fields on top (``speeds_file``, else
    ``$MEGATRAIN_SPEEDS``; ``speeds.for_gpu``); None where neither a known GPU nor a file gives them."""
    if machine.gpu_name is None and not (speeds_file or os.environ.get(SPEEDS_VAR)):
        return None
    return for_gpu(machine.gpu_name, speeds_file, machine.host_cores, machine.host_measured)


def for_machine(cfg: DecoderConfig, e: EngineConfig, batch_rows: int, seq_len: int, machine: Machine,
                speeds_file: str | None = None, stream_dtype: str | None = None,
                mix: RowMix | None = None) -> StepTime | None:
    """``predict`` on ``machine`` at ``machine_speeds``; None where there are no rates for it."""
    s = machine_speeds(machine, speeds_file)
    return None if s is None else predict(cfg, e, batch_rows, seq_len, s, stream_dtype, machine.gpus, mix)


# Under this share of its kind's record, the host's timed rate is reported: the H200's 16-core hosts timed full
# precision at 2.99-3.73 G params/s on quiet loans, 1.61-2.59 on one whose host ran other work in bursts
# (experiments/studies/NOTES.md, 2026-12-01)
SLOW_HOST = 0.7


def step_line(p: StepTime | None, tokens_per_step: int, machine: Machine) -> str:
    """The sentence ``train`` and ``plan`` print: the predicted step time and tokens/s (``p``, what
    ``for_machine`` gave; ``tokens_per_step``: an optimizer step's, every accumulated batch's), or why there is
    none."""
    if p is None:
        why = "no GPU" if machine.gpu_name is None else f"no rates for a {machine.gpu_name}"
        return (f"  predicted step: none ({why}; megatrain-jax plan --gpu H200 or --speeds FILE predicts for a "
                f"GPU: docs/performance.md)")
    line = f"  predicted step: {p.tokens_per_s(tokens_per_step):,.0f} tokens/s, {p.describe()}"
    usual = slow_host(machine.gpu_name, machine.host_cores, p.host_measured)
    if usual is not None:
        line += (f"\n  note: the host update timed at {p.host_measured['full'] / 1e9:.2f} G params/s here, under "
                 f"{SLOW_HOST:.0%} of the {usual / 1e9:.2f} measured on a host of this kind: something else may be "
                 f"using this host's cores or memory (the prediction takes the rate timed; a step the host bounds "
                 f"runs at the host's pace)")
    return line


def slow_host(gpu_name: str | None, cores: int | None, timed: dict[str, float] | None) -> float | None:
    """The full-precision rate a host of this GPU kind timed itself at with nothing else on it
    (``Speeds.measured_full_rate``, the measured host nearest in cores) where ``timed`` (the host update timed here,
    ``Machine.host_measured``) is under ``SLOW_HOST`` of it; None where it is not, where nothing was timed, or
    where the kind's record is not from runs."""
    kind = kind_of(gpu_name)
    usual = None if kind is None or not timed or "full" not in timed else SPEEDS[kind].measured_full_rate(cores)
    return usual if usual is not None and timed["full"] < SLOW_HOST * usual else None
