"""7-bit m with 5-bit v (``moment_dtype="m7v5"``, ``megatrain_jax.engine.update.m7v5``): the kernel against its
numpy reference bit for bit, a leaf updated in pieces as a whole, the grids and their packing, the bytes, and the
mode trained through the engine against capacity mode. (The kernel's builds against each other and the two
passes of a split update: ``test_host_kernel_paths.py``; the engine against the whole-model reference:
``test_q8_moments.py``; conversions on restore: ``test_checkpoint.py``.)"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, adamw
from megatrain_jax.engine import precision
from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.host_optimizer import QuantizedMoment
from megatrain_jax.engine.update.m7v5 import (BITS, M7V5_BLOCK, VMAX, adamw_m7v5_numpy, adamw_m7v5_reference,
                                              m7v5_codes_shape, m7v5_decode, m7v5_dequantize, m7v5_encode,
                                              m7v5_leaf, m7v5_quantize, m7v5_scale_shape, pack_groups,
                                              unpack_groups)
from megatrain_jax.engine.update.q8 import q8_decode_m

from test_engine import TINY3, make_batches

BF16 = ml_dtypes.bfloat16
HP = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.7, bc1=0.5, bc2=0.3)
M7V5 = EngineConfig(master_dtype="bfloat16", moment_dtype="m7v5", host_grad_dtype="bfloat16")


def _state(shape, seed, g_bf16=False, block=M7V5_BLOCK, quantize=m7v5_quantize):
    """bfloat16 p, m and v in a quantized format (``quantize``: m7v5's by default) with their scales, and g."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape).astype(BF16)
    g = (rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))).astype(np.float32)
    if g_bf16:
        g = g.astype(BF16)
    m, ma = quantize(0.01 * rng.standard_normal(shape), block, "m", seed=seed + 1)
    v, va = quantize(1e-4 * np.abs(rng.standard_normal(shape)), block, "v", seed=seed + 2)
    return p, m, v, ma, va, g


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


@pytest.mark.parametrize("g_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("shape,block", [((64, 384), 128), ((3, 1000), 128), ((5, 4104), 128), ((4, 2, 48), 32)])
def test_kernel_matches_reference_bit_for_bit(lib, g_bf16, shape, block):
    """Rows of several blocks, a last block shorter than the others, a leaf of three dimensions; three steps in a
    row, each fed the last one's result."""
    steps_match_the_reference(adamw_m7v5_numpy, adamw_m7v5_reference, lib, _state(shape, 3, g_bf16, block), block)


def test_rows_in_pieces_equal_the_whole(lib):
    """A call on a run of whole rows with its flat offset writes what the whole call writes there (the engine
    updates a leaf spread over devices piece by piece: m's rows are cols * 7 / 8 bytes, v's cols * 5 / 8)."""
    pieces_equal_the_whole(adamw_m7v5_numpy, lib, _state((6, 512), 4))


def test_the_grids_are_small_floats_and_rounding_is_unbiased():
    """m: a sign and e3m3 (64 magnitudes, 2^-9 steps below 2^-6, largest 1.875), the 8-bit m's grid without its top
    exponent bit's values; v: e4m1 (32 values, largest 1.5). Each value's codes average back to it."""
    m = np.abs(m7v5_decode(np.arange(128, dtype=np.uint8), "m"))
    assert len(np.unique(m)) == 64 and m.max() == VMAX["m"] == 1.875 and np.unique(m)[1] == 2.0 ** -9
    assert set(np.unique(m) * 2.0 ** -8) <= set(np.abs(q8_decode_m(np.arange(128, dtype=np.uint8))))
    assert np.array_equal(m7v5_decode(np.arange(64, 128, dtype=np.uint8), "m"), -m[:64])
    v = m7v5_decode(np.arange(32, dtype=np.uint8), "v")
    assert len(np.unique(v)) == 32 and v.max() == VMAX["v"] == 1.5 and v[1] == 2.0 ** -15 and v[2] == 2.0 ** -14
    assert v[3] == 1.5 * 2.0 ** -14 and np.all(np.diff(v) > 0)
    r = host_kernel.sr_bits(7, 1, 0, 200_000)
    for kind, y in (("m", 0.3), ("m", -0.01), ("m", 3e-4), ("v", 0.7), ("v", 4.5e-5), ("v", 1e-3)):
        mean = float(np.mean(m7v5_decode(m7v5_encode(np.full(200_000, y, np.float32), r, kind), kind)))
        assert mean == pytest.approx(y, rel=0.02), (kind, y)
    assert m7v5_encode(np.array([1e-30], np.float32), r[:1], "v")[0] == 1  # a positive v never code 0
    assert m7v5_encode(np.array([-0.0, np.nan, 9.0], np.float32), r[:3], "m").tolist() == [0, 63, 63]


def test_codes_pack_eight_to_a_group_of_their_bits():
    """Element 8j + i at bits ``bits * i`` of group j's little-endian word; unpacking gives the codes back."""
    rng = np.random.default_rng(0)
    for bits in (5, 7):
        codes = rng.integers(0, 2 ** bits, (3, 64), dtype=np.uint8)
        packed = pack_groups(codes, bits)
        assert packed.shape == (3, 8 * bits)
        assert np.array_equal(unpack_groups(packed, bits, 64), codes)
        word = int.from_bytes(bytes(packed[1, bits:2 * bits]), "little")
        assert [(word >> (bits * i)) & (2 ** bits - 1) for i in range(8)] == codes[1, 8:16].tolist()


def test_which_leaves_take_m7v5_moments_and_their_bytes():
    """Matrices of 4,096+ elements whose rows are a multiple of 8 long; m 7 bits an element and v 5, a float32 scale
    per 128 elements for each: 1.5625 bytes a parameter for both."""
    assert m7v5_leaf((64, 64)) and not m7v5_leaf((4096,)) and not m7v5_leaf((64, 68)) and m7v5_leaf((4, 2, 512))
    assert m7v5_codes_shape((64, 256), "m") == (64, 224) and m7v5_codes_shape((64, 256), "v") == (64, 160)
    assert m7v5_scale_shape((64, 256)) == (64, 2) and BITS == {"m": 7, "v": 5}
    n = 4096 * 4096
    assert precision.MODES["m7v5"].moments_of((4096, 4096)) == n * 12 // 8 + 2 * 4 * 4096 * 32
    with pytest.raises(ValueError, match="multiple of 8"):
        m7v5_quantize(np.zeros((4, 12), np.float32), M7V5_BLOCK, "m", seed=0)
    with pytest.raises(ValueError, match="block"):
        m7v5_scale_shape((64, 256), block=100)
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    codes, scales = m7v5_quantize(x, M7V5_BLOCK, "m", seed=3)
    back = m7v5_dequantize(codes, scales, M7V5_BLOCK, "m", x.shape)
    assert np.max(np.abs(back - x) / np.abs(x).max()) < 0.07  # within a step of the grid
    with pytest.raises(ValueError, match="codes must have shape"):
        m7v5_dequantize(codes[:, :-1], scales, M7V5_BLOCK, "m", x.shape)


def test_engine_holds_m7v5_moments_and_trains_as_capacity_mode_does(lib):
    """Through the engine: the matrices' m is 7 bits an element, v 5, each with its scales; on one batch over 8
    steps the losses follow capacity mode's within 2%."""
    def check(p, m, v):
        assert isinstance(m, QuantizedMoment) == isinstance(v, QuantizedMoment) == m7v5_leaf(p.shape)
        if m7v5_leaf(p.shape):
            assert 8 * m.codes.size == 7 * p.size and 8 * v.codes.size == 5 * p.size
            assert m.absmax.shape == v.absmax.shape == m7v5_scale_shape(p.shape)
    trains_as_capacity_mode_does(M7V5, check)
