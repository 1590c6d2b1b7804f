"""8-bit m with 4-bit v (``moment_dtype="m8v4"``, ``megatrain_jax.engine.update.m8v4``): the kernel against its
numpy reference bit for bit, a leaf updated in pieces as a whole, the codes as the two formats they come from,
the bytes, and the mode trained through the engine against capacity mode. (The kernel's builds against each
other and the two passes of a split update: ``test_host_kernel_paths.py``; conversions on restore:
``test_checkpoint.py``.)"""

from __future__ import annotations

import numpy as np
import pytest

from megatrain_jax import EngineConfig
from megatrain_jax.engine import precision
from megatrain_jax.engine.update.host_optimizer import QuantizedMoment
from megatrain_jax.engine.update.m8v4 import (M8V4_BLOCK, adamw_m8v4_numpy, adamw_m8v4_reference, m8v4_codes_shape,
                                              m8v4_dequantize, m8v4_leaf, m8v4_quantize, m8v4_scale_shape)
from megatrain_jax.engine.update.q4 import q4_dequantize, q4_quantize
from megatrain_jax.engine.update.q8 import q8_dequantize, q8_quantize

from test_q4_moments import pieces_equal_the_whole, steps_match_the_reference, trains_as_capacity_mode_does
from test_q4_moments import _state as q4_state

M8V4 = EngineConfig(master_dtype="bfloat16", moment_dtype="m8v4", host_grad_dtype="bfloat16")


def _state(shape, seed, g_bf16=False, block=M8V4_BLOCK):
    return q4_state(shape, seed, g_bf16, block, quantize=m8v4_quantize)


@pytest.mark.parametrize("g_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("shape,block", [((64, 384), 128), ((3, 1000), 128), ((5, 4098), 128), ((4, 2, 50), 32)])
def test_kernel_matches_reference_bit_for_bit(lib, g_bf16, shape, block):
    """Rows of several blocks, a last block shorter than the others, a leaf of three dimensions; three steps in a
    row, each fed the last one's result."""
    steps_match_the_reference(adamw_m8v4_numpy, adamw_m8v4_reference, lib, _state(shape, 3, g_bf16, block), block)


def test_rows_in_pieces_equal_the_whole(lib):
    """A call on a run of whole rows with its flat offset writes what the whole call writes there (the engine
    updates a leaf spread over devices piece by piece: m's rows are cols bytes, v's cols / 2)."""
    pieces_equal_the_whole(adamw_m8v4_numpy, lib, _state((6, 512), 4))


def test_m_is_the_8_bit_formats_and_v_the_4_bit_formats():
    """m's codes and scales are the 8-bit format's at this block, v's the 4-bit format's: the same bits from the
    same seed, and the same values back."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    m, ma = m8v4_quantize(x, M8V4_BLOCK, "m", seed=11)
    m8, ma8 = q8_quantize(x, M8V4_BLOCK, "m", seed=11)
    assert np.array_equal(m, m8) and np.array_equal(ma, ma8)
    assert np.array_equal(m8v4_dequantize(m, ma, M8V4_BLOCK, "m", x.shape), q8_dequantize(m8, ma8, M8V4_BLOCK, "m"))
    v, va = m8v4_quantize(x ** 2, M8V4_BLOCK, "v", seed=11)
    v4, va4 = q4_quantize(x ** 2, M8V4_BLOCK, "v", seed=11)
    assert np.array_equal(v, v4) and np.array_equal(va, va4)
    assert np.array_equal(m8v4_dequantize(v, va, M8V4_BLOCK, "v", x.shape),
                          q4_dequantize(v4, va4, M8V4_BLOCK, "v", x.shape))
    with pytest.raises(ValueError, match="kind"):
        m8v4_quantize(x, M8V4_BLOCK, "mu", seed=0)


def test_which_leaves_take_m8v4_moments_and_their_bytes():
    """The 4-bit format's leaves (matrices of 4,096+ elements, rows of an even length); m a byte an element, v half
    of one, a float32 scale per 128 elements for each: 1.56 bytes a parameter for both."""
    assert m8v4_leaf((64, 64)) and not m8v4_leaf((4096,)) and not m8v4_leaf((63, 65))
    assert m8v4_codes_shape((64, 256), "m") == (64, 256) and m8v4_codes_shape((64, 256), "v") == (64, 128)
    assert m8v4_scale_shape((64, 256)) == (64, 2)
    assert precision.MODES["m8v4"].moments_of((4096, 4096)) == 4096 * 4096 + 4096 * 2048 + 2 * 4 * 4096 * 32
    q8, q4 = (precision.MODES[n].moments_of((4096, 4096)) for n in ("q8", "q4"))
    assert q4 < precision.MODES["m8v4"].moments_of((4096, 4096)) < q8


def test_engine_holds_m8v4_moments_and_trains_as_capacity_mode_does(lib):
    """Through the engine: the matrices' m is a byte an element, v half of one, each with its scales; on one batch
    over 8 steps the losses follow capacity mode's within 2%."""
    def check(p, m, v):
        assert isinstance(m, QuantizedMoment) == isinstance(v, QuantizedMoment) == m8v4_leaf(p.shape)
        if m8v4_leaf(p.shape):
            assert m.codes.size == p.size and 2 * v.codes.size == p.size
            assert m.absmax.shape == v.absmax.shape == m8v4_scale_shape(p.shape)
    trains_as_capacity_mode_does(M8V4, check)
