"""One block of a preset, forward and backward programs timed with and without kept residuals
(``EngineConfig.keep_residuals``): where the time of a long-context step goes.

    PYTHONPATH=. python experiments/studies/kept_block_bench.py --preset llama3.2-3b --seq-lens 32768,131072 \
        --out $OUT/h100_kept_block.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax
from child import median_seconds  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    import jax
    return median_seconds(lambda: jax.block_until_ready(fn()), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3.2-3b")
    ap.add_argument("--seq-lens", default="32768,131072")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from child import results_header
    from megatrain_jax import Decoder, preset
    from megatrain_jax.engine.device_fns import device_fns
    from megatrain_jax.contract.layered import block_params, layered
    from megatrain_jax.engine.transfer import Placement

    cfg = preset(args.preset, layers=1, max_positions=1 << 20)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fns = device_fns(layered(model), Placement(None))
    params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16), block_params(model)[0]))
    runs = []
    for T in (int(t) for t in args.seq_lens.split(",")):
        x = jax.random.normal(jax.random.key(0), (1, T, cfg.hidden), jnp.bfloat16)
        dy = jax.random.normal(jax.random.key(1), (1, T, cfg.hidden), jnp.bfloat16)
        pos = jnp.arange(T)[None]
        (_, kept), _ = fns.forward(params, x, pos, None, keep=True)
        run = {"system": "megatrain_jax", "preset": args.preset, "seq_len": T, "rows": 1,
               "forward_s": timed(lambda: fns.forward(params, x, pos, None)[0]),
               "forward_keep_s": timed(lambda: fns.forward(params, x, pos, None, keep=True)[0]),
               "backward_s": timed(lambda: fns.backward(params, x, pos, None, dy, None)[0]),
               "backward_kept_s": timed(lambda: fns.backward(params, x, pos, None, dy, None, kept=kept)[0]),
               "kept_bytes": sum(k.nbytes for k in kept), "kept_shapes": [str((k.shape, k.dtype)) for k in kept]}
        run["plain_s"] = run["forward_s"] + run["backward_s"]
        run["kept_s"] = run["forward_keep_s"] + run["backward_kept_s"]
        print(json.dumps(run), flush=True)
        runs.append(run)
        del kept
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
