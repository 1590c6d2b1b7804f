"""Micro-benchmarks of the kernels the model's new paths use, on one GPU, into one results JSON.

    PYTHONPATH=. python experiments/kernel_bench.py --out $OUT/kernels.json [--only packed,ragged]

- ``packed``: causal attention over packed documents. cuDNN's packed layout (documents found from the
  segment ids, at most ``max_segments`` per row) against XLA's masked attention at a short length
  (values and gradients), then forward + backward time at long lengths, against unpacked cuDNN causal
  attention on the same row, for several ``max_segments``.
- ``ragged``: ``jax.lax.ragged_dot`` (the MoE experts' grouped matmul) at the Mixtral-8x7B and
  Qwen3-30B-A3B shapes, forward and forward + backward, against one dense matmul of the same FLOPs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.models.layers import packed_attention, segment_layout  # noqa: E402


def timed(fn, *args, reps: int = 5) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call (compile)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def segment_ids(B: int, T: int, docs: int, pad: int = 0, seed: int = 0) -> np.ndarray:
    """Rows of ``docs`` documents of random lengths (ids 1..docs), then ``pad`` padding tokens (id 0)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - pad), docs - 1, replace=False))
        bounds = np.concatenate([[0], cuts, [T - pad]])
        for d in range(docs):
            out[b, bounds[d]:bounds[d + 1]] = d + 1
    return out


def qkv(B, T, N, K, H, seed=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H), dtype), jax.random.normal(ks[1], (B, T, K, H), dtype),
            jax.random.normal(ks[2], (B, T, K, H), dtype))


def masked_xla(q, k, v, seg):
    mask = seg[:, None, :, None] == seg[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def bench_packed() -> dict:
    out = {"check": [], "speed": []}
    # Correctness: values and gradients against XLA's masked attention, float32 reference.
    for B, T, docs, pad, M in ((2, 2048, 5, 100, 8), (1, 4096, 8, 0, 64), (2, 1024, 1, 0, 4)):
        q, k, v = qkv(B, T, 32, 8, 128, seed=T)
        seg = jnp.asarray(segment_ids(B, T, docs, pad, seed=T))
        dy = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
        f_packed = jax.jit(lambda q, k, v: jax.vjp(lambda *a: packed_attention(*a, seg, M), q, k, v))
        y, pb = f_packed(q, k, v)
        g = pb(dy)
        y_ref, pb_ref = jax.vjp(lambda *a: masked_xla(*(x.astype(jnp.float32) for x in a), seg), q, k, v)
        g_ref = pb_ref(dy.astype(jnp.float32))
        rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
        rec = {"B": B, "T": T, "docs": docs, "pad": pad, "max_segments": M, "out_rel_err": rel(y, y_ref),
               "dq_rel_err": rel(g[0], g_ref[0]), "dk_rel_err": rel(g[1], g_ref[1]), "dv_rel_err": rel(g[2], g_ref[2])}
        # The same, through the bf16 XLA path: the error bf16 itself makes.
        y_bf, pb_bf = jax.vjp(lambda *a: masked_xla(*a, seg), q, k, v)
        rec["xla_bf16_out_rel_err"] = rel(y_bf, y_ref)
        rec["xla_bf16_dq_rel_err"] = rel(pb_bf(dy)[0], g_ref[0])
        print("check", rec, flush=True)
        out["check"].append(rec)
    # Speed: forward + backward of one 3B-like layer's attention (24 heads of 128, 8 kv heads).
    for T, docs, Ms in ((32768, 8, (8, 64, 512)), (131072, 8, (8, 64)), (8192, 8, (8, 64))):
        N, K, H = 24, 8, 128
        q, k, v = qkv(1, T, N, K, H)
        dy = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)

        def fb(attn):
            return jax.jit(lambda q, k, v, dy: jax.vjp(attn, q, k, v)[1](dy))
        causal_flops = 4 * T * T * N * H / 2 * 3.5  # fwd 2 matmuls + bwd 5, causal half
        t_full = timed(fb(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")),
                       q, k, v, dy)
        seg = jnp.asarray(segment_ids(1, T, docs, seed=1))
        rec = {"T": T, "heads": N, "kv_heads": K, "docs": docs, "unpacked_causal_s": t_full,
               "unpacked_causal_tflops": causal_flops / t_full / 1e12, "packed": []}
        lens = np.diff(np.flatnonzero(np.diff(np.concatenate([[-1], np.asarray(seg[0]), [-2]]))))
        doc_flops = sum(4 * L * L * N * H / 2 * 3.5 for L in lens)
        for M in Ms:
            t = timed(fb(lambda q, k, v, M=M: packed_attention(q, k, v, seg, M)), q, k, v, dy)
            rec["packed"].append({"max_segments": M, "s": t, "time_vs_unpacked": t / t_full,
                                  "tflops_on_document_flops": doc_flops / t / 1e12})
        print("speed", rec, flush=True)
        out["speed"].append(rec)
    lay = segment_layout(jnp.asarray(segment_ids(1, 64, 3, 4, seed=2)), 4)
    out["layout_example"] = {k: np.asarray(v).tolist() for k, v in lay.items()}
    return out


def bench_ragged() -> dict:
    out = []
    # (name, tokens per micro-batch, hidden, expert ffn, experts, top-k)
    for name, T, D, F, E, k in (("mixtral-8x7b", 16384, 4096, 14336, 8, 2), ("qwen3-30b-a3b", 16384, 2048, 768, 128, 8)):
        A = T * k
        x = jax.random.normal(jax.random.key(0), (A, D), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (E, D, F), jnp.bfloat16) * 0.02
        rng = np.random.default_rng(0)
        sizes = np.bincount(rng.integers(0, E, A), minlength=E).astype(np.int32)  # random routing, near balanced
        gs = jnp.asarray(sizes)
        flops = 2 * A * D * F
        fwd = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
        fb = jax.jit(lambda x, w, gs, dy: jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs), x, w)[1](dy))
        dy = jnp.ones((A, F), jnp.bfloat16)
        t_f, t_fb = timed(fwd, x, w, gs), timed(fb, x, w, gs, dy)
        dense = jax.jit(lambda x, w: x @ w)
        t_d = timed(dense, x, w[0])
        rec = {"shape": name, "rows": A, "hidden": D, "expert_ffn": F, "experts": E, "top_k": k,
               "fwd_s": t_f, "fwd_tflops": flops / t_f / 1e12, "bwd_only_s": t_fb,
               "bwd_tflops": 2 * flops / t_fb / 1e12,
               "dense_same_flops_s": t_d, "dense_tflops": flops / t_d / 1e12}
        print("ragged", rec, flush=True)
        out.append(rec)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="packed,ragged")
    args = ap.parse_args()
    dev = jax.devices()[0]
    result = {"name": f"{dev.platform}_kernels", "command": "PYTHONPATH=. python " + " ".join(sys.argv),
              "git_commit": os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
              "device": {"kind": dev.device_kind, "platform": dev.platform}, "date": datetime.date.today().isoformat(),
              "jax_version": jax.__version__}
    for part in args.only.split(","):
        try:
            result[part] = {"packed": bench_packed, "ragged": bench_ragged}[part]()
        except Exception as e:  # recorded, not hidden
            import traceback
            traceback.print_exc()
            result[part] = {"status": f"error: {type(e).__name__}: {str(e)[:800]}"}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
