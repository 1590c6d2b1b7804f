"""The host kernel's rates on the machine that runs it, in one process, for two questions:

1. **The quantized kernels' builds** (issue 52): the 8-bit and m7v5 moment kernels (bfloat16 gradients,
   the engine's defaults: blocks of 256, 128 and 128) as built with AVX2 passes and as the portable loops alone
   (``MEGATRAIN_NO_INTRINSICS``), parameters/s over every usable core and over one.
2. **The split update's first pass** (issue 51, the 32K row): the step's forward waits for
   ``megatrain_adamw_stream`` (read p, m, v, g: 16 bytes a parameter; write the bfloat16 copy: 2), which ran
   at about the whole update's rate inside a step. Against it: how fast this host reads four float32 streams
   at all (a sum over them), and the same pass written here in variants of its memory access: prefetches for
   reading instead of writing, non-temporal stores of the copy, other prefetch distances, more sub-ranges per
   chunk, no software prefetch. Every variant's copy is checked equal, bit for bit, to the shipped pass's.

    PYTHONPATH=. python experiments/studies/host_kernel_rates.py --out $OUT/host_kernel_rates.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)  # child.py
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax
from child import median_seconds, results_header  # noqa: E402

from megatrain_jax.engine.update import host_kernel  # noqa: E402
from megatrain_jax.engine.update.m7v5 import M7V5_BLOCK, adamw_m7v5_numpy, m7v5_quantize  # noqa: E402
from megatrain_jax.engine.update.q8 import Q8_BLOCK, adamw_q8_numpy, q8_quantize  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.5, bc1=0.1, bc2=0.05)
BF16 = ml_dtypes.bfloat16

# The first pass in variants. The element math is adamw_block's (kernels/host_adamw.cpp) with kState = false,
# compiled with the product's flags, so every variant writes the same bits; only the memory access differs.
VARIANTS_CPP = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <immintrin.h>
#include <omp.h>
struct H { float lr, b1, b2, eps, wd, gs, ob1, ob2, ibc1, ibc2; };
static inline uint16_t to_bf16(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}
template <int kPf, int kPfWrite, bool kNt>
static inline void block(const float* __restrict p, const float* __restrict m, const float* __restrict v,
                         const float* __restrict g, uint16_t* __restrict out, int64_t b, int64_t e, int64_t hi,
                         const H& h) {
  if (kPf > 0 && b + kPf < hi) {
    __builtin_prefetch(p + b + kPf, kPfWrite, 2); __builtin_prefetch(m + b + kPf, kPfWrite, 2);
    __builtin_prefetch(v + b + kPf, kPfWrite, 2); __builtin_prefetch(g + b + kPf, 0, 2);
  }
  alignas(32) uint16_t tmp[16];
  uint16_t* dst = kNt ? tmp : out + b;
#pragma omp simd
  for (int64_t i = 0; i < e - b; ++i) {
    const float gi = g[b + i] * h.gs;
    const float mi = h.b1 * m[b + i] + h.ob1 * gi;
    const float vi = h.b2 * v[b + i] + h.ob2 * gi * gi;
    const float u = (mi * h.ibc1) / (std::sqrt(vi * h.ibc2) + h.eps) + h.wd * p[b + i];
    dst[i] = to_bf16(p[b + i] - h.lr * u);
  }
  if (kNt) {
    if (e - b == 16 && (reinterpret_cast<uintptr_t>(out + b) & 31) == 0)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + b), _mm256_load_si256(reinterpret_cast<__m256i*>(tmp)));
    else
      std::memcpy(out + b, tmp, 2 * (e - b));
  }
}
template <int kPf, int kPfWrite, bool kNt, int kSplit>
static void pass(const float* p, const float* m, const float* v, const float* g, uint16_t* out, int64_t n,
                 const H h) {
  const int64_t kChunk = 65536, kStep = 16;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = std::min(kChunk, std::max<int64_t>(32, ((n + nt - 1) / nt + 31) / 32 * 32));
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = c * chunk, hi = std::min(n, (c + 1) * chunk);
      const int64_t sub = (hi - lo) / kSplit / kStep * kStep;
      for (int64_t off = 0; off < sub; off += kStep)
        for (int64_t k = 0; k < kSplit; ++k) {
          const int64_t b = lo + k * sub + off, end = k + 1 < kSplit ? lo + (k + 1) * sub : hi;
          block<kPf, kPfWrite, kNt>(p, m, v, g, out, b, b + kStep, end, h);
        }
      for (int64_t b = lo + kSplit * sub; b < hi; b += kStep)
        block<kPf, kPfWrite, kNt>(p, m, v, g, out, b, std::min(b + kStep, hi), hi, h);
    }
    if (kNt) _mm_sfence();
  }
}
// the sum of four float32 streams: what reading them costs with no other work
extern "C" double read4(const float* a, const float* b, const float* c, const float* d, int64_t n) {
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < n; ++i) total += a[i] + b[i] + c[i] + d[i];
  return total;
}
#define V(name, ...) extern "C" void name(const float* p, const float* m, const float* v, const float* g, \
    uint16_t* out, int64_t n, float lr, float b1, float b2, float eps, float wd, float gs, float bc1, float bc2) { \
  pass<__VA_ARGS__>(p, m, v, g, out, n, H{lr, b1, b2, eps, wd, gs, 1 - b1, 1 - b2, 1 / bc1, 1 / bc2}); }
V(shipped_layout, 1024, 1, false, 2)
V(prefetch_read, 1024, 0, false, 2)
V(prefetch_read_nt_copy, 1024, 0, true, 2)
V(nt_copy, 1024, 1, false, 2)
V(prefetch_2048, 2048, 0, false, 2)
V(prefetch_4096, 4096, 0, false, 2)
V(split_4, 1024, 0, false, 4)
V(no_prefetch, 0, 0, false, 2)
"""
VARIANTS = ["shipped_layout", "prefetch_read", "prefetch_read_nt_copy", "nt_copy", "prefetch_2048", "prefetch_4096",
            "split_4", "no_prefetch"]


def compile_variants(tmp: str) -> ctypes.CDLL:
    src, so = os.path.join(tmp, "variants.cpp"), os.path.join(tmp, "variants.so")
    with open(src, "w") as f:
        f.write(VARIANTS_CPP)
    subprocess.run(["g++", *host_kernel.COMPILE_FLAGS, "-march=native", "-fopenmp", src, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    for name in VARIANTS:
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8
    lib.read4.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    lib.read4.restype = ctypes.c_double
    return lib


FORMATS = {"q8": (q8_quantize, adamw_q8_numpy, Q8_BLOCK), "m7v5": (m7v5_quantize, adamw_m7v5_numpy, M7V5_BLOCK)}


def quantized_state(fmt: str, n: int, block: int) -> tuple:
    """Seeded arrays of one format's update on n parameters (rows of 4,096) in blocks of ``block``: p, m, v,
    their scales, and a bfloat16 gradient."""
    rng = np.random.default_rng(0)
    shape = (n // 4096, 4096)
    quantize = FORMATS[fmt][0]
    p = rng.standard_normal(shape, np.float32).astype(BF16)
    g = (1e-3 * rng.standard_normal(shape, np.float32)).astype(BF16)
    m, ma = quantize(1e-3 * rng.standard_normal(shape, np.float32), block, "m", seed=1)
    v, va = quantize(1e-6 * np.abs(rng.standard_normal(shape, np.float32)), block, "v", seed=2)
    return p, m, v, ma, va, g


def quantized(lib, fmt: str, n: int, reps: int, block: int | None = None) -> float:
    """Parameters/s of one format's kernel on n parameters (rows of 4,096), bfloat16 gradients, in blocks of
    ``block`` (None: the format's own)."""
    _, run, own = FORMATS[fmt]
    block = block or own
    arrays = quantized_state(fmt, n, block)
    step = iter(range(10 ** 6))
    return n / median_seconds(lambda: run(*arrays, block=block, seed=next(step), lib=lib, **HP), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=256, help="millions of parameters per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.params * 1_000_000 // 4096 * 4096
    cores = len(os.sched_getaffinity(0))
    runs = []

    def record(run: dict) -> None:  # each measurement printed and the file rewritten: a cut run keeps what it measured
        runs.append(run)
        print(json.dumps(run), flush=True)
        with open(args.out, "w") as f:
            json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)

    builds = {"avx2_passes": host_kernel.load(), "portable": host_kernel.load(("MEGATRAIN_NO_INTRINSICS",))}
    for build, lib in builds.items():
        for threads in (cores, 1):
            host_kernel.set_threads(threads, lib)
            for fmt in ("q8", "m7v5"):
                rate = quantized(lib, fmt, n if threads > 1 else n // 8, args.reps)
                record({"system": f"{fmt}_kernel_bf16_grad", "build": build, "threads": threads,
                        "params_per_s": round(rate, 1)})
            host_kernel.set_threads(0, lib)

    lib = builds["avx2_passes"]
    rng = np.random.default_rng(1)
    p, m, g = (rng.standard_normal(n, np.float32) * s for s in (1.0, 1e-3, 1e-3))
    v = np.abs(rng.standard_normal(n, np.float32)) * 1e-6
    ref = np.empty(n, np.uint16)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    hp = [HP[k] for k in ("lr", "b1", "b2", "eps", "wd", "grad_scale", "bc1", "bc2")]
    pc, mc, vc, copy, copy16 = p.copy(), m.copy(), v.copy(), np.empty_like(ref), np.empty_like(ref)
    g16 = (g.view(np.uint32) >> 16).astype(np.uint16)  # a bfloat16 gradient (truncated: any values serve)
    # the product's two float32 entry points, with a float32 and a bfloat16 gradient: (system, gradient, call,
    # bytes written a parameter); both read 12 bytes of p, m and v and the gradient's 4 or 2
    for system, grad, call, written in (
            ("stream_pass", "float32",
             lambda: lib.megatrain_adamw_stream(ptr(p), ptr(m), ptr(v), ptr(g), ptr(ref), n, *hp, 0), 2),
            ("whole_update", "float32",
             lambda: lib.megatrain_adamw(ptr(pc), ptr(mc), ptr(vc), ptr(g), ptr(copy), n, *hp, 0), 14),
            ("stream_pass", "bfloat16",
             lambda: lib.megatrain_adamw_stream(ptr(p), ptr(m), ptr(v), ptr(g16), ptr(copy16), n, *hp, 1), 2),
            ("whole_update", "bfloat16",
             lambda: lib.megatrain_adamw(ptr(pc), ptr(mc), ptr(vc), ptr(g16), ptr(copy), n, *hp, 1), 14)):
        s = median_seconds(call, args.reps)
        read = 12 + (4 if grad == "float32" else 2)
        record({"system": system, "variant": "product_kernel", "gradient": grad, "threads": cores,
                "params_per_s": round(n / s, 1), "read_gb_per_s": round(read * n / s / 1e9, 2),
                "written_gb_per_s": round(written * n / s / 1e9, 2)})
    del pc, mc, vc, copy, copy16, g16
    with tempfile.TemporaryDirectory() as tmp:
        var = compile_variants(tmp)
        s = median_seconds(lambda: var.read4(ptr(p), ptr(m), ptr(v), ptr(g), n), args.reps)
        record({"system": "read_four_streams", "threads": cores, "elements_per_s": round(n / s, 1),
                "read_gb_per_s": round(16 * n / s / 1e9, 2)})
        for name in VARIANTS:
            out = np.zeros(n, np.uint16)
            fn = getattr(var, name)
            s = median_seconds(lambda: fn(ptr(p), ptr(m), ptr(v), ptr(g), ptr(out), n, *hp), args.reps)
            record({"system": "stream_pass", "variant": name, "threads": cores, "params_per_s": round(n / s, 1),
                    "read_gb_per_s": round(16 * n / s / 1e9, 2), "equal_to_product": bool((out == ref).all())})


if __name__ == "__main__":
    main()
