"""The step-time model's H200 rates weighed one field at a time against every committed run of the engine as it
is (CPU only; ``experiments/step_time_vs_runs.py``'s runs and errors): for each value tried, the runs within 10%
over all H200 runs, on the 16- and the 32-core host, and among the single-GPU 16-core runs since 2026-11-30.
The values ``plan.speeds`` holds are the ``base`` row; with ``--fit`` the study's coordinate search over every
fitted field is run too (about five minutes) and its rates recorded.

    PYTHONPATH=. python experiments/studies/step_time_rate_sweep.py --out experiments/results/cpu_step_time_rate_sweep_<sha>.json [--fit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # child.py, step_time_vs_runs

import step_time_vs_runs as study  # noqa: E402
from child import results_header  # noqa: E402
from megatrain_jax.plan.speeds import SPEEDS  # noqa: E402

RECENT = "2026-11-30"
# (label, the field, the values): the H200 record's products, its host's full-precision rate, PCIe each way and
# the shared link, at the values the runs and measure_speeds.py's files suggested
SWEEPS = [("matmul_flops", [650e12, 660e12, 670e12, 680e12, 700e12]),
          ("host_full", [3.0e9, 3.2e9, 3.38e9]),
          ("h2d_bytes", [47.4e9, 53.9e9]),
          ("link_bytes", [60e9, 79e9])]


def counts(rs: list[dict], s) -> dict:
    errs = study.errors(rs, s)
    groups = {"all": lambda r: True, "16_core": lambda r: r["host_cores"] == 16,
              "32_core": lambda r: r["host_cores"] == 32,
              "16_core_one_gpu_recent": lambda r: r["host_cores"] == 16 and r["gpus"] == 1 and r["date"] >= RECENT}
    out = {}
    for name, keep in groups.items():
        mine = [e for r, e in zip(rs, errs) if keep(r)]
        out[name] = {"runs": len(mine), "within_10pct": sum(abs(e) <= 0.10 for e in mine),
                     "median_error": round(statistics.median(mine), 4) if mine else None}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fit", action="store_true", help="also run step_time_vs_runs' search over every field")
    ap.add_argument("--work", default=study.WORK, help="as step_time_vs_runs.py's --work: the generated chats, "
                                                       "for the packed runs' span ('none': whole rows)")
    args = ap.parse_args(argv)
    rs = [r for r in study.runs(work=None if args.work == "none" else args.work)
          if r["kind"] == "H200" and not r["older"]]
    base = SPEEDS["H200"]
    rows = [{"field": "base", "value": None, **counts(rs, base)}]
    for field, values in SWEEPS:
        for value in values:
            rows.append({"field": field, "value": value, **counts(rs, study._with(base, field, value))})
    if args.fit:
        fitted = study.fit(rs, base)
        rows.append({"field": "fit", "value": {k: study._get(fitted, k) for k in study.FITTED
                                               if study._get(fitted, k) is not None}, **counts(rs, fitted)})
    record = {**results_header(args.out, __file__), "base": base.name, "runs": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return record


if __name__ == "__main__":
    main()
