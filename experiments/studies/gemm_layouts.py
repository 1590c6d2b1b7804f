"""A 13B block's matrix products at 32K tokens, one at a time, with each operand layout (issue 51's per-layer
compute item): does the backward's slower rate come from its transposed operands?

    PYTHONPATH=. python experiments/studies/gemm_layouts.py --out $OUT/gemm_layouts.json [--tokens 32768]

The profiled 13B step (``h200_block_kernels_e1148dc.json``, its trace) ran the forward's products at ~830
TFLOP/s and the backward's at ~700-720, on the same shapes: the backward's cuBLAS calls take an operand
transposed (the input gradient ``dy @ w.T``, the weight gradient ``x.T @ dy``, whose contraction runs over the
tokens). For each of the block's three projection shapes (hidden -> hidden, hidden -> ffn, ffn -> hidden), on one
GPU:

- **jax**: the forward ``x @ w``; the input gradient as the model's backward computes it (``dy @ w.T``, the
  transpose folded into the product) and with ``w.T`` made beforehand (a separate array); the weight gradient as
  the model computes it (``x.T @ dy``) and with ``x.T`` made beforehand, and as ``dy.T @ x`` (the transposed
  gradient); and the time of making each transpose. Each timed as four independent products in one jitted
  call (so dispatch is a small share), the median of ``--reps`` calls.
- **torch** (a child process, where torch with CUDA is installed): the same three products in torch's own
  layout (``nn.Linear`` holds w as [out, in]: forward ``x @ w.t()``, input gradient ``dy @ w``, weight
  gradient ``dy.t() @ x``), CUDA events, as its autograd calls them.

Each row gives milliseconds per product and TFLOP/s (2 x tokens x in x out). Without a GPU the JAX half still
runs, at ``--tokens 256`` on the CPU; its rates mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from child import median_seconds, results_header  # noqa: E402

SHAPES = {"attention": (5120, 5120), "ffn_in": (5120, 13824), "ffn_out": (13824, 5120)}  # (in, out), Llama-2-13B
COPIES = 4  # independent products per timed call


def _rate(tokens: int, d_in: int, d_out: int, seconds: float) -> dict:
    return {"ms": round(seconds * 1e3, 3), "tflops": round(2.0 * tokens * d_in * d_out / seconds / 1e12, 1)}


def jax_half(tokens: int, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    def timed(fn, *args) -> float:
        return median_seconds(lambda: jax.block_until_ready(fn(*args)), reps)

    def each(op):  # COPIES independent products in one program: a = tuple of first operands
        return jax.jit(lambda a, b: tuple(op(x, b) for x in a))

    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 2 * COPIES + 1)
        norm = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16)  # noqa: E731
        xs = tuple(norm(keys[i], (tokens, d_in)) for i in range(COPIES))
        dys = tuple(norm(keys[COPIES + i], (tokens, d_out)) for i in range(COPIES))
        w = norm(keys[-1], (d_in, d_out))
        wt = jax.block_until_ready(jnp.transpose(w).copy())
        transpose = jax.jit(lambda a: tuple(jnp.transpose(x) for x in a))
        xts = jax.block_until_ready(transpose(xs))
        dyts = jax.block_until_ready(transpose(dys))
        cases = {
            "forward x @ w": (each(lambda x, w: x @ w), xs, w, (d_in, d_out)),
            "input grad dy @ w.T (as the model)": (each(lambda dy, w: dy @ w.T), dys, w, (d_out, d_in)),
            "input grad dy @ wt (w.T made before)": (each(lambda dy, wt: dy @ wt), dys, wt, (d_out, d_in)),
            "weight grad x.T @ dy (as the model)": (jax.jit(lambda a, b: tuple(x.T @ dy for x, dy in zip(a, b))),
                                                    xs, dys, (d_in, d_out)),
            "weight grad xt @ dy (x.T made before)": (jax.jit(lambda a, b: tuple(x @ dy for x, dy in zip(a, b))),
                                                      xts, dys, (d_in, d_out)),
            "weight grad dy.T @ x (its transpose)": (jax.jit(lambda a, b: tuple(dy.T @ x for x, dy in zip(a, b))),
                                                     xs, dys, (d_in, d_out)),
            "weight grad dyt @ x (dy.T made before)": (jax.jit(lambda a, b: tuple(dy @ x for x, dy in zip(a, b))),
                                                       xs, dyts, (d_in, d_out)),
        }
        for case, (fn, a, b, (k, n)) in cases.items():
            s = timed(fn, a, b) / COPIES
            rows.append({"system": "jax", "shape": name, "in": d_in, "out": d_out, "case": case,
                         **_rate(tokens, k, n, s)})
        for what, arrays in (("x", xs), ("dy", dys)):
            s = timed(transpose, arrays) / COPIES
            gb = 2 * 2 * arrays[0].size / 1e9
            rows.append({"system": "jax", "shape": name, "case": f"transpose {what} {tuple(arrays[0].shape)}",
                         "ms": round(s * 1e3, 3), "gb_per_s": round(gb / s, 1)})
        del xs, dys, xts, dyts, w, wt
    return rows


def torch_half(tokens: int, reps: int) -> list[dict]:
    try:
        import torch
    except ImportError as e:
        return [{"system": "torch", "status": f"not run: no torch here ({e})"}]
    if not torch.cuda.is_available():
        return [{"system": "torch", "status": "not run: no CUDA device for torch"}]
    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        norm = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        xs = [norm(tokens, d_in) for _ in range(COPIES)]
        dys = [norm(tokens, d_out) for _ in range(COPIES)]
        w = norm(d_out, d_in)  # nn.Linear's weight
        cases = {"forward x @ w.t()": (lambda: [x @ w.t() for x in xs], (d_in, d_out)),
                 "input grad dy @ w": (lambda: [dy @ w for dy in dys], (d_out, d_in)),
                 "weight grad dy.t() @ x": (lambda: [dy.t() @ x for x, dy in zip(xs, dys)], (d_in, d_out))}
        for case, (fn, (k, n)) in cases.items():
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            rows.append({"system": "torch", "shape": name, "in": d_in, "out": d_out, "case": case,
                         **_rate(tokens, k, n, statistics.median(ts) / COPIES)})
        del xs, dys, w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=None, help="rows of each product (default 32768; 256 on a CPU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--half", choices=("torch",), default=None, help=argparse.SUPPRESS)  # the child's half
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.half == "torch":
        print(json.dumps(torch_half(args.tokens, args.reps)))
        return
    # torch first, in its own process: JAX then takes most of the GPU's memory
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--half", "torch", "--tokens",
                            str(args.tokens or 32768), "--reps", str(args.reps)],
                           capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        torch_rows = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        torch_rows = [{"system": "torch", "status": f"error: exit {child.returncode}: {child.stderr[-600:]}"}]
    import jax
    tokens = args.tokens or (32768 if jax.devices()[0].platform == "gpu" else 256)
    rows = jax_half(tokens, args.reps) + torch_rows
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        out = {**results_header(args.out, __file__), "tokens": tokens, "copies_per_call": COPIES, "runs": rows}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
