"""Fused host AdamW: the C++ kernel (``kernels/host_adamw.cpp``, built on first use where a C++ compiler
exists) and its pure-jnp reference. ``load()`` returns None when no compiler is found or the build fails;
callers then use the JAX path (``EngineConfig.host_kernel`` turns the kernel off on purpose).

The source ships in the wheel as ``megatrain_jax/kernels/host_adamw.cpp``; in the repository (and an
editable install) it is the top-level ``kernels/`` folder, which pyproject maps onto ``megatrain_jax.kernels``.
Run from a checkout without installing (``PYTHONPATH=.``), that mapping does not exist, and the source is
read from the checkout's ``kernels/`` folder beside the package.

Capacity mode has its own entry point, ``megatrain_adamw_bf16_sr`` (``adamw_sr_inplace``, ``adamw_sr_numpy``;
reference ``adamw_sr_reference``): p, m and v are stored as bfloat16, g is float32 (or bfloat16, through
``megatrain_adamw_bf16_sr_g16``), and all three are written back rounded stochastically. The random bits are
a counter-based hash of (seed, stream, offset + element index), so an array updated in pieces (each with its
start as ``offset``) gets the bits one whole call gets.

8-bit moments (issue 35) have one more entry point, ``megatrain_adamw_q8``: its formats, numpy reference and
wrappers are in ``megatrain_jax.engine.update.q8``; 7-bit m with 5-bit v another, ``megatrain_adamw_m7v5``, in
``megatrain_jax.engine.update.m7v5``.

Build ahead of time (e.g. in an image): ``python -m megatrain_jax.engine.update.host_kernel``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax import lax


def source_path():
    """Where the C++ source is: the installed package data, or a source checkout's kernels/ folder."""
    try:
        return resources.files("megatrain_jax.kernels") / "host_adamw.cpp"
    except ModuleNotFoundError:  # a source checkout on sys.path, not installed
        return Path(__file__).resolve().parents[3] / "kernels" / "host_adamw.cpp"  # megatrain_jax/engine/update/


SOURCE = source_path()


def adamw_reference(p, m, v, g, *, lr, b1, b2, eps, wd, grad_scale, bc1, bc2):
    """What the kernel computes, in jnp float32: returns (p, m, v, p as bfloat16)."""
    g = g * jnp.float32(grad_scale)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + wd * p
    p = p - lr * u
    return p, m, v, p.astype(jnp.bfloat16)


_U32 = 1 << 32


def _mix(x):
    """lowbias32 on a uint32 array (the kernel's ``mix32``)."""
    x = x ^ lax.shift_right_logical(x, jnp.uint32(16))
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ lax.shift_right_logical(x, jnp.uint32(15))
    x = x * jnp.uint32(0x846CA68B)
    return x ^ lax.shift_right_logical(x, jnp.uint32(16))


def check_seed_offset(seed, offset, n: int) -> None:
    """Where seed and offset are Python (or numpy) integers: 0 <= seed < 2^32, 0 <= offset, and
    offset + n <= 2^32 (the counters are uint32). Traced values are not checked."""
    if isinstance(seed, (int, np.integer)) and not 0 <= int(seed) < _U32:
        raise ValueError(f"seed must be in [0, 2^32), got {seed}")
    if isinstance(offset, (int, np.integer)) and not (0 <= int(offset) and int(offset) + n <= _U32):
        raise ValueError(f"need 0 <= offset and offset + n <= 2^32, got offset={offset}, n={n}")


def sr_bits(seed, stream: int, offset, n: int):
    """The kernel's random bits for ``n`` elements from global index ``offset``: uint32 array whose element
    i is ``mix((offset + i) ^ mix(seed ^ 0x9E3779B9 * (stream + 1)))``; stream 0 is p, 1 is m, 2 is v.
    ``seed`` and ``offset`` may be traced; ``n`` is static."""
    check_seed_offset(seed, offset, n)
    salt = jnp.uint32((0x9E3779B9 * (stream + 1)) % _U32)
    key = _mix(jnp.asarray(seed, jnp.uint32) ^ salt)
    j = jnp.asarray(offset, jnp.uint32) + jnp.arange(n, dtype=jnp.uint32)
    return _mix(j ^ key)


def stochastic_round_bf16(x, r):
    """float32 ``x`` rounded to bfloat16 with uint32 random bits ``r`` (low 16 used), as the kernel rounds:
    the bits truncation drops are added to them, so the magnitude rounds up with probability (dropped bits)
    / 2^16 and the mean over r is x exactly (for finite x that does not round up to inf). NaN becomes a quiet
    NaN with its sign; inf stays inf."""
    u = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    r = jnp.asarray(r, jnp.uint32)
    sh16 = jnp.uint32(16)
    rounded = lax.shift_right_logical(u + (r & jnp.uint32(0xFFFF)), sh16)
    nan = jnp.uint32(0x7FC0) | (lax.shift_right_logical(u, sh16) & jnp.uint32(0x8000))
    special = jnp.where((u & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000), nan, lax.shift_right_logical(u, sh16))
    out = jnp.where((u & jnp.uint32(0x7F800000)) == jnp.uint32(0x7F800000), special, rounded)
    return lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)


def _as_bf16(a):
    a = jnp.asarray(a)
    return lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a.astype(jnp.bfloat16)


def adamw_sr_reference(p, m, v, g, *, lr, b1, b2, eps, wd, grad_scale, bc1, bc2, seed, offset=0):
    """What ``megatrain_adamw_bf16_sr`` computes, in jnp: p, m, v bfloat16 (or their uint16 bits), g float32,
    same shape. Returns the new (p, m, v) as bfloat16, equal to the kernel's bit for bit, eagerly or under
    jit. The float32 math mirrors the kernel operation for operation (1 - b1, 1 / bc1 and 1 / bc2 are computed
    once in float32, then multiplied by), and each result is rounded with ``stochastic_round_bf16`` and
    ``sr_bits``. Under jit XLA would contract a product and the sum it feeds into one fused multiply-add and
    reassociate products of constants; optimization barriers on the hyperparameters and on every product
    that feeds a sum prevent both (on CPU they cost three materialized passes over the intermediates)."""
    f32 = jnp.float32
    p, m, v = (_as_bf16(a) for a in (p, m, v))
    shape = p.shape
    p0, m0, v0 = (a.reshape(-1).astype(f32) for a in (p, m, v))
    g = jnp.asarray(g, f32).reshape(-1)
    lr, b1, b2, eps, wd, grad_scale, bc1, bc2 = lax.optimization_barrier(
        tuple(jnp.asarray(x, f32) for x in (lr, b1, b2, eps, wd, grad_scale, bc1, bc2)))
    one_b1, one_b2, inv_bc1, inv_bc2 = f32(1) - b1, f32(1) - b2, f32(1) / bc1, f32(1) / bc2
    gi = g * grad_scale
    bm, ag, bv, agg = lax.optimization_barrier((b1 * m0, one_b1 * gi, b2 * v0, (one_b2 * gi) * gi))
    mi = bm + ag
    vi = bv + agg
    q, wp = lax.optimization_barrier(((mi * inv_bc1) / (jnp.sqrt(vi * inv_bc2) + eps), wd * p0))
    u = q + wp
    pi = p0 - lax.optimization_barrier(lr * u)
    n = p0.size
    return tuple(stochastic_round_bf16(x, sr_bits(seed, k, offset, n)).reshape(shape)
                 for k, x in enumerate((pi, mi, vi)))


# The passes a quantized-moment update may run as (the kernel's ``pass`` argument): the whole update; p alone
# (``stream``: the copy the next forward fetches); the moments' codes and scales alone (``commit``, from the same
# old codes and gradient as the stream pass). Stream then commit leave exactly what the whole update does.
QUANTIZED_PASSES = {"whole": 0, "stream": 1, "commit": 2}


def quantized_pass(name: str) -> int:
    """The kernel's code of a quantized update's pass (``QUANTIZED_PASSES``); ValueError naming the choices."""
    if name not in QUANTIZED_PASSES:
        raise ValueError(f"pass must be one of {', '.join(QUANTIZED_PASSES)}, got {name!r}")
    return QUANTIZED_PASSES[name]


def cpu_features() -> str:
    """This machine's CPU feature flags (Linux's /proc/cpuinfo, sorted; empty where unreadable): part of the built
    kernel's cache key, since ``-march=native`` builds for them. A cache shared by hosts of other CPUs (a home
    folder on a network disk) then holds one build per kind of CPU, instead of handing one host's AVX-512 build to
    another that would stop on its first instruction."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    base = os.environ.get("MEGATRAIN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatrain_jax")
    return Path(base)


# No contraction into fused multiply-adds: both entry points must round identically wherever inlined.
# -fno-trapping-math lets GCC vectorize selects next to float operations (the 8-bit kernel's first pass stayed
# scalar without it: 3x slower); it changes no result, only what may happen to floating-point exception flags,
# which nothing reads.
COMPILE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                 "-ffp-contract=off")


def built_path(cxx: str, flags: tuple[str, ...]) -> Path:
    """Where the kernel built by ``cxx`` with ``flags`` is cached: keyed by the source, the machine and its CPU's
    features (``cpu_features``), the compiler and the flags."""
    tag = hashlib.sha256(SOURCE.read_bytes() + os.uname().machine.encode() + cpu_features().encode() + cxx.encode()
                         + " ".join(flags).encode())
    return _cache_dir() / f"host_adamw_{tag.hexdigest()[:16]}.so"


def build(verbose: bool = False, defines: tuple[str, ...] = ()) -> Path | None:
    """Compile the kernel into the cache (``built_path``: keyed by source, flags, compiler, machine and CPU); None
    without a compiler or when every build attempt fails. ``defines`` are preprocessor macros for the compiler (``-D``):
    ``("MEGATRAIN_NO_INTRINSICS",)`` builds the portable loops alone, as a machine without AVX2 runs them."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    flags = (*COMPILE_FLAGS, *(f"-D{d}" for d in defines))
    out = built_path(cxx, flags)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, resources.as_file(SOURCE) as src_path:
        tmp_out = Path(tmp) / out.name
        for extra in (["-march=native", "-fopenmp"], ["-fopenmp"], []):  # best first, then portable
            r = subprocess.run([cxx, *flags, *extra, str(src_path), "-o", str(tmp_out)], capture_output=True,
                               text=True)
            if r.returncode == 0:
                break
            if verbose:
                print(r.stderr, file=sys.stderr)
        else:
            warnings.warn(f"could not compile {src_path.name} with {cxx}; using the JAX host optimizer")
            return None
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


@functools.lru_cache(maxsize=None)
def load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built kernel (compiled on first call; ``defines`` as ``build``'s), or None where it cannot be built
    or loaded."""
    path = build(defines=defines)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"could not load {path}: {e}; using the JAX host optimizer")
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of the kernel's source) with its entry points' argument and result types set."""
    for fn in (lib.megatrain_adamw, lib.megatrain_adamw_stream):
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8 + [ctypes.c_int]
        fn.restype = None
    for fn in (lib.megatrain_adamw_bf16_sr, lib.megatrain_adamw_bf16_sr_g16):
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_float] * 8
                       + [ctypes.c_uint32, ctypes.c_int64])
        fn.restype = None
    for fn in (lib.megatrain_adamw_q8, lib.megatrain_adamw_m7v5):
        fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] + [ctypes.c_int64] * 3 + [ctypes.c_float] * 8
                       + [ctypes.c_uint32, ctypes.c_int64, ctypes.c_int])
        fn.restype = None
    lib.megatrain_omp_threads.restype = ctypes.c_int
    lib.megatrain_q8_vector_width.restype = ctypes.c_int
    lib.megatrain_set_threads.argtypes = [ctypes.c_int]
    lib.megatrain_set_threads.restype = None
    return lib


def require(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or load()
    if lib is None:
        raise RuntimeError("host AdamW kernel unavailable (no C++ compiler, or it failed to build)")
    return lib


def set_threads(n: int, lib: ctypes.CDLL | None = None) -> None:
    """Threads the kernel uses from now on, process-wide (n <= 0: OpenMP's default, all cores)."""
    require(lib).megatrain_set_threads(int(n))


def adamw_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, p_bf16: int | None, n: int, *, lr: float,
                  b1: float, b2: float, eps: float, wd: float, grad_scale: float, bc1: float, bc2: float,
                  g_bf16: bool = False) -> None:
    """Run the kernel on raw buffer addresses (float32 p, m, v; g float32, or bfloat16 bits where ``g_bf16``;
    optional bfloat16 out) of ``n`` elements."""
    lib.megatrain_adamw(p, m, v, g, p_bf16, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2, int(g_bf16))


def adamw_stream_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, p_bf16: int, n: int, *, lr: float,
                         b1: float, b2: float, eps: float, wd: float, grad_scale: float, bc1: float,
                         bc2: float, g_bf16: bool = False) -> None:
    """Only the bfloat16 copy of the updated parameters: ``p``, ``m`` and ``v`` are read, not written. The
    values equal, bit for bit, the copy ``adamw_inplace`` writes with the same arguments."""
    lib.megatrain_adamw_stream(p, m, v, g, p_bf16, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2, int(g_bf16))


def adamw_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, p_bf16: np.ndarray | None,
                stream_only: bool = False, lib: ctypes.CDLL | None = None, **hp) -> None:
    """The kernel on numpy arrays (contiguous float32 p, m, v; g float32 or bfloat16; bf16 out as uint16 or
    ml_dtypes.bfloat16), in place. ``stream_only`` writes just ``p_bf16`` (see ``adamw_stream_inplace``)."""
    lib = require(lib)
    for a in (p, m, v):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.size == p.size
    hp = dict(hp, g_bf16=gradient_is_bf16(g, p.size))
    if p_bf16 is not None:
        assert p_bf16.itemsize == 2 and p_bf16.flags.c_contiguous and p_bf16.size == p.size
    out = None if p_bf16 is None else p_bf16.ctypes.data
    if stream_only:
        assert out is not None, "stream_only needs a bfloat16 output"
        adamw_stream_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)
    else:
        adamw_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)


def adamw_sr_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, n: int, *, lr: float, b1: float,
                     b2: float, eps: float, wd: float, grad_scale: float, bc1: float, bc2: float, seed: int,
                     offset: int, g_bf16: bool = False) -> None:
    """Capacity mode on raw buffer addresses: bfloat16 p, m, v (updated in place, stochastically rounded),
    float32 g (bfloat16 where ``g_bf16``), ``n`` elements whose global indices start at ``offset`` (ValueError
    unless 0 <= seed < 2^32 and 0 <= offset, offset + n <= 2^32)."""
    check_seed_offset(int(seed), int(offset), int(n))
    fn = lib.megatrain_adamw_bf16_sr_g16 if g_bf16 else lib.megatrain_adamw_bf16_sr
    fn(p, m, v, g, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2, seed, offset)


def is_bf16(a: np.ndarray) -> bool:
    """bfloat16 data: ml_dtypes.bfloat16 or its uint16 bits."""
    return a.dtype.itemsize == 2 and a.dtype.name in ("uint16", "bfloat16")


def gradient_is_bf16(g: np.ndarray, size: int) -> bool:
    """Whether the gradient is bfloat16 (else float32); TypeError unless it is a contiguous array of either,
    of ``size`` elements."""
    if not ((g.dtype == np.float32 or is_bf16(g)) and g.flags.c_contiguous and g.size == size):
        raise TypeError(f"g must be a contiguous float32 or bfloat16 (uint16 bits) array of p's size {size}, got "
                        f"{g.dtype} of size {g.size}")
    return g.dtype != np.float32


def adamw_sr_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, *, seed: int, offset: int = 0,
                   lib: ctypes.CDLL | None = None, **hp) -> None:
    """Capacity mode on numpy arrays, in place: p, m, v contiguous bfloat16 (uint16 bits or
    ml_dtypes.bfloat16), g contiguous float32 or bfloat16, all the same size. See ``adamw_sr_inplace``."""
    lib = require(lib)
    for a in (p, m, v):
        if not (is_bf16(a) and a.flags.c_contiguous and a.size == p.size):
            raise TypeError(f"p, m and v must be contiguous uint16/bfloat16 arrays of one size, got {a.dtype}")
    g_bf16 = gradient_is_bf16(g, p.size)
    adamw_sr_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, p.size, seed=seed,
                     offset=offset, g_bf16=g_bf16, **hp)


# Hyperparameters of a timing run (any finite values: the kernel's time does not depend on them)
TIMING_HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)


def best_seconds(fn, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn``, after one untimed (first touch)."""
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def sustained_seconds(fn, calls: int, window: float = 0.1) -> float:
    """``fn``'s mean seconds a call over back-to-back calls, at least ``calls`` of them and at least ``window``
    seconds in all, after one untimed call (first touch): the rate a step's long run of updates sustains, where
    the fastest of a few short calls reads high (a few milliseconds each over 32M parameters, a few percent to 11%
    above the update's rate in a step on the 16-core H200 host)."""
    if calls < 1:
        raise ValueError(f"sustained_seconds needs at least one timed call, got calls={calls}")
    fn()
    done, t = 0, time.perf_counter()
    while done < calls or time.perf_counter() - t < window:
        fn()
        done += 1
    return (time.perf_counter() - t) / done


def full_precision_rates(n: int = 1 << 25, reps: int = 5, lib: ctypes.CDLL | None = None) -> dict[str, float]:
    """The fused kernel's full-precision update timed on this host over every core it may use, as the engine runs
    it: one leaf of ``n`` float32 parameters (float32 gradient), best of ``reps``. ``full``: parameters per second
    split in two passes (the bfloat16 stream copy, then masters and moments); ``lean``: the second pass alone
    (one pass, no copy); ``first_half_share``: the first pass's share of the two; ``one_pass_speedup``: how much
    faster the update runs whole in one pass. The step-time model's host fields (``plan.speeds``); at the default
    ``n`` (576 MiB of arrays, beyond the caches; the engine's leaves run to ~45M parameters) it takes about 0.5 s
    on an H200's 16-core host."""
    lib = require(lib)
    p, m, v, g = (np.full(n, x, np.float32) for x in (0.5, 0.0, 0.0, 0.01))
    copy = np.zeros(n, np.uint16)
    first = best_seconds(lambda: adamw_numpy(p, m, v, g, copy, stream_only=True, lib=lib, **TIMING_HP), reps)
    commit = best_seconds(lambda: adamw_numpy(p, m, v, g, None, lib=lib, **TIMING_HP), reps)
    whole = best_seconds(lambda: adamw_numpy(p, m, v, g, copy, lib=lib, **TIMING_HP), reps)
    return {"full": n / (first + commit), "lean": n / commit, "first_half_share": first / (first + commit),
            "one_pass_speedup": (first + commit) / whole}


SUSTAINED_CALLS = 2  # the fewest timed calls of a mode's sustained timing (its window is a tenth of a second)


def mode_rates(n: int = 1 << 25, reps: int = 5, lib: ctypes.CDLL | None = None) -> dict[str, float]:
    """The fused kernel timed on this host for every precision mode, each alone over every core it may use:
    ``full_precision_rates`` (``full``, ``lean``, ``first_half_share``, ``one_pass_speedup``), then parameters per
    second of capacity mode (``capacity``: bfloat16 masters and moments rounded stochastically, float32 gradient)
    and of each quantized-moment mode under its format's name (``q8``, ``m7v5``: bfloat16 gradient, as those modes
    send it), each over at least a tenth of a second of calls (``sustained_seconds``). The modes do not follow one
    another from host to host: full precision is bound by the host's memory, the others by its cores (the 16-core
    H200 host timed full precision at 3.0 to 3.7 G params/s on different days, capacity mode ran at 5.5 in a step
    on the 3.7 day). About 0.4 s more than ``full_precision_rates`` on an H200's 16-core host; the arrays are
    freed after."""
    from megatrain_jax.engine.update.moment_formats import FORMATS  # above this module: its kernels call here
    lib = require(lib)
    rates = dict(full_precision_rates(n, reps, lib))
    pb, mb, vb = (np.full(n, x, np.uint16) for x in (0x3F00, 0, 0))
    g = np.full(n, 0.01, np.float32)
    rates["capacity"] = n / sustained_seconds(lambda: adamw_sr_numpy(pb, mb, vb, g, seed=0, lib=lib, **TIMING_HP),
                                              SUSTAINED_CALLS)
    del pb, mb, vb, g
    shape = (max(n // 4096, 1), 4096)
    gq = np.full(shape, 0x3C24, np.uint16)  # bfloat16 gradients
    for name, fmt in FORMATS.items():
        pq = np.full(shape, 0x3F00, np.uint16)
        mq, vq = (np.zeros(fmt.codes_shape(shape, kind), np.uint8) for kind in ("m", "v"))
        ma, va = (np.zeros(fmt.scale_shape(shape), np.float32) for _ in range(2))
        rates[name] = pq.size / sustained_seconds(
            lambda: fmt.inplace(lib, pq.ctypes.data, mq.ctypes.data, vq.ctypes.data, ma.ctypes.data, va.ctypes.data,
                                gq.ctypes.data, shape[0], shape[1], block=fmt.block, g_bf16=True, seed=0, offset=0,
                                **TIMING_HP), SUSTAINED_CALLS)
        del pq, mq, vq, ma, va
    return rates


if __name__ == "__main__":
    path = build(verbose=True)
    print(path or "no C++ compiler (or the build failed): the JAX host optimizer will be used")
    if path:
        print("OpenMP threads:", load().megatrain_omp_threads())
