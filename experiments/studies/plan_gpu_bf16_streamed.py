"""The GPU plan against every measured streamed run that sends bfloat16 gradients home (the runs the ledger's rule
for float32 sums read only by programs moves, plan/gpu_ledger.py): for each, the measured GPU peak, the plan that
run recorded at its own commit (``planned.gpu_gib``: XLA's figures where the GPU was at hand), and the plan at
this commit by rules of thumb for the engine that run recorded. CPU only.

    PYTHONPATH=. python experiments/studies/plan_gpu_bf16_streamed.py --out experiments/results/cpu_plan_gpu_bf16_streamed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py
REPO = os.path.dirname(EXPERIMENTS)
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

# results files of streamed runs with host_grad_dtype = "bfloat16" through `train` (shipped_configs.py records)
RUNS = ["tests/assets/measured/h200x2_qwen32b_q8_cli.json", "tests/assets/measured/h200x4_70b_q8_cli.json",
        "experiments/results/h200x4_gpt_oss_120b_40953f5_6l_rehearsal.json",
        "experiments/results/h200x4_dense_120b_b7db504_6l_rehearsal.json",
        "experiments/results/h200x4_llama3_70b_32k_b7db504_8l_rehearsal.json",
        "experiments/results/h200x4_llama3_70b_32k_fe50612_8l_rehearsal.json",
        "experiments/results/h200_capped_rtx4090_64gb_sft_8b_q8_fbb9963.json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from child import results_header
    from megatrain_jax.cli import load_config
    from megatrain_jax.plan import GiB, plan
    from test_memory_plan import _recorded_engine  # a results file's engine record as an EngineConfig

    rows = []
    for path in RUNS:
        record = json.load(open(os.path.join(REPO, path)))
        for r in record["runs"]:
            if r.get("status") != "ok" or r["planned"]["engine"].get("host_grad_dtype") != "bfloat16":
                continue
            config = os.path.join(REPO, "experiments", "configs", f"{r['config']}.toml")
            # the model and the batch as the run had them (the engine is the one it recorded; its model folder, where the
            # config names one, by the preset of the same shape; the data's file is not read)
            overrides = [o for o in r["overrides"] if not o.startswith(
                ("train.", "model.hf_checkpoint", "data.path", "data.format", "data.tokenizer"))]
            cfg = load_config(config, [*overrides, "engine.kept_layers=auto", "model.hf_checkpoint=none",
                                       *_preset_of(config), "data.format=tokens", "data.path=none"])
            e = _recorded_engine(r["planned"]["engine"])
            host = (r.get("caps") or {}).get("host_ram_gib") or record["device"]["host_ram_gib"]
            p = plan(cfg.model.build(), e, cfg.data.batch_size, cfg.data.seq_len, host_ram_bytes=int(host * GiB),
                     gpu_bytes=None, detect=False, packed=cfg.data.mode == "packed")
            measured, then = r["gpu_peak_gib"], r["planned"]["gpu_gib"]
            rows.append({"file": path, "config": r["config"], "overrides": overrides, "git_commit": record["git_commit"],
                         "measured_gpu_peak_gib": round(measured, 3), "plan_then_gib": then,
                         "plan_then_exact": r["planned"]["gpu_exact"],
                         "plan_then_error": round((then - measured) / measured, 4),
                         "plan_now_gib": round(p.gpu_total / GiB, 3), "plan_now_peak_at": p.gpu_peak_at,
                         "plan_now_error": round((p.gpu_total / GiB - measured) / measured, 4)})
            print(f"{rows[-1]['file'].split('/')[-1]:<58} then {rows[-1]['plan_then_error']:+.1%}  "
                  f"now {rows[-1]['plan_now_error']:+.1%}", flush=True)
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "note": "plan_now: rules of thumb (no GPU here)",
                   "runs": rows}, f, indent=1)


def _preset_of(config: str) -> list[str]:
    """A config that names a Hugging Face folder says the preset of its shape (``# plan shape: PRESET``)."""
    for line in open(config):
        if line.startswith("# plan shape:"):
            return [f"model.preset={line.split(':', 1)[1].strip()}"]
    return []


if __name__ == "__main__":
    main()
