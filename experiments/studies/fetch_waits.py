"""What paces the forward of a streamed step, from the instrumented step's timeline that bench.py and side_by_side.py
record (``runs[i].timeline``: each op's output ready on the device, the main thread's time in each op, the host
worker's tasks). CPU only; reads results files, runs nothing.

For each streamed block's forward between a step's global norm and its head it takes: the gap to the forward
before it; when the block's copy landed against the end of the forward before it (``landed_after_prev_ms``: at
or above zero, the copy waited for that forward, since a copy into new GPU memory starts only once the compute
queued before it has run); when the host's first pass of the block's update ended against the same (above zero:
the host paced it); and how long the copy took from the main thread's issue to its landing. The summary per run
says how many forwards each cause could have paced.

    PYTHONPATH=. python experiments/studies/fetch_waits.py experiments/results/h200x2_side_by_side_streamed_abfe3c3.json \
        --out experiments/results/cpu_fetch_waits_<sha>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # child.py


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def forward_rows(events: list[dict]) -> list[dict]:
    """One row per block forward in the timeline's first forward (from the global norm before its head, where
    the timeline holds one), in order."""
    heads = [e["at"] for e in events if e["ev"] == "ready" and e["kind"] == "head"]
    if not heads:
        return []
    end = heads[0]
    start = max((e["at"] for e in events if e["ev"] == "ready" and e["kind"] == "grad_norm" and e["at"] < end),
                default=float("-inf"))
    inside = lambda t: start < t <= end  # noqa: E731
    landed = {e["part"]: e["at"] for e in events
              if e["ev"] == "ready" and e["kind"] in ("fetch", "visit") and inside(e["at"])}
    issued = {e["part"]: e["end"] for e in events
              if e["ev"] == "host" and e["kind"] in ("fetch", "visit") and inside(e["end"])}
    updated = {e["key"].split()[-1]: e["end"] for e in events
               if e["ev"] == "task" and e["key"].startswith("update ") and inside(e["end"])}
    rows, prev = [], None
    for e in events:
        if e["ev"] != "ready" or not inside(e["at"]) or e["kind"] not in ("embed", "forward"):
            continue
        if e["kind"] == "forward" and prev is not None and e["part"] in landed:
            part = e["part"]
            rows.append({"part": part, "gap_ms": _ms(e["at"] - prev),
                         "landed_after_prev_ms": _ms(landed[part] - prev),
                         "update_after_prev_ms": _ms(updated[part] - prev) if part in updated else None,
                         "issue_to_landed_ms": _ms(landed[part] - issued[part]) if part in issued else None})
        prev = e["at"]
    return rows


def summary(rows: list[dict]) -> dict:
    """The forwards counted, their median gap, and how many had their copy land after the forward before ended
    (the copy could have paced them) or their host update end after it (the host could have)."""
    if not rows:
        return {"forwards": 0}
    median = lambda key: round(statistics.median(r[key] for r in rows if r[key] is not None), 1)  # noqa: E731
    return {"forwards": len(rows), "median_gap_ms": median("gap_ms"),
            "median_landed_after_prev_ms": median("landed_after_prev_ms"),
            "copy_landed_after_prev_forward": sum(r["landed_after_prev_ms"] >= 0 for r in rows),
            "host_update_ended_after_prev_forward": sum(r["update_after_prev_ms"] is not None
                                                        and r["update_after_prev_ms"] >= 0 for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="results files whose runs carry a timeline")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = []
    for path in args.files:
        with open(path) as f:
            result = json.load(f)
        for r in result.get("runs", []):
            timeline = r.get("timeline") if isinstance(r, dict) else None
            if not timeline or not timeline.get("events"):
                continue
            rows = forward_rows(timeline["events"])
            runs.append({"file": os.path.relpath(path), "config": r.get("config"),
                         "prefetch_depth": (r.get("engine") or {}).get("prefetch_depth"),
                         "step_time_s": r.get("step_time_s"), "summary": summary(rows), "forwards": rows})
            print(json.dumps({k: runs[-1][k] for k in ("file", "config", "prefetch_depth", "summary")}), flush=True)
    from child import results_header
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
