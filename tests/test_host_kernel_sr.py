"""Capacity mode of the fused host AdamW kernel (megatrain_adamw_bf16_sr: bfloat16 p, m, v written back with
stochastic rounding) against its jnp reference, and the rounding itself."""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from megatrain_jax.engine.update.host_kernel import (adamw_sr_numpy, adamw_sr_reference, set_threads, sr_bits,
                                       stochastic_round_bf16)

BF16 = ml_dtypes.bfloat16
HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.37, bc1=1 - 0.9 ** 7, bc2=1 - 0.95 ** 7)


def _state(n: int, seed: int):
    """bfloat16 p, m, v (v >= 0) and float32 g, with m and v of optimizer-like magnitudes."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(BF16)
    m = (rng.standard_normal(n) * 0.1).astype(BF16)
    v = (np.abs(rng.standard_normal(n)) * 0.01).astype(BF16)
    return p, m, v, rng.standard_normal(n).astype(np.float32)


def _kernel(lib, p, m, v, g, **kw):
    """The kernel on copies; returns the new (p, m, v) as uint16 bits."""
    p, m, v = (a.copy() for a in (p, m, v))
    adamw_sr_numpy(p, m, v, g.copy(), lib=lib, **kw)
    return tuple(a.view(np.uint16) for a in (p, m, v))


def _bits(arrays):
    # np.asarray blocks: the reference must be finished before any kernel writes into buffers JAX may alias.
    return tuple(np.asarray(a).view(np.uint16) for a in arrays)


def _mix_py(x: int) -> int:
    """lowbias32 as the spec writes it, in plain Python integers (independent of the jnp and C++ versions)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_sr_bits_follow_the_spec():
    for seed, stream, offset in ((0, 0, 0), (0xDEADBEEF, 1, 12345), (0xFFFFFFFF, 2, 2 ** 32 - 5)):
        key = _mix_py(seed ^ ((0x9E3779B9 * (stream + 1)) & 0xFFFFFFFF))
        want = [_mix_py(((offset + i) & 0xFFFFFFFF) ^ key) for i in range(5)]
        got = np.asarray(sr_bits(seed, stream, offset, 5))
        assert got.dtype == np.uint32
        assert got.tolist() == want, (seed, stream, offset)


def test_stochastic_round_threshold_and_specials():
    """The dropped 16 bits plus r's low 16 carry into bit 16 exactly when their sum reaches 2^16; NaN comes
    back quiet with its sign, inf as inf, whatever r is."""
    mid = np.array([0x3F808000], np.uint32).view(np.float32)  # 1 + 2^-8: halfway between 1 and 1 + 2^-7
    r = np.array([0, 0x7FFF, 0x8000, 0xFFFF, 0xABCD7FFF, 0x12348000], np.uint32)
    got = np.asarray(stochastic_round_bf16(np.repeat(mid, r.size), r)).view(np.uint16)
    assert got.tolist() == [0x3F80, 0x3F80, 0x3F81, 0x3F81, 0x3F80, 0x3F81]
    neg = np.asarray(stochastic_round_bf16(-np.repeat(mid, r.size), r)).view(np.uint16)
    assert neg.tolist() == [0xBF80, 0xBF80, 0xBF81, 0xBF81, 0xBF80, 0xBF81]  # the magnitude rounds up
    special = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000], np.uint32)
    x = special.view(np.float32)
    for rr in (0, 0xFFFF, 0xFFFFFFFF):
        got = np.asarray(stochastic_round_bf16(x, np.full(x.size, rr, np.uint32))).view(np.uint16)
        assert got.tolist() == [0x7FC0, 0xFFC0, 0x7FC0, 0xFFC0, 0x7F80, 0xFF80], hex(rr)


@pytest.mark.parametrize("x", [1.0 + 0.3 * 2 ** -7, -(1.0 + 0.3 * 2 ** -7), 3.0e-5 * (1 + 0.77 * 2 ** -7)])
def test_stochastic_round_is_unbiased(x):
    """Over all 2^16 values of the low bits the mean is x exactly; over random r (numpy's, and the kernel's
    hash) within a few standard errors of x; round-to-nearest is off by far more."""
    x32 = np.float32(x)
    t = np.array([x32]).view(np.uint32) & np.uint32(0xFFFF0000)  # truncated toward zero, and one step out
    lo, hi = (np.abs(b.view(np.float32).astype(np.float64)[0]) for b in (t, t + np.uint32(0x10000)))
    ulp = hi - lo
    f = (abs(np.float64(x32)) - lo) / ulp  # probability of rounding the magnitude up
    assert 0.1 < f < 0.9
    every = np.asarray(stochastic_round_bf16(np.full(65536, x32), np.arange(65536, dtype=np.uint32)))
    assert every.astype(np.float64).sum() == np.float64(x32) * 65536
    n = 200_000
    se = ulp * np.sqrt(f * (1 - f) / n)
    rng = np.random.default_rng(0)
    for r in (rng.integers(0, 2 ** 32, n, dtype=np.uint32), sr_bits(1234, 0, 0, n)):
        mean = np.asarray(stochastic_round_bf16(np.full(n, x32), r)).astype(np.float64).mean()
        assert abs(mean - np.float64(x32)) < 5 * se, (mean, x32, se)
    nearest = np.float64(np.float32(x32).astype(BF16))
    assert abs(nearest - np.float64(x32)) > 100 * se


def test_kernel_matches_reference_bit_for_bit(lib):
    """Sizes under one block, mid-block, over several chunks (so several threads), with weight decay on and
    off, offsets up to the last counter, one and four threads: the kernel equals the jnp reference bit for bit,
    run eagerly and under jit (the reference's barriers keep XLA from fusing multiply-adds).

    A float32 result one unit in the last place off changes its stochastically rounded bfloat16 with
    probability 2^-16 only, whatever the data, so catching a different operation order takes millions of
    elements: hence the largest case."""
    big = 2_000_003
    cases = [(1, 0.1, 0.37, 0), (31, 0.0, 1.7, 5), (1000, 0.1, 1.7, 77), (65_536 * 2 + 37, 0.0, 0.37, 0),
             (big, 0.1, 2.5, 2 ** 32 - big)]
    try:
        for i, (n, wd, gs, offset) in enumerate(cases):
            p, m, v, g = _state(n, i)
            hp = dict(HP, wd=wd, grad_scale=gs, seed=0xC0FFEE + i, offset=offset)
            want = _bits(adamw_sr_reference(p, m, v, g, **hp))
            if n == big:
                jitted = _bits(jax.jit(functools.partial(adamw_sr_reference, **hp))(p, m, v, g))
                for a, b, name in zip(jitted, want, "pmv"):
                    np.testing.assert_array_equal(a, b, err_msg=f"jit reference {name}")
            for threads in (1, 4):
                set_threads(threads, lib)
                got = _kernel(lib, p, m, v, g, **hp)
                for a, b, name in zip(got, want, "pmv"):
                    np.testing.assert_array_equal(a, b, err_msg=f"{name}, n={n}, threads={threads}")
            if n >= 1000:
                assert (want[0] != p.view(np.uint16)).mean() > 0.1  # the update moved p
    finally:
        set_threads(0, lib)


def test_pieces_equal_the_whole(lib):
    n, cuts = 200_003, (70_001, 131_111)
    p, m, v, g = _state(n, 10)
    hp = dict(HP, seed=99)
    whole = _kernel(lib, p, m, v, g, **hp)
    bounds = (0, *cuts, n)
    pieces = [_kernel(lib, p[a:b].copy(), m[a:b].copy(), v[a:b].copy(), g[a:b].copy(), **dict(hp, offset=a))
              for a, b in zip(bounds, bounds[1:])]
    for k, name in enumerate("pmv"):
        np.testing.assert_array_equal(np.concatenate([piece[k] for piece in pieces]), whole[k], err_msg=name)
    # and the offsets matter: every piece at offset 0 is not the whole
    wrong = [_kernel(lib, p[a:b].copy(), m[a:b].copy(), v[a:b].copy(), g[a:b].copy(), **hp)
             for a, b in zip(bounds, bounds[1:])]
    assert not np.array_equal(np.concatenate([piece[1] for piece in wrong]), whole[1])


def test_seeds(lib):
    """Same seed, same bits; another seed changes the random bits of (nearly) every element, and so the
    rounding of every element whose dropped bits it moves across the carry: about 2 f (1 - f), a third of the
    elements per stream for uniform f, most elements in at least one of p, m, v."""
    n = 100_000
    p, m, v, g = _state(n, 11)
    a = _kernel(lib, p, m, v, g, **HP, seed=1)
    b = _kernel(lib, p, m, v, g, **HP, seed=1)
    c = _kernel(lib, p, m, v, g, **HP, seed=2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    differ = [x != y for x, y in zip(a, c)]
    for d, name in zip(differ, "pmv"):
        assert d.mean() > 0.2, (name, d.mean())
    assert np.logical_or.reduce(differ).mean() > 0.5
    bits = [np.asarray(sr_bits(s, k, 0, n)) for s in (1, 2) for k in range(3)]
    for i in range(len(bits)):
        for j in range(i):
            assert ((bits[i] & 0xFFFF) != (bits[j] & 0xFFFF)).mean() > 0.99, (i, j)


def test_tiny_updates_move_p_on_average(lib):
    """p = 1 with an update of a quarter of a bfloat16 step below 1 (lr tiny, no weight decay): round to nearest
    would leave every p at 1; stochastic rounding moves the mean by the update, within statistical error."""
    n = 200_000
    step = 2.0 ** -8  # bfloat16 spacing just below 1
    hp = dict(lr=0.25 * step, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, grad_scale=1.0, bc1=1 - 0.9, bc2=1 - 0.999)
    p = np.ones(n, BF16)
    m, v = np.zeros(n, BF16), np.zeros(n, BF16)
    g = np.ones(n, np.float32)
    # The float32 value the kernel rounds (same operations in the same order).
    f32 = np.float32
    gi = f32(1) * f32(hp["grad_scale"])
    mi = f32(hp["b1"]) * f32(0) + (f32(1) - f32(hp["b1"])) * gi
    vi = f32(hp["b2"]) * f32(0) + ((f32(1) - f32(hp["b2"])) * gi) * gi
    u = (mi * (f32(1) / f32(hp["bc1"]))) / (np.sqrt(vi * (f32(1) / f32(hp["bc2"]))) + f32(hp["eps"]))
    target = np.float64(f32(1) - f32(hp["lr"]) * u)
    assert 0.2 * step < 1 - target < 0.3 * step
    assert np.float64(np.float32(target).astype(BF16)) == 1.0  # round to nearest: no movement at all
    new_p, new_m, _ = (x.view(BF16).astype(np.float64) for x in _kernel(lib, p, m, v, g, **hp, seed=5))
    assert set(np.unique(new_p)) == {1.0 - step, 1.0}
    f = (1 - target) / step  # probability of rounding down to 1 - step
    se = step * np.sqrt(f * (1 - f) / n)
    assert abs(new_p.mean() - target) < 5 * se, (new_p.mean(), target, se)
    assert 1 - new_p.mean() > 100 * se
    # m = 0.1 is not a bfloat16 either: its mean is 0.1 (as float32) too
    m_step = 2.0 ** -11
    fm = (np.float64(mi) - 0.099609375) / m_step
    assert abs(new_m.mean() - np.float64(mi)) < 5 * m_step * np.sqrt(fm * (1 - fm) / n)


def test_nan_and_inf(lib):
    """g = NaN makes p, m, v NaN; v = inf stays inf (and makes the step 0); m = -inf stays -inf (and sends
    p to +inf); a NaN p stays NaN; NaNs are written as the canonical quiet NaN with their sign, payloads
    dropped; all as the reference writes them. (p = inf gives NaN, weight decay or not: wd * p is 0 * inf.)"""
    n = 64
    p, m, v, g = _state(n, 12)
    g[3] = np.array([0xFFA00000], np.uint32).view(np.float32)[0]  # signalling, payload in the high bits
    g[8] = np.nan
    v[5], m[6] = np.inf, -np.inf
    p[7:8].view(np.uint16)[0] = 0x7FC5  # quiet, with a payload
    hp = dict(HP, seed=3)
    want = _bits(adamw_sr_reference(p, m, v, g, **hp))
    got = _kernel(lib, p, m, v, g, **hp)
    for a, b, name in zip(got, want, "pmv"):
        np.testing.assert_array_equal(a, b, err_msg=name)
    gp, gm, gv = (x.view(BF16).astype(np.float32) for x in got)
    assert np.isnan(gp[[3, 8]]).all() and np.isnan(gm[[3, 8]]).all() and np.isnan(gv[[3, 8]]).all()
    assert gv[5] == np.inf and np.isfinite(gp[5]) and np.isfinite(gm[5])
    assert gm[6] == -np.inf and gp[6] == np.inf and np.isfinite(gv[6])
    assert np.isnan(gp[7])
    for x in got:
        nan = np.isnan(x.view(BF16).astype(np.float32))
        assert ((x[nan] & 0x7FFF) == 0x7FC0).all()  # canonical quiet NaN
    assert got[0][3] & 0x8000 and got[0][7] == 0x7FC0  # sign kept
    others = np.ones(n, bool)
    others[[3, 5, 6, 7, 8]] = False
    assert all(np.isfinite(x.view(BF16).astype(np.float32)[others]).all() for x in got)


def test_counter_range_is_checked(lib):
    n = 10
    p, m, v, g = _state(n, 13)
    _kernel(lib, p, m, v, g, **HP, seed=0, offset=2 ** 32 - n)  # the last counters: fine
    for bad in (dict(seed=0, offset=2 ** 32 - n + 1), dict(seed=0, offset=-1), dict(seed=2 ** 32, offset=0),
                dict(seed=-1, offset=0)):
        with pytest.raises(ValueError):
            _kernel(lib, p, m, v, g, **HP, **bad)
        with pytest.raises(ValueError):
            sr_bits(bad["seed"], 0, bad["offset"], n)
    with pytest.raises(TypeError):
        adamw_sr_numpy(p.astype(np.float32), m, v, g, lib=lib, seed=0, **HP)
