"""Scaling over the GPUs of one machine: 1 GPU and N GPUs in one call, one results JSON (docs/results.md).

    PYTHONPATH=. python experiments/scaling.py --config 7b_32k --gpus 2 --out $OUT/scaling.json

Three runs, each in its own process (so that each has its own host-memory peak and pinned pool), each
training the ``bench.py`` configuration from a random initialization on the demo corpus:

- ``1 GPU``: the configuration as it is (its rows per step);
- ``weak``: N GPUs, N times the rows: the same tokens per GPU per step;
- ``strong``: N GPUs, the same rows as the 1-GPU run (the same global batch).

Each run records ``num_gpus``, tokens/s, the host and per-GPU memory peaks, and the bytes each GPU moves
over PCIe per step, counted from the step's schedule and the size of each GPU's shard of every part it
fetches (weights, host to GPU) or sends (float32 gradients, GPU to host); GPU-resident parts move
nothing. The parent prints the speed-ups against the 1-GPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    """One run, on the GPUs CUDA_VISIBLE_DEVICES leaves; writes its record to ``args.worker_out``."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from bench import CONFIGS, resolve_layout, run_config  # noqa: E402 (sets the memory fraction)

    from megatrain_jax.plan import fit_host_pool

    bc = CONFIGS[args.config]
    bc, picked = resolve_layout(dataclasses.replace(bc, rows=args.rows))  # planned for this run's GPUs and rows
    cfg = bc.model()
    fit_host_pool(cfg, bc.engine, bc.rows, bc.seq_len)  # before JAX starts, as megatrain-jax train does
    import jax

    run = run_config(args.config, bc, args.warmup, args.steps, profile=False,
                     trace_dir=args.trace_dir and os.path.join(args.trace_dir, args.kind))
    if picked:
        run["resolved"] = picked
    gpus = run.get("num_gpus") or len(jax.devices())  # the devices the engine spread over
    run["rows_per_gpu"] = bc.rows // gpus
    run["tokens_per_gpu_per_step"] = bc.rows * bc.seq_len // gpus
    run["gpu_peak_gib_per_device"] = [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)
                                      for d in jax.devices()]
    with open(args.worker_out, "w") as f:
        json.dump(run, f)


def summarize(runs: list[dict]) -> dict:
    """Each finished run's speed-up and host peak against the 1-GPU run (written into the runs too), and
    the summary by run kind that the parent prints."""
    one = next((r for r in runs if r["scaling"] == "1gpu" and r.get("status") == "ok"), None)
    summary = {}
    for r in runs:
        if one and r.get("status") == "ok":
            r["speedup_vs_1gpu"] = round(r["tokens_per_s"] / one["tokens_per_s"], 3)
            r["host_peak_vs_1gpu"] = round(r["host_peak_gib"] / one["host_peak_gib"], 3)
        summary[r["scaling"]] = {k: r.get(k) for k in ("num_gpus", "status", "tokens_per_s", "speedup_vs_1gpu",
                                                       "host_peak_gib", "host_peak_vs_1gpu", "gpu_peak_gib",
                                                       "pcie_per_gpu_per_step")}
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="7b_32k", help="a configuration of experiments/bench.py")
    ap.add_argument("--gpus", type=int, default=2, help="N: the GPUs of the scaled runs")
    ap.add_argument("--runs", default="1gpu,weak,strong", help="which of 1gpu, weak, strong to run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--out", help="path of the results JSON (runs are added to it when it exists)")
    ap.add_argument("--trace-dir", help="also trace one step per run (jax.profiler) under DIR/<run>, and record "
                                        "each GPU's compute, collective and idle time (trace_summary.py)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        return worker(args)
    if not args.out:
        ap.error("--out is required")
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from bench import CONFIGS, device_info  # noqa: E402

    base_rows = CONFIGS[args.config].rows
    plans = {"1gpu": (1, base_rows), "weak": (args.gpus, base_rows * args.gpus), "strong": (args.gpus, base_rows)}
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip() or None
    result = {"name": f"scaling_{args.config}_{args.gpus}gpu",
              "command": "PYTHONPATH=. python " + " ".join(["experiments/scaling.py"] + (argv or sys.argv[1:])),
              "git_commit": commit, "date": datetime.date.today().isoformat(), "device": None, "runs": []}
    if args.out and os.path.exists(args.out):  # more runs of the same study: added to the file
        with open(args.out) as f:
            earlier = json.load(f)
        earlier["command"] = [c for c in ([earlier["command"]] if isinstance(earlier["command"], str)
                                          else earlier["command"])] + [result["command"]]
        if earlier.get("git_commit") != commit:
            earlier["git_commit_added_runs"] = commit
        result = earlier
    for kind in args.runs.split(","):
        gpus, rows = plans[kind]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))), PYTHONPATH=ROOT)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--rows", str(rows), "--worker-out", path, "--kind", kind]
        if args.trace_dir:
            cmd += ["--trace-dir", args.trace_dir]
        code = subprocess.run(cmd, env=env).returncode
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError):
            run = {"config": args.config, "status": f"error: worker exited with {code} and no record"}
        run["scaling"] = kind
        if args.trace_dir:  # the perfetto file, where a caller fetching a shallow folder finds it
            traces = sorted(Path(args.trace_dir, kind).rglob("perfetto_trace.json.gz"))
            if traces:
                shutil.copy(traces[-1], Path(args.trace_dir, f"{kind}_perfetto.json.gz"))
        result["runs"].append(run)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if result["device"] is None:
        import jax
        result["device"] = dict(device_info(), gpus=len(jax.devices()))
    result["summary"] = summary = summarize(result["runs"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
