"""Long context on one GPU: batch 1 at growing lengths, with the memory plan's prediction next to each run
(issue 16). One results file.

    PYTHONPATH=. python experiments/long_context.py --configs 3b_8k,3b_32k,3b_128k --out $OUT/long.json

Each configuration runs in a fresh process, as ``megatrain-jax train`` would: the engine config is what
``plan.lean_engine`` picks on this machine from the defaults (activation offload and the lean host
layout when GPU or host memory is short), the pinned pool is fitted before JAX starts, then a randomly
initialized model trains on the demo corpus (one row of ``seq_len`` tokens per step). The record holds the
step times (each step synchronized: the loss read and the host updates done; the first includes
compiling the per-layer programs), tokens/s and model TFLOP/s of the median of the
later steps (of the first where only one ran), the GPU and host peaks, and the plan's predicted peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from child import git_commit, pick_configs, run_configs  # noqa: E402
from plan_check import record_plan  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LongConfig:
    preset: str
    seq_len: int
    steps: int  # the first compiles: timed figures come from the others where there are any
    mlp_chunk_tokens: int | None = None
    master_dtype: str = "float32"
    keep_residuals: bool = False  # keep attention's output and statistics for the backward (EngineConfig)


K = 1024
MAX_POSITIONS = 1024 * K  # so that the plan's longest length is the memory's bound, not the model's
CONFIGS = {
    "tiny_cpu": LongConfig("tiny", 256, 2),  # a smoke test (tests/test_experiments.py)
    "3b_8k": LongConfig("llama3.2-3b", 8 * K, 3),
    "3b_32k": LongConfig("llama3.2-3b", 32 * K, 3),
    "3b_128k": LongConfig("llama3.2-3b", 128 * K, 2),
    "3b_8k_kept": LongConfig("llama3.2-3b", 8 * K, 3, keep_residuals=True),
    "3b_32k_kept": LongConfig("llama3.2-3b", 32 * K, 3, keep_residuals=True),
    "3b_128k_kept": LongConfig("llama3.2-3b", 128 * K, 3, keep_residuals=True),
    "3b_256k_kept": LongConfig("llama3.2-3b", 256 * K, 2, mlp_chunk_tokens=32 * K, keep_residuals=True),
    "3b_256k": LongConfig("llama3.2-3b", 256 * K, 2, mlp_chunk_tokens=32 * K),
    "3b_512k": LongConfig("llama3.2-3b", 512 * K, 1, mlp_chunk_tokens=32 * K),
    "7b_256k": LongConfig("7b", 256 * K, 2, mlp_chunk_tokens=32 * K),
    "7b_256k_capacity": LongConfig("7b", 256 * K, 2, mlp_chunk_tokens=32 * K, master_dtype="bfloat16"),
}


def measure(name: str, lc: LongConfig) -> dict:
    # XLA's share of the GPU: megatrain_jax's (0.95, set when plan_check.py, imported above, imported bench.py),
    # unless the environment says otherwise; the committed runs before 2026-11-30 used 0.9, set here then
    from megatrain_jax import EngineConfig, preset
    from megatrain_jax._environment import physical_ram_bytes
    from megatrain_jax.plan import GiB, fit_host_pool, gpu_bytes_before_jax, lean_engine, longest_seq_len, plan

    cfg = preset(lc.preset, max_positions=MAX_POSITIONS, mlp_chunk_tokens=lc.mlp_chunk_tokens)
    engine_cfg, why = lean_engine(cfg, EngineConfig(master_dtype=lc.master_dtype, keep_residuals=lc.keep_residuals),
                                  1, lc.seq_len)
    fit_host_pool(cfg, engine_cfg, 1, lc.seq_len)
    import jax
    from bench import device_info, gpu_peak_gib, host_peak_gib
    from flax import nnx

    from megatrain_jax import Decoder, Engine, default_optimizer
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens
    from megatrain_jax.flops import model_flops_per_token

    run = {"system": "megatrain_jax", "config": name, "preset": lc.preset, "seq_len": lc.seq_len, "rows": 1,
           "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                     "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count(),
                     "mlp_chunk_tokens": cfg.mlp_chunk_tokens},
           "engine": dataclasses.asdict(engine_cfg), "engine_picked_by_plan": why, "master_dtype": lc.master_dtype,
           "device": device_info()}
    stats = jax.devices()[0].memory_stats() or {}
    try:
        t0 = time.perf_counter()
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        engine = Engine(abstract, default_optimizer(3e-4), engine_cfg, seed=0)
        jax.block_until_ready(engine.state)
        run["init_s"] = round(time.perf_counter() - t0, 1)
        toks, starts = demo_tokens(cfg.vocab_size, (lc.steps + 1) * lc.seq_len * 2 + lc.seq_len + 1, seed=0)
        data = TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), lc.seq_len).batches(1)
        records = []
        for b, _ in zip(data, range(lc.steps)):  # each step synchronized: at these lengths the overlap of
            t = time.perf_counter()              # one step's update with the next forward is negligible
            m = engine.step(b).resolve()
            engine.sync()
            m["step_time_s"] = time.perf_counter() - t
            records.append(m)
            print(f"[{name}] step {m['step']} loss {m['loss']:.4f} {m['step_time_s']:.2f}s gpu peak "
                  f"{gpu_peak_gib()} GiB host peak {host_peak_gib()} GiB", file=sys.stderr, flush=True)
        timed = records[1:] or records
        step = statistics.median(r["step_time_s"] for r in timed)
        fpt = model_flops_per_token(cfg.active_param_count(), cfg.layers, cfg.hidden, lc.seq_len)
        run.update(step_times=[round(r["step_time_s"], 2) for r in records], losses=[round(r["loss"], 4) for r in records],
                   steps_timed=len(timed), step_time_s=round(step, 2), first_step_includes_compile=len(records) == 1,
                   tokens_per_step=lc.seq_len, loss_first=timed[0]["loss"], loss_last=timed[-1]["loss"],
                   num_gpus=engine.placement.size,
                   tokens_per_s=round(lc.seq_len / step, 1), model_tflops=round(lc.seq_len / step * fpt / 1e12, 1),
                   loss_finite=bool(all(r["loss"] == r["loss"] and abs(r["loss"]) < float("inf") for r in records)),
                   status="ok")
    except Exception as e:  # recorded, not hidden
        import traceback
        traceback.print_exc()
        run["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
    run.update(gpu_peak_gib=gpu_peak_gib(), host_peak_gib=host_peak_gib())
    p = plan(cfg, engine_cfg, 1, lc.seq_len, host_ram_bytes=physical_ram_bytes(), gpu_bytes=stats.get("bytes_limit"),
             detect=False)
    record_plan(run, p, gpu_bytes_before_jax_gib=round((gpu_bytes_before_jax() or 0) / GiB, 2),
                longest_seq_len=longest_seq_len(p, multiple=8 * K))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="path of the results JSON (runs are added to it when it exists)")
    ap.add_argument("--configs", default="3b_8k,3b_32k,3b_128k", help=f"comma-separated names from {sorted(CONFIGS)}")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, CONFIGS[args.child])))
        return
    if not args.out:
        ap.error("--out is required")
    names = pick_configs(ap, args.configs, CONFIGS)
    import jax  # the version only: the children start the GPU
    result = {"name": os.path.splitext(os.path.basename(args.out))[0], "command": [], "git_commit": git_commit(),
              "date": datetime.date.today().isoformat(), "jax_version": jax.__version__, "device": None, "runs": []}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result["command"].append("PYTHONPATH=. python experiments/long_context.py " + " ".join(sys.argv[1:]))
    run_configs(__file__, names, [], args.timeout, result, args.out, lambda name, run: (
        f"{name}: {run['status']} step {run.get('step_time_s')} s, {run.get('model_tflops')} TFLOP/s, GPU "
        f"{run.get('gpu_peak_gib')} GiB (plan {run.get('plan', {}).get('gpu_gib')}), host "
        f"{run.get('host_peak_gib')} GiB (plan {run.get('plan', {}).get('host_gib')}), engine "
        f"{run.get('engine_picked_by_plan')}"))

if __name__ == "__main__":
    main()
