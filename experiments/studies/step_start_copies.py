"""Which copies a step's start waits behind (issue 51): a JAX profiler trace of steps run back to back, so that
each step's forward begins while the step before's decision and host updates are in flight, with every copy
between host and device on the GPU's streams listed around each step boundary. Each arm runs in its own process
and may carry ``engine_patch_ab.py``'s patches (``CONFIG+PATCH``).

    PYTHONPATH=. python experiments/studies/step_start_copies.py --out $OUT/step_start_copies.json \
        --tar $OUT/step_start_copies.tar.gz \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+decision_copies_late

For each arm: the GPU's copies (``MemcpyD2H``/``H2D`` on its stream lines) of at least 1 MB and every copy home
of at most 64 bytes (a step decision's scale and verdict, the loss), each with its stream, start and duration in
milliseconds from the traced window's first GPU event, and size; the windows where no compute kernel runs on the
GPU for more than 2 ms; and, for each small copy home, when the host issued it (``issued_ms``: the runtime's call
that queued it, matched by its correlation id; None where the trace has none), and the copies of at least 1 MB
that were running on any stream when it started or that its stream ran in the 300 ms before it. The traces
(``perfetto_trace.json.gz``, one per arm) go into ``--tar``; ``--read`` summarizes such a tarball again on the CPU
into a results file whose commit, date and device are the measured run's (``--measured``):

    python experiments/studies/step_start_copies.py --read TRACES.tar.gz --measured RESULTS.json --out OUT.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, EXPERIMENTS, os.path.dirname(EXPERIMENTS)]

from trace_summary import classify  # noqa: E402  (copy: memcpy and memset; collective; compute)

SIZE = re.compile(r"size:(\d+)")
BIG, SMALL = 1 << 20, 64


def gpu_events(trace: dict) -> tuple[list[dict], dict]:
    """The complete events on the GPU's stream lines, and each line's name."""
    procs, threads = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    lines = {k: v for k, v in threads.items() if "GPU" in procs.get(k[0], "") and "stream" in v.lower()}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e["tid"]) in lines], lines


def summarize(trace: dict) -> dict:
    events, lines = gpu_events(trace)
    if not events:
        return {"error": "no events on the GPU's stream lines"}
    t0 = min(e["ts"] for e in events)
    issued = {e["args"]["correlation_id"]: (e["ts"] - t0) / 1e3 for e in trace["traceEvents"]
              if e.get("ph") == "X" and "memcpy" in e.get("name", "").lower() and (e["pid"], e.get("tid")) not in lines
              and (e.get("args") or {}).get("correlation_id") is not None}  # the host's calls that queued copies
    copies, compute = [], []
    for e in events:
        name = e["name"]
        start, dur = (e["ts"] - t0) / 1e3, e.get("dur", 0) / 1e3
        kind = classify(name)
        if kind == "copy" and "memcpy" in name.lower():
            m = SIZE.search(json.dumps(e.get("args", {})))
            size = int(m.group(1)) if m else None
            kind = "d2h" if "D2H" in name or "DtoH" in name else "h2d" if "H2D" in name or "HtoD" in name else name
            copies.append({"kind": kind, "stream": lines[(e["pid"], e["tid"])], "start_ms": round(start, 3),
                           "ms": round(dur, 3), "bytes": size,
                           "correlation_id": (e.get("args") or {}).get("correlation_id")})
        elif kind == "compute":
            compute.append((start, start + dur))
    copies.sort(key=lambda c: c["start_ms"])
    compute.sort()
    idle, reach = [], compute[0][1]
    for a, b in compute[1:]:
        if a - reach > 2.0:
            idle.append({"from_ms": round(reach, 3), "ms": round(a - reach, 3)})
        reach = max(reach, b)
    big = [c for c in copies if c["bytes"] is not None and c["bytes"] >= BIG]
    small = [c for c in copies if c["kind"] == "d2h" and c["bytes"] is not None and c["bytes"] <= SMALL]
    for c in small:
        t, when = c["start_ms"], issued.get(c["correlation_id"])
        c["issued_ms"] = None if when is None else round(when, 3)
        c["running_then"] = [b for b in big if b["start_ms"] <= t < b["start_ms"] + b["ms"]]
        c["its_stream_before"] = [b for b in big if b["stream"] == c["stream"] and t - 300 <= b["start_ms"] < t]
    return {"span_ms": round(max(b for _, b in compute) - compute[0][0], 3), "streams": sorted(set(lines.values())),
            "copies_1mb_or_more": big, "small_copies_home": small, "compute_idle_over_2ms": idle}


def run_arm(arm: str, warmup: int, steps: int, trace_dir: str, out: str) -> None:
    """In the child: the arm's patches, its engine as bench.py builds it, ``warmup`` steps, then ``steps`` traced."""
    config, *patches = arm.split("+")
    import engine_patch_ab
    for name in patches:
        engine_patch_ab.PATCHES[name]()
    import bench
    import jax
    from flax import nnx

    from megatrain_jax import Decoder, Engine, default_optimizer
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens

    bc, picked = bench.resolve_layout(bench.CONFIGS[config])
    cfg = bc.model()
    engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), default_optimizer(3e-4), bc.engine,
                    seed=0)
    toks, starts = demo_tokens(cfg.vocab_size, (warmup + steps) * bc.rows * bc.seq_len * 2 + bc.seq_len + 1, seed=0)
    data = iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), bc.seq_len).batches(bc.rows))
    times = [m["step_time_s"] for m in engine.steps(next(data) for _ in range(warmup))]
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        traced = [m["step_time_s"] for m in engine.steps(next(data) for _ in range(steps))]
    engine.close()
    path = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)[-1]
    with gzip.open(path) as f:
        summary = summarize(json.load(f))
    with open(out, "w") as f:
        json.dump({"arm": arm, "resolved": picked, "step_times": [round(t, 4) for t in times],
                   "traced_step_times": [round(t, 4) for t in traced], "trace": str(path), **summary}, f)


def read_traces(tarball: str, measured_path: str, out: str) -> None:
    """``--read``: each arm's trace in the tarball summarized again, under the measured run's commit, date and
    device, its arms named as that run named them."""
    with open(measured_path) as f:
        measured = json.load(f)
    runs = []
    with tarfile.open(tarball) as tar:
        for m in sorted((m for m in tar.getmembers() if m.name.endswith("perfetto_trace.json.gz")),
                        key=lambda m: m.name):
            i = int(m.name.split("/")[0].removeprefix("arm"))
            trace = json.load(gzip.open(tar.extractfile(m)))
            arm = measured["runs"][i]
            runs.append({"arm": arm["arm"], "traced_step_times": arm.get("traced_step_times"), **summarize(trace)})
    result = {"name": Path(out).stem, "command": "python experiments/studies/step_start_copies.py " + " ".join(sys.argv[1:]),
              "git_commit": measured["git_commit"], "date": measured["date"], "device": measured["device"],
              "read_at_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip() or None,
              "trace": os.path.basename(tarball), "measured": os.path.basename(measured_path), "runs": runs}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=None, help="comma-separated bench configs, each with +PATCH names")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps traced back to back")
    ap.add_argument("--trace-dir", default="/tmp/step_start_copies")
    ap.add_argument("--tar", default=None, help="pack the arms' traces here")
    ap.add_argument("--read", default=None, metavar="TARBALL", help="summarize the traces --tar packed, no run")
    ap.add_argument("--measured", default=None, help="with --read: the results file of the run they come from")
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child's arm
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.read:
        if not args.measured:
            ap.error("--read needs --measured (the results file of the run the traces come from)")
        read_traces(args.read, args.measured, args.out)
        return
    if args.arm:
        run_arm(args.arm, args.warmup, args.steps, args.trace_dir, args.out)
        return
    if not args.arms:
        ap.error("--arms is required")
    import engine_patch_ab
    arms = args.arms.split(",")
    unknown = [p for a in arms for p in a.split("+")[1:] if p not in engine_patch_ab.PATCHES]
    if unknown:
        ap.error(f"unknown patch(es) {unknown}; choose from {sorted(engine_patch_ab.PATCHES)}")
    runs = []
    for i, arm in enumerate(arms):
        part, trace_dir = f"{args.out}.{i}.json", os.path.join(args.trace_dir, f"arm{i}")
        proc = subprocess.run([sys.executable, __file__, "--arm", arm, "--warmup", str(args.warmup), "--steps",
                               str(args.steps), "--trace-dir", trace_dir, "--out", part], capture_output=True, text=True)
        print(proc.stdout[-1500:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
        if proc.returncode or not os.path.exists(part):
            runs.append({"arm": arm, "status": f"error: exit {proc.returncode}: {proc.stderr[-800:]}"})
            continue
        with open(part) as f:
            runs.append({**json.load(f), "status": "ok"})
        os.remove(part)
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tar:
            for i, run in enumerate(runs):
                if run.get("trace"):
                    tar.add(run["trace"], arcname=f"arm{i}/perfetto_trace.json.gz")
    from child import results_header
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
