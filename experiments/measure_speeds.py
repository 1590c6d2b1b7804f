"""Measure this machine's rates for the step-time model and write them as a calibration file
(``megatrain-jax plan --speeds FILE``, ``MEGATRAIN_SPEEDS=FILE megatrain-jax train ...``; docs/performance.md).

    PYTHONPATH=. python experiments/measure_speeds.py --out $OUT/speeds_h200x2.json [--params 256]

What it measures, each as the model reads it (``megatrain_jax.plan.speeds.Speeds``):

- the host update of each precision mode, with the fused kernel on every core this process may use: full
  precision as the engine runs it (split in two passes: the bfloat16 stream copy, then masters and moments;
  ``first_half_share`` is the first pass's share of the two; ``one_pass_speedup``, how much faster the same
  update runs in one pass, ``split_update=false``), the lean mode (one pass, no copy), capacity
  mode and the quantized-moment modes, each kernel alone (``host_kernels_alone``) and, as the file gives them, times
  its share in a step on this GPU kind's measured host nearest in cores (``Speeds.host_in_step``: what ``train``
  does with its own timing); ``host_cores`` is the cores it ran on;
- on a GPU: PCIe each way and both ways at once (``link_bytes``: the two copies' bytes over the time both take
  together), each as the engine copies a block's state (its float32 masters and moments at ``--hidden``/``--ffn``,
  three arrays a leaf, through ``Placement``; best of a few); and, recorded apart (``gpu_kernel_ceilings``, not read as
  calibration): both ways with one 1 GiB array each way (nearly full duplex where a block's arrays are not),
  the GPU's bfloat16 matrix products at a block's shapes (``--hidden``/``--ffn``/``--tokens``; the model's
  compute rates are a whole block's, fitted to runs, and below a lone kernel's) and causal flash attention's
  forward at ``--seq``.

The results file (name, command, git_commit, device, date, runs) holds the rates under ``runs[0].speeds``; it
is the file to give ``--speeds`` (``plan.speeds.from_file`` reads them from it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.engine.update import host_kernel  # noqa: E402
from megatrain_jax.plan import speeds as speeds_mod  # noqa: E402

best_seconds = host_kernel.best_seconds  # the fastest of reps timed calls, after one untimed (first touch)


def host_rates(n: int, reps: int) -> dict:
    """Parameters per second of each mode's kernel alone (one leaf of ``n`` parameters), as ``train`` times them
    at its start (``host_kernel.mode_rates``)."""
    rates = host_kernel.mode_rates(n, reps)
    split = {k: rates.pop(k) for k in ("first_half_share", "one_pass_speedup")}
    return {"host_update": {k: round(v, -6) for k, v in rates.items()},
            "first_half_share": round(split["first_half_share"], 3),
            "one_pass_speedup": round(split["one_pass_speedup"], 3), "host_cores": len(os.sched_getaffinity(0))}


def gpu_rates(hidden: int, ffn: int, tokens: int, seq: int, heads: int, reps: int) -> tuple[dict, dict]:
    """PCIe each way (rates the model takes as they are), and the ceilings of bfloat16 matrix products at a
    block's shapes and of causal attention's forward (kernels alone: the model's rates are a whole block's,
    below these); ({}, {}) without a GPU."""
    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return {}, {}
    from megatrain_jax.engine.transfer import Placement, select_devices
    pl = Placement(select_devices(1))  # one GPU's own link (the model's rate is per GPU)
    # The engine's copies as it makes them: a block's float32 masters and moments (its leaves at --hidden, --ffn
    # and --heads, plan.counts.leaf_shapes, three arrays each), each way through Placement. One large array each way runs nearly twice one way
    # both at once on the H200 (96 GB/s), where a block's arrays got 56-63 (experiments/studies/NOTES.md,
    # 2026-11-30): the model takes the block's figures; the one array's are kept apart.
    from megatrain_jax.engine.parts import PartId
    from megatrain_jax.models import preset
    from megatrain_jax.plan.counts import leaf_shapes
    block = preset("llama2-13b", hidden=hidden, ffn=ffn, heads=heads, kv_heads=heads)
    state = [pl.to_host(jnp.zeros(s, jnp.float32)) for s in leaf_shapes(block, PartId.block(0)) for _ in range(3)]
    jax.block_until_ready(state)
    on_gpu = pl.to_device(state)
    jax.block_until_ready(on_gpu)
    nbytes = sum(a.nbytes for a in state)
    h2d = best_seconds(lambda: jax.block_until_ready(pl.to_device(state)), reps)
    d2h = best_seconds(lambda: jax.block_until_ready(pl.to_host(on_gpu)), reps)
    both = best_seconds(lambda: jax.block_until_ready((pl.to_device(state), pl.to_host(on_gpu))), reps)
    del state, on_gpu
    one = pl.to_host(jnp.zeros((1 << 29,), jnp.bfloat16))  # 1 GiB pinned, one array
    one_on_gpu = pl.to_device(one)
    jax.block_until_ready((one, one_on_gpu))
    one_both = best_seconds(lambda: jax.block_until_ready((pl.to_device(one), pl.to_host(one_on_gpu))), reps)
    x = jnp.ones((tokens, hidden), jnp.bfloat16)
    w_up, w_down = jnp.ones((hidden, ffn), jnp.bfloat16), jnp.ones((ffn, hidden), jnp.bfloat16)
    mm = jax.jit(lambda x, a, b: (x @ a) @ b)
    mm_s = best_seconds(lambda: jax.block_until_ready(mm(x, w_up, w_down)), reps)
    rows, d = max(1, tokens // seq), hidden // heads
    q = jnp.ones((rows, seq, heads, d), jnp.bfloat16)
    # the path the model's attention takes (cuDNN's flash attention on the GPU): XLA's default path materializes
    # the scores and ran 45 TFLOP/s on the H200 (h200x2_measure_speeds_abfe3c3.json), not the engine's rate
    from megatrain_jax.models.layers import attention_implementation
    impl = attention_implementation(block, jnp.bfloat16)
    attn = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation=impl))
    attn_s = best_seconds(lambda: jax.block_until_ready(attn(q)), reps)
    return {"h2d_bytes": round(nbytes / h2d, -6), "d2h_bytes": round(nbytes / d2h, -6),
            "link_bytes": round(2 * nbytes / both, -6)}, {
        "one_array_link_bytes": round(2 ** 31 / one_both, -6),
        "matmul_flops": round(4 * tokens * hidden * ffn / mm_s, -9),
        "attention_flops": round(2 * heads * d * seq * rows * seq / attn_s, -9), "attention_implementation": impl}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", type=int, default=256, help="millions of parameters per host update run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of the matrix products and attention")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length of the attention")
    args = ap.parse_args(argv)
    from child import results_header
    speeds = host_rates(args.params * 1_000_000, args.reps)
    pcie, ceilings = gpu_rates(args.hidden, args.ffn, args.tokens, args.seq, args.heads, args.reps)
    speeds.update(pcie)
    import jax
    # The plan reads a file's host_update as the rates a step runs at: each kernel's rate times its share in a step
    # on this GPU kind's measured host nearest in cores (Speeds.host_in_step, as train applies to its own timing;
    # none known: the kernel's rate as it is); the kernels' rates alone are kept beside.
    kernels = dict(speeds["host_update"])
    record_here = speeds_mod.SPEEDS.get(speeds_mod.kind_of(jax.devices()[0].device_kind))
    share = {} if record_here is None else record_here.on_host(speeds["host_cores"]).host_in_step
    speeds["host_update"] = {k: round(v * share.get(k, 1.0), -6) for k, v in kernels.items()}
    speeds["name"] = f"{jax.devices()[0].device_kind}, {speeds['host_cores']}-core host (measured)"
    speeds["source"] = os.path.basename(args.out)
    record = {**results_header(args.out, __file__), "runs": [{"system": "measure_speeds", "speeds": speeds,
                                                               "host_kernels_alone": kernels,
                                                               "gpu_kernel_ceilings": ceilings,
                                                               "shapes": {k: getattr(args, k) for k in
                                                                          ("params", "hidden", "ffn", "heads",
                                                                           "tokens", "seq")}}]}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(json.dumps(speeds))
    return record


if __name__ == "__main__":
    main()
