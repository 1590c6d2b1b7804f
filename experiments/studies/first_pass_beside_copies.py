"""The split update's first pass alone and beside a copy between the GPU and pinned host memory (issue 51, the
3.5B 32K row): does a copy home slow the host's pass?

    PYTHONPATH=. python experiments/studies/first_pass_beside_copies.py --out $OUT/first_pass_beside_copies.json

In the row's timeline (`h200x2_side_by_side_streamed_32k_3736a7b.json`) block 0's first pass, the first after
the global norm, took 53 and 121 ms where the next blocks' took 22-39; it runs while the io part, updated on the
GPU, sends its masters, moments and copy home (14 bytes a parameter, ~3.7 GB at 7B's vocabulary and width). So,
on one GPU and its host: the first pass (``megatrain_adamw_stream``: float32 p, m, v and a bfloat16 gradient
read, the bfloat16 copy written) over one block of ``--params`` parameters, alone and started beside a copy of
``--copy-gb`` from the GPU to pinned host memory, beside one the other way, and beside both; and each copy
alone. Medians of ``--reps``. The CPU frequency governor is recorded (a pass after an idle gap may run at a
lower clock).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)  # child.py
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax
from child import results_header  # noqa: E402

from megatrain_jax.engine.update import host_kernel  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.5, bc1=0.1, bc2=0.05)


def governor() -> str:
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=202.4e6, help="one block's parameters (7B's width: 202.4M)")
    ap.add_argument("--copy-gb", type=float, default=3.7)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--idle-s", type=float, default=0.0, help="sleep before each timed pass (an idle gap)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    lib = host_kernel.require(host_kernel.load())
    n = int(args.params)
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n, dtype=np.float32)
    m = rng.standard_normal(n, dtype=np.float32) * 1e-3
    v = np.abs(rng.standard_normal(n, dtype=np.float32)) * 1e-6
    g = rng.standard_normal(n, dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = np.empty(n, ml_dtypes.bfloat16)

    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    gpu = SingleDeviceSharding(dev, memory_kind="device")
    elems = int(args.copy_gb * 1e9 / 4)
    on_gpu = jax.device_put(jnp.ones((elems,), jnp.float32), gpu)
    on_host = jax.block_until_ready(jax.device_put(on_gpu, host))

    def first_pass() -> float:
        t = time.perf_counter()
        host_kernel.adamw_stream_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data,
                                         out.ctypes.data, n, g_bf16=True, **HP)
        return time.perf_counter() - t

    def copies(home: bool, out_: bool) -> list:
        return ([jax.device_put(on_gpu, host)] if home else []) + ([jax.device_put(on_host, gpu)] if out_ else [])

    rows = []
    for name, home, out_ in (("alone", False, False), ("beside a copy home", True, False),
                             ("beside a copy to the GPU", False, True), ("beside both", True, True)):
        passes, copy_s = [], []
        first_pass()  # warm
        for _ in range(args.reps):
            if args.idle_s:
                time.sleep(args.idle_s)
            t0 = time.perf_counter()
            inflight = copies(home, out_)
            passes.append(first_pass())
            jax.block_until_ready(inflight)
            copy_s.append(time.perf_counter() - t0)
            del inflight
        rows.append({"case": f"first pass {name}", "pass_ms": round(1e3 * statistics.median(passes), 2),
                     "pass_gb_per_s": round(16 * n / statistics.median(passes) / 1e9, 1),  # 14 read, 2 written
                     "samples_ms": [round(1e3 * s, 2) for s in passes],
                     **({"copies_done_ms": round(1e3 * statistics.median(copy_s), 2)} if home or out_ else {})})
    for name, home, out_ in (("copy home alone", True, False), ("copy to the GPU alone", False, True)):
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(copies(home, out_))
            ts.append(time.perf_counter() - t0)
        s = statistics.median(ts)
        rows.append({"case": name, "ms": round(1e3 * s, 2), "gb_per_s": round(args.copy_gb / s, 1)})
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        res = {**results_header(args.out, __file__), "params": n, "copy_gb": args.copy_gb,
               "cpu_governor": governor(), "kernel_threads": os.environ.get("OMP_NUM_THREADS", "all cores"),
               "runs": rows}
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
