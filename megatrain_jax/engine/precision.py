"""The precision modes, one record each (``MODES``): what a mode keeps in host memory and in which dtype, what
crosses PCIe, what it needs and what it excludes, the settings it comes with, its host kernel and how its
checkpoints convert. Every reader asks here (``mode_of``): the config's checks, the host optimizer, the passes,
the memory plan, the checkpoint and the config file. A new mode (6-bit moments, say) is one record here, its
kernel entry point, and a line of ``tests/test_precision.py``; docs/contributing.md says how.

A mode is chosen by ``EngineConfig.master_dtype`` and ``moment_dtype``; full precision has two host layouts,
told apart by what streams (``EngineConfig.stream_dtype``, else the model's compute dtype): a 16-bit stream
copy beside the float32 masters (``FULL``), or the float32 masters themselves (``LEAN``, what ``plan.lean``
picks when host RAM is short). ``host_grad_dtype`` is a choice within the modes that allow it.

Plain Python, as ``engine.config``: the memory plan and the config file read it without importing JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from megatrain_jax.engine.config import EngineConfig

Kernel = Literal["adamw", "adamw_sr", "adamw_q8", "adamw_m7v5"]
SIXTEEN_BITS = ("bfloat16", "float16")  # a stream dtype of these keeps a 16-bit copy beside float32 masters
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Precision:
    """One precision mode. Bytes are per parameter; a role a mode lacks is 0.

    - ``master_dtype``, ``moment_dtype``: the ``EngineConfig`` values that choose it (``mode_of``). A
      ``moment_dtype`` names a quantized format of the matrices' moments (``QUANTIZED``: ``q8``, ``m7v5``).
    - ``masters``: the masters' dtype on the host, which is also what streams unless ``stream_copy``.
    - ``moments``: the dtype of Adam's m and v where a leaf keeps them whole (``moment_bytes`` for both):
      every leaf, or those the quantized format leaves whole (``moments_of``).
    - ``stream_copy``: a 16-bit copy of the weights (2 B/param, pinned) is what crosses PCIe to the GPU,
      written by the update; else the masters themselves cross (pinned), and there is no copy.
    - ``host_grad_dtypes``: the dtypes gradients may come home in (``EngineConfig.host_grad_dtype``); the
      first is the default.
    - ``host_only``: every part updates on the host (no GPU-resident parts). ``needs_kernel``: runs only in
      the fused C++ host kernel (``megatrain_jax.adamw``). ``disk_tier``: the disk tier may hold its moments.
    - ``bundle``: the ``engine.*`` settings that switch it on, as the memory plan's advice applies them
      (the mode's own dtypes and what comes with them).
    - ``kernel``: the fused host kernel's entry point (``host_optimizer.KERNELS``): ``adamw`` (C++
      ``megatrain_adamw``, which also writes the stream copy), ``adamw_sr`` (``megatrain_adamw_bf16_sr``:
      16-bit masters and moments written with stochastic rounding, keyed by ``host_optimizer.rounding_seed``),
      ``adamw_q8`` (``megatrain_adamw_q8`` for the 8-bit matrices, ``adamw_sr`` for the rest), ``adamw_m7v5``
      (``megatrain_adamw_m7v5``: 7-bit m, 5-bit v, ``adamw_sr`` for the rest).
    - ``summary``: what the mode keeps, in the words the plan's advice and ``train``'s sentences use.
    - ``checkpoint``: what a checkpoint holds (the stream copy never: a restore remakes it) and what converts;
      ``resumes`` says which modes' checkpoints this one resumes.
    - ``quality``: what training in it costs against float32 masters and moments, as measured (the quality
      table of docs/capacity.md: a 1B model's held-out loss); ``train`` says it where it picks the mode itself.
      ``quality_met``: whether that is within the table's bar (1.5%), None where not yet measured; ``plan``'s
      table of modes marks those that are not, and those not measured.
    """

    name: str
    title: str
    master_dtype: str
    moment_dtype: str | None
    masters: str
    moments: str
    stream_copy: bool
    host_grad_dtypes: tuple[str, ...]
    host_only: bool
    needs_kernel: bool
    disk_tier: bool
    bundle: tuple[tuple[str, Any], ...]
    kernel: Kernel
    summary: str
    checkpoint: str
    quality: str
    quality_met: bool | None

    # ------------------------------------------------------------------ bytes
    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.masters]

    @property
    def moment_bytes(self) -> int:
        """Bytes per parameter of m and v together, kept whole."""
        return 2 * DTYPE_BYTES[self.moments]

    @property
    def quantized(self) -> bool:
        """Whether the matrices' moments are in a quantized format (``moment_dtype``, ``QUANTIZED``)."""
        return self.moment_dtype is not None

    @property
    def stochastic(self) -> bool:
        """16-bit masters and moments are written with stochastic rounding (unbiased), float32 ones to nearest."""
        return self.masters != "float32"

    @property
    def to_gpu_bytes(self) -> int:
        """Bytes per parameter of the weights sent to the GPU for each visit of a part."""
        return 2 if self.stream_copy else self.master_bytes

    def to_gpu_dtype(self, stream_dtype: str | None, model_dtype: str) -> str:
        """The dtype the weights cross PCIe in: the stream copy's (``stream_dtype``, else the model's compute
        dtype), or the masters' where they are streamed themselves."""
        return (stream_dtype or model_dtype) if self.stream_copy else self.masters

    def moments_of(self, shape: tuple[int, ...]) -> int:
        """Host bytes of both Adam moments of one leaf of this shape."""
        quantized = QUANTIZED[self.moment_dtype](shape) if self.quantized else None
        return self.moment_bytes * math.prod(shape) if quantized is None else quantized

    def bytes_per_param(self, host_grad_dtype: str | None = None, shape: tuple[int, ...] = (4096, 4096)
                        ) -> dict[str, float]:
        """Host bytes per parameter by role, for a leaf of ``shape`` (a large matrix by default; 8-bit
        moments depend on it) and gradients coming home in ``host_grad_dtype`` (default: the mode's)."""
        grads = host_grad_dtype or self.host_grad_dtypes[0]
        return {"masters": self.master_bytes, "moments": self.moments_of(shape) / math.prod(shape),
                "stream_copy": 2 if self.stream_copy else 0, "host_grads": DTYPE_BYTES[grads]}

    # ------------------------------------------------------------------ checkpoints
    def resumes(self, other: Precision) -> bool:
        """Whether a checkpoint written in mode ``other`` resumes in this one: the masters must be of one
        dtype; the moments convert between bfloat16 and 8 bits (``checkpoint.parts.moment_formats``)."""
        return other.masters == self.masters


def _quantized_bytes(name: str):
    """Both moments of a leaf in format ``name`` (``moment_formats.FORMATS``): codes and a float32 scale per
    block of a row; None for the leaves that keep whole moments."""
    def moment_bytes(shape: tuple[int, ...]) -> int | None:
        from megatrain_jax.engine.update.moment_formats import FORMATS  # (imports JAX: only when asked)
        return FORMATS[name].moment_bytes(shape)
    return moment_bytes


# Each quantized moment format (a ``moment_dtype``): the host bytes of both moments of a leaf of a shape, or
# None where the leaf keeps them whole. The formats themselves: ``engine.update.moment_formats``.
QUANTIZED = {name: _quantized_bytes(name) for name in ("q8", "m7v5")}

FULL = Precision(
    name="full", title="full precision", master_dtype="float32", moment_dtype=None, masters="float32",
    moments="float32", stream_copy=True, host_grad_dtypes=("float32", "bfloat16"), host_only=False,
    needs_kernel=False, disk_tier=True, bundle=(("engine.stream_dtype", "bfloat16"),), kernel="adamw",
    summary="float32 masters and Adam moments, a 16-bit copy of the weights streamed",
    checkpoint="float32 masters and moments; the 16-bit stream copy is remade from the masters on restore",
    quality="the reference: the same numbers as an in-memory jax.grad and optax AdamW step", quality_met=True)
LEAN = dataclasses.replace(
    FULL, name="lean", title="the lean full-precision mode", stream_copy=False,
    bundle=(("engine.stream_dtype", "float32"),),
    summary="float32 masters and Adam moments, the masters streamed (no 16-bit copy)",
    checkpoint="float32 masters and moments, as full precision's (the two resume each other's)")
CAPACITY = Precision(
    name="capacity", title="capacity mode", master_dtype="bfloat16", moment_dtype=None, masters="bfloat16",
    moments="bfloat16", stream_copy=False, host_grad_dtypes=("float32", "bfloat16"),
    host_only=True, needs_kernel=True, disk_tier=True,
    bundle=(("engine.master_dtype", "bfloat16"), ("engine.stream_dtype", "bfloat16"),
            ("engine.resident_layers", 0), ("engine.resident_io", False), ("engine.gpu_updated_layers", 0),
            ("engine.gpu_updated_io", False)),
    kernel="adamw_sr",
    summary="bfloat16 masters and Adam moments, stochastically rounded (no 16-bit copy)",
    checkpoint="bfloat16 masters and moments; quantized moments of another checkpoint are dequantized on restore",
    quality=("a held-out loss within 0.1% of float32's on a 1B model, the mean of three seeds "
             "(quality: docs/capacity.md)"), quality_met=True)
Q8 = dataclasses.replace(
    CAPACITY, name="q8", title="capacity mode with 8-bit moments", moment_dtype="q8",
    host_grad_dtypes=("bfloat16", "float32"), disk_tier=False,
    bundle=CAPACITY.bundle + (("engine.moment_dtype", "q8"), ("engine.host_grad_dtype", "bfloat16"),
                              ("engine.disk_parts", 0)),
    kernel="adamw_q8",
    summary="bfloat16 masters, 8-bit Adam moments and bfloat16 gradients in host memory, stochastically rounded",
    checkpoint="bfloat16 masters, 8-bit moments (codes and scales) for matrices; a capacity-mode "
               "checkpoint's bfloat16 moments are quantized on restore",
    quality=("a held-out loss within 0.2% of float32's on a 1B model, the mean of three seeds "
             "(quality: docs/capacity.md)"))

M7V5 = dataclasses.replace(
    Q8, name="m7v5", title="capacity mode with 7-bit m and 5-bit v", moment_dtype="m7v5",
    bundle=tuple((key, "m7v5" if key == "engine.moment_dtype" else value) for key, value in Q8.bundle),
    kernel="adamw_m7v5",
    summary="bfloat16 masters, Adam's m in 7 bits and v in 5, bfloat16 gradients in host memory, stochastically "
            "rounded",
    checkpoint="bfloat16 masters, m's 7-bit and v's 5-bit codes and scales for matrices; bfloat16 or 8-bit moments "
               "of another checkpoint are converted on restore",
    quality=("a held-out loss within 0.5% of float32's on a 1B model, the mean of three seeds "
             "(quality: docs/capacity.md)"), quality_met=True)
MODES: dict[str, Precision] = {mode.name: mode for mode in (FULL, LEAN, CAPACITY, Q8, M7V5)}
# Moment formats that are gone, and what to do with a config or checkpoint that names them: both trained worse
# than the quality table's bar allows (docs/capacity.md), and m7v5 has m8v4's bytes.
REMOVED_MOMENT_DTYPES = {
    "q4": "4-bit moments were removed: their held-out loss was 3.2% above float32's on the 1B quality table",
    "m8v4": "8-bit m with 4-bit v (m8v4) was removed: its held-out loss was 1.6% above float32's on the 1B "
            "quality table, and m7v5 keeps the same bytes at 0.4% (docs/capacity.md)"}
CONVERT_REMOVED = ("a checkpoint saved in it resumes with megatrain_jax at commit ebb2e98 in capacity mode "
                   "(engine.moment_dtype unset); save there, and that checkpoint resumes here in any capacity mode")


def removed_moments(name: str) -> str:
    """Why the moment format ``name`` (of ``REMOVED_MOMENT_DTYPES``) is gone, and what to set instead."""
    return f"{REMOVED_MOMENT_DTYPES[name]}. Set it to 'm7v5' (the same bytes) or 'q8'; {CONVERT_REMOVED}"


MASTER_DTYPES = tuple(dict.fromkeys(mode.master_dtype for mode in MODES.values()))
MOMENT_DTYPES = tuple(dict.fromkeys(mode.moment_dtype for mode in MODES.values() if mode.moment_dtype))
HOST_GRAD_DTYPES = tuple(dict.fromkeys(d for mode in MODES.values() for d in mode.host_grad_dtypes))


def mode_of(cfg: EngineConfig, model_dtype: str = "bfloat16", stream_dtype: str | None = None) -> Precision:
    """The record of ``cfg``'s mode. What streams (``stream_dtype``, else ``cfg.stream_dtype``, else the model's
    compute dtype ``model_dtype``) tells full precision's two layouts apart, and nothing else."""
    sixteen = (stream_dtype or cfg.stream_dtype or model_dtype) in SIXTEEN_BITS
    for mode in MODES.values():
        copy = sixteen and mode.master_bytes > 2  # a 16-bit stream beside wider masters is a copy of them
        if (mode.master_dtype, mode.moment_dtype) == (cfg.master_dtype, cfg.moment_dtype) and mode.stream_copy == copy:
            return mode
    raise ValueError(f"no precision mode has master_dtype={cfg.master_dtype!r} and moment_dtype={cfg.moment_dtype!r}")


def switch(cfg: EngineConfig, mode: Precision, stream_dtype: str | None = None) -> tuple[tuple[str, Any], ...]:
    """The ``engine.*`` changes that put ``cfg`` in ``mode`` (its dtypes, host gradients in the mode's default,
    and its ``bundle``), leaving out what ``cfg`` has already; ``stream_dtype``: what ``cfg`` streams where it
    leaves ``stream_dtype`` unset (the model's compute dtype)."""
    now = {**{f"engine.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
           "engine.stream_dtype": cfg.stream_dtype or stream_dtype}
    to = {"engine.master_dtype": mode.master_dtype, "engine.moment_dtype": mode.moment_dtype,
          "engine.host_grad_dtype": mode.host_grad_dtypes[0], **dict(mode.bundle)}
    return tuple((key, value) for key, value in to.items() if now[key] != value)


def lower(mode: Precision) -> list[Precision]:
    """The modes that store less than ``mode`` (later in ``MODES`` with other stored dtypes), in order: what the
    memory plan may offer a run that does not fit. Full precision's two layouts differ only in what
    streams, which the plan offers apart (its stream lever)."""
    order = list(MODES.values())
    return [m for m in order[order.index(mode) + 1:] if m not in layouts(mode) + [mode]]


def layouts(mode: Precision) -> list[Precision]:
    """The other modes that store what ``mode`` stores and differ only in what crosses PCIe (full
    precision's stream copy or its streamed masters)."""
    stored = lambda m: (m.masters, m.moments, m.moment_dtype)  # noqa: E731
    return [m for m in MODES.values() if m is not mode and stored(m) == stored(mode)]


def in_mode(cfg: EngineConfig, mode: Precision) -> EngineConfig:
    """``cfg`` switched to ``mode`` (``switch``)."""
    return dataclasses.replace(cfg, **{key.removeprefix("engine."): value for key, value in switch(cfg, mode)})


def streamed_dtype(cfg: EngineConfig, model_dtype: str, stream_dtype: str | None = None) -> str:
    """The dtype ``cfg``'s weights cross PCIe in, for a model computing in ``model_dtype`` (``stream_dtype``:
    one that replaces ``cfg``'s)."""
    return mode_of(cfg, model_dtype, stream_dtype).to_gpu_dtype(stream_dtype or cfg.stream_dtype, model_dtype)


def check_precision(cfg: EngineConfig) -> None:
    """Raise ValueError saying what to set unless ``cfg``'s precision settings make one mode and the rest of
    ``cfg`` is what that mode can run with (``EngineConfig.__post_init__`` calls it)."""
    either = lambda values: " or ".join(repr(v) for v in values)  # noqa: E731
    if cfg.master_dtype not in MASTER_DTYPES:
        first = {m.master_dtype: m.title for m in reversed(MODES.values())}  # the first mode of each
        modes = "; ".join(f"{d}: {title}" for d, title in reversed(first.items()))
        raise ValueError(f"EngineConfig.master_dtype must be {either(MASTER_DTYPES)} ({modes}), "
                         f"got {cfg.master_dtype!r}")
    if cfg.moment_dtype in REMOVED_MOMENT_DTYPES:
        raise ValueError(f"EngineConfig.moment_dtype={cfg.moment_dtype!r}: {removed_moments(cfg.moment_dtype)}")
    if cfg.moment_dtype is not None and cfg.moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"EngineConfig.moment_dtype must be unset (the masters' dtype) or {either(MOMENT_DTYPES)} "
                         f"({', '.join(m.title for m in MODES.values() if m.moment_dtype)}), got {cfg.moment_dtype!r}")
    if cfg.host_grad_dtype not in HOST_GRAD_DTYPES:
        raise ValueError(f"EngineConfig.host_grad_dtype must be {either(HOST_GRAD_DTYPES)}, got "
                         f"{cfg.host_grad_dtype!r}")
    takes = {"moment_dtype": lambda m: m.moment_dtype == cfg.moment_dtype,
             "host_grad_dtype": lambda m: cfg.host_grad_dtype in m.host_grad_dtypes}
    for name, takes_it in takes.items():
        modes = [m for m in MODES.values() if takes_it(m)]
        if cfg.master_dtype not in {m.master_dtype for m in modes}:  # a setting of other modes only
            raise ValueError(f"engine.{name} = {getattr(cfg, name)!r} is part of {modes[0].title}: set "
                             f"master_dtype = '{modes[0].master_dtype}' too, or leave {name} unset")
    mode = mode_of(cfg)
    if cfg.disk_parts and not mode.disk_tier:
        raise ValueError(f"the disk tier (disk_parts) holds bfloat16 or float32 moments, not quantized ones ({mode.title}, "
                         f"moment_dtype={mode.moment_dtype!r}): set disk_parts = 0 or leave moment_dtype unset")
    if not mode.stream_copy and cfg.stream_dtype not in (None, mode.masters):
        raise ValueError(f"{mode.title} (master_dtype={mode.master_dtype!r}) streams the {mode.masters} masters: "
                         f"leave stream_dtype unset or {mode.masters!r}, not {cfg.stream_dtype!r}")
    from megatrain_jax.engine.config import AUTO  # (config imports this module: read once it is loaded)
    if mode.host_only and (cfg.resident_layers not in (0, AUTO) or cfg.resident_io):
        raise ValueError(f"{mode.title} (master_dtype={mode.master_dtype!r}) updates every part on the host with "
                         f"stochastic rounding: set resident_layers = 0 and resident_io = false")
    if mode.needs_kernel and not cfg.host_kernel:
        raise ValueError(f"{mode.title} (master_dtype={mode.master_dtype!r}) runs in the fused host kernel: "
                         f"leave host_kernel = true")
