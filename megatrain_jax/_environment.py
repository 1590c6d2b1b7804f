"""Process settings: XLA's pinned-host pool and its share of GPU memory (before JAX starts its GPU backend)
and JAX's persistent compilation cache (when the engine starts).

XLA's GPU client allocates pinned host memory from a pool capped at 64 GB by default
(``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``). Host memory is where all of megatrain_jax's state lives, so the
default here is 90% of physical RAM. The pool grows by doubling regions and keeps them, so it can end up
near twice the pinned arrays; ``megatrain-jax train`` knows from its memory plan what will be pinned and
caps the pool there (``limit_host_pool``) before JAX starts. An explicit setting in the environment always
wins.

Compiling the per-part programs is a large share of the time to the first step (seconds per program on
a GPU). ``enable_compilation_cache`` turns on JAX's persistent compilation cache in a per-user folder, so
a second run of the same model shape loads them from disk. It never replaces a cache the user configured
(``jax.config.update("jax_compilation_cache_dir", ...)`` or ``JAX_COMPILATION_CACHE_DIR``);
``MEGATRAIN_COMPILATION_CACHE=0`` turns it off, and ``MEGATRAIN_COMPILATION_CACHE=/some/dir`` moves it.
"""

from __future__ import annotations

import os
from pathlib import Path

HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
# The host RAM this process may use, in GiB, where /proc/meminfo does not tell it: a container whose cgroup
# allows less than the host's RAM, or a virtual machine whose RAM is added as it is touched and reports less
# than its limit. It replaces both the physical RAM and MemAvailable everywhere.
HOST_RAM_VAR = "MEGATRAIN_HOST_RAM_GIB"
GPU_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# The share of each GPU's memory XLA's allocator takes when megatrain_jax sets it (JAX's own default is
# 0.75). The engine owns the GPU; the rest is for the CUDA context, cuDNN and cuBLAS handles and NCCL's
# buffers, outside XLA's pool. Measured on the H100 box: the 8B SFT example (packed cuDNN attention, 58.7 GiB
# peak) trains at 0.95 (75.2 GiB pool) where at 0.75 (59.4 GiB) it ran out of memory at step 3 to 7
# (experiments/results/h100_sft8b_edge.json).
ENGINE_GPU_FRACTION = 0.95
CACHE_VAR = "MEGATRAIN_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "")


def host_ram_override() -> int | None:
    """``MEGATRAIN_HOST_RAM_GIB`` in bytes, None where it is unset or empty. A value that is not a positive
    number is refused with what to write instead."""
    raw = os.environ.get(HOST_RAM_VAR, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not 1 <= gib < float("inf"):
        raise ValueError(f"{HOST_RAM_VAR}={raw!r}: give the host RAM this run may use in GiB, at least 1 (e.g. "
                         f"{HOST_RAM_VAR}=500), or unset it to read /proc/meminfo")
    return int(gib * 2**30)


def physical_ram_bytes() -> int:
    """The machine's RAM: ``MEGATRAIN_HOST_RAM_GIB`` where set, else the kernel's page count."""
    override = host_ram_override()
    return override if override is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The value megatrain_jax itself put in HOST_LIMIT_VAR, so that a child process (which inherits both)
# does not take it for the user's.
_OURS_VAR = "MEGATRAIN_HOST_LIMIT_SET"
_USER_LIMIT = os.environ.get(HOST_LIMIT_VAR)  # as the process started, before this module set anything
if _USER_LIMIT is not None and _USER_LIMIT == os.environ.get(_OURS_VAR):
    _USER_LIMIT = None


def _set_limit(gib: int) -> None:
    os.environ[HOST_LIMIT_VAR] = os.environ[_OURS_VAR] = str(max(1, gib))


def set_host_memory_limit(fraction: float = 0.9) -> None:
    """Cap XLA's pinned pool at ``fraction`` of the machine's RAM unless the user set the cap. Run at import: a
    malformed ``MEGATRAIN_HOST_RAM_GIB`` falls back to the kernel's page count here, and is refused, with what
    to write, where a plan reads it (``megatrain-jax plan`` and ``train`` exit with status 2)."""
    if _USER_LIMIT is None:
        try:
            ram = physical_ram_bytes()
        except ValueError:
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        _set_limit(int(ram * fraction / 2**30))


_OURS_FRACTION_VAR = "MEGATRAIN_GPU_FRACTION_SET"
_USER_FRACTION = os.environ.get(GPU_FRACTION_VAR)
if _USER_FRACTION is not None and _USER_FRACTION == os.environ.get(_OURS_FRACTION_VAR):
    _USER_FRACTION = None


def set_gpu_memory_fraction(fraction: float = ENGINE_GPU_FRACTION) -> None:
    """Let XLA take ``fraction`` of each GPU's memory instead of JAX's 75%, unless the user chose how JAX
    allocates (``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``XLA_PYTHON_CLIENT_PREALLOCATE`` or
    ``XLA_PYTHON_CLIENT_ALLOCATOR``). Read by JAX when its GPU backend starts: importing megatrain_jax does it."""
    chosen = _USER_FRACTION is not None or "XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ \
        or "XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ
    if not chosen:
        os.environ[GPU_FRACTION_VAR] = os.environ[_OURS_FRACTION_VAR] = f"{fraction:g}"


def gpu_fraction_source() -> str:
    """Who set the GPU memory fraction in force: ``"the user"`` or ``"megatrain_jax"``."""
    return "the user" if _USER_FRACTION is not None else "megatrain_jax"


def user_host_pool_limit() -> int | None:
    """The pinned pool's cap in bytes if the user set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, else None."""
    try:
        return None if _USER_LIMIT is None else int(float(_USER_LIMIT) * 2**30)
    except ValueError:
        return None


def host_pool_limit() -> int | None:
    """The pinned pool's cap in bytes as set now (by the user, ``set_host_memory_limit`` or
    ``limit_host_pool``)."""
    try:
        return int(float(os.environ[HOST_LIMIT_VAR]) * 2**30)
    except (KeyError, ValueError):
        return None


def limit_host_pool(nbytes: int | None) -> bool:
    """Cap XLA's pinned pool at ``nbytes`` (rounded up to whole GiB) for the GPU backend that JAX will start.
    Does nothing, and returns False, where the user set the cap, where JAX's backends already started (the
    setting is read once, at start), or for ``None``."""
    from jax._src import xla_bridge

    if nbytes is None or _USER_LIMIT is not None or xla_bridge.backends_are_initialized():
        return False
    _set_limit(-(-int(nbytes) // 2**30))
    return True


def visible_gpus() -> int:
    """How many GPUs this process will see, read without starting JAX (``CUDA_VISIBLE_DEVICES``, else the
    NVIDIA driver's list); 1 where neither says."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return max(1, len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"]))
    try:
        return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
    except OSError:
        return 1


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/megatrain_jax/jax_cache`` (``~/.cache/...`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatrain_jax" / "jax_cache"


def enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache unless the user configured one or turned ours off
    (``MEGATRAIN_COMPILATION_CACHE=0``). Returns the cache folder in use (the user's or ours), or None.

    Ours caches every program, however fast it compiled (``jax_persistent_cache_min_compile_time_secs``
    0): on a GPU even small programs take a tenth of a second or more to compile, and building the state and
    the first step compile about 25 of them (≈ 25 s cold at 3.5B, ≈ 0.2 s from the cache). Safe to call many times and after JAX has compiled programs: JAX opens the cache at
    the first compilation that finds a folder configured."""
    import jax

    configured = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if configured:  # the user's cache (or ours, from an earlier call): leave every setting as it is
        return configured
    choice = os.environ.get(CACHE_VAR)
    if not jax.config.jax_enable_compilation_cache:  # the user turned JAX's cache off
        return None
    if choice is not None and choice.strip().lower() in _OFF:
        return None
    path = Path(choice).expanduser() if choice else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home, say: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return str(path)


set_host_memory_limit()
set_gpu_memory_fraction()
