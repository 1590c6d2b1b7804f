"""Plain GPU training, the bar for models that fit on the GPU: the whole model, its float32 masters, gradients and
AdamW moments in GPU memory, one jitted step (``jax.value_and_grad`` + optax, exact global-norm clipping, buffers
donated), each block under ``jax.checkpoint``. Same model, data, optimizer and clipping as ``bench.py``'s configs;
each remat policy given is run and the fastest is the run's result ("at its best settings").

    PYTHONPATH=. python experiments/plain_gpu.py --configs 3p5b_8k --out $OUT/plain_gpu.json [--append]

Policies: ``nothing`` (every block recomputed in the backward, what the engine's streamed blocks do),
``dots`` (matrix products kept: ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``, what its
``kept_layers`` do), ``none`` (no remat: everything kept). A policy that runs out of GPU memory is recorded as
such. Each policy runs in a process of its own (its memory peaks are its own). Each run records where the
model lives (every parameter on the GPU, no PCIe traffic per step).
Dense models only (a routed block's statistics are not summed here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import CONFIGS, gpu_peak_gib, host_peak_gib  # noqa: E402
from child import pick_configs, results_header  # noqa: E402
from megatrain_jax import Batch, Decoder, default_optimizer  # noqa: E402
from megatrain_jax.data import TokenDataset, TokenFile  # noqa: E402
from megatrain_jax.data.demo import demo_tokens  # noqa: E402
from megatrain_jax.flops import model_flops_per_token  # noqa: E402
from megatrain_jax.loss import causal_lm_loss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "none": None}


def train_step(model: nnx.Module, tx: optax.GradientTransformation, policy: str):
    """The jitted step ``(params, opt_state, batch) -> (params, opt_state, loss, grad_norm)`` and the initial
    ``(params, opt_state)``; each block's call under ``jax.checkpoint`` with ``POLICIES[policy]`` (``none``: no
    remat)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch: Batch):
        m = nnx.merge(graphdef, params)
        x = m.io.embed(batch.inputs, batch.positions, batch.segment_ids)
        for block in m.blocks:
            bgd, bstate = nnx.split(block)
            call = lambda s, x: nnx.merge(bgd, s)(x, batch.positions, batch.segment_ids)  # noqa: E731
            if policy != "none":
                call = jax.checkpoint(call, policy=POLICIES[policy])
            x = call(bstate, x)
        logits = m.io.unembed(m.io.final_hidden(x))
        return causal_lm_loss(logits, batch.targets, batch.loss_mask)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm

    return jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params)


def run_policy(name: str, policy: str, warmup: int, timed: int) -> dict:
    bc = CONFIGS[name]
    cfg = bc.model()
    tokens_per_step = bc.rows * bc.seq_len
    run = {"system": "plain_jax_gpu", "config": name, "remat_policy": policy,
           "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                     "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count()},
           "seq_len": bc.seq_len, "tokens_per_step": tokens_per_step,
           "optimizer": "adamw(lr 3e-4, wd 0.1, b2 0.95), clip 1.0 (optax, on the GPU)",
           "compute_dtype": cfg.dtype, "master_dtype": "float32",
           "where_the_model_lives": {"gpu_resident_param_share": 1.0, "pcie_bytes_per_step": 0,
                                     "note": "masters, gradients and AdamW moments all in GPU memory"}}
    try:
        if cfg.moe is not None:
            raise ValueError("plain_gpu.py runs dense models only")
        t0 = time.perf_counter()
        tx = optax.chain(optax.clip_by_global_norm(1.0), default_optimizer(3e-4))
        step, params, opt_state = train_step(Decoder(cfg, rngs=nnx.Rngs(0)), tx, policy)
        jax.block_until_ready((params, opt_state))
        run["init_s"] = round(time.perf_counter() - t0, 2)
        toks, starts = demo_tokens(cfg.vocab_size, (warmup + timed) * tokens_per_step * 2 + bc.seq_len + 1, seed=0)
        data = iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), bc.seq_len).batches(bc.rows))
        losses, norms, times = [], [], []
        for _ in range(warmup + timed):
            batch = jax.device_put(next(data))
            t = time.perf_counter()
            params, opt_state, loss, norm = step(params, opt_state, batch)
            losses.append(float(loss))  # waits for the step
            norms.append(float(norm))
            times.append(time.perf_counter() - t)
        step_time = statistics.median(times[warmup:])
        fpt = model_flops_per_token(cfg.active_param_count(), cfg.layers, cfg.hidden, bc.seq_len)
        run.update(step_time_s=round(step_time, 4), tokens_per_s=round(tokens_per_step / step_time, 1),
                   model_tflops=round(tokens_per_step / step_time * fpt / 1e12, 1), steps_timed=timed,
                   step_times=[round(t, 4) for t in times], losses=[round(x, 4) for x in losses],
                   grad_norms=[round(x, 4) for x in norms], gpu_peak_gib=gpu_peak_gib(), host_peak_gib=host_peak_gib(),
                   status="ok", loss_finite_and_decreasing=bool(np.isfinite(losses).all() and losses[-1] < losses[0]))
    except Exception as e:  # recorded, not hidden (out of GPU memory for a policy is a result)
        run.update(status=f"error: {type(e).__name__}: {str(e)[:400]}", gpu_peak_gib=gpu_peak_gib())
    return run


def run_in_child(name: str, policy: str, warmup: int, timed: int) -> dict:
    """``run_policy`` in a process of its own, so that its GPU and host peaks are its own (and a policy that
    kills its process, out of memory, is recorded as such)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{name}:{policy}", "--warmup",
                           str(warmup), "--steps", str(timed), "--out", "-"], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"system": "plain_jax_gpu", "config": name, "remat_policy": policy,
            "status": f"error: the run's process ended with {proc.returncode}: {proc.stderr.strip()[-400:]}"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="3p5b_8k", help="comma-separated names of bench.py's configs")
    ap.add_argument("--policies", default="nothing,dots,none", help=f"remat policies, from {sorted(POLICIES)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--out", required=True)
    ap.add_argument("--append", action="store_true", help="add the runs to the results file at --out if it exists")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # CONFIG:POLICY, one run, printed as JSON
    args = ap.parse_args(argv)
    if args.child is not None:
        name, policy = args.child.split(":")
        run = run_policy(name, policy, args.warmup, args.steps)
        print(json.dumps(run))
        return run
    names, policies = pick_configs(ap, args.configs, CONFIGS), args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown remat policy {p!r}; known: {', '.join(POLICIES)}")
    result = {**results_header(args.out, __file__), "runs": []}
    if args.append and os.path.exists(args.out):  # another script's file: this command goes beside its own
        command = result["command"]
        with open(args.out) as f:
            result = json.load(f)
        if command not in result.get("commands", [result.get("command")]):
            result["commands"] = result.get("commands", [result.get("command")]) + [command]
            result["command"] = " && ".join(result["commands"])
    for name in names:
        tried = []
        for p in policies:
            tried.append(run_in_child(name, p, args.warmup, args.steps))
            print(f"plain_gpu {name} {p}: {tried[-1]['status']} {tried[-1].get('tokens_per_s')} tok/s", flush=True)
        ok = [r for r in tried if r["status"] == "ok"]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        for r in tried:
            r["best_of_policies"] = r is best
        result["runs"] += tried
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
