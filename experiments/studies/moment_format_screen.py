"""Which Adam-moment format would pass the quality table, before its host kernel is built (issue 52).

The quality table (``quality_table.sh``: Llama-3.2-1B's shape on the local corpus, 2,000 steps of 4 x 2,048 tokens,
three seeds, the held-out loss after the last step, every mode through the engine's host update) takes ~20 minutes
of a GPU per run and needs the format's kernel. This study trains the same model on the same data, schedule and
evaluation in memory on one GPU (``ReferenceTrainer``: ``jax.grad`` and an optax transformation), with each format
simulated in the optimizer: after every step each matrix's m and v are replaced by the values their codes would
hold (a scale per block of a row mapping the block's largest magnitude to the format's largest value, a small float
of ``e`` exponent and ``m`` mantissa bits with subnormals, rounded stochastically; a positive v never to 0), the
masters rounded stochastically to bfloat16 and the gradients to bfloat16, as capacity mode with quantized moments
runs them on the host. Vectors and small leaves keep bfloat16 moments, as in the engine. ``float32`` is
``megatrain_jax.adamw`` itself (float32 masters and moments).

It is a simulation, not the kernel: its numbers screen formats against each other and against the formats the
table measured through the engine (8-bit moments: -0.20%, m8v4: +1.63%, 4-bit: +3.19% at seed 0;
``conv_1b_quality_5dd390b.json``), which run here too as the calibration. A format it passes is then built and
measured on the table itself.

    PYTHONPATH=. python experiments/studies/moment_format_screen.py --data build/corpus/corpus.bin \
        --formats float32,q8,m8v4,m7v5 --seeds 0 --out $OUT/h200_moment_format_screen_a.json
    PYTHONPATH=. python experiments/studies/moment_format_screen.py --merge a.json b.json --out screen.json

On a CPU, ``--preset tiny --steps 20 --rows 2 --seq-len 128`` runs it in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatrain_jax import Decoder, preset  # noqa: E402
from megatrain_jax.cli.run_config import OptimizerConfig  # noqa: E402
from megatrain_jax.data import DataConfig, TokenFile  # noqa: E402
from megatrain_jax.optim import adamw, decay_mask  # noqa: E402
from megatrain_jax.reference import ReferenceTrainer, model_loss  # noqa: E402

MIN_SIZE = 4096  # the engine's quantized leaves: matrices of this many elements or more (q8_leaf)


@dataclasses.dataclass(frozen=True)
class SmallFloat:
    """A magnitude of ``e`` exponent bits (bias 2^e - 1) and ``m`` mantissa bits with subnormals: the 8-bit
    format's e4m3 and e5m3, and narrower (m = 0 is the 4-bit format's powers of two)."""
    e: int
    m: int

    @property
    def bias(self) -> int:
        return 2 ** self.e - 1

    @property
    def top(self) -> float:  # the largest value, (2 - 2^-m) 2^0: a block's largest magnitude maps to it
        return 2.0 - 2.0 ** -self.m

    @property
    def bits(self) -> int:
        return self.e + self.m

    def round(self, y: jax.Array, u: jax.Array) -> jax.Array:
        """y in [0, top] onto the grid, up with probability of its distance from the value below (u uniform)."""
        y = jnp.clip(y, 0.0, self.top)
        _, exp = jnp.frexp(y)  # y = f 2^exp, f in [0.5, 1): the binade's exponent is exp - 1
        e = jnp.maximum(exp - 1, 1 - self.bias)  # the subnormals share the smallest normal binade's step
        step = jnp.ldexp(jnp.ones_like(y), e - self.m)  # exact (exp2 need not be)
        lo = jnp.floor(y / step) * step
        return jnp.where(u < (y - lo) / step, lo + step, lo)

    def smallest(self) -> float:
        return 2.0 ** (1 - self.bias - self.m)

    def values(self) -> np.ndarray:
        """Every magnitude of the grid: f 2^(1 - bias - m) for exponent field 0, (1 + f / 2^m) 2^(e - bias) above."""
        sub, m = 2.0 ** (1 - self.bias - self.m), 2 ** self.m
        return np.unique([f * sub if e == 0 else (1 + f / m) * 2.0 ** (e - self.bias)
                          for e in range(2 ** self.e) for f in range(m)])


def check_shipped_grids() -> None:
    """The simulated grids of the shipped formats are the product's: the magnitudes its codes decode to (q8's m and
    v, m7v5's m and v), with the same largest value (a block's largest magnitude maps to it)."""
    from megatrain_jax.engine.update.m7v5 import VMAX, m7v5_decode
    from megatrain_jax.engine.update.q8 import Q8_VMAX, q8_decode_m, q8_decode_v
    table = lambda fn, n: np.unique(np.abs(np.asarray(fn(np.arange(n, dtype=np.uint8)), np.float64)))  # noqa: E731
    for grid, ref, top in ((FORMATS["q8"].m, table(q8_decode_m, 256), float(Q8_VMAX)),
                           (FORMATS["q8"].v, table(q8_decode_v, 256), float(Q8_VMAX)),
                           (FORMATS["m7v5"].m, table(lambda c: m7v5_decode(c, "m"), 128), float(VMAX["m"])),
                           (FORMATS["m7v5"].v, table(lambda c: m7v5_decode(c, "v"), 32), float(VMAX["v"]))):
        if not (np.array_equal(grid.values(), ref) and grid.top == top):
            raise SystemExit(f"the simulated grid {grid} is not the product's ({len(ref)} magnitudes up to {top})")


@dataclasses.dataclass(frozen=True)
class Format:
    """m's format (with a sign), v's, and the block of a row that shares one float32 scale."""
    m: SmallFloat
    v: SmallFloat
    block: int

    def bytes_per_param(self) -> float:
        return (1 + self.m.bits + self.v.bits) / 8 + 8 / self.block


FORMATS: dict[str, Format | None] = {
    "float32": None,  # megatrain_jax.adamw: float32 masters and moments
    "q8": Format(SmallFloat(4, 3), SmallFloat(5, 3), 256),  # shipped: passes (-0.20%)
    "m8v4": Format(SmallFloat(4, 3), SmallFloat(4, 0), 128),  # shipped until removed: +1.63%
    "q4": Format(SmallFloat(3, 0), SmallFloat(4, 0), 128),  # shipped until removed: +3.19% at seed 0
    "m7v5": Format(SmallFloat(3, 3), SmallFloat(4, 1), 128),  # shipped: +0.41%, m8v4's bytes
    "m8v5": Format(SmallFloat(4, 3), SmallFloat(4, 1), 128),
    "m7v6": Format(SmallFloat(3, 3), SmallFloat(4, 2), 128),
    "m8v6": Format(SmallFloat(4, 3), SmallFloat(4, 2), 128),
}


def quantized_leaf(shape: tuple[int, ...], block: int) -> bool:
    return len(shape) >= 2 and int(np.prod(shape)) >= MIN_SIZE and int(np.prod(shape[1:])) % block == 0


def bf16_sr(x: jax.Array, key: jax.Array) -> jax.Array:
    """float32 x rounded stochastically to bfloat16 (kept as float32): 16 random bits added below the kept ones."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    r = jax.random.bits(key, x.shape, jnp.uint32) >> 16
    return jax.lax.bitcast_convert_type((bits + r) & jnp.uint32(0xFFFF0000), jnp.float32)


def fake_quantize(x: jax.Array, grid: SmallFloat, block: int, key: jax.Array, signed: bool) -> jax.Array:
    """What x's codes would hold: per block of a row, |x| over the block's largest times the grid's top, rounded
    onto the grid, scaled back (v: a positive value never to 0)."""
    b = x.reshape(x.shape[0], -1, block)
    absmax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, grid.top / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    y = jnp.abs(b) * scale
    q = grid.round(y, jax.random.uniform(key, b.shape))
    if not signed:
        q = jnp.where((y > 0) & (q == 0), grid.smallest(), q)
    out = jnp.where(absmax > 0, q / jnp.where(scale > 0, scale, 1.0), 0.0)
    return (jnp.sign(b) * out if signed else out).reshape(x.shape)


def simulated_adamw(schedule: optax.Schedule, fmt: Format, seed: int, b1: float, b2: float, eps: float,
                    weight_decay: float) -> optax.GradientTransformation:
    """AdamW as the host kernel runs it in capacity mode with quantized moments: the gradient in bfloat16, the
    update from the moments just computed, the masters rounded stochastically to bfloat16 and the moments stored
    in ``fmt`` (matrices) or bfloat16 (the rest), each rounding keyed by (step, leaf, stream)."""

    def init(params):
        zeros = lambda p: jnp.zeros_like(p, jnp.float32)  # noqa: E731
        return {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params),
                "nu": jax.tree.map(zeros, params)}

    def update(grads, state, params):
        t = state["count"] + 1
        bc1, bc2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
        lr = schedule(state["count"])
        step_key = jax.random.fold_in(jax.random.PRNGKey(seed), t)
        leaves, treedef = jax.tree.flatten(params)
        g_leaves, m_leaves, v_leaves = (treedef.flatten_up_to(x) for x in (grads, state["mu"], state["nu"]))
        decays = treedef.flatten_up_to(decay_mask(params))
        new_p, new_m, new_v = [], [], []
        for i, (p, g, m0, v0, decay) in enumerate(zip(leaves, g_leaves, m_leaves, v_leaves, decays)):
            kp, km, kv = jax.random.split(jax.random.fold_in(step_key, i), 3)
            g = g.astype(jnp.bfloat16).astype(jnp.float32)
            m = b1 * m0 + (1 - b1) * g
            v = b2 * v0 + (1 - b2) * g * g
            u = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + (weight_decay * p if decay else 0.0)
            new_p.append(bf16_sr(p - lr * u, kp) - p)
            if quantized_leaf(p.shape, fmt.block):
                new_m.append(fake_quantize(m, fmt.m, fmt.block, km, signed=True))
                new_v.append(fake_quantize(v, fmt.v, fmt.block, kv, signed=False))
            else:
                new_m.append(bf16_sr(m, km))
                new_v.append(bf16_sr(v, kv))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
        return unflat(new_p), {"count": t, "mu": unflat(new_m), "nu": unflat(new_v)}

    return optax.GradientTransformation(init, update)


def run(name: str, seed: int, args) -> dict:
    cfg = preset(args.preset, dtype="bfloat16")
    if args.data:
        cfg = cfg.replace(vocab_size=TokenFile.open(args.data).vocab_size)
    data_cfg = DataConfig(path=args.data, seq_len=args.seq_len, batch_size=args.rows, seed=seed,
                          demo_tokens=1 << 23, eval_fraction=args.eval_fraction)
    data = data_cfg.build(cfg.vocab_size)
    held_out = list(itertools.islice(data_cfg.build_eval(cfg.vocab_size), args.eval_batches))
    opt = OptimizerConfig(lr=args.lr, warmup_steps=max(args.steps // 10, 1))
    schedule = opt.schedule(args.steps)
    fmt = FORMATS[name]
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    if fmt is None:
        tx = adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    else:  # capacity mode's masters start as the float32 ones rounded to bfloat16
        for _, param in nnx.iter_graph(model):
            if isinstance(param, nnx.Param):
                param.value = param.value.astype(jnp.bfloat16).astype(param.value.dtype)
        tx = simulated_adamw(schedule, fmt, seed, opt.b1, opt.b2, opt.eps, opt.weight_decay)
    trainer = ReferenceTrainer(model, tx, clip_norm=1.0)
    losses, t0 = [], time.perf_counter()
    for step, batch in zip(range(args.steps), data):
        losses.append(round(float(trainer.step(batch)["loss"]), 5))
        if (step + 1) % max(args.steps // 10, 1) == 0:
            print(f"[{name}:{seed}] step {step + 1:5d} loss {losses[-1]:.4f} "
                  f"{(time.perf_counter() - t0) / (step + 1):.3f} s a step", flush=True)
    wall = time.perf_counter() - t0
    loss_fn = jax.jit(lambda params, b: model_loss(nnx.merge(trainer.graphdef, params), b))
    eval_loss = float(np.mean([float(loss_fn(trainer.params, b)) for b in held_out]))
    return {"system": name, "seed": seed, "status": "ok" if np.all(np.isfinite(losses)) else "nonfinite",
            "format": None if fmt is None else {"m": dataclasses.asdict(fmt.m), "v": dataclasses.asdict(fmt.v),
                                                "block": fmt.block, "bytes_per_param": fmt.bytes_per_param()},
            "eval_loss": round(eval_loss, 5), "final_loss": round(float(np.mean(losses[-20:])), 5),
            "losses": losses[::10], "wall_s": round(wall, 1),
            "tokens_per_s": round(args.steps * args.rows * args.seq_len / wall, 1)}


def gaps(runs: list[dict]) -> dict:
    """Each format's held-out loss against float32's at the same seed, and the mean over the seeds both have."""
    base = {r["seed"]: r["eval_loss"] for r in runs if r["system"] == "float32"}
    out = {}
    for name in dict.fromkeys(r["system"] for r in runs if r["system"] != "float32"):
        by_seed = {r["seed"]: r["eval_loss"] / base[r["seed"]] - 1 for r in runs
                   if r["system"] == name and r["seed"] in base}
        if by_seed:
            mine = np.mean([r["eval_loss"] for r in runs if r["system"] == name and r["seed"] in by_seed])
            ref = np.mean([base[s] for s in by_seed])
            out[name] = {"mean_gap": round(float(mine / ref - 1), 5), "seeds": sorted(by_seed),
                         "by_seed": {str(s): round(float(g), 5) for s, g in sorted(by_seed.items())}}
    return out


def device() -> dict:
    d = jax.devices()[0]
    ram = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    return {"name": getattr(d, "device_kind", str(d)), "platform": d.platform, "count": jax.device_count(),
            "cpu_cores": os.cpu_count(), "host_ram_gib": ram}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="float32,q8,m8v4,m7v5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--data", default=None, help="a token file (local_corpus.py's); the demo corpus without")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-fraction", type=float, default=0.02)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="no training: the runs of these files, compared")
    args = ap.parse_args()
    command = "PYTHONPATH=. python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT", commit)[:7]
    check_shipped_grids()
    if args.merge:
        files = [json.load(open(p)) for p in args.merge]
        setups = {json.dumps(f["setup"], sort_keys=True) for f in files}
        if len(setups) != 1:
            raise SystemExit("the files were trained with different setups; merge runs of one setup")
        runs = [r for f in files for r in f["runs"]]
        pairs = [(r["system"], r["seed"]) for r in runs]
        if len(set(pairs)) != len(pairs):
            raise SystemExit(f"the files hold some (format, seed) runs more than once: {sorted(pairs)}")
        record = {**{k: files[0][k] for k in ("setup", "device")}, "merged": args.merge, "runs": runs}
    else:
        unknown = [f for f in args.formats.split(",") if f not in FORMATS]
        if unknown:
            raise SystemExit(f"unknown formats {unknown}; choose from {list(FORMATS)}")
        setup = {k: v for k, v in vars(args).items() if k not in ("out", "formats", "seeds", "merge")}
        runs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in args.formats.split(","):
                runs.append(run(name, seed, args))
                print(f"[{name}:{seed}] held-out loss {runs[-1]['eval_loss']:.5f}", flush=True)
        record = {"setup": setup, "device": device(), "runs": runs}
    record = {"name": os.path.splitext(os.path.basename(args.out))[0], "command": command, "git_commit": commit,
              "date": datetime.date.today().isoformat(), **record, "gaps": gaps(record["runs"])}
    for name, g in record["gaps"].items():
        print(f"{name:8s} held-out loss vs float32 {100 * g['mean_gap']:+.2f}% (seeds {g['seeds']}: "
              + ", ".join(f"{100 * x:+.2f}%" for x in g["by_seed"].values()) + ")")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
