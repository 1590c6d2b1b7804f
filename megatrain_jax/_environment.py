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
# The most host RAM a figure may give, in GiB: 128 TiB, all a process can address on x86-64 (47 bits of user
# space). A larger one is a typo or bytes (or MiB) written for GiB, not a machine.
MOST_HOST_GIB = 2**17
GPU_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# JAX's own name for the share now (jaxlib's xla_client, which reads GPU_FRACTION_VAR as its deprecated name and
# refuses to start its GPU client where both are set).
JAX_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
# What XLA takes of each GPU where no fraction is set (the user chose the preallocation or the allocator).
JAX_GPU_FRACTION = 0.75
# The share of each GPU's memory XLA's allocator takes when megatrain_jax sets it (JAX's own default is
# 0.75). The engine owns the GPU; the rest is for the CUDA context, cuDNN and cuBLAS handles and NCCL's
# buffers, outside XLA's pool. Measured on the H100 box: the 8B SFT example (packed cuDNN attention, 58.7 GiB
# peak) trains at 0.95 (75.2 GiB pool) where at 0.75 (59.4 GiB) it ran out of memory at step 3 to 7
# (experiments/results/h100_sft8b_edge.json).
ENGINE_GPU_FRACTION = 0.95
CACHE_VAR = "MEGATRAIN_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "")


def host_ram_override() -> int | None:
    """``MEGATRAIN_HOST_RAM_GIB`` in bytes, None where it is unset or empty. A value that is not a number of GiB
    from 1 to ``MOST_HOST_GIB`` is refused with what to write instead."""
    raw = os.environ.get(HOST_RAM_VAR, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not 1 <= gib <= MOST_HOST_GIB:
        raise ValueError(f"{HOST_RAM_VAR}={raw!r}: give the host RAM this run may use in GiB, at least 1 and at most "
                         f"{MOST_HOST_GIB:,} (e.g. {HOST_RAM_VAR}=500), or unset it to read /proc/meminfo"
                         f"{not_gib(gib, MOST_HOST_GIB)}")
    return int(gib * 2**30)


def not_gib(value: float, most: float) -> str:
    """What a figure past ``most`` GiB would be if it were bytes or MiB (what ``free -b`` and nvidia-smi print), as
    a clause to add to the refusal; "" where it is neither."""
    for unit, scale in (("bytes", 2**30), ("MiB", 2**10)):
        if most < value < float("inf") and 1 <= value / scale <= most:
            return f" ({value:.0f} {unit} is {f'{value / scale:,.1f}'.removesuffix('.0')} GiB)"
    return ""


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
_USER_FRACTION = os.environ.get(JAX_FRACTION_VAR) or os.environ.get(GPU_FRACTION_VAR)
if _USER_FRACTION is not None and _USER_FRACTION == os.environ.get(_OURS_FRACTION_VAR) \
        and JAX_FRACTION_VAR not in os.environ:
    _USER_FRACTION = None


def set_gpu_memory_fraction(fraction: float = ENGINE_GPU_FRACTION) -> None:
    """Let XLA take ``fraction`` of each GPU's memory instead of JAX's 75%, unless the user chose how JAX
    allocates (``XLA_CLIENT_MEM_FRACTION`` or ``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``XLA_PYTHON_CLIENT_PREALLOCATE``
    or ``XLA_PYTHON_CLIENT_ALLOCATOR``). Read by JAX when its GPU backend starts: importing megatrain_jax does it."""
    ours = os.environ.get(_OURS_FRACTION_VAR)
    if os.environ.get(JAX_FRACTION_VAR) and ours is not None and os.environ.get(GPU_FRACTION_VAR) == ours:
        del os.environ[GPU_FRACTION_VAR]  # ours, inherited from a parent: JAX refuses both names at once
    if not _allocation_chosen():
        os.environ[GPU_FRACTION_VAR] = os.environ[_OURS_FRACTION_VAR] = f"{fraction:g}"


def _allocation_chosen() -> bool:
    return _USER_FRACTION is not None or "XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ \
        or "XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ


def gpu_fraction_in_force() -> float:
    """The share of each GPU's memory XLA's allocator will take, as JAX reads it when its GPU client starts:
    ``XLA_CLIENT_MEM_FRACTION``, else ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (which importing megatrain_jax sets to
    ``ENGINE_GPU_FRACTION`` unless the user chose), else JAX's 75%. A value that is not a number above 0 and at
    most 1 is refused naming the variable (JAX would fail on it as its GPU client starts, or plan past the card)."""
    if os.environ.get(JAX_FRACTION_VAR) and os.environ.get(GPU_FRACTION_VAR):
        raise ValueError(f"{JAX_FRACTION_VAR} and {GPU_FRACTION_VAR} are both set, which JAX refuses as its GPU client "
                         f"starts: unset {GPU_FRACTION_VAR} (JAX's deprecated name)")
    name = JAX_FRACTION_VAR if os.environ.get(JAX_FRACTION_VAR) else GPU_FRACTION_VAR
    raw = os.environ.get(name, "")
    if not raw:
        return JAX_GPU_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ValueError(f"{name}={raw!r}: give the share of each GPU's memory XLA may take, a number above 0 and at "
                         f"most 1 (e.g. {name}=0.9), or unset it (megatrain_jax then sets {ENGINE_GPU_FRACTION:g})")
    return value


def preallocation_note() -> str | None:
    """What JAX makes of an ``XLA_PYTHON_CLIENT_PREALLOCATE`` that is not one of its words (it turns preallocation
    off only for ``false``, ``False`` and ``0``; any other value keeps it on); None for those words and where unset."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    if raw in (None, "", "false", "False", "0", "true", "True", "1"):
        return None
    return (f"XLA_PYTHON_CLIENT_PREALLOCATE={raw!r}: JAX turns preallocation off only for false, False or 0, so it "
            f"preallocates; write XLA_PYTHON_CLIENT_PREALLOCATE=false to turn it off")


def gpu_fraction_var() -> str:
    """The variable the GPU memory fraction in force is read from: JAX's newer name where it is set, else the one
    megatrain_jax sets."""
    return JAX_FRACTION_VAR if os.environ.get(JAX_FRACTION_VAR) else GPU_FRACTION_VAR


def gpu_fraction_source() -> str:
    """Who set the GPU memory fraction in force: ``"the user"``, ``"megatrain_jax"``, or ``"JAX's default"`` (the
    user chose the preallocation or the allocator and no fraction, so megatrain_jax set none)."""
    if _USER_FRACTION is not None:
        return "the user"
    return "JAX's default" if _allocation_chosen() else "megatrain_jax"


def user_host_pool_limit() -> int | None:
    """The pinned pool's cap in bytes if the user set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, else None. XLA reads a
    whole number of GiB there: any other value is refused with what to write (XLA takes its 64 GB in place of
    ``abc`` or ``1.5``, with an error in its log, and a pool of ``0`` or ``-5`` GiB holds nothing)."""
    if _USER_LIMIT is None:
        return None
    raw = _USER_LIMIT.strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{HOST_LIMIT_VAR}={_USER_LIMIT!r}: XLA caps its pinned host pool at a whole number of GiB, "
                         f"at least 1 (e.g. {HOST_LIMIT_VAR}=200); or unset it, and megatrain-jax train caps the pool "
                         f"at what the run pins")
    return int(raw) * 2**30


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


def listed_gpus() -> int | None:
    """How many GPUs ``CUDA_VISIBLE_DEVICES`` lets CUDA see, as CUDA reads it: its entries before the first that
    names no device (an index, or a ``GPU-``/``MIG-`` UUID), so that ``""`` and ``-1`` hide every GPU and ``0,-1,1``
    shows one; None where it is unset."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return None
    count = 0
    for entry in listed.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.upper().startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


def gpus_hidden() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` hides every GPU from this process (JAX then runs on the CPU)."""
    return listed_gpus() == 0


def visible_gpus() -> int:
    """How many GPUs this process will see, read without starting JAX (``CUDA_VISIBLE_DEVICES``, else the
    NVIDIA driver's list); 1 where neither says (or where none is: the CPU is one device)."""
    listed = listed_gpus()
    if listed is not None:
        return max(1, listed)
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
