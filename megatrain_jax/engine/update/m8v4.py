"""8-bit m with 4-bit v (``EngineConfig.moment_dtype="m8v4"``, issue 52): the first moment in the 8-bit format's
codes (``q8``: a sign and an "e4m3" magnitude a byte, scaled so that the block's largest |m| is 1.875), the second
in the 4-bit format's (``q4``: powers of two 2^-14..1 of the block's largest, a nibble, two to a byte), one
float32 scale per block of ``M8V4_BLOCK`` elements of a row for each; both rounded stochastically with the same
random streams as those formats. 1.56 bytes a parameter for both moments, against 2.03 (8-bit) and 1.06 (4-bit).

Why this pair: m on a 4-bit grid scaled by its block's largest value puts noise as large as the step itself into
every update (its small elements round to 0 or 1/64 of the block's largest at random), and the 4-bit moments'
held-out loss ended 3.19% over float32's on the 1B quality table; v on its 4-bit grid costs far less
(``experiments/studies/q4_moment_grids.py``: the update's error 1.10 for 4-bit moments, 0.37 for 8-bit m with 4-bit
v, 0.095 for 8-bit moments; docs/capacity.md).

The numpy reference of the kernel's entry point ``megatrain_adamw_m8v4`` (``adamw_m8v4_reference``) is written
with the two formats' own quantizers (``q8.q8_quantize`` of m, ``q4.q4_quantize`` of v, at this block size);
``adamw_m8v4_inplace`` and ``adamw_m8v4_numpy`` are its wrappers. Leaves: those of ``q4.q4_leaf`` (v's nibbles
need rows of an even length); the rest keep bfloat16 moments.
"""

from __future__ import annotations

import ctypes

import numpy as np

from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.q4 import q4_codes_shape, q4_dequantize, q4_leaf, q4_quantize, q4_scale_shape
from megatrain_jax.engine.update.q8 import (check_kernel_arrays, q8_dequantize, q8_quantize, q8_rows,
                                            quantized_adamw_reference)

M8V4_BLOCK = 128  # elements of a row that share a scale, for both moments (even: v's nibbles)
M8V4_MAX_BLOCK = 4096


def m8v4_leaf(shape: tuple[int, ...]) -> bool:
    """Whether a leaf of this shape keeps m8v4 moments: the 4-bit format's leaves (``q4.q4_leaf``)."""
    return q4_leaf(shape)


def m8v4_codes_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """Shape of a moment's codes (uint8): m one a byte (the leaf's shape), v two to a byte ((rows, cols / 2))."""
    return tuple(shape) if _kind(kind) == "m" else q4_codes_shape(shape)


def m8v4_scale_shape(shape: tuple[int, ...], block: int = M8V4_BLOCK) -> tuple[int, int]:
    """Shape of a moment's float32 scales (one per block of a row): (rows, ceil(cols / block))."""
    return q4_scale_shape(shape, block)


def _kind(kind: str) -> str:
    if kind not in ("m", "v"):
        raise ValueError(f"kind must be 'm' or 'v', got {kind!r}")
    return kind


def _check_block(block) -> None:
    if not (isinstance(block, (int, np.integer)) and 0 < int(block) <= M8V4_MAX_BLOCK and int(block) % 2 == 0):
        raise ValueError(f"block must be an even integer in [2, {M8V4_MAX_BLOCK}], got {block!r}")


def m8v4_quantize(x, block: int, kind: str, *, seed: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float moment as this format's codes (``m8v4_codes_shape``) and scales, as the kernel writes it: m by the
    8-bit format's rule, v by the 4-bit format's, each at ``block``."""
    _check_block(block)
    if _kind(kind) == "m":
        return q8_quantize(x, block, "m", seed=seed, offset=offset)
    return q4_quantize(x, block, "v", seed=seed, offset=offset)


def m8v4_dequantize(codes, absmax, block: int, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 moment that codes and scales stand for, as the kernel reads it; ``shape``: the leaf's."""
    _check_block(block)
    if _kind(kind) == "m":
        return q8_dequantize(np.asarray(codes, np.uint8).reshape(shape), absmax, block, "m").reshape(shape)
    return q4_dequantize(codes, absmax, block, "v", shape)


def adamw_m8v4_reference(p, m, v, m_absmax, v_absmax, g, *, block: int, lr, b1, b2, eps, wd, grad_scale, bc1,
                         bc2, seed: int, offset: int = 0):
    """What ``megatrain_adamw_m8v4`` computes, in numpy float32, operation for operation: p bfloat16 (or uint16
    bits), m codes (p's shape), v packed codes (``q4_codes_shape``), scales float32 (``m8v4_scale_shape``), g
    float32 or bfloat16. Returns the new (p as uint16 bits, m codes, v codes, m scales, v scales), equal to the
    kernel's bit for bit."""
    shape = np.shape(p)
    return quantized_adamw_reference(
        p, m8v4_dequantize(m, m_absmax, block, "m", shape), m8v4_dequantize(v, v_absmax, block, "v", shape), g,
        lambda x, kind: m8v4_quantize(x, block, kind, seed=seed, offset=offset), lr=lr, b1=b1, b2=b2, eps=eps,
        wd=wd, grad_scale=grad_scale, bc1=bc1, bc2=bc2, seed=seed, offset=offset)


def adamw_m8v4_inplace(lib: ctypes.CDLL, p: int, m: int, v: int, m_absmax: int, v_absmax: int, g: int,
                       n_rows: int, cols: int, *, block: int, g_bf16: bool, lr: float, b1: float, b2: float,
                       eps: float, wd: float, grad_scale: float, bc1: float, bc2: float, seed: int, offset: int,
                       part: str = "whole") -> None:
    """m8v4 moments on raw buffer addresses: ``n_rows`` rows of ``cols`` elements of bfloat16 p (in place), m's
    codes (n_rows x cols bytes) and v's packed codes (n_rows x cols / 2 bytes), their float32 scales (n_rows x
    ceil(cols / block) each), g float32 or, where ``g_bf16``, bfloat16. As ``q4.adamw_q4_inplace`` otherwise (whole
    rows of a bigger array from ``offset``; ``part``: the whole update or one of its passes)."""
    _check_block(block)
    if n_rows < 0 or cols < 0 or cols % 2:
        raise ValueError(f"need n_rows >= 0 and an even cols >= 0, got {n_rows}, {cols}")
    host_kernel.check_seed_offset(int(seed), int(offset), int(n_rows) * int(cols))
    lib.megatrain_adamw_m8v4(p, m, v, m_absmax, v_absmax, g, int(bool(g_bf16)), n_rows, cols, block, lr, b1, b2,
                             eps, wd, grad_scale, bc1, bc2, seed, offset, host_kernel.quantized_pass(part))


def adamw_m8v4_numpy(p: np.ndarray, m: np.ndarray, v: np.ndarray, m_absmax: np.ndarray, v_absmax: np.ndarray,
                     g: np.ndarray, *, block: int = M8V4_BLOCK, seed: int, offset: int = 0,
                     lib: ctypes.CDLL | None = None, **hp) -> None:
    """m8v4 moments on numpy arrays, in place: p contiguous bfloat16 viewed as rows x cols (``q8_rows``, cols
    even); m contiguous uint8 of p's size, v of half of it; the scales contiguous float32 of
    ``m8v4_scale_shape(p.shape, block)``; g contiguous float32 or bfloat16 of p's size."""
    lib = host_kernel.require(lib)
    _check_block(block)
    rows, cols = q8_rows(p.shape)
    if cols % 2:
        raise ValueError(f"m8v4 moments need rows of an even length, got p of shape {p.shape}")
    g_bf16 = check_kernel_arrays(p, m, v, m_absmax, v_absmax, g, codes_size=p.size, v_codes_size=p.size // 2,
                                 scale_shape=m8v4_scale_shape(p.shape, block), block=block)
    adamw_m8v4_inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, m_absmax.ctypes.data, v_absmax.ctypes.data,
                       g.ctypes.data, rows, cols, block=block, g_bf16=g_bf16, seed=seed, offset=offset, **hp)
