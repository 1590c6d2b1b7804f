"""Smoke tests of the maintained experiment scripts (experiments/*.py; the one-off studies in
experiments/studies/ have none): each runs on the CPU in seconds, on a tiny model or on its pure parts, with
no GPU, torch or DeepSpeed, and reads nothing from experiments/results/."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, adamw, preset
from megatrain_jax.engine.parts import PartId
from megatrain_jax.engine.timeline import Timeline
from megatrain_jax.plan import io_param_count

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return sys.modules[name]


def _runs(ours_32k=23000.0, ds_32k=10000.0, tflops_7b=470.0, host=(6.0e9, 4.8e9), idle=0.05, ds_8k=3700.0):
    return [
        {"system": "megatrain_jax", "config": "3p5b_8k", "tokens_per_s": 18500.0,
         "breakdown": {"gpu_idle_fraction_est": 0.05}},
        {"system": "deepspeed_zero3", "config": "3p5b_8k", "tokens_per_s": ds_8k},
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
    assert good["3p5b_32k_vs_zero3"]["ratio"] == 2.3 and good["3p5b_8k_vs_zero3"]["ratio"] == 5.0
    for bad, key in [(_runs(ds_32k=11000.0), "3p5b_32k_vs_zero3"), (_runs(tflops_7b=469.0), "7b_32k_model_tflops"),
                     (_runs(ds_8k=3800.0), "3p5b_8k_vs_zero3"),
                     (_runs(host=(5.0e9, 4.8e9)), "host_optimizer_vs_torch"), (_runs(idle=0.11), "gpu_idle_fraction")]:
        verdict = targets({"runs": bad})
        assert not verdict[key]["met"] and not verdict["all_met"], key


def test_side_by_side_checks_issue_51s_bars():
    """SlideFormer against ours where both stream the model (same config label), ours against the better
    plain all-GPU run where it fits, and the step-time model's error on each run of ours."""
    targets = load_script("side_by_side").targets
    runs = [{"system": "megatrain_jax", "config": "3p5b_8k_nothing_resident", "tokens_per_s": 6600.0,
             "step_time_error": -0.06, "predicted_step": {"resident_share": 0.0}},
            {"system": "slideformer", "config": "3p5b_8k_nothing_resident", "tokens_per_s": 5500.0,
             "gpu_resident_param_share": 0.0},
            {"system": "megatrain_jax", "config": "3p5b_8k", "tokens_per_s": 22700.0, "step_time_error": 0.11},
            {"system": "plain_jax_gpu", "config": "3p5b_8k", "remat_policy": "nothing", "tokens_per_s": 19953.0},
            {"system": "plain_jax_gpu", "config": "3p5b_8k", "remat_policy": "dots", "tokens_per_s": 23793.0}]
    v = targets({"runs": runs})
    sf = v["3p5b_8k_nothing_resident_vs_slideformer"]
    assert sf["ratio"] == 1.2 and sf["met"] and sf["ours_gpu_resident_param_share"] == 0.0
    # a run of ours with skipped steps (no update ran in them) does not count, whatever its speed
    skipped = targets({"runs": [dict(runs[0], skipped_steps=2), runs[1]]})["3p5b_8k_nothing_resident_vs_slideformer"]
    assert skipped["ratio"] == 1.2 and not skipped["met"] and "2 of our timed steps were skipped" in skipped["not_counted"]
    plain = v["3p5b_8k_vs_plain_gpu"]
    assert plain["plain_gpu_remat_policy"] == "dots" and plain["ratio"] == 0.954 and plain["met"]
    assert not v["predicted_step_time"]["met"] and not v["all_met"]
    runs[0]["breakdown"] = {"host_update": {"gb_per_s": 90.0}}
    runs.append({"system": "stream", "config": "host_stream", "copy_gb_per_s": 92.7, "triad_gb_per_s": 100.0})
    host = targets({"runs": runs})["host_update_vs_stream"]
    assert host["share"] == {"3p5b_8k_nothing_resident": 0.9} and host["met"]
    # torch with fused AdamW is the other plain bar: the better of the two systems counts
    runs += [{"system": "plain_torch_gpu", "config": "3p5b_8k", "settings": "liger", "tokens_per_s": 24500.0},
             {"system": "plain_torch_gpu", "config": "3p5b_8k", "settings": "compiled", "status": "error: x"}]
    plain = targets({"runs": runs})["3p5b_8k_vs_plain_gpu"]
    assert plain["plain_gpu_system"] == "plain_torch_gpu" and plain["plain_gpu_settings"] == "liger"
    assert plain["ratio"] == 0.927 and not plain["met"]
    # --without names each system by the script its stages run
    sbs = load_script("side_by_side")
    args = type("Args", (), dict(out="o", warmup=2, steps=6, steps_8k=10, steps_98k=4, ds_steps=4, sf_steps=4,
                                 host_params=256, sf_flags="--no-timing"))
    all_stages = sbs.stages(args, "t")
    run_scripts = {cmd[1] for _, cmd in all_stages}
    assert set(sbs.SCRIPTS.values()) <= run_scripts
    # --sf-flags reach every SlideFormer run of the comparison; the sf_settings stage tries each switch on one shape
    headline = [cmd for st, cmd in all_stages if cmd[1] == sbs.SCRIPTS["slideformer"] and st != "sf_settings"]
    assert headline and all("--no-timing" in cmd for cmd in headline)
    settings = [cmd for st, cmd in all_stages if st == "sf_settings"]
    labels = [cmd[cmd.index("--config") + 1] for cmd in settings]
    assert labels == [f"3p5b_32k_slideformer_{n}" for n in ("default", "no_timing", "double_buffer",
                                                            "no_timing_double_buffer")]
    assert ["--no-timing" in c for c in settings] == [False, True, False, True]
    assert ["--double-buffer" in c for c in settings] == [False, False, True, True]
    # --sf-flags best: the sf_settings stage runs before any other, and the fastest of its runs gives the flags
    args.sf_flags = "best"
    ordered = sbs.stages(args, "t")
    assert [st for st, _ in ordered[:4]] == ["sf_settings"] * 4
    later = [cmd for st, cmd in ordered if cmd[1] == sbs.SCRIPTS["slideformer"] and st != "sf_settings"]
    assert later and all(sbs.SF_BEST in cmd for cmd in later)
    tried = [{"system": "slideformer", "config": f"3p5b_32k_slideformer_{n}", "tokens_per_s": t}
             for n, t in (("default", 18000.0), ("no_timing", 18500.0), ("double_buffer", None),
                          ("no_timing_double_buffer", 18400.0))]
    other = [{"system": "slideformer", "config": "3p5b_32k_nothing_resident", "tokens_per_s": 99999.0},
             {"system": "megatrain_jax", "config": "3p5b_32k_slideformer_default", "tokens_per_s": 99999.0}]
    assert sbs.best_sf_flags(tried + other) == (["--no-timing"], "no_timing")
    assert sbs.best_sf_flags(other) is None


def test_plain_torch_records_each_setting_and_what_stopped_it(tmp_path):
    """peers/plain_torch.py: each setting in a process of its own, appended to the results file as a run of its
    own, with where the model lives; a setting that cannot run (here: no torch on this machine, or a child that
    outlives --timeout) is recorded with the reason, not left out; unknown settings are refused."""
    spec = importlib.util.spec_from_file_location("plain_torch", REPO / "experiments" / "peers" / "plain_torch.py")
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)
    out = tmp_path / "fits.json"
    out.write_text(json.dumps({"name": "fits", "runs": [{"system": "megatrain_jax", "config": "3p5b_8k"}]}))
    small = ["--layers", "1", "--rows", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--seq", "64",
             "--warmup", "1", "--steps", "1"]
    runs = pt.main([*small, "--settings", "eager", "--out", str(out)])
    saved = json.loads(out.read_text())["runs"]
    assert [r["system"] for r in saved] == ["megatrain_jax", "plain_torch_gpu"] and saved[1] == runs[0]
    (run,) = runs
    assert run["config"] == "1l_128tok" and run["settings"] == "eager" and run["tokens_per_step"] == 128
    assert run["where_the_model_lives"]["gpu_resident_param_share"] == 1.0
    try:
        import torch  # noqa: F401
        assert run["status"] == "ok" and run["tokens_per_s"] > 0 and len(run["losses"]) == 2
    except ImportError:
        assert run["status"].startswith("error: ModuleNotFoundError") and "torch" in run["status"]
    (late,) = pt.main([*small, "--settings", "compiled", "--timeout", "0.01", "--out", "-"])
    assert late["status"] == "error: no result within 0.01 s" and late["settings"] == "compiled"
    with pytest.raises(SystemExit):
        pt.main([*small, "--settings", "fastest", "--out", "-"])


def test_a_peers_timed_steps_are_recorded_with_their_median():
    run = {"model": {"params": 3_500_000_000, "layers": 16, "hidden": 4096}}
    step = load_script("compare_zero3").record_timed(run, [6.0, 1.5, 1.4, 1.6, 1.5], [11.2, 11.1, 11.0, 10.9, 10.8],
                                                     1, 4, 2048)
    assert step == 1.5 and run["tokens_per_s"] == round(8192 / 1.5, 1) and run["status"] == "ok"
    assert run["loss_finite_and_decreasing"] is True


def test_side_by_side_verdict_without_a_peer_run_claims_nothing():
    runs = [r for r in _runs() if r["system"] != "deepspeed_zero3"]
    verdict = load_script("side_by_side").targets({"runs": runs})
    assert not {"3p5b_8k_vs_zero3", "3p5b_32k_vs_zero3", "3p5b_98k_vs_zero3"} & set(verdict)
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


def test_bench_traces_one_step_per_config_from_its_command_line(tmp_path, monkeypatch):
    """bench.py --trace-dir: one step under the profiler after the timed ones, in a folder per config, and the
    trace's summary in the record (on the CPU it finds no GPU lane, but the trace file is written and read)."""
    monkeypatch.syspath_prepend(str(REPO / "experiments"))  # as when run: child.py, trace_summary.py
    bench = load_script("bench")
    out = tmp_path / "bench.json"
    bench.main(["--configs", "tiny_cpu", "--warmup", "1", "--steps", "1", "--trace-dir", str(tmp_path / "traces"),
                "--out", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    assert run["status"] == "ok", run["status"]
    assert run["trace"]["file"] == "perfetto_trace.json.gz" and "devices" in run["trace"], run["trace"]
    assert list((tmp_path / "traces" / "tiny_cpu").rglob("perfetto_trace.json.gz"))
    assert len(run["step_times"]) == 2  # the traced step is not among the timed ones


def test_bench_counts_the_state_of_parts_updated_on_the_gpu_among_its_pcie_bytes():
    """A run with the io part and a block updated on the GPU (``gpu_updated_io``, ``gpu_updated_layers``) records
    their masters and moments crossing each way (12 B/param; this float32 model computes with its masters, so no
    copy comes home beside them) instead of their weights and gradients (4 B/param each)."""
    bench = load_script("bench")
    base = EngineConfig(micro_batches=2, clip_norm=0.05)
    runs = [bench.run_config(f"tiny_{i}", bench.BenchConfig("tiny", 3, 32, 4, e), warmup=1, timed=2, profile=False)
            for i, e in enumerate((base, dataclasses.replace(base, gpu_updated_io=True, gpu_updated_layers=1)))]
    assert all(r["status"] == "ok" for r in runs), [r["status"] for r in runs]
    a, b = (r["pcie_per_gpu_per_step"] for r in runs)
    cfg = preset("tiny", layers=3)
    n = io_param_count(cfg) + cfg.block_param_count(0)
    # (and each part's optimizer step count, a few bytes)
    assert b["h2d_bytes"] - a["h2d_bytes"] == pytest.approx((12 - 4) * n, abs=32)
    assert b["d2h_bytes"] - a["d2h_bytes"] == pytest.approx((12 - 4) * n, abs=32)


def test_bench_counts_both_passes_of_a_two_pass_step_among_its_pcie_bytes():
    """A ``norm_first`` step fetches its streamed weights for the forward, the first backward and the second one
    (less the blocks the forward leaves on the GPU for the backward, and the io part once more for the second
    head), and sends its gradients home once: bench.py counts every pass of the step, not only the first."""
    bench = load_script("bench")
    base = EngineConfig(micro_batches=2, clip_norm=0.05)
    runs = [bench.run_config(f"tiny_{i}", bench.BenchConfig("tiny", 3, 32, 4, e), warmup=1, timed=1, profile=False)
            for i, e in enumerate((base, dataclasses.replace(base, norm_first=True)))]
    assert all(r["status"] == "ok" for r in runs), [r["status"] for r in runs]
    one, two = (r["pcie_per_gpu_per_step"] for r in runs)
    cfg = preset("tiny", layers=3)
    # the second pass fetches the io part and the last block (one ahead: prefetch_depth 1) for its head, then
    # blocks 1 and 0 for its backward: the weights of the whole model once more (float32 weights: 4 B/param)
    assert two["h2d_bytes"] - one["h2d_bytes"] == 4 * cfg.param_count()
    assert two["d2h_bytes"] == one["d2h_bytes"]


def test_bench_breakdown_counts_the_gpu_resident_parts_update_as_device_work():
    """The synchronized step's update time splits by part: the GPU-resident parts' (device work, counted busy by
    gpu_idle_beyond_device_update_est) and the host parts'."""
    bench = load_script("bench")
    bc = bench.BenchConfig("tiny", 3, 32, 4, EngineConfig(micro_batches=2, resident_layers=2, resident_io=True,
                                                          kept_layers=1))
    run = bench.run_config("tiny_resident", bc, warmup=1, timed=2)
    assert run["status"] == "ok", run["status"]
    b = run["breakdown"]
    assert 0 < b["device_update_s"] < b["optimizer_s"], b  # two blocks and io on the device, one block on the host
    assert b["gpu_idle_beyond_device_update_est"] <= b["gpu_idle_fraction_est"]


def test_long_context_records_speed_peaks_and_the_plan():
    run = load_script("long_context").measure("tiny_cpu", load_script("long_context").CONFIGS["tiny_cpu"])
    assert run["status"] == "ok", run["status"]
    assert run["steps_timed"] == 1 and run["tokens_per_s"] > 0 and run["loss_finite"]
    assert run["plan"]["host_gib"] > 0 and set(run["plan_error"]) >= {"host"}
    assert run["engine"]["offload_activations"] == 0  # nothing is short here


@pytest.fixture
def restore_environ():
    """The scripts' in-process measurements set XLA/pool variables as a launcher would: undone after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ---------------------------------------------------------------------------------------------------------
# child.py: what every measuring script shares.

def test_child_runs_a_process_and_reads_its_last_line_or_says_how_it_ended(tmp_path):
    child = load_script("child")
    ok = child.run_child([sys.executable, "-c", "print('progress'); print('{\"status\": \"ok\", \"x\": 1}')"],
                         config="a")
    assert ok["status"] == "ok" and ok["x"] == 1 and "config" not in ok and ok["wall_s"] >= 0
    failed = child.run_child([sys.executable, "-c", "import sys; print('{}'); sys.exit(3)"], config="b")
    assert failed["config"] == "b" and failed["status"].startswith("error: exit 3")
    slow = child.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5, config="c")
    assert slow["config"] == "c" and slow["status"] == "error: no result within 0.5 s"


def test_child_runs_each_configuration_in_its_own_process_and_rewrites_the_file(tmp_path):
    child = load_script("child")
    script = tmp_path / "fake_measure.py"
    script.write_text("import json, sys\n"
                      "name = sys.argv[sys.argv.index('--child') + 1]\n"
                      "print(json.dumps({'config': name, 'status': 'ok', 'extra': sys.argv[3:],\n"
                      "                  'device': {'name': 'fake'}}))\n")
    out, lines = tmp_path / "r.json", []
    result = {"name": "r", "device": None, "runs": []}
    child.run_configs(str(script), ["a", "b"], ["--steps", "2"], 30, result, str(out),
                      lambda name, run: lines.append(name) or name)
    assert json.loads(out.read_text()) == result
    assert result["device"] == {"name": "fake"} and [r["config"] for r in result["runs"]] == ["a", "b"]
    assert all("device" not in r and r["extra"] == ["--steps", "2"] for r in result["runs"]) and lines == ["a", "b"]


def test_child_results_header_names_the_script_from_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    monkeypatch.setattr(sys, "argv", ["x.py", "--out", "o.json"])
    child = load_script("child")
    for script in ("experiments/bench.py", "experiments/studies/op_memory.py"):
        assert child.script_path(str(REPO / script)) == script
    header = child.results_header(str(tmp_path / "h100_op_memory_8k.json"),
                                  str(REPO / "experiments" / "studies" / "op_memory.py"))
    assert header["name"] == "h100_op_memory_8k" and header["git_commit"] == "abc123"
    assert header["command"] == "PYTHONPATH=. python experiments/studies/op_memory.py --out o.json"
    import jax
    assert header["device"]["platform"] == jax.devices()[0].platform and header["device"]["host_ram_gib"] > 0
    ap = argparse.ArgumentParser()
    assert child.pick_configs(ap, "b,a", {"a": 1, "b": 2}) == ["b", "a"]
    with pytest.raises(SystemExit):
        child.pick_configs(ap, "a,nope", {"a": 1})


# ---------------------------------------------------------------------------------------------------------
# trace_summary.py: a synthetic profiler trace (times in microseconds).

def _trace(path: Path) -> None:
    meta = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}
    x = lambda tid, name, ts, dur, pid=1: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = [meta(1, 0, "process_name", "/device:GPU:0"), meta(2, 0, "process_name", "/device:GPU:1"),
              meta(3, 0, "process_name", "/host:CPU"),
              meta(1, 10, "thread_name", "Stream #13(Compute)"), meta(1, 11, "thread_name", "Stream #14(Nccl)"),
              meta(1, 12, "thread_name", "XLA Ops"), meta(2, 20, "thread_name", "XLA Ops"),
              x(10, "fusion_1", 0, 60_000), x(10, "gemm", 150_000, 50_000),  # compute: 150 ms
              {**x(10, "fusion_1", 60_000, 40_000), "args": {"hlo_module": "jit_backward"}},
              x(11, "ncclDevKernel_AllGather_RING", 80_000, 40_000),  # 20 ms of it under no compute
              x(10, "MemcpyD2D", 120_000, 10_000),  # a copy inside the span: idle for compute
              x(11, "MemcpyD2H", 300_000, 20_000),  # after the last kernel: outside the span
              x(12, "fusion_1", 0, 500_000),  # not a stream line
              x(20, "fusion_2", 0, 1_000, pid=2), x(0, "host work", 0, 1_000, pid=3)]
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_trace_summary_splits_each_gpus_time_into_compute_collectives_copies_and_idle(tmp_path):
    ts = load_script("trace_summary")
    assert "error" in ts.summarize(tmp_path)
    _trace(tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz")
    out = ts.summarize(tmp_path)
    assert out["file"] == "perfetto_trace.json.gz" and set(out["devices"]) == {"/device:GPU:0", "/device:GPU:1"}
    gpu = out["devices"]["/device:GPU:0"]
    assert (gpu["span_ms"], gpu["compute_ms"], gpu["collective_ms"], gpu["copy_ms"]) == (200.0, 150.0, 40.0, 10.0)
    assert gpu["collective_exposed_ms"] == 20.0 and gpu["idle_ms"] == 30.0  # 100-120 nccl alone; 120-150 nothing
    assert gpu["top_collectives"] == {"ncclDevKernel_AllGather_RING": 40.0}
    assert gpu["compute_kinds_ms"] == {"attention": 0.0, "matmul": 50.0, "fusion": 100.0, "other": 0.0}
    assert gpu["top_kernels"] == {"fusion_1": {"ms": 100.0, "calls": 2}, "gemm": {"ms": 50.0, "calls": 1}}
    assert gpu["top_fusions"] == {"fusion_1": {"ms": 60.0, "calls": 1},  # the products are not listed
                                  "fusion_1 @ jit_backward": {"ms": 40.0, "calls": 1}}
    assert out["devices"]["/device:GPU:1"] == {"lines": ["XLA Ops"]}  # no stream kernels: its lines, no numbers
    cli = subprocess.run([sys.executable, str(REPO / "experiments" / "trace_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert json.loads(cli.stdout) == out


# ---------------------------------------------------------------------------------------------------------
# host_adam_bench.py: every system it can run here, on 1M parameters.

def test_host_adam_bench_times_each_system_and_records_the_ones_that_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    systems = ["megatrain_jax_fused_kernel_fp32", "megatrain_jax_fused_kernel_first_half", "fused_kernel_on_numpy_fp32",
               "megatrain_jax_capacity_kernel", "megatrain_jax_q8_kernel", "megatrain_jax_q8_kernel_bf16_grad",
               "megatrain_jax_host_fp32", "jax_cpu_backend", "torch_fused_cpu_adamw"]
    out = tmp_path / "host_adam.json"
    result = load_script("host_adam_bench").main(["--params", "1", "--reps", "1", "--systems", ",".join(systems),
                                                  "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["params"] == 2**20 and result["git_commit"] == "abc123"
    assert result["command"].startswith("PYTHONPATH=. python experiments/host_adam_bench.py --params 1")
    runs = {r["system"]: r for r in result["runs"]}
    assert set(runs) == set(systems)
    for name in systems[:-1]:  # the engine's host optimizer, the fused kernel and XLA's CPU backend run here
        assert runs[name]["status"] == "ok" and runs[name]["params_per_s"] > 0, runs[name]
    torch = runs["torch_fused_cpu_adamw"]  # torch is no test dependency: its failure is recorded, not raised
    assert torch["status"] == "ok" or (torch["status"].startswith("error: ") and torch["params_per_s"] is None)
    assert {"omp_threads", "thp_enabled", "cpu_vector_flags"} <= set(result["system_info"])


# ---------------------------------------------------------------------------------------------------------
# compare_zero3.py: everything but the training (which needs torch, transformers and DeepSpeed).

def _zero3_args(*argv):
    cz = load_script("compare_zero3")
    ns = argparse.Namespace(layers=16, rows=16, micro=4, seq=2048, hidden=4096, ffn=11008, heads=32, kv_heads=32,
                            vocab=32000, config=None, ds_config=cz.DEFAULT_DS_CONFIG, ds_set=list(argv))
    return cz, ns


def test_compare_zero3_dry_run_resolves_the_deepspeed_config_without_torch(capsys):
    """(This test environment has no torch: the dry run needs none.)"""
    cz = load_script("compare_zero3")
    assert cz.main(["--dry-run"]) == 0
    shown = json.loads(capsys.readouterr().out)
    h = 4096
    ds = shown["ds_config"]
    assert not any(k.startswith("_") for k in ds) and ds["zero_optimization"]["stage"] == 3
    batch_keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    assert tuple(ds[k] for k in batch_keys) == (4, 4, 16)
    zero = ds["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (h * h, int(0.9 * h * h), 10 * h)
    assert shown["config"] == "3p5b_32k" and shown["tokens_per_step"] == 32768 and shown["gradient_accumulation"] == 4
    for bad in (["--dry-run", "--rows", "10"], ["--dry-run", "--ds-set", "no_equals_sign"],
                ["--out", "x", "--steps", "0"]):
        with pytest.raises(SystemExit):
            cz.main(bad)


def test_compare_zero3_trains_the_same_model_size_flops_and_batches_as_bench():
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens
    from megatrain_jax.flops import model_flops_per_token

    cz, ns = _zero3_args("zero_optimization.stage3_prefetch_bucket_size=5e8",
                         "zero_optimization.offload_param.device=none")
    for layers, name in ((16, "3p5b_32k"), (32, "7b_32k")):
        ns.layers = layers
        shape = cz.model_shape(ns)
        cfg = preset("7b", layers=layers)  # bench.py's model of that name
        assert shape["params"] == cfg.param_count() and cz.config_name(ns) == name
        assert cz.flops_per_token(shape["params"], layers, 4096, 2048) == model_flops_per_token(
            cfg.param_count(), layers, cfg.hidden, 2048)
    ds = cz.build_ds_config(ns)
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e8
    assert ds["zero_optimization"]["offload_param"] == {"device": "none", "pin_memory": True}
    rows, seq, vocab, steps = 4, 16, 97, 3  # bench.py's corpus and order at a tiny size
    toks, starts = demo_tokens(vocab, steps * rows * seq * 2 + seq + 1, seed=0)
    ours = iter(TokenDataset(TokenFile.from_array(toks, vocab, starts), seq).batches(rows))
    for windows in cz.window_batches(steps, rows, seq, vocab):
        batch = next(ours)
        assert windows.shape == (rows, seq + 1) and windows.dtype == np.int64
        np.testing.assert_array_equal(windows[:, :-1], batch.inputs)
        np.testing.assert_array_equal(windows[:, 1:], batch.targets)


def test_compare_zero3_adds_its_run_to_the_results_file_and_replaces_it_as_it_progresses(tmp_path):
    cz = load_script("compare_zero3")
    path = tmp_path / "vs_zero3.json"
    path.write_text(json.dumps({"name": "bench", "runs": [{"system": "megatrain_jax", "config": "3p5b_32k"}]}))
    slot: list = []
    run = {"system": cz.SYSTEM, "run_id": "1-1", "status": cz.EXITED_EARLY}
    cz.write_run(str(path), {"name": "peer"}, run, slot)  # before training: a record that survives a kill
    cz.write_run(str(path), {"name": "peer"}, dict(run, status="ok"), slot)
    saved = json.loads(path.read_text())
    assert saved["name"] == "bench" and [r.get("status") for r in saved["runs"]] == [None, "ok"] and slot == [1]
    cz.write_run(str(path), {"name": "peer"}, {"run_id": "2-2", "status": "ok"}, [])  # another process's run
    assert len(json.loads(path.read_text())["runs"]) == 3
    path.write_text("not json")
    cz.write_run(str(path), {"name": "peer"}, run, slot)
    assert json.loads(path.read_text()) == {"name": "peer", "runs": [run]}
    # a file begun before the GPU was named (a peer's first write) takes the name once the header has it
    fresh, slot = tmp_path / "fresh.json", []
    cz.write_run(str(fresh), {"name": "peer", "device": {"cpu_cores": 32}}, run, slot)
    cz.write_run(str(fresh), {"name": "peer", "device": {"name": "NVIDIA H200", "cpu_cores": 32}}, run, slot)
    assert json.loads(fresh.read_text())["device"] == {"name": "NVIDIA H200", "cpu_cores": 32}


# ---------------------------------------------------------------------------------------------------------
# capacity.py and plan_check.py: the plan's measurement scripts.

def test_capacity_search_trains_the_most_layers_whose_lean_plan_fits():
    capacity = load_script("capacity")
    from megatrain_jax.plan import GiB

    host, gpu = int(125.9 * GiB), int(72 * GiB)  # the H100 box: its RAM, 90% of the GPU
    cc = capacity.CONFIGS["largest_fp32"]
    bc, lean, planned = capacity.choose(cc, host, gpu)
    assert cc.search_layers[0] <= bc.layers < cc.search_layers[1] and planned["layers_chosen"] == bc.layers
    assert planned["fits"] and planned["host_gib"] <= 125.9 and lean  # full precision does not fit as configured
    assert bc.engine != cc.bench.engine and bc.preset == "8b"  # the lean engine config is what trains
    with pytest.raises(SystemExit, match="no layer count"):  # one more layer no longer fits with the margins
        capacity.choose(dataclasses.replace(cc, search_layers=(bc.layers + 1, bc.layers + 1)), host, gpu)


def test_capacity_measures_a_tiny_configuration_through_the_plan(restore_environ):
    capacity, bench = load_script("capacity"), load_script("bench")
    run = capacity.measure("tiny", capacity.CapacityConfig(bench.CONFIGS["tiny_cpu"]), warmup=1, steps=1)
    assert run["status"] == "ok", run["status"]
    assert run["tokens_per_s"] > 0 and np.isfinite(run["losses"]).all() and run["master_dtype"] == "float32"
    assert run["lean_mode"] is None and run["plan"]["fits"]  # a tiny model fits as configured
    assert run["mem_available_gib_at_start"] > 0 and "host" in run["plan_error"]


def test_plan_check_records_the_plan_next_to_the_measured_peaks(restore_environ):
    plan_check = load_script("plan_check")
    fake = SimpleNamespace(gpu_total=11 * 2**30, host_total=9 * 2**30, gpu_peak_at="forward 3", fits=True,
                           gpu={"weights": 2**30}, host={"masters": 2**29})
    run = {"gpu_peak_gib": 10.0, "host_peak_gib": None}
    plan_check.record_plan(run, fake, extra=1)
    assert run["plan"]["gpu_gib"] == 11.0 and run["plan"]["extra"] == 1 and run["plan"]["host"] == {"masters": 0.5}
    assert run["plan_error"] == {"gpu": 0.1}  # no measured host peak: no host error
    assert {"3p5b_32k", "7b_32k", "3b_128k"} <= set(plan_check.CHECKS)
    assert set(plan_check.HELD_OUT) | set(plan_check.HELD_OUT_2) <= set(plan_check.KNOWN)
    run = plan_check.measure("tiny_cpu", plan_check.KNOWN["tiny_cpu"], steps=2)
    assert run["status"] == "ok", run["status"]
    assert len(run["losses"]) == 2 and run["rows"] * run["seq_len"] == run["tokens_per_step"]
    assert run["engine"] == dataclasses.asdict(plan_check.KNOWN["tiny_cpu"].engine)
    assert run["plan"]["host_gib"] > 0 and set(run["plan_error"]) == {"host"} and run["host_peak_gib"] > 0


# ---------------------------------------------------------------------------------------------------------
# scaling.py: one run's worker in this process, and the summary over runs.

def test_scaling_worker_records_a_run_and_the_summary_compares_with_one_gpu(tmp_path, restore_environ):
    scaling = load_script("scaling")
    out = tmp_path / "worker.json"
    scaling.worker(argparse.Namespace(config="tiny_cpu", rows=8, warmup=1, steps=1, trace_dir=None, kind="1gpu",
                                      worker_out=str(out)))
    run = json.loads(out.read_text())
    assert run["status"] == "ok", run["status"]
    assert run["num_gpus"] == 1 and run["rows_per_gpu"] == 8 and run["tokens_per_gpu_per_step"] == 8 * 128
    assert run["pcie_per_gpu_per_step"]["total_bytes"] > 0
    runs = [dict(run, scaling="1gpu", tokens_per_s=100.0, host_peak_gib=10.0),
            dict(run, scaling="weak", tokens_per_s=190.0, host_peak_gib=11.0),
            {"scaling": "strong", "status": "error: worker exited with -9 and no record"}]
    summary = scaling.summarize(runs)
    assert summary["weak"]["speedup_vs_1gpu"] == 1.9 and summary["weak"]["host_peak_vs_1gpu"] == 1.1
    assert summary["1gpu"]["speedup_vs_1gpu"] == 1.0 and summary["strong"]["speedup_vs_1gpu"] is None
    assert runs[1]["speedup_vs_1gpu"] == 1.9  # written into the runs too
    weak_alone = [dict(run, scaling="weak", tokens_per_s=190.0)]
    assert scaling.summarize(weak_alone)["weak"]["speedup_vs_1gpu"] is None  # no 1-GPU run: no ratio


def test_shipped_configs_runs_a_config_as_a_user_does_and_reads_its_metrics(tmp_path):
    """shipped_configs.py (issue 31): the demo config through `megatrain-jax train` in a child process, with
    the planned and measured peaks and the speeds read back; a config that cannot start says why."""
    import json
    shipped = load_script("shipped_configs")
    out = tmp_path / "shipped.json"
    result = shipped.main(["--configs", "demo_tiny", "--steps", "3", "--work", str(tmp_path), "--export",
                           "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["device"]["platform"] == "cpu"
    (run,) = result["runs"]
    assert run["status"] == "ok" and run["exit_status"] == 0 and run["target"] == "any"
    assert run["steps_reported"] == 3 and run["tokens_per_s"] > 0 and run["planned"]["host_gib"] > 0
    assert run["host_peak_gib"] > 0 and "host_plan_error" in run and len(run["step_times_s"]) == 3
    # --export: the config's export written into the run folder and recorded; the whole process's peak (the
    # kernel's count at exit) is at least what the steps sampled
    assert run["export"]["safetensors"] == 1 and run["export"]["weights_bytes"] > 0
    assert "config.json" in run["export"]["files"] and (tmp_path / "runs" / "demo_tiny" / "hf").is_dir()
    assert run["process_peak_rss_gib"] >= run["host_peak_gib"] * 0.99
    assert run["params"] > 0  # "megatrain_jax: N M params", as train prints it
    assert run["process_bytes_per_param"] == pytest.approx(run["process_peak_rss_gib"] * 2**30 / run["params"],
                                                           rel=1e-3)
    assert set(run["caps"]) == {"xla_mem_fraction", "host_ram_gib"}
    # --record: a run folder copied back without its results file, under the device named
    rec = shipped.main(["--record", str(tmp_path / "runs" / "demo_tiny"), "--configs", "demo_tiny", "--device",
                        "NVIDIA H200", "--out", str(tmp_path / "rec.json")])
    assert rec["device"]["name"] == "NVIDIA H200" and rec["device"]["recorded_on"]["platform"] == "cpu"
    (again,) = rec["runs"]
    assert again["status"] == "cut" and again["losses"] == run["losses"] and again["planned"] == run["planned"]
    with pytest.raises(SystemExit):
        shipped.main(["--record", str(tmp_path), "--configs", "demo_tiny", "--out", str(tmp_path / "x.json")])
    bad = shipped.run_config(REPO / "experiments" / "configs" / "demo_tiny.toml", 2, tmp_path, 120,
                             extra=["engine.micro_batches=3"])
    assert bad["status"] == "bad input" and any("micro_batches = 3" in line for line in bad["error_tail"])
    assert "export" not in bad  # without --export the export is off and not recorded
    slow = shipped.run_config(REPO / "experiments" / "configs" / "demo_tiny.toml", 2, tmp_path, 0.5)
    assert slow["status"] == "timeout" and slow["exit_status"] is None  # killed and reaped, the record written
    assert shipped.target(Path("h200_sft_8b.toml")) == "h200"


def test_shipped_configs_keeps_a_profiled_step_out_of_the_timing_and_records_its_lanes(tmp_path):
    """``--set train.profile_step=N``: step N ran serialized and N + 1 started from an idle GPU, so neither is in
    the median step; N's lanes are recorded beside the plan's busy seconds."""
    import json
    shipped = load_script("shipped_configs")
    busy = {"main": 0.5, "gpu": 3.0, "h2d": 2.0, "d2h": 1.0, "host": 2.0}
    (tmp_path / "memory_plan.json").write_text(json.dumps(
        {"host_total": 2**30, "gpu_total": 2**30, "gpu_exact": False, "estimate_gpu_total": 2**30,
         "gpu_available": 2**31, "gpu_peak_at": "head", "engine": {}, "programs": None,
         "predicted_step": {"seconds": 4.0, "bound": "gpu", "busy": busy}}))
    times = {1: 30.0, 2: 20.0, 3: 4.0, 4: 9.0, 5: 6.0, 6: 4.0, 7: 5.0, 8: 4.0}  # 5.0 with steps 4 and 5
    rows = [{"step": k, "loss": 1.0, "tokens_per_s": 100 / t, "model_tflops": 1.0, "step_time_s": t}
            for k, t in times.items()]
    rows[3].update(profiled=1.0, profile_serialized_s=9.0, profile_compute_s=3.5, profile_h2d_s=2.5,
                   profile_d2h_s=1.0, profile_host_update_s=1.5, profile_device_update_s=0.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {}
    shipped.read_run_folder(tmp_path, record)
    assert record["step_time_s"] == 4.0 and record["step_time_error"] == 0.0  # steps 3, 6 and 7
    assert record["profile"] == {"step": 4, "serialized_s": 9.0, "compute_s": 3.5, "h2d_s": 2.5, "d2h_s": 1.0,
                                 "host_update_s": 1.5, "device_update_s": 0.0, "plan_busy": busy}
    assert "loss_tokens_per_s" not in record  # an older run's metrics: not counted
    for r in rows:
        r["loss_tokens_per_s"] = 10 / r["step_time_s"]  # a tenth of the tokens in the loss
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shipped.read_run_folder(tmp_path, record)
    assert record["loss_tokens_per_s"] == 2.5 and record["tokens_per_s"] == 25.0  # the timed steps' medians


def test_shipped_configs_records_the_held_out_losses_and_times_no_step_after_an_evaluation(tmp_path):
    """``--set train.eval_every=N``: each evaluated step's held-out loss is recorded, and the step after it, which
    waited for the evaluation, is not in the median step."""
    import json
    shipped = load_script("shipped_configs")
    times = {1: 30.0, 2: 20.0, 3: 4.0, 4: 4.0, 5: 30.0, 6: 6.0, 7: 6.0, 8: 9.0}
    rows = [{"step": k, "loss": 1.0, "tokens_per_s": 100 / t, "model_tflops": 1.0, "step_time_s": t}
            for k, t in times.items()]
    rows[3]["eval_loss"], rows[7]["eval_loss"] = 2.5, 2.25
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {}
    shipped.read_run_folder(tmp_path, record)
    assert record["eval_losses"] == {"4": 2.5, "8": 2.25}
    assert record["tokens_per_s"] == 20.8  # the median of steps 3, 4, 6 and 7 (16.7 with step 5)


def test_shipped_configs_reaps_a_child_that_ends_as_the_cut_comes(monkeypatch):
    """SIGTERM through ``timeout`` reaches the train child too, which may be gone before this script kills it: the
    cut is still recorded (no ECHILD from reaping twice), and the environment's caps read as train reads them."""
    import signal
    shipped = load_script("shipped_configs")
    child = [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGTERM)"]
    for _ in range(5):
        with shipped.sigterm_cuts():
            code, _, peak = shipped.run_child(child, dict(os.environ), timeout=60)
        assert code == "cut" and peak > 0
    code, _, _ = shipped.run_child([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), 0.3)
    assert code is None  # the timeout's kill, reaped
    monkeypatch.setenv("MEGATRAIN_HOST_RAM_GIB", " ")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    assert shipped.caps() == {"xla_mem_fraction": "lots", "host_ram_gib": None}


def test_shipped_configs_records_a_config_cut_by_sigterm(tmp_path, monkeypatch):
    """A device call's own time limit (SIGTERM through ``timeout``) stops the config in flight: its record says
    ``cut`` with the steps its run folder holds, the configs after it are not run, and the results file is written
    with its header."""
    import json
    import os
    import signal
    import threading
    shipped = load_script("shipped_configs")
    metrics = tmp_path / "runs" / "demo_tiny" / "metrics.jsonl"

    def send_once_a_step_is_logged():
        for _ in range(1200):
            if metrics.exists() and metrics.read_text().count('"loss"') >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.1)
    threading.Thread(target=send_once_a_step_is_logged, daemon=True).start()
    out = tmp_path / "cut.json"
    before = signal.getsignal(signal.SIGTERM)
    result = shipped.main(["--configs", "demo_tiny,h100_3p5b_32k", "--steps", "100000", "--work", str(tmp_path),
                           "--out", str(out)])
    assert signal.getsignal(signal.SIGTERM) == before
    (run,) = result["runs"]
    assert run["status"] == "cut" and run["exit_status"] is None and run["steps_reported"] >= 2
    assert json.loads(out.read_text())["git_commit"] == result["git_commit"]
    # a SIGTERM while the script itself works (here: making a config's inputs) is recorded too
    monkeypatch.setattr(shipped, "hf_inputs", lambda path, work: os.kill(os.getpid(), signal.SIGTERM) or [])
    result = shipped.main(["--configs", "demo_tiny,h100_3p5b_32k", "--work", str(tmp_path), "--out", str(out)])
    assert [r["status"] for r in result["runs"]] == ["cut"] and "git_commit" in json.loads(out.read_text())


def test_convergence_merges_separate_runs_into_one_comparison(tmp_path, monkeypatch):
    """convergence.py --merge (issue 35's 1B comparison, one mode per device call): the runs of two files side by
    side with the gap of the new mode to float32 masters; files of another setup, or a run twice, are refused."""
    spec = importlib.util.spec_from_file_location("convergence", REPO / "experiments" / "studies" / "convergence.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    head = {"model": {"params": 1}, "steps": 3, "tokens_per_step": 8, "seq_len": 4, "optimizer": "adamw",
            "data": "corpus", "git_commit": "x", "device": {"name": "cpu"}}
    run = lambda mode, losses, held=None: {"mode": mode, "seed": 0, "losses": losses, "tokens_per_s": 1.0,  # noqa: E731
                                           "wall_s": 1.0, **({"eval_loss": held} if held else {})}
    files = []
    for mode, losses, held in (("float32", [3.0, 2.0, 1.0], 2.0), ("q8", [3.0, 2.0, 1.1], 2.02)):
        files.append(tmp_path / f"{mode}.json")
        files[-1].write_text(json.dumps({**head, "name": mode, "runs": [run(mode, losses, held)]}))
    out = tmp_path / "both.json"
    monkeypatch.setattr(sys, "argv", ["convergence.py"])
    conv.merge([str(f) for f in files], str(out), tail=1)
    merged = json.loads(out.read_text())
    assert merged["q8_vs_float32_final_loss"] == pytest.approx(0.1)
    assert merged["q8_within_bar"] == {"bar": 0.015, "met": False} and len(merged["parts"]) == 2
    held_out = merged["q8_vs_float32_eval_loss"]  # issue 52's measure: the held-out loss's gap, per seed and mean
    assert held_out["mean_gap"] == pytest.approx(0.01) and held_out["met"] and held_out["by_seed"] == {"0": 0.01}
    with pytest.raises(SystemExit, match="more than once"):
        conv.merge([str(files[0]), str(files[0])], str(out), tail=1)
    seed1 = tmp_path / "seed1.json"
    seed1.write_text(json.dumps({**head, "runs": [{**run("q8", [1.0]), "seed": 1}]}))
    with pytest.raises(SystemExit, match=r"no run for these \(mode, seed\) pairs: \[\('float32', 1\)\]"):
        conv.merge([str(files[0]), str(files[1]), str(seed1)], str(out), tail=1)
    files[1].write_text(json.dumps({**head, "steps": 4, "runs": [run("q8", [1.0])]}))
    with pytest.raises(SystemExit, match="differs .* in \\['steps'\\]"):
        conv.merge([str(f) for f in files], str(out), tail=1)


def test_convergence_takes_the_held_out_loss_after_the_last_step(tmp_path):
    """convergence.py --eval-fraction (issue 52's quality table): the last share of the data is held out and each
    run's loss on it after its last step is recorded, in its progress file too (a resumed run that finished
    in an earlier call reports it again)."""
    spec = importlib.util.spec_from_file_location("convergence", REPO / "experiments" / "studies" / "convergence.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    from megatrain_jax import preset
    cfg = preset("tiny", dtype="bfloat16")
    progress = str(tmp_path / "p.json")
    run = conv.train("m7v5", 0, 3, 2, 32, 1e-3, cfg, progress=progress, eval_fraction=0.05, eval_batches=2)
    assert run["eval_tokens"] == 2 * 2 * 32 and np.isfinite(run["eval_loss"]) and len(run["losses"]) == 3
    assert run["eval_loss"] != run["losses"][-1]  # the held-out batches, not the last training batch


def test_convergence_header_says_what_share_of_the_machine_the_run_had(monkeypatch):
    """A quality-table run shares its machine (quality_table.sh: a slice of the cores, a share of a GPU): the
    results file's device record says which, since the command line it records does not."""
    spec = importlib.util.spec_from_file_location("convergence", REPO / "experiments" / "studies" / "convergence.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    from megatrain_jax import preset
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.300")
    args = argparse.Namespace(out="x/run.json", preset=None, steps=2, rows=2, seq_len=32, lr=1e-3, data=None,
                              eval_fraction=0.0, eval_batches=0, resident=False, jobs=1)
    dev = conv.header(args, preset("tiny", dtype="bfloat16"))["device"]
    assert dev["cores_used"] == len(os.sched_getaffinity(0)) >= 1 and dev["gpu_memory_fraction"] == "0.300"
    assert "cuda_visible_devices" in dev and dev["host_cores"] == os.cpu_count()


def test_convergence_progress_and_the_resident_reference(tmp_path):
    """convergence.py's progress file holds the losses so far every ``every`` steps (a run cut by a device call's
    limit still says how far it got); ``--resident`` keeps only float32 masters on the GPU."""
    spec = importlib.util.spec_from_file_location("convergence", REPO / "experiments" / "studies" / "convergence.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    path = tmp_path / "p.json"
    hook = conv.progress_hook(str(path), "q8", 0, every=2)
    hook.fn({"step": 1, "loss": 3.0}, None)
    assert not path.exists()
    hook.fn({"step": 2, "loss": 2.5}, None)
    hook.fn({"step": 3, "loss": 2.0}, None)
    got = json.loads(path.read_text())
    assert got["steps_done"] == 2 and got["losses"] == [3.0, 2.5] and got["mode"] == "q8"
    cfg = conv.MODEL
    resident = conv.engine_config("float32", cfg, resident=True)
    assert resident.resident_layers == cfg.layers and resident.resident_io
    assert conv.engine_config("q8", cfg, resident=False) == conv.MODES["q8"]
    with pytest.raises(SystemExit, match="updates on the host"):
        conv.engine_config("q8", cfg, resident=True)


def test_convergence_cut_by_time_resumes_to_the_same_losses(tmp_path, monkeypatch):
    """convergence.py --checkpoint-dir with --stop-after-s (issue 35's 1B q8 run, longer than a device call): a run
    stopped after every step and run again until done has the losses of the uninterrupted run, bit for bit; a rerun
    of the finished run trains nothing and gives them again, its time unchanged. A progress file of another setup,
    or a checkpoint further on than its progress file, is refused before training (the checkpoint untouched). Its
    progress file, with the setup, merges as a cut run compared over the steps both runs reached."""
    spec = importlib.util.spec_from_file_location("convergence", REPO / "experiments" / "studies" / "convergence.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    from megatrain_jax import preset
    from megatrain_jax.checkpoint import committed_steps
    from megatrain_jax.data import demo
    # each conv.train call draws its 8M-token demo corpus again (about 1 s): every run here reads the same one,
    # drawn once (each run gets its own copy of the arrays)
    corpus = functools.cache(demo.demo_tokens)
    monkeypatch.setattr(demo, "demo_tokens", lambda *a, **kw: tuple(x.copy() for x in corpus(*a, **kw)))
    cfg = preset("tiny", dtype="bfloat16")
    whole = conv.train("q8", 0, 4, 2, 32, 1e-3, cfg)
    progress, ckpt = str(tmp_path / "p.json"), str(tmp_path / "ckpt")
    setup = {k: k for k in conv.RESUME}
    cuts = []
    for _ in range(4):
        try:
            got = conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt, stop_after_s=0.0,
                             header=setup)
            break
        except conv.Cut:
            cuts.append(json.loads(open(progress).read())["steps_done"])
    assert cuts and cuts[0] < 4 and got["losses"] == whole["losses"]
    again = conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt, header=setup)
    assert again["losses"] == whole["losses"] and again["wall_s"] == got["wall_s"]
    with pytest.raises(SystemExit, match="not 'float32'"):
        conv.train("float32", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt)
    with pytest.raises(SystemExit, match=r"another setup \(it differs in \['optimizer'\]\)"):
        conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt,
                   header={**setup, "optimizer": "lr 5e-3"})
    os.remove(progress)
    saved = committed_steps(tmp_path / "ckpt" / "q8.0")
    with pytest.raises(SystemExit, match="holds step 4, but .* the losses of 0 steps"):
        conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt, header=setup)
    assert committed_steps(tmp_path / "ckpt" / "q8.0") == saved
    # a signal (a device call's timeout): the step in flight is saved, and its losses with it
    import signal

    from megatrain_jax.checkpoint import CheckpointedExit
    plain = conv.progress_hook

    def killed_at_2(*args, **kwargs):
        hook = plain(*args, **kwargs)
        write = hook.fn

        def fn(m, info):
            write(m, info)
            if m["step"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        hook.fn = fn
        return hook
    monkeypatch.setattr(conv, "progress_hook", killed_at_2)
    progress, ckpt = str(tmp_path / "q.json"), str(tmp_path / "ckpt2")
    with pytest.raises(CheckpointedExit):
        conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt, header=setup)
    step = committed_steps(tmp_path / "ckpt2" / "q8.0")[0]
    assert json.loads(open(progress).read())["steps_done"] == step >= 2
    monkeypatch.setattr(conv, "progress_hook", plain)
    assert conv.train("q8", 0, 4, 2, 32, 1e-3, cfg, progress=progress, checkpoint_dir=ckpt,
                      header=setup)["losses"] == whole["losses"]
    head = {"model": {"params": 1}, "steps": 6, "tokens_per_step": 64, "seq_len": 32, "optimizer": "adamw",
            "data": "corpus"}
    full = tmp_path / "float32.json"
    full.write_text(json.dumps({**head, "name": "f", "runs": [{"mode": "float32", "seed": 0, "wall_s": 1.0,
                                                              "tokens_per_s": 1.0, "losses": [3, 2, 1, 1, 1, 1]}]}))
    cut = tmp_path / "q8.progress.json"
    conv.write_progress(str(cut), "q8", 0, 3, 2.0, [3.0, 2.0, 1.1], head)
    monkeypatch.setattr(sys, "argv", ["convergence.py"])
    out = tmp_path / "both.json"
    conv.merge([str(full), str(cut)], str(out), tail=1)
    merged = json.loads(out.read_text())
    assert merged["compared_steps"] == 3 and merged["q8_vs_float32_final_loss"] == pytest.approx(0.1)
    assert [r["steps_run"] for r in merged["runs"]] == [6, 3] and merged["runs"][1]["cut_after_step"] == 3
    assert merged["q8_within_bar"]["met"] is None and merged["runs"][1]["finite"] and "steps_done" not in merged
    conv.write_progress(str(cut), "q8", 0, 3, 2.0, [3.0, 2.0, 1.1], None)
    with pytest.raises(SystemExit, match="without its run's setup"):
        conv.merge([str(full), str(cut)], str(out), tail=1)
    conv.merge([str(full), str(cut)], str(out), tail=1, setup_from=str(full))
    merged = json.loads(out.read_text())
    assert merged["compared_steps"] == 3 and merged["parts"][1]["setup_from"] == str(full)
    assert "setup_from" not in merged["parts"][0]


def test_plain_gpu_training_runs_every_remat_policy_and_marks_the_fastest(tmp_path):
    """experiments/plain_gpu.py (the all-GPU bar for models that fit) on the CPU with the tiny config: each policy
    trains (the loss falls), records where the model lives, and exactly one run is marked the best; a policy or
    config it does not know is refused by name."""
    plain = load_script("plain_gpu")
    out = tmp_path / "plain.json"
    result = plain.main(["--configs", "tiny_cpu", "--policies", "nothing,dots", "--warmup", "1", "--steps", "2",
                         "--out", str(out)])
    runs = result["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok"], runs
    assert all(r["loss_finite_and_decreasing"] and r["where_the_model_lives"]["pcie_bytes_per_step"] == 0
               for r in runs)
    assert sum(r["best_of_policies"] for r in runs) == 1
    assert json.loads(out.read_text())["runs"] == runs
    for bad in (["--configs", "nope"], ["--policies", "some"]):
        with pytest.raises(SystemExit):
            plain.main(bad + ["--out", str(out)])


def test_measure_speeds_writes_a_calibration_file_the_plan_reads(tmp_path):
    """experiments/measure_speeds.py on the CPU (the host update's rates only): its results file is one
    ``--speeds`` takes, and its rates replace the record's."""
    from megatrain_jax.plan.speeds import H200, from_file
    record = load_script("measure_speeds").main(["--params", "8", "--reps", "1", "--out", str(tmp_path / "s.json")])
    speeds = record["runs"][0]["speeds"]
    assert set(speeds["host_update"]) == {"full", "lean", "capacity", "q8", "m7v5"}
    # no GPU kind here: each mode's rate in a step is its kernel's as it is
    assert speeds["host_update"] == {k: round(v, -6) for k, v in record["runs"][0]["host_kernels_alone"].items()}
    assert all(rate > 0 for rate in speeds["host_update"].values()) and 0 < speeds["first_half_share"] < 1
    assert not (tmp_path / "s.speeds.json").exists()  # one file: the results file
    s = from_file(tmp_path / "s.json", H200)
    assert s.host_update == speeds["host_update"] and s.host_cores == speeds["host_cores"]
    assert s.matmul_flops == H200.matmul_flops  # no GPU here: the record's GPU rates stay


def test_the_host_updates_bytes_count_a_second_read_for_each_split_part():
    """bench.py's host update bytes: 30 per parameter in one pass (full precision with a bfloat16 stream
    copy, float32 gradients), 16 more for each part that splits (masters, moments and gradient read again)."""
    bench = load_script("bench")
    cfg = preset("tiny", layers=2, dtype="bfloat16")
    build = lambda k: Engine(Decoder(cfg, rngs=nnx.Rngs(0)), adamw(1e-3), EngineConfig(split_parts=k))  # noqa: E731
    whole, all_split = build(0), build("auto")
    assert whole.policy.opt.splits
    params = {p: sum(x.size for x in jax.tree.leaves(whole.state[p].params)) for p in whole.state.ids()}
    assert bench.host_update_bytes(whole) == 30 * sum(params.values())
    assert bench.host_update_bytes(all_split) == 46 * sum(params.values())
    last = PartId.block(1)
    assert bench.host_update_bytes(build(1)) == 30 * sum(params.values()) + 16 * params[last]


def test_the_layer_compute_study_times_each_of_our_blocks_and_counts_its_flops(tmp_path):
    """experiments/studies/layer_compute.py on the CPU: our half times every block's forward and backward in
    both layouts (recomputing, keeping products), with hardware FLOP rates; the peer's half says why it did
    not run where torch has no GPU."""
    out = tmp_path / "layer.json"
    subprocess.run([sys.executable, str(REPO / "experiments" / "studies" / "layer_compute.py"), "--preset", "tiny",
                    "--rows", "2", "--seq", "16", "--steps", "2", "--out", str(out)], cwd=REPO, check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True)
    record = json.loads(out.read_text())
    ours = [r for r in record["runs"] if r["system"] == "megatrain_jax"]
    assert [r["kept_layers"] for r in ours] == [0, 2]
    for r in ours:
        assert len(r["samples"]["forward"]) == len(r["samples"]["backward"]) == 2 * 2
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["backward_hw_tflops"] >= 0
    cfg = preset("tiny")
    assert record["block_flops"] == {"matmul": 2.0 * cfg.block_active_param_count(0) * 32,
                                     "attention": 2.0 * cfg.heads * cfg.dim_per_head * 16 * 32}
    peer = [r for r in record["runs"] if r["system"] == "slideformer_layer"]
    assert len(peer) == 1 and (peer[0].get("status", "").startswith("not run") or peer[0]["forward_s"] > 0)


def test_the_layer_compute_study_packs_rows_as_train_packs_short_chats(tmp_path):
    """``--packed 3x4`` at 16 tokens: three 4-token documents then the padding as one run more, out of the loss;
    attention counted within the runs (4 keys a token, doubled: 4 runs of 4 over 16 tokens), the products as
    whole rows; with SlideFormer's half it is refused (its layer takes whole rows)."""
    lc = load_script("studies/layer_compute")
    seg, pos, mask = lc.packed_row("3x4", 16)
    assert seg.tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert pos.tolist() == list(range(4)) * 4 and mask.tolist() == [1.0] * 12 + [0.0] * 4
    assert lc.attention_span("3x4", 16) == 4.0 and lc.attention_span(None, 16) == 16.0
    out = tmp_path / "layer.json"
    cmd = [sys.executable, str(REPO / "experiments" / "studies" / "layer_compute.py"), "--preset", "tiny", "--rows",
           "2", "--seq", "16", "--steps", "1", "--packed", "3x4", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "--halves ours" in refused.stderr and not out.exists()
    subprocess.run(cmd + ["--halves", "ours"], cwd=REPO, check=True, env=env, capture_output=True)
    record = json.loads(out.read_text())
    cfg = preset("tiny")
    assert record["packed"] == "3x4" and record["attention_span"] == 4.0
    assert record["block_flops"]["attention"] == 2.0 * cfg.heads * cfg.dim_per_head * 4 * 32
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in record["runs"])
    with pytest.raises(SystemExit, match="do not fit"):
        lc.packed_row("5x4", 16)


def test_the_layer_compute_study_takes_whole_rows_with_part_of_each_out_of_the_loss(tmp_path):
    """``--loss-tokens N``: whole rows (attention over all 16 tokens) with only the first N in the loss; outside
    1..seq, or beside ``--packed``, refused before anything runs."""
    out = tmp_path / "layer.json"
    cmd = [sys.executable, str(REPO / "experiments" / "studies" / "layer_compute.py"), "--preset", "tiny", "--rows",
           "2", "--seq", "16", "--steps", "1", "--halves", "ours", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for bad, says in ((["--loss-tokens", "17"], "between 1 and --seq"),
                      (["--loss-tokens", "4", "--packed", "3x4"], "for whole rows")):
        refused = subprocess.run(cmd + bad, cwd=REPO, env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and says in refused.stderr and not out.exists()
    subprocess.run(cmd + ["--loss-tokens", "4"], cwd=REPO, check=True, env=env, capture_output=True)
    record = json.loads(out.read_text())
    assert record["loss_tokens"] == 4 and record["attention_span"] == 16.0
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in record["runs"])


def test_the_layer_compute_study_runs_our_half_once_per_xla_flags_variant(tmp_path):
    """``--xla-flags "V1;V2"``: our half once per variant, each in its own process, its records marked with the
    variant; a flag XLA does not know ends that variant's child, recorded as an error, and the others still run."""
    out = tmp_path / "layer.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, str(REPO / "experiments" / "studies" / "layer_compute.py"), "--preset", "tiny",
                    "--rows", "2", "--seq", "16", "--steps", "1", "--halves", "ours",
                    "--xla-flags=--xla_cpu_use_thunk_runtime=true;;--xla_no_such_flag_here=1", "--out", str(out)],
                   cwd=REPO, check=True, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True)
    runs = json.loads(out.read_text())["runs"]
    assert [r["xla_flags"] for r in runs] == ["--xla_cpu_use_thunk_runtime=true", "--xla_cpu_use_thunk_runtime=true",
                                              "", "", "--xla_no_such_flag_here=1"]
    assert all(r["forward_s"] > 0 for r in runs[:4])
    assert load_script("studies/layer_compute")._without(
        ["--a", "1", "--out", "x", "--xla-flags=y", "--b", "--out=z", "--xla-flags", ""], "--out", "--xla-flags") == [
            "--a", "1", "--b"]
    assert runs[4]["status"].startswith("error")


def test_zero3s_best_settings_at_13b_are_the_bar_and_each_run_says_where_its_state_lives():
    cz = load_script("compare_zero3")
    full = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    part = {"zero_optimization": {"offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "cpu", "ratio": 0.8}}}
    assert cz.offload_words(full) == ("ZeRO-3: parameters in pinned CPU memory, all of the optimizer state in "
                                      "pinned CPU memory")
    assert cz.offload_words(part) == ("ZeRO-3: parameters on the GPU, 80% of the optimizer state "
                                      "(offload_optimizer.ratio) in pinned CPU memory")
    runs = [{"system": "megatrain_jax", "config": "13b_32k", "tokens_per_s": 6400.0},
            {"system": "deepspeed_zero3", "config": "13b_32k", "tokens_per_s": 2500.0, "ds_overrides": []},
            {"system": "deepspeed_zero3", "config": "13b_32k", "tokens_per_s": 3500.0, "ds_overrides": ["x"]}]
    v = load_script("side_by_side").targets({"runs": runs})["13b_32k_vs_zero3_best"]
    assert v["zero3_tokens_per_s"] == 3500.0 and v["ratio"] == 1.829 and not v["met"]


def test_quality_table_puts_per_gpu_runs_on_each_gpu_with_a_share_of_its_memory_and_the_cores(tmp_path):
    """studies/quality_table.sh: JOBS run at once, PER_GPU to a GPU, each with 0.9/PER_GPU of its memory
    (XLA_PYTHON_CLIENT_MEM_FRACTION) and its own slice of the cores; more runs than PER_GPU x GPUs is refused."""
    import subprocess
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: NVIDIA H200'\n")
    (bin_ / "taskset").write_text('#!/bin/bash\nshift; echo "cores $1" >> "$TASKSET_LOG"; shift; exec "$@"\n')
    (bin_ / "python").write_text('#!/bin/bash\nfor a; do [ "$prev" = --out ] && out=$a; prev=$a; done\n'
                                 'echo "gpu=$CUDA_VISIBLE_DEVICES fraction=${XLA_PYTHON_CLIENT_MEM_FRACTION:-unset}" '
                                 '> "$out"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    script = REPO / "experiments" / "studies" / "quality_table.sh"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "W": str(tmp_path / "job"),
           "OUT": str(tmp_path / "out"), "POLL_S": "30", "TAG": "t", "TASKSET_LOG": str(tmp_path / "cores")}
    run = subprocess.run(["bash", str(script), "start"], env={**env, "JOBS": "q8:0 q8:1", "PER_GPU": "2"},
                         capture_output=True, text=True, cwd=REPO)
    assert "done: exit 0" in run.stdout, run.stdout + run.stderr
    for seed in (0, 1):
        written = (tmp_path / "out" / f"h200_conv_1b_q8_{seed}_t.json").read_text()
        assert written.strip() == "gpu=0 fraction=0.450", written
    slices = sorted((tmp_path / "cores").read_text().split())
    assert len(set(slices)) == 3 and "cores" in slices  # two distinct slices of the cores
    refused = subprocess.run(["bash", str(script), "start"], env={**env, "JOBS": "q8:0 q8:1"}, capture_output=True,
                             text=True, cwd=REPO)
    assert refused.returncode == 2 and "at most PER_GPU runs per GPU" in refused.stdout


def test_long_run_runs_a_command_across_calls_and_copies_what_it_wrote(tmp_path):
    """studies/long_run.sh: `start` launches the command in a session of its own and polls it; a second `start`
    while it runs polls the same one (no second copy); `poll` copies what it wrote under $W/out, its log and the
    memory samples to $OUT, and says how it ended."""
    import subprocess
    script = REPO / "experiments" / "studies" / "long_run.sh"
    env = {**os.environ, "W": str(tmp_path / "job"), "OUT": str(tmp_path / "out"), "POLL_S": "1"}
    cmd = [sys.executable, "-c", "import os, time; time.sleep(3); "
           "open(os.path.join(os.environ['JOB_OUT'], 'r.json'), 'w').write('{}'); print('finished')"]
    first = subprocess.run(["bash", str(script), "start", *cmd], env=env, capture_output=True, text=True)
    assert first.returncode == 0 and "started:" in first.stdout and "still running" in first.stdout
    again = subprocess.run(["bash", str(script), "start", "false"], env=env, capture_output=True, text=True)
    assert "a command is in flight" in again.stdout
    done = subprocess.run(["bash", str(script), "poll"], env={**env, "POLL_S": "60"}, capture_output=True, text=True)
    assert "done: exit 0" in done.stdout and "finished" in done.stdout, done.stdout + done.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"r.json", "job.log", "mem.log"}
    failing = subprocess.run(["bash", str(script), "start", "bash", "-c", "exit 3"], env={**env, "POLL_S": "60"},
                             capture_output=True, text=True)
    assert "done: exit 3" in failing.stdout
    unset = subprocess.run(["bash", str(script), "poll"], env={k: v for k, v in env.items() if k != "W"},
                           capture_output=True, text=True)
    assert unset.returncode != 0 and "set W" in unset.stderr


def test_plan_predictions_records_the_waiting_rows(tmp_path):
    """studies/plan_predictions.py: the scale rows' picks and predicted steps, the capped 14B at 32 and 16 cores,
    and every option plan offers the 8B on 24 GB + 64 GB, each fitting when applied."""
    import json
    spec = importlib.util.spec_from_file_location("plan_predictions",
                                                  REPO / "experiments" / "studies" / "plan_predictions.py")
    pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)
    out = tmp_path / "p.json"
    record = pp.main(["--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert record["command"].startswith("PYTHONPATH=. python experiments/studies/plan_predictions.py")
    runs = {r["config"]: r for r in record["runs"]}
    for name in ("qwen2.5-32b_q8_32k", "llama3-70b_q8_32k"):
        assert runs[name]["predicted_step"]["model_tflops"] > 0 and isinstance(runs[name]["kept_layers"], int)
    l40s = runs["l40s_sft_14b_capped_h200x2"]
    assert l40s["predicted_step_32_cores"]["seconds"] < l40s["predicted_step_16_cores"]["seconds"]
    rtx = runs["rtx4090_sft_8b_24gb_64gb"]
    assert not rtx["fits_as_configured"] and rtx["options"] and all(o["fits"] for o in rtx["options"])
    # 8-bit moments alone fit both (the float32 gradient sums a cast reads are not held for queued blocks: 4ef9240)
    assert rtx["modes_alone"]["q8"]["gpu_fits"] and rtx["modes_alone"]["q8"]["host_fits"]
    assert rtx["options"][0]["overrides"] == ["engine.moment_dtype=q8", "engine.host_grad_dtype=bfloat16"]
    thirteen = runs["13b_8k_h200x2"]
    picked, without = thirteen["picked"], thirteen["picked_without_gpu_updated"]
    assert picked["resident_copy"] is False and without["gpu_updated_layers"] == 0 < picked["gpu_updated_layers"]
    assert without["resident_layers"] > thirteen["as_run_fcba712"]["resident_layers"]
    seconds = lambda k: thirteen[k]["predicted_step"]["seconds"]  # noqa: E731
    assert seconds("picked") <= seconds("as_run_a0efdd0") and seconds("picked") < seconds("picked_without_gpu_updated")
    assert seconds("picked_without_gpu_updated") < seconds("as_run_fcba712")
    streamed = runs["3p5b_8k_nothing_resident_16_cores"]
    assert streamed["picked"]["gpu_updated_layers"] > 0 == streamed["picked_without_gpu_updated"]["gpu_updated_layers"]
    assert streamed["picked"]["predicted_step"]["seconds"] < streamed["picked_without_gpu_updated"]["predicted_step"]["seconds"]


# ---------------------------------------------------------------------------------------------------------
# studies/engine_patch_ab.py: its patches move bytes at other times, never the numbers. Each arm runs in a process
# of its own (the patches replace engine functions for the whole process).
PATCH_RUN = """
import sys
import numpy as np, jax
from flax import nnx
sys.path[:0] = ["tests", "experiments/studies", "experiments"]
from megatrain_jax import Decoder, Engine, EngineConfig, adamw, preset
from test_engine import make_batches
import engine_patch_ab
for name in sys.argv[2:]:
    engine_patch_ab.PATCHES[name]()
out = {}
for i, cfg in enumerate([EngineConfig(clip_norm=0.05, gpu_updated_layers=2, gpu_updated_io=True, prefetch_depth=2),
                         EngineConfig(clip_norm=0.05, micro_batches=2, resident_layers=1, gpu_updated_layers=1),
                         EngineConfig(accumulate_steps=2, gpu_updated_layers=1)]):
    engine = Engine(Decoder(preset("tiny", layers=3).replace(dtype="bfloat16"), rngs=nnx.Rngs(0)),
                    adamw(1e-3, eps=1e-6, weight_decay=0.1), cfg)
    batches = make_batches(6)
    for j in range(0, 6, cfg.accumulate_steps):
        engine.step(batches[j:j + cfg.accumulate_steps] if cfg.accumulate_steps > 1 else batches[j]).resolve()
    engine.sync()
    for k, leaf in enumerate(jax.tree.leaves(engine.state.parts)):
        out[f"{i}_{k}"] = np.atleast_1d(np.asarray(leaf)).view(np.uint8)
    engine.close()
np.savez(sys.argv[1], **out)
"""


def test_engine_patch_ab_patches_change_when_bytes_move_not_the_numbers(tmp_path):
    """Every patch of ``engine_patch_ab.py`` trains bit for bit as the engine does: GPU-updated blocks and the
    io part, two micro-batches beside a resident block, and accumulation (where the patches leave the passes)."""
    arms = {"as_is": [], "held_and_after_head": ["io_home_at_head", "blocks_brought_after_head"],
            "in_backward": ["blocks_brought_in_backward"], "decision_copies_late": ["decision_copies_late"],
            "decision_copies_started": ["decision_copies_started"]}
    runs = {}
    for arm, patches in arms.items():
        subprocess.run([sys.executable, "-c", PATCH_RUN, str(tmp_path / f"{arm}.npz"), *patches], cwd=REPO,
                       check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        runs[arm] = np.load(tmp_path / f"{arm}.npz")
    assert runs["as_is"].files
    for arm in ("held_and_after_head", "in_backward", "decision_copies_late", "decision_copies_started"):
        assert sorted(runs[arm].files) == sorted(runs["as_is"].files)
        for name in runs["as_is"].files:
            np.testing.assert_array_equal(runs["as_is"][name], runs[arm][name], err_msg=f"{arm}: {name}")


def test_step_start_copies_reads_the_gpu_streams_copies_and_idle(tmp_path):
    """``step_start_copies.summarize``: copies on the GPU's stream lines with their sizes, the small copies home with
    what ran beside them and before them on their stream, and the compute engine's idle windows; host lines
    ignored."""
    spec = importlib.util.spec_from_file_location("step_start_copies",
                                                  REPO / "experiments" / "studies" / "step_start_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 14, "args": {"name": "Stream #14(Compute,Memset)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 16, "args": {"name": "Stream #16(MemcpyD2H)"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": "pjrt_async_work_runner"}}]

    def ev(pid, tid, name, ts_ms, dur_ms, size=None, cid=None):
        args = {} if size is None else {"memcpy_details": f"kind_src:unknown kind_dst:unknown size:{size} async:1"}
        args.update({} if cid is None else {"correlation_id": cid})
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "args": args}

    trace = {"traceEvents": meta + [
        ev(1, 14, "fusion_1", 0.0, 10.0), ev(1, 14, "gemm_2", 10.5, 5.0), ev(1, 14, "fusion_3", 40.0, 5.0),
        ev(1, 16, "MemcpyD2H", 16.0, 40.0, size=2 << 30), ev(1, 16, "MemcpyD2H", 57.0, 0.01, size=4, cid="9"),
        ev(1, 16, "MemcpyD2H", 60.0, 0.01, size=1),  # no correlation id: when it was issued is unknown
        ev(1, 14, "MemsetD32Async", 20.0, 1.0), ev(7, 3, "MemcpyD2H", 30.0, 1.0, size=4, cid="9"),
        ev(7, 3, "MemcpyD2H", 31.0, 1.0, size=8)]}
    out = module.summarize(trace)
    assert out["span_ms"] == 45.0
    assert [c["bytes"] for c in out["copies_1mb_or_more"]] == [2 << 30]
    small, unmatched = out["small_copies_home"]  # the host line's copies are not the GPU's
    assert small["start_ms"] == 57.0 and small["running_then"] == [] and small["its_stream_before"][0]["ms"] == 40.0
    assert small["issued_ms"] == 30.0 and unmatched["issued_ms"] is None  # queued by the host 27 ms before it ran
    # --read: the packed traces summarized again under the measured run's commit, date, device and arm names
    import tarfile
    raw = tmp_path / "perfetto_trace.json.gz"
    raw.write_bytes(gzip.compress(json.dumps(trace).encode()))
    with tarfile.open(tmp_path / "traces.tar.gz", "w:gz") as tar:
        tar.add(raw, arcname="arm0/perfetto_trace.json.gz")
    measured = {"git_commit": "abc", "date": "2026-12-01", "device": {"name": "NVIDIA H200"},
                "runs": [{"arm": "3p5b_32k_nothing_resident", "traced_step_times": [1.2]}]}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    module.read_traces(str(tmp_path / "traces.tar.gz"), str(tmp_path / "measured.json"), str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    assert {k: got[k] for k in ("git_commit", "date", "device")} == {k: measured[k] for k in ("git_commit", "date", "device")}
    assert got["runs"][0]["arm"] == "3p5b_32k_nothing_resident" and got["runs"][0]["small_copies_home"] == out["small_copies_home"]
    assert out["compute_idle_over_2ms"] == [{"from_ms": 15.5, "ms": 24.5}]
    assert module.summarize({"traceEvents": meta[1:2]}) == {"error": "no events on the GPU's stream lines"}
