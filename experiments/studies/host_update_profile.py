"""Where the host AdamW update's time goes (issue 33), on whatever machine runs it, in one process:

1. the machine: cores this process may use, NUMA nodes and their CPUs, transparent huge pages;
2. its host memory bandwidth: large numpy copies split over 1..N threads (numpy releases the GIL while it
   copies), counted as bytes read + bytes written; and STREAM's copy and triad (``a = b + s * c``, doubles,
   every usable core through OpenMP, compiled here with g++ -O3 -march=native; counted as STREAM counts: 16 and
   24 bytes per element, write-allocate traffic not counted), the ceiling the issue's "80% of the host's
   bandwidth" is judged against;
3. the fused kernel on pageable numpy arrays, as the engine keeps masters and moments, over 1..N threads:
   parameters/s and the bandwidth that implies at the kernel's bytes per parameter (read p, m, v, g: 16;
   write p, m, v: 12; the bf16 stream copy: 2), against (2);
4. page faults: the kernel's first pass over freshly allocated arrays (first touch) against later ones
   (``ru_minflt``), and the same arrays with ``madvise(MADV_HUGEPAGE)``.

    PYTHONPATH=. python experiments/studies/host_update_profile.py --params 512 --out $OUT/host_update_profile.json

Pinned against pageable memory and how much of the update hides behind GPU work need the GPU:
``experiments/host_adam_bench.py`` (the HostOptimizer on pinned arrays beside ``fused_kernel_on_numpy_fp32``)
and a ``bench.py --timeline-steps`` run.
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)  # child.py
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax
from child import median_seconds  # noqa: E402

from megatrain_jax.engine.update import host_kernel  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)
KERNEL_BYTES = {"with_bf16_copy": 30, "fp32_only": 28}  # bytes moved per parameter by one update


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def machine() -> dict:
    nodes = {os.path.basename(n): read(os.path.join(n, "cpulist"))
             for n in sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))}
    return {"cpus_usable": len(os.sched_getaffinity(0)), "cpus_online": os.cpu_count(), "numa_nodes": nodes,
            "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag")}


def thread_counts(cpus: int) -> list[int]:
    counts, n = [], 1
    while n < cpus:
        counts.append(n)
        n *= 2
    return counts + [cpus]


def copy_bandwidth(nbytes: int, threads: int, reps: int) -> float:
    """GB/s of bytes read + bytes written, copying ``nbytes`` split over ``threads`` threads."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(c[0], c[-1] + 1) for c in chunks if c.size]
    with ThreadPoolExecutor(threads) as pool:
        def copy():
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
        s = median_seconds(copy, reps)
    return 2 * nbytes / s / 1e9


STREAM_C = r"""
#include <omp.h>
#include <stddef.h>
void stream_init(double *a, double *b, double *c, size_t n) {
  #pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.0; }
}
void stream_copy(double *c, const double *a, size_t n) {
  #pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) c[i] = a[i];
}
void stream_triad(double *a, const double *b, const double *c, double s, size_t n) {
  #pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
int stream_threads(void) { return omp_get_max_threads(); }
"""


def stream(mib: int, reps: int) -> dict:
    """STREAM's copy and triad over three arrays of ``mib`` MiB each (first touched by the same threads that
    then run, as STREAM does), best of ``reps``, GB/s as STREAM counts them."""
    import ctypes
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src, so = os.path.join(tmp, "stream.c"), os.path.join(tmp, "stream.so")
        with open(src, "w") as f:
            f.write(STREAM_C)
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", so], check=True)
        lib = ctypes.CDLL(so)
    n = (mib << 20) // 8
    a, b, c = (np.empty(n, np.float64) for _ in range(3))
    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    size = ctypes.c_size_t(n)
    lib.stream_init(ptr(a), ptr(b), ptr(c), size)
    best = {}
    for name, call, nbytes in (("copy", lambda: lib.stream_copy(ptr(c), ptr(a), size), 16 * n),
                               ("triad", lambda: lib.stream_triad(ptr(a), ptr(b), ptr(c), ctypes.c_double(3.0),
                                                                  size), 24 * n)):
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        best[f"{name}_gb_per_s"] = round(nbytes / min(times[1:]) / 1e9, 2)
    return {"threads": lib.stream_threads(), "array_mib": mib, **best}


def arrays(n: int, huge: bool) -> tuple[list[np.ndarray], list[mmap.mmap]]:
    """p, m, v, g (float32) and a bf16 copy, each in its own anonymous mapping, untouched (no page faulted
    yet); with ``huge``, advised to use transparent huge pages."""
    maps, out = [], []
    for itemsize, dtype in [(4, np.float32)] * 4 + [(2, np.uint16)]:
        mm = mmap.mmap(-1, n * itemsize)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        maps.append(mm)
        out.append(np.frombuffer(mm, dtype=dtype, count=n))
    return out, maps


def kernel_runs(n: int, threads: list[int], reps: int, lib) -> list[dict]:
    (p, m, v, g, bf), maps = arrays(n, huge=False)
    p[:], m[:], v[:], g[:] = 0.5, 0.0, 0.0, 0.01
    runs = []
    for t in threads:
        host_kernel.set_threads(t, lib)
        for name, out in (("with_bf16_copy", bf), ("fp32_only", None)):
            s = median_seconds(lambda: host_kernel.adamw_numpy(p, m, v, g, out, lib=lib, **HP), reps)
            runs.append({"threads": t, "variant": name, "params_per_s": round(n / s, 1),
                         "implied_gb_per_s": round(n * KERNEL_BYTES[name] / s / 1e9, 2)})
    del p, m, v, g, bf, maps  # the mappings go with the last array over them
    return runs


def first_touch(n: int, huge: bool, lib) -> dict:
    """The kernel's first pass over fresh arrays against its next ones: seconds and minor page faults."""
    (p, m, v, g, bf), maps = arrays(n, huge)
    out = {}
    for label in ("first", "second", "third"):
        f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        host_kernel.adamw_numpy(p, m, v, g, bf, lib=lib, **HP)
        out[label] = {"s": round(time.perf_counter() - t, 4),
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}
    smaps = [line for line in read("/proc/self/smaps_rollup").splitlines() if "AnonHugePages" in line]
    out["anon_huge_pages"] = smaps[0].split(":")[1].strip() if smaps else None
    del p, m, v, g, bf, maps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=512, help="millions of parameters per kernel run")
    ap.add_argument("--copy-mib", type=int, default=2048, help="MiB copied per bandwidth measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, 2, 4, ... all)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lib = host_kernel.load()
    if lib is None:
        sys.exit("host_update_profile: the host AdamW kernel is unavailable (no C++ compiler?)")
    info = machine()
    threads = ([int(t) for t in args.threads.split(",")] if args.threads else thread_counts(info["cpus_usable"]))
    n = args.params * 1_000_000
    bandwidth = [{"threads": t, "copy_gb_per_s": round(copy_bandwidth(args.copy_mib << 20, t, args.reps), 2)}
                 for t in threads]
    stream_result = stream(args.copy_mib, args.reps)
    kernel = kernel_runs(n, threads, args.reps, lib)
    host_kernel.set_threads(0, lib)
    touch = {"plain": first_touch(n, False, lib), "madv_hugepage": first_touch(n, True, lib)}
    from child import results_header
    best_bw = max(b["copy_gb_per_s"] for b in bandwidth)
    best = max((k for k in kernel if k["variant"] == "with_bf16_copy"), key=lambda k: k["params_per_s"])
    result = {**results_header(args.out, __file__),
              "runs": [{"system": "host_update_profile", "params": n, "machine": info, "bandwidth": bandwidth,
                        "stream": stream_result, "kernel": kernel, "first_touch": touch,
                        "summary": {"best_copy_gb_per_s": best_bw,
                                    "stream_triad_gb_per_s": stream_result["triad_gb_per_s"],
                                    "kernel_share_of_stream_triad": round(best["implied_gb_per_s"]
                                                                          / stream_result["triad_gb_per_s"], 3),
                                    "best_kernel_params_per_s": best["params_per_s"],
                                    "best_kernel_threads": best["threads"],
                                    "kernel_share_of_copy_bandwidth": round(best["implied_gb_per_s"] / best_bw, 3),
                                    "kernel_bound_params_per_s": round(best_bw * 1e9 / KERNEL_BYTES["with_bf16_copy"],
                                                                       1)}}]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["runs"][0]["summary"]))


if __name__ == "__main__":
    main()
