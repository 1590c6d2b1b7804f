"""CPU only: issue 52's levers for 100B+ on one H200 with at most 512 GiB of host, weighed with the memory plan.

    PYTHONPATH=. python experiments/studies/capacity_levers.py --out experiments/results/cpu_capacity_levers.json

For GPT-OSS-120B's shape and the dense-120b preset (8 rows of 2,048 tokens, nothing GPU-resident, one H200:
XLA's 95% of 141 GiB), the host the plan counts (``plan.memory.plan``, every item) under:

- today's leanest mode: bfloat16 masters, 8-bit moments, bfloat16 gradients home (capacity mode with q8);
- the same with as many parts' gradients waiting on the GPU as it holds (``grads_on_gpu``, the most that fit);
- capacity mode (bfloat16 moments: the disk tier does not hold 8-bit ones) with every block's moments in the
  disk tier (``disk_parts``), and the bytes that tier reads and writes per step;
- the exact two-pass step (``EngineConfig.norm_first``: a backward for the global norm, then a backward that
  updates each part as its gradient arrives: no step's gradients held, ``UPDATES_AHEAD`` + 1 parts' in flight);
- 7-bit m with 5-bit v (``moment_dtype="m7v5"``: 1.56 bytes per parameter for both, where 8-bit takes 2.03),
  alone and with the two-pass step;
- what ``train`` picks by itself from capacity mode on this host (``plan.lean_engine``).

Each row: host GiB, host bytes per parameter (the whole plan over the parameters), fits 512 GiB or not, and the
predicted step at the H200's default rates where the plan can time it.
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
from megatrain_jax.plan import GiB, plan  # noqa: E402
from megatrain_jax.plan.layout import lean_engine, most_fitting  # noqa: E402
from megatrain_jax.plan.speeds import SPEEDS  # noqa: E402
from megatrain_jax.plan.step_time import predict  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-gib", type=float, default=512.0)
    ap.add_argument("--gpu-gib", type=float, default=141 * 0.95)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kw = dict(host_ram_bytes=int(args.host_gib * GiB), gpu_bytes=int(args.gpu_gib * GiB), detect=False,
              disk_bytes=10**15)
    base = EngineConfig(micro_batches=1, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16",
                        disk_dir="/tmp/disk_tier")
    runs = []
    for name in ("gpt-oss-120b", "dense-120b"):
        cfg = preset(name)
        params = cfg.param_count()

        def row(label: str, host: float, e: EngineConfig | None, **extra) -> dict:
            step = None
            if e is not None:
                try:
                    step = round(predict(cfg, e, args.rows, args.seq, SPEEDS["H200"]).seconds, 2)
                except ValueError:
                    step = None
            return {"model": name, "params": params, "lever": label, "host_gib": round(host / GiB, 1),
                    "host_bytes_per_param": round(host / params, 2), "fits_host": host <= kw["host_ram_bytes"],
                    "predicted_step_s": step, **extra}

        today = plan(cfg, base, args.rows, args.seq, **kw)
        runs.append(row("capacity mode, 8-bit moments, bfloat16 gradients home (today)", today.host_total, base,
                        gpu_fits=today.gpu_fits, host_items_gib={k: round(v / GiB, 2) for k, v in today.host.items()}))
        n_host = cfg.layers + 1
        k = most_fitting(lambda k: plan(cfg, dataclasses.replace(base, grads_on_gpu=k), args.rows, args.seq,
                                        **kw).gpu_fits, n_host)
        waiting = dataclasses.replace(base, grads_on_gpu=k)
        runs.append(row(f"+ gradients of {k} of {n_host} parts waiting on the GPU (the most that fit)",
                        plan(cfg, waiting, args.rows, args.seq, **kw).host_total, waiting))
        disk = dataclasses.replace(base, moment_dtype=None, disk_parts=cfg.layers)  # the tier holds 16-bit moments
        runs.append(row("capacity mode (bfloat16 moments) with every block's moments in the disk tier",
                        plan(cfg, disk, args.rows, args.seq, **kw).host_total, disk,
                        disk_read_and_written_per_step_gib=round(2 * 4 * params / GiB, 1)))
        two_pass = dataclasses.replace(base, norm_first=True)
        runs.append(row("8-bit moments and the exact two-pass step (norm_first)",
                        plan(cfg, two_pass, args.rows, args.seq, **kw).host_total, two_pass))
        mixed = dataclasses.replace(base, moment_dtype="m7v5")
        runs.append(row("7-bit m and 5-bit v (m7v5)", plan(cfg, mixed, args.rows, args.seq, **kw).host_total, mixed))
        mixed_two_pass = dataclasses.replace(mixed, norm_first=True)
        p = plan(cfg, mixed_two_pass, args.rows, args.seq, **kw)
        runs.append(row("7-bit m, 5-bit v and the exact two-pass step", p.host_total, mixed_two_pass,
                        gpu_fits=p.gpu_fits, host_items_gib={k: round(v / GiB, 2) for k, v in p.host.items()}))
        picked, why = lean_engine(cfg, EngineConfig(micro_batches=1, master_dtype="bfloat16"), args.rows, args.seq,
                                  host_ram_bytes=kw["host_ram_bytes"], gpu_bytes=kw["gpu_bytes"])
        runs.append(row("train's own pick from capacity mode", plan(cfg, picked, args.rows, args.seq, **kw).host_total,
                        picked, picked={f: getattr(picked, f) for f in ("moment_dtype", "host_grad_dtype",
                                                                          "norm_first", "grads_on_gpu")}, said=why))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/capacity_levers.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "date": datetime.date.today().isoformat(),
              "device": {"name": "CPU (the memory plan, for one H200)", "cpu_cores": os.cpu_count()},
              "host_gib": args.host_gib, "gpu_gib": round(args.gpu_gib, 2), "rows": args.rows, "seq_len": args.seq,
              "note": "every row is the memory plan's own count (plan.memory.plan), whole process",
              "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    for r in runs:
        print(f"{r['model']:13s} {r['host_gib']:7.1f} GiB {r['host_bytes_per_param']:5.2f} B/param "
              f"{'fits' if r['fits_host'] else 'over'}  {r['predicted_step_s']}  {r['lever']}")


if __name__ == "__main__":
    main()
