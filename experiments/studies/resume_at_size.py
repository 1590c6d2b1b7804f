"""Checkpoints at the size of the machine's disk, through ``megatrain-jax train`` (issue 52): on one GPU, with the
lean mode's checkpoints (bfloat16 masters, 7-bit m and 5-bit v, the two-pass step), Qwen2.5-32B's shape cut to the
most layers whose resumable run fits the disk of the checkpoint folder (two checkpoints with
``checkpoint_keep = 1``: the saved one and the one written at the end of the resumed run), in four stages, each
a ``train`` in a child process (``shipped_configs.run_config``):

1. ``refused``: the shape with ``--refuse-layers`` layers, whose checkpoints do not fit: ``train`` must refuse at
   start with the bytes (exit 2), before building anything;
2. ``reference``: ``--steps`` steps without checkpoints;
3. ``first``: the first ``--steps // 2`` steps, saving a checkpoint at the last;
4. ``resumed``: ``train.resume = true`` on that folder, to ``--steps``: its losses must equal the reference's
   steps after the save, bit for bit (XLA's deterministic ops are set for every stage; the stochastic rounding
   of the quantized moments and the bfloat16 masters is keyed by step and element, so the resumed steps draw what
   the uninterrupted ones drew).

The learning rate is constant, without warm-up, in every stage: ``train``'s schedule spans the run's own
``train.steps`` (warm-up ``min(warmup_steps, steps - 1)``, then the cosine over the run), so a first run of fewer
steps would train another schedule than the reference, and the resumed steps could not match it (the first run of
this study, ``h200_resume_at_size_cdc352c.json``, did that). The results file is written after every stage.

    PYTHONPATH=. python experiments/studies/resume_at_size.py --out $OUT/h200_resume_at_size.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))
from child import results_header  # noqa: E402
from shipped_configs import CONFIGS, run_config  # noqa: E402

from megatrain_jax.cli.disk_room import checkpoint_bytes  # noqa: E402
from megatrain_jax.cli.run_config import load_config  # noqa: E402

CONFIG = Path(CONFIGS) / "h200_7b_32k.toml"
LEAN = ["model.preset=32b", "engine.master_dtype=bfloat16", "engine.moment_dtype=m7v5",
        "engine.host_grad_dtype=bfloat16", "engine.norm_first=true", "engine.resident_layers=0",
        "engine.resident_io=false", "engine.micro_batches=2", "optimizer.warmup_steps=0", "optimizer.decay=constant"]
GiB = 2 ** 30


def shape(layers: int) -> list[str]:
    return [*LEAN, f"model.layers={layers}"]


def checkpoint_size(layers: int) -> int:
    cfg = load_config(CONFIG, shape(layers))
    return checkpoint_bytes(cfg.model.build(), cfg.engine)


def metrics(work: Path) -> list[dict]:
    """The rows of the last stage's metrics.jsonl (run_config's run folder: work/runs/<config's stem>)."""
    path = work / "runs" / CONFIG.stem / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def du(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--refuse-layers", type=int, default=40, help="layers of the shape whose save must be refused")
    ap.add_argument("--checkpoints", default="/tmp/resume_at_size", help="the checkpoint folder (its disk decides)")
    ap.add_argument("--work", default="/tmp/resume_at_size_work")
    ap.add_argument("--timeout", type=float, default=200, help="seconds per stage")
    ap.add_argument("--max-layers", type=int, default=64, help="at most this many layers, whatever the disk holds")
    ap.add_argument("--skip-refusal", action="store_true", help="no refused stage")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ckpt, work = Path(args.checkpoints), Path(args.work)
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    free = shutil.disk_usage(ckpt).free
    layers = max((n for n in range(1, args.max_layers + 1) if 2 * checkpoint_size(n) <= 0.92 * free), default=None)
    if layers is None:
        sys.exit(f"resume_at_size: {free / GiB:.1f} GiB free at {ckpt}: not even one layer's run fits")
    size = checkpoint_size(layers)
    params = load_config(CONFIG, shape(layers)).model.build().param_count()
    print(f"{free / GiB:.1f} GiB free at {ckpt}: {layers} layers ({params / 1e9:.2f}B), checkpoints of "
          f"{size / GiB:.1f} GiB", flush=True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    save = [f"train.checkpoint_dir={ckpt}", "train.checkpoint_keep=1"]
    stages = []

    def write(summary: dict, final: bool = False) -> None:
        """The results file; before the last stage without the header's device fields (``results_header``
        starts JAX's backend, which in this process would take GPU memory from the stages' children)."""
        head = (results_header(args.out, __file__) if final else
                {"name": Path(args.out).stem, "command": " ".join(sys.argv), "partial": True})
        with open(args.out, "w") as f:
            json.dump({**head, "summary": summary, "runs": stages}, f, indent=1)

    def stage(name: str, layers_: int, steps: int, extra: list[str]) -> dict:
        t = time.perf_counter()
        record = run_config(CONFIG, steps, work, args.timeout, [*shape(layers_), *extra])
        rows = metrics(work)
        record.update(stage=name, layers=layers_, stage_wall_s=round(time.perf_counter() - t, 1),
                      step_losses={str(r["step"]): r["loss"] for r in rows if "loss" in r},
                      checkpoint_folder_bytes=du(ckpt))
        stages.append(record)
        write({"stages_done": [r["stage"] for r in stages]})
        print(json.dumps({k: record.get(k) for k in ("stage", "status", "layers", "step_losses", "stage_wall_s",
                                                      "checkpoint_folder_bytes", "error_tail")}), flush=True)
        return record

    refused = None
    if not args.skip_refusal:
        refused = stage("refused", args.refuse_layers, args.steps, [*save, f"train.checkpoint_every={args.steps}"])
        refused["refused_checkpoint_gib"] = round(2 * checkpoint_size(args.refuse_layers) / GiB, 1)
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
    reference = stage("reference", layers, args.steps, [])
    half = args.steps // 2
    stage("first", layers, half, [*save, f"train.checkpoint_every={half}"])
    resumed = stage("resumed", layers, args.steps, [*save, "train.resume=true"])
    after = [str(s) for s in range(half + 1, args.steps + 1)]
    ref_losses, res_losses = reference["step_losses"], resumed["step_losses"]
    summary = {
        "free_disk_gib": round(free / GiB, 1), "layers": layers, "params": params,
        "checkpoint_gib_planned": round(size / GiB, 2),
        "refused_at_start": None if refused is None else (
            refused["status"] != "ok" and not refused.get("step_losses")
            and any("not enough disk" in line for line in refused.get("error_tail", []))),
        "resumed_steps": after,
        "resumed_equal_bitwise": bool(after) and all(s in res_losses and s in ref_losses
                                                     and res_losses[s] == ref_losses[s] for s in after),
        "reference_losses": ref_losses, "resumed_losses": res_losses}
    print(json.dumps(summary), flush=True)
    write(summary, final=True)
    subprocess.run(["df", "-h", str(ckpt)])
    shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
