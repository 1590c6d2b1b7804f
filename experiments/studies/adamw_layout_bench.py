"""Does the host AdamW go faster with its state interleaved? (issue 33's last lever, a study: the engine keeps p, m
and v as three arrays.)

The fused kernel and torch's fused CPU AdamW both move 28 bytes a parameter (read p, m, v, g; write p, m, v) and
are limited per core by the cache misses each keeps in flight (experiments/studies/NOTES.md, v6-v8). Interleaving
the state does not change the bytes, only the number of streams a core walks: four (p, m, v, g) in the engine's
layout, three with m and v interleaved ([m0, v0, m1, v1, ...]), two with p, m and v interleaved. Fewer, denser
streams may let the hardware prefetchers keep more lines in flight.

Timed in alternating rounds in one process, on pageable numpy arrays (as the engine keeps its masters and moments):
- ``soa``: the engine's kernel (``host_kernel.adamw_numpy``);
- ``mv``: p, [m, v] interleaved, g; ``pmv``: [p, m, v] interleaved, g (compiled here from the source below, with the
  engine's flags, chunking and prefetch distance);
- ``torch``: torch's fused CPU AdamW, where torch is installed.
Before timing, the two interleaved kernels are checked bit for bit against ``soa`` on a small array.

    PYTHONPATH=. python experiments/studies/adamw_layout_bench.py --params 256 --out $OUT/adamw_layout.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatrain_jax.engine.update import host_kernel  # noqa: E402

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <omp.h>

namespace {
constexpr int64_t kChunk = 65536, kStep = 16, kPrefetch = 1024;
struct H { float lr, b1, b2, eps, wd, gs, ob1, ob2, ibc1, ibc2; };

// One element, in the engine kernel's order (host_adamw.cpp, adamw_block).
inline void one(float& p, float& m, float& v, float g0, const H& h) {
  const float g = g0 * h.gs;
  const float mi = h.b1 * m + h.ob1 * g;
  const float vi = h.b2 * v + h.ob2 * g * g;
  const float u = (mi * h.ibc1) / (std::sqrt(vi * h.ibc2) + h.eps) + h.wd * p;
  m = mi; v = vi; p = p - h.lr * u;
}

template <class Block>
void chunks(int64_t n, const Block& block) {
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = std::min(kChunk, std::max<int64_t>(32, ((n + nt - 1) / nt + 31) / 32 * 32));
    const int64_t count = (n + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < count; ++c) {
      const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      for (int64_t b = lo; b < hi; b += kStep) block(b, std::min(b + kStep, hi), hi);
    }
  }
}
}  // namespace

extern "C" void adamw_mv(float* p, float* mv, const float* g, int64_t n, float lr, float b1, float b2, float eps,
                         float wd, float gs, float bc1, float bc2) {
  const H h{lr, b1, b2, eps, wd, gs, 1 - b1, 1 - b2, 1 / bc1, 1 / bc2};
  chunks(n, [&](int64_t b, int64_t e, int64_t hi) {
    if (b + kPrefetch < hi) {
      __builtin_prefetch(p + b + kPrefetch, 1, 2);
      __builtin_prefetch(mv + 2 * (b + kPrefetch), 1, 2);
      __builtin_prefetch(mv + 2 * (b + kPrefetch) + 16, 1, 2);
      __builtin_prefetch(g + b + kPrefetch, 0, 2);
    }
#pragma omp simd
    for (int64_t i = b; i < e; ++i) one(p[i], mv[2 * i], mv[2 * i + 1], g[i], h);
  });
}

extern "C" void adamw_pmv(float* pmv, const float* g, int64_t n, float lr, float b1, float b2, float eps, float wd,
                          float gs, float bc1, float bc2) {
  const H h{lr, b1, b2, eps, wd, gs, 1 - b1, 1 - b2, 1 / bc1, 1 / bc2};
  chunks(n, [&](int64_t b, int64_t e, int64_t hi) {
    if (b + kPrefetch < hi) {
      for (int k = 0; k < 3; ++k) __builtin_prefetch(pmv + 3 * (b + kPrefetch) + 16 * k, 1, 2);
      __builtin_prefetch(g + b + kPrefetch, 0, 2);
    }
#pragma omp simd
    for (int64_t i = b; i < e; ++i) one(pmv[3 * i], pmv[3 * i + 1], pmv[3 * i + 2], g[i], h);
  });
}
"""

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)


def build() -> ctypes.CDLL:
    """The two interleaved kernels, compiled with the engine kernel's flags (host_kernel.COMPILE_FLAGS,
    -march=native)."""
    work = tempfile.mkdtemp(prefix="adamw_layout_")
    src, lib = os.path.join(work, "layout.cpp"), os.path.join(work, "layout.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run(["g++", *host_kernel.COMPILE_FLAGS, "-march=native", "-fopenmp", src, "-o", lib], check=True)
    so = ctypes.CDLL(lib)
    f32 = ctypes.POINTER(ctypes.c_float)
    hyper = [ctypes.c_float] * 8
    so.adamw_mv.argtypes = [f32, f32, f32, ctypes.c_int64, *hyper]
    so.adamw_pmv.argtypes = [f32, f32, ctypes.c_int64, *hyper]
    return so


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def hyper() -> list[float]:
    return [HP[k] for k in ("lr", "b1", "b2", "eps", "wd", "grad_scale", "bc1", "bc2")]


def make(so, layout: str, n: int, seed: int = 0):
    """(step, state) for ``layout`` over n parameters of random state; state(): (p, m, v) as separate arrays."""
    rng = np.random.default_rng(seed)
    p, m, g = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(n, dtype=np.float32))
    if layout == "soa":
        return (lambda: host_kernel.adamw_numpy(p, m, v, g, None, **HP)), (lambda: (p, m, v))
    if layout == "mv":
        mv = np.stack([m, v], axis=1).reshape(-1)
        return (lambda: so.adamw_mv(ptr(p), ptr(mv), ptr(g), n, *hyper())), (lambda: (p, mv[0::2], mv[1::2]))
    if layout == "pmv":
        pmv = np.stack([p, m, v], axis=1).reshape(-1)
        return (lambda: so.adamw_pmv(ptr(pmv), ptr(g), n, *hyper())), (lambda: (pmv[0::3], pmv[1::3], pmv[2::3]))
    if layout == "torch":
        import torch
        params = [torch.nn.Parameter(torch.from_numpy(p.copy()))]
        params[0].grad = torch.from_numpy(g.copy())
        return torch.optim.AdamW(params, lr=HP["lr"], weight_decay=HP["wd"], fused=True).step, None
    raise ValueError(layout)


def check(so) -> None:
    """The interleaved kernels write what the engine's writes, bit for bit (3 steps, an odd length)."""
    n = 70_001
    runs = {k: make(so, k, n) for k in ("soa", "mv", "pmv")}
    for _ in range(3):
        for step, _ in runs.values():
            step()
    ref = runs["soa"][1]()
    for k in ("mv", "pmv"):
        for a, b in zip(ref, runs[k][1]()):
            if not np.array_equal(a.view(np.uint32), np.ascontiguousarray(b).view(np.uint32)):
                raise SystemExit(f"layout {k!r} differs from the engine's kernel")


def cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=256, help="millions of parameters")
    ap.add_argument("--reps", type=int, default=11, help="timed rounds (layouts alternate within a round)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if host_kernel.load() is None:
        raise SystemExit("the engine's host kernel did not build here: nothing to compare against")
    so = build()
    check(so)
    n = args.params * 2**20
    steps = {}
    for k in ("soa", "mv", "pmv", "torch"):
        try:
            steps[k] = make(so, k, n)[0]
        except ImportError:
            pass
    for fn in steps.values():
        fn()  # first touch
    times = {k: [] for k in steps}
    for _ in range(args.reps):
        for k, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    rates = {k: n / statistics.median(v) for k, v in times.items()}
    for k, r in rates.items():
        print(f"{k:6s} {r / 1e9:6.2f} G params/s  {r * 28 / 1e9:6.1f} GB/s at 28 B/param"
              + (f"  {r / rates['soa']:.3f}x soa" if k != "soa" else ""), flush=True)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    out = {"name": os.path.splitext(os.path.basename(args.out))[0],
           "command": "PYTHONPATH=. python experiments/studies/adamw_layout_bench.py "
           + " ".join(sys.argv[1:] if argv is None else argv),
           "git_commit": commit, "date": datetime.date.today().isoformat(),
           "device": {"cpu_cores": os.cpu_count(), "cpu": cpu_name()},
           "params": n, "reps": args.reps, "checked_bit_for_bit": ["mv", "pmv"],
           "runs": [{"layout": k, "params_per_s": r, "gb_per_s_at_28_bytes": r * 28 / 1e9,
                     "vs_soa": r / rates["soa"], "seconds": times[k]} for k, r in rates.items()]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
