"""The host plan of this tree against every recorded `megatrain-jax train` run (``experiments/shipped_configs.py``'s
results files, and the ``*_cli.json`` ones of the same form): each run re-planned with the engine it ran
(``planned.engine``), on its host and its GPU (the GPU memory XLA took: ``planned.gpu_available_gib`` where the
run recorded it, else the device's at the engine's 0.95), over the GPUs it used (``train.devices``), and compared
with its peak resident set (VmHWM at the step ends) and with that less its mapped files (a Hugging Face
checkpoint being read: pages the kernel may take back), which is about its anonymous + pinned memory. A run that
starts from a Hugging Face folder is planned with the preset its config's ``# plan shape:`` line names.

    PYTHONPATH=. python experiments/studies/host_plan_vs_runs.py experiments/results/*shipped_configs*.json \
        experiments/results/*_cli.json --out experiments/results/cpu_host_plan_vs_runs_TAG.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from megatrain_jax.cli.run_config import load_config
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.plan import GiB, plan

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "experiments" / "configs"
SHAPE = re.compile(r"^# plan shape: (\S+)$", re.MULTILINE)
GPU_GIB = {"H100": 75.2, "H200": 132.8}  # what XLA takes of each at the engine's 0.95 (as recorded by newer runs)


def replan(check: dict, run: dict) -> dict | None:
    engine = (run.get("planned") or {}).get("engine")
    peak = run.get("host_peak_gib")
    if not engine or not peak or run.get("status") != "ok":
        return None
    path = CONFIGS / f"{run['config']}.toml"
    if not path.exists():
        return None
    overrides = [o for o in run.get("overrides", []) if not o.startswith(("train.", "data.path="))]
    if any(o.startswith("model.hf_checkpoint=") for o in overrides):
        shape = SHAPE.search(path.read_text())
        overrides = [o for o in overrides if not o.startswith("model.hf_checkpoint=")]
        overrides += ["model.hf_checkpoint=none", f"model.preset={shape.group(1)}", "data.format=tokens"]
    devices = next((int(o.split("=")[1]) for o in run.get("overrides", []) if o.startswith("train.devices=")), 1)
    try:
        cfg = load_config(str(path), overrides)
        model = cfg.model.build()
    except Exception as e:  # noqa: BLE001 - a config the tree no longer reads this way
        return {"config": run["config"], "skipped": f"{type(e).__name__}: {str(e)[:160]}"}
    known = {f for f in EngineConfig.__dataclass_fields__}
    e = EngineConfig(**{k: v for k, v in engine.items() if k in known})
    device = check.get("device", {}).get("name", "")
    gpu_gib = (run.get("planned") or {}).get("gpu_available_gib") or next(
        (g for kind, g in GPU_GIB.items() if kind in device), None)
    host_gib = check.get("device", {}).get("host_ram_gib") or 125.9
    p = plan(model, e, cfg.data.batch_size, cfg.data.seq_len, host_ram_bytes=int(host_gib * GiB),
             gpu_bytes=None if gpu_gib is None else int(gpu_gib * GiB), devices=devices, detect=False,
             packed=cfg.data.mode == "packed")
    own = peak - (run.get("host_file_max_gib") or 0.0)
    return {"config": run["config"], "device": device, "devices": devices, "host_ram_gib": host_gib,
            "plan_host_gib": round(p.host_total / GiB, 2), "peak_rss_gib": round(peak, 2), "own_gib": round(own, 2),
            "error_vs_peak": round((p.host_total / GiB - peak) / peak, 4),
            "error_vs_own": round((p.host_total / GiB - own) / own, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = []
    for f in sorted(set(args.files)):
        check = json.loads(Path(f).read_text())
        for run in check.get("runs", []):
            row = replan(check, run) if isinstance(run, dict) else None
            if row is not None:
                runs.append({"file": Path(f).name, **row})
    done = [r for r in runs if "plan_host_gib" in r]
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {key: {"median": round(statistics.median(r[key] for r in done), 4),
                     "min": min(r[key] for r in done), "max": max(r[key] for r in done),
                     "under": sum(r[key] < 0 for r in done)} for key in ("error_vs_peak", "error_vs_own")} if done else {}
    out = {"name": Path(args.out).stem, "command": "PYTHONPATH=. python experiments/studies/host_plan_vs_runs.py "
           + " ".join(sys.argv[1:] if argv is None else argv), "git_commit": commit,
           "date": datetime.date.today().isoformat(),
           "device": {"name": "development machine (CPU)", "cpu_cores": os.cpu_count()},
           "planned_runs": len(done), "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"planned_runs": len(done), "skipped": len(runs) - len(done), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
