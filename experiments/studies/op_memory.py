"""GPU memory per op of one training step, the step synchronized after every op: what each op holds
live and how far above that its own program goes (its transient), next to the memory plan's walk of the
same schedule (issue 16: the plan's 8K overshoot).

    PYTHONPATH=. python experiments/studies/op_memory.py --preset llama3.2-3b --seq-len 8192 --out $OUT/op_memory_8k.json

The first step is synchronized op by op (each op's outputs waited for, then the allocator's
``bytes_in_use`` and ``peak_bytes_in_use`` read): an op's transient is the rise of the peak above what was
live before it, seen the first time that op kind sets a new peak. Two more steps then run as the engine
runs them (the host ahead of the GPU), and the run's peak is recorded: their difference is what queued
work holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3.2-3b")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--keep-residuals", action="store_true")
    ap.add_argument("--layers", type=int, help="blocks (default: the preset's)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--resident-layers", type=int, default=0)
    ap.add_argument("--resident-io", action="store_true")
    ap.add_argument("--offload-activations", type=int, default=0, help="blocks whose inputs wait in host memory")
    ap.add_argument("--mlp-chunk-tokens", type=int, help="the model's MLP chunk (long_context.py's runs: 32768)")
    ap.add_argument("--synced-steps", type=int, default=1, help="steps synchronized op by op (issue 31: step 2 "
                    "is the first with GPU-resident parts updated by the step before)")
    ap.add_argument("--async-first", type=int, default=0,
                    help="steps run as the engine runs them before the synchronized ones (the run's peak read "
                         "after each); the synchronized steps then show what is live in a steady state")
    ap.add_argument("--live-arrays", action="store_true",
                    help="after every synchronized op, the bytes of JAX's live arrays on the GPU too; at the "
                         "last synchronized step's fullest op, the live arrays by shape and dtype")
    ap.add_argument("--master-dtype", default="float32", help="the host layout (capacity mode: bfloat16)")
    ap.add_argument("--moment-dtype", default=None, help="q8: 8-bit Adam moments (issue 35)")
    ap.add_argument("--host-grad-dtype", default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    from megatrain_jax import EngineConfig, preset
    from megatrain_jax.plan import GiB, fit_host_pool, plan

    cfg = preset(args.preset, max_positions=1 << 20, mlp_chunk_tokens=args.mlp_chunk_tokens,
                 **({"layers": args.layers} if args.layers else {}))
    engine_cfg = EngineConfig(keep_residuals=args.keep_residuals, micro_batches=args.micro_batches,
                              resident_layers=args.resident_layers, resident_io=args.resident_io,
                              offload_activations=args.offload_activations, master_dtype=args.master_dtype,
                              moment_dtype=args.moment_dtype, host_grad_dtype=args.host_grad_dtype)
    fit_host_pool(cfg, engine_cfg, args.rows, args.seq_len)
    import jax
    from flax import nnx

    from child import results_header
    from megatrain_jax import Decoder, Engine, default_optimizer
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens
    from megatrain_jax.engine.passes import block_until_done

    dev = jax.devices()[0]
    stats = lambda: dev.memory_stats() or {}  # noqa: E731
    ops: list[dict] = []
    step_no = [0]

    def live() -> list:
        return [a for a in jax.live_arrays()
                if not a.is_deleted() and dev in a.devices() and a.sharding.memory_kind == "device"]

    class Synced:
        def on_op(self, op, start, end, out):
            block_until_done(out)
            s = stats()
            rec = {"step": step_no[0], "op": repr(op), "in_use_gib": round(s.get("bytes_in_use", 0) / GiB, 3),
                   "peak_gib": round(s.get("peak_bytes_in_use", 0) / GiB, 3)}
            if args.live_arrays:
                arrays = live()
                rec["live_gib"] = round(sum(a.nbytes for a in arrays) / GiB, 3)
                rec["live_n"] = len(arrays)
            ops.append(rec)

        def on_task(self, *a, **k):
            pass

    engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), default_optimizer(3e-4), engine_cfg)
    steps = args.async_first + args.synced_steps + 2
    toks, starts = demo_tokens(cfg.vocab_size, (steps + 2) * args.rows * args.seq_len + 1, seed=0)
    data = iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), args.seq_len).batches(args.rows))
    async_peaks, watched = [], []

    class Watch:  # the steps as the engine runs them: the allocator read after each op's dispatch, no waiting
        def on_op(self, op, start, end, out):
            s = stats()
            watched.append({"step": step_no[0], "op": repr(op), "in_use_gib": round(s.get("bytes_in_use", 0) / GiB, 3),
                            "peak_gib": round(s.get("peak_bytes_in_use", 0) / GiB, 3)})

        def on_task(self, *a, **k):
            pass

    watch = Watch()
    engine.observe(watch)
    for _ in range(args.async_first):
        step_no[0] += 1
        engine.step(next(data)).resolve()
        engine.sync()
        s = stats()
        async_peaks.append({"step": step_no[0], "peak_gib": round(s.get("peak_bytes_in_use", 0) / GiB, 3),
                            "in_use_after_gib": round(s.get("bytes_in_use", 0) / GiB, 3)})
    engine.stop_observing(watch)
    synced = Synced()
    engine.observe(synced)
    for _ in range(args.synced_steps):
        step_no[0] += 1
        engine.step(next(data)).resolve()
    engine.sync()
    engine.stop_observing(synced)
    fullest = None
    if args.live_arrays:  # the last synchronized step's fullest op, run again to list what is live there
        last = [r for r in ops if r["step"] == step_no[0]]
        fullest = max(last, key=lambda r: r["in_use_gib"])["op"]
        listing: dict = {}

        class Lister:
            def on_op(self, op, start, end, out):
                block_until_done(out)
                if repr(op) in (fullest, "fetch(io)") and repr(op) not in listing:
                    listing[repr(op)] = {}
                    for a in live():
                        key = f"{a.dtype}{list(a.shape)}"
                        n, b = listing[repr(op)].get(key, (0, 0))
                        listing[repr(op)][key] = (n + 1, b + a.nbytes)

            def on_task(self, *a, **k):
                pass

        lister = Lister()
        engine.observe(lister)
        step_no[0] += 1
        engine.step(next(data)).resolve()
        engine.sync()
        engine.stop_observing(lister)
        fullest = {"op": fullest, "step": step_no[0],
                   "in_use_gib": round(stats().get("bytes_in_use", 0) / GiB, 3),
                   "arrays": {at: {k: {"n": n, "gib": round(b / GiB, 4)}
                                   for k, (n, b) in sorted(arrays.items(), key=lambda kv: -kv[1][1])}
                              for at, arrays in listing.items()}}
    for _ in range(2):
        step_no[0] += 1
        engine.step(next(data)).resolve()
    engine.sync()
    before, rises = 0.0, []
    for i, rec in enumerate(ops):
        prev_peak = ops[i - 1]["peak_gib"] if i else 0.0
        if rec["peak_gib"] > prev_peak + 0.01:
            live_before = ops[i - 1]["in_use_gib"] if i else 0.0
            rises.append({**rec, "live_before_gib": live_before,
                          "transient_gib": round(rec["peak_gib"] - live_before, 3)})
    p = plan(cfg, engine_cfg, args.rows, args.seq_len, gpu_bytes=stats().get("bytes_limit"))
    result = {**results_header(args.out, __file__),
              "runs": [{"system": "megatrain_jax", "preset": args.preset, "layers": cfg.layers, "seq_len": args.seq_len,
                        "mlp_chunk_tokens": cfg.mlp_chunk_tokens,
                        "rows": args.rows,
                        "engine": dataclasses.asdict(engine_cfg),
                        "synced_step_peak_gib": max(r["peak_gib"] for r in ops),
                        "run_peak_gib": round(stats().get("peak_bytes_in_use", 0) / GiB, 3),
                        "async_first_peaks": async_peaks, "async_watched": watched, "fullest_op_live_arrays": fullest,
                        "peak_rises": rises, "ops": ops,
                        "plan": {"gpu_gib": round(p.gpu_total / GiB, 2), "at": p.gpu_peak_at,
                                 "items": {k: round(v / GiB, 3) for k, v in p.gpu.items()}}}]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    r = result["runs"][0]
    print(f"synced step peak {r['synced_step_peak_gib']} GiB, run peak {r['run_peak_gib']} GiB, plan "
          f"{r['plan']['gpu_gib']} at {r['plan']['at']}")
    for rise in rises:
        print(f"  {rise['op']:<28} live before {rise['live_before_gib']:7.3f}  peak {rise['peak_gib']:7.3f}  "
              f"transient {rise['transient_gib']:7.3f}")


if __name__ == "__main__":
    main()
