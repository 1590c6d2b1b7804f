"""What the host plan's runtime allowance leaves out (2026-11-26): for each `megatrain-jax train` run recorded by
``experiments/shipped_configs.py`` with its plan's engine and the resident set by kind: the process's anonymous
memory at the step ends beyond the pageable arrays the plan counts (what the plan's runtime allowance stands for),
and the peak against the plan. Runs initialized from a Hugging Face folder (``model.hf_checkpoint``) are skipped
here: their GPU-resident parts' moments are ``pageable_zeros`` that may stay unwritten until a checkpoint's
``Engine.sync``, so their step-end anonymous memory is not comparable (NOTES, 2026-11-26, 0ceb1a2).

    PYTHONPATH=. python experiments/studies/host_runtime_study.py experiments/results/*_cli.json \
        experiments/results/*shipped_configs_6014bc6*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatrain_jax.cli.run_config import load_config
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.plan import GiB, plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def rows(path: Path) -> list[dict]:
    check = json.loads(path.read_text())
    out = []
    for run in check.get("runs", []):
        engine = (run.get("planned") or {}).get("engine")
        if not engine or not run.get("host_anon_max_gib"):
            continue
        overrides = [o for o in run.get("overrides", []) if not o.startswith("train.")]
        if any(o.startswith("model.hf_checkpoint=") for o in overrides):  # a generated folder on the GPU box
            continue
        try:
            cfg = load_config(CONFIGS / f"{run['config']}.toml", overrides)
            model = cfg.model.build()
        except Exception as e:  # noqa: BLE001 - e.g. an HF folder that only existed on the GPU machine
            out.append({"file": path.name, "config": run["config"], "skipped": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        e = EngineConfig(**{"keep_residuals": False, **engine})
        host_gib = check["device"].get("host_ram_gib")
        p = plan(model, e, cfg.data.batch_size, cfg.data.seq_len, host_ram_bytes=int(host_gib * GiB) if host_gib else None,
                 gpu_bytes=None, detect=False)
        table = p.host
        pageable = sum(v for k, v in table.items() if k.startswith("pageable:"))
        pool = sum(v for k, v in table.items() if k.startswith("pinned:") or k.startswith("XLA's pinned pool")
                   or k.startswith("CUDA driver"))
        runtime = sum(v for k, v in table.items() if k.startswith("runtime"))
        anon, shmem_total = run["host_anon_max_gib"], run["host_peak_gib"]  # peak: ru_maxrss, shared memory too
        out.append({"file": path.name, "config": run["config"], "host_gib": host_gib,
                    "plan_host": round(p.host_total / GiB, 2), "peak_rss": round(shmem_total, 2),
                    "anon": round(anon, 2), "file_rss": run.get("host_file_max_gib"),
                    "plan_pageable": round(pageable / GiB, 2),
                    "plan_pool": round(pool / GiB, 2), "plan_runtime": round(runtime / GiB, 2),
                    "anon_beyond_pageable": round(anon - pageable / GiB, 2),
                    "plan_error": round((p.host_total / GiB - shmem_total) / shmem_total, 4)})
    return out


if __name__ == "__main__":
    for f in sys.argv[1:]:
        for r in rows(Path(f)):
            print(json.dumps(r))
