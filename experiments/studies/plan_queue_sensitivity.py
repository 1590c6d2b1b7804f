"""How the memory plan's GPU error against every measured run moves with its assumption of how far the GPU
trails the host: what the host dropped for its newest ``plan.gpu_ledger.QUEUED_BLOCKS`` blocks is still
allocated (issue 16, the 8K overshoot). CPU only: the measured peaks are those tests/test_memory_plan.py
checks the plan against (its ``_measured_runs``, which reads tests/assets/measured/).

    PYTHONPATH=. python experiments/studies/plan_queue_sensitivity.py --out experiments/results/cpu_plan_queue_depths.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py
REPO = os.path.dirname(EXPERIMENTS)
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))


def _errors(mp, ledger, cases, depths: list[str]) -> list[dict]:
    """Each measured run's plan error (plan - measured, over measured) at each queue depth (``ledger``: the
    module whose ``QUEUED_BLOCKS`` the plan's GPU walk reads)."""
    runs = []
    for case in cases:
        case = getattr(case, "values", [case])[0]  # pytest.param(case, marks=...) or the case itself
        name, cfg, engine, rows, seq_len, host_gib, gpu_peak, _ = case
        errors = {}
        for d in depths:
            ledger.QUEUED_BLOCKS = int(d)
            p = mp.plan(cfg, engine, rows, seq_len, host_ram_bytes=int(host_gib * mp.GiB), gpu_bytes=None,
                        detect=False)
            errors[d] = round((p.gpu_total / mp.GiB - gpu_peak) / gpu_peak, 4)
        runs.append({"system": "megatrain_jax", "config": name, "measured_gpu_peak_gib": gpu_peak,
                     "plan_gpu_error_by_queued_blocks": errors})
        print(f"{name:<56}" + "".join(f"{errors[d]:+8.1%}" for d in depths), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="1,2,3,4,5,6,8", help="QUEUED_BLOCKS values to plan with")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import megatrain_jax.plan as mp
    from megatrain_jax.plan import gpu_ledger
    from child import results_header
    from test_memory_plan import _measured_runs  # the measured runs the plan is tested against

    product, depths = gpu_ledger.QUEUED_BLOCKS, args.depths.split(",")
    try:
        runs = _errors(mp, gpu_ledger, _measured_runs(), depths)
    finally:
        gpu_ledger.QUEUED_BLOCKS = product
    key = "plan_gpu_error_by_queued_blocks"
    worst = {d: {"over": max(r[key][d] for r in runs), "under": min(r[key][d] for r in runs)} for d in depths}
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "queued_blocks_in_product": product,
                   "worst": worst, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
