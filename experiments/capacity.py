"""Capacity: the largest models that train on this machine, with float32 masters and Adam moments, and in
capacity mode (bfloat16 masters and moments, stochastically rounded) (issue 15).

    PYTHONPATH=. python experiments/capacity.py --configs 8b_fp32,largest_fp32 --out $OUT/h100_capacity.json

Each configuration runs in a fresh process, so that its host peak (ru_maxrss) is its own, and goes through
the memory plan as ``megatrain-jax train`` does: ``lean_engine`` on this machine's MemAvailable (float32
streamed at full precision, and the fewest parts' gradients waiting on the GPU), then ``fit_host_pool`` before JAX starts. Then
experiments/bench.py's ``run_config`` trains a randomly initialized model on the demo corpus and times it.

``largest_*`` configurations search the most layers of their shape whose lean plan fits this host
(MemAvailable) and GPU (``plan.gpu_bytes_before_jax``: nvidia-smi's memory times the XLA fraction), and train that.
Each run records master_dtype, the machine's host_ram_gib and MemAvailable, the engine config that ran, the
plan's host and GPU totals next to the measured peaks, tokens/s, model TFLOP/s and the losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import BenchConfig  # noqa: E402  (the GPU's memory fraction as megatrain_jax sets it: 0.95)
from child import git_commit, pick_configs, run_configs  # noqa: E402

from megatrain_jax import EngineConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class CapacityConfig:
    bench: BenchConfig
    search_layers: tuple[int, int] | None = None  # (fewest, most): train the most that the plan fits


CONFIGS: dict[str, CapacityConfig] = {
    # Llama-3-8B (8.03 B) at 32K tokens per step; 8 blocks GPU-resident (updated there, faster), the rest
    # as the plan picks on this host.
    "8b_fp32": CapacityConfig(BenchConfig("8b", None, 2048, 16, EngineConfig(micro_batches=2, resident_layers=8))),
    # Llama-3-8B's shape with as many layers as fit: io GPU-resident, so that the gradient that comes home
    # last is one block's, not the 1 B-parameter io part's.
    "largest_fp32": CapacityConfig(BenchConfig("8b", None, 2048, 16, EngineConfig(micro_batches=4, resident_io=True)),
                                   search_layers=(32, 48)),
    # Capacity mode (bfloat16 masters and moments, stochastic rounding): Qwen2.5-14B (14.8 B) at 32K tokens.
    "14b_capacity": CapacityConfig(BenchConfig("14b", None, 2048, 16,
                                               EngineConfig(micro_batches=2, master_dtype="bfloat16"))),
    # Qwen2.5-14B's shape with as many layers as fit in capacity mode.
    "largest_capacity": CapacityConfig(BenchConfig("14b", None, 2048, 16,
                                                   EngineConfig(micro_batches=4, master_dtype="bfloat16")),
                                       search_layers=(48, 96)),
}


def mem_available_bytes() -> int:
    from megatrain_jax.plan import available_host_bytes
    return available_host_bytes()


def choose(cc: CapacityConfig, host: int, gpu: int | None) -> tuple[BenchConfig, str | None, dict]:
    """The configuration to train: the lean engine config the plan picks, and for a search the most layers
    whose lean plan fits; with the plan's numbers."""
    from megatrain_jax.plan import LEAN_HOST_MARGIN, GiB, lean_engine, plan

    bc = cc.bench
    candidates = [bc.layers] if cc.search_layers is None else range(cc.search_layers[1], cc.search_layers[0] - 1, -1)
    for layers in candidates:
        cfg = dataclasses.replace(bc, layers=layers).model()
        engine, lean = lean_engine(cfg, bc.engine, bc.rows, bc.seq_len, host_ram_bytes=host, gpu_bytes=gpu)
        p = plan(cfg, engine, bc.rows, bc.seq_len, host_ram_bytes=host, gpu_bytes=gpu, detect=False)
        # the host margin the lean pick leaves, and 5% of the GPU (the plan has come out up to 5% over or under)
        with_margin = p.replace(host_ram_bytes=int(host * (1 - LEAN_HOST_MARGIN)),
                                gpu_bytes=None if gpu is None else int(gpu * 0.95)).fits
        if with_margin or cc.search_layers is None:
            searched = {} if cc.search_layers is None else {"layers_searched": list(cc.search_layers),
                                                            "layers_chosen": layers}
            return dataclasses.replace(bc, layers=layers, engine=engine), lean, {
                "fits": p.fits, "host_gib": round(p.host_total / GiB, 2), "gpu_gib": round(p.gpu_total / GiB, 2),
                "gpu_peak_at": p.gpu_peak_at, "host_bytes_per_param": round(p.host_total / p.params, 2),
                "host_bytes_per_param_by_mode": {k: round(v, 2) for k, v in p.host_bytes_per_param().items()},
                "host": {k: round(v / GiB, 3) for k, v in p.host.items()}, **searched}
    raise SystemExit(f"no layer count in {cc.search_layers} fits")


def measure(name: str, cc: CapacityConfig, warmup: int, steps: int) -> dict:
    """Plan, then train ``name`` in this process (JAX starts after the host pool is fitted)."""
    from megatrain_jax.plan import GiB, fit_host_pool, gpu_bytes_before_jax

    host, gpu = mem_available_bytes(), gpu_bytes_before_jax()
    bc, lean, planned = choose(cc, host, gpu)
    cfg = bc.model()
    fit_host_pool(cfg, bc.engine, bc.rows, bc.seq_len)

    from bench import device_info, run_config
    run = run_config(name, bc, warmup, steps, profile=False)
    run.update(preset=bc.preset, master_dtype=bc.engine.master_dtype, adam_moments_dtype=bc.engine.master_dtype,
               device=device_info(),
               mem_available_gib_at_start=round(host / GiB, 2), gpu_bytes_planned_for_gib=gpu and round(gpu / GiB, 2),
               lean_mode=lean, plan=planned, pinned_pool_limit_gib=os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"))
    for k in ("gpu", "host"):
        if run.get(f"{k}_peak_gib"):
            run.setdefault("plan_error", {})[k] = round((planned[f"{k}_gib"] - run[f"{k}_peak_gib"]) /
                                                        run[f"{k}_peak_gib"], 4)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="path of the results JSON")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated names from {sorted(CONFIGS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per configuration")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run one configuration in this process
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, CONFIGS[args.child], args.warmup, args.steps)))
        return
    if not args.out:
        ap.error("--out is required")
    names = pick_configs(ap, args.configs, CONFIGS)
    import jax  # the version only: this process never starts the GPU backend, the children do
    commit = git_commit()
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/capacity.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
              "device": None, "runs": []}
    run_configs(__file__, names, ["--warmup", str(args.warmup), "--steps", str(args.steps)], args.timeout, result,
                args.out, lambda name, run: (
                    f"{name}: {run.get('status')} layers {run.get('model', {}).get('layers')} params "
                    f"{run.get('model', {}).get('params')} tokens/s {run.get('tokens_per_s')} TFLOP/s "
                    f"{run.get('model_tflops')} host {run.get('host_peak_gib')} GiB (plan "
                    f"{run.get('plan', {}).get('host_gib')}) gpu {run.get('gpu_peak_gib')} GiB (plan "
                    f"{run.get('plan', {}).get('gpu_gib')}) losses {run.get('losses')}"))


if __name__ == "__main__":
    main()
