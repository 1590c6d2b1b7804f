"""The head's loss and gradients, timed two ways on one device: the next-token loss as the package computes it
(``loss.chunked_nll_sum``: each chunk's gradient taken with its logits, three products a chunk) against the chunks
checkpointed and differentiated as written (their logits made again in the backward, four products: the form
before 9e75482, which ``loss.chunked_token_nll`` keeps for the per-token loss). Both through the models' own product (``models.layers.logits_matmul``, bfloat16 operands), with the
loss scaled as the engine scales it, at a model's hidden size, vocabulary and tokens a step. Records each variant's
median seconds over ``--reps`` calls (after a compiled warm-up), its hardware TFLOP/s (2 x tokens x hidden x vocab a
product), the loss of each (they must agree) and the largest gap between their gradients.

    PYTHONPATH=. python experiments/studies/head_loss_ab.py --hidden 5120 --vocab 32000 --tokens 32768 \
        --out $OUT/h200_head_loss_ab_<sha>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # child.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192, help="loss_chunk_tokens (the models' default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from child import results_header
    from megatrain_jax.loss import chunked_nll_sum, chunked_token_nll
    from megatrain_jax.models.layers import logits_matmul

    T, D, V, C = args.tokens, args.hidden, args.vocab, args.chunk
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k[0], (T, D), jnp.float32)
    w = (jax.random.normal(k[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(k[2], (T,), 0, V, jnp.int32)
    mask = jnp.ones((T,), jnp.float32)
    scale = 1.0 / T

    def head(w):
        return lambda x: logits_matmul(x, w, jnp.bfloat16)

    def fused(h, w):
        return chunked_nll_sum(head(w), h, targets, mask, C) * scale

    def checkpointed(h, w):  # the per-token loss's chunks (DPO's path) keep the checkpointed form
        return jnp.sum(chunked_token_nll(head(w), h, targets, C) * mask) * scale

    runs, grads = [], {}
    for name, fn, products in (("fused", fused, 3), ("checkpointed", checkpointed, 4)):
        f = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        out = jax.block_until_ready(f(h, w))  # compiles
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            out = jax.block_until_ready(f(h, w))
            times.append(time.perf_counter() - t)
        sec = statistics.median(times)
        grads[name] = out[1]
        runs.append({"system": "megatrain_jax", "variant": name, "products": products, "seconds": round(sec, 5),
                     "hw_tflops": round(products * 2 * T * D * V / sec / 1e12, 1), "loss": float(out[0]),
                     "seconds_each": [round(x, 5) for x in times]})
        print(json.dumps(runs[-1]), flush=True)
    gap = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                 max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)) for name, a, b in
           (("d_hidden", grads["fused"][0], grads["checkpointed"][0]),
            ("d_weight", grads["fused"][1], grads["checkpointed"][1]))}
    result = {**results_header(args.out, __file__), "shape": {"tokens": T, "hidden": D, "vocab": V, "chunk": C},
              "runs": runs, "largest_gradient_gap_relative": gap,
              "saved_seconds": round(runs[1]["seconds"] - runs[0]["seconds"], 5)}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({"saved_seconds": result["saved_seconds"], "gap": gap}))


if __name__ == "__main__":
    main()
