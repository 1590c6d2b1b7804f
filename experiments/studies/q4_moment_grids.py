"""How much noise each moment format adds to AdamW's update, and which 4-bit grid would add as little as the formats
that pass the quality table (issue 52; CPU, no GPU needed).

The quality table's 4-bit seed 0 ended +3.19% over float32 on the held-out loss (conv_1b_quality_seed0_3736a7b.json;
the gap grows through the run, +1.5% at step 400, +3.7% at step 2,000), while capacity mode (bfloat16 moments) and
8-bit moments end within 0.2% on the mean of three seeds (conv_1b_quality_3736a7b.json). A small model trained on
the CPU for 400 steps showed no gap at all (NOTES, 2026-11-30), so this study measures the cause directly: one
matrix's gradients, drawn with the traits that make a block of 128 hard to share one scale (columns of very
different sizes, a few outlier columns, a weak signal under noise, heavy tails), go through AdamW for ``--steps``
steps once with float32 moments and once per format, each format keeping its own moments from step to step as the
host kernel does (the update from the moments just computed, the quantized ones stored). Each step's update is
compared with float32's on the same gradients: the relative error ||u - u32|| / ||u32||, its part along u32 (a
bias in the step's size), and the cosine. The shipped formats run through the product's own numpy references
(``q8_quantize``, ``host_kernel.stochastic_round_bf16``: bit for bit the kernel's codes); the 4-bit format (the
product's until it was removed for missing the quality bar) and the candidate grids are simulated here.

    PYTHONPATH=. python experiments/studies/q4_moment_grids.py \
        --out experiments/results/cpu_q4_moment_grids_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatrain_jax.engine.update import host_kernel  # noqa: E402
from megatrain_jax.engine.update.q8 import Q8_BLOCK, q8_dequantize, q8_quantize  # noqa: E402

B1, B2, EPS = 0.9, 0.95, 1e-8  # the quality table's AdamW


# ---------------------------------------------------------------------------------------------- shipped formats
def _float32(x, kind, rng):
    return x


def _bfloat16_sr(x, kind, rng):
    """Capacity mode's moments: bfloat16, stochastically rounded by the kernel's rule."""
    r = rng.integers(0, 2 ** 32, x.size, dtype=np.uint32)
    return np.asarray(host_kernel.stochastic_round_bf16(x.reshape(-1), r), np.float32).reshape(x.shape)


def _q8(x, kind, rng):
    codes, scale = q8_quantize(x, Q8_BLOCK, kind, seed=int(rng.integers(0, 2 ** 31)))
    return q8_dequantize(codes, scale, Q8_BLOCK, kind)


# ---------------------------------------------------------------------------------------------- candidate grids
Q4_BLOCK = 128  # the 4-bit format's block (the product's until it was removed for missing the quality bar)


def _blocks(x, block=Q4_BLOCK):
    return x.reshape(x.shape[0], -1, block)


def _round(y, grid, rng, stochastic=True):
    """Magnitudes y in [0, 1] onto a sorted grid of [0, 1] ending at 1: stochastically between the two
    neighbours (unbiased), or to the nearest."""
    y = np.clip(y, grid[0], 1.0)
    i = np.clip(np.searchsorted(grid, y, side="right") - 1, 0, len(grid) - 2)
    lo, up = grid[i], grid[i + 1]
    frac = (y - lo) / (up - lo)
    go_up = rng.random(y.shape) < frac if stochastic else frac >= 0.5
    return np.where(go_up, up, lo)


def blockwise(grid, stochastic=True, floor=False, block=Q4_BLOCK):
    """A format of a sign (m) and magnitudes on ``grid`` scaled by the absmax of each ``block`` elements of a row;
    ``floor``: a positive value never rounds to 0 (v)."""
    grid = np.asarray(grid, np.float64)

    def fmt(x, kind, rng):
        b = _blocks(x, block).astype(np.float64)
        scale = np.abs(b).max(axis=-1, keepdims=True)
        y = np.where(scale > 0, np.abs(b) / np.where(scale > 0, scale, 1), 0)
        q = _round(y, grid, rng, stochastic)
        if floor:
            q = np.where((y > 0) & (q == 0), grid[grid > 0][0], q)
        return (np.sign(b) * q * scale).reshape(x.shape).astype(np.float32)
    return fmt


# The 4-bit moments as the product shipped them until their removal (megatrain_adamw_q4): blocks of 128 of a row,
# each scaled by its largest magnitude; m a sign and 0 or 2^-6 .. 1, v 0 or 2^-14 .. 1 (a positive v never 0), both
# rounded stochastically between their two neighbours. Simulated here by ``blockwise``: the same grids and rounding
# (its draws, not the kernel's random bits).
_Q4_M = blockwise([0.0] + [2.0 ** (c - 7) for c in range(1, 8)])
_Q4_V = blockwise([0.0] + [2.0 ** (c - 15) for c in range(1, 16)], floor=True)


def _q4(x, kind, rng):
    return (_Q4_M if kind == "m" else _Q4_V)(x, kind, rng)


def rank1(grid, stochastic=False):
    """Li et al.'s (NeurIPS 2023) second moment: each element over the smaller of its row's and its column's
    maximum, onto ``grid`` (no zero: a positive value below the grid's smallest takes it)."""
    grid = np.asarray(grid, np.float64)

    def fmt(x, kind, rng):
        r = x.astype(np.float64)
        scale = np.minimum(r.max(axis=1, keepdims=True), r.max(axis=0, keepdims=True))
        y = np.where(scale > 0, r / np.where(scale > 0, scale, 1), 0)
        q = _round(y, grid, rng, stochastic)
        q = np.where((y > 0) & (q == 0), grid[grid > 0][0], q)
        return (q * scale).astype(np.float32)
    return fmt


def ratio(grid, v_fmt, stochastic=True, block_scale=True):
    """m kept as its ratio to the square root of the v stored beside it, r = m / sqrt(v_q) (|r| stays near or
    under 1: Adam's step, before the bias corrections), onto ``grid`` with a sign, scaled by each block's
    largest |r| (``block_scale``) or by ``RMAX``; read back as r_q * sqrt(v_q). Its error is then a share of the
    element's own step, where m's blockwise scale makes it a share of the block's largest m. The m format of a
    pair whose v format is ``v_fmt`` (the same random draws: v is quantized first, as the kernel would)."""
    grid = np.asarray(grid, np.float64)

    def fmt(pair, kind, rng):
        mi, v_q = pair
        root = np.sqrt(v_q.astype(np.float64))
        r = np.where(root > 0, mi / np.where(root > 0, root, 1), 0)
        b = _blocks(r)
        scale = np.abs(b).max(axis=-1, keepdims=True) if block_scale else np.full(b.shape[:-1] + (1,), RMAX)
        y = np.where(scale > 0, np.abs(b) / np.where(scale > 0, scale, 1), 0)
        q = np.sign(b) * _round(y, grid, rng, stochastic) * scale
        return (q.reshape(r.shape) * root).astype(np.float32)
    fmt.pair = v_fmt
    return fmt


RMAX = 1.2  # over the largest |m| / sqrt(v) that b1 = 0.9, b2 = 0.95 allow (sqrt(1.36), Cauchy-Schwarz)
LINEAR_M = np.arange(0, 8) / 7
# a sign and 7 magnitudes, finer near 0 (where most steps are)
SOFT_M = np.array([0, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1])
POW2_M = np.concatenate([[0.0], 2.0 ** np.arange(-6, 1)])  # the shipped m grid
POW2_V = np.concatenate([[0.0], 2.0 ** np.arange(-14, 1)])  # the shipped v grid
# a sign and "e2m1" magnitudes (fp4): 0, 0.5, 1, 1.5, 2, 3, 4, 6 over 6
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) / 6
# powers of 4 for m (a wider range, coarser steps): 0, 4^-6 .. 1
POW4_M = np.concatenate([[0.0], 4.0 ** np.arange(-6, 1)])
# "e3m1" for v: 16 magnitudes, (1 + f/2) 2^e, e = -7..0 (a range of 2^7 with half steps)
E3M1_V = np.sort(np.concatenate([2.0 ** np.arange(-7, 1), 1.5 * 2.0 ** np.arange(-8, 0)]))
E3M1_V = E3M1_V / E3M1_V.max()
LINEAR_V = np.arange(1, 17) / 16  # Li et al.'s linear map without zero
SQRT2_V = 2.0 ** (-np.arange(15, -1, -1) / 2)  # powers of sqrt(2): 2^-7.5 .. 1, half the shipped grid's steps
# a signed "dynamic exponent" 4-bit map (Dettmers' shape: the leading zeros an exponent of ten, then a fraction)
DE_M = np.array([0.0, 0.0033, 0.0167, 0.05, 0.1, 0.3, 0.55, 1.0])

# Finer v grids at more bits, and m at 7 bits (12 bits an element for both, m8v4's bytes): after the quality
# table's m8v4 row (+1.63%, conv_1b_quality_5dd390b.json), which v format would err as little as the 8-bit one's.
def powers(step_bits: int, codes: int) -> np.ndarray:
    """``codes`` magnitudes: 0 and 2^(-k / 2^step_bits) for k = 0 .. codes - 2 (steps of 2^(1/2^step_bits))."""
    return np.concatenate([[0.0], 2.0 ** (-np.arange(codes - 2, -1, -1) / 2 ** step_bits)])


def small_float(e_bits: int, m_bits: int) -> np.ndarray:
    """The magnitudes of an unsigned float of ``e_bits`` exponent bits (bias 2^e_bits - 1) and ``m_bits`` mantissa
    bits with subnormals, as the 8-bit format builds its e4m3 and e5m3 (code 0 is 0), over the largest: the 8-bit
    format's encoder with narrower fields."""
    bias = 2 ** e_bits - 1
    vals = {(f / 2 ** m_bits) * 2.0 ** (1 - bias) if e == 0 else (1 + f / 2 ** m_bits) * 2.0 ** (e - bias)
            for e in range(2 ** e_bits) for f in range(2 ** m_bits)}
    vals = np.array(sorted(vals))
    return vals / vals.max()


E4M1 = small_float(4, 1)  # 5 bits: steps of 1/2 and 1/3, 2^-15 .. 1 with subnormals
E3M3 = small_float(3, 3)  # 6 magnitude bits (7 with m's sign): steps of 1/8 .. 1/15, 2^-6 .. 1, subnormals to 2^-9
E4M2 = small_float(4, 2)
V5_SQRT2 = powers(1, 32)  # 5 bits: steps of sqrt(2), 2^-15 .. 1 (the shipped 4-bit v's range, half its steps)
V6_QUARTER = powers(2, 64)  # 6 bits: steps of 2^(1/4), 2^-15.5 .. 1
V5_QUARTER = powers(2, 32)  # 5 bits: steps of 2^(1/4), 2^-7.5 .. 1
M7_QUARTER = powers(2, 64)  # m in 7 bits: a sign and 63 magnitudes in steps of 2^(1/4), 2^-15.5 .. 1
V4_QUARTER = powers(2, 16)[1:]  # rank-1's v in 4 bits: steps of 2^(1/4), 2^-3.75 .. 1, no zero
V4_THIRD = 2.0 ** (-np.arange(15, -1, -1) / 3)  # rank-1's v in 4 bits: steps of 2^(1/3), 2^-5 .. 1

# name: (m's format, v's format, what it is)
FORMATS = {
    "float32": (_float32, _float32, "the reference"),
    "capacity_bf16": (_bfloat16_sr, _bfloat16_sr, "capacity mode: bfloat16 moments, stochastic rounding (passes)"),
    "q8_shipped": (_q8, _q8, "8-bit moments as shipped (passes)"),
    "q4_shipped": (_q4, _q4, "4-bit moments as shipped (fails: +3.19%)"),
    "q4_m_only": (_q4, _float32, "the shipped 4-bit m, float32 v"),
    "q4_v_only": (_float32, _q4, "float32 m, the shipped 4-bit v"),
    "pow2_rtn": (blockwise(POW2_M, False), blockwise(POW2_V, False, True), "the shipped grids, to nearest"),
    "e2m1_m_q4_v": (blockwise(E2M1), _q4, "m: a sign and fp4 magnitudes (range 12), stochastic; v shipped"),
    "pow4_m_q4_v": (blockwise(POW4_M), _q4, "m: powers of 4 (range 4^6), stochastic; v shipped"),
    "q4_m_e3m1_v": (_q4, blockwise(E3M1_V, True, True), "m shipped; v: e3m1 (range 2^7, half steps), stochastic"),
    "li_et_al": (blockwise(DE_M, False), rank1(LINEAR_V), "m: a dynamic-exponent map to nearest; v: rank-1, "
                 "linear without zero, to nearest (Li et al. 2023)"),
    "de_m_q4_v": (blockwise(DE_M, False), _q4, "m: the dynamic-exponent map to nearest; v shipped"),
    "de_m_sr_q4_v": (blockwise(DE_M), _q4, "m: the dynamic-exponent map, stochastic; v shipped"),
    "ratio_linear_q4_v": (ratio(LINEAR_M, _q4), _q4, "m as m / sqrt(v_q), linear, block scale, stochastic; v shipped"),
    "ratio_soft_q4_v": (ratio(SOFT_M, _q4), _q4, "m as m / sqrt(v_q), finer near 0, block scale, stochastic; "
                        "v shipped"),
    "ratio_soft_rtn_q4_v": (ratio(SOFT_M, _q4, stochastic=False), _q4, "m as m / sqrt(v_q), finer near 0, block "
                            "scale, to nearest; v shipped"),
    "ratio_soft_fixed_q4_v": (ratio(SOFT_M, _q4, block_scale=False), _q4, "m as m / sqrt(v_q), finer near 0, "
                              "scaled by 1.2 (no scale stored), stochastic; v shipped"),
    "ratio_soft_f32_v": (ratio(SOFT_M, _float32), _float32, "m as m / sqrt(v), finer near 0, block scale, "
                         "stochastic; float32 v"),
    "f32_m_rank1_sqrt2_v": (_float32, rank1(SQRT2_V, True), "float32 m; v over its rank-1 scale, powers of sqrt(2), "
                            "stochastic"),
    "ratio_soft_rank1_sqrt2_v": (ratio(SOFT_M, rank1(SQRT2_V, True)), rank1(SQRT2_V, True),
                                 "m as m / sqrt(v_q), finer near 0, block scale, stochastic; v over its rank-1 "
                                 "scale, powers of sqrt(2), stochastic"),
    "q8_m_q4_v": (_q8, _q4, "m in the shipped 8 bits, v in the shipped 4 (1.53 B/param for both)"),
    "q8_m_rank1_sqrt2_v": (_q8, rank1(SQRT2_V, True), "m in the shipped 8 bits; v in 4 over its rank-1 scale, "
                           "powers of sqrt(2), stochastic (~1.53 B/param for both)"),
    "q8_m_pow2_v_block32": (_q8, blockwise(POW2_V, True, True, 32), "m in the shipped 8 bits; v on the shipped "
                            "4-bit grid, a scale per 32 elements (~1.64 B/param for both)"),
    "q8_m_sqrt2_v": (_q8, blockwise(SQRT2_V, True, True), "m in the shipped 8 bits; v in 4 on a sqrt(2) grid "
                     "(2^-7.5 .. 1 of the block's largest), stochastic"),
    "q8_m_sqrt2_v_block32": (_q8, blockwise(SQRT2_V, True, True, 32), "m in the shipped 8 bits; v in 4 on a sqrt(2) "
                             "grid, a scale per 32 elements, stochastic (~1.64 B/param for both)"),
    "q8_m_v5_sqrt2": (_q8, blockwise(V5_SQRT2, True, True), "m in the shipped 8 bits; v in 5 on a sqrt(2) grid "
                      "(2^-15 .. 1), a scale per 128, stochastic (~1.69 B/param for both)"),
    "q8_m_v5_quarter": (_q8, blockwise(V5_QUARTER, True, True), "m in the shipped 8 bits; v in 5 on a 2^(1/4) grid "
                        "(2^-7.5 .. 1), a scale per 128, stochastic (~1.69 B/param for both)"),
    "q8_m_v6_quarter": (_q8, blockwise(V6_QUARTER, True, True), "m in the shipped 8 bits; v in 6 on a 2^(1/4) grid "
                        "(2^-15.5 .. 1), a scale per 128, stochastic (~1.81 B/param for both)"),
    "m7_v5_sqrt2": (blockwise(M7_QUARTER), blockwise(V5_SQRT2, True, True), "m in 7 bits (a sign, 2^(1/4) steps, "
                    "2^-15.5 .. 1), v in 5 on a sqrt(2) grid, a scale per 128 each, stochastic (~1.56 B/param: "
                    "m8v4's bytes)"),
    "q8_m_rank1_quarter_v": (_q8, rank1(V4_QUARTER, True), "m in the shipped 8 bits; v in 4 over its rank-1 scale, "
                             "steps of 2^(1/4) (2^-3.75 .. 1), stochastic (~1.53 B/param for both)"),
    "q8_m_rank1_third_v": (_q8, rank1(V4_THIRD, True), "m in the shipped 8 bits; v in 4 over its rank-1 scale, "
                           "steps of 2^(1/3) (2^-5 .. 1), stochastic (~1.53 B/param for both)"),
    "q8_m_v5_e4m1": (_q8, blockwise(E4M1, True, True), "m in the shipped 8 bits; v in 5 as a small float e4m1 "
                     "(2^-15 .. 1), a scale per 128, stochastic (~1.69 B/param for both)"),
    "m7_e3m3_v5_e4m1": (blockwise(E3M3), blockwise(E4M1, True, True), "m in 7 bits (a sign and e3m3), v in 5 (e4m1), "
                        "a scale per 128 each, stochastic (~1.56 B/param: m8v4's bytes)"),
    "m6_e4m1_v6_e4m2": (blockwise(E4M1), blockwise(E4M2, True, True), "m in 6 bits (a sign and e4m1), v in 6 (e4m2), "
                        "a scale per 128 each, stochastic (~1.56 B/param: m8v4's bytes)"),
    "q8_m_factored_v": (_q8, "factored", "m in the shipped 8 bits; v factored as Adafactor's (a row and a column "
                        "vector: ~0 B/param), the rest of AdamW unchanged"),
}


def gradients(rows, cols, steps, rng, outliers=0.01, snr=0.2):
    """A stream of gradients of one matrix: per column a size (log-normal, sigma 1; ``outliers`` of the columns
    20x), per row a size (log-normal, sigma 0.5), a fixed signal of ``snr`` times the noise's size, and noise
    with heavy tails (Student's t, 4 degrees of freedom, scaled to unit variance); each element's size is also
    jittered (log-normal, sigma 0.5), so that the second moment is not a row size times a column size."""
    col = np.exp(rng.normal(0, 1.0, cols))
    col[rng.random(cols) < outliers] *= 20
    row = np.exp(rng.normal(0, 0.5, rows))
    size = np.outer(row, col) * np.exp(rng.normal(0, 0.5, (rows, cols)))  # not rank 1: factoring v has a cost
    signal = snr * rng.normal(0, 1, (rows, cols))
    for _ in range(steps):
        noise = rng.standard_t(4, (rows, cols)) / np.sqrt(2.0)
        yield (size * (signal + noise)).astype(np.float32)


def measure(names, args):
    rng = np.random.default_rng(args.seed)
    states = {n: (np.zeros((args.rows, args.cols), np.float32),) * 2 for n in names}
    rngs = {n: np.random.default_rng(args.seed + 1 + i) for i, n in enumerate(names)}
    sums = {n: {"rel_err": [], "scale": [], "cos": []} for n in names}
    factored = {}
    for t, g in enumerate(gradients(args.rows, args.cols, args.steps, rng), start=1):
        bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
        updates = {}
        for n in names:
            m, v = states[n]
            mi = np.float32(B1) * m + np.float32(1 - B1) * g
            fm, fv, _ = FORMATS[n]
            if fv == "factored":  # Adafactor's second moment: EMAs of g^2's row and column means
                rows_, cols_ = factored.setdefault(n, (np.zeros(args.rows), np.zeros(args.cols)))
                g2 = g.astype(np.float64) ** 2
                rows_, cols_ = B2 * rows_ + (1 - B2) * g2.mean(axis=1), B2 * cols_ + (1 - B2) * g2.mean(axis=0)
                factored[n] = (rows_, cols_)
                vi = (np.outer(rows_, cols_) / max(rows_.mean(), 1e-30)).astype(np.float32)
                updates[n] = (mi / bc1) / (np.sqrt(vi / bc2) + EPS)
                states[n] = (fm(mi, "m", rngs[n]), v)
                continue
            vi = np.float32(B2) * v + np.float32(1 - B2) * g * g
            updates[n] = (mi / bc1) / (np.sqrt(vi / bc2) + EPS)
            v_q = fv(vi, "v", rngs[n])
            states[n] = (fm((mi, v_q), "m", rngs[n]) if hasattr(fm, "pair") else fm(mi, "m", rngs[n]), v_q)
        if t <= args.burn_in:
            continue
        ref = updates["float32"].astype(np.float64).ravel()
        norm = np.linalg.norm(ref)
        for n in names:
            u = updates[n].astype(np.float64).ravel()
            sums[n]["rel_err"].append(np.linalg.norm(u - ref) / norm)
            sums[n]["scale"].append(float(u @ ref) / norm ** 2)
            sums[n]["cos"].append(float(u @ ref) / (np.linalg.norm(u) * norm))
    return {n: {k: round(float(np.mean(v)), 4) for k, v in sums[n].items()} for n in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--burn-in", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = args.formats.split(",")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        sys.exit(f"unknown formats {unknown}; choose from {list(FORMATS)}")
    if "float32" not in names:
        names = ["float32"] + names
    if args.cols % max(Q4_BLOCK, Q8_BLOCK):
        sys.exit(f"--cols must be a multiple of {max(Q4_BLOCK, Q8_BLOCK)} (the blocks of a row)")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("MEGATRAIN_GIT_COMMIT", "unknown")
    t0 = time.perf_counter()
    result = measure(names, args)
    host_ram_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    record = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
              "git_commit": commit, "date": time.strftime("%Y-%m-%d"),
              "device": {"name": "CPU (numpy; no GPU)", "cpu_cores": os.cpu_count(), "host_ram_gib": host_ram_gib},
              "setup": {"adamw": {"b1": B1, "b2": B2, "eps": EPS}, **{k: v for k, v in vars(args).items()
                                                                    if k not in ("out", "formats")},
                        "gradients": gradients.__doc__.split(":", 1)[1].strip()},
              # one entry per moment format, all on the same gradients in this process
              "runs": [{"system": n, "what": FORMATS[n][2], "status": "ok", **result[n]} for n in names],
              "wall_s": round(time.perf_counter() - t0, 1)}
    for n in names:
        r = result[n]
        print(f"{n:16s} relative error {r['rel_err']:.4f}  along u32 {r['scale']:.4f}  cosine {r['cos']:.4f}"
              f"   {FORMATS[n][2]}")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
