"""How much the host update's timing at a run's start spreads from one process to the next on one host, for each
way of timing it: ``host_kernel.mode_rates`` as ``train`` runs it (full precision the fastest of 5 calls; capacity
mode and the quantized modes the mean over a tenth of a second of calls, ``sustained_seconds``) beside the fastest
of 5 short calls for capacity mode (how the start timed it at a6e8da5, which read 5.51 and 6.45 G params/s in two
runs on hosts whose steps ran capacity mode's update at 4.9-5.0). Each round is a fresh process, one after
another; CPU only.

    PYTHONPATH=. python experiments/studies/host_kernel_timing_spread.py --rounds 5 --out $OUT/h200_host_kernel_timing_spread.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ONE_ROUND = """
import json
import numpy as np
from megatrain_jax.engine.update import host_kernel as hk
lib = hk.require(hk.load())
rates = hk.mode_rates(lib=lib)
n = 1 << 25
pb, mb, vb = (np.full(n, x, np.uint16) for x in (0x3F00, 0, 0))
g = np.full(n, 0.01, np.float32)
rates["capacity_fastest_of_5"] = n / hk.best_seconds(
    lambda: hk.adamw_sr_numpy(pb, mb, vb, g, seed=0, lib=lib, **hk.TIMING_HP), 5)
print(json.dumps(rates))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from child import results_header
    rounds = []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", ONE_ROUND], capture_output=True, text=True, check=True)
        rounds.append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = [k for k in rounds[0] if k not in ("first_half_share", "one_pass_speedup")]
    spread = {k: {"min": min(r[k] for r in rounds), "median": statistics.median(r[k] for r in rounds),
                  "max": max(r[k] for r in rounds),
                  "spread": (max(r[k] for r in rounds) - min(r[k] for r in rounds)) / statistics.median(
                      r[k] for r in rounds)} for k in keys}
    record = {**results_header(args.out, __file__),
              "runs": [{"rounds": rounds, "spread": spread, "host_cores": len(os.sched_getaffinity(0)),
                        "note": "parameters per second; spread: (max - min) / median over the rounds"}]}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(spread, indent=1))
    return record


if __name__ == "__main__":
    main()
