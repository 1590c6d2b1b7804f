"""The quantized Adam-moment formats, one record each (``FORMATS``, keyed by ``EngineConfig.moment_dtype``): which
leaves take them, the shapes of a moment's codes and scales, the kernel entry point that updates a leaf, and
the conversions to and from a float moment (a checkpoint in another format). The host optimizer, the
checkpoint and the memory plan ask here; each format's math is its own module (``q8``, ``m7v5``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from megatrain_jax.engine.update import m7v5, q8


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """One quantized moment format: ``leaf(shape)`` says whether a leaf takes it (the others keep bfloat16
    moments); a moment is codes of ``codes_shape(shape, kind)`` (uint8; ``kind`` "m" or "v": m7v5's differ)
    and float32 scales of ``scale_shape(shape)``, one per ``block`` elements of a row; ``inplace`` is the
    kernel's wrapper (``q8.adamw_q8_inplace``'s arguments); ``quantize(x, kind, seed)`` and
    ``dequantize(codes, scales, kind, shape)`` convert a float moment; ``words``: the format in the memory
    plan's words."""

    name: str
    block: int
    leaf: Callable[[tuple[int, ...]], bool]
    codes_shape: Callable[[tuple[int, ...], str], tuple[int, ...]]
    scale_shape: Callable[[tuple[int, ...]], tuple[int, int]]
    inplace: Callable
    quantize: Callable[..., tuple[np.ndarray, np.ndarray]]
    dequantize: Callable[..., np.ndarray]
    words: str

    def moment_bytes(self, shape: tuple[int, ...]) -> int | None:
        """Host bytes of both moments of a leaf of this shape, or None where the leaf keeps them whole."""
        if not self.leaf(shape):
            return None
        return sum(math.prod(self.codes_shape(shape, kind)) for kind in ("m", "v")) + 8 * math.prod(
            self.scale_shape(shape))


FORMATS: dict[str, MomentFormat] = {
    "q8": MomentFormat(
        "q8", q8.Q8_BLOCK, q8.q8_leaf, lambda shape, kind: tuple(shape), q8.q8_scale_shape, q8.adamw_q8_inplace,
        lambda x, kind, seed: q8.q8_quantize(x, q8.Q8_BLOCK, kind, seed=seed),
        lambda codes, scales, kind, shape: q8.q8_dequantize(codes, scales, q8.Q8_BLOCK, kind).reshape(shape),
        f"8-bit with a float32 scale per {q8.Q8_BLOCK} elements of a row"),
    "m7v5": MomentFormat(
        "m7v5", m7v5.M7V5_BLOCK, m7v5.m7v5_leaf, m7v5.m7v5_codes_shape, m7v5.m7v5_scale_shape,
        m7v5.adamw_m7v5_inplace,
        lambda x, kind, seed: m7v5.m7v5_quantize(x, m7v5.M7V5_BLOCK, kind, seed=seed),
        lambda codes, scales, kind, shape: m7v5.m7v5_dequantize(codes, scales, m7v5.M7V5_BLOCK, kind, shape),
        f"m 7-bit and v 5-bit, each with a float32 scale per {m7v5.M7V5_BLOCK} elements of a row"),
}
