"""The experiment scripts' pure parts: the side-by-side verdict and the step timeline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from flax import nnx

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, adamw, preset
from megatrain_jax.timeline import Timeline

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return sys.modules[name]


def _runs(ours_32k=21000.0, ds_32k=10000.0, tflops_7b=450.0, host=(5.0e9, 4.8e9), idle=0.05):
    return [
        {"system": "megatrain_jax", "config": "3p5b_32k", "tokens_per_s": ours_32k,
         "breakdown": {"gpu_idle_fraction_est": idle}},
        {"system": "deepspeed_zero3", "config": "3p5b_32k", "tokens_per_s": ds_32k},
        {"system": "megatrain_jax", "config": "3p5b_98k", "tokens_per_s": 21000.0,
         "breakdown": {"gpu_idle_fraction_est": 0.0}},
        {"system": "deepspeed_zero3", "config": "3p5b_98k", "tokens_per_s": 13000.0},
        {"system": "megatrain_jax", "config": "7b_32k", "model_tflops": tflops_7b},
        {"system": "megatrain_jax_fused_kernel_fp32", "config": "host_adamw", "params_per_s": host[0]},
        {"system": "torch_fused_cpu_adamw", "config": "host_adamw", "params_per_s": host[1]},
    ]


def test_side_by_side_verdict_checks_every_bar():
    targets = load_script("side_by_side").targets
    good = targets({"runs": _runs()})
    assert good["all_met"], good
    assert good["3p5b_32k_vs_zero3"]["ratio"] == 2.1
    for bad, key in [(_runs(ds_32k=11000.0), "3p5b_32k_vs_zero3"), (_runs(tflops_7b=449.0), "7b_32k_model_tflops"),
                     (_runs(host=(4.0e9, 4.8e9)), "host_optimizer_vs_torch"), (_runs(idle=0.11), "gpu_idle_fraction")]:
        verdict = targets({"runs": bad})
        assert not verdict[key]["met"] and not verdict["all_met"], key


def test_side_by_side_verdict_without_a_peer_run_claims_nothing():
    runs = [r for r in _runs() if r["system"] != "deepspeed_zero3"]
    verdict = load_script("side_by_side").targets({"runs": runs})
    assert "3p5b_32k_vs_zero3" not in verdict and "3p5b_98k_vs_zero3" not in verdict
    assert load_script("side_by_side").targets({"runs": []})["all_met"] is False


def test_timeline_records_host_ops_device_readiness_and_update_tasks():
    cfg = preset("tiny", layers=2)
    engine = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(1e-3), EngineConfig(micro_batches=2))
    rng = np.random.default_rng(0)
    batch = lambda: Batch.from_windows(rng.integers(0, cfg.vocab_size, (4, 17)))
    engine.step(batch()).resolve()
    timeline = Timeline()
    engine.observe(timeline)
    engine.step(batch()).resolve()
    engine.sync()
    engine.stop_observing(timeline)
    events = timeline.close()
    recorded = len(timeline.events)
    engine.step(batch()).resolve()  # after stop_observing: nothing more is recorded
    assert len(timeline.events) == recorded == len(events)
    kinds = {(e["ev"], e.get("kind")) for e in events}
    for kind in ("fetch", "forward", "head", "backward", "send_grads", "grad_norm", "update", "commit"):
        assert ("host", kind) in kinds, kind
    for kind in ("forward", "backward", "head"):
        assert ("ready", kind) in kinds, kind
    tasks = [e for e in events if e["ev"] == "task"]
    assert {t["key"] for t in tasks} >= {"decide", "update io", "update block_00000", "update block_00001"}
    assert all(0 <= t["start"] <= t["end"] for t in tasks)
    ready = [e["at"] for e in events if e["ev"] == "ready" and e["kind"] == "forward"]
    assert len(ready) == 2 * 2 and all(t >= 0 for t in ready)


def test_startup_script_times_cold_then_warm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    out = tmp_path / "startup.json"
    result = load_script("startup").main(["--configs", "tiny_cpu", "--out", str(out),
                                          "--cache-root", str(tmp_path / "caches")])
    import json
    assert json.loads(out.read_text()) == result
    cold, warm = result["runs"]
    assert (cold["cache"], warm["cache"]) == ("cold", "warm")
    for run in (cold, warm):
        assert run["status"] == "ok", run["status"]
        assert set(run["phases_s"]) == {"interpreter", "imports", "backend", "state", "first_step"}
        assert run["time_to_first_step_s"] >= sum(run["phases_s"].values()) - 0.01
        assert np.isfinite(run["loss_first"])
    assert cold["loss_first"] == warm["loss_first"]  # the same model and batch, from cached programs
    first = lambda run: run["compilation"]["during_first_step"]
    assert first(cold)["cache_writes"] > 0 and first(cold)["cache_hits"] == 0
    assert first(warm)["cache_hits"] == first(cold)["cache_writes"] and first(warm)["cache_writes"] == 0
    assert result["device"]["platform"] == "cpu" and result["git_commit"] == "abc123"
    touched = load_script("startup").pretouch(0.5, processes=2)  # throwaway processes that write, then exit
    assert touched["gib"] == 0.5 and touched["s"] > 0


def test_bench_records_what_the_disk_tier_read_and_wrote(tmp_path):
    bench = load_script("bench")
    bc = bench.BenchConfig("tiny", None, 32, 4, EngineConfig(micro_batches=2, disk_parts=1, disk_dir=str(tmp_path)))
    run = bench.run_config("tiny_disk", bc, warmup=1, timed=2, profile=False)
    assert run["status"] == "ok", run["status"]
    tier = run["disk_tier"]
    assert tier["parts"] == ["block_00001"] and tier["read_bytes_per_step"] > 0 and tier["written_bytes_per_step"] > 0
    assert tier["read_gb_s_while_reading"] > 0 and tier["write_gb_s_while_writing"] > 0


def test_long_context_records_speed_peaks_and_the_plan():
    run = load_script("long_context").measure("tiny_cpu", load_script("long_context").CONFIGS["tiny_cpu"])
    assert run["status"] == "ok", run["status"]
    assert run["steps_timed"] == 1 and run["tokens_per_s"] > 0 and run["loss_finite"]
    assert run["plan"]["host_gib"] > 0 and set(run["plan_error"]) >= {"host"}
    assert run["engine"]["offload_activations"] == 0  # nothing is short here
