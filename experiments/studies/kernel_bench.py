"""Micro-benchmarks of the kernels the model's new paths use, on one GPU, into one results JSON.

    PYTHONPATH=. python experiments/studies/kernel_bench.py --out $OUT/kernels.json [--only packed,ragged]

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
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

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


def guarded(out: list, fn, **case):
    """Run one case, recording its result or its error (the other cases still run)."""
    try:
        rec = {**case, **fn(**case)}
    except Exception as e:  # recorded, not hidden
        rec = {**case, "status": f"error: {type(e).__name__}: {str(e)[:600]}"}
    print(json.dumps(rec), flush=True)
    out.append(rec)


def rel(a, b) -> float:
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def packed_check(B, T, docs, pad, M):
    """Packed cuDNN against XLA's masked attention in float32: values and gradients (and bf16 XLA's error)."""
    q, k, v = qkv(B, T, 32, 8, 128, seed=T)
    seg = jnp.asarray(segment_ids(B, T, docs, pad, seed=T))
    dy = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
    y, g = jax.jit(lambda q, k, v, dy: (lambda o: (o[0], o[1](dy)))(
        jax.vjp(lambda *a: packed_attention(*a, seg, M), q, k, v)))(q, k, v, dy)
    y_ref, pb_ref = jax.vjp(lambda *a: masked_xla(*(x.astype(jnp.float32) for x in a), seg), q, k, v)
    g_ref = pb_ref(dy.astype(jnp.float32))
    y_bf, pb_bf = jax.vjp(lambda *a: masked_xla(*a, seg), q, k, v)
    return {"out_rel_err": rel(y, y_ref), "dq_rel_err": rel(g[0], g_ref[0]), "dk_rel_err": rel(g[1], g_ref[1]),
            "dv_rel_err": rel(g[2], g_ref[2]), "xla_bf16_out_rel_err": rel(y_bf, y_ref),
            "xla_bf16_dq_rel_err": rel(pb_bf(dy)[0], g_ref[0])}


def packed_speed(T, docs, M, N=24, K=8, H=128):
    """Forward + backward of one 3B-like layer's attention: unpacked cuDNN causal (M=0) or packed."""
    q, k, v = qkv(1, T, N, K, H)
    dy = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
    seg = jnp.asarray(segment_ids(1, T, docs, seed=1))
    if M == 0:
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
        lens = [T]
    else:
        attn = lambda q, k, v: packed_attention(q, k, v, seg, M)  # noqa: E731
        lens = np.diff(np.flatnonzero(np.diff(np.concatenate([[-1], np.asarray(seg[0]), [-2]]))))
    t = timed(jax.jit(lambda q, k, v, dy: jax.vjp(attn, q, k, v)[1](dy)), q, k, v, dy)
    flops = sum(4 * L * L * N * H / 2 * 3.5 for L in lens)  # causal half; forward 2 matmuls, backward 5
    return {"s": t, "tflops_on_attended_flops": flops / t / 1e12, "gpu_peak_gib": gpu_peak_gib()}


def gpu_peak_gib():
    return round((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)


def bench_packed() -> dict:
    out = {"check": [], "speed": []}
    for B, T, docs, pad, M in ((2, 2048, 5, 100, 8), (1, 4096, 8, 0, 64), (2, 1024, 1, 0, 4)):
        guarded(out["check"], packed_check, B=B, T=T, docs=docs, pad=pad, M=M)
    for T, docs, Ms in ((8192, 8, (0, 8, 64)), (32768, 8, (0, 8, 16, 64, 256)), (131072, 8, (0, 8, 64))):
        for M in Ms:
            guarded(out["speed"], packed_speed, T=T, docs=docs, M=M)
    lay = segment_layout(jnp.asarray(segment_ids(1, 64, 3, 4, seed=2)), 4)
    out["layout_example"] = {k: np.asarray(v).tolist() for k, v in lay.items()}
    return out


RAGGED_SHAPES = {  # tokens per micro-batch, hidden, expert ffn, experts, top-k
    "mixtral-8x7b": (16384, 4096, 14336, 8, 2), "qwen3-30b-a3b": (16384, 2048, 768, 128, 8)}
TILES = [(128, 128, 64, 4, 1), (128, 256, 64, 3, 1), (128, 128, 64, 4, 4), (128, 256, 64, 4, 4),
         (64, 128, 64, 4, 1), (128, 192, 64, 4, 1), (128, 128, 128, 3, 1)]


def ragged_inputs(shape, rows=None, empty_group=False):
    T, D, F, E, k = RAGGED_SHAPES[shape]
    A = rows or T * k
    x = jax.random.normal(jax.random.key(0), (A, D), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (E, D, F), jnp.bfloat16) * 0.02
    choice = np.random.default_rng(0).integers(1 if empty_group else 0, E, A)  # random routing, near balanced
    sizes = jnp.asarray(np.bincount(choice, minlength=E).astype(np.int32))
    return x, w, sizes


def ragged_check(shape):
    """grouped_matmul (Mosaic GPU) against XLA's ragged_dot: values and both gradients, one expert empty."""
    from megatrain_jax.models.moe import grouped_matmul
    x, w, sizes = ragged_inputs(shape, rows=4096, empty_group=True)
    dy = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[2]), jnp.bfloat16)
    f = lambda fn: jax.jit(lambda x, w, dy: (lambda o: (o[0], o[1](dy)))(jax.vjp(fn, x, w)))  # noqa: E731
    y, (dx, dw) = f(lambda x, w: grouped_matmul(x, w, sizes))(x, w, dy)
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    y_r, (dx_r, dw_r) = f(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x32, w32, dy32)
    return {"y_rel_err": rel(y, y_r), "dx_rel_err": rel(dx, dx_r), "dw_rel_err": rel(dw, dw_r),
            "empty_group_dw_max": float(jnp.max(jnp.abs(dw[0].astype(jnp.float32))))}


def ragged_speed(shape, kernel, tiles):
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot
    x, w, sizes = ragged_inputs(shape)
    A, D, F = x.shape[0], w.shape[1], w.shape[2]
    kw = dict(zip(("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"), tiles or ()))
    dy = jax.random.normal(jax.random.key(2), (A, F), jnp.bfloat16)
    fns = {"xla_ragged_dot": lambda x, w, sizes, dy: jax.lax.ragged_dot(x, w, sizes),
           "dense_same_flops": lambda x, w, sizes, dy: x @ w[0],
           "mosaic_fwd": lambda x, w, sizes, dy: ragged_dot(x, w, group_sizes=sizes, **kw),
           "mosaic_dx": lambda x, w, sizes, dy: ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **kw),
           "mosaic_dw": lambda x, w, sizes, dy: transposed_ragged_dot(x, dy, group_sizes=sizes, **kw)}
    t = timed(jax.jit(fns[kernel]), x, w, sizes, dy)
    return {"s": t, "tflops": 2 * A * D * F / t / 1e12}


def bench_ragged() -> dict:
    out = {"check": [], "speed": []}
    for shape in RAGGED_SHAPES:
        guarded(out["check"], ragged_check, shape=shape)
    for shape in RAGGED_SHAPES:
        guarded(out["speed"], ragged_speed, shape=shape, kernel="dense_same_flops", tiles=None)
        if shape == "mixtral-8x7b":  # XLA's ragged_dot masks every row for every expert: 128 experts run out of memory
            guarded(out["speed"], ragged_speed, shape=shape, kernel="xla_ragged_dot", tiles=None)
        for kernel in ("mosaic_fwd", "mosaic_dx", "mosaic_dw"):
            for tiles in TILES:
                guarded(out["speed"], ragged_speed, shape=shape, kernel=kernel, tiles=tiles)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="packed,ragged")
    args = ap.parse_args()
    from bench import device_info
    from child import git_commit
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python " + " ".join(sys.argv), "git_commit": git_commit(),
              "device": device_info(), "date": datetime.date.today().isoformat(), "jax_version": jax.__version__}
    for part in args.only.split(","):
        try:
            result[part] = {"packed": bench_packed, "ragged": bench_ragged}[part]()
        except Exception as e:  # recorded, not hidden
            import traceback
            traceback.print_exc()
            result[part] = {"status": f"error: {type(e).__name__}: {str(e)[:800]}"}
        with open(args.out, "w") as f:
            json.dump(as_runs(result), f, indent=1)


def as_runs(result: dict) -> dict:
    """The results-file layout (docs/results.md): every case of the ``packed`` and ``ragged`` sections as
    one entry of ``runs``, with the kernel it timed or checked as ``system``, its section as ``part`` and
    ``check`` or ``speed`` as ``kind``; a section that failed as a whole is a run with its status."""
    out = {k: v for k, v in result.items() if k not in SECTIONS}
    runs = list(result.get("runs", []))
    for part in SECTIONS:
        section = result.get(part)
        if section is None:
            continue
        if "status" in section:
            runs.append({"system": part, "part": part, "status": section["status"]})
            continue
        for kind in ("check", "speed"):
            for case in section.get(kind, []):
                runs.append({"system": _system(part, kind, case), "part": part, "kind": kind, **case,
                             "status": case.get("status", "ok")})
        if "layout_example" in section:
            out["packed_layout_example"] = section["layout_example"]
    out["runs"] = runs
    return out


SECTIONS = ("packed", "ragged")


def _system(part: str, kind: str, case: dict) -> str:
    if part == "packed":
        return "cudnn_causal_attention" if case.get("M") == 0 else "cudnn_packed_attention"
    if kind == "check":
        return "mosaic_grouped_matmul"
    return {"xla_ragged_dot": "xla_ragged_dot", "dense_same_flops": "xla_dense_matmul"}.get(
        case.get("kernel"), "mosaic_ragged_dot")


if __name__ == "__main__":
    main()
