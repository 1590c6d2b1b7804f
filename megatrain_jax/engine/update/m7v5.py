"""7-bit m with 5-bit v (``EngineConfig.moment_dtype="m7v5"``, issue 52): each moment a small float of our own per
element, one float32 scale per block of ``M7V5_BLOCK`` elements of a row mapping the block's largest magnitude to
the format's largest value, rounded stochastically with the 8-bit format's random streams:

- m: a sign (bit 6) and an "e3m3" magnitude (bias 7, subnormals): (1 + f/8) 2^(e - 7) for exponent e > 0,
  f 2^-9 for e = 0; 0 to 1.875;
- v: an unsigned "e4m1" (bias 15, subnormals): (1 + f/2) 2^(e - 15) for e > 0, f 2^-15 for e = 0; 0 to 1.5.
  A positive v never gets code 0 (code 1, the smallest step, instead).

The codes are 7 and 5 bits, eight to a group of 7 and 5 bytes (element 8j + i at bits 7i or 5i of group j's
little-endian word): 12 bits an element, 1.56 bytes a parameter for both moments with their scales.

Why this pair: at the bytes of the removed m8v4 (8-bit m, 4-bit v) its update errs less
(``experiments/studies/q4_moment_grids.py``: 0.26 against 0.37, 8-bit moments 0.095); m8v4's loss (1.6% on the
quality table) came from its 4-bit v, whose powers-of-two grid moves a stored v by up to
a third of itself at random each step, and a v of 5 bits halves that step; 7 bits of m keep most of the 8-bit m's
precision (docs/capacity.md). On the 1B quality table its held-out loss is 0.41% above float32's, the
mean of three seeds (``conv_1b_quality_3d07913.json``; the bar is 1.5%).

The encoder and decoder are the 8-bit format's (``q8.grid_encode``, ``q8.grid_decode``; ``Q8Grid`` in the kernel)
with narrower fields; the numpy reference of the kernel's entry point ``megatrain_adamw_m7v5`` is
``adamw_m7v5_reference``, its wrappers ``adamw_m7v5_inplace`` and ``adamw_m7v5_numpy``. Leaves: matrices of ``Q8_MIN_SIZE``+ elements whose rows
(``q8_rows``) are a multiple of 8 long (so that no group is shared by two rows); the rest keep bfloat16 moments.
"""

from __future__ import annotations

import ctypes

import numpy as np

from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.q8 import (Q8_MIN_SIZE, _block_sizes, check_kernel_arrays, grid_decode, grid_encode,
                                            q8_rows, quantized_adamw_reference)

M7V5_BLOCK = 128  # elements of a row that share one scale, for both moments (a multiple of 8: whole groups)
M7V5_MAX_BLOCK = 4096
# (exponent bits, mantissa bits, sign) of each moment's small float, and its code's bits
GRIDS = {"m": (3, 3, True), "v": (4, 1, False)}
BITS = {kind: e + m + int(signed) for kind, (e, m, signed) in GRIDS.items()}
VMAX = {kind: np.float32(2.0 - 2.0 ** -m) for kind, (e, m, signed) in GRIDS.items()}  # 1.875 and 1.5
_STREAM = {"m": 1, "v": 2}  # the random stream that rounds it (0 rounds p)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def m7v5_leaf(shape: tuple[int, ...]) -> bool:
    """Whether a leaf of this shape keeps m7v5 moments: a matrix (2+ dimensions) of ``Q8_MIN_SIZE``+ elements
    whose rows (``q8_rows``) are a multiple of 8 long. The engine and the plan ask here."""
    return len(shape) >= 2 and int(np.prod(shape)) >= Q8_MIN_SIZE and q8_rows(shape)[1] % 8 == 0


def m7v5_codes_shape(shape: tuple[int, ...], kind: str) -> tuple[int, int]:
    """Shape of a moment's packed codes (uint8): (rows, cols * 7 / 8) for m, (rows, cols * 5 / 8) for v."""
    rows, cols = q8_rows(shape)
    return rows, cols * BITS[_kind(kind)] // 8


def m7v5_scale_shape(shape: tuple[int, ...], block: int = M7V5_BLOCK) -> tuple[int, int]:
    """Shape of a moment's float32 scales (one per block of a row): (rows, ceil(cols / block))."""
    _check_block(block)
    rows, cols = q8_rows(shape)
    return rows, -(-cols // block)


def _kind(kind: str) -> str:
    if kind not in GRIDS:
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    return kind


def _check_block(block) -> None:
    if not (isinstance(block, (int, np.integer)) and 0 < int(block) <= M7V5_MAX_BLOCK and int(block) % 8 == 0):
        raise ValueError(f"block must be a multiple of 8 in [8, {M7V5_MAX_BLOCK}], got {block!r}")


def m7v5_decode(codes, kind: str) -> np.ndarray:
    """Exact float32 values of codes (one per element, before scaling): m's sign in bit 6."""
    e_bits, m_bits, signed = GRIDS[_kind(kind)]
    c = np.asarray(codes).astype(np.uint32)
    if not signed:
        return grid_decode(c, 2 ** e_bits - 1, m_bits)
    sign_at = e_bits + m_bits
    mag = grid_decode(c & np.uint32(2 ** sign_at - 1), 2 ** e_bits - 1, m_bits)
    return (mag.view(np.uint32) | ((c & np.uint32(2 ** sign_at)) << np.uint32(31 - sign_at))).view(np.float32)


def m7v5_encode(x, r, kind: str) -> np.ndarray:
    """Codes (uint8, one per element) of scaled float32 values (magnitudes clamped to the format's largest, NaN to
    it too), rounded stochastically with uint32 random bits r: m's zero is always code 0, never -0; a positive v
    never gets code 0."""
    e_bits, m_bits, signed = GRIDS[_kind(kind)]
    top = VMAX[kind]
    x = np.asarray(x, np.float32)
    if signed:
        sign_at = e_bits + m_bits
        ax = np.abs(x)
        mag = grid_encode(np.where(ax < top, ax, top), r, 2 ** e_bits - 1, m_bits) & np.uint32(2 ** sign_at - 1)
        sign = np.where(np.signbit(x) & (mag != 0), np.uint32(2 ** sign_at), np.uint32(0))
        return (mag | sign).astype(np.uint8)
    yc = np.ascontiguousarray(np.where(x < top, x, top), np.float32)
    c = grid_encode(yc, r, 2 ** e_bits - 1, m_bits) & np.uint32(2 ** BITS[kind] - 1)
    return np.maximum(c, np.minimum(yc.view(np.uint32), np.uint32(1))).astype(np.uint8)


def pack_groups(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes of ``bits`` bits (uint8, rows x cols, cols a multiple of 8), 8 to a group of ``bits`` bytes: element
    8j + i at bits ``bits * i`` of group j's little-endian word. (rows, cols * bits / 8) uint8."""
    rows, cols = codes.shape
    c = codes.reshape(rows, cols // 8, 8).astype(np.uint64) & np.uint64(2 ** bits - 1)
    words = np.bitwise_or.reduce(c << (np.uint64(bits) * np.arange(8, dtype=np.uint64)), axis=-1)
    as_bytes = np.ascontiguousarray(words.astype("<u8")).view(np.uint8).reshape(rows, cols // 8, 8)
    return np.ascontiguousarray(as_bytes[:, :, :bits]).reshape(rows, cols * bits // 8)


def unpack_groups(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """``pack_groups`` undone: (rows, cols) uint8 codes."""
    rows = packed.shape[0]
    groups = np.zeros((rows, cols // 8, 8), np.uint8)
    groups[:, :, :bits] = np.asarray(packed, np.uint8).reshape(rows, cols // 8, bits)
    words = groups.view("<u8").reshape(rows, cols // 8, 1)
    c = (words >> (np.uint64(bits) * np.arange(8, dtype=np.uint64))) & np.uint64(2 ** bits - 1)
    return c.astype(np.uint8).reshape(rows, cols)


def m7v5_quantize(x, block: int, kind: str, *, seed: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float moment (any float dtype, e.g. a checkpoint's bfloat16 m or v, or zeros) as packed codes
    (``m7v5_codes_shape``) and scales (float32, ``m7v5_scale_shape``), exactly as the kernel writes a moment it
    has computed: absmax = max |x| (m) or max x (v) per block, y = x * min(largest / absmax, FLT_MAX), codes from
    ``m7v5_encode`` with the random bits of the moment's stream (1 for m, 2 for v) under ``seed`` from global
    index ``offset``."""
    _check_block(block)
    kind = _kind(kind)
    x = np.asarray(x).astype(np.float32)
    rows, cols = q8_rows(x.shape)
    if cols % 8:
        raise ValueError(f"m7v5 moments need rows a multiple of 8 long, got shape {x.shape}")
    x2 = x.reshape(rows, cols)
    sizes = _block_sizes(cols, block)
    if x.size == 0:
        return np.zeros(m7v5_codes_shape(x.shape, kind), np.uint8), np.zeros((rows, sizes.size), np.float32)
    a = np.abs(x2) if kind == "m" else x2
    absmax = np.maximum(np.maximum.reduceat(a, np.arange(0, cols, block), axis=1), np.float32(0))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        q = VMAX[kind] / absmax
    inv = np.where(q < _F32_MAX, q, _F32_MAX).astype(np.float32)
    y = x2 * np.repeat(inv, sizes, axis=1)
    r = np.asarray(host_kernel.sr_bits(seed, _STREAM[kind], offset, x.size)).reshape(rows, cols)
    return pack_groups(m7v5_encode(y, r, kind), BITS[kind]), absmax.astype(np.float32)


def m7v5_dequantize(codes, absmax, block: int, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 moment that packed codes and scales stand for, as the kernel reads it: decode(code) * (absmax /
    largest), the factor computed once per block in float32; ``shape``: the leaf's."""
    _check_block(block)
    kind = _kind(kind)
    rows, cols = q8_rows(tuple(shape))
    codes = np.asarray(codes, np.uint8)
    if codes.shape != m7v5_codes_shape(tuple(shape), kind):
        raise ValueError(f"{kind}'s codes must have shape {m7v5_codes_shape(tuple(shape), kind)} for a leaf of shape "
                         f"{tuple(shape)}, got {codes.shape}")
    sizes = _block_sizes(cols, block)
    absmax = np.asarray(absmax, np.float32)
    if absmax.shape != (rows, sizes.size):
        raise ValueError(f"absmax must have shape {(rows, sizes.size)} for a leaf of shape {tuple(shape)} and "
                         f"block {block}, got {absmax.shape}")
    values = m7v5_decode(unpack_groups(codes, BITS[kind], cols), kind)
    return (values * np.repeat(absmax / VMAX[kind], sizes, axis=1)).reshape(shape)


def adamw_m7v5_reference(p, m, v, m_absmax, v_absmax, g, *, block: int, lr, b1, b2, eps, wd, grad_scale, bc1,
                         bc2, seed: int, offset: int = 0):
    """What ``megatrain_adamw_m7v5`` computes, in numpy float32, operation for operation: p bfloat16 (or uint16
    bits), m and v packed codes (``m7v5_codes_shape``), scales float32 (``m7v5_scale_shape``), g float32 or
    bfloat16. Returns the new (p as uint16 bits, m codes, v codes, m scales, v scales), equal to the kernel's bit
    for bit."""
    shape = np.shape(p)
    return quantized_adamw_reference(
        p, m7v5_dequantize(m, m_absmax, block, "m", shape), m7v5_dequantize(v, v_absmax, block, "v", shape), g,
        lambda x, kind: m7v5_quantize(x, block, kind, seed=seed, offset=offset), lr=lr, b1=b1, b2=b2, eps=eps,
        wd=wd, grad_scale=grad_scale, bc1=bc1, bc2=bc2, seed=seed, offset=offset)


def adamw_m7v5_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, m_absmax: int, v_absmax: int, g: int,
                       n_rows: int, cols: int, *, block: int, g_bf16: bool, lr: float, b1: float, b2: float,
                       eps: float, wd: float, grad_scale: float, bc1: float, bc2: float, seed: int, offset: int,
                       part: str = "whole") -> None:
    """m7v5 moments on raw buffer addresses: ``n_rows`` rows of ``cols`` (a multiple of 8) elements of bfloat16 p
    (in place), m's and v's packed codes (n_rows x cols * 7 / 8 and n_rows x cols * 5 / 8 bytes), their float32
    scales (n_rows x ceil(cols / block) each), g float32 or, where ``g_bf16``, bfloat16. As
    ``q8.adamw_q8_inplace`` otherwise (whole rows of a bigger array from ``offset``; ``part``: the whole update or
    one of its passes)."""
    _check_block(block)
    if n_rows < 0 or cols < 0 or cols % 8:
        raise ValueError(f"need n_rows >= 0 and cols >= 0 a multiple of 8, got {n_rows}, {cols}")
    host_kernel.check_seed_offset(int(seed), int(offset), int(n_rows) * int(cols))
    lib.megatrain_adamw_m7v5(p, m, v, m_absmax, v_absmax, g, int(bool(g_bf16)), n_rows, cols, block, lr, b1, b2,
                             eps, wd, grad_scale, bc1, bc2, seed, offset, host_kernel.quantized_pass(part))


def adamw_m7v5_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, m_absmax: np.ndarray, v_absmax: np.ndarray,
                     g: np.ndarray, *, block: int = M7V5_BLOCK, seed: int, offset: int = 0,
                     lib: ctypes.CDLL | None = None, **hp) -> None:
    """m7v5 moments on numpy arrays, in place: p contiguous bfloat16 viewed as rows x cols (``q8_rows``, cols a
    multiple of 8); m contiguous uint8 of p.size * 7 / 8 bytes, v of p.size * 5 / 8; the scales contiguous float32
    of ``m7v5_scale_shape(p.shape, block)``; g contiguous float32 or bfloat16 of p's size."""
    lib = host_kernel.require(lib)
    _check_block(block)
    rows, cols = q8_rows(p.shape)
    if cols % 8:
        raise ValueError(f"m7v5 moments need rows a multiple of 8 long, got p of shape {p.shape}")
    g_bf16 = check_kernel_arrays(p, m, v, m_absmax, v_absmax, g, codes_size=p.size * BITS["m"] // 8,
                                 v_codes_size=p.size * BITS["v"] // 8, scale_shape=m7v5_scale_shape(p.shape, block),
                                 block=block)
    adamw_m7v5_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, m_absmax.ctypes.data, v_absmax.ctypes.data,
                       g.ctypes.data, rows, cols, block=block, g_bf16=g_bf16, seed=seed, offset=offset, **hp)
