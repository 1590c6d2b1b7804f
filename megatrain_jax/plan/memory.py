"""How much host and GPU memory a run needs, before anything is allocated: ``plan()`` and its
``MemoryPlan``.

**GPU.** ``gpu_ledger`` walks the engine's own schedule with a ledger of the device buffers each op
creates and frees, plus the work the GPU still has queued and the running program's scratch memory.

**Host.** Every persistent array lives in host memory (docs/design.md): float32 masters, Adam's moments
and the 16-bit stream copy of *every* part (GPU-resident ones too: host memory is the source of truth),
and the float32 gradients of the host-updated parts. What crosses PCIe is pinned: the gradients, the
stream copy (or the masters, when they are streamed). With the fused AdamW the moments, and the masters of
parts that stream a 16-bit copy, are pageable (only the kernel touches them); another optimizer keeps all
of it pinned. XLA serves pinned memory from a pool whose regions double in size (2 MiB, 4 MiB, ...) up to
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, which ``megatrain-jax train`` fits to the pinned arrays
(``machine.fitted_pool_limit``; importing megatrain_jax sets 90% of RAM otherwise). The process keeps the
whole pool, so the host total is the pool (not the pinned arrays in it), the pageable arrays, and an
allowance for the Python/JAX/CUDA runtime. (A CPU backend has no such pool; the plan counts it anyway.)

The host total is the run's peak from start to exit: training's arrays, and what the end of the run holds beyond
them (``end_of_run``: the GPU-resident parts brought home, the Hugging Face export, a checkpoint's save). A run
whose end would not fit is refused, or given a leaner layout, before it trains.

What fits instead, when this does not, is ``levers``' job. tests/test_memory_plan.py compares the plan
with the peaks measured on GPUs (tests/assets/measured/).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatrain_jax._environment import limit_host_pool, physical_ram_bytes, visible_gpus
from megatrain_jax.checkpoint.failures import format_size
from megatrain_jax.engine import precision
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.program_memory import ProgramMemory
from megatrain_jax.engine.schedule import UPDATES_AHEAD, offloaded_blocks
from megatrain_jax.engine.update import disk_tier
from megatrain_jax.engine.update.moment_formats import FORMATS
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.engine.parts import IO, PartId, part_ids
from megatrain_jax.plan.counts import (BATCH_BYTES_PER_TOKEN, GiB, activation_bytes, blocks_param_count,
                                       host_grad_bytes, host_roles, io_param_count, layer_param_count, leaf_shapes,
                                       moment_bytes, part_param_count, stream_bytes)
from megatrain_jax.plan.activations import assumes_flash, kept_bytes
from megatrain_jax.plan.gpu_ledger import gpu_peak
from megatrain_jax.plan.machine import (GPU_CLIENT_HOST_SHARE, GPU_FRAGMENTATION_MARGIN, HOST_RUNTIME_BYTES,
                                        PINNED_RSS_OVERHEAD, available_disk_bytes, available_gpu_bytes,
                                        available_host_bytes, fitted_pool_limit, pinned_pool_bytes)

# Room in XLA's pinned pool for GPU-updated blocks' records beyond the two a visit holds (``plan``), in records.
ROOM_FOR_RECORDS = 2


class MemoryPlanError(RuntimeError):
    """The run does not fit in host or GPU memory; the message lists the numbers and what would fit."""


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
    programs: ProgramMemory | None = None  # XLA's memory analysis of the compiled programs (GPU at hand)
    export: bool = False  # the run ends with a Hugging Face export (``train.export_hf``)
    checkpoints: bool = False  # the run saves checkpoints

    @property
    def pinned_per_pool(self) -> int:
        """Pinned bytes in each GPU's pool (the state is spread over the GPUs)."""
        return -(-self.host_pinned // self.devices)

    @property
    def mode(self) -> precision.Precision:
        """The precision mode this plan's engine runs in (engine/precision.py)."""
        return precision.mode_of(self.engine_cfg, self.model_cfg.dtype, self.stream_dtype)

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
        """The GPU peak and the allocator's fragmentation margin fit what XLA may use."""
        return self.gpu_available is None or self.gpu_total + GPU_FRAGMENTATION_MARGIN <= self.gpu_available

    @property
    def gpu_exact(self) -> bool:
        """Whether every program's scratch memory on the GPU side is XLA's own figure (``programs``, compiled
        for this run's micro-batch shape), not a rule of thumb."""
        e = self.engine_cfg
        return self.programs is not None and self.programs.matches(
            self.batch_rows // self.devices // e.micro_batches, self.seq_len, stream_bytes(self.stream_dtype),
            self.packed, self.devices, e.keep_residuals, e.kept_layers > 0)

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
                    devices=self.devices, disk_bytes=self.disk_available, programs=self.programs,
                    export=self.export, checkpoints=self.checkpoints)
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

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (bytes): totals, limits, items, the engine config and, where the GPU was at
        hand, XLA's figures for each compiled program."""
        return {"host_total": self.host_total, "host_available": self.host_available, "gpu_total": self.gpu_total,
                "gpu_available": self.gpu_available, "gpu_fragmentation_margin": GPU_FRAGMENTATION_MARGIN,
                "gpu_exact": self.gpu_exact, "gpu_peak_at": self.gpu_peak_at, "fits": self.fits,
                "batch_rows": self.batch_rows, "seq_len": self.seq_len, "devices": self.devices,
                "engine": dataclasses.asdict(self.engine_cfg), "host": dict(self.host), "gpu": dict(self.gpu),
                "programs": None if self.programs is None else self.programs.as_dict()}

    def table(self) -> str:
        c, e = self.model_cfg, self.engine_cfg
        lines = [f"memory plan: {self.params / 1e9:.2f} B params ({c.layers} layers, hidden {c.hidden}, vocab "
                 f"{c.vocab_size}); {self.batch_rows} x {self.seq_len} tokens per pass in {e.micro_batches} "
                 f"micro-batch(es); prefetch_depth {e.prefetch_depth}; weights streamed as {self.stream_dtype}; "
                 f"{e.resident_layers} blocks{' + io' if e.resident_io else ''} GPU-resident; gradients of {e.grads_on_gpu} "
                 f"parts wait on the GPU" + (f"; {e.gpu_updated_layers} streamed blocks updated on the GPU"
                                            if e.gpu_updated_layers not in (0, "auto") else "")]
        source = ("programs' scratch memory from XLA's memory analysis" if self.gpu_exact else
                  "an estimate: programs' scratch memory from rules of thumb")
        gpu_name = f"GPU, at its peak (during {self.gpu_peak_at}, 1st step; {source})"
        sides = (("host RAM", self.host, self.host_available, 0),
                 (gpu_name, self.gpu, self.gpu_available, GPU_FRAGMENTATION_MARGIN))
        for name, items, avail, margin in sides:
            lines.append(f"  {name:<96s} {'GiB':>8s}")
            lines += [f"    {k:<94s} {v / GiB:8.2f}" for k, v in items.items()]
            total = sum(items.values())
            if margin:
                lines.append(f"    {'(kept free: the allocator' + chr(39) + 's fragmentation margin, measured)':<94s} "
                             f"{margin / GiB:8.2f}")
            verdict = ("(no limit known)" if avail is None else
                       f"of {avail / GiB:.2f} available: " + ("fits" if total + margin <= avail
                                                               else f"OVER by {(total + margin - avail) / GiB:.2f} GiB"))
            lines.append(f"    {'total':<94s} {total / GiB:8.2f}  {verdict}")
            if items is self.host and self.host_pool_limit is not None and self.pinned_per_pool > self.host_pool_limit:
                lines.append(f"    OVER by {(self.host_pinned - self.host_pool_limit) / GiB:.2f} GiB: "
                             f"{self.host_pinned / GiB:.2f} GiB of pinned arrays, XLA's pinned pool is capped at "
                             f"{self.host_pool_limit / GiB:.0f} GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
        if self.programs is not None:
            lines.append(f"  compiled programs (XLA's memory analysis, per device; micro-batches of "
                         f"{self.programs.micro_rows} x {self.programs.seq_len} tokens)      GiB: temp, arguments, "
                         f"outputs, aliased")
            lines += [f"    {f.program + ' (' + f.variant + ')':<78s} {f.temp / GiB:8.2f} {f.argument / GiB:8.2f} "
                      f"{f.output / GiB:8.2f} {f.alias / GiB:8.2f}" for f in self.programs.figures]
        if self.disk:
            where = "" if self.disk_available is None else f" of {format_size(self.disk_available)} free: " + (
                "fits" if self.disk_fits else f"OVER by {format_size(self.disk - self.disk_available)}")
            lines.append(f"  disk tier ({self.engine_cfg.disk_parts} blocks' Adam moments in {self.engine_cfg.disk_dir}): "
                         f"{format_size(self.disk)}{where}; each step reads and writes it once")
        lines.append(f"  host bytes per parameter: {self.host_pinned / self.params:.1f} in pinned arrays, "
                     f"{self.host_total / self.params:.1f} in all (each precision mode's: plan.modes)")
        return "\n".join(lines)

    # ------------------------------------------------------------------ what would fit
    def host_bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter of this run in each mode: full precision (float32 masters and moments,
        GPU-resident parts as configured), capacity mode (no GPU-resident parts) and capacity mode with 8-bit
        moments and bfloat16 gradients."""
        e = dataclasses.replace(self.engine_cfg, grads_on_gpu=0, disk_parts=0, gpu_updated_layers=0)
        full, lean, capacity, q8 = (precision.in_mode(e, precision.MODES[name])
                                    for name in ("full", "lean", "capacity", "q8"))
        every = lambda cfg: len(host_roles(self.model_cfg, cfg).host_updated)  # noqa: E731
        modes = {
            "full precision, 16-bit stream copy, gradients in host memory": full,
            "full precision, float32 streamed, gradients in host memory": lean,
            "full precision, float32 streamed, every host-updated gradient waiting on the GPU": dataclasses.replace(
                lean, grads_on_gpu=every(lean)),
            "capacity mode (bfloat16 masters and moments), gradients in host memory": capacity,
            "capacity mode, every gradient waiting on the GPU": dataclasses.replace(
                capacity, grads_on_gpu=every(capacity)),
            "capacity mode, 8-bit moments, bfloat16 gradients in host memory": q8,
        }
        if e.disk_dir:
            modes["full precision, float32 streamed, every non-resident block's moments in the disk tier"] = (
                dataclasses.replace(lean, disk_parts=self.model_cfg.layers - e.resident_layers))
        return {name: self.replace(engine_cfg=cfg, stream_dtype=cfg.stream_dtype).host_total / self.params
                for name, cfg in modes.items()}



def plan(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
         stream_dtype: str | None = None, host_ram_bytes: int | None = None, gpu_bytes: int | None = None,
         *, packed: bool = False, loaded_copy: bool = False, detect: bool = True,
         host_pool_limit: int | None = None, devices: int = 1, disk_bytes: int | None = None,
         programs: ProgramMemory | None = None, export: bool = False, checkpoints: bool = False) -> MemoryPlan:
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
    ``engine_cfg.disk_dir``). ``programs``: XLA's memory analysis of the run's compiled programs
    (``megatrain_jax.engine.program_memory``, on the machine that runs it); their scratch memory replaces
    the rules of thumb where they were compiled for this micro-batch shape (``gpu_exact``). ``export``: the run
    ends with a Hugging Face export; ``checkpoints``: it saves checkpoints (``end_of_run``).
    """
    c, e = model_cfg, engine_cfg
    e.check_rows(batch_rows, devices)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if e.resident_layers > c.layers:
        raise ValueError(f"resident_layers={e.resident_layers} exceeds the model's {c.layers} blocks")
    if e.offload_activations > c.layers:
        raise ValueError(f"offload_activations={e.offload_activations} exceeds the model's {c.layers} blocks")
    e.check_layers(c.layers)
    roles = host_roles(c, e)  # raises where grads_on_gpu or disk_parts ask for more parts than there are
    if detect:
        host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
        gpu_bytes = available_gpu_bytes() if gpu_bytes is None else gpu_bytes
        if disk_bytes is None and e.disk_parts:  # a stopped run's own tier files are room: its resume replaces them
            free = available_disk_bytes(e.disk_dir)
            disk_bytes = None if free is None else free + disk_tier.held_bytes(e.disk_dir, roles.disk)
    mode = precision.mode_of(e, c.dtype, stream_dtype)  # what the host keeps, in which dtype (engine/precision.py)
    stream_dtype = mode.to_gpu_dtype(stream_dtype or e.stream_dtype, c.dtype)
    sb = stream_bytes(stream_dtype)
    P = c.param_count()
    on_host_grads = P - blocks_param_count(c, range(e.resident_layers)) - (io_param_count(c) if e.resident_io else 0)
    waiting = [part_param_count(c, part) for part in roles.grads_on_gpu]  # gradients kept on the GPU
    visiting = [part_param_count(c, part) for part in roles.gpu_updated]  # updated on the GPU: no host gradient
    on_host_grads -= sum(visiting)

    # The fused C++ AdamW (megatrain_jax.adamw, the CLI's optimizer) keeps what only it touches in pageable
    # memory; it runs with float32 or bfloat16 streaming, where a C++ compiler exists (else the engine warns).
    fused = e.host_kernel and stream_dtype in ("float32", "bfloat16")
    pinned, pageable = {}, {}
    mb = mode.moment_bytes  # bytes of Adam moments per parameter, but for 8-bit moments (not on disk)
    on_disk = sum(part_param_count(c, part) for part in roles.disk)  # params whose moments live in files
    in_ram = sum(moment_bytes(c, e, part) for part in part_ids(c.layers) if part not in roles.disk)
    tag = "" if mode.masters == "float32" else f"; {mode.title}"
    moments = "Adam moments m and v, " + (
        f"{FORMATS[mode.moment_dtype].words} for matrices, {mode.moments} for vectors ({in_ram / P:.2f} "
        f"B/param{tag})" if mode.quantized
        else f"{mode.moments} ({mb} B/param{tag})")
    if on_disk:
        moments += f" of the {(P - on_disk) / 1e9:.2f} B params not in the disk tier"
    masters = f"master weights, {mode.masters}"
    if mode.needs_kernel:  # the fused kernel: the masters (streamed themselves) pinned, the moments pageable
        pinned[f"{masters}, streamed ({mode.master_bytes} B/param{tag})"] = mode.master_bytes * P
        pageable[moments] = in_ram
    else:  # only the fused kernel's own arrays are pageable: not the masters where they are streamed
        kernel = sum(visiting) if fused else 0  # the GPU-updated parts' come home in pinned arrays
        (pageable if fused and mode.stream_copy else pinned)[f"{masters} ({mode.master_bytes} B/param)"] = (
            mode.master_bytes * (P - (kernel if mode.stream_copy else 0)))
        (pageable if fused else pinned)[moments] = in_ram - mb * kernel
        if kernel:
            pinned[f"masters and moments of the {len(visiting)} parts updated on the GPU ({mode.master_bytes + mb} "
                   f"B/param, brought over and sent home each step)"] = (
                (mode.master_bytes if mode.stream_copy else 0) + mb) * kernel
    if visiting:  # a visit's new record comes home beside the one it replaces (its copy to the GPU is done)
        record = (mode.master_bytes + mb + (mode.to_gpu_bytes if mode.stream_copy else 0)) * max(visiting)
        pinned["one GPU-updated part's record coming home beside the one it replaces (the largest)"] = record
        # Measured: 13B at 32K tokens with one such block ran out of a pool fitted to these arrays (53.2 GiB,
        # capped at 63) at its first update on the GPU, and held with the cap at 80
        # (experiments/results/h200x2_side_by_side_13b_abfe3c3.json, ..._13b_pool80_abfe3c3.json). Which of the
        # pool's arrays outlive their count is not found (perhaps the records' float32 arrays, a 13B matrix 270
        # MiB, not fitting the holes the bfloat16 gradients leave). Two more records' room, so that the fitted
        # cap holds them.
        pinned["room for GPU-updated records beyond that (two more; a pool fitted without it ran out, "
               "measured)"] = ROOM_FOR_RECORDS * record
    if on_disk:  # the one updating, two read ahead, one being written behind
        pageable[f"disk tier: moments of up to {min(4, e.disk_parts)} blocks in memory (updating, read ahead, "
                 f"written behind)"] = mb * layer_param_count(c) * min(4, e.disk_parts)
    if mode.stream_copy:
        pinned[f"16-bit stream copy of the weights ({mode.to_gpu_bytes} B/param)"] = mode.to_gpu_bytes * P
    # The gradients of the host-updated parts (in ``host_grad_dtype``), but for those waiting on the GPU: of
    # these, one part's at a time comes home in float32, when its update runs. A ``norm_first`` step holds
    # only the parts whose updates the host has not finished: at most UPDATES_AHEAD + 1, counted as the
    # largest that many.
    gb = host_grad_bytes(e)
    grads = gb * (on_host_grads - sum(waiting)) + 4 * max(waiting, default=0)
    what = f"{gb} B/param of the {(on_host_grads - sum(waiting)) / 1e9:.2f} B host-updated params"
    if e.norm_first:
        held = sorted((part_param_count(c, part) for part in roles.host_updated), reverse=True)[:UPDATES_AHEAD + 1]
        grads = gb * sum(held)
        what = (f"norm_first: {gb} B/param of the {len(held)} largest host-updated parts, {sum(held) / 1e9:.2f} B "
                f"params: those whose updates may be unfinished")
    # Building the state, each of up to 4 parts at once passes its masters through pinned memory on its way
    # to pageable memory; the gradients later reuse that room.
    build = 4 * 4 * max(layer_param_count(c), io_param_count(c)) if fused and mode.stream_copy else 0
    if waiting:
        what += f", and one of the {len(waiting)} parts whose gradients wait on the GPU, in float32"
    pinned[f"gradients of one step, {e.host_grad_dtype} ({what})"] = max(grads, build)
    ab = activation_bytes(c)
    offloaded = offloaded_blocks(c.layers, e.prefetch_depth, e.offload_activations)
    flash = assumes_flash(c)
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
    pools = "pool" if devices == 1 else f"{devices} pools, one per GPU, each"
    host[f"XLA's pinned pool rounds up: regions double from 2 MiB ({pools} {pool / devices / GiB:.1f}{cap} GiB)"] = (
        max(pool - arrays, 0))
    host[f"pinned memory beyond the pool's regions, and the CUDA driver's bookkeeping of them "
         f"({PINNED_RSS_OVERHEAD:.0%} of the pool, measured)"] = int(pool * PINNED_RSS_OVERHEAD)
    host.update({f"pageable: {k}": v for k, v in pageable.items()})
    if loaded_copy:
        host["float32 weights loaded into the model object (4 B/param)"] = 4 * P
    tokens = batch_rows * seq_len
    host[f"token batches in flight ({e.accumulate_steps + 2} x {tokens} tokens x {BATCH_BYTES_PER_TOKEN} B)"] = (
        (e.accumulate_steps + 2) * tokens * BATCH_BYTES_PER_TOKEN)
    host["runtime: Python, JAX, CUDA libraries, compiled programs (allowance)"] = HOST_RUNTIME_BYTES
    if gpu_bytes:  # each GPU's client, in proportion to what XLA takes of it
        host[f"the GPU client's host memory ({GPU_CLIENT_HOST_SHARE:.2%} of the {gpu_bytes / GiB:.1f} GiB XLA takes"
             + (f" of each of {devices} GPUs" if devices > 1 else "") + ", measured)"] = int(
                 GPU_CLIENT_HOST_SHARE * gpu_bytes * devices)
    what, end = end_of_run(c, e, mode, fused, export, checkpoints, pool_room=max(pool - arrays, 0))
    if end:
        host[what] = end

    gpu, at = gpu_peak(c, e, batch_rows, seq_len, sb, flash, devices, packed, programs)
    return MemoryPlan(host, gpu, host_ram_bytes, gpu_bytes, c, e, batch_rows, seq_len, stream_dtype, packed,
                      loaded_copy, arrays, host_pool_limit, fitted, at, devices, mb * on_disk, disk_bytes, programs,
                      export, checkpoints)


# A checkpoint's save writes every part from the state's own arrays: 0.04 GiB more host memory during a 7B save
# (experiments/results/h200x2_checkpoint_7b.json, docs/checkpoints.md).
CHECKPOINT_SAVE_BYTES = int(0.04 * GiB)


def end_of_run(c: DecoderConfig, e: EngineConfig, mode: precision.Precision, fused: bool, export: bool,
               checkpoints: bool, pool_room: int = 0) -> tuple[str, int]:
    """What the end of a run holds beyond training's arrays, at its most, and the words: the GPU-resident parts
    brought home (``Engine.sync``: with the fused AdamW a leaf at a time through a pinned temporary, into the
    part's own host arrays, ``HostOptimizer.home_into``; otherwise a part at a time, as new arrays), a checkpoint's
    save, and the Hugging Face export (one tensor's cast copy: ``hf.export.peak_bytes``). They run one after the
    other, so the most of them counts. Their arrays (the resident parts' moments too, untouched until then: a
    run from a checkpoint folder starts with zero pages) are training's items already. The resident parts come
    home through pinned memory, which XLA's pool serves: only what exceeds the pool's room beyond the pinned
    arrays (``pool_room``, no step in flight then) is more host memory."""
    items = {}
    resident = ([IO] if e.resident_io else []) + [PartId.block(i) for i in range(e.resident_layers)]
    if resident and fused:
        leaf = max(math.prod(shape) for part in resident for shape in leaf_shapes(c, part))
        items["the GPU-resident parts brought home, a leaf at a time through pinned memory"] = max(
            4 * leaf - pool_room, 0)
    elif resident:
        per_param = mode.master_bytes + mode.moment_bytes + (mode.to_gpu_bytes if mode.stream_copy else 0)
        items["the GPU-resident parts brought home, a part at a time as new pinned arrays"] = max(per_param * max(
            part_param_count(c, part) for part in resident) - pool_room, 0)
    if checkpoints:
        items["a checkpoint's save (measured at 7B)"] = CHECKPOINT_SAVE_BYTES
    if export:
        from megatrain_jax.hf.export import peak_bytes
        items["the Hugging Face export, a tensor at a time"] = peak_bytes(c)
    if not any(items.values()):
        return "", 0
    name, most = max(items.items(), key=lambda kv: kv[1])
    rest = "; ".join(k for k, v in items.items() if k != name and v)
    return f"end of run, beyond training's arrays: {name}" + (f" (the largest; also {rest})" if rest else ""), most


def fit_host_pool(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                  **plan_kw) -> bool:
    """Before JAX starts its GPU backend: cap XLA's pinned pool at what this run pins
    (``fitted_pool_limit``), as ``megatrain-jax train`` does. Returns whether the cap was set (not where the
    user set one, nor once JAX's backends have started). ``devices`` (in ``plan_kw``) defaults to the GPUs
    this process will see: the engine spreads over all of them by default."""
    plan_kw.setdefault("devices", visible_gpus())
    p = plan(model_cfg, engine_cfg, batch_rows, seq_len, host_ram_bytes=physical_ram_bytes(), detect=False,
             **plan_kw)
    return limit_host_pool(p.host_pool_limit)

