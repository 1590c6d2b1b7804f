"""4-bit Adam moments (``moment_dtype="q4"``, ``megatrain_jax.engine.update.q4``): the kernel against its numpy
reference bit for bit, the codes against their documented values, unbiased rounding, and the mode trained
through the engine against capacity mode and the reference step."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, adamw
from megatrain_jax.engine.update.host_optimizer import QuantizedMoment
from megatrain_jax.engine.update.q4 import (Q4_BLOCK, adamw_q4_numpy, adamw_q4_reference, q4_codes_shape,
                                            q4_decode_m, q4_decode_v, q4_dequantize, q4_leaf, q4_quantize,
                                            q4_scale_shape)

from test_engine import TINY3, make_batches

BF16 = ml_dtypes.bfloat16
HP = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.7, bc1=0.5, bc2=0.3)
Q4 = EngineConfig(master_dtype="bfloat16", moment_dtype="q4", host_grad_dtype="bfloat16")


def _state(shape, seed, g_bf16=False, block=Q4_BLOCK, quantize=q4_quantize):
    """bfloat16 p, m and v in a quantized format (``quantize``: 4-bit by default) with their scales, and g."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape).astype(BF16)
    g = (rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))).astype(np.float32)
    if g_bf16:
        g = g.astype(BF16)
    m, ma = quantize(0.01 * rng.standard_normal(shape), block, "m", seed=seed + 1)
    v, va = quantize(1e-4 * np.abs(rng.standard_normal(shape)), block, "v", seed=seed + 2)
    return p, m, v, ma, va, g


@pytest.mark.parametrize("g_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("shape,block", [((64, 384), 128), ((3, 1000), 128), ((5, 4098), 128), ((4, 2, 50), 32)])
def test_kernel_matches_reference_bit_for_bit(lib, g_bf16, shape, block):
    """Rows of several blocks, a last block shorter than the others, a leaf of three dimensions."""
    p, m, v, ma, va, g = _state(shape, 3, g_bf16, block)
    want = adamw_q4_reference(p, m, v, ma, va, g, block=block, seed=123, offset=0, **HP)
    got = [x.copy() for x in (p, m, v, ma, va)]
    adamw_q4_numpy(*got, g, block=block, seed=123, lib=lib, **HP)
    for name, a, b in zip(("p", "m", "v", "m scales", "v scales"), want, (got[0].view(np.uint16), *got[1:])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def steps_match_the_reference(run, reference, lib, state, block: int, steps: int = 3) -> None:
    """``run`` (a quantized kernel's numpy wrapper) against its numpy ``reference``, ``steps`` steps in a row from
    ``state`` (p, m, v, their scales, g), each fed the last one's result: every p bit, code and scale equal."""
    *got, g = [x.copy() for x in state]
    for step in range(steps):
        want = reference(*got, g, block=block, seed=123 + step, offset=0, **HP)
        run(*got, g, block=block, seed=123 + step, lib=lib, **HP)
        for name, a, b in zip(("p", "m", "v", "m scales", "v scales"), want, (got[0].view(np.uint16), *got[1:])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}, step {step}")


def pieces_equal_the_whole(run, lib, state) -> None:
    """``run`` (a quantized kernel's numpy wrapper) on runs of whole rows of ``state`` (6 x 512), each with its
    flat offset, writes what one call on the whole writes."""
    p, m, v, ma, va, g = state
    whole = [x.copy() for x in (p, m, v, ma, va)]
    run(*whole, g, seed=9, lib=lib, **HP)
    pieces = [x.copy() for x in (p, m, v, ma, va)]
    for a, b in ((0, 2), (2, 6)):
        views = [np.ascontiguousarray(x[a:b]) for x in pieces]
        run(*views, np.ascontiguousarray(g[a:b]), seed=9, offset=a * 512, lib=lib, **HP)
        for x, y in zip(pieces, views):
            x[a:b] = y
    for x, y in zip(whole, pieces):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_rows_in_pieces_equal_the_whole(lib):
    """A call on a run of whole rows with its flat offset writes what the whole call writes there (the engine
    updates a leaf spread over devices piece by piece)."""
    pieces_equal_the_whole(adamw_q4_numpy, lib, _state((6, 512), 4))


def test_codes_decode_to_documented_values():
    """m: bit 3 the sign, c in 1..7 is 2^(c - 7); v: c in 1..15 is 2^(c - 15); code 0 is 0."""
    assert list(q4_decode_m(np.arange(8))) == [0.0] + [2.0 ** (c - 7) for c in range(1, 8)]
    assert list(q4_decode_m(np.arange(8, 16))) == [-0.0] + [-(2.0 ** (c - 7)) for c in range(1, 8)]
    assert list(q4_decode_v(np.arange(16))) == [0.0] + [2.0 ** (c - 15) for c in range(1, 16)]


@pytest.mark.parametrize("kind", ["m", "v"])
def test_stochastic_rounding_is_unbiased(kind):
    """Averaged over seeds, the dequantized moment is the moment: within 3 standard errors of the rounding
    noise (at most half the block's maximum per draw), element by element."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x = x if kind == "m" else x ** 2
    draws = np.stack([q4_dequantize(*q4_quantize(x, Q4_BLOCK, kind, seed=s), Q4_BLOCK, kind) for s in range(400)])
    scale = np.repeat(np.abs(x).reshape(4, 2, 128).max(-1), 128, axis=1)
    assert np.all(np.abs(draws.mean(0) - x) <= 3 * 0.5 * scale / np.sqrt(400))
    assert np.all(np.abs(draws - x) <= scale * 0.5 + 1e-7)  # each draw is one of x's two neighbours


def test_positive_v_never_rounds_to_zero_and_zero_stays_zero():
    x = np.zeros((2, 256), np.float32)
    x[0, 0], x[0, 1:] = 1.0, 1e-12  # far under the grid's 2^-14: code 1, never 0
    codes, absmax = q4_quantize(x, Q4_BLOCK, "v", seed=1)
    back = q4_dequantize(codes, absmax, Q4_BLOCK, "v")
    assert np.all(back[0] > 0) and np.all(back[1] == 0) and absmax[1].max() == 0


def test_which_leaves_take_4_bit_moments_and_their_bytes():
    """Matrices of 4,096+ elements with an even row length; codes two to a byte, a float32 scale per 128."""
    assert q4_leaf((64, 64)) and q4_leaf((8, 16, 32)) and not q4_leaf((4096,)) and not q4_leaf((63, 65))
    assert q4_codes_shape((64, 256)) == (64, 128) and q4_scale_shape((64, 256)) == (64, 2)
    from megatrain_jax.engine import precision
    assert precision.MODES["q4"].moments_of((4096, 4096)) == 2 * (4096 * 2048 + 4 * 4096 * 32)
    with pytest.raises(ValueError, match="even"):
        q4_quantize(np.zeros((4, 5)), Q4_BLOCK, "m", seed=0)


def trains_as_capacity_mode_does(ec: EngineConfig, check_leaf) -> None:
    """An engine in quantized mode ``ec`` and one in capacity mode, on one batch over 8 steps: the quantized one's
    loss falls and follows capacity mode's within 2%; ``check_leaf(p, m, v)`` on every leaf of it after a sync."""
    cfg = TINY3.replace(dtype="bfloat16")
    batches = make_batches(1, vocab=cfg.vocab_size) * 8
    runs, engines = {}, {}
    for name, e in (("capacity", EngineConfig(master_dtype="bfloat16")), ("quantized", ec)):
        engine = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(3e-3), e)
        runs[name] = [engine.step([b]).resolve()["loss"] for b in batches]
        engines[name] = engine
    engine = engines["quantized"]
    engine.sync()
    for part in engine.state.parts:
        structure = jax.tree.structure(part.params)
        for p, m, v in zip(jax.tree.leaves(part.params), structure.flatten_up_to(part.opt.mu),
                           structure.flatten_up_to(part.opt.nu)):
            check_leaf(p, m, v)
    assert runs["quantized"][-1] < runs["quantized"][0] - 0.05
    assert max(abs(a - b) / b for a, b in zip(runs["quantized"], runs["capacity"])) < 0.02, runs
    for e in engines.values():
        e.close()


def test_engine_holds_4_bit_moments_and_trains_as_capacity_mode_does(lib):
    """Through the engine: the matrices' moments are 4-bit codes (half a byte per element) and scales, and on
    one batch over 8 steps the losses follow capacity mode's within 2%."""
    def check(p, m, v):
        assert isinstance(m, QuantizedMoment) == isinstance(v, QuantizedMoment) == q4_leaf(p.shape)
        if q4_leaf(p.shape):
            assert m.codes.dtype == np.uint8 and 2 * m.codes.size == p.size
            assert m.absmax.shape == q4_scale_shape(p.shape)
    trains_as_capacity_mode_does(Q4, check)
