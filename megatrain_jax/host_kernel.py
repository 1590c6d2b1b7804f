"""Fused host AdamW: the C++ kernel (``kernels/host_adamw.cpp``, built on first use where a C++ compiler
exists) and its pure-jnp reference. ``load()`` returns None when no compiler is found or the build fails;
callers then use the JAX path (``EngineConfig.host_kernel`` turns the kernel off on purpose).

The source ships in the wheel as ``megatrain_jax/kernels/host_adamw.cpp``; in the repository (and an
editable install) it is the top-level ``kernels/`` folder, which pyproject maps onto ``megatrain_jax.kernels``.
Run from a checkout without installing (``PYTHONPATH=.``), that mapping does not exist, and the source is
read from the checkout's ``kernels/`` folder beside the package.

Build ahead of time (e.g. in an image): ``python -m megatrain_jax.host_kernel``.
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
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import numpy as np

def source_path():
    """Where the C++ source is: the installed package data, or a source checkout's kernels/ folder."""
    try:
        return resources.files("megatrain_jax.kernels") / "host_adamw.cpp"
    except ModuleNotFoundError:  # a source checkout on sys.path, not installed
        return Path(__file__).resolve().parents[1] / "kernels" / "host_adamw.cpp"


SOURCE = source_path()


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


def build(verbose: bool = False) -> Path | None:
    """Compile the kernel into the cache (keyed by source, flags, compiler and machine); None without a
    compiler or when every build attempt fails."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + os.uname().machine.encode() + cxx.encode() + " ".join(_FLAGS).encode())
    out = _cache_dir() / f"host_adamw_{tag.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, resources.as_file(SOURCE) as src_path:
        tmp_out = Path(tmp) / out.name
        for extra in (["-march=native", "-fopenmp"], ["-fopenmp"], []):  # best first, then portable
            r = subprocess.run([cxx, *_FLAGS, *extra, str(src_path), "-o", str(tmp_out)], capture_output=True,
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
def load() -> ctypes.CDLL | None:
    """The built kernel (compiled on first call), or None where it cannot be built or loaded."""
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"could not load {path}: {e}; using the JAX host optimizer")
        return None
    for fn in (lib.megatrain_adamw, lib.megatrain_adamw_stream):
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8
        fn.restype = None
    lib.megatrain_omp_threads.restype = ctypes.c_int
    lib.megatrain_set_threads.argtypes = [ctypes.c_int]
    lib.megatrain_set_threads.restype = None
    return lib


def _require(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or load()
    if lib is None:
        raise RuntimeError("host AdamW kernel unavailable (no C++ compiler, or it failed to build)")
    return lib


def set_threads(n: int, lib: ctypes.CDLL | None = None) -> None:
    """Threads the kernel uses from now on, process-wide (n <= 0: OpenMP's default, all cores)."""
    _require(lib).megatrain_set_threads(int(n))


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
    lib = _require(lib)
    for a in (p, m, v, g):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.size == p.size
    if p_bf16 is not None:
        assert p_bf16.itemsize == 2 and p_bf16.flags.c_contiguous and p_bf16.size == p.size
    out = None if p_bf16 is None else p_bf16.ctypes.data
    if stream_only:
        assert out is not None, "stream_only needs a bfloat16 output"
        adamw_stream_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)
    else:
        adamw_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, out, p.size, **hp)


if __name__ == "__main__":
    path = build(verbose=True)
    print(path or "no C++ compiler (or the build failed): the JAX host optimizer will be used")
    if path:
        print("OpenMP threads:", load().megatrain_omp_threads())
