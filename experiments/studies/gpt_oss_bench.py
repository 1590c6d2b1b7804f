"""Where a GPT-OSS block's time goes on the GPU (issue 34): forward + backward of its parts at one micro-batch of
the shipped H100 config (8 rows of 2,048 tokens), each timed alone.

    PYTHONPATH=. python experiments/studies/gpt_oss_bench.py --out $OUT/h100_gpt_oss_parts.json
    PYTHONPATH=. python experiments/studies/gpt_oss_bench.py --rows 1 --seq-len 64 --hidden 64 --out /tmp/x.json  # CPU

Parts: the experts with their biases as the product computes them (one more input width of the grouped matmul),
the same with each row's bias gathered and added (the way before this script: its gradient is a scatter-add of
every row into E), the experts without biases, the whole MoE layer (routing, gather, combine), and the
attention with sinks on a sliding (128) and a full layer by XLA (``sink_attention``), by cuDNN's kernel rescaled with
its log-sum-exp (``sink_rescaled``), and without sinks, the full one also as cuDNN takes it (``sink_as_key``).
Each record: seconds, and TFLOP/s over the part's
matmul FLOPs (forward 2, backward 4 per multiply-add; the attention's over the keys it is allowed to see).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))
from child import median_seconds, results_header  # noqa: E402

from megatrain_jax.models import layers  # noqa: E402
from megatrain_jax.models import preset  # noqa: E402
from megatrain_jax.models.moe import MoE, grouped_matmul  # noqa: E402


def timed_grad(fn, args, reps: int) -> float:
    """Median seconds of value-and-gradient of ``sum(fn(*args))`` with respect to every argument."""
    step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(len(args)))))
    return median_seconds(lambda: jax.block_until_ready(step(*args)), reps)


def experts_gathered(experts, x_AD, sizes_E):
    """The experts with each row's bias gathered and added after the product (the code before this script)."""
    dt = x_AD.dtype
    expert_A = jnp.repeat(jnp.arange(sizes_E.shape[0]), sizes_E, total_repeat_length=x_AD.shape[0])

    def dot(x, w, b):
        return grouped_matmul(x, w[...].astype(dt), sizes_E) + b[...].astype(dt)[expert_A]

    gate = jnp.minimum(dot(x_AD, experts.gate, experts.gate_bias), experts.limit)
    up = dot(x_AD, experts.up, experts.up_bias)
    h = (jnp.clip(up, -experts.limit, experts.limit) + 1) * (gate * jax.nn.sigmoid(gate * experts.alpha))
    return dot(h, experts.down, experts.down_bias)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=None, help="a smaller width (and expert width) to try on a CPU")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    cfg = preset("gpt-oss-20b")
    D = args.hidden or cfg.hidden
    moe_cfg = cfg.moe if args.hidden is None else dataclasses.replace(cfg.moe, expert_ffn=D)
    F, E, K = moe_cfg.expert_ffn, moe_cfg.experts, moe_cfg.top_k
    T = args.rows * args.seq_len
    dt = jnp.bfloat16
    key = jax.random.key(0)
    moe = MoE(D, moe_cfg, rngs=nnx.Rngs(0))
    for p in (moe.experts.gate_bias, moe.experts.up_bias, moe.experts.down_bias):  # nonzero biases
        p[...] = 0.02 * jax.random.normal(key, p[...].shape)
    graph, state = nnx.split(moe)
    x_TD = jax.random.normal(key, (T, D), dt)
    choice = jax.random.randint(jax.random.key(1), (T * K,), 0, E)
    sizes_E = jnp.bincount(choice, length=E).astype(jnp.int32)
    x_AD = jnp.repeat(x_TD, K, axis=0)
    expert_flops = 3 * 2 * T * K * D * F * 3  # three products, forward + backward
    runs = []

    def record(part, seconds, flops):
        runs.append({"part": part, "seconds": round(seconds, 5), "tflops": round(flops / seconds / 1e12, 1)})
        print(json.dumps(runs[-1]), flush=True)

    def experts_fn(use):
        return lambda st, x: use(nnx.merge(graph, st).experts, x)

    record("experts, bias in the grouped matmul", timed_grad(experts_fn(lambda m, x: m(x, sizes_E)), (state, x_AD),
                                                              args.reps), expert_flops)
    record("experts, bias gathered per row", timed_grad(experts_fn(lambda m, x: experts_gathered(m, x, sizes_E)),
                                                         (state, x_AD), args.reps), expert_flops)
    plain = MoE(D, dataclasses.replace(moe_cfg, expert_bias=False), rngs=nnx.Rngs(0))
    pgraph, pstate = nnx.split(plain)
    record("experts without biases", timed_grad(lambda st, x: nnx.merge(pgraph, st).experts(x, sizes_E),
                                                (pstate, x_AD), args.reps), expert_flops)
    record("MoE layer (route, gather, experts, combine)",
           timed_grad(lambda st, x: nnx.merge(graph, st)(x)[0], (state, x_TD.reshape(args.rows, args.seq_len, D)),
                      args.reps), expert_flops)

    N, KV, H = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = jax.random.normal(key, (args.rows, args.seq_len, N, H), dt)
    k, v = (jax.random.normal(jax.random.key(i), (args.rows, args.seq_len, KV, H), dt) for i in (2, 3))
    sinks = jnp.zeros((N,), jnp.float32)
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    for window in (cfg.sliding_window, None):
        seen = args.seq_len * (args.seq_len + 1) / 2 if window is None else sum(
            min(i + 1, window) for i in range(args.seq_len))
        flops = 2 * 2 * args.rows * N * H * seen * 3
        fn = lambda q, k, v, s, w=window: layers.sink_attention(q, k, v, s, H ** -0.5, w, None)  # noqa: E731
        record(f"attention with sinks, window {window}", timed_grad(fn, (q, k, v, sinks), args.reps), flops)
        rescaled = lambda q, k, v, s, w=window: layers.sink_rescaled(q, k, v, s, H ** -0.5, w, impl)  # noqa: E731
        record(f"attention with sinks, window {window}, rescaled by the log-sum-exp ({impl})",
               timed_grad(rescaled, (q, k, v, sinks), args.reps), flops)
        local = None if window is None else (window - 1, 0)
        plain = lambda q, k, v, s, w=local: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=H ** -0.5, is_causal=True, local_window_size=w, implementation=impl)
        record(f"attention without sinks, window {window} ({impl})", timed_grad(plain, (q, k, v, sinks), args.reps),
               flops)
    key_form = lambda q, k, v, s: layers.sink_as_key(q, k, v, s, H ** -0.5, impl)  # noqa: E731
    record(f"attention with sinks, window None, the sink as one more key ({impl})",
           timed_grad(key_form, (q, k, v, sinks), args.reps), flops)

    header = results_header(args.out, __file__)
    with open(args.out, "w") as f:
        json.dump({**header, "shape": {"rows": args.rows, "seq_len": args.seq_len, "hidden": D, "expert_ffn": F,
                                        "experts": E, "top_k": K}, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
