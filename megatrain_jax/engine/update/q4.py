"""The 4-bit Adam moments of ``EngineConfig.moment_dtype="q4"`` (issue 52): the formats, the numpy reference of
the host kernel's entry point ``megatrain_adamw_q4`` (``adamw_q4_reference``) and its wrappers
(``adamw_q4_inplace``, ``adamw_q4_numpy``).

As the 8-bit moments (``q8``): p bfloat16 as in capacity mode, g float32 or bfloat16, and each of m and v a
code per element with one float32 scale (the block's absmax) per block of ``Q4_BLOCK`` elements of a row (the
array viewed as rows x cols). Here a code is a nibble and two share a byte: element x of the flat order sits
in byte x // 2, the low nibble for even x. The grids are powers of two, scaled so that the block's largest
magnitude is 1:

- m: bit 3 the sign, bits 0-2 a magnitude c: 0 for c = 0, else 2^(c - 7) (2^-6 to 1);
- v: a magnitude c of 4 bits: 0 for c = 0, else 2^(c - 15) (2^-14 to 1).

Both are rounded stochastically between their two neighbours on the grid (``q4_encode_m``, ``q4_encode_v``),
so each code's expectation is the value it stands for: a coarse grid rounded to nearest would freeze v (an
EMA step of (1 - b2) is far under half a step) and zero most of m. A positive v never gets code 0 (code 1,
2^-14 of the block's maximum), which keeps sqrt(v) away from 0 where m may be nonzero. The second moment's
range (2^14) is that of its square root's 2^7: the small gradients of a block with one large one keep a
step of their own size.

Which leaves have them: ``q4_leaf`` (matrices of ``Q4_MIN_SIZE``+ elements with an even row length, so that no
byte is shared by two rows or blocks); the rest keep bfloat16 moments, as under ``q8``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.q8 import check_kernel_arrays, q8_rows, quantized_adamw_reference

Q4_BLOCK = 128  # elements of a row that share one scale
Q4_MAX_BLOCK = 4096  # the kernel's per-thread buffers hold one block of this many floats
Q4_MIN_SIZE = 4096
_EMIN = {"m": -6, "v": -14}  # the smallest nonzero magnitude of each grid is 2^EMIN
_STREAM = {"m": 1, "v": 2}  # the random stream that rounds it (0 rounds p)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def q4_leaf(shape: tuple[int, ...]) -> bool:
    """Whether a leaf of this shape keeps 4-bit moments under ``moment_dtype="q4"``: a matrix (2+ dimensions) of
    ``Q4_MIN_SIZE``+ elements whose rows (``q8_rows``) have an even length. The engine and the plan ask here."""
    return len(shape) >= 2 and int(np.prod(shape)) >= Q4_MIN_SIZE and q8_rows(shape)[1] % 2 == 0


def q4_codes_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of a 4-bit moment's codes (uint8, two to a byte) for a leaf of this shape: (rows, cols / 2)."""
    rows, cols = q8_rows(shape)
    return rows, cols // 2


def q4_scale_shape(shape: tuple[int, ...], block: int = Q4_BLOCK) -> tuple[int, int]:
    """Shape of the float32 scales (absmax per block) of a 4-bit moment: (rows, ceil(cols / block))."""
    _check_block(block)
    rows, cols = q8_rows(shape)
    return rows, -(-cols // block)


def _check_block(block) -> None:
    if not (isinstance(block, (int, np.integer)) and 0 < int(block) <= Q4_MAX_BLOCK and int(block) % 2 == 0):
        raise ValueError(f"block must be an even integer in [2, {Q4_MAX_BLOCK}], got {block!r}")


def _kind(kind: str) -> str:
    if kind not in _EMIN:
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    return kind


def _decode(c: np.ndarray, emin: int) -> np.ndarray:
    """The exact float32 value of magnitude codes c (uint32): 0, or 2^(c - 1 + emin)."""
    bits = np.where(c == 0, np.uint32(0), (c - np.uint32(1) + np.uint32(127 + emin)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _encode(y: np.ndarray, r: np.ndarray, emin: int) -> np.ndarray:
    """Stochastic rounding of float32 y in [0, 1] to magnitude codes (uint32) with uint32 random bits r (low 20
    used), as the kernel's ``q4_encode``: at or above 2^emin, y = (1 + f) 2^e gives code e - emin + 1, plus one
    with probability f (its top 20 bits); below, code 1 with probability y / 2^emin (20-bit fixed point)."""
    u = np.ascontiguousarray(y, np.float32).view(np.uint32)
    low = np.asarray(r, np.uint32) & np.uint32(0xFFFFF)
    e = u >> np.uint32(23)
    normal = e - np.uint32(127 + emin) + np.uint32(1) + (((u & np.uint32(0x7FFFFF)) >> np.uint32(3)) + low
                                                          >> np.uint32(20))
    shift = np.uint32(130 + emin) - e  # >= 4 below 2^emin (wraps above it: not used there)
    fixed = ((u & np.uint32(0x7FFFFF)) | np.uint32(0x800000)) >> np.minimum(shift, np.uint32(31))
    return np.where(u >= np.uint32((127 + emin) << 23), normal, (fixed + low) >> np.uint32(20))


def q4_decode_m(codes) -> np.ndarray:
    """Exact float32 values of m codes (one per element, 0..15, before scaling): bit 3 the sign."""
    c = np.asarray(codes).astype(np.uint32)
    mag = _decode(c & np.uint32(7), _EMIN["m"])
    return (mag.view(np.uint32) | ((c & np.uint32(8)) << np.uint32(28))).view(np.float32)


def q4_decode_v(codes) -> np.ndarray:
    """Exact float32 values of v codes (one per element, 0..15, before scaling)."""
    return _decode(np.asarray(codes).astype(np.uint32), _EMIN["v"])


def q4_encode_m(x, r) -> np.ndarray:
    """m codes (uint8, one per element) of scaled float32 values x (magnitudes clamped to 1, NaN to 1 too),
    rounded stochastically with uint32 random bits r; zero is always code 0, never -0."""
    x = np.asarray(x, np.float32)
    ax = np.abs(x)
    mag = _encode(np.where(ax < 1, ax, np.float32(1)), r, _EMIN["m"]) & np.uint32(7)
    sign = np.where(np.signbit(x) & (mag != 0), np.uint32(8), np.uint32(0))
    return (mag | sign).astype(np.uint8)


def q4_encode_v(y, r) -> np.ndarray:
    """v codes (uint8, one per element) of scaled float32 values y >= 0 (clamped to 1, NaN to 1 too), rounded
    stochastically with uint32 random bits r; a positive y never gets code 0."""
    y = np.asarray(y, np.float32)
    yc = np.ascontiguousarray(np.where(y < 1, y, np.float32(1)), np.float32)
    c = _encode(yc, r, _EMIN["v"]) & np.uint32(15)
    return np.maximum(c, np.minimum(yc.view(np.uint32), np.uint32(1))).astype(np.uint8)


def q4_pack(codes: np.ndarray) -> np.ndarray:
    """Codes of one per element (rows x cols, cols even) packed two to a byte: (rows, cols / 2)."""
    c = np.asarray(codes, np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << np.uint8(4))).astype(np.uint8)


def q4_unpack(packed: np.ndarray) -> np.ndarray:
    """The codes of ``q4_pack``'s bytes, one per element: (rows, 2 * bytes per row)."""
    b = np.asarray(packed, np.uint8)
    out = np.empty((b.shape[0], 2 * b.shape[1]), np.uint8)
    out[:, 0::2], out[:, 1::2] = b & np.uint8(15), b >> np.uint8(4)
    return out


def _block_sizes(cols: int, block: int) -> np.ndarray:
    starts = np.arange(0, cols, block)
    return np.minimum(starts + block, cols) - starts


def q4_quantize(x, block: int, kind: str, *, seed: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float moment (any float dtype; e.g. a capacity-mode checkpoint's bfloat16 m or v, or zeros) as packed
    4-bit codes (``q4_codes_shape``) and scales (``q4_scale_shape``), as the kernel writes a moment it has
    computed: absmax = max |x| (m) or max x (v) per block, y = x * min(1 / absmax, FLT_MAX), codes from
    ``q4_encode_m``/``q4_encode_v`` with the moment's random stream under ``seed`` from flat index ``offset``."""
    _check_block(block)
    kind = _kind(kind)
    x = np.asarray(x).astype(np.float32)
    rows, cols = q8_rows(x.shape)
    if cols % 2:
        raise ValueError(f"4-bit moments need rows of an even length, got shape {x.shape}")
    x2 = x.reshape(rows, cols)
    sizes = _block_sizes(cols, block)
    if x.size == 0:
        return np.zeros((rows, cols // 2), np.uint8), np.zeros((rows, sizes.size), np.float32)
    a = np.abs(x2) if kind == "m" else x2
    absmax = np.maximum(np.maximum.reduceat(a, np.arange(0, cols, block), axis=1), np.float32(0))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        q = np.float32(1) / absmax
    inv = np.where(q < _F32_MAX, q, _F32_MAX).astype(np.float32)
    y = x2 * np.repeat(inv, sizes, axis=1)
    r = np.asarray(host_kernel.sr_bits(seed, _STREAM[kind], offset, x.size)).reshape(rows, cols)
    codes = q4_encode_m(y, r) if kind == "m" else q4_encode_v(y, r)
    return q4_pack(codes), absmax.astype(np.float32)


def q4_dequantize(packed, absmax, block: int, kind: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The float32 moment that packed codes and scales stand for, as the kernel reads it: decode(code) * absmax.
    ``shape``: the leaf's (default: rows x cols of the codes)."""
    _check_block(block)
    kind = _kind(kind)
    codes = q4_unpack(packed)
    rows, cols = codes.shape
    sizes = _block_sizes(cols, block)
    absmax = np.asarray(absmax, np.float32)
    if absmax.shape != (rows, sizes.size):
        raise ValueError(f"absmax must have shape {(rows, sizes.size)} for codes of {rows} x {cols} and block "
                         f"{block}, got {absmax.shape}")
    values = (q4_decode_m if kind == "m" else q4_decode_v)(codes)
    out = values * np.repeat(absmax, sizes, axis=1)
    return out.reshape(shape if shape is not None else (rows, cols))


def adamw_q4_reference(p, m, v, m_absmax, v_absmax, g, *, block: int, lr, b1, b2, eps, wd, grad_scale, bc1, bc2,
                       seed: int, offset: int = 0):
    """What ``megatrain_adamw_q4`` computes, in numpy float32, operation for operation (as
    ``q8.adamw_q8_reference``): p bfloat16 (or uint16 bits), m and v packed codes (``q4_codes_shape``), scales
    float32 (``q4_scale_shape``), g float32 or bfloat16. Returns the new (p as uint16 bits, m codes, v codes,
    m scales, v scales), equal to the kernel's bit for bit."""
    shape = np.shape(p)
    return quantized_adamw_reference(
        p, q4_dequantize(m, m_absmax, block, "m", shape), q4_dequantize(v, v_absmax, block, "v", shape), g,
        lambda x, kind: q4_quantize(x, block, kind, seed=seed, offset=offset), lr=lr, b1=b1, b2=b2, eps=eps, wd=wd,
        grad_scale=grad_scale, bc1=bc1, bc2=bc2, seed=seed, offset=offset)


def adamw_q4_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, m_absmax: int, v_absmax: int, g: int, n_rows: int,
                     cols: int, *, block: int, g_bf16: bool, lr: float, b1: float, b2: float, eps: float,
                     wd: float, grad_scale: float, bc1: float, bc2: float, seed: int, offset: int,
                     part: str = "whole") -> None:
    """4-bit moments on raw buffer addresses: ``n_rows`` rows of ``cols`` elements of bfloat16 p (in place),
    packed m and v codes (n_rows x cols / 2 bytes) and their float32 scales (n_rows x ceil(cols / block)),
    g float32 or, where ``g_bf16``, bfloat16. Whole rows of a bigger array: the addresses of its first row and
    ``offset`` = the flat index of its first element. ValueError unless cols and block are even, 0 < block <=
    4096, 0 <= seed < 2^32 and 0 <= offset, offset + n <= 2^32. ``part``: the whole update, or one pass of it
    (``host_kernel.QUANTIZED_PASSES``: "stream" writes p alone, "commit" then the codes and scales alone, from the
    same old codes and gradient; the two leave what "whole" does)."""
    _check_block(block)
    if n_rows < 0 or cols < 0 or cols % 2:
        raise ValueError(f"need n_rows >= 0 and an even cols >= 0, got {n_rows}, {cols}")
    host_kernel.check_seed_offset(int(seed), int(offset), int(n_rows) * int(cols))
    lib.megatrain_adamw_q4(p, m, v, m_absmax, v_absmax, g, int(bool(g_bf16)), n_rows, cols, block, lr, b1, b2, eps,
                           wd, grad_scale, bc1, bc2, seed, offset, host_kernel.quantized_pass(part))


def adamw_q4_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, m_absmax: np.ndarray, v_absmax: np.ndarray,
                   g: np.ndarray, *, block: int = Q4_BLOCK, seed: int, offset: int = 0,
                   lib: ctypes.CDLL | None = None, **hp) -> None:
    """4-bit moments on numpy arrays, in place: p contiguous bfloat16 (uint16 bits or ml_dtypes.bfloat16) viewed
    as rows x cols (``q8_rows``, cols even); m and v contiguous uint8 of ``q4_codes_shape``; m_absmax and
    v_absmax contiguous float32 of ``q4_scale_shape(p.shape, block)``; g contiguous float32 or bfloat16 of p's
    size. See ``adamw_q4_inplace``."""
    lib = host_kernel.require(lib)
    _check_block(block)
    rows, cols = q8_rows(p.shape)
    if cols % 2:
        raise ValueError(f"4-bit moments need rows of an even length, got p of shape {p.shape}")
    g_bf16 = check_kernel_arrays(p, m, v, m_absmax, v_absmax, g, codes_size=p.size // 2,
                                 scale_shape=q4_scale_shape(p.shape, block), block=block)
    adamw_q4_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, m_absmax.ctypes.data, v_absmax.ctypes.data,
                     g.ctypes.data, rows, cols, block=block, g_bf16=g_bf16, seed=seed, offset=offset, **hp)
