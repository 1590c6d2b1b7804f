"""MXFP4 tensors of the released GPT-OSS checkpoints, dequantized as transformers does, one tensor at a time.

openai/gpt-oss-20b and -120b store each MoE layer's ``experts.gate_up_proj`` and ``experts.down_proj`` as a pair:
``<name>_blocks`` [experts, out, in / 32, 16] uint8, two FP4 (e2m1) values per byte, and ``<name>_scales``
[experts, out, in / 32] uint8, the power-of-two exponent (bias 127) of each group of 32 values along the input
dimension. ``dequantize_mxfp4`` computes what transformers' ``integrations.mxfp4.convert_moe_packed_tensors``
computes, bit for bit: the low nibble of byte j is value 2j of its group and the high nibble value 2j + 1, each
looked up in the same table (``FP4_VALUES``) and scaled by ``ldexp(value, scale - 127)`` (torch's ``ldexp``: at
exponent 255, 0 stays 0, +-0.5 is +-2^127 and larger values are +-inf), then the [experts, out, in] result
transposed to transformers' parameter layout [experts, in, out] and rounded to the dtype asked for. Every value
is exact in bfloat16 and float32 alike.

``DequantizedCheckpoint`` shows a ``Checkpoint`` holding such pairs as one tensor of the dequantized shape under
the parameter's name (``...experts.gate_up_proj``): each is dequantized when it is read, so loading goes part by
part (one layer's tensor at a time), never the whole model at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from megatrain_jax.hf.safetensors_io import Checkpoint, dtype_code

BLOCKS, SCALES = "_blocks", "_scales"
# transformers' FP4_VALUES: e2m1 codes 0..15 (bit 3 the sign)
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``convert_moe_packed_tensors(blocks, scales, dtype=dtype)``: blocks [E, rows, groups, 16] uint8 and scales
    [E, rows, groups] uint8 -> [E, groups x 32, rows] in ``dtype`` (float32 or bfloat16)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected [experts, rows, "
                         f"groups, bytes] and [experts, rows, groups]")
    E, rows, groups, nbytes = blocks.shape
    values = np.empty((E, rows, groups, nbytes, 2), np.float32)
    values[..., 0] = FP4_VALUES[blocks & 0x0F]
    values[..., 1] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # past float32's range: inf, as torch.ldexp gives
        values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None, None])
    out = values.reshape(E, rows, groups * nbytes * 2).transpose(0, 2, 1)
    dt = np.dtype(ml_dtypes.bfloat16) if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype)
    return np.ascontiguousarray(out.astype(dt, copy=False))


def packed_names(ckpt: Checkpoint) -> list[str]:
    """The names of the MXFP4 pairs a checkpoint holds (``X`` for ``X_blocks`` with ``X_scales``)."""
    return [n[:-len(BLOCKS)] for n in ckpt.names() if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in ckpt]


class DequantizedCheckpoint:
    """A ``Checkpoint`` whose MXFP4 pairs read as their dequantized tensors (``dtype``, bfloat16 by default:
    exact, and half float32's bytes), under the parameter's name; every other tensor as stored. The last tensor
    dequantized is kept (gate and up are two leaves of one stored ``gate_up_proj``)."""

    def __init__(self, ckpt: Checkpoint, dtype=ml_dtypes.bfloat16):
        self._ckpt, self.dir, self.dtype = ckpt, ckpt.dir, dtype
        self.packed = set(packed_names(ckpt))
        self._last: tuple[str, np.ndarray] | None = None

    def _stored(self, name: str) -> list[str]:
        return [name + BLOCKS, name + SCALES] if name in self.packed else [name]

    def release(self) -> None:
        """Every tensor has been read: drop the last one dequantized and unmap the files (``Checkpoint.release``)."""
        self._last = None
        self._ckpt.release()

    def names(self) -> list[str]:
        hidden = {n for p in self.packed for n in self._stored(p)}
        return [n for n in self._ckpt.names() if n not in hidden] + sorted(self.packed)

    def __contains__(self, name: str) -> bool:
        return name in self.packed or name in self._ckpt

    def shapes(self) -> dict[str, tuple[int, ...]]:
        names = set(self.names())
        shapes = {n: s for n, s in self._ckpt.shapes().items() if n in names}
        for p in self.packed:
            E, rows, groups, nbytes = self._ckpt.info(p + BLOCKS).shape
            shapes[p] = (E, groups * nbytes * 2, rows)
        return shapes

    def dtypes(self) -> dict[str, str]:
        """As ``Checkpoint.dtypes``; a dequantized pair reads as BF16 (``dtype``)."""
        names, code = set(self.names()), dtype_code(self.dtype)
        return {**{n: d for n, d in self._ckpt.dtypes().items() if n in names}, **{p: code for p in self.packed}}

    def file_of(self, name: str):
        return self._ckpt.file_of(name + BLOCKS if name in self.packed else name)

    def will_need(self, names: Sequence[str]) -> None:
        self._ckpt.will_need([s for n in names for s in self._stored(n)])

    def get(self, name: str) -> np.ndarray:
        if name not in self.packed:
            return self._ckpt.get(name)
        if self._last is None or self._last[0] != name:
            self._last = (name, dequantize_mxfp4(self._ckpt.get(name + BLOCKS), self._ckpt.get(name + SCALES),
                                                 self.dtype))
        return self._last[1]
