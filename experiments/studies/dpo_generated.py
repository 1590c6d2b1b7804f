"""Preference training (DPO) through ``megatrain-jax train`` on generated preference data (issue 53's GPU run).

Writes ``--data-dir``: a tokenizer folder (a byte-level BPE trained on the generated text, with a ChatML
template: ``scripts/make_tiny_hf.py``'s) and ``prefs.jsonl``, ``--pairs`` chat pairs whose chosen answer is right
and whose rejected answer is wrong (sums, reversed words, letter counts); then runs ``megatrain-jax train
--config CONFIG`` as a user would (the shipped ``experiments/configs/h200_dpo_8b_generated.toml`` reads that
folder) with any ``--set`` overrides, and writes the results file: each step's loss and rewards (the reward
accuracy curve), the first and last 5-step means, tokens/s, the reference pass's time, and the run's memory
peaks against the plan.

    PYTHONPATH=. python experiments/studies/dpo_generated.py --config experiments/configs/h200_dpo_8b_generated.toml \
        --out $OUT/h200_dpo_8b_generated.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median as _median

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(EXPERIMENTS)
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from child import results_header  # noqa: E402
from megatrain_jax.cli.run_config import load_config  # noqa: E402
from make_tiny_hf import WORDS, write_tokenizer  # noqa: E402


DEFAULT_DATA = "build/dpo_generated"  # where the shipped config reads its pairs and tokenizer


def median(values: list) -> float | None:
    return _median(values) if values else None


def peak(records: list[dict], key: str) -> float | None:
    """The largest ``key`` of the run's metrics records (None where none has it: no GPU)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference pairs: a question, the right answer chosen, a wrong one rejected."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, w = rng.randrange(50), rng.randrange(50), WORDS[rng.randrange(len(WORDS))]
        kind = i % 3
        if kind == 0:
            q, good, bad = (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.",
                            f"{a} plus {b} is {a + b + rng.randint(1, 9)}.")
        elif kind == 1:
            q, good, bad = f"Spell {w} backwards.", f"Backwards, {w} is {w[::-1]}.", f"Backwards, {w} is {w}."
        else:
            q, good, bad = (f"How many letters are in {w}?", f"{w} has {len(w)} letters.",
                            f"{w} has {len(w) + rng.randint(1, 4)} letters.")
        out.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(EXPERIMENTS, "configs", "h200_dpo_8b_generated.toml"))
    ap.add_argument("--data-dir", default=DEFAULT_DATA, help="where to write the data (the config reads "
                    f"{DEFAULT_DATA}; another folder is passed to train as data.path and data.tokenizer)")
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], help="an override passed to train (section.key=value)")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = Path(args.data_dir)
    (data / "tokenizer").mkdir(parents=True, exist_ok=True)
    lines = pairs(args.pairs)
    (data / "prefs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    texts = [f"{m['role']} {m['content']}" for x in lines for k in ("prompt", "chosen", "rejected") for m in x[k]]
    vocab = write_tokenizer(data / "tokenizer", texts, args.vocab)
    run_dir = None
    for item in args.set:
        if item.startswith("train.run_dir="):
            run_dir = item.split("=", 1)[1]
    if run_dir is None:
        import tomllib
        run_dir = tomllib.loads(Path(args.config).read_text())["train"]["run_dir"]
    moved = [] if args.data_dir == DEFAULT_DATA else [f"data.path={data / 'prefs.jsonl'}",
                                                       f"data.tokenizer={data / 'tokenizer'}"]
    command = [sys.executable, "-m", "megatrain_jax", "train", "--config", args.config, *moved, *args.set]
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    wall = time.perf_counter() - t0
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    metrics = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in records if "loss" in r and "rewards_accuracy" in r]
    keys = ("step", "loss", "rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected", "grad_norm",
            "step_time_s", "tokens_per_s", "model_tflops")
    curve = [{k: r.get(k) for k in keys} for r in steps]
    mean = lambda rows, k: round(sum(r[k] for r in rows) / len(rows), 4) if rows else None  # noqa: E731
    plan_file = Path(run_dir) / "memory_plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    predicted = (plan or {}).get("predicted_step") or {}
    cfg = load_config(args.config, [*moved, *args.set])
    model_cfg = cfg.model.build()
    said = proc.stderr.splitlines() + proc.stdout.splitlines()
    timed = steps[2:]  # the first steps compile
    run = {"system": "megatrain_jax", "config": Path(args.config).stem, "objective": "dpo",
           "dpo": {"beta": cfg.dpo.beta, "label_smoothing": cfg.dpo.label_smoothing},
           "model": {"layers": model_cfg.layers, "hidden": model_cfg.hidden, "ffn": model_cfg.ffn,
                     "heads": model_cfg.heads, "kv_heads": model_cfg.kv_heads, "vocab": model_cfg.vocab_size,
                     "params": model_cfg.param_count()},
           "seq_len": cfg.data.seq_len, "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
           "steps_timed": len(timed), "num_gpus": 1, "master_dtype": cfg.engine.master_dtype,
           "step_time_s": median([r["step_time_s"] for r in timed]),
           "tokens_per_s": median([r["tokens_per_s"] for r in timed]),
           "model_tflops": median([r["model_tflops"] for r in timed]),
           "gpu_peak_gib": peak(records, "gpu_peak_gib"), "host_peak_gib": peak(records, "host_peak_rss_gib"),
           "loss_first": steps[0]["loss"] if steps else None, "loss_last": steps[-1]["loss"] if steps else None,
           "status": "ok" if proc.returncode == 0 else f"error: exit {proc.returncode}",
           # where the model lives: the plan's share of parameters resident and PCIe bytes a step
           "gpu_resident_param_share": predicted.get("resident_share"),
           "pcie_per_step_planned": {k: predicted.get(k) for k in ("h2d_bytes", "d2h_bytes")},
           "predicted_step_s": predicted.get("seconds"),
           "first5": {k: mean(steps[:5], k) for k in ("loss", "rewards_accuracy", "rewards_margin")},
           "last5": {k: mean(steps[-5:], k) for k in ("loss", "rewards_accuracy", "rewards_margin")},
           "steps": curve, "reference_pass": [x.strip() for x in said if "reference pass" in x],
           "memory_plan": plan, "stderr_tail": proc.stderr[-2000:] if proc.returncode else None}
    result = {**results_header(args.out, __file__), "command_train": " ".join(command[1:]), "wall_s": round(wall, 1),
              "data": {"pairs": len(lines), "tokenizer_vocab": vocab, "file": str(data / "prefs.jsonl")},
              "runs": [run]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    shown = ("status", "first5", "last5", "tokens_per_s", "gpu_peak_gib", "host_peak_gib")
    print(json.dumps({k: run[k] for k in shown}))


if __name__ == "__main__":
    main()
