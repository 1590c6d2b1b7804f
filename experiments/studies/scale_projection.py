"""Projection of 70B and 120B training on bigger hosts, from a few layers measured on this GPU (issue 15).

    PYTHONPATH=. python experiments/studies/scale_projection.py --out $OUT/h100_scale_projection.json

What is measured here: each model's full io part (embedding, head) with ``--layers`` (default 2 and 4)
of its blocks, trained on the demo corpus in a fresh process per run, in the mode the full model would use
on the target host (70B: float32 masters and moments; 120B: capacity mode, bfloat16 masters and moments,
since its full-precision state does not fit 1.5 TB). Each run records the median step time, one step
synchronized after every op (time per category: compute, host-to-device, device-to-host, host optimizer),
the bytes each step moves over PCIe, and the host and GPU peaks. The difference between the two layer
counts is the per-layer steady state; the rest is the io part and fixed costs.

What is projected: the full model's step on a target machine as the largest of its compute, its PCIe
transfers and its host optimizer time (the engine overlaps them), times the overlap efficiency measured
here (measured step / that largest component, at the larger layer count), plus the io part as measured.
Host RAM is the memory plan's for the full model on the target. ``--host-only`` (no GPU needed) projects
only that: each model in each host layout (``HOST_MODES``: full precision, capacity mode, capacity mode with
8-bit moments and bfloat16 gradients; each as configured and as ``megatrain-jax train`` picks it, issue 35)
on an H200 with each of ``HOST_SIZES_GIB``. Every assumption about the targets (their
host-to-device bandwidth, GPU speed and host optimizer rate relative to this machine) is written into the
results file next to the numbers; docs/capacity.md states the table as a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from bench import BenchConfig  # noqa: E402  (the GPU memory fraction as megatrain_jax sets it: 0.95)
from child import git_commit, run_child  # noqa: E402

from megatrain_jax import EngineConfig  # noqa: E402

SEQ, ROWS = 2048, 16  # 32,768 tokens per step, as the 7B benchmarks
MODELS = {
    "70b": EngineConfig(micro_batches=4),  # full precision (16-bit stream copy)
    "120b": EngineConfig(micro_batches=4, master_dtype="bfloat16"),  # capacity mode
}
GiB = 1024**3

# Host layouts and hosts of the host-only projection (issue 35): an H200 (XLA may use 95% of its 140 GiB).
HOST_MODES = {
    "full precision (float32 masters and moments, 16-bit stream copy)": EngineConfig(micro_batches=4),
    "capacity mode (bfloat16 masters and moments)": EngineConfig(micro_batches=4, master_dtype="bfloat16"),
    "capacity mode, 8-bit moments, bfloat16 gradients": EngineConfig(
        micro_batches=4, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16"),
    # issue 52's leanest: 7-bit m, 5-bit v and the exact two-pass step (no step's gradients in host memory)
    "capacity mode, 7-bit m and 5-bit v, the two-pass step": EngineConfig(
        micro_batches=4, master_dtype="bfloat16", moment_dtype="m7v5", host_grad_dtype="bfloat16", norm_first=True),
}
# Others' figures beside the projection, as they state them (not measured here).
CITED = {"MegaTrain, 120B on one GPU": {"host_ram": "1.5 TB", "source": "the MegaTrain paper's 120B claim, as "
                                        "issue 52 cites it (1.5 TB of host RAM for 120B)"}}
HOST_SIZES_GIB = (512, 1024, 1536)
H200_GIB = 140

# The targets. Each number not measured here is an assumption, recorded with its source.
TARGETS = {
    "H200 with 1.5 TB host": {
        "host_ram_gib": 1536,
        "h2d_gb_s": None,  # None: the same PCIe Gen5 x16 link as the H100 box, so the bandwidth measured here
        "gpu_speed_vs_h100": 1.0,  # same Hopper SMs and clocks; HBM3e's extra bandwidth barely moves dense matmuls
        "host_optimizer_vs_here": 1.0,  # assumed: a host CPU with the memory bandwidth of the H100 box's
        "notes": "PCIe Gen5 x16 as on the H100 box (measured here); GPU compute as the H100's; host optimizer "
                 "rate as measured here (the fused AdamW is memory-bandwidth bound; a 1.5 TB host with more "
                 "memory channels would be faster)",
    },
    "GH200 (NVLink-C2C)": {
        "host_ram_gib": 480,
        "h2d_gb_s": 400.0,  # NVLink-C2C: 450 GB/s per direction nominal; ~400 GB/s assumed achievable
        "gpu_speed_vs_h100": 1.0,
        "host_optimizer_vs_here": 2.0,  # Grace: 72 cores, LPDDR5X ~500 GB/s vs this host's measured rate
        "notes": "host-to-device 400 GB/s assumed (NVLink-C2C, 450 GB/s per direction nominal); Grace's host "
                 "optimizer assumed 2x this host's (72 Neoverse V2 cores, ~500 GB/s LPDDR5X); 480 GB of host "
                 "memory",
    },
}


def measure(name: str, layers: int, warmup: int, steps: int) -> dict:
    """Train ``layers`` blocks of preset ``name`` with its full io part in this process."""
    from megatrain_jax import preset
    from megatrain_jax.plan import available_host_bytes, fit_host_pool, lean_engine, plan

    cfg = preset(name, layers=layers)
    engine, lean = lean_engine(cfg, MODELS[name], ROWS, SEQ, host_ram_bytes=available_host_bytes())
    fit_host_pool(cfg, engine, ROWS, SEQ)
    # planned before the run: MemAvailable afterwards leaves out what this process holds
    p = plan(cfg, engine, ROWS, SEQ, host_ram_bytes=available_host_bytes(), detect=False)
    bc = BenchConfig(name, layers, SEQ, ROWS, engine)
    from bench import device_info, run_config
    run = run_config(f"{name}_{layers}l", bc, warmup, steps, profile=True)
    run["device"] = device_info()
    # what crosses PCIe a step as bench.py counts it from the engine's schedule, every pass of the step
    pcie = run.get("pcie_per_gpu_per_step", {})
    run.update(preset=name, layers=layers, lean_mode=lean, master_dtype=engine.master_dtype,
               h2d_bytes_per_step=pcie.get("h2d_bytes"), d2h_bytes_per_step=pcie.get("d2h_bytes"),
               plan_host_gib=round(p.host_total / GiB, 2), plan_gpu_gib=round(p.gpu_total / GiB, 2))
    return run


def project(name: str, small: dict, big: dict, target: dict) -> dict:
    """The full model's step on ``target`` from two measured layer counts."""
    from megatrain_jax import preset
    from megatrain_jax.flops import model_flops_per_token
    from megatrain_jax.plan import lean_engine, plan

    full = preset(name)
    dl = big["layers"] - small["layers"]
    per_layer = {k: (big["breakdown"][f"{k}_s"] - small["breakdown"][f"{k}_s"]) / dl
                 for k in ("compute", "h2d", "d2h", "optimizer")}
    fixed = {k: small["breakdown"][f"{k}_s"] - per_layer[k] * small["layers"] for k in per_layer}
    bytes_layer = (big["h2d_bytes_per_step"] - small["h2d_bytes_per_step"]) / dl
    h2d_here = big["h2d_bytes_per_step"] / big["breakdown"]["h2d_s"] / 1e9  # GB/s, serialized fetches
    bw = target["h2d_gb_s"] or h2d_here
    L = full.layers
    compute = (fixed["compute"] + per_layer["compute"] * L) / target["gpu_speed_vs_h100"]
    transfer = (big["h2d_bytes_per_step"] + bytes_layer * (L - big["layers"])) / (bw * 1e9)
    optimizer = (fixed["optimizer"] + per_layer["optimizer"] * L) / target["host_optimizer_vs_here"]
    here = max(big["breakdown"]["compute_s"], big["h2d_bytes_per_step"] / (h2d_here * 1e9),
               big["breakdown"]["optimizer_s"])
    efficiency = here / big["step_time_s"]  # how close the overlapped step came to its largest component here
    step = max(compute, transfer, optimizer) / efficiency
    tokens = ROWS * SEQ
    fpt = model_flops_per_token(full.active_param_count(), full.layers, full.hidden, SEQ)
    engine, lean = lean_engine(full, MODELS[name], ROWS, SEQ, host_ram_bytes=target["host_ram_gib"] * GiB)
    p = plan(full, engine, ROWS, SEQ, host_ram_bytes=target["host_ram_gib"] * GiB, detect=False)
    return {"params": full.param_count(), "layers": L, "mode": engine.master_dtype, "engine": dataclasses.asdict(engine),
            "compute_s": round(compute, 2), "transfer_s": round(transfer, 2), "host_optimizer_s": round(optimizer, 2),
            "overlap_efficiency_measured": round(efficiency, 3), "step_s": round(step, 2),
            "bound_by": max((("compute", compute), ("transfer", transfer), ("host optimizer", optimizer)),
                            key=lambda kv: kv[1])[0],
            "tokens_per_s": round(tokens / step, 1), "model_tflops": round(tokens / step * fpt / 1e12, 1),
            "host_ram_gib_planned": round(p.host_total / GiB, 1), "host_fits": p.host_fits,
            "host_bytes_per_param": round(p.host_total / p.params, 2),
            "inputs": {"per_layer_s": {k: round(v, 4) for k, v in per_layer.items()},
                       "io_and_fixed_s": {k: round(v, 4) for k, v in fixed.items()},
                       "h2d_bytes_per_layer": int(bytes_layer), "h2d_gb_s_measured_here": round(h2d_here, 1),
                       "h2d_gb_s_assumed": bw}}


def project_host(name: str, rows: int = ROWS, micro_batches: int | None = None, host_cores: int | None = None
                 ) -> dict:
    """The full model's host RAM in each of ``HOST_MODES`` on an H200 with each of ``HOST_SIZES_GIB``: as
    configured, and as ``megatrain-jax train`` picks it (``lean_engine``, no disk tier); ``rows`` of ``SEQ``
    tokens a step, in ``micro_batches`` (default: each mode's); the step at the H200's rates on a host of
    ``host_cores`` cores (``Speeds.on_host``; None: the 16-core host's)."""
    from megatrain_jax import preset
    from megatrain_jax.plan import gpu_fraction, lean_engine, plan
    from megatrain_jax.plan.speeds import SPEEDS
    from megatrain_jax.plan.step_time import predict

    full, gpu = preset(name), int(H200_GIB * GiB * gpu_fraction())
    out = {"params": full.param_count(), "gpu_bytes": gpu, "modes": {}}
    batch = rows
    for mode, engine in HOST_MODES.items():
        engine = engine if micro_batches is None else dataclasses.replace(engine, micro_batches=micro_batches)
        rows = {}
        for host in HOST_SIZES_GIB:
            kw = dict(host_ram_bytes=host * GiB, gpu_bytes=gpu)
            given = plan(full, engine, batch, SEQ, detect=False, **kw)
            picked, said = lean_engine(full, engine, batch, SEQ, **kw)
            p = plan(full, picked, batch, SEQ, detect=False, **kw)
            step = predict(full, picked, batch, SEQ, SPEEDS["H200"].on_host(host_cores)) if p.fits else None
            rows[f"{host} GiB"] = {
                "as_configured": {"host_gib": round(given.host_total / GiB, 1), "fits": given.fits},
                "picked": {"host_gib": round(p.host_total / GiB, 1), "fits": p.fits, "said": said,
                           "host_bytes_per_param": round(p.host_total / p.params, 2),
                           "predicted_step": None if step is None else {
                               **step.as_dict(), "tokens_per_s": round(batch * SEQ / step.seconds, 1)},
                           "changes": {f.name: getattr(picked, f.name) for f in dataclasses.fields(picked)
                                       if getattr(picked, f.name) != getattr(engine, f.name)}}}
        out["modes"][mode] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="path of the results JSON")
    ap.add_argument("--models", default="70b,120b")
    ap.add_argument("--layers", default="2,4", help="the two layer counts measured")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per run")
    ap.add_argument("--rows", type=int, default=ROWS, help=f"rows of {SEQ} tokens a step (--host-only)")
    ap.add_argument("--micro-batches", type=int, help="micro-batches of every host mode (--host-only; default 4)")
    ap.add_argument("--host-cores", type=int,
                    help="the host's cores for the predicted steps (--host-only; default: the H200's 16-core host; "
                         "64: the 4-GPU machine's, whose host update rates are on record in plan.speeds)")
    ap.add_argument("--host-only", action="store_true",
                    help="only the host RAM of each mode on each host size, from the plan (no GPU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.layers.split(","))
    if args.child:
        name, layers = args.child.split(":")
        print(json.dumps(measure(name, int(layers), args.warmup, args.steps)))
        return
    if not args.out:
        ap.error("--out is required")
    import jax  # the version only; the children start the GPU

    from megatrain_jax.plan import speeds
    commit = git_commit()
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/scale_projection.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
              "kind": "projection from measured per-layer inputs; not a measurement of the full models",
              "targets": TARGETS, "tokens_per_step": ROWS * SEQ, "seq_len": SEQ, "device": None,
              "runs": [], "projection": {}}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["host_projection"] = {"seq_len": SEQ, "rows": args.rows, "micro_batches": args.micro_batches or 4, "gpu": f"H200, {H200_GIB} GiB", "cited": CITED,
                                 "step_rates": ("the step-time model at the H200's default rates (16-core host): "
                                                "a larger host's more cores and memory channels would update faster"
                                                if args.host_cores is None else "the step-time model at "
                                                f"{speeds.SPEEDS['H200'].on_host(args.host_cores).name}"),
                                 "models": {name: project_host(name, args.rows, args.micro_batches, args.host_cores)
                                            for name in args.models.split(",")}}
    save()
    for name, proj in result["host_projection"]["models"].items():
        for mode, rows in proj["modes"].items():
            print(f"{name}, {mode}: " + "; ".join(
                f"{host}: {r['as_configured']['host_gib']} GiB as configured ({'fits' if r['as_configured']['fits'] else 'no'}), "
                f"picked {r['picked']['host_gib']} GiB ({'fits' if r['picked']['fits'] else 'no'})"
                for host, r in rows.items()), flush=True)
    if args.host_only:
        result["kind"] = "host RAM from the memory plan (no measurement)"
        save()
        return

    for name in args.models.split(","):
        runs = []
        for layers in (lo, hi):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{name}:{layers}", "--warmup",
                   str(args.warmup), "--steps", str(args.steps)]
            run = run_child(cmd, args.timeout, config=f"{name}_{layers}l")
            result["device"] = result["device"] or run.pop("device", None)
            run.pop("device", None)
            result["runs"].append(run)
            runs.append(run)
            save()
            print(f"{run['config']}: {run.get('status')} step {run.get('step_time_s')} s breakdown "
                  f"{run.get('breakdown')} host {run.get('host_peak_gib')} GiB gpu {run.get('gpu_peak_gib')} GiB",
                  flush=True)
        if all(r.get("status") == "ok" for r in runs):
            result["projection"][name] = {t: project(name, runs[0], runs[1], spec) for t, spec in TARGETS.items()}
            save()
            for t, p in result["projection"][name].items():
                print(f"  {name} on {t}: step {p['step_s']} s ({p['bound_by']}-bound), {p['tokens_per_s']} tok/s, "
                      f"{p['model_tflops']} TFLOP/s, host {p['host_ram_gib_planned']} GiB "
                      f"({'fits' if p['host_fits'] else 'does not fit'})", flush=True)


if __name__ == "__main__":
    main()
