"""The fused host AdamW kernel (kernels/host_adamw.cpp) against its jnp reference, across thread counts and
entry points."""

from __future__ import annotations

import numpy as np
import pytest

from megatrain_jax.engine.update.host_kernel import adamw_numpy, adamw_reference, set_threads


def test_host_kernel_matches_reference_math(lib):
    rng = np.random.default_rng(0)
    n = 10_001
    p, m, g = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(np.float32)
    hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.5, bc1=1 - 0.9 ** 3, bc2=1 - 0.95 ** 3)
    ref = [np.asarray(x) for x in adamw_reference(p, m, v, g, **hp)]
    out = np.empty(n, np.uint16)
    adamw_numpy(p, m, v, g, out, lib=lib, **hp)
    for got, want in zip((p, m, v), ref[:3]):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(out, ref[3].view(np.uint16))


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) if a.dtype == np.float32 else a


def test_host_kernel_same_bits_across_threads_and_entry_points(lib):
    """One thread and four (more than the cores of a small runner, so chunks really are shared out), over
    sizes that end mid-chunk, mid-block, on a chunk boundary and below one block: every element is updated
    exactly once (sentinel-filled outputs, jnp reference), with the same bits for either thread count, and
    the stream-only pass writes the bf16 copy the full update writes, leaving p, m and v alone."""
    rng = np.random.default_rng(3)
    hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.7, bc1=0.1, bc2=0.05)
    try:
        for n in (7, 33, 65_536 * 2, 65_536 * 2 + 37, 300_017):
            src = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
            src[2] = np.abs(src[2])
            ref = [np.asarray(x) for x in adamw_reference(*src, **hp)]
            results = {}
            for threads in (1, 4):
                set_threads(threads, lib)
                where = f"n={n}, threads={threads}"
                stream_state = [x.copy() for x in src]
                first_half = np.full(n, 0xFFFE, np.uint16)
                adamw_numpy(*stream_state, first_half, stream_only=True, lib=lib, **hp)
                for got, want in zip(stream_state, src):
                    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"stream-only wrote state, {where}")
                state = [x.copy() for x in src]
                bf16 = np.full(n, 0xFFFF, np.uint16)
                adamw_numpy(*state, bf16, lib=lib, **hp)
                np.testing.assert_array_equal(first_half, bf16, err_msg=where)
                for got, want in zip(state[:3], ref[:3]):
                    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=where)
                np.testing.assert_array_equal(bf16, ref[3].view(np.uint16), err_msg=where)
                results[threads] = state[:3] + [bf16]
            for got, want in zip(results[4], results[1]):
                np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"4 threads vs 1, n={n}")
    finally:
        set_threads(0, lib)  # back to OpenMP's default for the rest of the process


@pytest.mark.parametrize("n", [5, 16, 65_536 + 19, 200_003])
def test_float32_kernels_read_a_bfloat16_gradient_as_its_float32_widening(lib, n):
    """Both float32 entry points take a bfloat16 gradient (uint16 bits): p, m, v and the copy are bit for bit
    those of the same values given as float32, over sizes that end mid-block and mid-chunk."""
    rng = np.random.default_rng(5)
    hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=0.7, bc1=0.1, bc2=0.05)
    p, m = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    v = np.abs(rng.standard_normal(n)).astype(np.float32)
    g16 = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    g32 = (g16.astype(np.uint32) << 16).view(np.float32)
    out = {}
    for name, g in (("float32", g32), ("bfloat16", g16)):
        state = [x.copy() for x in (p, m, v)]
        first, copy = np.full(n, 0xFFFE, np.uint16), np.full(n, 0xFFFF, np.uint16)
        adamw_numpy(*state, g, first, stream_only=True, lib=lib, **hp)
        adamw_numpy(*state, g, copy, lib=lib, **hp)
        np.testing.assert_array_equal(first, copy)
        out[name] = [_bits(x) for x in state] + [copy]
    assert not np.array_equal(out["float32"][0], _bits(p))  # it did update
    for a, b in zip(out["float32"], out["bfloat16"]):
        np.testing.assert_array_equal(a, b)
