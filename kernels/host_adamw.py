"""Fused host AdamW: the C++ kernel (built on first use where a C++ compiler exists) and its pure-jnp
reference. ``load()`` returns None when no compiler is found or ``MEGATRAIN_NO_KERNELS=1``; callers
then fall back to the JAX path.

Build ahead of time (e.g. in an image): ``python -m kernels.host_adamw``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("host_adamw.cpp")


def adamw_reference(p, m, v, g, *, lr, b1, b2, eps, wd, grad_scale, bc1, bc2):
    """What the kernel computes, in jnp float32: returns (p, m, v, p as bfloat16)."""
    g = g * jnp.float32(grad_scale)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + wd * p
    p = p - lr * u
    return p, m, v, p.astype(jnp.bfloat16)


def _cache_dir() -> Path:
    base = os.environ.get("MEGATRAIN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatrain_jax")
    return Path(base)


# No contraction into fused multiply-adds: both entry points must round identically wherever inlined.
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")


def build(verbose: bool = False, defines: tuple[str, ...] = ()) -> Path | None:
    """Compile the kernel into the cache (keyed by source, flags and machine); None without a compiler.
    ``defines`` are for experiments: ``"MEGATRAIN_PREFETCH=256"`` becomes ``-DMEGATRAIN_PREFETCH=256``, and
    an entry starting with ``-`` is passed as a compiler flag."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    src = SOURCE.read_bytes()
    flags_id = " ".join(_FLAGS + defines).encode()
    tag = hashlib.sha256(src + os.uname().machine.encode() + cxx.encode() + flags_id).hexdigest()[:16]
    out = _cache_dir() / f"host_adamw_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = Path(tmp) / out.name
        base = [cxx, *_FLAGS, *(d if d.startswith("-") else f"-D{d}" for d in defines), str(SOURCE), "-o", str(tmp_out)]
        for flags in (["-march=native", "-fopenmp"], ["-fopenmp"], []):  # best first, then portable
            r = subprocess.run(base[:2] + flags + base[2:], capture_output=True, text=True)
            if r.returncode == 0:
                break
            if verbose:
                print(r.stderr, file=sys.stderr)
        else:
            warnings.warn(f"could not compile {SOURCE.name} with {cxx}; using the JAX host optimizer")
            return None
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


@functools.lru_cache(maxsize=None)
def load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if os.environ.get("MEGATRAIN_NO_KERNELS") == "1":
        return None
    path = build(defines=defines)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for fn in (lib.megatrain_adamw, lib.megatrain_adamw_stream):
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8
        fn.restype = None
    lib.megatrain_omp_threads.restype = ctypes.c_int
    lib.megatrain_set_threads.argtypes = [ctypes.c_int]
    lib.megatrain_set_threads.restype = None
    return lib


def adamw_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, p_bf16: int | None, n: int, *, lr: float,
                  b1: float, b2: float, eps: float, wd: float, grad_scale: float, bc1: float, bc2: float) -> None:
    """Run the kernel on raw buffer addresses (float32 p, m, v, g; optional bfloat16 out) of ``n`` elements."""
    lib.megatrain_adamw(p, m, v, g, p_bf16, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2)


def adamw_stream_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, p_bf16: int, n: int, *, lr: float,
                         b1: float, b2: float, eps: float, wd: float, grad_scale: float, bc1: float,
                         bc2: float) -> None:
    """Only the bfloat16 copy of the updated parameters: ``p``, ``m`` and ``v`` are read, not written. The
    values equal, bit for bit, the copy ``adamw_inplace`` writes with the same arguments."""
    lib.megatrain_adamw_stream(p, m, v, g, p_bf16, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2)


def adamw_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, p_bf16: np.ndarray | None,
                stream_only: bool = False, lib: ctypes.CDLL | None = None, **hp) -> None:
    """The kernel on numpy arrays (contiguous float32; bf16 out as uint16 or ml_dtypes.bfloat16), in place.
    ``stream_only`` writes just ``p_bf16`` (see ``adamw_stream_inplace``)."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("host AdamW kernel unavailable (no C++ compiler, or MEGATRAIN_NO_KERNELS=1)")
    for a in (p, m, v, g):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.size == p.size
    out = None if p_bf16 is None else p_bf16.ctypes.data
    if stream_only:
        assert out is not None, "stream_only needs a bfloat16 output"
        adamw_stream_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)
    else:
        adamw_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)


if __name__ == "__main__":
    path = build(verbose=True)
    print(path or "no C++ compiler found: the JAX host optimizer will be used")
    if path:
        print("OpenMP threads:", load().megatrain_omp_threads())
