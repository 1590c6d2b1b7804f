"""The host-memory peaks of a run from the per-second log its study script kept beside its results file (``mem.log``:
/proc/meminfo's MemAvailable and the train process's VmRSS, VmHWM, RssAnon, RssShmem), against the plan that run's
results file records (``planned.host_gib``, from the run folder's memory_plan.json). The resident set counts
mapped files too (a Hugging Face checkpoint read from disk, which the kernel may drop at any time); the process's
own anonymous memory plus its shared memory (XLA's pinned pool) is what the plan counts.

    python experiments/studies/mem_log_peaks.py experiments/results/h200_shipped_configs_bc37d2f_h200_sft_8b_end.json \
        --out experiments/results/h200_shipped_configs_bc37d2f_h200_sft_8b_end.peaks.json

The log is the results file's name with ``.mem.log`` for ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

FIELD = re.compile(r"(MemAvailable|VmRSS|VmHWM|RssAnon|RssShmem):\s*(\d+) kB")
KIB_PER_GIB = 2**20


def samples(log: Path) -> list[dict]:
    """Each line's time and fields (GiB); lines from before the train process existed have no process fields."""
    out = []
    for line in log.read_text().splitlines():
        if not line.startswith("t="):
            continue
        row = {"t": int(line.split()[0][2:])}
        row.update({k: int(v) / KIB_PER_GIB for k, v in FIELD.findall(line)})
        out.append(row)
    return out


def peaks(rows: list[dict], planned_gib: float | None) -> dict:
    proc = [r for r in rows if "RssAnon" in r and "RssShmem" in r]
    if not proc:
        raise SystemExit("no line of the log holds the train process's RssAnon and RssShmem")
    top = max(proc, key=lambda r: r["RssAnon"] + r["RssShmem"])
    least = min(rows, key=lambda r: r.get("MemAvailable", float("inf")))
    own = top["RssAnon"] + top["RssShmem"]
    out = {"samples": len(rows), "anon_plus_shmem_peak_gib": round(own, 2), "at_t": top["t"] - rows[0]["t"],
           "anon_at_peak_gib": round(top["RssAnon"], 2), "shmem_at_peak_gib": round(top["RssShmem"], 2),
           "vmhwm_gib": round(max(r.get("VmHWM", 0) for r in proc), 2),
           "least_mem_available_gib": round(least["MemAvailable"], 2), "planned_host_gib": planned_gib}
    if planned_gib:
        out["plan_error_vs_anon_plus_shmem"] = round((planned_gib - own) / own, 4)
        out["plan_error_vs_vmhwm"] = round((planned_gib - out["vmhwm_gib"]) / out["vmhwm_gib"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="the run's results file (shipped_configs.py's), its .mem.log beside it")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    results = Path(args.results)
    log = results.with_suffix(".mem.log")
    record = json.loads(results.read_text())
    runs = []
    for run in record["runs"]:
        runs.append({"config": run.get("config"), "status": run.get("status"),
                     **peaks(samples(log), (run.get("planned") or {}).get("host_gib"))})
    out = {"name": Path(args.out).stem, "command": "python experiments/studies/mem_log_peaks.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "git_commit": record.get("git_commit"),
        "date": datetime.date.today().isoformat(), "device": record.get("device"), "source": [str(results), str(log)],
        "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
