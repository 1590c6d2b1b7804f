"""How much host and GPU memory a run needs, before anything is allocated.

Host RAM holds every persistent array (docs/design.md): float32 master weights, Adam's two moments, the
float32 gradients of one step, and a 16-bit copy of the weights when the stream dtype is 16-bit. The GPU
holds only what is in flight: ``prefetch_depth + 1`` layers of streamed weights, the float32 gradient
accumulator of the layer in backward (and of the one draining to host), the io part (embedding, head)
with its float32 gradient, the activations at every layer boundary, one layer's recompute activations
per micro-batch and the chunked logits of the loss.

The numbers are estimates from shapes (the transient terms are rules of thumb), good to some 10-20%:
enough to tell a plan that fits from one that will be OOM-killed an hour in.
"""

from __future__ import annotations

import dataclasses
import math

from megatrain_jax.engine_config import EngineConfig
from megatrain_jax.models.config import DecoderConfig

GiB = 1024**3
HOST_RUNTIME_BYTES = 3 * GiB  # Python, JAX/XLA runtime, compiled programs
GPU_RUNTIME_BYTES = 1 * GiB  # XLA workspaces and allocator fragmentation


class MemoryPlanError(RuntimeError):
    """The run does not fit in host or GPU memory; the message lists the numbers and what would fit."""


def io_param_count(cfg: DecoderConfig) -> int:
    """Embedding, final norm and (untied) head."""
    return cfg.vocab_size * cfg.hidden + cfg.hidden + (0 if cfg.tie_embeddings else cfg.hidden * cfg.vocab_size)


def layer_param_count(cfg: DecoderConfig) -> int:
    return (cfg.param_count() - io_param_count(cfg)) // cfg.layers


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


def available_gpu_bytes() -> int | None:
    """The accelerator allocator's limit (``memory_stats()['bytes_limit']``), None on CPU."""
    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    stats = dev.memory_stats() or {}
    return stats.get("bytes_limit")


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
        return self.host_available is None or self.host_total <= self.host_available

    @property
    def gpu_fits(self) -> bool:
        return self.gpu_available is None or self.gpu_total <= self.gpu_available

    @property
    def fits(self) -> bool:
        return self.host_fits and self.gpu_fits

    def replace(self, **changes) -> "MemoryPlan":
        """The plan of the same run with ``model_cfg``, ``engine_cfg``, ``batch_rows`` ... changed."""
        args = dict(model_cfg=self.model_cfg, engine_cfg=self.engine_cfg, batch_rows=self.batch_rows,
                    seq_len=self.seq_len, stream_dtype=self.stream_dtype, host_ram_bytes=self.host_available,
                    gpu_bytes=self.gpu_available, packed=self.packed, loaded_copy=self.loaded_copy,
                    detect=False)
        args.update(changes)
        return plan(**args)

    def table(self) -> str:
        c, e = self.model_cfg, self.engine_cfg
        lines = [f"memory plan: {self.params / 1e9:.2f} B params ({c.layers} layers, hidden {c.hidden}, vocab "
                 f"{c.vocab_size}); {self.batch_rows} x {self.seq_len} tokens per pass in {e.micro_batches} "
                 f"micro-batch(es); prefetch_depth {e.prefetch_depth}; weights streamed as {self.stream_dtype}"]
        for name, items, avail in (("host RAM", self.host, self.host_available),
                                   ("GPU", self.gpu, self.gpu_available)):
            lines.append(f"  {name:<60s} {'GiB':>9s}")
            lines += [f"    {k:<58s} {v / GiB:9.2f}" for k, v in items.items()]
            total = sum(items.values())
            verdict = ("(no limit known)" if avail is None else
                       f"of {avail / GiB:.2f} available: " + ("fits" if total <= avail
                                                               else f"OVER by {(total - avail) / GiB:.2f} GiB"))
            lines.append(f"    {'total':<58s} {total / GiB:9.2f}  {verdict}")
        lines.append(f"  host bytes per parameter: {self.host_total / self.params:.1f}")
        return "\n".join(lines)

    def options(self) -> list[str]:
        """Changes to the run (as config keys) that would make it fit, each checked by re-planning."""
        out: list[str] = []
        e, rows = self.engine_cfg, self.batch_rows
        if not self.gpu_fits:
            for m in range(e.micro_batches + 1, rows + 1):
                if rows % m == 0 and self.replace(engine_cfg=dataclasses.replace(e, micro_batches=m)).gpu_fits:
                    out.append(f"smaller micro-batches: engine.micro_batches = {m} ({rows // m} rows each)")
                    break
            if self.stream_dtype == "float32" and self.replace(stream_dtype="bfloat16").gpu_fits:
                out.append("stream 16-bit weights: engine.stream_dtype = 'bfloat16' (host keeps a bf16 copy, "
                           "+2 B/param)")
            if e.prefetch_depth > 1 and self.replace(engine_cfg=dataclasses.replace(e, prefetch_depth=1)).gpu_fits:
                out.append("prefetch fewer layers: engine.prefetch_depth = 1")
            r = rows // 2
            while r >= 1:
                fit_m = next((m for m in range(1, r + 1) if r % m == 0 and self.replace(
                    batch_rows=r, engine_cfg=dataclasses.replace(e, micro_batches=m)).gpu_fits), None)
                if fit_m is not None:
                    out.append(f"fewer rows per step: data.batch_size = {r} with engine.micro_batches = {fit_m} "
                               f"(engine.accumulate_steps = {max(1, rows // r)} keeps the tokens per step)")
                    break
                r //= 2
        if not self.host_fits and self.stream_dtype != "float32":
            if self.replace(stream_dtype="float32").host_fits:
                out.append("no 16-bit host copy: engine.stream_dtype = 'float32' (saves 2 B/param of host RAM, "
                           "doubles the bytes sent per layer)")
        if not self.fits:
            layers = next((n for n in range(self.model_cfg.layers - 1, 0, -1)
                           if self.replace(model_cfg=self.model_cfg.replace(layers=n)).fits), None)
            if layers is not None:
                out.append(f"a smaller model: model.layers = {layers} fits as configured otherwise")
        if not self.host_fits:
            out.append(f"a machine with at least {math.ceil(self.host_total / GiB)} GiB of free host RAM")
        return out

    def check(self) -> None:
        """Raise MemoryPlanError with the table and the options that fit, unless the run fits."""
        if self.fits:
            return
        where = " and ".join(n for n, ok in (("host RAM", self.host_fits), ("GPU memory", self.gpu_fits)) if not ok)
        opts = self.options()
        advice = ("options that fit:\n" + "\n".join(f"  - {o}" for o in opts)) if opts else \
            "no single change found that fits; reduce the model or the tokens per step"
        raise MemoryPlanError(f"this run does not fit in {where}.\n{self.table()}\n{advice}\n"
                              f"(set train.memory_check = false to start anyway)")


def plan(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
         stream_dtype: str | None = None, host_ram_bytes: int | None = None, gpu_bytes: int | None = None,
         *, packed: bool = False, loaded_copy: bool = False, detect: bool = True) -> MemoryPlan:
    """The memory needed to train ``model_cfg`` on batches of ``batch_rows`` x ``seq_len`` tokens.

    ``stream_dtype`` is the dtype of the weights sent to the GPU (default: ``engine_cfg.stream_dtype``, else
    the model's compute dtype). Limits not given are read from this machine when ``detect`` (host:
    MemAvailable; GPU: the allocator's bytes_limit). ``packed`` rows have segment masks, which take
    attention off the cuDNN flash path and materialize the score matrix. ``loaded_copy``: the model
    object holds float32 weights loaded from a checkpoint for the whole run (``fit`` keeps the model).
    """
    c, e = model_cfg, engine_cfg
    if batch_rows < 1 or seq_len < 1 or batch_rows % e.micro_batches:
        raise ValueError(f"batch_rows={batch_rows} must be >= 1 and divisible by micro_batches={e.micro_batches}; "
                         f"seq_len={seq_len} must be >= 1")
    stream_dtype = stream_dtype or e.stream_dtype or c.dtype
    P, Pl, Pio = c.param_count(), layer_param_count(c), io_param_count(c)
    sb = 2 if stream_dtype in ("bfloat16", "float16") else 4
    ab = 2 if c.dtype in ("bfloat16", "float16") else 4  # activations in the compute dtype
    tokens, micro_rows = batch_rows * seq_len, batch_rows // e.micro_batches
    micro_tokens = micro_rows * seq_len
    host = {
        "master weights, float32 (4 B/param)": 4 * P,
        "Adam moments m and v, float32 (8 B/param)": 8 * P,
        # Counted for every parameter, though GPU-resident parts keep theirs on the device: measured host
        # peaks (7B, 14 of 32 blocks + io resident: 120.1 GiB, this plan 120.4) carry about as much again in
        # init temporaries and pinned-pool chunks XLA keeps, which nothing else here counts.
        "gradients of one step, float32 (4 B/param)": 4 * P,
    }
    if sb == 2:
        host["16-bit stream copy of the weights (2 B/param)"] = 2 * P
    if loaded_copy:
        host["float32 weights loaded into the model object (4 B/param)"] = 4 * P
    # XLA may not update a part in place (no donation on the CPU client), so allow a second copy of the
    # largest part's weights, moments and stream copy, plus its scaled gradient (measured: 3.5B on an H100
    # peaks at 69 GiB of host RSS, about 4 GiB above the persistent arrays)
    host[f"optimizer update temporaries of the largest part ({max(Pio, Pl) / 1e6:.0f} M params)"] = (
        max(Pio, Pl) * (4 + 8 + 4 + (sb if sb == 2 else 0)))
    host[f"batches in flight ({e.accumulate_steps + 2} x {batch_rows} x {seq_len} x 5 int32 arrays)"] = (
        (e.accumulate_steps + 2) * tokens * 5 * 4)
    host["runtime: Python, JAX, compiled programs (allowance)"] = HOST_RUNTIME_BYTES
    flash = c.attention_impl == "cudnn" or (c.attention_impl == "auto" and ab == 2 and not packed)
    gpu = {
        f"streamed layer weights ({e.prefetch_depth + 1} layers x {Pl / 1e6:.0f} M x {sb} B)":
            (e.prefetch_depth + 1) * Pl * sb,
        "layer gradient accumulators, float32 (2 layers: accumulating, draining)": 2 * Pl * 4,
        f"io part: weights ({sb} B) + float32 gradient, {Pio / 1e6:.0f} M params": Pio * (sb + 4),
        f"boundary activations ({c.layers + 1} x {tokens} tokens x {c.hidden} x {ab} B)":
            (c.layers + 1) * tokens * c.hidden * ab,
        "gradient w.r.t. the last hidden state, all micro-batches": tokens * c.hidden * ab,
        f"one layer's recompute activations ({micro_tokens} tokens per micro-batch)":
            micro_tokens * (c.hidden * 10 + c.ffn * 4) * ab,
        f"chunked logits ({min(c.loss_chunk_tokens, micro_tokens)} tokens x {c.vocab_size} x 4 B x 3)":
            min(c.loss_chunk_tokens, micro_tokens) * c.vocab_size * 4 * 3,
    }
    resident = getattr(e, "resident_layers", 0) * Pl + (Pio if getattr(e, "resident_io", False) else 0)
    if resident:  # weights, Adam state and gradients kept on the GPU (megatrain_jax.resident): ~18 B/param
        gpu[f"GPU-resident parts with optimizer state ({resident / 1e6:.0f} M params x 18 B)"] = 18 * resident
    if not flash:
        gpu[f"attention scores, not flash ({micro_rows} x {c.heads} heads x {seq_len}^2 x 4 B x 3)"] = (
            micro_rows * c.heads * seq_len * seq_len * 4 * 3)
    gpu["XLA workspace and fragmentation (allowance)"] = GPU_RUNTIME_BYTES
    if detect:
        host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
        gpu_bytes = available_gpu_bytes() if gpu_bytes is None else gpu_bytes
    return MemoryPlan(host, gpu, host_ram_bytes, gpu_bytes, c, e, batch_rows, seq_len, stream_dtype, packed,
                      loaded_copy)

