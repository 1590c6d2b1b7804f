"""What the restore's NaN/infinity check costs: ``checkpoint.store.non_finite`` (the check every restored part goes
through, its chunks on up to 8 threads) over float32 and bfloat16 arrays of a block's size, against the same chunks
tested on one thread (the median of ``--rounds`` calls each), and a plain copy of the same bytes (numpy, one thread) for the host's memory.

    PYTHONPATH=. python experiments/studies/finite_check_rate.py --gib 4 --out $OUT/h200_finite_check_rate.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from child import median_seconds, results_header  # noqa: E402
from megatrain_jax.checkpoint import store  # noqa: E402

LEAF = 45 << 20  # elements of one leaf: about the widest block matrix of a 13B model


def one_thread(leaves: dict[str, np.ndarray]) -> list[str]:
    """``non_finite``'s test, its chunks one after another on this thread."""
    bad = []
    for name, leaf in leaves.items():
        flat = leaf.reshape(-1)
        for i in range(0, flat.size, store._CHECK_CHUNK):
            part = flat[i:i + store._CHECK_CHUNK]
            if flat.dtype.name == "bfloat16":
                found = ((part.view(np.uint16) & 0x7F80) == 0x7F80).any()
            else:
                found = not np.isfinite(part).all()
            if found:
                bad.append(name)
                break
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of each dtype's leaves")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ml_dtypes
    runs = []
    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        size = np.dtype(dtype).itemsize
        n = max(1, int(args.gib * 2**30 / size / LEAF))
        leaves = {f"leaf_{i}": rng.standard_normal(LEAF, np.float32).astype(dtype) for i in range(n)}
        nbytes = sum(x.nbytes for x in leaves.values())
        assert store.non_finite(leaves) == [] and one_thread(leaves) == []
        poisoned = dict(leaves, bad=leaves["leaf_0"].copy())
        poisoned["bad"][-3] = np.nan
        found = store.non_finite(poisoned) == ["bad"]
        out = np.empty_like(leaves["leaf_0"])
        pooled = median_seconds(lambda: store.non_finite(leaves), args.rounds)
        single = median_seconds(lambda: one_thread(leaves), args.rounds)
        copy = median_seconds(lambda: [np.copyto(out, x) for x in leaves.values()], args.rounds)
        runs.append({"dtype": np.dtype(dtype).name, "gib": round(nbytes / 2**30, 2), "leaves": n,
                     "nan_found": found, "threads": min(8, os.cpu_count() or 1),
                     "pooled_gb_s": round(nbytes / pooled / 1e9, 2), "one_thread_gb_s": round(nbytes / single / 1e9, 2),
                     "copy_one_thread_gb_s": round(2 * nbytes / copy / 1e9, 2)})
        print(json.dumps(runs[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
