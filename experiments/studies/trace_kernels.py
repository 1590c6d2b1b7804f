"""Each GPU kernel of named XLA programs, in the order it ran, from a JAX profiler trace: which product took how
long inside one call of a program (trace_summary.py sums them by name instead).

    python experiments/studies/trace_kernels.py TRACE.tar.gz|TRACE_DIR --modules jit__forward_keep,jit__backward_kept \
        --measured experiments/results/<the run's results>.json [--calls 1] --out experiments/results/<name>.json

Reads the newest ``perfetto_trace.json.gz`` under the directory (or in the tarball, e.g. the one
``h200_block_kernels.sh`` packs). For each module it lists the kernels of its first ``--calls`` calls: each
kernel's name (80 characters), its start within the call and its duration, in milliseconds; memsets are left
out. A call starts at a gap of more than 1 ms, or where the kernel that began the module's first call runs again
(calls of one program dispatched back to back). The file's commit, date and device are the measured run's
(``--measured``); each entry of ``runs`` is one call of one program.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path


def load_events(src: str) -> tuple[str, list]:
    if os.path.isdir(src):
        files = sorted(Path(src).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
        if not files:
            sys.exit(f"no perfetto_trace.json.gz under {src}")
        return str(files[-1]), json.load(gzip.open(files[-1]))["traceEvents"]
    with tarfile.open(src) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith("perfetto_trace.json.gz")]
        if not members:
            sys.exit(f"no perfetto_trace.json.gz in {src}")
        data = tar.extractfile(members[-1]).read()
        return members[-1].name, json.load(gzip.open(io.BytesIO(data)))["traceEvents"]


def calls(events: list, module: str, n: int, gap_us: float = 1000.0) -> list[list[dict]]:
    ks = sorted((e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict)
                 and e["args"].get("hlo_module") == module and "memset" not in e["name"].lower()),
                key=lambda e: e["ts"])
    out: list[list[dict]] = []
    end = None
    first = ks[0]["name"] if ks else None
    for e in ks:
        if end is None or e["ts"] - end > gap_us or (e["name"] == first and out[-1]):
            if len(out) == n:
                break
            out.append([])
        t0 = out[-1][0]["ts"] if out[-1] else e["ts"]
        out[-1].append({"name": e["name"][:80], "start_ms": round((e["ts"] - t0) / 1e3, 3),
                        "ms": round(e["dur"] / 1e3, 3), "ts": e["ts"]})
        end = e["ts"] + e["dur"]
    return [[{k: v for k, v in k_.items() if k != "ts"} for k_ in c] for c in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--modules", required=True)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--measured", required=True,
                    help="the results file of the run the trace comes from (h200_block_kernels.sh writes both): "
                         "its commit, date and device are this file's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name, events = load_events(args.trace)
    with open(args.measured) as f:
        measured = json.load(f)
    runs = [{"system": "megatrain_jax", "program": m, "call": i, "kernels": kernels,
             "kernels_ms": round(sum(k["ms"] for k in kernels), 3)}
            for m in args.modules.split(",") for i, kernels in enumerate(calls(events, m, args.calls))]
    out = {"name": os.path.splitext(os.path.basename(args.out or "trace_kernels.json"))[0],
           "command": "python experiments/studies/trace_kernels.py " + " ".join(sys.argv[1:]),
           "git_commit": measured["git_commit"], "date": measured["date"], "device": measured["device"],
           "read_at_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip() or None,
           "trace": f"{os.path.basename(args.trace)}: {name}", "measured": os.path.basename(args.measured),
           "runs": runs}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
