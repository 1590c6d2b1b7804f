"""Convergence of capacity mode (bfloat16 masters and Adam moments, stochastic rounding) against float32
masters: the same ~134M-parameter model, data and schedule, 500 steps on the demo corpus (issue 15).

    PYTHONPATH=. python experiments/studies/convergence.py --out $OUT/h100_convergence_capacity.json
    PYTHONPATH=. python experiments/studies/convergence.py --seeds 0,1,2 --jobs 6 --out $OUT/conv_seeds.json
    PYTHONPATH=. python experiments/studies/convergence.py --preset llama3.2-1b --data build/corpus/corpus.bin \
        --rows 4 --seq-len 2048 --steps 2000 --modes float32 --resident --out $OUT/conv_1b_float32.json
        # issue 35's 1B run, one mode a call (a device call's 10 minutes did not hold 2,000 steps of float32
        # masters updated on the host: --resident updates them on the GPU); then --modes q8, and one comparison:
    PYTHONPATH=. python experiments/studies/convergence.py --merge conv_1b_float32.json conv_1b_q8.json \
        --out conv_1b.json

(``--data``: a token file, e.g. from ``local_corpus.py``; the model takes its vocabulary.)

For each seed both runs go through ``fit`` with the same initialization, batches and AdamW schedule
(warm-up, cosine decay); the only difference is the host layout (``--modes``: float32 masters, capacity
mode, capacity mode with 8-bit moments and bfloat16 gradients). A seed sets both the
initialization and the data order. The results file records every step's loss, each run's final loss (the
mean of the last ``--tail`` steps, which evens out batch-to-batch noise), each seed's relative gap, and the
gap of the means over seeds. With ``--jobs`` above 1 the runs are child processes sharing the GPU (this
model leaves it mostly idle: a step is bound by per-op latency), each with a slice of its memory.
Runs on a GPU in a few minutes; on a CPU pass ``--steps`` and a smaller ``--rows`` to try it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from megatrain_jax import Decoder, EngineConfig, Hook, TrainConfig, fit, preset  # noqa: E402
from megatrain_jax.cli.run_config import OptimizerConfig  # noqa: E402
from megatrain_jax.data import DataConfig, TokenFile  # noqa: E402
from megatrain_jax.models.config import DecoderConfig  # noqa: E402

# A Llama-style ~134M model: 12 layers of width 768, a 32K vocabulary, bfloat16 compute.
MODEL = preset("tiny", vocab_size=32000, hidden=768, ffn=2048, layers=12, heads=12, kv_heads=12,
               dtype="bfloat16", max_positions=2048, loss_chunk_tokens=8192)
MODES = {"float32": EngineConfig(micro_batches=1), "capacity": EngineConfig(micro_batches=1, master_dtype="bfloat16"),
         # issue 35: capacity mode with 8-bit Adam moments and bfloat16 gradients in host memory
         "q8": EngineConfig(micro_batches=1, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")}
# Each mode's bar against float32 masters, on the mean final loss over seeds (issues 15 and 35).
BARS = {"capacity": 0.01, "q8": 0.015}


def model_config(args) -> DecoderConfig:
    """The 134M model on the demo corpus; with ``--preset`` that preset (bfloat16 compute), and with ``--data`` a
    token file's vocabulary (e.g. ``local_corpus.py``'s)."""
    cfg = MODEL if args.preset is None else preset(args.preset, dtype="bfloat16")
    if args.data:
        cfg = cfg.replace(vocab_size=TokenFile.open(args.data).vocab_size)
    return cfg


def engine_config(mode: str, cfg: DecoderConfig, resident: bool) -> EngineConfig:
    """``mode``'s engine; with ``resident`` (float32 only) every part kept and updated on the GPU: the same AdamW
    on the same float32 masters, without the host update's time (a reference that must fit a device call)."""
    if not resident:
        return MODES[mode]
    if mode != "float32":
        raise SystemExit(f"--resident keeps float32 masters on the GPU; mode {mode!r} updates on the host")
    return dataclasses.replace(MODES[mode], resident_layers=cfg.layers, resident_io=True)


def progress_hook(path: str, mode: str, seed: int, every: int = 100) -> Hook:
    """Every ``every`` steps, the losses so far to ``path`` (so that a run cut by a device call's time limit still
    says how far it got and how fast)."""
    losses, t0 = [], time.perf_counter()

    def write(m: dict, info) -> None:
        losses.append(round(float(m["loss"]), 5))
        if m["step"] % every == 0:
            with open(path, "w") as f:
                json.dump({"mode": mode, "seed": seed, "steps_done": m["step"], "elapsed_s": round(
                    time.perf_counter() - t0, 1), "losses": losses}, f)
    return Hook(write, every=1)


def train(mode: str, seed: int, steps: int, rows: int, seq_len: int, lr: float, cfg: DecoderConfig = MODEL,
          data_path: str | None = None, resident: bool = False, progress: str | None = None) -> dict:
    data = DataConfig(path=data_path, seq_len=seq_len, batch_size=rows, seed=seed,
                      demo_tokens=1 << 23).build(cfg.vocab_size)
    optimizer, _ = OptimizerConfig(lr=lr, warmup_steps=max(steps // 10, 1)).build(steps)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    t = time.perf_counter()
    engine = engine_config(mode, cfg, resident)
    history = fit(model, data, optimizer, train=TrainConfig(steps=steps, log_every=max(steps // 10, 1), seed=seed),
                  engine=engine, write_back=False,
                  hooks=[progress_hook(progress, mode, seed)] if progress else ())
    wall = time.perf_counter() - t
    if progress and os.path.exists(progress):
        os.remove(progress)  # the whole run's record follows
    losses = [round(float(x), 5) for x in history["loss"]]
    return {"system": "megatrain_jax", "mode": mode, "seed": seed, "engine": dataclasses.asdict(engine), "wall_s": round(wall, 1),
            "tokens_per_s": round(steps * rows * seq_len / wall, 1), "losses": losses,
            "finite": bool(np.all(np.isfinite(losses)))}


def run_children(runs: list[tuple[str, int]], args, jobs: int) -> list[dict]:
    """Each (mode, seed) in its own process, ``jobs`` at a time, sharing the GPU; their results in order."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(0.9 / jobs, 0.9):.3f}",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // jobs))}
    extra = (["--preset", args.preset] if args.preset else []) + (["--data", args.data] if args.data else [])
    base = [sys.executable, os.path.abspath(__file__), *extra, "--steps", str(args.steps), "--rows", str(args.rows),
            "--seq-len", str(args.seq_len), "--lr", str(args.lr)] + (["--resident"] if args.resident else [])
    outs = [f"{args.out}.{mode}.{seed}.part" for mode, seed in runs]
    pending = list(zip(runs, outs))
    running: list[subprocess.Popen] = []
    while pending or running:
        while pending and len(running) < jobs:
            (mode, seed), out = pending.pop(0)
            running.append(subprocess.Popen(base + ["--run", f"{mode}:{seed}", "--out", out], env=env))
        running[0].wait()
        done = running.pop(0)
        if done.returncode:
            raise SystemExit(f"a child failed (exit {done.returncode}): {done.args}")
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
        os.remove(out)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--tail", type=int, default=20, help="final loss = mean of the last this many steps")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (initialization and data order)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, as child processes sharing the GPU")
    ap.add_argument("--modes", default="float32,capacity", help=f"comma-separated, from {sorted(MODES)}; with "
                                                                 f"float32 among them, the others are compared with it")
    ap.add_argument("--preset", default=None, help="a model preset instead of the 134M model (e.g. llama3.2-1b)")
    ap.add_argument("--data", default=None, help="a token file (default: the demo corpus), e.g. from local_corpus.py")
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="no training: one comparison (to --out) from results "
                                                                 "files of separate runs, e.g. one mode each")
    ap.add_argument("--resident", action="store_true", help="float32 only: masters kept and updated on the GPU (the "
                                                               "same AdamW; for a reference that must run faster)")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a child: MODE:SEED, its run alone to --out
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out, args.tail)
        return
    if args.run:
        mode, seed = args.run.split(":")
        with open(args.out, "w") as f:
            json.dump(train(mode, int(seed), args.steps, args.rows, args.seq_len, args.lr, model_config(args),
                            args.data, args.resident, f"{args.out}.progress.json"), f)
        return
    repo = os.path.dirname(EXPERIMENTS)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    dev = jax.devices()[0]
    cfg = model_config(args)
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/convergence.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
              "device": {"name": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
                         "host_ram_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)},
              "model": {**{k: getattr(cfg, k) for k in ("vocab_size", "hidden", "ffn", "layers", "heads")},
                        "params": cfg.param_count(), "dtype": cfg.dtype, "preset": args.preset},
              "steps": args.steps, "tokens_per_step": args.rows * args.seq_len, "seq_len": args.seq_len,
              "optimizer": f"megatrain_jax.adamw lr {args.lr}, {max(args.steps // 10, 1)} warm-up steps, cosine to "
                           f"10%, wd 0.1, b2 0.95; clip 1.0",
              "data": (f"token file {args.data} ({TokenFile.open(args.data).tokens.size} tokens), the run's seed"
                       if args.data else "demo corpus (megatrain_jax.data.demo), 8M tokens, the run's seed"),
              "jobs": args.jobs, "runs": []}
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: any of {sorted(MODES)}; got {args.modes}")
    if args.resident and modes != ["float32"]:
        ap.error("--resident keeps float32 masters on the GPU: pass it with --modes float32 alone")
    todo = [(mode, seed) for seed in seeds for mode in modes]
    if args.jobs > 1:
        runs = run_children(todo, args, args.jobs)
    else:
        runs = [train(mode, seed, args.steps, args.rows, args.seq_len, args.lr, cfg, args.data, args.resident,
                      f"{args.out}.{mode}.{seed}.progress.json") for mode, seed in todo]
    summarize(result, runs, args.tail, args.out)


def summarize(result: dict, runs: list[dict], tail: int, out: str) -> None:
    """Each run's final loss (the mean of its last ``tail`` steps), each mode's mean over seeds and each mode's gap
    to float32 masters, into ``result``, written to ``out`` and printed."""
    result["tail"] = tail
    seeds = sorted({r["seed"] for r in runs})
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for run in runs:
        run["master_dtype"] = MODES[run["mode"]].master_dtype
        run["final_loss"] = round(float(np.mean(run["losses"][-tail:])), 5)
        result["runs"].append(run)
        print(f"{run['mode']} seed {run['seed']}: final loss {run['final_loss']} (mean of the last {tail}) "
              f"{run['tokens_per_s']} tok/s {run['wall_s']} s", flush=True)
    final = {(r["mode"], r["seed"]): r["final_loss"] for r in runs}
    means = {m: float(np.mean([final[m, s] for s in seeds])) for m in modes}
    result["mean_final_loss"] = {m: round(v, 5) for m, v in means.items()}
    compared = [m for m in modes if m != "float32"] if "float32" in modes else []  # each against float32
    for m in compared:
        result[f"{m}_vs_float32_by_seed"] = {
            str(s): round((final[m, s] - final["float32", s]) / final["float32", s], 5) for s in seeds}
        gap = (means[m] - means["float32"]) / means["float32"]
        result[f"{m}_vs_float32_final_loss"] = round(gap, 5)
        result[f"{m}_within_bar"] = {"bar": BARS[m], "met": abs(gap) <= BARS[m]}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for m in compared:
        print(f"{m} vs float32 final loss (means over seeds {seeds}): {result[f'{m}_vs_float32_final_loss']:+.4%} "
              f"(bar {BARS[m]:.1%}); by seed {result[f'{m}_vs_float32_by_seed']}")


# What results files must share to be one comparison (``merge``).
SETUP = ("model", "steps", "tokens_per_step", "seq_len", "optimizer", "data")


def merge(paths: list[str], out: str, tail: int) -> None:
    """One comparison from results files of the same model, data and schedule run separately (one mode per
    device call, say): their runs side by side, each file's header kept under ``parts``. Every mode needs a run
    for every seed, once; the final loss is over the last ``tail`` steps."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    for path, part in zip(paths[1:], parts[1:]):
        differ = [k for k in SETUP if part.get(k) != parts[0].get(k)]
        if differ:
            raise SystemExit(f"{path} differs from {paths[0]} in {differ}: not one comparison")
    runs = [{k: v for k, v in r.items() if k not in ("final_loss", "master_dtype")} for part in parts
            for r in part["runs"]]
    have = [(r["mode"], r["seed"]) for r in runs]
    twice = sorted({run for run in have if have.count(run) > 1})
    if twice:
        raise SystemExit(f"the files hold these (mode, seed) runs more than once: {twice}; merge one of each")
    missing = sorted({(m, s) for m, _ in have for _, s in have} - set(have))
    if missing:
        raise SystemExit(f"no run for these (mode, seed) pairs: {missing}; every mode needs every seed")
    result = {k: parts[0][k] for k in SETUP}
    result.update(name=os.path.splitext(os.path.basename(out))[0],
                  command="PYTHONPATH=. python experiments/studies/convergence.py " + " ".join(sys.argv[1:]),
                  parts=[{k: part.get(k) for k in ("name", "command", "git_commit", "date", "device")}
                         for part in parts],
                  runs=[])
    summarize(result, runs, tail, out)


if __name__ == "__main__":
    main()
