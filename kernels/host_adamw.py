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


def build(verbose: bool = False) -> Path | None:
    """Compile the kernel into the cache (keyed by source hash and machine); None without a compiler."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + os.uname().machine.encode() + cxx.encode()).hexdigest()[:16]
    out = _cache_dir() / f"host_adamw_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = Path(tmp) / out.name
        base = [cxx, "-O3", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", str(SOURCE), "-o", str(tmp_out)]
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


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    if os.environ.get("MEGATRAIN_NO_KERNELS") == "1":
        return None
    path = build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.megatrain_adamw.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8
    lib.megatrain_adamw.restype = None
    lib.megatrain_omp_threads.restype = ctypes.c_int
    return lib


def adamw_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, g: int, p_bf16: int | None, n: int, *, lr: float,
                  b1: float, b2: float, eps: float, wd: float, grad_scale: float, bc1: float, bc2: float) -> None:
    """Run the kernel on raw buffer addresses (float32 p, m, v, g; optional bfloat16 out) of ``n`` elements."""
    lib.megatrain_adamw(p, m, v, g, p_bf16, n, lr, b1, b2, eps, wd, grad_scale, bc1, bc2)


def adamw_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, p_bf16: np.ndarray | None, **hp) -> None:
    """The kernel on numpy arrays (contiguous float32; bf16 out as uint16 or ml_dtypes.bfloat16), in place."""
    lib = load()
    if lib is None:
        raise RuntimeError("host AdamW kernel unavailable (no C++ compiler, or MEGATRAIN_NO_KERNELS=1)")
    for a in (p, m, v, g):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.size == p.size
    out = None if p_bf16 is None else p_bf16.ctypes.data
    adamw_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)


if __name__ == "__main__":
    path = build(verbose=True)
    print(path or "no C++ compiler found: the JAX host optimizer will be used")
    if path:
        print("OpenMP threads:", load().megatrain_omp_threads())
