"""The memory plan: the right ballpark for real models, refusal with the numbers and what would fit."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain_jax.engine_config import EngineConfig
from megatrain_jax.memory_plan import GiB, MemoryPlanError, layer_param_count, plan
from megatrain_jax.models.config import preset

SEVEN_B = preset("7b")
BIG = dict(host_ram_bytes=10_000 * GiB, gpu_bytes=10_000 * GiB)


def test_7b_host_bytes_per_parameter():
    p = plan(SEVEN_B, EngineConfig(micro_batches=2), 16, 2048, **BIG)
    P = SEVEN_B.param_count()
    assert 6.6e9 < P < 6.8e9
    assert p.host["master weights, float32 (4 B/param)"] == 4 * P
    assert p.host["Adam moments m and v, float32 (8 B/param)"] == 8 * P
    assert p.host["gradients of one step, float32 (4 B/param)"] == 4 * P
    assert p.stream_dtype == "bfloat16" and "16-bit stream copy of the weights (2 B/param)" in p.host
    assert 17.5 < p.host_total / P < 20.5  # 18 B/param persistent, plus temporaries
    # streaming the float32 masters drops the 16-bit copy
    f32 = plan(SEVEN_B, EngineConfig(micro_batches=2, stream_dtype="float32"), 16, 2048, **BIG)
    assert 1.9 < (p.host_total - f32.host_total) / P < 2.6


def test_gpu_bytes_match_the_measured_3p5b_run():
    # experiments/results/h100_3p5b_engine_v2.json: 3.5B, 16 x 2048 tokens, 2 micro-batches: 14.5 GiB peak
    p = plan(preset("7b", layers=16), EngineConfig(micro_batches=2), 16, 2048, **BIG)
    assert 11 * GiB < p.gpu_total < 19 * GiB
    Pl = layer_param_count(SEVEN_B)
    assert 200e6 < Pl < 205e6
    assert p.gpu["streamed layer weights (2 layers x 202 M x 2 B)"] == 2 * Pl * 2
    tokens = 16 * 2048
    assert p.gpu[f"boundary activations (17 x {tokens} tokens x 4096 x 2 B)"] == 17 * tokens * 4096 * 2


def test_more_micro_batches_less_gpu_memory_same_host():
    one = plan(SEVEN_B, EngineConfig(micro_batches=1), 16, 2048, **BIG)
    four = plan(SEVEN_B, EngineConfig(micro_batches=4), 16, 2048, **BIG)
    assert four.gpu_total < one.gpu_total and four.host_total == one.host_total
    deeper = plan(SEVEN_B, EngineConfig(prefetch_depth=3), 16, 2048, **BIG)
    assert deeper.gpu_total - one.gpu_total == 2 * layer_param_count(SEVEN_B) * 2


def test_fits_and_check_passes_with_room():
    p = plan(SEVEN_B, EngineConfig(micro_batches=2), 16, 2048, host_ram_bytes=200 * GiB, gpu_bytes=80 * GiB)
    assert p.fits
    p.check()
    assert "fits" in p.table() and "OVER" not in p.table()


def test_refuses_when_limits_are_tiny_and_lists_numbers_and_options():
    p = plan(SEVEN_B, EngineConfig(micro_batches=1), 64, 2048, host_ram_bytes=110 * GiB, gpu_bytes=30 * GiB)
    assert not p.host_fits and not p.gpu_fits
    with pytest.raises(MemoryPlanError) as e:
        p.check()
    msg = str(e.value)
    assert "host RAM and GPU memory" in msg and "OVER by" in msg and "GiB" in msg
    assert "engine.micro_batches = " in msg  # smaller micro-batches
    assert "engine.stream_dtype = 'float32'" in msg  # no 16-bit host copy
    assert "memory_check = false" in msg


def test_host_overflow_suggests_a_smaller_model():
    p = plan(SEVEN_B, EngineConfig(micro_batches=2), 16, 2048, host_ram_bytes=64 * GiB, gpu_bytes=80 * GiB)
    assert not p.host_fits and p.gpu_fits
    opts = p.options()
    layers = int(next(o for o in opts if o.startswith("a smaller model")).split("= ")[1].split()[0])
    assert 10 < layers < 32 and p.replace(model_cfg=SEVEN_B.replace(layers=layers)).fits
    assert not p.replace(model_cfg=SEVEN_B.replace(layers=layers + 1)).fits
    assert any("at least" in o and "GiB of free host RAM" in o for o in opts)


def test_each_suggested_option_really_fits():
    p = plan(SEVEN_B, EngineConfig(micro_batches=1), 64, 2048, host_ram_bytes=1000 * GiB, gpu_bytes=40 * GiB)
    assert p.host_fits and not p.gpu_fits
    opts = p.options()
    micro = next(o for o in opts if o.startswith("smaller micro-batches"))
    m = int(micro.split("= ")[1].split()[0])
    assert plan(SEVEN_B, EngineConfig(micro_batches=m), 64, 2048, host_ram_bytes=1000 * GiB,
                gpu_bytes=40 * GiB).fits
    assert any(o.startswith("fewer rows per step") for o in opts)


def test_float32_stream_over_gpu_suggests_bf16():
    e = EngineConfig(micro_batches=16, stream_dtype="float32", prefetch_depth=4)
    base = plan(SEVEN_B, e, 16, 2048, host_ram_bytes=1000 * GiB, gpu_bytes=1000 * GiB)
    tight = dataclasses.replace(base, gpu_available=base.gpu_total - 1)
    assert not tight.gpu_fits
    assert any("stream_dtype = 'bfloat16'" in o or "prefetch_depth = 1" in o for o in tight.options())


def test_packed_rows_count_attention_scores():
    plain = plan(SEVEN_B, EngineConfig(), 4, 2048, **BIG)
    packed = plan(SEVEN_B, EngineConfig(), 4, 2048, packed=True, **BIG)
    assert packed.gpu_total > plain.gpu_total


def test_bad_inputs():
    with pytest.raises(ValueError, match="divisible by micro_batches"):
        plan(SEVEN_B, EngineConfig(micro_batches=3), 16, 2048, **BIG)


def test_gpu_resident_parts_cost_gpu_memory():
    if "resident_layers" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        pytest.skip("this engine has no GPU-resident parts")
    base = plan(SEVEN_B, EngineConfig(), 16, 2048, **BIG)
    res = plan(SEVEN_B, EngineConfig(resident_layers=2, resident_io=True), 16, 2048, **BIG)
    from megatrain_jax.memory_plan import io_param_count
    extra = 18 * (2 * layer_param_count(SEVEN_B) + io_param_count(SEVEN_B))
    assert res.gpu_total - base.gpu_total == extra and res.host_total == base.host_total
