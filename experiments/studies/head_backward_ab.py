"""Whether the head's backward in bfloat16 (31f2d79: the logits' float32 cotangent rounded to the compute dtype
before the head's two backward products) changes training, against the seed-to-seed spread.

Trains the built-in demo's config (`experiments/configs/demo_tiny.toml`: the tiny model on the synthetic corpus) in
bfloat16 compute, once per (variant, seed), each in its own process: ``bf16`` is the package as it is, ``f32`` puts
back the head's product as it was before 31f2d79 (differentiated as written, so its backward products take the
float32 cotangent: float32 on a CPU, TF32 on a GPU). Records each run's last logged training loss and its held-out
loss at the end, the largest gap between the variants at one seed, and the spread of each variant over its seeds.
The quality table (docs/capacity.md) holds runs from both sides of that commit; this says how much that can matter
at this size (a tiny model: an indication, not the 1B table's answer).

    PYTHONPATH=. python experiments/studies/head_backward_ab.py --seeds 0,1,2 --out $OUT/cpu_head_backward_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(EXPERIMENTS)
sys.path.insert(0, EXPERIMENTS)

VARIANTS = ("f32", "bf16")
CONFIG = "experiments/configs/demo_tiny.toml"


def run_one(variant: str, seed: int, steps: int, run_dir: str) -> None:
    """Train once in this process (the child's side): the head as it was where ``variant`` is ``f32``."""
    import jax.numpy as jnp

    import megatrain_jax.models.decoder as decoder
    from megatrain_jax.cli import main
    if variant == "f32":  # the head's product before 31f2d79: its backward takes the float32 cotangent
        decoder.logits_matmul = lambda h, w, dtype: jnp.matmul(h.astype(dtype), w.astype(dtype),
                                                               preferred_element_type=jnp.float32)
    code = main(["train", "--config", CONFIG, "model.dtype=bfloat16", f"train.seed={seed}", f"train.steps={steps}",
                 f"train.run_dir={run_dir}"])
    sys.exit(code)


def last(path: str, key: str) -> float | None:
    """The last value of ``key`` in a run's metrics.jsonl."""
    value = None
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if key in row:
                value = row[key]
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "SEED", "RUN_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_one(args.child[0], int(args.child[1]), args.steps, args.child[2])
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for seed in seeds:
            for variant in VARIANTS:
                run_dir = os.path.join(work, f"{variant}_{seed}")
                proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--out", args.out,
                                       "--child", variant, str(seed), run_dir], cwd=REPO, capture_output=True,
                                      text=True, env={**os.environ, "PYTHONPATH": REPO})
                if proc.returncode != 0:
                    raise SystemExit(f"{variant} seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                metrics = os.path.join(run_dir, "metrics.jsonl")
                runs.append({"system": "megatrain_jax", "variant": variant, "seed": seed,
                             "final_loss": last(metrics, "loss"), "eval_loss": last(metrics, "eval_loss")})
                print(json.dumps(runs[-1]), flush=True)
    by = {(r["variant"], r["seed"]): r for r in runs}
    summary = {}
    for key in ("final_loss", "eval_loss"):
        gaps = [abs(by["bf16", s][key] - by["f32", s][key]) for s in seeds]
        spreads = {v: max(by[v, s][key] for s in seeds) - min(by[v, s][key] for s in seeds) for v in VARIANTS}
        summary[key] = {"largest_gap_between_variants": round(max(gaps), 6),
                        "spread_over_seeds": {v: round(x, 6) for v, x in spreads.items()}}
    from child import results_header
    record = {**results_header(args.out, __file__), "config": CONFIG, "compute_dtype": "bfloat16",
              "steps": args.steps, "seeds": seeds, "summary": summary, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
