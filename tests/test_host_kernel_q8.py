"""8-bit moments in the fused host AdamW kernel (megatrain_adamw_q8: bfloat16 p, m and v as one byte each
with a float32 scale per block) against its numpy reference; the formats and their stochastic rounding; the
bfloat16-gradient variant of the capacity kernel."""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from megatrain_jax.engine.update.host_kernel import adamw_numpy, adamw_sr_numpy, set_threads
from megatrain_jax.engine.update.q8 import (Q8_BLOCK, adamw_q8_numpy, adamw_q8_reference, q8_decode_m, q8_decode_v,
                                            q8_dequantize, q8_encode_m, q8_encode_v, q8_quantize, q8_scale_shape)

BF16 = ml_dtypes.bfloat16
HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.37, bc1=1 - 0.9 ** 7, bc2=1 - 0.95 ** 7)
CODES = np.arange(256, dtype=np.uint8)


def _documented(c: int, bias: int, signed: bool) -> float:
    """A code's value as the header writes it, in Python floats (independent of the implementations)."""
    sign = -1.0 if signed and c & 0x80 else 1.0
    mag = c & 0x7F if signed else c
    e, f = mag >> 3, mag & 7
    return sign * (f * 2.0 ** (1 - bias - 3) if e == 0 else (1 + f / 8) * 2.0 ** (e - bias))


def _state(rows: int, cols: int, block: int, seed: int, g_bf16: bool, quantize=q8_quantize):
    """bfloat16 p, m and v quantized by ``quantize`` (8-bit by default) with their scales, and g, of magnitudes
    that differ by orders from block to block, with some all-zero blocks of m, v and g."""
    rng = np.random.default_rng(seed)
    nb = -(-cols // block)
    block_scale = np.repeat(10.0 ** rng.uniform(-8, 1, (rows, nb)), block, axis=1)[:, :cols]
    zero = np.repeat(rng.random((rows, nb)) < 0.15, block, axis=1)[:, :cols]
    p = rng.standard_normal((rows, cols)).astype(BF16)
    m = np.where(zero, 0, rng.standard_normal((rows, cols)) * block_scale).astype(np.float32)
    v = np.where(zero, 0, np.abs(rng.standard_normal((rows, cols))) * block_scale ** 2).astype(np.float32)
    # element magnitudes spread too, down past the formats' smallest steps
    v *= 10.0 ** rng.uniform(-12, 0, (rows, cols)).astype(np.float32)
    g = np.where(zero & (rng.random((rows, nb)).repeat(block, axis=1)[:, :cols] < 0.5), 0,
                 rng.standard_normal((rows, cols)) * block_scale).astype(np.float32)
    m_codes, m_absmax = quantize(m, block, "m", seed=seed + 100)
    v_codes, v_absmax = quantize(v, block, "v", seed=seed + 100)
    return p, m_codes, v_codes, m_absmax, v_absmax, g.astype(BF16) if g_bf16 else g


def _kernel(lib, state, run=adamw_q8_numpy, **kw):
    """The kernel (``run``: 8-bit by default) on copies of (p, m, v, m_absmax, v_absmax, g); returns the new
    first five, p as uint16."""
    p, m, v, ma, va, g = (a.copy() for a in state)
    run(p, m, v, ma, va, g, lib=lib, **kw)
    return p.view(np.uint16), m, v, ma, va


def _assert_equal(got, want, what: str):
    for a, b, name in zip(got, want, ("p", "m", "v", "m_absmax", "v_absmax")):
        b = np.asarray(b)
        np.testing.assert_array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                                      b.view(np.uint32) if b.dtype == np.float32 else b, err_msg=f"{name}, {what}")


@pytest.mark.parametrize("g_bf16", [False, True], ids=["g_f32", "g_bf16"])
def test_kernel_matches_reference_bit_for_bit(lib, g_bf16):
    """One row, partial last blocks (cols not a multiple of block), blocks of 16 to 4096, arrays of many
    blocks (several threads), offsets up to the last counter; three steps in a row, each equal to the numpy
    reference in p's bits, every code and every scale.

    A float32 result one unit in the last place off changes a stochastically rounded p with probability 2^-16
    and a code with 2^-20 (a scale, stored as computed, shows it at once), so catching a different operation
    order takes millions of elements: hence the largest case, one step."""
    cases = [(1, 1000, 256, 0, 3), (7, 300, 128, 5, 3), (3, 2 * 4096 + 5, 4096, 0, 3), (13, 77, 16, 123, 3),
             (96, 2048 + 40, Q8_BLOCK, 2 ** 32 - 96 * 2088, 3), (1000, 2000, Q8_BLOCK, 0, 1)]
    for i, (rows, cols, block, offset, steps) in enumerate(cases):
        state = _state(rows, cols, block, i, g_bf16)
        moved = 0
        for step in range(steps):
            hp = dict(HP, block=block, seed=1000 * i + step, offset=offset)
            want = adamw_q8_reference(*state, **hp)
            got = _kernel(lib, state, **hp)
            _assert_equal(got, want, f"case {i}, step {step}")
            moved += (got[0] != state[0].view(np.uint16)).mean()
            state = (got[0].view(BF16), *got[1:], state[5])
        assert moved / steps > 0.3  # the updates moved p
        assert (state[1] != 0).mean() > 0.5 and (state[2] != 0).mean() > 0.5


def test_rows_in_pieces_equal_the_whole(lib):
    """Row ranges of one array (views into it, offset = the first element's flat index) write what one call
    on the whole array writes; offsets matter."""
    rows, cols, block = 40, 700, 256
    state = _state(rows, cols, block, 7, False)
    hp = dict(HP, block=block, seed=42)
    whole = _kernel(lib, state, **hp)
    pieces = [a.copy() for a in state]
    for a, b in ((0, 9), (9, 10), (10, 40)):
        adamw_q8_numpy(*(x[a:b] for x in pieces), lib=lib, offset=a * cols, **hp)
    _assert_equal((pieces[0].view(np.uint16), *pieces[1:5]), whole, "pieces")
    wrong = [a.copy() for a in state]
    for a, b in ((0, 9), (9, 40)):
        adamw_q8_numpy(*(x[a:b] for x in wrong), lib=lib, offset=0, **hp)
    assert not np.array_equal(wrong[1], whole[1])


def test_threads_do_not_change_results(lib):
    state = _state(64, 4096 + 13, 512, 8, True)
    hp = dict(HP, block=512, seed=9)
    try:
        set_threads(1, lib)
        one = _kernel(lib, state, **hp)
        set_threads(3, lib)
        three = _kernel(lib, state, **hp)
    finally:
        set_threads(0, lib)
    default = _kernel(lib, state, **hp)
    _assert_equal(one, default, "1 thread vs the default")
    _assert_equal(three, default, "3 threads vs the default")


def test_codes_decode_to_documented_values_and_round_trip():
    """Every code decodes to the value the header documents; encoding an exact value gives its code back
    whatever the random bits (-0 excepted: zero is always code 0)."""
    m, v = q8_decode_m(CODES), q8_decode_v(CODES)
    assert m.dtype == v.dtype == np.float32
    assert m.tolist() == [_documented(c, 15, True) for c in range(256)]
    assert v.tolist() == [_documented(c, 31, False) for c in range(256)]
    assert m.max() == v.max() == 1.875 and m.min() == -1.875
    assert np.all(np.diff(v) > 0) and np.all(np.diff(m[:128]) > 0)  # one value per code, in order
    rng = np.random.default_rng(0)
    for r in (np.zeros(256, np.uint32), np.full(256, 0xFFFFFFFF, np.uint32),
              rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32)):
        back_m = q8_encode_m(m, r)
        assert back_m[0x80] == 0
        np.testing.assert_array_equal(np.delete(back_m, 0x80), np.delete(CODES, 0x80))
        np.testing.assert_array_equal(q8_encode_v(v, r), CODES)


@pytest.mark.parametrize("kind", ["m", "v"])
def test_stochastic_rounding_is_unbiased(kind):
    """Values between codes (normal, subnormal, between the last subnormal and the first normal, just under
    the maximum): every result is one of the two neighbouring codes, the mean over every 2^20 low bits is the
    value exactly (for a subnormal value, one whose quotient by the step has no bits below 2^-20; off by less
    than 2^-20 steps otherwise), and the mean over random bits is within 5 standard errors of it (spacing / 2 /
    sqrt(N))."""
    decode, encode = (q8_decode_m, q8_encode_m) if kind == "m" else (q8_decode_v, q8_encode_v)
    grid = decode(CODES[:128] if kind == "m" else CODES).astype(np.float64)
    lo_code, sub = 17 if kind == "m" else 60, grid[1]
    ys = [grid[lo_code] + 0.37 * (grid[lo_code + 1] - grid[lo_code]),  # normal: every float32 is exact
          (3 + 639_631 / 2 ** 20) * sub,  # subnormal, 20-bit fixed point
          (7 + 209_715 / 2 ** 20) * sub,  # the last subnormal step
          grid[-2] + 0.9 * (grid[-1] - grid[-2])]  # under the maximum
    if kind == "m":
        ys.append(-ys[0])
    rng = np.random.default_rng(1)
    n = 2 ** 18
    every = np.arange(2 ** 20, dtype=np.uint32)
    for y in ys:
        y32 = np.float32(y)
        a = np.searchsorted(grid, abs(float(y32))) - 1
        lo, hi = grid[a], grid[a + 1]
        assert lo < abs(float(y32)) < hi
        exact = decode(encode(np.full(every.size, y32), every)).astype(np.float64)
        assert set(np.abs(np.unique(exact))) == {lo, hi}
        assert exact.sum() == float(y32) * every.size, (kind, y)
        off_grid = np.float32(grid[3] + 0.61 * (grid[4] - grid[3]))  # bits below 2^-20 of a step
        mean = decode(encode(np.full(every.size, off_grid), every)).astype(np.float64).mean()
        assert abs(mean - float(off_grid)) < (grid[4] - grid[3]) * 2.0 ** -20
        r = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
        mean = decode(encode(np.full(n, y32), r)).astype(np.float64).mean()
        assert abs(mean - float(y32)) < 5 * (hi - lo) / 2 / np.sqrt(n), (kind, y, mean)


def test_positive_v_never_rounds_to_zero():
    r = np.random.default_rng(2).integers(0, 2 ** 32, 10_000, dtype=np.uint64).astype(np.uint32)
    step = float(q8_decode_v(np.uint8(1)))
    for y in (step * 1e-3, step * 0.5, 1e-30, np.finfo(np.float32).smallest_subnormal):
        assert (q8_encode_v(np.full(r.size, y, np.float32), r) == 1).all(), y
    assert (q8_encode_v(np.zeros(r.size, np.float32), r) == 0).all()
    assert (q8_encode_m(np.full(r.size, step * 1e-3, np.float32), r) == 0).mean() > 0.99  # m has no such rule


def test_quantize_round_trip():
    """Zeros quantize to zero codes and scales; a bfloat16 moment comes back within its block's grid
    spacing, and its absmax element within an ulp; a 1-D array is one row."""
    codes, absmax = q8_quantize(np.zeros((3, 10)), 4, "v", seed=0)
    assert not codes.any() and not absmax.any() and absmax.shape == (3, 3) == q8_scale_shape((3, 10), 4)
    assert not q8_dequantize(codes, absmax, 4, "v").any()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 600)) * 0.01).astype(BF16)
    codes, absmax = q8_quantize(x, 256, "m", seed=1)
    back = q8_dequantize(codes, absmax, 256, "m")
    assert back.dtype == np.float32 and back.shape == x.shape
    xf = x.astype(np.float32)
    rel = np.abs(back - xf) / np.repeat(absmax, 256, axis=1)[:, :600]
    assert rel.max() <= 0.125 / 1.875 * 1.001  # one step of a 3-bit mantissa near the top
    top = np.abs(xf) == np.repeat(absmax, 256, axis=1)[:, :600]
    np.testing.assert_allclose(back[top], xf[top], rtol=2 ** -22, atol=0)  # 1.875 * (absmax / 1.875): an ulp
    assert q8_quantize(np.ones(1000), 256, "v", seed=0)[1].shape == (1, 4) == q8_scale_shape((1000,))


def test_sr_kernel_takes_a_bf16_gradient(lib):
    """megatrain_adamw_bf16_sr_g16 with bfloat16 g equals megatrain_adamw_bf16_sr with the same values as
    float32, bit for bit."""
    rng = np.random.default_rng(4)
    n = 300_007
    p = rng.standard_normal(n).astype(BF16)
    m = (rng.standard_normal(n) * 0.1).astype(BF16)
    v = (np.abs(rng.standard_normal(n)) * 0.01).astype(BF16)
    g16 = rng.standard_normal(n).astype(BF16)
    outs = []
    for g in (g16.astype(np.float32), g16, g16.view(np.uint16)):
        state = [a.copy() for a in (p, m, v)]
        adamw_sr_numpy(*state, g, lib=lib, seed=77, offset=11, **HP)
        outs.append([a.view(np.uint16) for a in state])
    for other in outs[1:]:
        for a, b in zip(other, outs[0]):
            np.testing.assert_array_equal(a, b)
    assert (outs[0][0] != p.view(np.uint16)).mean() > 0.3


def test_errors_are_clear(lib):
    state = _state(4, 100, 32, 5, False)
    hp = dict(HP, seed=0)
    for bad_block in (0, -1, 4097, 2.0):
        with pytest.raises(ValueError, match="block"):
            _kernel(lib, state, block=bad_block, **hp)
    with pytest.raises(ValueError, match="m_absmax"):  # scales of another block size
        _kernel(lib, state, block=64, **hp)
    p, m, v, ma, va, g = state
    bad = {"p": (p.astype(np.float32), m, v, ma, va, g), "m": (p, m.astype(np.int16), v, ma, va, g),
           "v": (p, m, v[:, :50], ma, va, g), "v_absmax": (p, m, v, ma, va.astype(np.float64), g),
           "g": (p, m, v, ma, va, g.astype(np.float64))}
    for name, args in bad.items():
        with pytest.raises(TypeError, match=name):
            _kernel(lib, args, block=32, **hp)
    with pytest.raises(ValueError, match="v_absmax"):
        _kernel(lib, (p, m, v, ma, va[:, :-1].copy(), g), block=32, **hp)
    with pytest.raises(ValueError, match="offset"):
        _kernel(lib, state, block=32, **dict(hp, offset=2 ** 32 - 399))
    with pytest.raises(ValueError, match="kind"):
        q8_quantize(np.zeros(4), 4, "x", seed=0)
    with pytest.raises(TypeError, match="g must be"):
        adamw_sr_numpy(p.ravel().copy(), p.ravel().copy(), p.ravel().copy(), g.ravel().astype(np.float16),
                       lib=lib, **hp)


@pytest.mark.parametrize("moment_dtype,within", [("q8", 0.03), ("m7v5", 0.05)])
def test_quantized_adamw_trains_a_least_squares_problem_as_well_as_float32(lib, moment_dtype, within):
    """A noisy least-squares fit, 400 steps of AdamW with a decaying learning rate: 8-bit moments (and
    bfloat16 parameters) end within 3% of float32 AdamW's loss, m7v5's within 5%, far below where they
    started."""
    from megatrain_jax.engine.update.moment_formats import FORMATS
    fmt = FORMATS[moment_dtype]
    rng = np.random.default_rng(5)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    w_true = rng.standard_normal((16, 64)).astype(np.float32)
    Y = X @ w_true.T + 0.3 * rng.standard_normal((256, 16)).astype(np.float32)
    w0 = (0.1 * rng.standard_normal((16, 64))).astype(BF16)

    def loss_grad(w):
        err = X @ w.T - Y
        return 0.5 * float((err ** 2).mean()), (err.T @ X / err.size).astype(np.float32)

    b1, b2, steps, block = 0.9, 0.95, 400, 32
    p32, m32, v32 = w0.astype(np.float32), np.zeros((16, 64), np.float32), np.zeros((16, 64), np.float32)
    pq = w0.copy()
    mq, vq = (np.zeros(fmt.codes_shape((16, 64), kind), np.uint8) for kind in ("m", "v"))
    ma, va = (np.zeros((16, -(-64 // block)), np.float32) for _ in range(2))
    for t in range(1, steps + 1):
        hp = dict(lr=3e-2 * (1 - t / steps) + 1e-4, b1=b1, b2=b2, eps=1e-8, wd=0.0, grad_scale=1.0,
                  bc1=1 - b1 ** t, bc2=1 - b2 ** t)
        adamw_numpy(p32, m32, v32, loss_grad(p32)[1], None, lib=lib, **hp)
        g = loss_grad(pq.astype(np.float32))[1]
        fmt.inplace(lib, pq.ctypes.data, mq.ctypes.data, vq.ctypes.data, ma.ctypes.data, va.ctypes.data,
                    g.ctypes.data, 16, 64, block=block, g_bf16=False, seed=t, offset=0, **hp)
    start, f32, quantized = (loss_grad(w.astype(np.float32))[0] for w in (w0, p32, pq))
    assert f32 < 0.01 * start
    assert abs(quantized - f32) < within * f32, (quantized, f32)