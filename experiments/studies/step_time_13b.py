"""CPU only: the step-time model's predictions for Llama-2-13B's shape on one H200 of the x2 host (issue 51's
13B rows): the layouts the issue measured (20 resident blocks, none kept; 4 resident, 24 kept), the layout the
plan picks with ``resident_layers`` and ``kept_layers`` "auto", the most kept blocks that fit beside 0, 4 and 7
resident, and the GPU's own work with every block recomputed and with every block keeping its products (the
ceiling no layout passes). At 32K and 8K tokens per step (16 and 4 rows of 2,048).

    PYTHONPATH=. python experiments/studies/step_time_13b.py --out experiments/results/cpu_step_time_13b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatrain_jax.engine.config import EngineConfig  # noqa: E402
from megatrain_jax.models import preset  # noqa: E402
from megatrain_jax.plan import Machine, plan, resolve  # noqa: E402
from megatrain_jax.plan.layout import most_fitting  # noqa: E402
from megatrain_jax.plan.speeds import SPEEDS  # noqa: E402
from megatrain_jax.plan.step_time import lengths, predict  # noqa: E402

GiB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-gib", type=float, default=240.0, help="host RAM available (the x2 host: 251.8 total)")
    ap.add_argument("--gpu-gib", type=float, default=141 * 0.95, help="what XLA may allocate of the H200")
    ap.add_argument("--host-cores", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = preset("llama2-13b")
    s = SPEEDS["H200"].on_host(args.host_cores)
    machine = Machine(int(args.host_gib * GiB), int(args.gpu_gib * GiB), gpu_name="NVIDIA H200",
                      host_cores=args.host_cores)
    kw = dict(host_ram_bytes=machine.host_ram_bytes, gpu_bytes=machine.gpu_bytes)
    base = EngineConfig(micro_batches=1, resident_io=True, keep_residuals=True, prefetch_depth=2)
    runs = []
    for rows in (16, 4):
        tokens = rows * 2048

        def row(label: str, e: EngineConfig, said: str | None = None) -> dict:
            p = predict(cfg, e, rows, 2048, s)
            fits = plan(cfg, e, rows, 2048, detect=False, **kw).fits
            return {"system": "step_time_model", "layout": label, "tokens_per_step": tokens, "seq_len": 2048,
                    "resident_layers": e.resident_layers, "kept_layers": e.kept_layers, "fits": fits,
                    "predicted_step_s": round(p.seconds, 4), "predicted_tokens_per_s": round(tokens / p.seconds),
                    "bound": p.bound, "gpu_resident_param_share": round(p.resident_share, 4),
                    "pcie_bytes_per_step": {"h2d": p.h2d_bytes, "d2h": p.d2h_bytes}, **({"said": said} if said else {})}

        runs.append(row("the issue's auto: 20 resident, none kept", dataclasses.replace(base, resident_layers=20)))
        runs.append(row("the issue's hand layout: 4 resident, 24 kept",
                        dataclasses.replace(base, resident_layers=4, kept_layers=24)))
        picked = resolve(cfg, dataclasses.replace(base, resident_layers="auto", kept_layers="auto"), rows, 2048,
                         machine)
        runs.append(row("the plan's pick (both 'auto')", picked.engine_cfg, picked.said))
        for r in (0, 4, 7):
            e = dataclasses.replace(base, resident_layers=r)
            k = most_fitting(lambda k: plan(cfg, dataclasses.replace(e, kept_layers=k), rows, 2048, detect=False,
                                            **kw).gpu_fits, cfg.layers)
            runs.append(row(f"{r} resident, the most kept that fit", dataclasses.replace(e, kept_layers=k)))
        for label, k in (("GPU work alone, every block recomputed", 0), ("GPU work alone, every block kept", 40)):
            n = lengths(cfg, dataclasses.replace(base, resident_layers=0, kept_layers=k), rows, 2048, s)
            gpu = sum(n.forward.values()) + sum(n.backward.values()) + n.head
            runs.append({"system": "step_time_model", "layout": label, "tokens_per_step": tokens,
                         "predicted_step_s": round(gpu, 4), "predicted_tokens_per_s": round(tokens / gpu)})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/step_time_13b.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "device": {"name": "CPU (the model, for one H200 of the x2 host)",
                                               "cpu_cores": os.cpu_count()},
              "date": datetime.date.today().isoformat(), "speeds": s.name, "host_gib": args.host_gib,
              "gpu_gib": round(args.gpu_gib, 2), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    for r in runs:
        print(r["tokens_per_step"], r["layout"], r["predicted_tokens_per_s"], r.get("bound", ""))


if __name__ == "__main__":
    main()
