"""Whether gradients sent home in bfloat16 leave full-precision training unchanged on this machine.

At one micro-batch on one device a block's gradient is its backward's cotangent of the bfloat16 weights, so
``host_grad_dtype="bfloat16"`` should update the float32 masters with the same values as ``"float32"``
(tests/test_engine.py checks it bit for bit on the CPU). On a GPU, XLA may keep more than bfloat16's bits in the
float32 path (excess precision: a bfloat16 rounding followed by a widening can be folded away), and then the
two differ. This trains one small decoder twice per setting, ``--steps`` steps each, with deterministic ops, and
reports per setting whether masters, moments and stream copies are equal bit for bit and, where not, how far
apart (the largest relative difference of the masters' change, and the share of elements that differ); a
control pair (float32 twice) says whether the runs repeat at all. And it looks at the float32 gradients that come
home: the share of their elements that are not bfloat16 values (low 16 bits not zero), which is the excess
precision the bfloat16 gradients drop.

    PYTHONPATH=. python experiments/studies/bf16_gradients_exact.py --out $OUT/bf16_gradients_exact.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from child import results_header  # noqa: E402
from megatrain_jax import Decoder, Engine, EngineConfig, adamw  # noqa: E402
from megatrain_jax.batch import Batch  # noqa: E402
from megatrain_jax.models.presets import preset  # noqa: E402


class Widened:
    """Counts, over the float32 gradients sent home, the elements that are not bfloat16 values."""

    def __init__(self):
        self.blocks, self.io = [0, 0], [0, 0]  # [not bfloat16, all]

    def on_op(self, op, start, end, out):
        if op.kind != "send_grads":
            return
        for g in jax.tree.leaves(out):
            g = np.asarray(g)
            if g.dtype == np.float32:
                where = self.io if op.part.is_io else self.blocks
                where[0] += int((g.view(np.uint32) & 0xFFFF != 0).sum())
                where[1] += g.size

    def on_task(self, *a, **k):
        pass


def trained(cfg, engine_cfg: EngineConfig, steps: int, rows: int, seq: int, observer=None) -> tuple[Engine, list]:
    engine = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(3e-4, weight_decay=0.1), engine_cfg)
    if observer is not None:
        engine.observe(observer)
    start = [np.asarray(x, np.float32).copy() for x in jax.tree.leaves(engine.state.params())]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = rng.integers(0, cfg.vocab_size, (rows, seq + 1), dtype=np.int32)
        engine.step(Batch.from_windows(tokens)).resolve()
    engine.sync()
    return engine, start


def compare(a: Engine, b: Engine, start: list) -> dict:
    leaves_a, leaves_b = jax.tree.leaves(a.state), jax.tree.leaves(b.state)
    equal = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))
    worst, differ, total = 0.0, 0, 0
    for s, x, y in zip(start, jax.tree.leaves(a.state.params()), jax.tree.leaves(b.state.params())):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        change = np.abs(x - s).max()
        if change > 0:
            worst = max(worst, float(np.abs(x - y).max() / change))
        differ += int((x.view(np.uint32) != y.view(np.uint32)).sum())
        total += x.size
    return {"bitwise_equal": bool(equal), "masters_differing_share": differ / total,
            "max_diff_over_max_change": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = preset("7b", layers=2).replace(hidden=1024, ffn=2816, heads=8, kv_heads=8, vocab_size=8192,
                                         dtype="bfloat16")
    runs = []
    for name, extra in (("one_micro_batch", {}), ("two_micro_batches", {"micro_batches": 2})):
        pair, widened = {}, Widened()
        for grads in ("float32", "float32_again", "bfloat16"):
            home = grads.removesuffix("_again")
            pair[grads] = trained(cfg, EngineConfig(clip_norm=1.0, host_grad_dtype=home, **extra),
                                  args.steps, args.rows, args.seq, widened if grads == "float32" else None)
        row = {"setting": name, "engine": extra, "steps": args.steps,
               "control_float32_twice": compare(pair["float32"][0], pair["float32_again"][0], pair["float32"][1]),
               "float32_against_bfloat16": compare(pair["float32"][0], pair["bfloat16"][0], pair["float32"][1]),
               "float32_gradients_not_bfloat16_share": {
                   "blocks": widened.blocks[0] / max(widened.blocks[1], 1),
                   "io": widened.io[0] / max(widened.io[1], 1)}}
        runs.append(row)
        print(json.dumps(row), flush=True)
        for engine, _ in pair.values():
            engine.close()
    model = {"hidden": cfg.hidden, "layers": cfg.layers, "vocab": cfg.vocab_size, "params": cfg.param_count()}
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "model": model, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
