"""A machine's rates, as the step-time model (``step_time``) reads them: the GPU's compute, PCIe each way, the
GPU's memory, the host update per precision mode, the disk tier, and the Python thread's cost per op.

``SPEEDS`` holds one record per GPU kind, fitted to the runs committed under experiments/results (each
record's ``source`` names them; ``experiments/step_time_vs_runs.py`` refits and checks them). A
calibration file (JSON with any of ``Speeds``' fields, e.g. from a run on the machine at hand) replaces them:
``for_gpu(name, file)``, ``megatrain-jax plan --speeds FILE``, or ``MEGATRAIN_SPEEDS=FILE``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

SPEEDS_VAR = "MEGATRAIN_SPEEDS"
# The host update's rate against the host's cores: the fused kernels ran 2.05x (capacity) and 2.73x (8-bit
# moments) faster on a 64-core H200 host than on a 16-core one (h200x4_host_adamw_q8.json, h200_host_adamw.json):
# cores ** 0.6 between them. Two hosts, two kernels: a calibration file measured on the host is better.
CORE_SCALING = 0.6


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Rates in bytes/s, FLOP/s, parameters/s and seconds.

    - ``matmul_flops``: a block's matrix products (bfloat16), forward and backward alike;
      ``attention_flops``: its attention forward (flash attention: 2 x query width x keys per token);
      ``attention_backward``: attention's backward in units of its forward;
      ``kept_backward``: a block keeping its matrix products (``kept_layers``) runs its backward (no
      recompute) this much slower than the products' count says (it reads them back from GPU memory).
    - ``h2d_bytes``, ``d2h_bytes``: PCIe as the engine moves weights and gradients, one copy at a time;
      ``link_bytes``: both directions together while copies run each way at once (None: each way at its own
      rate, the link full duplex).
    - ``hbm_bytes`` and ``device_update_bytes_per_param``: a GPU-resident part's AdamW is memory-bound.
    - ``host_update``: parameters per second of a host part's AdamW inside a step (beside the transfers), per
      precision mode (``engine.precision``'s names); ``first_half_share``: the part of it the split update's
      first half (the stream copy the next forward waits for) takes; ``one_pass_speedup``: how much faster
      than its two halves together a splitting mode's update runs in one pass (``split_update=false``).
    - ``host_in_step``: per precision mode, its ``host_update`` rate over its kernel's rate alone on the same host
      (missing: 1, the kernel's rate as it is), which carries a mode's rate timed on another host
      (``measured_here``) into a step. A host between two measured ones takes the share of the nearest in cores
      (``on_host``): the H200's 16-core host's 2.6 / 3.0 up to 22 cores, 1 (its kernels as they are) from 23.
    - ``from_specifications``: the record's rates come from specification sheets, not from runs.
    - ``host_cores``: the cores of the host the host update rates were measured on; ``hosts``: the host fields
      (``host_update``, ``host_in_step``, ``first_half_share``, ``one_pass_speedup``, ``source``) measured on
      other hosts of this GPU kind, by their cores. On a host with other cores the rates are the measured host's of
      those cores, else the nearest measured host's scaled by (cores / its cores) ** ``CORE_SCALING``
      (``on_host``).
    - ``disk_bytes``: the disk tier's read + write rate.
    - ``packed_flash``: packed rows take cuDNN's packed layout here, attention within each run of a row (a
      Hopper GPU or later: ``models.layers.attention_implementation``); False: XLA's masked attention over whole
      rows (Ada and older).
    - ``dispatch``: the main thread's own seconds per op kind (issuing a transfer, a compiled call).
    - ``no_gradient_backward``: a block's backward runs (1 - this x the share of the rows' tokens no loss reaches,
      ``RowMix.no_gradient``) of its time: its gradients are zeros there, and the GPU runs products over zeros
      faster (they draw less power, so its clock stays higher). 0: not measured on this GPU (not counted).
    """

    name: str
    matmul_flops: float
    attention_flops: float
    attention_backward: float
    kept_backward: float
    h2d_bytes: float
    d2h_bytes: float
    hbm_bytes: float
    device_update_bytes_per_param: float
    host_update: dict[str, float]
    first_half_share: float
    disk_bytes: float
    dispatch: dict[str, float]
    host_cores: int = 16
    source: str = ""
    link_bytes: float | None = None
    hosts: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # the host update timed on the host at hand (``host_kernel.mode_rates``) that ``measured_here`` took these host
    # rates from; None: the record's, or a calibration file's
    host_measured: dict[str, float] | None = None
    packed_flash: bool = True
    # about 30 bytes per parameter in one pass against 46 in two; the fused kernel alone on the H200's 16-core
    # host: 4.58 G params/s in one pass (h200_host_update_profile_08c2422.json), 3.00 in two
    # (h200_measure_speeds_d5d7c51.json)
    one_pass_speedup: float = 1.5
    no_gradient_backward: float = 0.0
    host_in_step: dict[str, float] = dataclasses.field(default_factory=dict)
    # the rates come from a GPU's and a host's specification sheets, not from runs (the workstation cards)
    from_specifications: bool = False

    def host_update_rate(self, mode: str, one_pass: bool = False) -> float:
        """Parameters per second of ``mode``'s host update; ``one_pass``: a splitting mode's update run
        whole (``split_update=false``)."""
        try:
            rate = self.host_update[mode]
        except KeyError:
            raise ValueError(f"no host update rate for precision mode {mode!r} in {self.name}: give one in the "
                             f"calibration file's host_update") from None
        return rate * self.one_pass_speedup if one_pass else rate

    def disk_seconds(self, on_disk: bool, params: float, moment_bytes: int) -> float:
        """A disk-tier part's moments read before and written after its update."""
        return 2 * params * moment_bytes / self.disk_bytes if on_disk else 0.0

    def replace(self, **changes: Any) -> "Speeds":
        return dataclasses.replace(self, **changes)

    def measured_here(self, rates: dict[str, float], cores: int | None) -> "Speeds":
        """These rates with the host update timed on the host at hand (``host_kernel.mode_rates``, which
        ``Machine.here`` runs where a GPU is): each precision mode timed there takes its kernel's timed rate times
        its ``host_in_step``; a mode not timed (the runs that timed full precision alone, before every mode was
        timed) keeps its record's ratio to full precision, scaled by the measured full-precision rate over this
        record's; the split's first-pass share and the one-pass speedup as measured. The lean mode keeps the
        record's ratio too (the timed ``lean`` is the split update's second pass, recorded, not used). The hosts
        lent as one kind differ: the H200's 16-core host ran the full-precision kernel at 3.00, 3.33, 3.44 and 3.73
        G params/s on four days, the 32-core one at 3.40, 3.75 and 4.50, and the steps the host bounds follow it;
        capacity mode's kernel, bound by the cores rather than the memory, does not follow full precision's
        (experiments/studies/NOTES.md, 2026-12-01)."""
        f = rates["full"] / self.host_update["full"]
        update = {k: (rates[k] * self.host_in_step.get(k, 1.0) if k in rates and k != "lean" else v * f)
                  for k, v in self.host_update.items()}
        return self.replace(host_update=update,
                            first_half_share=rates["first_half_share"], one_pass_speedup=rates["one_pass_speedup"],
                            host_cores=cores or self.host_cores, hosts={}, host_measured=dict(rates),
                            name=f"{self.name}, host update measured here at {rates['full'] / 1e9:.2f} G params/s")

    def measured_full_rate(self, cores: int | None) -> float | None:
        """The full-precision host update's rate measured on the host of this record nearest ``cores`` (None: the
        record's own), not scaled by cores: what a host of this kind timed itself at where nothing else ran on it
        (``step_time.step_line``'s note); None for a record from specification sheets."""
        if self.from_specifications:
            return None
        near = self._nearest_host(cores)
        return self.host_update["full"] if near == self.host_cores else self.hosts[near]["host_update"]["full"]

    def _nearest_host(self, cores: int | None) -> int:
        """The cores of the measured host nearest ``cores`` (this record's own, or one of ``hosts``)."""
        if cores is None:
            return self.host_cores
        return min((self.host_cores, *self.hosts), key=lambda c: (abs(math.log(cores / c)), -c))

    def on_host(self, cores: int | None) -> "Speeds":
        """These rates on a host of ``cores`` usable cores (None or the same: unchanged): a host of that many
        cores measured for this GPU kind (``hosts``), else the nearest measured host's update rates scaled as
        the fused kernel's measured between a 16- and a 64-core H200 host."""
        if cores is None or cores == self.host_cores:
            return self
        near = self._nearest_host(cores)
        base = self
        if near != self.host_cores:
            measured = self.hosts[near]
            base = self.replace(**{"host_in_step": {}, **measured}, host_cores=near, hosts={},
                                name=f"{self.name.split(',')[0]}, {near}-core host (measured)")
            if near == cores:
                return base
        f = (cores / near) ** CORE_SCALING
        return base.replace(host_update={k: v * f for k, v in base.host_update.items()}, host_cores=cores,
                            name=f"{base.name}, host update scaled to {cores} cores")


# 7-bit m with 5-bit v: its kernel against the 8-bit one, both alone over every core of an H200 host, in one
# process (host_kernel_ab.py): 4.31 against 5.59 G params/s on the 16-core host
# (h200_host_kernel_ab_8645a2f.json), 8.60 against 11.01 on the 32-core one (h200x2_host_kernel_ab_8645a2f.json).
# Before its passes read their codes' groups in place (22887c3) it ran 0.56 of the 8-bit rate (2.97 against
# 5.27), as the quality table's steps had said (0.60, h200x2_conv_1b_m7v5_*_2ef8a80.json).
M7V5_OVER_Q8 = 0.77


def _with_m7v5(rates: dict[str, float]) -> dict[str, float]:
    """The rates with m7v5's: the 8-bit moments' times ``M7V5_OVER_Q8``."""
    return {**rates, "m7v5": rates["q8"] * M7V5_OVER_Q8}


_DISPATCH = {"fetch": 0.004, "forward": 0.0008, "backward": 0.001, "send_grads": 0.0015, "release": 0.0002,
             "update": 0.0002, "head": 0.0008, "embed": 0.0004, "embed_backward": 0.0004, "grad_norm": 0.001}

H100 = Speeds(
    name="H100 80GB, 16-core host (defaults)", matmul_flops=650e12, attention_flops=480e12, attention_backward=2.5,
    kept_backward=1.2, h2d_bytes=47.6e9, d2h_bytes=47.8e9, hbm_bytes=2.6e12, device_update_bytes_per_param=30,
    host_update=_with_m7v5({"full": 2.6e9, "lean": 2.9e9, "capacity": 4.0e9, "q8": 3.5e9}),
    first_half_share=0.5,
    disk_bytes=3e9, dispatch=_DISPATCH,
    source="experiments/results: h100_side_by_side_v14.json, h100_kept_block.json, h100_host_adamw_v10.json, "
           "h100_scale_projection (tests/assets/measured)")
# The H200's 16-core host: the fused kernel alone (h200_measure_speeds_d5d7c51.json) ran full precision at 3.00 G
# params/s, the lean mode at 5.45, capacity mode at 6.94 and 8-bit moments at 5.24; inside a step full precision
# runs at 2.6 (the 3.5B streamed rows' steps within 2-4% of the model), so each mode here is its kernel's rate
# times 2.6 / 3.0. Checked against steps the H100's rates had put 19-24% too slow: capacity mode
# (h200_capped_rtx4090_sft_8b_export_29f9356.json, 2.83 s measured) and the lean mode
# (h200_dpo_8b_generated_d968773.json, 1.79 s).
_H200_HOST = _with_m7v5({"full": 3.00e9, "lean": 4.7e9, "capacity": 6.0e9, "q8": 4.55e9})
# So on that host a mode's rate in a step is 2.6 / 3.0 of its kernel's alone (full precision's is the kernel's:
# the memory lane counts what the transfers take from it), which carries a kernel timed on the host lent into the
# step (``Speeds.measured_here``).
_H200_IN_STEP = {mode: 2.6 / 3.0 for mode in ("capacity", "q8", "m7v5")}
# The 32-core host of the 2-GPU H200 machine, measured (h200x2_measure_speeds_fcba712.json; the 8-bit
# kernel with its AVX-512 passes): the kernels alone, taken as they run in a step. The 13B step's timeline at
# 8K tokens on that host (h200x2_side_by_side_13b_8k_fcba712.json) ran its full-precision passes at 3.45 G
# params/s, the kernel alone at 3.40; scaling the 16-core rates by cores had put full precision at 3.95 (the
# host's memory, one NUMA node, not its cores, bounds it) and the 8-bit update at 6.9 against 12.2.
_H200X2_HOST = {"host_update": _with_m7v5({"full": 3.40e9, "lean": 5.89e9, "capacity": 9.83e9, "q8": 12.2e9}),
                "first_half_share": 0.424, "one_pass_speedup": 1.49,
                "source": "experiments/results/h200x2_measure_speeds_fcba712.json"}
# The 64-core host of the 4-GPU machine: capacity mode's kernel measured at 11.15 G params/s (h200x4_host_adamw_q8
# .json), 1.13x the 32-core host's 9.83 (memory, not cores, again); the other modes are the 32-core host's rates
# times that 1.13, not measured there (the 8-bit kernel's AVX2 build ran 11.19 there, 1.24x its AVX2 build on the
# 32-core host: consistent with 12.2 x 1.13 = 13.8 for the AVX-512 build).
_H200X4_HOST = {"host_update": {**{k: v * 1.13 for k, v in _H200X2_HOST["host_update"].items()},
                                "capacity": 11.15e9},
                "first_half_share": 0.424, "one_pass_speedup": 1.49,
                "source": "experiments/results/h200x4_host_adamw_q8.json (capacity); the rest from the 32-core host"}
# The engine's copies (jax.device_put between pinned host memory and the GPU) on one H200 of the 2-GPU machine
# ran 54 GB/s each way alone but 56-63 GB/s for both directions together (a fetch issued behind copies home
# shares the link with them, and copies in flight interleave rather than queue); torch's, on two streams, 84
# (h200x2_transfer_queues_2b81da0.json).
_H200_LINK = 60e9
# A block's products on the H200: 662-740 TFLOP/s one at a time in every operand layout, torch's 669-770
# (h200_gemm_layouts_ebe68f5.json), and a 13B block's backward in a step 674-727 (h200_block_kernel_calls_e1148dc
# .json). At the H100's 650 the model put the step 4-12% over the runs the GPU bounds (the 16-core host's
# h200_7b_32k and h200_sft_8b, the 3.5B 32K rows); at 670, 111 of the 123 H200 runs since 2026-11-25 are within
# 10% against 106 at 650 (cpu_step_time_vs_runs_*.json; 680 and 700 move the 32-core host's runs under).
_H200_MATMUL = 670e12
# A block's backward with each row's tail out of the loss, no loss reaching it (layer_compute.py --loss-tokens,
# whole rows, the same attention): at the 8B shape 50% of the row ran it 5.8% faster, 75% 9.6%, 89% 10.9%
# (recomputing; 9-10% keeping its products), at the 13B shape 89% 11.2% (h200_block_kernels_8b_loss*_c75ab97.json,
# _42c233b.json, h200_block_kernels_13b_loss*_42c233b.json): the traced products ran 4-8% faster with the rest.
# 0.12 per share. The GH200 (the same GPU) takes it too.
_H200_NO_GRADIENT = 0.12
H200 = dataclasses.replace(
    H100, name="H200, 16-core host (defaults)", matmul_flops=_H200_MATMUL, h2d_bytes=47.4e9, d2h_bytes=47.4e9,
    hbm_bytes=3.4e12, no_gradient_backward=_H200_NO_GRADIENT,
    link_bytes=_H200_LINK, host_update=_H200_HOST, host_in_step=_H200_IN_STEP,
    hosts={32: _H200X2_HOST, 64: _H200X4_HOST},
    source="experiments/results: h200_bench_before_after_*.json, h200_host_adamw.json, "
           "h200_host_update_profile.json, h200_measure_speeds_d5d7c51.json")
# Workstation cards (issue 53): predicted from their specification sheets, not fitted to runs; a calibration file
# measured on the machine (``experiments/measure_speeds.py``) replaces any field. PCIe Gen4 x16 moves ~25 GB/s
# each way from pinned memory; a 16-core desktop host with two channels of DDR5 reads and writes about half the
# bytes per second of the H200's 16-core host (~65 against ~120 GB/s in a STREAM-style test), so its host update
# rates are taken at half the H200 host's (the update moves its bytes at about the memory's rate).
_DESKTOP_HOST = {k: v * 0.55 for k, v in H200.host_update.items()}
RTX_4090 = dataclasses.replace(
    H100, name="RTX 4090 (24 GB), 16-core desktop host: predicted from specifications",
    matmul_flops=150e12, attention_flops=110e12,  # 165 TFLOP/s bfloat16 with float32 accumulation, dense
    h2d_bytes=25e9, d2h_bytes=25e9, hbm_bytes=1.0e12, host_update=_DESKTOP_HOST, host_in_step=_H200_IN_STEP,
    disk_bytes=2e9,
    packed_flash=False,  # Ada (compute capability 8.9): packed rows take XLA's masked attention
    from_specifications=True,
    source="specifications (NVIDIA Ada GPU architecture whitepaper; PCIe Gen4 x16), not measured")
L40S = dataclasses.replace(
    RTX_4090, name="L40S / RTX 6000 Ada (48 GB), 16-core desktop host: predicted from specifications",
    matmul_flops=260e12, attention_flops=190e12,  # 362 TFLOP/s bfloat16 dense on the sheet, held by its 350 W limit
    hbm_bytes=0.86e12)
# The GH200 reaches its host over NVLink-C2C, not PCIe: the H200's rates otherwise, its link's not measured
GH200 = dataclasses.replace(H200, name="GH200: the H200's rates, its host link not measured", link_bytes=None)
SPEEDS: dict[str, Speeds] = {"H100": H100, "H200": H200, "GH200": GH200, "RTX 4090": RTX_4090, "L40S": L40S,
                             "RTX 6000 ADA": L40S}
# Each kind's memory in GiB as its driver reports it (nvidia-smi's MiB / 1024: the H200's 143,771 MiB, the H100 80GB's
# 81,559, the GH200's 96 GB part 97,871, the RTX 4090's 24,564, the L40S's 46,068, the RTX 6000 Ada's 49,140): what
# `plan --gpu NAME` plans the GPU side for when --gpu-gib is not given (the 144 GB GH200: --gpu-gib 140).
MEMORY_GIB: dict[str, float] = {"H100": 79.6, "H200": 140.4, "GH200": 95.6, "RTX 4090": 24.0, "L40S": 45.0,
                                "RTX 6000 ADA": 48.0}


def kind_of(gpu_name: str | None) -> str | None:
    """The ``SPEEDS`` key of a GPU's name (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA GeForce RTX 4090``,
    ``NVIDIA RTX 6000 Ada Generation``, ...), None if unknown."""
    name = (gpu_name or "").upper()
    for kind in sorted(SPEEDS, key=len, reverse=True):  # GH200 before H200
        if kind.upper() in name:
            return kind
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def from_file(path: str | os.PathLike, base: Speeds) -> Speeds:
    """``base`` with the fields a calibration file gives (JSON object; unknown fields are refused): an object of
    ``Speeds`` fields, or the results file ``experiments/measure_speeds.py`` writes (its ``runs[0].speeds``)."""
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the calibration file {path}: {err}") from None
    runs = given.get("runs") if isinstance(given, dict) else None
    if isinstance(runs, list) and runs and isinstance(runs[0], dict) and "speeds" in runs[0]:
        given = runs[0]["speeds"]  # measure_speeds.py's results file
    if not isinstance(given, dict):
        raise ValueError(f"the calibration file {path} must hold a JSON object of Speeds fields")
    fields = {f.name for f in dataclasses.fields(Speeds)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"the calibration file {path} has unknown fields {unknown}; known: {sorted(fields)}")
    for key, value in given.items():
        if key in ("host_update", "dispatch"):
            if not isinstance(value, dict) or not all(_positive(v) for v in value.values()):
                raise ValueError(f"{path}: {key} must map names to positive numbers")
            given[key] = {**getattr(base, key), **value}
        elif key == "hosts":
            raise ValueError(f"{path}: a calibration file holds one host's rates (its host_cores), not hosts")
        elif key in ("host_in_step", "from_specifications", "host_measured"):
            raise ValueError(f"{path}: {key} is not a calibration field: a file's host_update holds the rates a "
                             f"step runs at, taken as they are (experiments/measure_speeds.py writes each kernel's "
                             f"rate times its share in a step)")
        elif key == "link_bytes" and value is None:
            continue  # null: each way at its own rate (a full-duplex link)
        elif key == "packed_flash":
            if not isinstance(value, bool):
                raise ValueError(f"{path}: packed_flash must be true or false, got {value!r}")
        elif key == "no_gradient_backward":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{path}: no_gradient_backward must be a number from 0 up to (not including) 1, "
                                 f"got {value!r}")
        elif key not in ("name", "source") and not _positive(value):
            raise ValueError(f"{path}: {key} must be a positive number, got {value!r}")
    # a file's rates are its own host's: other hosts' records do not apply to it
    return dataclasses.replace(base, **{"name": f"{base.name} with {Path(path).name}", "hosts": {}, **given})


def for_gpu(gpu_name: str | None, file: str | os.PathLike | None = None, host_cores: int | None = None,
            host_measured: dict[str, float] | None = None) -> Speeds | None:
    """The rates for a GPU of this name: its kind's record (an unknown kind starts from the H100's), on a host
    of ``host_cores`` cores (None: the record's host; ``Speeds.on_host``), with the host update as measured on
    this host (``host_measured``: ``Speeds.measured_here``) or a calibration file's fields (``file``, else
    ``$MEGATRAIN_SPEEDS``) on top: a file, which the user chose, wins over the measurement. None for a GPU kind
    without a record and no file."""
    file = file or os.environ.get(SPEEDS_VAR) or None
    kind = kind_of(gpu_name)
    if kind is None and file is None:
        return None
    base = SPEEDS.get(kind or "H100")
    if file:
        return from_file(file, base).on_host(host_cores)  # a file's host rates are its host's
    s = base.on_host(host_cores)
    return s if host_measured is None else s.measured_here(host_measured, host_cores)
