"""Merge the raw outputs of ``sft_export.sh`` runs (each a folder with ``metrics.jsonl`` and ``train.log``, as
the device tool brings ``$OUT`` back) into one results file (docs/results.md), with how each ended.

    python experiments/studies/merge_sft_runs.py --name h100_sft8b_grads9_killed \\
        --command "OUT=$OUT STEPS=30 LIMIT=380 bash experiments/studies/sft_export.sh" \\
        --exit-status 137 --note "..." --out experiments/results/h100_sft8b_grads9_killed.json DIR1 DIR2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

UNPACKED_8B_TFLOPS = 371.9  # Llama-3-8B unpacked on the same H100 box (tests/assets/measured/h100_capacity_fp32.json)


def summary(folder: Path, exit_status: int | None) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    log = (folder / "train.log").read_text()
    planned = re.search(r"planned memory: host ([\d.]+) GiB, GPU ([\d.]+) GiB", log)
    timed = [r for r in rows if r["step"] >= 3] or rows
    record = {"system": "megatrain_jax", "source": folder.name, "exit_status": exit_status,
            "steps_reported": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
            "model_tflops": round(statistics.median(r["model_tflops"] for r in timed), 1),
            "gpu_peak_gib": round(max(r["gpu_peak_gib"] for r in rows), 2),
            "host_peak_gib": round(max(r["host_peak_rss_gib"] for r in rows), 2),
            "host_rss_gib_last_step": round(rows[-1]["host_peak_rss_gib"], 2),
            "host_anon_max_gib": round(max(r.get("host_rss_anon_gib") or 0 for r in rows), 2) or None,
            "planned": None if planned is None else {"host_gib": float(planned.group(1)),
                                                     "gpu_gib": float(planned.group(2))},
            "done_line": next((line for line in log.splitlines() if line.startswith("done:")), None),
            "exported_line": next((line.strip() for line in log.splitlines() if "exported the trained model" in line),
                                  None)}
    record["unpacked_8b_ratio"] = round(record["model_tflops"] / UNPACKED_8B_TFLOPS, 3)
    plan = folder / "memory_plan.json"  # the plan the run started with (sft_export.sh keeps it since 58de2c4)
    if plan.exists():
        m = json.loads(plan.read_text())
        gib = lambda b: round(b / 2**30, 3)  # noqa: E731
        record["planned"] = {"host_gib": gib(m["host_total"]), "gpu_gib": gib(m["gpu_total"]),
                             "gpu_exact": m["gpu_exact"], "gpu_estimate_gib": gib(m["estimate_gpu_total"]),
                             "gpu_peak_at": m["gpu_peak_at"], "engine": m["engine"]}
        for side in ("host", "gpu"):
            record[f"{side}_plan_error"] = round((record["planned"][f"{side}_gib"] - record[f"{side}_peak_gib"])
                                                 / record[f"{side}_peak_gib"], 4)
        record["gpu_estimate_error"] = round((record["planned"]["gpu_estimate_gib"] - record["gpu_peak_gib"])
                                             / record["gpu_peak_gib"], 4)
    loaded = folder / "transformers_load.json"  # the export loaded by transformers and run once
    if loaded.exists() and loaded.read_text().strip():
        record["transformers_load"] = json.loads(loaded.read_text())
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--name", required=True)
    ap.add_argument("--command", required=True, help="the command that produced each folder")
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--exit-status", type=int, default=None)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = [summary(Path(d), args.exit_status) for d in args.dirs]
    out = {"name": args.name, "command": args.command, "git_commit": args.git_commit,
           "device": {"name": "NVIDIA H100 80GB HBM3", "host_ram_gib": 125, "cpu_cores": 16}, "date": "2026-11-25",
           "note": args.note, "merged_by": "python experiments/studies/merge_sft_runs.py " + " ".join(args.dirs),
           "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r in runs:
        print(json.dumps({k: r[k] for k in ("source", "steps_reported", "host_peak_gib", "planned", "done_line")}))


if __name__ == "__main__":
    main()
