"""Measured GPU and host memory peaks next to the memory plan's prediction, one results file (issue 13).

    PYTHONPATH=. python experiments/plan_check.py --out $OUT/h100_plan_check.json

Each configuration runs in a fresh process, so that its host peak (ru_maxrss) is its own: a randomly
initialized model (built part by part, as experiments/bench.py does) trains on the demo corpus for a few
steps; the first step compiles, the later ones run ahead of the GPU as training does. Each run records
its whole engine config, preset, layers, rows and seq_len, the measured ``gpu_peak_gib`` (the device's
``peak_bytes_in_use``) and ``host_peak_gib`` (ru_maxrss), and what ``megatrain_jax.plan.plan``
predicts for that run on this machine. tests/test_memory_plan.py checks the plan against the file once it
is copied to tests/assets/measured/.

The GPU is given to XLA as megatrain_jax gives it (95%, through bench.py's import) unless the environment
says otherwise (``XLA_PYTHON_CLIENT_MEM_FRACTION``; the committed checks ran at 0.9, bench.py's setting then). About 7 minutes on the
H100 box (125 GiB of RAM), most of it building each model's state; ``--configs`` runs a subset.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import CONFIGS, BenchConfig  # noqa: E402  (the GPU's memory fraction as megatrain_jax sets it)
from child import git_commit, pick_configs, run_configs  # noqa: E402

from megatrain_jax import EngineConfig  # noqa: E402

# bench.py's configurations, plus long context: 3B at 128K tokens in one row (docs/design.md's 39.0 GiB).
CHECKS: dict[str, BenchConfig] = {
    "3p5b_32k_streamed": CONFIGS["3p5b_32k_streamed"],
    "3p5b_32k": CONFIGS["3p5b_32k_r8"],  # the layouts these checks were first run with (fixed resident counts)
    "7b_32k": CONFIGS["7b_32k_r14"],
    "3b_128k": BenchConfig("llama3.2-3b", None, 131072, 1, EngineConfig(micro_batches=1)),
}
# Shapes no earlier plan check measured, to test the plan's queue rule out of sample (issue 16): other
# sequence lengths, row splits, model widths. They were chosen while the plan counted 4 queued weights and 4
# queued gradients; the plan came out 15.7% over 3p5b_8k_streamed's peak, and now counts 3 queued blocks
# (plan.gpu_ledger.QUEUED_BLOCKS; experiments/studies/NOTES.md has the story).
HELD_OUT: dict[str, BenchConfig] = {
    "3b_16k": BenchConfig("llama3.2-3b", None, 16384, 1, EngineConfig(micro_batches=1)),
    "3b_8k_4x2k": BenchConfig("llama3.2-3b", None, 2048, 4, EngineConfig(micro_batches=2)),
    "1b_8k": BenchConfig("llama3.2-1b", None, 8192, 1, EngineConfig(micro_batches=1)),
    "3b_64k_kept": BenchConfig("llama3.2-3b", None, 65536, 1, EngineConfig(micro_batches=1, keep_residuals=True)),
    "3p5b_8k_streamed": BenchConfig("7b", 16, 2048, 4, EngineConfig(micro_batches=1)),
}
# And shapes chosen after the queue rule became 3 blocks and the chunked-MLP rules were added, to test those.
HELD_OUT_2: dict[str, BenchConfig] = {
    "3b_96k_kept": BenchConfig("llama3.2-3b", None, 98304, 1, EngineConfig(micro_batches=1, keep_residuals=True)),
    "1b_64k": BenchConfig("llama3.2-1b", None, 65536, 1, EngineConfig(micro_batches=1)),
    "3p5b_16k_streamed": BenchConfig("7b", 16, 2048, 8, EngineConfig(micro_batches=1)),
    "3b_24k_2rows": BenchConfig("llama3.2-3b", None, 12288, 2, EngineConfig(micro_batches=1)),
}
KNOWN = {**CONFIGS, **CHECKS, **HELD_OUT, **HELD_OUT_2}  # any of bench.py's configurations may be checked too


def record_plan(run: dict, p, **extra) -> None:
    """The plan's predicted peaks and breakdown next to the run's measured ones (``plan``, ``plan_error``)."""
    from megatrain_jax.plan import GiB
    run["plan"] = {"gpu_gib": round(p.gpu_total / GiB, 2), "host_gib": round(p.host_total / GiB, 2), **extra,
                   "gpu_peak_at": p.gpu_peak_at, "fits": p.fits, "gpu": {k: round(v / GiB, 3) for k, v in p.gpu.items()},
                   "host": {k: round(v / GiB, 3) for k, v in p.host.items()}}
    run["plan_error"] = {k: round((run["plan"][f"{k}_gib"] - run[f"{k}_peak_gib"]) / run[f"{k}_peak_gib"], 4)
                         for k in ("gpu", "host") if run.get(f"{k}_peak_gib")}


def measure(name: str, bc: BenchConfig, steps: int) -> dict:
    """Train ``steps`` steps of ``bc`` in this process; the run's record with the plan's prediction."""
    import jax
    from bench import device_info, gpu_peak_gib, host_peak_gib
    from flax import nnx

    from megatrain_jax import Decoder, Engine, default_optimizer
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens
    from megatrain_jax.plan import GiB, fit_host_pool, plan

    cfg = bc.model()
    fit_host_pool(cfg, bc.engine, bc.rows, bc.seq_len)  # as megatrain-jax train does, before the GPU starts
    run = {"system": "megatrain_jax", "config": name, "preset": bc.preset, "layers": cfg.layers,
           "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                     "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count()},
           "rows": bc.rows, "seq_len": bc.seq_len, "tokens_per_step": bc.rows * bc.seq_len,
           "engine": dataclasses.asdict(bc.engine), "compute_dtype": cfg.dtype, "device": device_info(),
           "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                  "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")}}
    stats = jax.devices()[0].memory_stats() or {}
    run["gpu_bytes_limit_gib"] = round(stats.get("bytes_limit", 0) / GiB, 2)
    try:
        t0 = time.perf_counter()
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        engine = Engine(abstract, default_optimizer(3e-4), bc.engine, seed=0)
        jax.block_until_ready(engine.state)
        run["init_s"] = round(time.perf_counter() - t0, 1)
        tokens = bc.rows * bc.seq_len
        toks, starts = demo_tokens(cfg.vocab_size, (steps + 1) * tokens * 2 + bc.seq_len + 1, seed=0)
        data = TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), bc.seq_len).batches(bc.rows)
        batches = (b for b, _ in zip(data, range(steps)))
        run["gpu_peak_gib_after_step"], run["losses"] = [], []
        for m in engine.steps(batches):  # metrics arrive one step late: the peak so far at that point
            run["gpu_peak_gib_after_step"].append(gpu_peak_gib())
            run["losses"].append(round(m["loss"], 4))
            print(f"[{name}] step {m['step']} loss {m['loss']:.4f} {m['step_time_s']:.2f}s gpu peak "
                  f"{gpu_peak_gib()} GiB host peak {host_peak_gib()} GiB", file=sys.stderr, flush=True)
        run["steps"] = steps
        run["status"] = "ok"
    except Exception as e:  # recorded, not hidden: the JSON says what failed
        import traceback
        traceback.print_exc()
        run["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
    run.update(gpu_peak_gib=gpu_peak_gib(), host_peak_gib=host_peak_gib())
    p = plan(cfg, bc.engine, bc.rows, bc.seq_len, host_ram_bytes=int(run["device"]["host_ram_gib"] * GiB),
             gpu_bytes=stats.get("bytes_limit"), detect=False)
    record_plan(run, p, host_pinned_arrays_gib=round(p.host_pinned / GiB, 2))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="path of the results JSON")
    ap.add_argument("--configs", default=",".join(CHECKS), help=f"comma-separated names from {sorted(KNOWN)}")
    ap.add_argument("--steps", type=int, default=2,
                    help="training steps per configuration: the first compiles, the second runs ahead of the GPU")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run one configuration in this process
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, KNOWN[args.child], args.steps)))
        return
    if not args.out:
        ap.error("--out is required")
    names = pick_configs(ap, args.configs, KNOWN)
    import jax  # the version only: this process never starts the GPU backend, the children do
    commit = git_commit()
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/plan_check.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
              "device": None, "runs": []}
    t_start = time.perf_counter()
    run_configs(__file__, names, ["--steps", str(args.steps)], args.timeout, result, args.out, lambda name, run: (
        f"{name}: {run['status']} in {run['wall_s']} s: GPU {run.get('gpu_peak_gib')} GiB (plan "
        f"{run.get('plan', {}).get('gpu_gib')}), host {run.get('host_peak_gib')} GiB (plan "
        f"{run.get('plan', {}).get('host_gib')})"))
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

if __name__ == "__main__":
    main()
