"""The quantized-moment kernels of two sources of ``kernels/host_adamw.cpp`` side by side, in one process: the
source at ``--base`` (a git revision) and the working tree's, each compiled with the product's flags
(``host_kernel.COMPILE_FLAGS``, ``-march=native``), measured in alternating rounds so that a host whose rate
drifts between calls (the H200 hosts' rates move by ~20% from one call to the next) shows the two builds under
the same conditions. For each build: the 8-bit and m7v5 kernels, bfloat16 gradients, over every usable core and
over one, at each format's block and at the other's (the per-block work set against the codes' own cost). Both
builds are given the same arrays and must write the same bits (``equal_to_base``).

    PYTHONPATH=. python experiments/studies/host_kernel_ab.py --base HEAD~1 --out $OUT/host_kernel_ab.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(EXPERIMENTS)
sys.path.insert(0, EXPERIMENTS)  # child.py
sys.path.insert(0, REPO)  # the repository root: megatrain_jax
from child import median_seconds, results_header  # noqa: E402

from host_kernel_rates import FORMATS, HP  # noqa: E402
from host_kernel_rates import quantized_state as state  # noqa: E402

from megatrain_jax.engine.update import host_kernel  # noqa: E402

CASES = [("q8", 256), ("q8", 128), ("m7v5", 128), ("m7v5", 256)]  # each format's own block first


def compile_source(source: str, so: str):
    """The kernel built from ``source`` as ``host_kernel.build`` builds the product's, loaded with its argtypes."""
    subprocess.run(["g++", *host_kernel.COMPILE_FLAGS, "-march=native", "-fopenmp", source, "-o", so], check=True)
    return host_kernel.declare(ctypes.CDLL(so))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision whose kernels/host_adamw.cpp is the base")
    ap.add_argument("--params", type=int, default=128, help="millions of parameters per measurement (all cores)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.params * 1_000_000 // 4096 * 4096
    cores = len(os.sched_getaffinity(0))
    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    runs = []

    def record(run: dict) -> None:  # each measurement printed and the file rewritten: a cut run keeps what it measured
        runs.append(run)
        print(json.dumps(run), flush=True)
        with open(args.out, "w") as f:
            json.dump({**results_header(args.out, __file__), "base_commit": base_rev, "runs": runs}, f, indent=1)

    with tempfile.TemporaryDirectory() as tmp:
        base_src = os.path.join(tmp, "base.cpp")
        with open(base_src, "w") as f:
            f.write(subprocess.run(["git", "show", f"{base_rev}:kernels/host_adamw.cpp"], cwd=REPO,
                                   capture_output=True, text=True, check=True).stdout)
        builds = {"base": compile_source(base_src, os.path.join(tmp, "base.so")),
                  "tree": compile_source(os.path.join(REPO, "kernels", "host_adamw.cpp"), os.path.join(tmp, "tree.so"))}
        # the same bits from both builds, on one thread and on all (the blocks' order between threads differs)
        for fmt, block in CASES:
            outs = {}
            for build, lib in builds.items():
                lib.megatrain_set_threads(cores)
                arrays = state(fmt, 4096 * 64, block)
                FORMATS[fmt][1](*arrays, block=block, seed=7, lib=lib, **HP)
                outs[build] = [a.view(np.uint8).tobytes() for a in arrays[:5]]
            record({"system": f"{fmt}_kernel_bf16_grad", "block": block, "equal_to_base": outs["base"] == outs["tree"]})
        for threads in (cores, 1):
            size = n if threads > 1 else n // 8
            for fmt, block in CASES:
                arrays = state(fmt, size, block)
                for rnd in range(args.rounds):
                    for build, lib in builds.items():
                        lib.megatrain_set_threads(threads)
                        step = iter(range(10 ** 6))
                        run = FORMATS[fmt][1]
                        s = median_seconds(lambda: run(*arrays, block=block, seed=next(step), lib=lib, **HP),
                                           args.reps)
                        record({"system": f"{fmt}_kernel_bf16_grad", "build": build, "block": block,
                                "threads": threads, "round": rnd, "params_per_s": round(size / s, 1)})


if __name__ == "__main__":
    main()
