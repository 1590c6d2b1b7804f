"""The host kernel's builds agree bit for bit: the AVX-512 and AVX2 passes of the 8-bit and m7v5 moment kernels
(used where the compiler targets them, as on the GPU machines' hosts; ``MEGATRAIN_NO_AVX512`` leaves the first out)
against each other and against the portable loops alone (``MEGATRAIN_NO_INTRINSICS``, what a machine without AVX2
runs), on states whose magnitudes span the formats' ranges, blocks whose lengths are not multiples of the vectors'
8 and 32 elements, and counters near the end of their range; and the m7v5 kernel against its numpy reference on
such a state."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from megatrain_jax.engine.update import host_kernel
from megatrain_jax.engine.update.m7v5 import adamw_m7v5_numpy, adamw_m7v5_reference, m7v5_quantize
from megatrain_jax.engine.update.q8 import adamw_q8_numpy, q8_quantize

from test_host_kernel_q8 import HP, _assert_equal
from test_host_kernel_q8 import _kernel as kernel_on_copies
from test_host_kernel_q8 import _state as wide_state

BF16 = ml_dtypes.bfloat16
FORMATS = {"q8": (q8_quantize, adamw_q8_numpy), "m7v5": (m7v5_quantize, adamw_m7v5_numpy)}
# rows, cols, block, offset: a block of 16 (under one 32-element vector pass), blocks of 40 and 50 (tails of 8
# and 18 after the vectors), a last block shorter than the others, counters that wrap past 2^32
CASES = [(3, 1000, 256, 0), (7, 300, 128, 6), (13, 80, 16, 124), (5, 250, 50, 0), (9, 2 * 4096 + 40, 4096, 0),
         (24, 2088, 40, 2 ** 32 - 24 * 2088)]
# m7v5's codes come eight to a group: rows and blocks a multiple of 8 long (a block of 40: a tail of 8 after the
# 32-element vector pass)
CASES_8 = [(3, 1000, 256, 0), (7, 296, 128, 6), (13, 80, 16, 124), (5, 248, 40, 0), (9, 2 * 4096 + 40, 4096, 0),
           (24, 2088, 40, 2 ** 32 - 24 * 2088)]


def cases(fmt: str) -> list[tuple[int, int, int, int]]:
    return CASES_8 if fmt == "m7v5" else CASES


@pytest.fixture(scope="module")
def portable():
    built = host_kernel.load(("MEGATRAIN_NO_INTRINSICS",))
    if built is None:
        pytest.fail("the portable build of the host kernel failed (the warning above says why)", pytrace=False)
    return built


def _state(fmt: str, rows: int, cols: int, block: int, seed: int, g_bf16: bool):
    return wide_state(rows, cols, block, seed, g_bf16, quantize=FORMATS[fmt][0])


def _run(fmt: str, lib, state, **hp):
    return kernel_on_copies(lib, state, run=FORMATS[fmt][1], **hp)


def _three_steps_agree(fmt: str, a, b, g_bf16: bool, what: str) -> None:
    """Builds ``a`` and ``b`` over the cases, three steps in a row each, each build fed its own last result:
    every p bit, code and scale equal, and p moved."""
    for i, (rows, cols, block, offset) in enumerate(cases(fmt)):
        state = _state(fmt, rows, cols, block, i, g_bf16)
        ours = theirs = state
        for step in range(3):
            hp = dict(HP, block=block, seed=1000 * i + step, offset=offset)
            ours = (*_run(fmt, a, ours, **hp), state[5])
            theirs = (*_run(fmt, b, theirs, **hp), state[5])
            _assert_equal(ours[:5], theirs[:5], f"{fmt}, {what}, case {i}, step {step}")
            ours = (ours[0].view(BF16), *ours[1:])
            theirs = (theirs[0].view(BF16), *theirs[1:])
        assert (ours[0].view(np.uint16) != state[0].view(np.uint16)).mean() > 0.3  # p moved


@pytest.mark.parametrize("g_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
def test_vector_and_portable_builds_agree_bit_for_bit(lib, portable, fmt, g_bf16):
    """Three steps in a row per case, each build fed its own last result: every p bit, code and scale equal."""
    _three_steps_agree(fmt, lib, portable, g_bf16, "vector against portable")


def test_vector_and_portable_builds_agree_on_millions_of_elements(lib, portable):
    """A float32 result one unit in the last place off changes a stochastically rounded p with probability 2^-16
    and a code with 2^-20 (a scale shows it at once), so a different operation order needs millions of
    elements to show: one step of each format over 2M."""
    for fmt in FORMATS:
        state = _state(fmt, 1000, 2048, 2048, 77, False)
        hp = dict(HP, block=2048, seed=5, offset=0)
        _assert_equal(_run(fmt, lib, state, **hp), _run(fmt, portable, state, **hp), fmt)


@pytest.fixture(scope="module")
def avx2_only():
    built = host_kernel.load(("MEGATRAIN_NO_AVX512",))
    if built is None:
        pytest.fail("the build without the AVX-512 passes failed (the warning above says why)", pytrace=False)
    return built


@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
def test_avx512_and_avx2_builds_agree_bit_for_bit(lib, avx2_only, portable, fmt):
    """The quantized-moment kernels' AVX-512 passes (16 elements a vector, where the compiler targets AVX-512)
    against their AVX2 passes, on the cases above (three steps each, both gradient types) and over 2M elements.
    Where this machine has no AVX-512 both builds are AVX2 and the widths the test checks say so."""
    widths = (lib.megatrain_q8_vector_width(), avx2_only.megatrain_q8_vector_width(),
              portable.megatrain_q8_vector_width())
    assert widths[1:] in ((8, 1), (1, 1)) and widths[0] >= widths[1], widths
    for g_bf16 in (False, True):
        _three_steps_agree(fmt, lib, avx2_only, g_bf16, f"widths {widths}")
    state = _state(fmt, 1000, 2048, 2048, 78, True)
    hp = dict(HP, block=2048, seed=6, offset=0)
    _assert_equal(_run(fmt, lib, state, **hp), _run(fmt, avx2_only, state, **hp), f"2M, widths {widths}")


def test_m7v5_kernel_matches_its_reference_across_magnitudes(lib):
    """The kernel of 7-bit m with 5-bit v against its numpy reference on the wide-ranging state (both gradient
    types, every case, three steps in a row each fed its own last result)."""
    fmt, reference = "m7v5", adamw_m7v5_reference
    for g_bf16 in (False, True):
        for i, (rows, cols, block, offset) in enumerate(cases(fmt)):
            state = _state(fmt, rows, cols, block, i, g_bf16)
            for step in range(3):
                hp = dict(HP, block=block, seed=41 + 7 * i + step, offset=offset)
                got = _run(fmt, lib, state, **hp)
                _assert_equal(got, reference(*state, **hp), f"case {i}, step {step}")
                state = (got[0].view(BF16), *got[1:], state[5])


@pytest.mark.parametrize("start", [0, 1, 16], ids=["aligned", "odd_start", "half_line"])
def test_float32_passes_agree_across_builds_wherever_the_copy_starts(lib, portable, start):
    """The float32 kernel's whole update and its stream pass (whose bfloat16 copy the AVX2 build writes with
    non-temporal stores where a block of it is 32-byte aligned, with plain stores elsewhere) write the same bits
    as the portable build, for copies that start on, off and half-way into a 32-byte line; the stream pass's
    copy equals the whole update's."""
    from megatrain_jax.engine.update.host_kernel import adamw_numpy
    rng = np.random.default_rng(start)
    n = 300_000 + 7
    p, m, g = (rng.standard_normal(n).astype(np.float32) * s for s in (1.0, 1e-3, 1e-3))
    v = np.abs(rng.standard_normal(n)).astype(np.float32) * 1e-6
    copies = {}
    for name, kernel in (("vector", lib), ("portable", portable)):
        for stream_only in (False, True):
            state = [a.copy() for a in (p, m, v)]
            buf = np.zeros(n + 32, np.uint16)
            out = buf[start:start + n]
            adamw_numpy(*state, g, out, stream_only=stream_only, lib=kernel, **HP)
            assert not buf[:start].any() and not buf[start + n:].any()  # nothing written outside the copy
            copies[name, stream_only] = out.copy()
            if not stream_only:
                copies[name, "state"] = [a.copy() for a in state]
    for key in ((False,), (True,)):
        np.testing.assert_array_equal(copies[("vector", *key)], copies[("portable", *key)])
    np.testing.assert_array_equal(copies["vector", True], copies["vector", False])
    for a, b in zip(copies["vector", "state"], copies["portable", "state"]):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_kernel_cache_keys_on_the_cpus_features(monkeypatch, tmp_path):
    """A cache shared by hosts of different CPUs (a home folder on a network disk) holds one build per kind of CPU:
    ``-march=native`` builds for this one's features, which another host may lack."""
    monkeypatch.setenv("MEGATRAIN_KERNEL_CACHE", str(tmp_path))
    here = host_kernel.built_path("g++", host_kernel.COMPILE_FLAGS)
    assert here.parent == tmp_path and here == host_kernel.built_path("g++", host_kernel.COMPILE_FLAGS)
    if not host_kernel.cpu_features():
        pytest.skip("no CPU feature flags readable on this machine (/proc/cpuinfo)")
    monkeypatch.setattr(host_kernel, "cpu_features", lambda: "fpu sse sse2")
    assert host_kernel.built_path("g++", host_kernel.COMPILE_FLAGS) != here


@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
def test_the_stream_pass_then_the_commit_pass_leave_what_the_whole_update_does(lib, avx2_only, portable, fmt):
    """A quantized update split in two: ``stream`` writes p alone (codes and scales untouched), ``commit`` then
    writes the codes and scales alone (p untouched) from the same old codes and gradient; together, bit for bit
    the whole update, in every build, on the cases above with both gradient types."""
    for name, built in (("default", lib), ("avx2", avx2_only), ("portable", portable)):
        for g_bf16 in (False, True):
            for i, (rows, cols, block, offset) in enumerate(cases(fmt)):
                state = _state(fmt, rows, cols, block, i, g_bf16)
                hp = dict(HP, block=block, seed=500 + i, offset=offset)
                whole = _run(fmt, built, state, **hp)
                streamed = _run(fmt, built, state, part="stream", **hp)
                what = f"{fmt}, {name} build, case {i}, g_bf16 {g_bf16}"
                np.testing.assert_array_equal(streamed[0], whole[0], err_msg=f"{what}: p")
                for a, b in zip(streamed[1:], state[1:5]):  # codes and scales as they were
                    np.testing.assert_array_equal(a, b, err_msg=f"{what}: moments touched by the stream pass")
                committed = _run(fmt, built, (streamed[0].view(BF16), *state[1:]), part="commit", **hp)
                _assert_equal(committed, whole, what)


def test_an_unknown_pass_is_refused(lib):
    state = _state("q8", 2, 64, 32, 0, False)
    with pytest.raises(ValueError, match="pass must be one of whole, stream, commit"):
        _run("q8", lib, state, part="second", **dict(HP, block=32, seed=1, offset=0))
