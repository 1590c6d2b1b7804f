"""Convergence of capacity mode (bfloat16 masters and Adam moments, stochastic rounding) against float32
masters: the same ~134M-parameter model, data and schedule, 500 steps on the demo corpus (issue 15).

    PYTHONPATH=. python experiments/studies/convergence.py --out $OUT/h100_convergence_capacity.json
    PYTHONPATH=. python experiments/studies/convergence.py --seeds 0,1,2 --jobs 6 --out $OUT/conv_seeds.json
    PYTHONPATH=. python experiments/studies/convergence.py --preset llama3.2-1b --data build/corpus/corpus.bin \
        --rows 4 --seq-len 2048 --steps 2000 --modes float32 --resident --out $OUT/conv_1b_float32.json
        # issue 35's 1B run, one mode a call (--resident: float32 masters updated on the GPU, ~5 min on an H200)
    PYTHONPATH=. python experiments/studies/convergence.py --preset llama3.2-1b --data build/corpus/corpus.bin \
        --rows 4 --seq-len 2048 --steps 2000 --modes q8 --checkpoint-dir build/conv_ckpt --stop-after-s 500 \
        --out build/conv/conv_1b_q8.json
        # the 8-bit mode updates on the host (~0.48 s a step on an H200 of a 64-core host: 2,000 steps are longer
        # than a device call): it stops after 500 s with its checkpoint and progress saved (exit status 3); the
        # same command, run again, continues it bit for bit; then one comparison:
    PYTHONPATH=. python experiments/studies/convergence.py --merge conv_1b_float32.json conv_1b_q8.json \
        --out conv_1b.json

Issue 52's quality table (1B, 2,000 steps, 3 seeds, every mode through the host update, the held-out loss
after the last step on 32 batches of the data's last 2%): one mode and seed a run, cut and continued as above
where a run is longer than a call, then one ``--merge`` of the twelve files:

    PYTHONPATH=. python experiments/studies/convergence.py --preset llama3.2-1b --data build/corpus/corpus.bin \
        --rows 4 --seq-len 2048 --steps 2000 --modes float32 --seeds 0 --eval-fraction 0.02 --eval-batches 32 \
        --checkpoint-dir build/conv_ckpt --stop-after-s 480 --out build/conv/conv_1b_float32_0.json

(``--data``: a token file, e.g. from ``local_corpus.py``; the model takes its vocabulary.) Several runs at once, one
per GPU, each longer than a device call: ``studies/quality_table.sh`` (``JOBS="float32:0 q8:0" ... start``, then
``poll``).

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
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from megatrain_jax import Decoder, EngineConfig, Hook, TrainConfig, fit, preset  # noqa: E402
from megatrain_jax.checkpoint import CheckpointedExit, committed_steps  # noqa: E402
from megatrain_jax.cli.run_config import OptimizerConfig  # noqa: E402
from megatrain_jax.data import DataConfig, TokenFile  # noqa: E402
from megatrain_jax.evaluate import eval_hook  # noqa: E402
from megatrain_jax.models.config import DecoderConfig  # noqa: E402

# A Llama-style ~134M model: 12 layers of width 768, a 32K vocabulary, bfloat16 compute.
MODEL = preset("tiny", vocab_size=32000, hidden=768, ffn=2048, layers=12, heads=12, kv_heads=12,
               dtype="bfloat16", max_positions=2048, loss_chunk_tokens=8192)
# float32 updates each part in one pass (split_parts=0), as the other modes do (they never split): the same numbers
# as the split update (tests/test_engine.py), ~30 host bytes a parameter against ~46, so a 1B run on a 16-core
# host takes ~0.43 s a step against ~0.48 by the step-time model, and two to a GPU fit one session.
MODES = {"float32": EngineConfig(micro_batches=1, split_parts=0),
         "capacity": EngineConfig(micro_batches=1, master_dtype="bfloat16"),
         # issue 35: capacity mode with 8-bit Adam moments and bfloat16 gradients in host memory
         "q8": EngineConfig(micro_batches=1, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16"),
         # issue 52: 7-bit m with 5-bit v (4-bit moments, +3.2%, and 8-bit m with 4-bit v, +1.6%, ran here
         # before they were removed for missing the bar: conv_1b_quality_6291c89.json, q4_moment_grids.py)
         "m7v5": EngineConfig(micro_batches=1, master_dtype="bfloat16", moment_dtype="m7v5",
                              host_grad_dtype="bfloat16")}
# Each mode's bar against float32 masters, on the mean final loss over seeds (issues 15 and 35), and on the mean
# held-out loss where the runs have one (issue 52: 1.5% for every lossy mode).
BARS = {"capacity": 0.01, "q8": 0.015, "m7v5": 0.015}
EVAL_BARS = {"capacity": 0.015, "q8": 0.015, "m7v5": 0.015}


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


def progress_hook(path: str, mode: str, seed: int, every: int = 100, header: dict | None = None,
                  stop_after_s: float | None = None, prior: dict | None = None) -> Hook:
    """Every ``every`` steps, the losses so far to ``path`` (so that a run cut by a device call's time limit still
    says how far it got and how fast), under ``header`` (the results file's setup: a cut run can be merged, and a
    resumed one is checked against it). ``prior``: the progress file a resumed run continues (``read_progress``);
    the step the run resumes after decides how many of its losses are kept. With ``stop_after_s``, the run stops
    once that many seconds have passed (the step in flight finishes; its checkpoint is saved)."""
    prior = prior or {"losses": [], "elapsed_s": 0.0}
    losses, t0 = list(prior["losses"]), time.perf_counter()
    state = {"trained": 0, "elapsed": float(prior["elapsed_s"]), "held_out": prior.get("held_out")}

    def write(m: dict, info) -> None:
        if not state["trained"]:
            done = m["step"] - 1  # the step a resumed run's checkpoint holds (0: a fresh start)
            if done > len(losses):  # (train checks this before fit: here only if fit resumed further than it found)
                raise SystemExit(f"{path} holds the losses of {len(losses)} steps, but the run resumed after step "
                                 f"{done}: the losses between are lost")
            del losses[done:]
            if done == 0:
                state["elapsed"] = 0.0  # a fresh start: an old file's time is not this run's
        state["trained"] += 1
        losses.append(round(float(m["loss"]), 5))
        if "eval_loss" in m:  # the held-out loss after this step (eval_hook, before this hook)
            state["held_out"] = {"after_step": m["step"], "loss": round(float(m["eval_loss"]), 5),
                             "tokens": m["eval_tokens"]}
        if m["step"] % every == 0:
            flush()
        if stop_after_s is not None and info is not None and time.perf_counter() - t0 > stop_after_s:
            info.stop(f"--stop-after-s {stop_after_s:g}")

    def flush() -> dict:
        """The losses so far, written now; returns the record. A call that trained nothing (the run was done)
        adds no time."""
        elapsed = state["elapsed"] + (time.perf_counter() - t0 if state["trained"] else 0.0)
        return write_progress(path, mode, seed, len(losses), elapsed, losses, header, state["held_out"])

    hook = Hook(write, every=1)
    hook.flush = flush
    return hook


# What a resumed run must share with the run it continues (and ``merge``'s files with each other).
SETUP = ("model", "steps", "tokens_per_step", "seq_len", "optimizer", "data", "eval")
OPTIONAL = ("eval",)  # setup written only since issue 52: a file without it had no held-out split
RESUME = (*SETUP, "resident")


def read_progress(path: str, mode: str, seed: int, header: dict | None) -> dict | None:
    """The progress file a cut run left at ``path``, checked to be this run's (None: there is none)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        got = json.load(f)
    if (got.get("mode"), got.get("seed")) != (mode, seed):
        raise SystemExit(f"{path} is the progress of mode {got.get('mode')!r} seed {got.get('seed')!r}, not {mode!r} "
                         f"seed {seed}: give this run another --out")
    if header is not None:
        differ = [k for k in RESUME if got.get(k) != header.get(k)]
        if differ:
            raise SystemExit(f"{path} is the progress of a run with another setup (it differs in {differ}): give this "
                             f"run another --out and --checkpoint-dir, or delete that file and the run's checkpoints")
    return got


def write_progress(path: str, mode: str, seed: int, steps: int, elapsed: float, losses: list, header: dict | None,
                   evaluated: dict | None = None):
    record = {**(header or {}), "mode": mode, "seed": seed, "steps_done": steps, "elapsed_s": round(elapsed, 1),
              "losses": losses}
    if evaluated is not None:
        record["held_out"] = evaluated  # the held-out loss after the last step
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return record


class Cut(Exception):
    """A run stopped by ``--stop-after-s`` or a signal: its checkpoint and progress file are kept for the same
    command."""


def train(mode: str, seed: int, steps: int, rows: int, seq_len: int, lr: float, cfg: DecoderConfig = MODEL,
          data_path: str | None = None, resident: bool = False, progress: str | None = None,
          checkpoint_dir: str | None = None, stop_after_s: float | None = None, header: dict | None = None,
          eval_fraction: float = 0.0, eval_batches: int = 32) -> dict:
    """One run. With ``eval_fraction`` the last share of the data is held out, and the loss on its first
    ``eval_batches`` batches is taken after the last step (``eval_loss``). ``progress``: the file of its losses so far. With ``checkpoint_dir`` it saves its state there when
    it ends or stops (and every 500 steps) and resumes from it, continuing the losses of ``progress`` (whose
    setup must equal ``header``'s); with ``stop_after_s`` it stops after that many seconds and raises ``Cut`` (the
    same call continues it). A run that was finished trains nothing and returns its record again."""
    if (checkpoint_dir or stop_after_s is not None) and not (progress and checkpoint_dir):
        raise ValueError("a run that stops and resumes needs a checkpoint_dir and a progress file")
    data_cfg = DataConfig(path=data_path, seq_len=seq_len, batch_size=rows, seed=seed, demo_tokens=1 << 23,
                          eval_fraction=eval_fraction)
    data = data_cfg.build(cfg.vocab_size)
    held_out = list(itertools.islice(data_cfg.build_eval(cfg.vocab_size), eval_batches)) if eval_fraction else []
    evaluated: dict = {}
    optimizer, _ = OptimizerConfig(lr=lr, warmup_steps=max(steps // 10, 1)).build(steps)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    engine = engine_config(mode, cfg, resident)
    t = time.perf_counter()
    ckpt, prior = {}, None
    if checkpoint_dir:
        ckpt = dict(checkpoint_dir=os.path.join(checkpoint_dir, f"{mode}.{seed}"), checkpoint_every=500,
                    checkpoint_keep=1, resume=True)
        prior = read_progress(progress, mode, seed, header)
        saved = committed_steps(Path(ckpt["checkpoint_dir"]))
        kept = len(prior["losses"]) if prior else 0
        if saved and saved[0] > kept:  # checked before fit: a failure inside it would save over the checkpoint
            raise SystemExit(f"{ckpt['checkpoint_dir']} holds step {saved[0]}, but {progress} has the losses of "
                             f"{kept} steps: the losses between are lost. Delete that checkpoint folder to start "
                             f"again, or give the --out of the run that made it")
    hook = progress_hook(progress, mode, seed, header=header, stop_after_s=stop_after_s,
                         prior=prior) if progress else None
    hooks = [eval_hook(held_out, every=steps, total_steps=steps)] if held_out else []
    hooks += [Hook(lambda m, info: evaluated.update(m) if "eval_loss" in m else None, every=1)]
    try:
        history = fit(model, data, optimizer,
                      train=TrainConfig(steps=steps, log_every=max(steps // 10, 1), seed=seed, **ckpt),
                      engine=engine, write_back=False, hooks=hooks + ([hook] if hook else []))
    except CheckpointedExit:  # a signal: the step in flight finished and was saved; so are its losses
        hook.flush()
        raise
    if hook:
        record = hook.flush()
        if record["steps_done"] < steps:
            raise Cut(f"{mode} seed {seed}: stopped after step {record['steps_done']} of {steps} "
                      f"({history.stopped or 'the data ran out'}); the same command continues it from "
                      f"{ckpt.get('checkpoint_dir')}")
        losses, wall = record["losses"], record["elapsed_s"]
        held = record.get("held_out")  # (a run finished in an earlier call evaluated then)
    else:
        losses, wall = [round(float(x), 5) for x in history["loss"]], time.perf_counter() - t
        held = None
    if evaluated:
        held = {"after_step": evaluated["step"], "loss": round(float(evaluated["eval_loss"]), 5),
                "tokens": evaluated["eval_tokens"]}
    if eval_fraction and (held is None or held["after_step"] != steps):
        raise SystemExit(f"{mode} seed {seed}: no held-out loss after step {steps} (got {held})")
    if len(losses) != steps:
        raise SystemExit(f"{mode} seed {seed}: {len(losses)} losses for {steps} steps")
    if progress and os.path.exists(progress) and not checkpoint_dir:
        os.remove(progress)  # the whole run's record follows (with checkpoints it stays: a rerun finds it done)
    return {"system": "megatrain_jax", "mode": mode, "seed": seed, "engine": dataclasses.asdict(engine),
            "wall_s": round(wall, 1), "tokens_per_s": round(steps * rows * seq_len / max(wall, 1e-9), 1),
            "losses": losses, "finite": bool(np.all(np.isfinite(losses))),
            **({"eval_loss": held["loss"], "eval_tokens": held["tokens"]} if held else {})}


def run_children(runs: list[tuple[str, int]], args, jobs: int) -> list[dict]:
    """Each (mode, seed) in its own process, ``jobs`` at a time, sharing the GPU; their results in order. A child
    cut by ``--stop-after-s`` (exit status 3) leaves its checkpoint and progress file; any other failure stops the
    others."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(0.9 / jobs, 0.9):.3f}",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // jobs))}
    extra = (["--preset", args.preset] if args.preset else []) + (["--data", args.data] if args.data else [])
    base = [sys.executable, os.path.abspath(__file__), *extra, "--steps", str(args.steps), "--rows", str(args.rows),
            "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--eval-fraction", str(args.eval_fraction),
            "--eval-batches", str(args.eval_batches)] + (["--resident"] if args.resident else [])
    base += (["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else []) + (
        ["--stop-after-s", str(args.stop_after_s)] if args.stop_after_s is not None else [])
    outs = [f"{args.out}.{mode}.{seed}.part" for mode, seed in runs]
    pending = list(zip(runs, outs))
    running: list[subprocess.Popen] = []
    cut = False
    try:
        while pending or running:
            while pending and len(running) < jobs:
                (mode, seed), out = pending.pop(0)
                running.append(subprocess.Popen(base + ["--run", f"{mode}:{seed}", "--out", out], env=env))
            running[0].wait()
            done = running.pop(0)
            if done.returncode == 3:
                cut = True  # its progress and checkpoint wait for the same command
            elif done.returncode:
                raise SystemExit(f"a child failed (exit {done.returncode}): {done.args}")
    finally:
        for child in running:  # a failure: the others stop too (their checkpoints are saved on SIGTERM)
            child.terminate()
            child.wait()
    if cut:
        print("cut: some runs stopped (--stop-after-s); the same command continues them", flush=True)
        raise SystemExit(3)
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
        os.remove(out)
    return results


def header(args, cfg: DecoderConfig) -> dict:
    """The results file's head: what ran, where, and the setup (``SETUP``) a comparison and a resume check."""
    repo = os.path.dirname(EXPERIMENTS)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    dev = jax.devices()[0]
    return {"name": os.path.splitext(os.path.basename(args.out))[0],
            "command": "PYTHONPATH=. python experiments/studies/convergence.py " + " ".join(sys.argv[1:]),
            "git_commit": commit, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
            "device": {"name": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
                       "host_ram_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
                       # what this process had of the machine (quality_table.sh runs several at once, each on
                       # its slice of the cores and share of a GPU): the command line above does not say
                       "cores_used": len(os.sched_getaffinity(0)), "host_cores": os.cpu_count(),
                       "gpu_memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
            "model": {**{k: getattr(cfg, k) for k in ("vocab_size", "hidden", "ffn", "layers", "heads")},
                      "params": cfg.param_count(), "dtype": cfg.dtype, "preset": args.preset},
            "steps": args.steps, "tokens_per_step": args.rows * args.seq_len, "seq_len": args.seq_len,
            "optimizer": f"megatrain_jax.adamw lr {args.lr}, {max(args.steps // 10, 1)} warm-up steps, cosine to "
                         f"10%, wd 0.1, b2 0.95; clip 1.0",
            "data": (f"token file {args.data} ({TokenFile.open(args.data).tokens.size} tokens), the run's seed"
                     if args.data else "demo corpus (megatrain_jax.data.demo), 8M tokens, the run's seed"),
            "eval": ({"fraction": args.eval_fraction, "batches": args.eval_batches,
                      "tokens": args.eval_batches * args.rows * args.seq_len} if args.eval_fraction else None),
            "resident": args.resident, "jobs": args.jobs}


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
    ap.add_argument("--setup-from", metavar="FILE", help="with --merge: the setup of a progress file written without "
                    "one (before commit 336a4b6), taken from FILE (a results file of the same command but its mode)")
    ap.add_argument("--eval-fraction", type=float, default=0.0, help="hold out this last share of the data and take "
                    "each run's loss on it after the last step (issue 52's quality table: 0.01)")
    ap.add_argument("--eval-batches", type=int, default=32, help="held-out batches evaluated (rows x seq-len tokens each)")
    ap.add_argument("--resident", action="store_true", help="float32 only: masters kept and updated on the GPU (the "
                                                               "same AdamW; for a reference that must run faster)")
    ap.add_argument("--checkpoint-dir", help="each run saves its state under this folder (one folder per mode and "
                    "seed) when it ends or is stopped, and every 500 steps, and resumes from it: with --stop-after-s, "
                    "a run longer than a device call goes on in the next call with the same command (its losses so "
                    "far are in OUT.MODE.SEED.progress.json)")
    ap.add_argument("--stop-after-s", type=float, help="stop each run after this many seconds of its own (exit status "
                    "3), its checkpoint saved: run the same command again to continue. Per run: runs one after "
                    "another (several modes or seeds, fewer --jobs than runs) take a multiple of it. Needs "
                    "--checkpoint-dir")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a child: MODE:SEED, its run alone to --out
    args = ap.parse_args()
    if args.stop_after_s is not None and not args.checkpoint_dir:
        ap.error("--stop-after-s stops a run to continue it later: give --checkpoint-dir too (without it, the same "
                 "command would start again and stop at the same step)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.merge:
        merge(args.merge, args.out, args.tail, args.setup_from)
        return
    cfg = model_config(args)
    if args.run:  # a child of run_children: its progress file is the one a run in the parent would write
        mode, seed = args.run.split(":")
        parent = args.out.removesuffix(".part")
        head = header(argparse.Namespace(**{**vars(args), "out": parent.rsplit(".", 2)[0]}), cfg)
        run = cut_or(lambda: train(mode, int(seed), args.steps, args.rows, args.seq_len, args.lr, cfg, args.data,
                                   args.resident, f"{parent}.progress.json", args.checkpoint_dir, args.stop_after_s,
                                   head, args.eval_fraction, args.eval_batches))
        with open(args.out, "w") as f:
            json.dump(run, f)
        return
    result = {**header(args, cfg), "runs": []}
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
        head = {k: v for k, v in result.items() if k != "runs"}
        runs = [cut_or(lambda mode=mode, seed=seed: train(
            mode, seed, args.steps, args.rows, args.seq_len, args.lr, cfg, args.data, args.resident,
            f"{args.out}.{mode}.{seed}.progress.json", args.checkpoint_dir, args.stop_after_s, head,
            args.eval_fraction, args.eval_batches))
            for mode, seed in todo]
    summarize(result, runs, args.tail, args.out)


def cut_or(run: Callable[[], dict]) -> dict:
    """``run()``, or exit status 3 with its message when ``--stop-after-s`` cut it."""
    try:
        return run()
    except Cut as cut:
        print(f"cut: {cut}", flush=True)
        raise SystemExit(3) from None


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
        result[f"{m}_within_bar"] = {"bar": BARS[m], "met": abs(gap) <= BARS[m]} if "compared_steps" not in result \
            else {"bar": BARS[m], "met": None, "why": f"compared after {result['compared_steps']} of {result['steps']} "
                  f"steps: the bar is for the schedule's end"}
    if runs and all("eval_loss" in r for r in runs):  # the held-out loss: per seed, mean and spread over seeds
        held = {(r["mode"], r["seed"]): r["eval_loss"] for r in runs}
        result["mean_eval_loss"] = {m: round(float(np.mean([held[m, s] for s in seeds])), 5) for m in modes}
        for m in compared:
            by_seed = {s: (held[m, s] - held["float32", s]) / held["float32", s] for s in seeds}
            gap = (result["mean_eval_loss"][m] - result["mean_eval_loss"]["float32"]) / result["mean_eval_loss"]["float32"]
            result[f"{m}_vs_float32_eval_loss"] = {
                "mean_gap": round(gap, 5), "by_seed": {str(s): round(g, 5) for s, g in by_seed.items()},
                "seed_spread": round(max(by_seed.values()) - min(by_seed.values()), 5),
                "bar": EVAL_BARS[m], "met": abs(gap) <= EVAL_BARS[m]}
            print(f"{m} vs float32 held-out loss (means over seeds {seeds}): {gap:+.4%} (bar {EVAL_BARS[m]:.1%}); "
                  f"by seed {result[f'{m}_vs_float32_eval_loss']['by_seed']}", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for m in compared:
        print(f"{m} vs float32 final loss (means over seeds {seeds}): {result[f'{m}_vs_float32_final_loss']:+.4%} "
              f"(bar {BARS[m]:.1%}); by seed {result[f'{m}_vs_float32_by_seed']}")


def merge(paths: list[str], out: str, tail: int, setup_from: str | None = None) -> None:
    """One comparison from results files of the same model, data and schedule run separately (one mode per
    device call, say): their runs side by side, each file's header kept under ``parts``. Every mode needs a run
    for every seed, once; the final loss is over the last ``tail`` steps. A run's progress file (a run cut short,
    written with its setup) may stand for its results file: then every run is compared over the steps all of
    them reached (``compared_steps``), which is a point inside the schedule, not its end. A progress file written
    before it carried its setup takes ``setup_from``'s (a results file of the same command but its mode), recorded
    as such: the caller vouches for it."""
    parts = []
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        if "runs" not in part and "steps_done" in part:  # a progress file: one run, cut after steps_done steps
            if any(k not in part for k in SETUP if k not in OPTIONAL):
                if setup_from is None:
                    raise SystemExit(f"{path} is a progress file without its run's setup (written before the setup "
                                     f"was recorded in it): it cannot be checked against {paths[0]}; --setup-from "
                                     f"FILE gives it FILE's, if you know it ran the same command but its mode")
                with open(setup_from) as f:
                    given = json.load(f)
                part = {**{k: given.get(k) for k in SETUP}, "name": os.path.basename(path), "command": None,
                        "setup_from": setup_from, **part}
            tokens = part["steps_done"] * part["tokens_per_step"]
            part = {**{k: v for k, v in part.items() if k not in ("mode", "seed", "losses", "elapsed_s", "steps_done")},
                    "runs": [{"system": "megatrain_jax", "mode": part["mode"], "seed": part["seed"],
                              "losses": part["losses"], "wall_s": part["elapsed_s"], "cut_after_step":
                              part["steps_done"], "tokens_per_s": round(tokens / max(part["elapsed_s"], 1e-9), 1),
                              "finite": bool(np.all(np.isfinite(part["losses"])))}]}
        parts.append(part)
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
    result = {k: parts[0].get(k) for k in SETUP}
    result.update(name=os.path.splitext(os.path.basename(out))[0],
                  command="PYTHONPATH=. python experiments/studies/convergence.py " + " ".join(sys.argv[1:]),
                  parts=[{k: part.get(k) for k in ("name", "command", "git_commit", "date", "device", "setup_from")
                          if k in part or k != "setup_from"}
                         for part in parts],
                  runs=[])
    for k in ("git_commit", "device", "date"):  # the schema's head: the first part's that has it (each is in parts)
        result[k] = next((part[k] for part in parts if part.get(k)), None)
    reached = min(len(r["losses"]) for r in runs)
    if reached < result["steps"]:
        if reached < tail:
            raise SystemExit(f"a run was cut after {reached} steps, fewer than --tail {tail}: nothing to compare")
        result["compared_steps"] = reached
        for r in runs:
            r["steps_run"] = len(r["losses"])
            r["losses"] = r["losses"][:reached]
        print(f"compared over the first {reached} of {result['steps']} steps (a run was cut there)", flush=True)
    summarize(result, runs, tail, out)


if __name__ == "__main__":
    main()
