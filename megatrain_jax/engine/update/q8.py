"""The 8-bit Adam moments of ``EngineConfig.moment_dtype="q8"`` (issue 35): the formats, the numpy reference of the
host kernel's entry point ``megatrain_adamw_q8`` (``adamw_q8_reference``) and its wrappers (``adamw_q8_inplace``,
``adamw_q8_numpy``): p bfloat16 as in capacity mode, g float32 or bfloat16, and m and v
one byte per element with one float32 scale (the absmax) per block of ``block`` elements of a row (the array
viewed as rows x cols; a row's last block may be shorter). The bytes are small floats of our own, scaled so
that the block's largest magnitude is 1.875: m a sign and "e4m3" (exponent bias 15, subnormals), v an
unsigned "e5m3" (bias 31), a range of 2^15 and 2^31 below the block's maximum (``q8_decode_m``,
``q8_decode_v``). Both are rounded stochastically (``q8_encode_m``, ``q8_encode_v``), because round-to-nearest
would freeze v: an EMA step of (1 - b2), 5% or less, is under half a step of a 3-bit mantissa (6% to 12%) and
would be rounded away, so v could never decay; with stochastic rounding its expectation is exact. A positive
v never gets code 0 (code 1 instead: a bias only below the smallest step), which keeps sqrt(v) away from 0
where m may be nonzero. ``q8_quantize`` and ``q8_dequantize`` convert a float moment to codes and scales and
back (state conversion); the reference is written with them.

Which leaves have them: ``q8_leaf`` (the engine and the memory plan both ask it).
"""

from __future__ import annotations

import ctypes

import numpy as np

from megatrain_jax.engine.update import host_kernel

Q8_BLOCK = 256  # the default quantization block: elements of a row that share one scale
Q8_MAX_BLOCK = 4096  # the kernel's per-thread buffers hold one block of this many floats
Q8_MIN_SIZE = 4096  # under moment_dtype="q8", leaves of fewer elements (or under 2 dimensions) keep bfloat16 moments
Q8_VMAX = np.float32(1.875)  # the largest value of both formats, (1 + 7/8) * 2^0: a block's absmax maps to it
_Q8_BIAS = {"m": 15, "v": 31}  # exponent bias of each moment's format
_Q8_STREAM = {"m": 1, "v": 2}  # the random stream that rounds it (0 rounds p)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def q8_leaf(shape: tuple[int, ...]) -> bool:
    """Whether a leaf of this shape keeps 8-bit moments under ``moment_dtype="q8"``: a matrix (2+ dimensions) of
    ``Q8_MIN_SIZE``+ elements. Vectors and small leaves keep bfloat16 moments: their bytes are negligible, and
    a scale per few elements would cost more than it saves. The engine and the memory plan both ask here."""
    return len(shape) >= 2 and int(np.prod(shape)) >= Q8_MIN_SIZE


def q8_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the row view of an array of this shape: (shape[0], product of the rest); an array of
    one dimension (or none) is one row, so a bias vector is not cut into blocks of one element."""
    if len(shape) <= 1:
        return 1, int(np.prod(shape, dtype=np.int64))
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


def q8_scale_shape(shape: tuple[int, ...], block: int = Q8_BLOCK) -> tuple[int, int]:
    """Shape of the float32 scales (absmax per block) of an 8-bit moment of this shape: (rows, ceil(cols /
    block))."""
    _check_block(block)
    rows, cols = q8_rows(shape)
    return rows, -(-cols // block)


def _check_block(block) -> None:
    if not (isinstance(block, (int, np.integer)) and 0 < int(block) <= Q8_MAX_BLOCK):
        raise ValueError(f"block must be an integer in [1, {Q8_MAX_BLOCK}], got {block!r}")


def grid_decode(c: np.ndarray, bias: int, mant: int = 3) -> np.ndarray:
    """Exact float32 value of magnitude codes c (uint32, exponent c >> mant, mantissa the low ``mant`` bits; the
    8-bit format's 3, m7v5's fewer): a normal code is its float32 bit pattern, a subnormal one (exponent 0)
    f * 2^(1 - bias - mant). The kernel's ``Q8Grid<bias, mant>::decode``."""
    c = np.asarray(c, np.uint32)
    e, f = c >> np.uint32(mant), c & np.uint32(2 ** mant - 1)
    normal = (((e + np.uint32(127 - bias)) << np.uint32(23)) | (f << np.uint32(23 - mant))).view(np.float32)
    return np.where(e == 0, f.astype(np.float32) * np.float32(2.0 ** (1 - bias - mant)), normal)


def grid_encode(y: np.ndarray, r: np.ndarray, bias: int, mant: int = 3) -> np.ndarray:
    """Stochastic rounding of float32 y in [0, largest] to magnitude codes (uint32) with uint32 random bits r (low
    20 used), as the kernel's ``Q8Grid<bias, mant>::encode``: from the smallest normal 2^(1 - bias) up, the
    random bits, at the top of the 23 - mant mantissa bits that truncation drops, carry into the kept ones with
    probability (dropped bits) / 2^(23 - mant) (to 2^-20); below, t = y / 2^(1 - bias - mant) in fixed point
    (exact when t has no bits below 2^-20) rounds up with probability of its fraction. Mean over r: y (within
    2^-20 steps where t has lower bits)."""
    drop = 23 - mant
    u = np.ascontiguousarray(y, np.float32).view(np.uint32)
    low = (np.asarray(r, np.uint32) & np.uint32(0xFFFFF)) << np.uint32(3 - mant)
    normal = ((u + low) >> np.uint32(drop)) - np.uint32((127 - bias) << mant)
    shift = np.uint32(128 - bias) - (u >> 23)  # >= 1 below the smallest normal (wraps above it: not used there)
    fixed = ((u & np.uint32(0x7FFFFF)) | np.uint32(0x800000)) >> np.minimum(shift, np.uint32(31))
    return np.where(u >= np.uint32((128 - bias) << 23), normal, (fixed + low) >> np.uint32(drop))


def q8_decode_m(codes) -> np.ndarray:
    """Exact float32 values of m codes (uint8, before scaling): bit 7 the sign, the low 7 an "e4m3" magnitude
    (bias 15, subnormals): (1 + f/8) 2^(e - 15) for exponent e > 0, f 2^-17 for e = 0; 0 to 1.875."""
    c = np.asarray(codes, np.uint8).astype(np.uint32)
    mag = grid_decode(c & np.uint32(0x7F), _Q8_BIAS["m"])
    return (mag.view(np.uint32) | ((c & np.uint32(0x80)) << 24)).view(np.float32)


def q8_decode_v(codes) -> np.ndarray:
    """Exact float32 values of v codes (uint8, before scaling): an unsigned "e5m3" (bias 31, subnormals),
    (1 + f/8) 2^(e - 31) for exponent e > 0, f 2^-33 for e = 0; 0 to 1.875."""
    return grid_decode(np.asarray(codes, np.uint8).astype(np.uint32), _Q8_BIAS["v"])


def q8_encode_m(x, r) -> np.ndarray:
    """m codes (uint8) of scaled float32 values x (magnitudes clamped to 1.875, NaN to 1.875 too), rounded
    stochastically with uint32 random bits r (see ``grid_encode``); zero is always code 0, never -0."""
    x = np.asarray(x, np.float32)
    ax = np.abs(x)
    mag = grid_encode(np.where(ax < Q8_VMAX, ax, Q8_VMAX), r, _Q8_BIAS["m"]) & np.uint32(0x7F)
    sign = np.where(np.signbit(x), np.uint32(0x80), np.uint32(0))
    return (mag | np.where(mag != 0, sign, np.uint32(0))).astype(np.uint8)


def q8_encode_v(y, r) -> np.ndarray:
    """v codes (uint8) of scaled float32 values y >= 0 (clamped to 1.875, NaN to 1.875 too), rounded
    stochastically with uint32 random bits r (see ``grid_encode``); a positive y never gets code 0 (code 1,
    the smallest step, instead)."""
    y = np.asarray(y, np.float32)
    yc = np.ascontiguousarray(np.where(y < Q8_VMAX, y, Q8_VMAX), np.float32)
    c = grid_encode(yc, r, _Q8_BIAS["v"]) & np.uint32(0xFF)
    return np.maximum(c, np.minimum(yc.view(np.uint32), np.uint32(1))).astype(np.uint8)


def _q8_kind(kind: str) -> str:
    if kind not in _Q8_BIAS:
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    return kind


def _block_sizes(cols: int, block: int) -> np.ndarray:
    """Elements of each block of a row: block, ..., block, the rest."""
    starts = np.arange(0, cols, block)
    return np.minimum(starts + block, cols) - starts


def q8_quantize(x, block: int, kind: str, *, seed: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float moment (any float dtype, e.g. the bfloat16 m or v of a capacity-mode checkpoint, or zeros) as
    8-bit codes (uint8, x's shape) and scales (float32, ``q8_scale_shape``), exactly as the kernel writes a
    moment it has computed: absmax = max |x| (m) or max x (v) per block, y = x * min(1.875 / absmax, FLT_MAX)
    (the cap maps a block of zeros to zeros), codes from ``q8_encode_m``/``q8_encode_v`` with the random bits
    of the moment's stream (``sr_bits``: 1 for m, 2 for v) under ``seed`` from global index ``offset``."""
    _check_block(block)
    kind = _q8_kind(kind)
    x = np.asarray(x).astype(np.float32)
    rows, cols = q8_rows(x.shape)
    x2 = x.reshape(rows, cols)
    sizes = _block_sizes(cols, block)
    if x.size == 0:
        return np.zeros(x.shape, np.uint8), np.zeros((rows, sizes.size), np.float32)
    a = np.abs(x2) if kind == "m" else x2
    absmax = np.maximum(np.maximum.reduceat(a, np.arange(0, cols, block), axis=1), np.float32(0))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        q = Q8_VMAX / absmax
    inv = np.where(q < _F32_MAX, q, _F32_MAX).astype(np.float32)
    y = x2 * np.repeat(inv, sizes, axis=1)
    r = np.asarray(host_kernel.sr_bits(seed, _Q8_STREAM[kind], offset, x.size)).reshape(rows, cols)
    codes = q8_encode_m(y, r) if kind == "m" else q8_encode_v(y, r)
    return codes.reshape(x.shape), absmax.astype(np.float32)


def q8_dequantize(codes, absmax, block: int, kind: str) -> np.ndarray:
    """The float32 moment that codes and scales stand for, as the kernel reads it: decode(code) * (absmax /
    1.875), the factor computed once per block in float32. Shape of ``codes``."""
    _check_block(block)
    kind = _q8_kind(kind)
    codes = np.asarray(codes, np.uint8)
    rows, cols = q8_rows(codes.shape)
    sizes = _block_sizes(cols, block)
    absmax = np.asarray(absmax, np.float32)
    if absmax.shape != (rows, sizes.size):
        raise ValueError(f"absmax must have shape {(rows, sizes.size)} for codes of shape {codes.shape} and "
                         f"block {block}, got {absmax.shape}")
    values = (q8_decode_m if kind == "m" else q8_decode_v)(codes).reshape(rows, cols)
    return (values * np.repeat(absmax / Q8_VMAX, sizes, axis=1)).reshape(codes.shape)


def _bf16_bits_to_f32(a) -> np.ndarray:
    """float32 values of bfloat16 data (ml_dtypes.bfloat16 or its uint16 bits)."""
    a = np.asarray(a)
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def adamw_q8_reference(p, m, v, m_absmax, v_absmax, g, *, block: int, lr, b1, b2, eps, wd, grad_scale, bc1, bc2,
                       seed: int, offset: int = 0):
    """What ``megatrain_adamw_q8`` computes, in numpy float32, operation for operation (1 - b1, 1 - b2, 1 / bc1
    and 1 / bc2 computed once in float32; numpy neither fuses nor reorders): p bfloat16 (or uint16 bits), m and
    v uint8 codes, scales float32 of ``q8_scale_shape``, g float32 or bfloat16 (or uint16 bits). Returns the new
    (p as uint16 bits, m codes, v codes, m scales, v scales), equal to the kernel's bit for bit."""
    return quantized_adamw_reference(
        p, q8_dequantize(m, m_absmax, block, "m"), q8_dequantize(v, v_absmax, block, "v"), g,
        lambda x, kind: q8_quantize(x, block, kind, seed=seed, offset=offset), lr=lr, b1=b1, b2=b2, eps=eps, wd=wd,
        grad_scale=grad_scale, bc1=bc1, bc2=bc2, seed=seed, offset=offset)


def quantized_adamw_reference(p, m0, v0, g, quantize, *, lr, b1, b2, eps, wd, grad_scale, bc1, bc2, seed: int,
                              offset: int = 0):
    """The AdamW step of the quantized kernels in numpy float32, from the moments already dequantized (``m0``,
    ``v0`` float32 of p's shape) to ``quantize(x, "m" | "v")`` of the new ones (codes, scales): the new (p as
    uint16 bits, m codes, v codes, m scales, v scales). ``adamw_q8_reference`` and ``m7v5.adamw_m7v5_reference``."""
    f32 = np.float32
    shape = np.shape(p)
    p0 = _bf16_bits_to_f32(p).reshape(shape)
    g = np.asarray(g)
    g = (g.astype(np.float32) if g.dtype == np.float32 else _bf16_bits_to_f32(g)).reshape(shape)
    lr, b1, b2, eps, wd, grad_scale, bc1, bc2 = (f32(x) for x in (lr, b1, b2, eps, wd, grad_scale, bc1, bc2))
    one_b1, one_b2, inv_bc1, inv_bc2 = f32(1) - b1, f32(1) - b2, f32(1) / bc1, f32(1) / bc2
    gi = g * grad_scale
    mi = b1 * m0 + one_b1 * gi
    vi = b2 * v0 + (one_b2 * gi) * gi
    u = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2) + eps) + wd * p0
    pi = p0 - lr * u
    new_p = np.asarray(host_kernel.stochastic_round_bf16(pi.reshape(-1), host_kernel.sr_bits(seed, 0, offset, pi.size)))
    new_m, new_m_absmax = quantize(mi, "m")
    new_v, new_v_absmax = quantize(vi, "v")
    return new_p.view(np.uint16).reshape(shape), new_m, new_v, new_m_absmax, new_v_absmax


def adamw_q8_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, m_absmax: int, v_absmax: int, g: int, n_rows: int,
                     cols: int, *, block: int, g_bf16: bool, lr: float, b1: float, b2: float, eps: float,
                     wd: float, grad_scale: float, bc1: float, bc2: float, seed: int, offset: int,
                     part: str = "whole") -> None:
    """8-bit moments on raw buffer addresses: ``n_rows`` rows of ``cols`` elements of bfloat16 p (in place,
    stochastically rounded), uint8 m and v codes and their float32 scales (n_rows x ceil(cols / block),
    row-major; in place), g float32 or, where ``g_bf16``, bfloat16. Whole rows of a bigger array: pass the
    addresses of its first row and ``offset`` = the flat index of its first element. ValueError unless
    0 < block <= 4096 (the kernel's precondition), 0 <= seed < 2^32 and 0 <= offset, offset + n <= 2^32. ``part``: the whole update, or one pass of it
    (``host_kernel.QUANTIZED_PASSES``: "stream" writes p alone, "commit" then the codes and scales alone, from the
    same old codes and gradient; the two leave what "whole" does)."""
    _check_block(block)
    if n_rows < 0 or cols < 0:
        raise ValueError(f"need n_rows, cols >= 0, got {n_rows}, {cols}")
    host_kernel.check_seed_offset(int(seed), int(offset), int(n_rows) * int(cols))
    lib.megatrain_adamw_q8(p, m, v, m_absmax, v_absmax, g, int(bool(g_bf16)), n_rows, cols, block, lr, b1, b2, eps,
                           wd, grad_scale, bc1, bc2, seed, offset, host_kernel.quantized_pass(part))


def adamw_q8_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, m_absmax: np.ndarray, v_absmax: np.ndarray,
                   g: np.ndarray, *, block: int = Q8_BLOCK, seed: int, offset: int = 0,
                   lib: ctypes.CDLL | None = None, **hp) -> None:
    """8-bit moments on numpy arrays, in place: p contiguous bfloat16 (uint16 bits or ml_dtypes.bfloat16) of
    any shape, viewed as rows x cols (``q8_rows``); m and v contiguous uint8 codes of p's size; m_absmax and
    v_absmax contiguous float32 of shape ``q8_scale_shape(p.shape, block)``; g contiguous float32 or bfloat16 of
    p's size. See ``adamw_q8_inplace``."""
    lib = host_kernel.require(lib)
    _check_block(block)
    g_bf16 = check_kernel_arrays(p, m, v, m_absmax, v_absmax, g, codes_size=p.size,
                                 scale_shape=q8_scale_shape(p.shape, block), block=block)
    rows, cols = q8_rows(p.shape)
    adamw_q8_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, m_absmax.ctypes.data, v_absmax.ctypes.data,
                     g.ctypes.data, rows, cols, block=block, g_bf16=g_bf16, seed=seed, offset=offset, **hp)


def check_kernel_arrays(p: np.ndarray, m: np.ndarray, v: np.ndarray, m_absmax: np.ndarray, v_absmax: np.ndarray,
                        g: np.ndarray, *, codes_size: int, scale_shape: tuple[int, int], block: int,
                        v_codes_size: int | None = None) -> bool:
    """The numpy wrappers' checks of a quantized-moment kernel's arrays (8 bits, m7v5): p contiguous bfloat16;
    m and v contiguous uint8 of ``codes_size`` bytes (v of ``v_codes_size`` where it differs: m7v5); the scales
    contiguous float32 of ``scale_shape``; g contiguous float32 or bfloat16 of p's size.
    TypeError or ValueError naming the array; returns whether g is bfloat16."""
    if not (host_kernel.is_bf16(p) and p.flags.c_contiguous):
        raise TypeError(f"p must be a contiguous uint16/bfloat16 array, got {p.dtype}")
    for name, a, size in (("m", m, codes_size), ("v", v, codes_size if v_codes_size is None else v_codes_size)):
        if not (a.dtype == np.uint8 and a.flags.c_contiguous and a.size == size):
            raise TypeError(f"{name} must be a contiguous uint8 array of {size} codes' bytes for p of size "
                            f"{p.size}, got {a.dtype} of size {a.size}")
    for name, a in (("m_absmax", m_absmax), ("v_absmax", v_absmax)):
        if not (a.dtype == np.float32 and a.flags.c_contiguous):
            raise TypeError(f"{name} must be a contiguous float32 array, got {a.dtype}")
        if a.shape != scale_shape:
            raise ValueError(f"{name} must have shape {scale_shape} (rows, ceil(cols / block)) for p of shape "
                             f"{p.shape} and block {block}, got {a.shape}")
    return host_kernel.gradient_is_bf16(g, p.size)
