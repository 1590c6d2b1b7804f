"""How much host and GPU memory a run needs, before anything is allocated.

**GPU.** The plan walks the engine's own schedule (``schedule.step_ops``, the ops ``passes.py`` runs),
with a ledger of the device buffers each op creates and frees: the GPU-resident parts (fp32 master, Adam
moments, compute copy), streamed weights between ``fetch`` and ``release``, the boundary activation of
every layer and micro-batch until its backward, d(loss)/d(hidden) per micro-batch, the float32 gradient
accumulator of the part in backward, and the gradients of GPU-resident parts until their update. Two
effects come on top of what the host program holds:

- *run-ahead*: JAX dispatches asynchronously, so a buffer the host has dropped stays allocated until the
  GPU has run the work queued on it: streamed weights after ``release``, gradients whose copy to host
  memory is queued, offloaded activations whose copy is queued. XLA's GPU client would admit 32
  computations ahead of the GPU (``max_inflight_computations``), but the host does not get that far:
  measured on the H100 box (experiments/host_lead.py, op_memory.py) it ran 10-17 ops ahead, with 2-6
  released blocks' buffers still in use. The plan counts what the host dropped for its newest
  ``QUEUED_BLOCKS`` blocks (a block: one part in one pass's forward or backward) as still allocated
  (experiments/plan_queue_sensitivity.py has the error against every measured run for other depths);
- *transients*: the scratch memory of the compiled function that is running (block forward, recompute +
  VJP, head, the embedding's VJP). These are rules of thumb (``_transient``), each written from the
  tensors that function keeps and compared with XLA's compiled memory analysis.

The GPU total is the ledger's peak over one optimizer step, plus the running op's transient.

**Host.** Every persistent array lives in host memory (docs/design.md): float32 masters, Adam's moments
and the 16-bit stream copy of *every* part (GPU-resident ones too: host memory is the source of truth),
and the float32 gradients of the host-updated parts. What crosses PCIe is pinned: the gradients, the
stream copy (or the masters, when they are streamed). With the fused AdamW the moments, and the masters of
parts that stream a 16-bit copy, are pageable (only the kernel touches them); another optimizer keeps all
of it pinned. XLA serves pinned memory from a pool whose regions double in size (2 MiB, 4 MiB, ...) up to
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, which ``megatrain-jax train`` fits to the pinned arrays
(``fitted_pool_limit``; importing megatrain_jax sets 90% of RAM otherwise). The process keeps the whole
pool, so the host total is the pool (not the pinned arrays in it), the pageable arrays, and an allowance
for the Python/JAX/CUDA runtime. (A CPU backend has no such pool; the plan counts it anyway.)

tests/test_memory_plan.py compares this plan with the peaks measured in experiments/results/.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import deque
from typing import Any, Callable, Iterator

from megatrain_jax.engine_config import EngineConfig
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.schedule import STORES_AHEAD, offloaded_blocks, step_ops

GiB = 1024**3
MiB = 1024**2
# The one allowance besides the transients: Python, JAX/XLA, CUDA libraries, compiled programs (3.0-3.7 GiB
# of resident memory outside the pinned pool, measured on the H100 box).
HOST_RUNTIME_BYTES = int(3.5 * GiB)
# Constants of the software stack (jax 0.11.2, CUDA driver 580; measured on the H100 box):
QUEUED_BLOCKS = 3  # blocks of work the GPU trails the host by (measured: 2-6 released blocks still in use)
PINNED_RSS_OVERHEAD = 0.031  # a pinned pool region of 32 GiB adds 33.0 GiB of resident memory
HOST_POOL_FRACTION = 0.9  # megatrain_jax._environment caps XLA's pinned pool at 90% of RAM
POOL_HEADROOM = (0.10, 4 * GiB)  # what the fitted pool cap adds to the pinned arrays: a share and a constant
# What the lean full-precision pick leaves free of the host's available memory where it can: the plan's host
# total has come out 0-4% under the measured peaks (experiments/results/h100_plan_check.json).
LEAN_HOST_MARGIN = 0.03
JAX_GPU_FRACTION = 0.75  # JAX lets XLA take 75% of GPU memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise
BATCH_BYTES_PER_TOKEN = 16  # a filled Batch: int32 inputs, targets, positions and float32 loss mask


class MemoryPlanError(RuntimeError):
    """The run does not fit in host or GPU memory; the message lists the numbers and what would fit."""


def io_param_count(cfg: DecoderConfig) -> int:
    """Embedding, final norm and (untied) head."""
    return cfg.vocab_size * cfg.hidden + cfg.hidden + (0 if cfg.tie_embeddings else cfg.hidden * cfg.vocab_size)


def layer_param_count(cfg: DecoderConfig) -> int:
    return (cfg.param_count() - io_param_count(cfg)) // cfg.layers


def host_roles(cfg: DecoderConfig, e: EngineConfig):
    """Which parts update on the host, wait on the GPU, keep moments on disk (``parts.HostRoles``)."""
    from megatrain_jax.parts import HostRoles
    return HostRoles.of(cfg.layers, e.resident_layers, e.resident_io, e.grads_on_gpu, e.disk_parts)


def part_param_count(cfg: DecoderConfig, part) -> int:
    return io_param_count(cfg) if part.is_io else layer_param_count(cfg)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_disk_bytes(folder: str | os.PathLike | None) -> int | None:
    """Free bytes on the file system that holds ``folder`` (or its nearest existing parent), None without one."""
    if not folder:
        return None
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def available_gpu_bytes() -> int | None:
    """The accelerator allocator's limit (``memory_stats()['bytes_limit']``), None on CPU."""
    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    stats = dev.memory_stats() or {}
    return stats.get("bytes_limit")


def gpu_bytes_before_jax() -> int | None:
    """What XLA's allocator will get on the first GPU, read without starting JAX: ``nvidia-smi``'s total
    memory times ``gpu_fraction()``; None without nvidia-smi (a CPU machine)."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.split()
        return int(int(out[0]) * MiB * gpu_fraction())
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def gpu_fraction() -> float:
    """The share of GPU memory XLA may allocate in this environment."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_FRACTION))


def fitted_pool_limit(pinned: int, host_ram_bytes: int | None, devices: int = 1) -> int | None:
    """The cap on XLA's pinned pool for ``pinned`` bytes of pinned arrays, as ``megatrain-jax train`` sets
    it before JAX starts (``_environment.limit_host_pool``): the arrays plus 10% and 4 GiB of headroom, in
    whole GiB, at most 90% of RAM. The pool then stops growing where the arrays end instead of doubling
    past them (up to twice their size, in memory nothing else can use). None where neither is known; an
    explicit ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` set by the user wins.

    XLA keeps one pinned pool per GPU, each under that cap, and the state is spread over the GPUs: with
    several, each pool gets its share of the arrays plus 10%, and a share of the headroom (at least 2 GiB)."""
    from megatrain_jax._environment import user_host_pool_limit
    user = user_host_pool_limit()
    if user is not None:
        return user
    cap = None if host_ram_bytes is None else int(HOST_POOL_FRACTION * host_ram_bytes / GiB / devices) * GiB
    headroom = POOL_HEADROOM[1] if devices == 1 else max(POOL_HEADROOM[1] / devices, 2 * GiB)
    fitted = math.ceil((pinned / devices * (1 + POOL_HEADROOM[0]) + headroom) / GiB) * GiB
    return fitted if cap is None else min(fitted, cap)


def fit_host_pool(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                  **plan_kw) -> bool:
    """Before JAX starts its GPU backend: cap XLA's pinned pool at what this run pins
    (``fitted_pool_limit``), as ``megatrain-jax train`` does. Returns whether the cap was set (not where the
    user set one, nor once JAX's backends have started). ``devices`` (in ``plan_kw``) defaults to the GPUs
    this process will see: the engine spreads over all of them by default."""
    from megatrain_jax._environment import limit_host_pool, physical_ram_bytes, visible_gpus
    plan_kw.setdefault("devices", visible_gpus())
    p = plan(model_cfg, engine_cfg, batch_rows, seq_len, host_ram_bytes=physical_ram_bytes(), detect=False,
             **plan_kw)
    return limit_host_pool(p.host_pool_limit)


def pinned_pool_bytes(arrays: int, limit: int | None) -> int:
    """What XLA's pinned-host allocator reserves to hold ``arrays`` bytes: its regions double from 2 MiB,
    and the last one is cut to what ``limit`` leaves."""
    total, region = 0, 2 * MiB
    while total < arrays:
        total, region = total + region, 2 * region
    return total if limit is None else min(total, limit)


# ---------------------------------------------------------------------------------------------- GPU
def _transient(c: DecoderConfig, kind: str, micro_rows: int, seq_len: int, sb: int, flash: bool,
               packed: bool = False, kept: bool = False) -> tuple[int, str]:
    """Scratch memory of the compiled function behind an op, a rule of thumb from the tensors it keeps per
    token. In brackets, XLA's memory analysis on the H100 (per micro-batch: 7B layer at 16K tokens / 3B at
    128K; it depends on the tokens, not on how they split into rows)."""
    ab = 2 if c.dtype in ("bfloat16", "float16") else 4
    q, kv, D, V = c.heads * c.dim_per_head, c.kv_heads * c.dim_per_head, c.hidden, c.vocab_size
    mt = micro_rows * seq_len
    # The MLP's width per token: a mixture of experts computes top_k experts' rows (and the shared
    # expert's), and also holds each routed copy of the token's input and output [tokens * top_k, D].
    # (A rule from the shapes; no MoE run has checked it yet.)
    F = c.ffn if c.moe is None else c.moe.top_k * c.moe.expert_ffn + (c.moe.shared_expert_ffn or 0) \
        + 2 * c.moe.top_k * D // 3
    mlp_t = mt if c.mlp_chunk_tokens is None else min(mt, c.mlp_chunk_tokens)  # tokens the MLP holds at once
    scores = 0 if flash else micro_rows * c.heads * seq_len * seq_len * (4 + ab)  # no flash: T x T scores
    # A chunked MLP leaves the attention's tensors the larger part at long lengths; its lax.map also copies
    # the block's [T, D] input padded into chunks and stacks the chunks' gradients in the backward.
    # [Measured with experiments/op_memory.py, one block, 32K-token chunks, above its outputs: forward 3B 512K
    # 6.0 GiB (this rule 5.0), 7B 256K 6.1 (6.0); backward 3B 256K 15.7 (16.0), 3B 512K 31.4 (30.5), 7B 128K
    # 11.2 (13.0), 7B 256K 22.2 (24.0)]
    chunked = mlp_t < mt
    if kind == "forward":  # [1.01 / 6.0 GiB, and 8B's 1.31 at 16K; this rule the same]
        if chunked and mt * (q + 2 * kv) > mlp_t * 3 * F:
            return mt * (q + 2 * kv) * ab + scores, "q, k and v (the MLP is chunked)"
        return mlp_t * 3 * F * ab + scores, "MLP gate, up and product"
    if kind == "backward":  # [7B: 1.85, 4.19, 8.38 GiB at 16K, 32K, 64K tokens; 3B: 2.88, 11.56 at 32K, 128K;
        #                        this rule 2.08, 4.17, 8.33; 2.94, 11.75; float32 weights add ~0.57 at 7B]
        weights = layer_param_count(c) * 4 if sb == 4 else 0  # their bf16 cast; the gradient in float32
        # cuDNN's packed layout: a float32 dQ workspace per possible document [rows x segments, N, T, H]
        # (one row of 32K tokens, 24 heads of 128, 64 segments: this rule 24 GiB, +29 GiB measured;
        # experiments/results/h100_kernels.json)
        packed_ws = c.segments_per_row(seq_len) * mt * q * 4 if packed and flash else 0
        qs = 1 if kept else 2  # q, and the attention output unless it was kept (counted with the activations)
        copies = 2 * mt * D if chunked else 0  # the chunked MLP's padded input and stacked gradient
        return (max((mt * (5 * D + qs * q + 2 * kv) + mlp_t * 3 * F + copies) * ab, layer_param_count(c) * sb)
                + weights + 2 * scores + packed_ws,
                "what the recompute keeps for the VJP: norm outputs, residual, q, k, v, " +
                ("" if kept else "attention output, ") + "MLP gate, up and product, the residual's float32 "
                "gradient" + (", and the chunked MLP's padded input and stacked gradient" if chunked else ""))
    if kind == "head":  # [2.6 / 11.6 GiB; this rule 2.8 / 10.8]
        chunk = min(c.loss_chunk_tokens, mt)
        return (2 * chunk * V * 4 + io_param_count(c) * sb + mt * D * (ab + 4),
                f"one {chunk}-token chunk of float32 logits and their gradient, the io gradient, the final hidden "
                f"state and its float32 gradient")
    if kind == "embed_backward":  # [0.24 / 0.73 GiB; exact]
        return V * D * sb, "the dense embedding gradient"
    return 0, ""


def _flash(c: DecoderConfig) -> bool:
    """Whether the plan assumes cuDNN's flash attention (a 16-bit model on a GPU; packed rows too, in cuDNN's
    packed layout, which needs a Hopper GPU)."""
    return c.attention_impl == "cudnn" or (c.attention_impl == "auto" and c.dtype in ("bfloat16", "float16"))


def kept_bytes(c: DecoderConfig, e: EngineConfig, micro_rows: int, seq_len: int, flash: bool,
               packed: bool = False) -> int:
    """The residuals one block keeps from its forward to its backward per micro-batch
    (``EngineConfig.keep_residuals``): cuDNN flash attention's output [rows, T, heads, head_dim] in the
    compute dtype and its softmax statistics [rows, heads, T] in float32, in cuDNN's packed layout one
    such row of statistics per possible document (``segments_per_row``; measured on the H100,
    tests/test_remat.py). Nothing on XLA's attention."""
    if not (flash and e.keep_residuals):
        return 0
    ab = 2 if c.dtype in ("bfloat16", "float16") else 4
    stats = c.segments_per_row(seq_len) if packed else 1
    return micro_rows * seq_len * c.heads * (c.dim_per_head * ab + 4 * stats)


@dataclasses.dataclass
class _Ledger:
    """Device bytes per category as the schedule runs, and buffers the host dropped but the GPU still uses."""

    live: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # category -> [bytes, buffers]
    held: list = dataclasses.field(default_factory=list)  # (block, category, bytes) queued GPU work still uses
    queue: deque = dataclasses.field(default_factory=deque)  # the blocks the host has moved through, newest last

    def add(self, cat: str, nbytes: int, n: int = 1) -> None:
        entry = self.live.setdefault(cat, [0, 0])
        entry[0] += nbytes
        entry[1] += n

    def drop(self, cat: str, nbytes: int, n: int = 1, block: Any = None) -> None:
        """``cat``'s buffers the host no longer holds; with ``block``, work queued for that block (a part in
        one pass and phase) still uses them until the host is ``QUEUED_BLOCKS`` blocks further."""
        self.add(cat, -nbytes, -n)
        if block is not None:
            self.reach(block)
            self.held.append((block, cat, nbytes))

    def reach(self, block: Any) -> None:
        """The host has issued ``block``'s work: what the GPU still uses for older blocks than the newest
        ``QUEUED_BLOCKS`` is free."""
        if block in self.queue:
            return
        self.queue.append(block)
        while len(self.queue) > QUEUED_BLOCKS:
            done = self.queue.popleft()
            self.held = [h for h in self.held if h[0] != done]

    def settle(self, cat: str, keep: int) -> None:
        """The host waited for all but the newest ``keep`` of ``cat``'s dropped buffers: the rest are free."""
        mine = [h for h in self.held if h[1] == cat]
        gone = set(map(id, mine[:max(len(mine) - keep, 0)]))
        self.held = [h for h in self.held if id(h) not in gone]

    def total(self) -> int:
        return sum(b for b, _ in self.live.values()) + sum(b for _, _, b in self.held)

    def breakdown(self) -> dict[str, int]:
        held: dict[str, list[int]] = {}
        for block, cat, b in self.held:  # counted in blocks: one entry may hold several micro-batches' buffers
            entry = held.setdefault(f"{cat}: dropped by the host, still used by queued GPU work", [0, set()])
            entry[0] += b
            entry[1].add(block)
        return {**{f"{cat} ({n} buffers)" if n > 1 else cat: b for cat, (b, n) in self.live.items() if b},
                **{f"{cat} ({len(blocks)} blocks)" if len(blocks) > 1 else cat: b
                   for cat, (b, blocks) in held.items() if b}}


def _gpu_peak(c: DecoderConfig, e: EngineConfig, rows: int, seq_len: int, sb: int,
              flash: bool, devices: int = 1, packed: bool = False) -> tuple[dict[str, int], str]:
    """Walk one optimizer step of the engine's schedule: the peak's items (bytes) and the op it happens in,
    on one GPU of ``devices``: each holds its rows, its shard of the resident parts and of each fetched
    part, and each fetched part whole once gathered. The step is a steady-state one: the gradients that
    wait on the GPU (``grads_on_gpu``) from the step before are there when it starts, each until its part's
    fetch (which waits for the part's update, which copies the gradient home)."""
    from megatrain_jax.parts import IO, PartId
    ab = 2 if c.dtype in ("bfloat16", "float16") else 4
    Pl, Pio, M = layer_param_count(c), io_param_count(c), e.micro_batches
    rows = rows // devices
    fetched = 1 if devices == 1 else 1 + 1 / devices  # the shard, and the part whole once gathered
    act = rows // M * seq_len * c.hidden * ab  # one boundary activation of one micro-batch
    res = kept_bytes(c, e, rows // M, seq_len, flash, packed)  # one block's kept residuals (one micro-batch)
    on_gpu = {IO} if e.resident_io else set()
    on_gpu |= {PartId.block(i) for i in range(e.resident_layers)}
    # fp32 master + Adam moments + the compute copy (a second fp32 copy when float32 is streamed)
    resident = (e.resident_layers * Pl + (Pio if e.resident_io else 0)) * (12 + sb) // devices
    batches = rows * seq_len * (BATCH_BYTES_PER_TOKEN + (0 if flash else 4))
    W, A, G = "streamed weights of the io part and blocks", "boundary activations", "gradient accumulators, float32"
    K = "kept residuals: attention output and softmax statistics (keep_residuals)"
    R, DY, B = "gradients of GPU-resident parts, float32", "d(loss)/d(hidden) per micro-batch", "token batches"
    H = "gradients waiting on the GPU for their host update, float32 (grads_on_gpu)"
    held = set(host_roles(c, e).grads_on_gpu)
    led, acts, home = _Ledger(), {}, set()  # acts: layer -> micro-batch activations held
    keeps: dict[int, int] = {}  # block -> micro-batch kept residuals held
    away: dict[int, int] = {}  # layer -> micro-batch activations in host memory (offload_activations)
    for part in held:  # the step before's, copied home by each part's update before its fetch
        led.add(H, part_param_count(c, part) * 4 // devices)
    best: tuple[int, dict[str, int], str] = (-1, {}, "")
    passes = min(e.accumulate_steps, 2)  # later accumulating passes repeat the second
    for j in range(passes):
        accumulate, last, backward = j > 0, j == passes - 1, False
        led.add(B, batches)
        for op in step_ops(c.layers, M, e.prefetch_depth, update=last, offload=e.offload_activations):
            part, kind = op.part, op.kind
            backward |= kind == "head"
            here = (j, backward, kind if part is None else part)  # the block whose work this op queues
            kept = part in on_gpu
            waits = part in held  # its gradient stays on the GPU until its update (not GPU-resident)
            io = kind == "head" or (part is not None and part.is_io)  # the head accumulates the io gradient
            weights, grad = (Pio * sb, Pio * 4) if io else (Pl * sb, Pl * 4)
            weights = int(weights * fetched)
            temp, why = _transient(c, kind, rows // M, seq_len, sb, flash, packed, res > 0)
            out = 0  # bytes the op allocates
            if kind == "fetch":
                out = 0 if kept else weights
            elif kind in ("embed", "forward", "backward", "head"):
                out = act + (grad if kind in ("backward", "head") and op.micro == 0 else 0)
                out += res if kind == "forward" else 0
            elif kind == "load_acts":  # one copy per micro-batch (and one of its kept residuals)
                out = (act + res) * M
            elif kind == "send_grads":  # when accumulating, the earlier sum comes back to be added
                temp = grad if accumulate and not (kept or waits) else 0
            total = resident + led.total() + temp + out
            if total > best[0]:
                items = {f"GPU-resident parts with their optimizer state ({len(on_gpu)} parts)": resident,
                         **led.breakdown()}
                items[f"transient of {op!r} (rule of thumb: {why})"] = temp
                items[f"outputs of {op!r}"] = out
                best = (total, {k: v for k, v in items.items() if v}, repr(op))
            if kind == "fetch" and waits and part not in home:  # the forward's fetch waited for the update,
                home.add(part)                                   # which took the step before's gradient home
                led.drop(H, grad // devices)
            if kind == "fetch" and not kept:  # what the host program holds after the op
                led.add(W, weights)
            elif kind == "release" and not kept:
                led.drop(W, weights, block=here)
            if kind in ("embed", "forward", "head", "backward", "embed_backward"):
                led.reach(here)  # its work is queued: GPU-resident blocks' and unreleased ones' too
            if kind in ("embed", "forward"):
                layer = 0 if kind == "embed" else part.layer + 1
                acts[layer] = acts.get(layer, 0) + 1
                led.add(A, act)
                if kind == "forward" and res:
                    keeps[part.layer] = keeps.get(part.layer, 0) + 1
                    led.add(K, res)
            elif kind == "store_acts":  # freed once the queued copies have read them; the host waits for
                n = acts.pop(part.layer)  # all but the last STORES_AHEAD blocks' copies
                nk = keeps.pop(part.layer, 0)  # the block's kept residuals go with its inputs
                led.add(K, -res * nk, -nk)
                led.add(A, res * nk, 0)
                led.drop(A, (act + res) * n, n, block=here)
                led.settle(A, keep=STORES_AHEAD)  # the host waits for the older blocks' copies
                away[part.layer] = n
            elif kind == "load_acts":
                acts[part.layer] = n = away.pop(part.layer)
                led.add(A, act * n, n)
                if res:
                    keeps[part.layer] = n
                    led.add(K, res * n, n)
            elif kind in ("head", "backward") and op.micro == 0:
                led.add(G, grad)
            elif kind == "send_grads":
                led.drop(G, grad, block=None if kept or waits else here)
                if kept and not accumulate:
                    led.add(R, grad)
                elif waits and not accumulate:
                    led.add(H, grad // devices)
            elif kind == "update" and kept:
                led.drop(R, grad)
            if kind == "head":
                led.add(DY, act)
            last_micro = op.micro == M - 1
            if last_micro and kind == "backward" and part.layer in keeps:
                n = keeps.pop(part.layer)
                led.drop(K, res * n, n)
            if last_micro and (kind == "head" or (kind == "backward" and part.layer > 0)):
                layer = c.layers if kind == "head" else part.layer
                led.drop(A, act * acts[layer], acts.pop(layer))
            elif last_micro and kind == "embed_backward":
                led.drop(A, act * sum(acts.values()), sum(acts.values()))
                led.drop(DY, act * M, M)
                acts.clear()
        led.drop(B, batches)
    return best[1], best[2]


# ---------------------------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class Option:
    """A change to the run's config that was re-planned and fits: ``changes`` as (``section.key``, value)
    pairs, ``why`` says what it changes and what it costs in speed."""

    changes: tuple[tuple[str, Any], ...]
    why: str

    @property
    def overrides(self) -> list[str]:
        """The changes as command-line overrides (``megatrain-jax train ... engine.micro_batches=4``)."""
        text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
        return [f"{key}={text(value)}" for key, value in self.changes]

    def __str__(self) -> str:
        return f"{' '.join(self.overrides)}: {self.why}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per item in host and GPU memory, the limits they are compared with, and the inputs."""

    host: dict[str, int]
    gpu: dict[str, int]
    host_available: int | None
    gpu_available: int | None
    model_cfg: DecoderConfig
    engine_cfg: EngineConfig
    batch_rows: int
    seq_len: int
    stream_dtype: str
    packed: bool = False
    loaded_copy: bool = False
    host_pinned: int = 0  # bytes of the pinned arrays (what XLA's pool must hold)
    host_pool_limit: int | None = None  # XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB in bytes
    host_pool_fitted: bool = True  # the cap is fitted to this plan's pinned arrays (not given)
    gpu_peak_at: str = ""  # the op during which the GPU peaks
    devices: int = 1  # GPUs the run spreads over: ``gpu`` is one GPU's, ``host`` the whole host's
    disk: int = 0  # bytes of the disk tier's files (``EngineConfig.disk_parts``)
    disk_available: int | None = None  # free bytes where they go

    @property
    def pinned_per_pool(self) -> int:
        """Pinned bytes in each GPU's pool (the state is spread over the GPUs)."""
        return -(-self.host_pinned // self.devices)

    @property
    def params(self) -> int:
        return self.model_cfg.param_count()

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_fits(self) -> bool:
        pool_ok = self.host_pool_limit is None or self.pinned_per_pool <= self.host_pool_limit
        return pool_ok and (self.host_available is None or self.host_total <= self.host_available)

    @property
    def gpu_fits(self) -> bool:
        return self.gpu_available is None or self.gpu_total <= self.gpu_available

    @property
    def disk_fits(self) -> bool:
        return self.disk_available is None or self.disk <= self.disk_available

    @property
    def fits(self) -> bool:
        return self.host_fits and self.gpu_fits and self.disk_fits

    def replace(self, **changes) -> "MemoryPlan":
        """The plan of the same run with ``model_cfg``, ``engine_cfg``, ``batch_rows`` ... changed."""
        args = dict(model_cfg=self.model_cfg, engine_cfg=self.engine_cfg, batch_rows=self.batch_rows,
                    seq_len=self.seq_len, stream_dtype=self.stream_dtype, host_ram_bytes=self.host_available,
                    gpu_bytes=self.gpu_available, packed=self.packed, loaded_copy=self.loaded_copy,
                    host_pool_limit=None if self.host_pool_fitted else self.host_pool_limit, detect=False,
                    devices=self.devices, disk_bytes=self.disk_available)
        args.update(changes)
        return plan(**args)

    def applied(self, changes: tuple[tuple[str, Any], ...]) -> "MemoryPlan":
        """The plan with config changes (``("engine.micro_batches", 4), ...``) applied."""
        model, engine, rows, seq = {}, {}, self.batch_rows, self.seq_len
        stream = self.stream_dtype
        for key, value in changes:
            section, name = key.split(".", 1)
            if key == "data.batch_size":
                rows = value
            elif key == "data.seq_len":
                seq = value
            elif section == "engine":
                engine[name] = value
                stream = value if name == "stream_dtype" else stream
            elif section == "model":
                model[name] = value
            else:
                raise ValueError(f"the memory plan cannot apply {key}")
        return self.replace(model_cfg=self.model_cfg.replace(**model),
                            engine_cfg=dataclasses.replace(self.engine_cfg, **engine), batch_rows=rows,
                            seq_len=seq, stream_dtype=stream)

    def table(self) -> str:
        c, e = self.model_cfg, self.engine_cfg
        lines = [f"memory plan: {self.params / 1e9:.2f} B params ({c.layers} layers, hidden {c.hidden}, vocab "
                 f"{c.vocab_size}); {self.batch_rows} x {self.seq_len} tokens per pass in {e.micro_batches} "
                 f"micro-batch(es); prefetch_depth {e.prefetch_depth}; weights streamed as {self.stream_dtype}; "
                 f"{e.resident_layers} blocks{' + io' if e.resident_io else ''} GPU-resident; gradients of {e.grads_on_gpu} "
                 f"parts wait on the GPU"]
        gpu_name = f"GPU, at its peak (during {self.gpu_peak_at}, 1st step)"
        sides = (("host RAM", self.host, self.host_available), (gpu_name, self.gpu, self.gpu_available))
        for name, items, avail in sides:
            lines.append(f"  {name:<96s} {'GiB':>8s}")
            lines += [f"    {k:<94s} {v / GiB:8.2f}" for k, v in items.items()]
            total = sum(items.values())
            verdict = ("(no limit known)" if avail is None else
                       f"of {avail / GiB:.2f} available: " + ("fits" if total <= avail
                                                               else f"OVER by {(total - avail) / GiB:.2f} GiB"))
            lines.append(f"    {'total':<94s} {total / GiB:8.2f}  {verdict}")
            if items is self.host and self.host_pool_limit is not None and self.pinned_per_pool > self.host_pool_limit:
                lines.append(f"    OVER by {(self.host_pinned - self.host_pool_limit) / GiB:.2f} GiB: "
                             f"{self.host_pinned / GiB:.2f} GiB of pinned arrays, XLA's pinned pool is capped at "
                             f"{self.host_pool_limit / GiB:.0f} GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
        if self.disk:
            where = "" if self.disk_available is None else f" of {self.disk_available / GiB:.2f} free: " + (
                "fits" if self.disk_fits else f"OVER by {(self.disk - self.disk_available) / GiB:.2f} GiB")
            lines.append(f"  disk tier ({self.engine_cfg.disk_parts} blocks' Adam moments in {self.engine_cfg.disk_dir}): "
                         f"{self.disk / GiB:.2f} GiB{where}; each step reads and writes it once")
        lines.append(f"  host bytes per parameter: {self.host_pinned / self.params:.1f} in pinned arrays, "
                     f"{self.host_total / self.params:.1f} in all; by mode:")
        lines += [f"    {name:<94s} {b:8.1f}" for name, b in self.host_bytes_per_param().items()]
        return "\n".join(lines)

    # ------------------------------------------------------------------ what would fit
    def _levers(self) -> Iterator[tuple[str, list[tuple[tuple[str, Any], ...]], Callable]]:
        """Each lever: its name, candidate changes fastest first, and the words for a chosen change."""
        e, c, rows, seq = self.engine_cfg, self.model_cfg, self.batch_rows, self.seq_len
        n_updated = lambda r, io: c.layers - r + (0 if io else 1)  # noqa: E731  (host-updated parts)
        resident = [(("engine.resident_layers", r),) for r in range(c.layers, -1, -1)
                    if r != e.resident_layers and n_updated(r, e.resident_io) >= e.grads_on_gpu and not e.capacity
                    and c.layers - r >= e.disk_parts]
        yield ("resident", resident,
               lambda ch: (f"{ch[0][1]} GPU-resident blocks instead of {e.resident_layers}: " +
                           ("fewer blocks update on the GPU, so the next forward may wait on the host optimizer "
                            "(slower)" if ch[0][1] < e.resident_layers else
                            "their gradients stay on the GPU (4 B/param less host RAM) and they update there "
                            "(faster)")))
        io = [(("engine.resident_io", not e.resident_io),)]
        ok = n_updated(e.resident_layers, not e.resident_io) >= e.grads_on_gpu and not e.capacity
        yield ("resident_io", io if ok else [],
               lambda ch: "io part (embedding, head) " + ("kept on the GPU (faster)" if ch[0][1] else
                                                          "streamed instead of GPU-resident (slower first block)"))
        other = "float32" if self.stream_dtype in ("bfloat16", "float16") else "bfloat16"
        yield ("stream", [] if e.capacity else [(("engine.stream_dtype", other),)],
               lambda ch: ("stream the float32 masters: no 16-bit host copy (2 B/param less host RAM), twice the "
                           "bytes per layer over PCIe (hidden behind compute from about 16K tokens per layer visit "
                           "on an H100)") if other == "float32" else
               ("stream bfloat16 weights: half the PCIe bytes (faster); the host keeps a 16-bit copy (+2 B/param)"))
        if e.disk_dir and e.host_kernel:  # the tier runs with the fused kernel only
            blocks = c.layers - e.resident_layers
            gib = lambda n: n * layer_param_count(c) * (4 if e.capacity else 8) / GiB  # noqa: E731
            yield ("disk", [(("engine.disk_parts", n),) for n in range(1, blocks + 1) if n != e.disk_parts],
                   lambda ch: (f"the Adam moments of the last {ch[0][1]} blocks in files under {e.disk_dir} "
                               f"({gib(ch[0][1]):.1f} GiB, read and written once per step: slower unless the disk "
                               f"keeps up with the host optimizer)"))
        n_host = len(host_roles(c, e).host_updated)
        yield ("grads_on_gpu", [(("engine.grads_on_gpu", n),) for n in range(1, n_host + 1) if n != e.grads_on_gpu],
               lambda ch: (f"the float32 gradients of {ch[0][1]} parts wait on the GPU for the global norm instead of "
                           f"in host memory (4 B/param less host RAM for them, as much more GPU memory); each "
                           f"comes home when its update runs"))
        if not e.capacity and e.host_kernel:  # capacity mode runs in the fused kernel
            to = {"engine.master_dtype": "bfloat16", "engine.stream_dtype": "bfloat16", "engine.resident_layers": 0,
                  "engine.resident_io": False}
            now = {"engine.stream_dtype": self.stream_dtype, "engine.resident_layers": e.resident_layers,
                   "engine.resident_io": e.resident_io}
            yield ("capacity", [tuple((k, v) for k, v in to.items() if now.get(k) != v)],
                   lambda ch: ("capacity mode: bfloat16 masters and Adam moments, stochastically rounded (6 B/param "
                               "instead of 12, no 16-bit copy; quality: docs/capacity.md)" +
                               ("; every part updates on the host" if e.resident_layers or e.resident_io else "")))
        if e.keep_residuals and kept_bytes(c, e, 1, 1, _flash(c)):
            yield ("keep", [(("engine.keep_residuals", False),)],
                   lambda ch: ("attention is recomputed in the backward instead of kept from the forward: one "
                               "activation per block less, attention's forward twice per step (slower at long "
                               "sequences)"))
        act_gib = (rows * seq * c.hidden * (2 if c.dtype in ("bfloat16", "float16") else 4)
                   + kept_bytes(c, e, rows, seq, _flash(c), self.packed)) / GiB
        yield ("offload", [(("engine.offload_activations", n),) for n in self.offload_counts()],
               lambda ch: (f"the inputs of the first {ch[0][1]} blocks wait in pinned host memory between forward and "
                           f"backward ({ch[0][1] * act_gib:.1f} GiB of host RAM), copied out and back behind the "
                           f"compute"))
        yield ("micro", [(("engine.micro_batches", m),) for m in _divisors(rows) if m > e.micro_batches],
               lambda ch: (f"{ch[0][1]} micro-batches of {rows // ch[0][1] * seq} tokens: smaller transients; "
                           f"below about 8K tokens per layer visit the weight transfers stop hiding behind compute"))
        yield ("prefetch", [(("engine.prefetch_depth", d),) for d in range(e.prefetch_depth - 1, 0, -1)],
               lambda ch: f"prefetch {ch[0][1]} block(s) ahead: fewer weights in flight; a slow host update "
                          f"or transfer is hidden less")
        fewer = []
        for k in (2, 4, 8, 16, 32):
            if rows % k == 0:
                r = rows // k
                m = max(d for d in _divisors(r) if d <= e.micro_batches)
                fewer.append((("data.batch_size", r), ("engine.accumulate_steps", e.accumulate_steps * k),
                              ("engine.micro_batches", m)))
        yield ("rows", fewer,
               lambda ch: (f"{ch[0][1]} rows per pass, {ch[1][1]} passes per optimizer step (the same tokens per "
                           f"step): fewer boundary activations; the weights cross PCIe twice per pass, "
                           f"{ch[1][1] // e.accumulate_steps}x the transfers per step"))
        shorter = [(("data.seq_len", seq // k),) for k in (2, 4, 8, 16) if seq % k == 0 and seq // k >= 128]
        yield ("seq", shorter, lambda ch: f"sequences of {ch[0][1]} tokens: shorter context (changes what the model "
                                          f"learns) and fewer tokens per step")

    def _first_fit(self, candidates: list) -> tuple[tuple[str, Any], ...] | None:
        """The first candidate that fits. More resident blocks need more GPU and less host memory, so that
        lever is bisected for the most blocks that fit the GPU; more gradients on the GPU need less host
        memory, so that one for the fewest that fit the host; the others have few candidates."""
        if candidates and candidates[0][0][0] in ("engine.grads_on_gpu", "engine.disk_parts"):
            return self._fewest(candidates[0][0][0], sorted(ch[0][1] for ch in candidates))
        if candidates and candidates[0][0][0] == "engine.offload_activations":
            return self._fewest(candidates[0][0][0], sorted(ch[0][1] for ch in candidates), gpu=True)
        if candidates and candidates[0][0][0] == "engine.resident_layers":
            values = sorted(ch[0][1] for ch in candidates)
            lo, hi = 0, len(values)
            while lo < hi:  # lo: how many values fit the GPU
                mid = (lo + hi) // 2
                ok = self.applied((("engine.resident_layers", values[mid]),)).gpu_fits
                lo, hi = (mid + 1, hi) if ok else (lo, mid)
            best = (("engine.resident_layers", values[lo - 1]),) if lo else None
            return best if best is not None and self.applied(best).fits else None
        return next((ch for ch in candidates if self._fits(ch)), None)

    def _fits(self, changes: tuple[tuple[str, Any], ...]) -> bool:
        """Whether the plan with ``changes`` fits; a combination the engine refuses does not."""
        try:
            return self.applied(changes).fits
        except ValueError:
            return False

    def _fewest(self, key: str, values: list[int], gpu: bool = False) -> tuple[tuple[str, Any], ...] | None:
        """The smallest of ``values`` for ``key`` whose plan fits the host (more of it, less host memory), or
        with ``gpu`` the GPU (more of it, less GPU memory), if that plan fits everything."""
        best = self._first_fitting(key, values, gpu)
        return best if best is not None and self.applied(best).fits else None

    def _first_fitting(self, key: str, values: list[int], gpu: bool) -> tuple[tuple[str, Any], ...] | None:
        """The smallest of ``values`` for ``key`` whose plan fits the host (with ``gpu``: the GPU), bisected:
        more of it takes less of that memory."""
        lo, hi = 0, len(values)
        while lo < hi:  # lo: the first value whose plan fits
            mid = (lo + hi) // 2
            p = self.applied(((key, values[mid]),))
            lo, hi = (lo, mid) if (p.gpu_fits if gpu else p.host_fits) else (mid + 1, hi)
        return ((key, values[lo]),) if lo < len(values) else None

    def lean(self) -> tuple[tuple[str, Any], ...] | None:
        """Full precision in less host RAM, for a run that does not fit the host: the float32 masters are
        streamed (no 16-bit host copy), and if that is not enough, the fewest parts' gradients wait on the
        GPU, or else (with a ``disk_dir``) the fewest blocks' moments go to the disk tier; with
        ``LEAN_HOST_MARGIN`` of the host left over where possible. The changes, or None where the run fits
        already or even this does not fit."""
        if self.host_fits:
            return None
        if self.host_available is not None:
            margin = self.replace(host_ram_bytes=int(self.host_available * (1 - LEAN_HOST_MARGIN)))
            changes = margin._leanest()
            if changes is not None:
                return changes
        return self._leanest()

    def offload(self) -> tuple[tuple[str, Any], ...] | None:
        """For a run that does not fit the GPU: the fewest blocks whose inputs wait in host memory
        (``engine.offload_activations``) that make the GPU fit, whether or not the host then fits (more
        host RAM: ``lean_engine`` then makes the host lean where it can); None where the GPU fits already or
        no count makes it fit."""
        if self.gpu_fits or self.gpu_available is None:
            return None
        return self._first_fitting("engine.offload_activations", self.offload_counts(), gpu=True)

    def offload_counts(self) -> list[int]:
        """The ``engine.offload_activations`` values above this run's that offload more blocks."""
        e = self.engine_cfg
        return list(range(e.offload_activations + 1, offloaded_blocks(self.model_cfg.layers, e.prefetch_depth,
                                                                       self.model_cfg.layers) + 1))

    def _leanest(self) -> tuple[tuple[str, Any], ...] | None:
        stream = () if self.stream_dtype == "float32" or self.engine_cfg.capacity else (
            ("engine.stream_dtype", "float32"),)
        p = self.applied(stream)
        if p.host_fits:
            return stream if p.fits else None
        n_host = len(host_roles(self.model_cfg, self.engine_cfg).host_updated)
        grads = p._fewest("engine.grads_on_gpu", list(range(1, n_host + 1)))
        if grads is not None:
            return stream + grads
        e = self.engine_cfg
        if e.disk_dir and not e.disk_parts and e.host_kernel:  # moments of the last blocks on disk
            blocks = self.model_cfg.layers - self.engine_cfg.resident_layers
            disk = p._fewest("engine.disk_parts", list(range(1, blocks + 1)))
            return None if disk is None else stream + disk
        return None

    def host_bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter of this run in each mode: full precision (float32 masters and moments,
        GPU-resident parts as configured) and capacity mode (no GPU-resident parts)."""
        e = self.engine_cfg
        full = dataclasses.replace(e, master_dtype="float32", stream_dtype=None, grads_on_gpu=0, disk_parts=0)
        capacity = dataclasses.replace(full, master_dtype="bfloat16", resident_layers=0, resident_io=False)
        every = lambda cfg: len(host_roles(self.model_cfg, cfg).host_updated)  # noqa: E731
        modes = {
            "full precision, 16-bit stream copy, gradients in host memory": dataclasses.replace(
                full, stream_dtype="bfloat16"),
            "full precision, float32 streamed, gradients in host memory": dataclasses.replace(
                full, stream_dtype="float32"),
            "full precision, float32 streamed, every host-updated gradient waiting on the GPU": dataclasses.replace(
                full, stream_dtype="float32", grads_on_gpu=every(full)),
            "capacity mode (bfloat16 masters and moments), gradients in host memory": capacity,
            "capacity mode, every gradient waiting on the GPU": dataclasses.replace(
                capacity, grads_on_gpu=every(capacity)),
        }
        if e.disk_dir:
            modes["full precision, float32 streamed, every non-resident block's moments in the disk tier"] = (
                dataclasses.replace(full, stream_dtype="float32", disk_parts=self.model_cfg.layers - e.resident_layers))
        return {name: self.replace(engine_cfg=cfg, stream_dtype=cfg.stream_dtype or "bfloat16").host_total / self.params
                for name, cfg in modes.items()}

    def options(self) -> list[Option]:
        """Changes that make the run fit in both host and GPU memory, each re-planned: one lever at a time,
        and where none of those keeps full precision (capacity mode may fit alone), pairs of the other
        levers; a smaller model last. Empty when nothing of that kind fits."""
        if self.fits:
            return []
        levers = sorted(self._levers(), key=lambda lever: lever[0] == "resident")  # resident last: bisected
        out = []
        for name, candidates, words in levers:
            ch = self._first_fit(candidates)
            if ch is not None:
                out.append((name, Option(ch, words(ch))))
        if all(name == "capacity" for name, _ in out):  # nothing at full precision yet: pairs of levers
            levers = [lever for lever in levers if lever[0] != "capacity"]
            for i, (_, first, words1) in enumerate(levers):
                for name2, _, _ in levers[i + 1:]:
                    for ch1 in first[:6]:
                        p = self.applied(ch1)  # the second lever's candidates are those valid after the first
                        _, second, words2 = next(lever for lever in p._levers() if lever[0] == name2)
                        ch2 = p._first_fit([c for c in second if not any(k in dict(ch1) for k, _ in c)])
                        if ch2 is not None:
                            out.append(("pair", Option(ch1 + ch2, f"{words1(ch1)}; and {words2(ch2)}")))
                            break
        layers = next((n for n in range(self.model_cfg.layers - 1, 0, -1)
                       if self.applied(self._smaller(n)).fits), None)
        if layers is not None:
            out.append(("smaller", Option(self._smaller(layers), f"a smaller model of {layers} layers (the rest as "
                                                                 f"configured)")))
        return [option for _, option in out]

    def _smaller(self, layers: int) -> tuple[tuple[str, Any], ...]:
        changes: tuple[tuple[str, Any], ...] = (("model.layers", layers),)
        e = self.engine_cfg
        if e.resident_layers > layers:
            changes += (("engine.resident_layers", layers),)
        n_updated = layers - min(e.resident_layers, layers) + (0 if e.resident_io else 1)
        if e.grads_on_gpu > n_updated:
            changes += (("engine.grads_on_gpu", n_updated),)
        if e.disk_parts > layers - min(e.resident_layers, layers):
            changes += (("engine.disk_parts", layers - min(e.resident_layers, layers)),)
        return changes

    def longest_seq_len(self, multiple: int = 1024) -> int | None:
        """The longest ``seq_len`` (a multiple of ``multiple``, up to the model's ``max_positions``) at which
        this run, with its rows and engine settings, fits host and GPU; None when not even ``multiple``
        does. Memory grows with the length, so the fitting lengths are a prefix: bisected."""
        top = self.model_cfg.max_positions // multiple
        fits = lambda k: self.replace(seq_len=k * multiple).fits  # noqa: E731
        if top < 1 or not fits(1):
            return None
        lo, hi = 1, top  # fits(lo) holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo * multiple

    def machine_needed(self) -> str:
        """The host RAM and GPU memory on which this run fits as configured."""
        ram = math.ceil(max(self.host_pinned / HOST_POOL_FRACTION, self.host_total) / GiB)
        while not self.replace(host_ram_bytes=ram * GiB, host_pool_limit=None, gpu_bytes=None).host_fits:
            ram += 1
        gpu = math.ceil(self.gpu_total / GiB)
        return (f"a machine with at least {ram} GiB of host RAM and a GPU whose allocator may use {gpu} GiB "
                f"({math.ceil(gpu / gpu_fraction())} GiB at XLA_PYTHON_CLIENT_MEM_FRACTION={gpu_fraction():g})")

    def advice(self) -> str:
        """What fits instead, as printed by ``check`` and ``megatrain-jax plan``."""
        opts = self.options()
        same_model = [o for o in opts if not any(key.startswith("model.") for key, _ in o.changes)]
        if same_model:
            text = "options that fit (each re-planned on the same host and GPU):"
        else:
            text = "nothing that keeps this model fits this host and GPU (one change, or two together)."
            text += "\noptions that fit, with a smaller model:" if opts else ""
        lines = [text] + [f"  - {o}" for o in opts] + [f"as configured, it needs {self.machine_needed()}"]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise MemoryPlanError with the table and the options that fit, unless the run fits."""
        if self.fits:
            return
        where = " and ".join(n for n, ok in (("host RAM", self.host_fits), ("GPU memory", self.gpu_fits)) if not ok)
        raise MemoryPlanError(f"this run does not fit in {where}.\n{self.table()}\n{self.advice()}\n"
                              f"(set train.memory_check = false to start anyway)")


def lean_engine(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                host_ram_bytes: int | None = None, disk_dir: str | None = None, gpu_bytes: int | None = None,
                **plan_kw) -> tuple[EngineConfig, str | None]:
    """The engine config ``megatrain-jax train`` runs: as given, unless memory is short.

    - Host RAM (default: this machine's MemAvailable) short, and the config leaves the stream dtype unset
      and no gradients on the GPU: the lean full-precision mode that fits (``MemoryPlan.lean``; in capacity
      mode, gradients waiting on the GPU alone). ``disk_dir`` (where the config sets none) is where the
      disk tier may go when nothing else fits.
    - The GPU short, and no activation offload configured: the fewest blocks whose inputs wait in host
      memory that make the run fit (``MemoryPlan.offload``).
    - Nothing of that fits while each block keeps its attention residuals (``keep_residuals``): the same
      search without them, if that fits.

    Returns the config and a sentence saying what was picked (None: as given). ``gpu_bytes`` defaults to
    ``gpu_bytes_before_jax()``. Reads nothing from JAX, so it can run before JAX starts its GPU backend."""
    host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
    gpu_bytes = gpu_bytes_before_jax() if gpu_bytes is None else gpu_bytes
    kw = dict(host_ram_bytes=host_ram_bytes, gpu_bytes=gpu_bytes, **plan_kw)
    picked, said = _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw)
    keeps = engine_cfg.keep_residuals and kept_bytes(model_cfg, engine_cfg, 1, 1, _flash(model_cfg)) > 0
    if keeps and not plan(model_cfg, picked, batch_rows, seq_len, detect=False, **kw).fits:
        # the kept attention residuals are one more activation per block: without them attention is
        # recomputed in the backward (slower), and the blocks' inputs may fit where both do not
        recompute = dataclasses.replace(engine_cfg, keep_residuals=False)
        plain, plain_said = _fit_engine(model_cfg, recompute, batch_rows, seq_len, disk_dir, kw)
        if plan(model_cfg, plain, batch_rows, seq_len, detect=False, **kw).fits:
            return plain, "; ".join(["keeping attention's output for the backward does not fit: attention is "
                                     "recomputed in the backward (engine.keep_residuals=false)"] + plain_said)
    return picked, ("; ".join(said) or None)


def _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw) -> tuple[EngineConfig, list[str]]:
    """``lean_engine`` for one setting of ``keep_residuals``: the config, and what was picked in words."""
    user_host = engine_cfg.stream_dtype is not None or engine_cfg.grads_on_gpu or engine_cfg.disk_parts
    said = []
    if not engine_cfg.offload_activations:
        p = plan(model_cfg, engine_cfg, batch_rows, seq_len, detect=False, **kw)
        changes = p.offload()
        # the fewest offloaded blocks for the GPU; their host RAM may call for the lean host layout, whose
        # gradients on the GPU may in turn call for a few blocks more
        for n in ([] if changes is None else [n for n in p.offload_counts() if n >= changes[0][1]]):
            offloaded, words = dataclasses.replace(engine_cfg, offload_activations=n), None
            if not user_host:
                offloaded, words = _lean_host(model_cfg, offloaded, batch_rows, seq_len, disk_dir=disk_dir, **kw)
            after = plan(model_cfg, offloaded, batch_rows, seq_len, detect=False, **kw)
            if after.fits:
                engine_cfg = offloaded
                what = "inputs" if not kept_bytes(model_cfg, offloaded, 1, 1, _flash(model_cfg)) else \
                    "inputs and kept attention residuals"
                said.append(f"GPU memory is short ({p.gpu_total / GiB:.1f} GiB needed, {p.gpu_available / GiB:.1f} "
                            f"available): the {what} of the first {n} blocks wait in host memory between forward "
                            f"and backward (engine.offload_activations={n}; GPU {after.gpu_total / GiB:.1f} GiB)")
                said += [words] if words else []
                break
    if not user_host:
        engine_cfg, words = _lean_host(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir=disk_dir, **kw)
        said += [words] if words else []
    return engine_cfg, said


def _lean_host(model_cfg, engine_cfg, batch_rows, seq_len, *, host_ram_bytes, gpu_bytes, disk_dir=None,
               **plan_kw) -> tuple[EngineConfig, str | None]:
    """``lean_engine``'s host part: the lean layout that fits the host (``MemoryPlan.lean``), and the words."""
    given = engine_cfg
    if disk_dir is not None and engine_cfg.disk_dir is None:
        engine_cfg = dataclasses.replace(engine_cfg, disk_dir=str(disk_dir))
    plan_kw.setdefault("disk_bytes", available_disk_bytes(engine_cfg.disk_dir))
    p = plan(model_cfg, engine_cfg, batch_rows, seq_len, host_ram_bytes=host_ram_bytes, gpu_bytes=gpu_bytes,
             detect=False, **plan_kw)
    changes = p.lean()
    if changes is None:
        return given, None
    lean = p.applied(changes)
    if not lean.engine_cfg.disk_parts:  # the disk folder is the config's only where the tier is used
        lean = lean.replace(engine_cfg=dataclasses.replace(lean.engine_cfg, disk_dir=given.disk_dir))
    said = " ".join(f"{k}={v}" for k, v in changes)
    if lean.engine_cfg.disk_parts:
        said += (f" (engine.disk_dir={lean.engine_cfg.disk_dir}: {lean.disk / GiB:.1f} GiB of Adam moments in "
                 f"files, read and written once per step)")
    return lean.engine_cfg, (f"host RAM is short ({p.host_total / GiB:.1f} GiB needed, "
                             f"{p.host_available / GiB:.1f} available): running "
                             f"{'capacity mode with' if engine_cfg.capacity else 'in the lean full-precision mode'} "
                             f"{said}, {lean.host_total / lean.params:.1f} host bytes per parameter instead of "
                             f"{p.host_total / p.params:.1f} ({lean.host_total / GiB:.1f} GiB)")


def plan(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
         stream_dtype: str | None = None, host_ram_bytes: int | None = None, gpu_bytes: int | None = None,
         *, packed: bool = False, loaded_copy: bool = False, detect: bool = True,
         host_pool_limit: int | None = None, devices: int = 1, disk_bytes: int | None = None) -> MemoryPlan:
    """The memory needed to train ``model_cfg`` on batches of ``batch_rows`` x ``seq_len`` tokens.

    ``stream_dtype`` is the dtype of the weights sent to the GPU (default: ``engine_cfg.stream_dtype``, else
    the model's compute dtype). ``gpu_bytes`` is what XLA's allocator may use (``bytes_limit``, a fraction of
    the card: see ``gpu_fraction``). Limits not given are read from this machine when ``detect`` (host:
    MemAvailable; GPU: the allocator's bytes_limit). XLA's pinned pool is capped at ``host_pool_limit``
    (default: ``fitted_pool_limit``, as ``megatrain-jax train`` sets it). ``packed`` rows carry segment
    ids: cuDNN's packed attention and its per-document workspace (``DecoderConfig.segments_per_row``; a
    Hopper GPU is assumed: older ones take XLA's masked attention, whose scores the plan does not count).
    ``loaded_copy``:
    the model object holds float32 weights loaded from a checkpoint for the whole run. ``devices``: the GPUs
    the run spreads over (per-GPU figures are one GPU's; host figures the whole host's, with one pinned
    pool per GPU). ``disk_bytes``: free space for the disk tier's files (default, when ``detect``: that of
    ``engine_cfg.disk_dir``).
    """
    c, e = model_cfg, engine_cfg
    if devices < 1 or batch_rows % (e.micro_batches * devices):
        raise ValueError(f"batch_rows={batch_rows} must be divisible by micro_batches x devices = "
                         f"{e.micro_batches} x {devices}")
    if batch_rows < 1 or seq_len < 1 or batch_rows % e.micro_batches:
        raise ValueError(f"batch_rows={batch_rows} must be >= 1 and divisible by micro_batches={e.micro_batches}; "
                         f"seq_len={seq_len} must be >= 1")
    if e.resident_layers > c.layers:
        raise ValueError(f"resident_layers={e.resident_layers} exceeds the model's {c.layers} blocks")
    if e.offload_activations > c.layers:
        raise ValueError(f"offload_activations={e.offload_activations} exceeds the model's {c.layers} blocks")
    if detect:
        host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
        gpu_bytes = available_gpu_bytes() if gpu_bytes is None else gpu_bytes
        disk_bytes = available_disk_bytes(e.disk_dir) if disk_bytes is None else disk_bytes
    roles = host_roles(c, e)  # raises where grads_on_gpu or disk_parts ask for more parts than there are
    stream_dtype = "bfloat16" if e.capacity else (stream_dtype or e.stream_dtype or c.dtype)
    sb = 2 if stream_dtype in ("bfloat16", "float16") else 4
    P = c.param_count()
    on_host_grads = P - e.resident_layers * layer_param_count(c) - (io_param_count(c) if e.resident_io else 0)
    waiting = [part_param_count(c, part) for part in roles.grads_on_gpu]  # gradients kept on the GPU

    # The fused C++ AdamW (megatrain_jax.adamw, the CLI's optimizer) keeps what only it touches in pageable
    # memory; it runs with float32 or bfloat16 streaming, where a C++ compiler exists (else the engine warns).
    fused = e.host_kernel and stream_dtype in ("float32", "bfloat16")
    pinned, pageable = {}, {}
    mb = 4 if e.capacity else 8  # bytes of Adam moments per parameter
    on_disk = e.disk_parts * layer_param_count(c)  # params whose moments live in the disk tier's files
    moments = "Adam moments m and v, " + ("bfloat16 (4 B/param; capacity mode)" if e.capacity else
                                          "float32 (8 B/param)")
    if on_disk:
        moments += f" of the {(P - on_disk) / 1e9:.2f} B params not in the disk tier"
    if e.capacity:  # bfloat16 masters (streamed themselves) and moments, stochastically rounded
        pinned["master weights, bfloat16, streamed (2 B/param; capacity mode)"] = 2 * P
        pageable[moments] = mb * (P - on_disk)
    else:
        (pageable if fused and sb == 2 else pinned)["master weights, float32 (4 B/param)"] = 4 * P
        (pageable if fused else pinned)[moments] = mb * (P - on_disk)
    if on_disk:  # the one updating, two read ahead, one being written behind
        pageable[f"disk tier: moments of up to {min(4, e.disk_parts)} blocks in memory (updating, read ahead, "
                 f"written behind)"] = mb * layer_param_count(c) * min(4, e.disk_parts)
    if sb == 2 and not e.capacity:
        pinned["16-bit stream copy of the weights (2 B/param)"] = 2 * P
    # The gradients of the host-updated parts, but for those waiting on the GPU: of these, one part's at a
    # time comes home, when its update runs.
    grads = 4 * (on_host_grads - sum(waiting)) + 4 * max(waiting, default=0)
    # Building the state, each of up to 4 parts at once passes its masters through pinned memory on its way
    # to pageable memory; the gradients later reuse that room.
    build = 4 * 4 * max(layer_param_count(c), io_param_count(c)) if fused and sb == 2 and not e.capacity else 0
    what = f"4 B/param of the {(on_host_grads - sum(waiting)) / 1e9:.2f} B host-updated params"
    if waiting:
        what += f", and one of the {len(waiting)} parts whose gradients wait on the GPU"
    pinned[f"gradients of one step, float32 ({what})"] = max(grads, build)
    ab = 2 if c.dtype in ("bfloat16", "float16") else 4
    offloaded = offloaded_blocks(c.layers, e.prefetch_depth, e.offload_activations)
    flash = _flash(c)
    if offloaded:
        per_block = batch_rows * seq_len * c.hidden * ab + kept_bytes(c, e, batch_rows, seq_len, flash, packed)
        pinned[f"offloaded activations: the inputs of {offloaded} blocks ({batch_rows} x {seq_len} tokens x "
               f"{c.hidden} x {ab} B each" + (", and their kept attention residuals" if kept_bytes(
                   c, e, 1, 1, flash) else "") + ")"] = offloaded * per_block
    arrays = sum(pinned.values())
    fitted = host_pool_limit is None
    if fitted:
        host_pool_limit = fitted_pool_limit(arrays, host_ram_bytes, devices)
    pool = devices * pinned_pool_bytes(-(-arrays // devices), host_pool_limit)
    host = {f"pinned: {k}": v for k, v in pinned.items()}
    cap = "" if host_pool_limit is None else f" of at most {host_pool_limit / GiB:.0f}"
    pools = "" if devices == 1 else f"{devices} pools, one per GPU, each"
    host[f"XLA's pinned pool rounds up: regions double from 2 MiB ({pools}pool {pool / GiB:.1f}{cap} GiB)"] = (
        max(pool - arrays, 0))
    host["CUDA driver's bookkeeping of pinned memory (3.1% of the pool, measured)"] = int(pool * PINNED_RSS_OVERHEAD)
    host.update({f"pageable: {k}": v for k, v in pageable.items()})
    if loaded_copy:
        host["float32 weights loaded into the model object (4 B/param)"] = 4 * P
    tokens = batch_rows * seq_len
    host[f"token batches in flight ({e.accumulate_steps + 2} x {tokens} tokens x {BATCH_BYTES_PER_TOKEN} B)"] = (
        (e.accumulate_steps + 2) * tokens * BATCH_BYTES_PER_TOKEN)
    host["runtime: Python, JAX, CUDA libraries, compiled programs (allowance)"] = HOST_RUNTIME_BYTES

    gpu, at = _gpu_peak(c, e, batch_rows, seq_len, sb, flash, devices, packed)
    return MemoryPlan(host, gpu, host_ram_bytes, gpu_bytes, c, e, batch_rows, seq_len, stream_dtype, packed,
                      loaded_copy, arrays, host_pool_limit, fitted, at, devices, mb * on_disk, disk_bytes)
