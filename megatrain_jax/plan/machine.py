"""What this machine has and what its software stack does with memory: free host RAM, disk and GPU
memory, the share of the GPU that JAX lets XLA allocate, XLA's pinned-host pool, and the GPUs a run counts
(``run_gpus``, ``Machine``).

The constants are measured on the H100 box (jax 0.11.2, CUDA driver 580, 125.9 GiB host); docs/design.md
has the data path they belong to."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import time

from megatrain_jax._environment import (gpu_fraction_in_force, gpus_hidden, host_ram_override, user_host_pool_limit,
                                        visible_gpus)
from megatrain_jax.plan.counts import GiB, MiB
from megatrain_jax.plan.speeds import SPEEDS_VAR

# Python, JAX/XLA, CUDA libraries, compiled programs, glibc's heap: the anonymous memory of a run beyond the arrays
# the plan counts and the GPU client's share below: 2.56 GiB in the 8B SFT run on one H200 (16 cores; 6.71 GiB
# beyond its Adam moments, less the client's 4.15), the largest measured. The one host allowance the plan adds to
# what it counts (experiments/results/h200_host_memory_phases_0d5dd00_h200_sft_8b.json).
HOST_RUNTIME_BYTES = int(2.6 * GiB)
# The GPU client holds host memory in proportion to the GPU memory XLA takes at its start (its preallocation):
# 0.42 GiB without preallocation, then 3.13% of what is preallocated (1.51 GiB at 34.95 GiB, 2.60 at 69.9, 4.57
# at 132.8: experiments/results/h200_gpu_client_host_memory_3266815.json), one client per GPU.
GPU_CLIENT_HOST_SHARE = 0.0313
# XLA's GPU allocator (BFC) may have the bytes for a program's scratch buffer free but not in one piece. The
# plan keeps this much of the GPU unplanned. Measured on the H100 box: the 8B SFT example ran out of memory
# asking for 8.39 GiB with 9.34 GiB free in the pool, the largest free piece 7.84 GiB: 1.50 GiB lost to
# fragmentation (experiments/results/h100_sft8b_edge.json).
GPU_FRAGMENTATION_MARGIN = int(1.5 * GiB)
# What XLA's pinned pool costs beyond its own regions, as a share of the pool: 3.1% on the H100 box (a 32 GiB
# region added 33.0 GiB of resident memory); on one H200, 5.1% of anonymous memory for a bare 50 GiB pool of arrays
# (h200_gpu_client_host_memory_3266815.json) and 8.0% in the 8B SFT run (54.0 GiB of pinned mappings for its 50 GiB
# pool, with the rest of its memory counted: h200_host_memory_phases_0d5dd00_h200_sft_8b.json). The largest.
PINNED_RSS_OVERHEAD = 0.08
HOST_POOL_FRACTION = 0.9  # megatrain_jax._environment caps XLA's pinned pool at 90% of RAM
POOL_HEADROOM = (0.10, 4 * GiB)  # what the fitted pool cap adds to the pinned arrays: a share and a constant


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None elsewhere;
    ``MEGATRAIN_HOST_RAM_GIB`` instead where it is set (a machine whose /proc/meminfo understates or
    overstates what this process may use)."""
    override = host_ram_override()
    if override is not None:
        return override
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
    if st.f_blocks == 0:  # a special file system (/proc, /sys): no size to compare with (disk_room says what it is)
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
    memory times ``gpu_fraction()``; None without nvidia-smi (a CPU machine) or where ``CUDA_VISIBLE_DEVICES``
    hides every GPU (nvidia-smi lists them all the same; JAX runs on the CPU). A GPU fraction JAX cannot take is
    refused here (ValueError), before JAX would fail on it."""
    if gpus_hidden():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.split()
        total = int(out[0]) * MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return int(total * gpu_fraction())


def gpu_name_before_jax() -> str | None:
    """The first GPU's name as the driver gives it (``NVIDIA H200``), read without starting JAX; None without
    nvidia-smi or where ``CUDA_VISIBLE_DEVICES`` hides every GPU."""
    if gpus_hidden():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.splitlines()
        return out[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


SLOW_TIMING_PAUSE_S = 1.0  # the pause before a slow timing is taken again
SLOW_TIMING_RETAKES = 3  # the most times a slow timing is taken again


@functools.lru_cache(maxsize=1)
def measured_host_update(gpu_name: str | None, cores: int) -> dict[str, float] | None:
    """The fused kernel's host update timed on this host for every precision mode (``kernel_rates``), once a
    process; None where the kernel cannot be built or loaded (the engine then updates through JAX, which no record
    describes). A timing whose full-precision rate is under ``step_time.SLOW_HOST`` of the GPU kind's measured host
    (``step_time.slow_host``) is taken again after ``SLOW_TIMING_PAUSE_S``, up to ``SLOW_TIMING_RETAKES`` times
    until one is not slow, and the fastest kept: on the 16-core H200 host timings a second or two apart went
    2.2-2.4, 3.3-3.4, 2.4, 3.3 G params/s on one loan, and every start that read that low ran its steps at the
    usual pace (experiments/studies/NOTES.md, 2026-12-02), so a slow host is one that times slow every time."""
    from megatrain_jax.plan.step_time import slow_host
    best = kernel_rates()
    for _ in range(SLOW_TIMING_RETAKES):
        if best is None or slow_host(gpu_name, cores, best) is None:
            break
        time.sleep(SLOW_TIMING_PAUSE_S)
        again = kernel_rates()
        if again is not None and again["full"] > best["full"]:
            best = again
    return best


def kernel_rates() -> dict[str, float] | None:
    """One timing of the fused kernel in every precision mode (``host_kernel.mode_rates``: under a second, 576 MiB
    of arrays at most, freed after; the kernel built first where it is not yet); None where it cannot be loaded."""
    from megatrain_jax.engine.update import host_kernel
    lib = host_kernel.load()
    return None if lib is None else host_kernel.mode_rates(lib=lib)


def gpu_fraction() -> float:
    """The share of GPU memory XLA may allocate in this environment: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (or JAX's
    newer ``XLA_CLIENT_MEM_FRACTION``), which importing megatrain_jax sets to ``ENGINE_GPU_FRACTION`` unless the user
    chose; JAX's 75% where none is set. A value JAX cannot take is refused (``_environment.gpu_fraction_in_force``)."""
    return gpu_fraction_in_force()


def fitted_pool_limit(pinned: int, host_ram_bytes: int | None, devices: int = 1) -> int | None:
    """The cap on XLA's pinned pool for ``pinned`` bytes of pinned arrays, as ``megatrain-jax train`` sets
    it before JAX starts (``_environment.limit_host_pool``): the arrays plus 10% and 4 GiB of headroom, in
    whole GiB, at most 90% of RAM. The pool then stops growing where the arrays end instead of doubling
    past them (up to twice their size, in memory nothing else can use). None where neither is known; an
    explicit ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` set by the user wins.

    XLA keeps one pinned pool per GPU, each under that cap, and the state is spread over the GPUs: with
    several, each pool gets its share of the arrays plus 10%, and a share of the headroom (at least 2 GiB)."""
    user = user_host_pool_limit()
    if user is not None:
        return user
    cap = None if host_ram_bytes is None else int(HOST_POOL_FRACTION * host_ram_bytes / GiB / devices) * GiB
    headroom = POOL_HEADROOM[1] if devices == 1 else max(POOL_HEADROOM[1] / devices, 2 * GiB)
    fitted = math.ceil((pinned / devices * (1 + POOL_HEADROOM[0]) + headroom) / GiB) * GiB
    return fitted if cap is None else min(fitted, cap)


def pinned_pool_bytes(arrays: int, limit: int | None) -> int:
    """What XLA's pinned-host allocator reserves to hold ``arrays`` bytes: its regions double from 2 MiB,
    and the last one is cut to what ``limit`` leaves."""
    total, region = 0, 2 * MiB
    while total < arrays:
        total, region = total + region, 2 * region
    return total if limit is None else min(total, limit)



def run_gpus(devices: int | None) -> int:
    """The GPUs a run spreads over, the one count ``train``, ``plan`` and the benchmark share: ``train.devices``
    where it is set (the engine refuses more than there are), else every GPU this process will see, read
    without starting JAX (``CUDA_VISIBLE_DEVICES``, else the driver's list; 1 where neither says)."""
    return devices or visible_gpus()


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a run may use, as the layout is picked for it (``resolve``): ``host_ram_bytes`` of host RAM and
    ``gpu_bytes`` of each GPU's allocator (None: not known; with no GPU, nothing is picked for one),
    ``gpus`` GPUs, ``disk_bytes`` free where the disk tier would go (None: read from the folder),
    ``several_processes`` (each holds its own host: no layout is picked for them), ``gpu_name`` (the
    driver's name of the GPU, which says whose rates the step-time model takes; None: no GPU, or not known),
    ``host_cores`` (the cores this process may use, which scale the host update's rate; None: not known,
    the rates' own host) and ``host_measured`` (the host update's rates timed on this host,
    ``host_kernel.mode_rates``, which the step-time model takes over its record's: ``Speeds.measured_here``;
    None: not measured)."""

    host_ram_bytes: int | None
    gpu_bytes: int | None
    gpus: int = 1
    disk_bytes: int | None = None
    several_processes: bool = False
    gpu_name: str | None = None
    host_cores: int | None = None
    host_measured: dict[str, float] | None = None

    @classmethod
    def here(cls, devices: int | None = None, *, host_ram_bytes: int | None = None, gpu_bytes: int | None = None,
             several_processes: bool = False, time_host: bool = True) -> "Machine":
        """This machine, read before JAX starts its GPU backend: MemAvailable (``available_host_bytes``), what
        XLA's allocator will get on a GPU (``gpu_bytes_before_jax``) and ``run_gpus(devices)``; the figures
        given win (``megatrain-jax plan --host-gib/--gpu-gib``). Where a GPU is, the host update is timed here
        too (``measured_host_update``), and the model predicts for the host lent, not the record's; not where
        ``time_host`` is off (``plan --gpu`` planning for another machine), where a calibration file is given
        (``$MEGATRAIN_SPEEDS``: it wins), or where the distributed runtime is requested (``several_processes``:
        the host's processes would time it at once). Separate runs sharing one host each time it while the
        others may be running: their timings, and the layouts picked from them, then come out low. A timing under
        ``step_time.SLOW_HOST`` of the kind's measured host is taken again after a pause, up to three times, and the
        fastest kept (``measured_host_update``): readings that low came and went on hosts that ran their steps at the
        usual pace."""
        host = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
        gpu_name = gpu_name_before_jax()
        cores = len(os.sched_getaffinity(0))
        timed = time_host and gpu_name is not None and not several_processes and not os.environ.get(SPEEDS_VAR)
        measured = measured_host_update(gpu_name, cores) if timed else None
        return cls(host, gpu_bytes_before_jax() if gpu_bytes is None else gpu_bytes, run_gpus(devices), None,
                   several_processes, gpu_name, cores, measured)
