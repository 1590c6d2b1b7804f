"""XLA's own memory figures in the plan (issue 31): ``engine.program_memory`` compiles the per-part programs a
step runs, for the run's micro-batch shape and layout, and reads ``memory_analysis()``; the plan charges their
scratch memory (temp) instead of the rules of thumb (``MemoryPlan.gpu_exact``); ``plan.exact_plan`` plans
with them and picks the layout again where that does not fit; ``megatrain-jax train`` writes the plan it ran
with, XLA's figures included, to ``memory_plan.json``.

Checked here, on CPU devices (XLA's CPU backend answers ``memory_analysis()`` too):

- the figures name exactly the programs one step calls, and are for one micro-batch shape (``matches``);
- the engine's first step finds those programs compiled: it compiles none of them again, on one device and
  over two;
- the plan takes the figures only where they fit its shape, and charges the peak op exactly their temp;
- the GPU verdict keeps the allocator's fragmentation margin free;
- ``exact_plan`` offloads activations where XLA's figures do not fit the GPU;
- ``train`` writes the figures to ``memory_plan.json`` where a GPU is at hand, and none on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax._src import monitoring

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, default_optimizer, preset
from megatrain_jax.engine.program_memory import OP_KIND, program_memory
from megatrain_jax.engine.transfer import Placement
from megatrain_jax.plan import GiB, exact_plan, plan
from megatrain_jax.plan.machine import GPU_FRAGMENTATION_MARGIN

REPO = Path(__file__).resolve().parents[1]
DEMO_TINY = REPO / "experiments" / "configs" / "demo_tiny.toml"

CFG = preset("tiny", layers=3)
ENGINE = EngineConfig(micro_batches=2)
ROWS, SEQ = 4, 32
LIMITS = dict(host_ram_bytes=100 * GiB, gpu_bytes=100 * GiB, detect=False)

# The names jit gives the per-part programs (``DeviceFns._program``): on one device the jitted bodies, over
# several the shard_map wrapper ``program``.
PER_PART = {"embed", "block", "_head", "_backward", "_embed_backward", "program"}


def abstract(cfg):
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def pm():
    """XLA's figures for ``CFG`` in 2 micro-batches of 2 x 32 tokens on one device."""
    return program_memory(abstract(CFG), ENGINE, ROWS, SEQ)


# ------------------------------------------------------------------------------------------ the figures
def test_figures_name_the_programs_of_a_step(pm):
    assert [(f.program, f.variant) for f in pm.figures] == [
        ("embed", "plain"), ("forward", "plain"),
        ("head", "starts the accumulator"), ("head", "adds to the accumulator"),
        ("backward", "starts the accumulator"), ("backward", "adds to the accumulator"),
        ("embed_backward", "adds to the accumulator")]
    assert (pm.micro_rows, pm.seq_len, pm.devices, pm.packed, pm.keep_residuals) == (2, 32, 1, False, False)
    for f in pm.figures:
        assert min(f.temp, f.argument, f.output, f.alias) >= 0, f
        assert f.argument > 0 and f.output > 0, f
    assert pm.temp("backward") > 0
    assert pm.temp("backward") == max(f.temp for f in pm.figures if f.program == "backward")
    assert pm.temp("nope") is None
    # for its own micro-batch shape (float32 streamed: 4 bytes) and no other
    assert pm.matches(2, 32, 4, False, 1)
    assert not pm.matches(2, 64, 4, False, 1)
    assert not pm.matches(1, 32, 4, False, 1)
    assert not pm.matches(2, 32, 2, False, 1)
    assert not pm.matches(2, 32, 4, True, 1)
    assert not pm.matches(2, 32, 4, False, 2)
    as_dict = pm.as_dict()
    assert as_dict["seq_len"] == 32 and [p["program"] for p in as_dict["programs"]] == [
        f.program for f in pm.figures]
    json.dumps(as_dict)  # plain data


@pytest.fixture
def compiles():
    """The names of the programs XLA compiles (or loads from the persistent cache: the backend_compile event
    fires for both, checked by hand with jax 0.11.2, so the suite's persistent cache hides nothing here)."""
    names: list[str] = []

    def listen(event, duration, **kw):
        if "backend_compile" in event:
            name = kw.get("fun_name", "?")  # "jit(_backward)"
            names.append(name[4:-1] if name.startswith("jit(") else name)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(listen)


def _first_step(model, rows, placement, compiles) -> list[str]:
    """The programs compiled while an engine is built on ``model`` and runs its first step."""
    compiles.clear()
    eng = Engine(model, default_optimizer(), ENGINE, placement=placement)
    eng.step(Batch.from_windows(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (rows, SEQ + 1)))).resolve()
    eng.sync()
    return list(compiles)


# Model shapes no other test compiles (hidden and ffn), so that no in-process cache holds their programs.
@pytest.mark.parametrize("devices,rows,measured,baseline", [
    (1, 4, dict(hidden=56, ffn=88), dict(hidden=40, ffn=72)),
    (2, 8, dict(hidden=72, ffn=104), dict(hidden=24, ffn=56)),
], ids=["one-device", "two-devices"])
def test_the_first_step_finds_the_programs_compiled(devices, rows, measured, baseline, compiles, build_model):
    # (build_model: concrete models drawn with numpy; Decoder's own initializers compile each op on first use)
    placement = Placement(jax.devices()[:devices])
    # Without program_memory: the step compiles each per-part program once, as many as there are figures.
    # (Run first: it also compiles the shape-independent helpers, such as the scalar additions of the losses,
    # which the step below then finds compiled; the per-part count is what is compared exactly.)
    plain = _first_step(build_model(preset("tiny", layers=3, **baseline)), rows, placement, compiles)
    cfg = preset("tiny", layers=3, **measured)
    figures = program_memory(abstract(cfg), ENGINE, rows, SEQ, placement=placement).figures
    programs = {(f.program, f.variant) for f in figures}
    assert len(programs) == len(figures) == (7 if devices == 1 else 11)  # each program once
    after = _first_step(build_model(cfg), rows, placement, compiles)
    assert len([n for n in plain if n in PER_PART]) == len(programs), plain
    assert [n for n in after if n in PER_PART] == [], after
    assert len(plain) - len(after) >= len(programs), (plain, after)


# ------------------------------------------------------------------------------------------ the plan
def test_the_plan_charges_xla_figures(pm):
    exact = plan(CFG, ENGINE, ROWS, SEQ, programs=pm, **LIMITS)
    assert exact.gpu_exact and exact.programs is pm
    assert "XLA's memory analysis" in exact.table() and "an estimate" not in exact.table()
    assert not any("rule of thumb" in k for k in exact.gpu)
    # the peak op's transient is the temp XLA gave the program it runs
    (key, temp), = [(k, v) for k, v in exact.gpu.items() if k.startswith("transient of")]
    assert key.startswith(f"transient of {exact.gpu_peak_at} (XLA's memory analysis")
    kind = exact.gpu_peak_at.split("(")[0]
    assert kind in OP_KIND.values()
    assert temp == pm.temp(kind) > 0
    as_dict = exact.as_dict()
    assert as_dict["gpu_exact"] is True and as_dict["programs"] == pm.as_dict()
    assert as_dict["gpu_fragmentation_margin"] == GPU_FRAGMENTATION_MARGIN

    estimate = plan(CFG, ENGINE, ROWS, SEQ, **LIMITS)
    assert not estimate.gpu_exact and estimate.programs is None
    assert "an estimate" in estimate.table()
    assert any("rule of thumb" in k for k in estimate.gpu)
    assert estimate.as_dict()["programs"] is None

    # figures for 32-token micro-batches do not stand for 64-token ones: the rules of thumb again
    other = plan(CFG, ENGINE, ROWS, 2 * SEQ, programs=pm, **LIMITS)
    assert not other.gpu_exact and "an estimate" in other.table()
    assert any("rule of thumb" in k for k in other.gpu)
    # nor for another micro-batch count (4 micro-batches of 1 row)
    assert not plan(CFG, dataclasses.replace(ENGINE, micro_batches=4), ROWS, SEQ, programs=pm, **LIMITS).gpu_exact


def test_the_gpu_verdict_keeps_the_fragmentation_margin(pm):
    p = plan(CFG, ENGINE, ROWS, SEQ, programs=pm, **LIMITS)
    assert GPU_FRAGMENTATION_MARGIN > 0
    edge = dataclasses.replace(p, gpu_available=p.gpu_total + GPU_FRAGMENTATION_MARGIN)
    assert edge.gpu_fits and edge.fits
    short = dataclasses.replace(p, gpu_available=p.gpu_total + GPU_FRAGMENTATION_MARGIN - 1)
    assert not short.gpu_fits and not short.fits
    assert "OVER by" in short.table() and "OVER by" not in edge.table()


# ------------------------------------------------------------------------------------------ exact_plan
def test_exact_plan_picks_the_layout_again(tmp_path, monkeypatch):
    # Six blocks, 8 x 256 tokens in one micro-batch: the activations outweigh the tiny model's weights, so
    # offloading the first block's input lowers the GPU peak.
    cfg, engine, rows, seq = preset("tiny", layers=6), EngineConfig(), 8, 256
    model = abstract(cfg)
    kw = dict(given=engine, devices=None, disk_dir=str(tmp_path / "disk_tier"))
    # With room to spare the layout stands, with XLA's figures attached.
    roomy = plan(cfg, engine, rows, seq, **LIMITS)
    exact, said = exact_plan(model, roomy, **kw)
    assert said is None and exact.gpu_exact and exact.fits
    assert exact.engine_cfg == engine and exact.programs is not None
    assert exact.programs.matches(rows, seq, 4, False, 1)

    offloaded = exact.applied((("engine.offload_activations", 1),))
    assert offloaded.gpu_exact and offloaded.gpu_total < exact.gpu_total
    # A GPU between the two: XLA's figures for the layout as given do not fit, with one block offloaded they do.
    gpu = GPU_FRAGMENTATION_MARGIN + (offloaded.gpu_total + exact.gpu_total) // 2
    estimate = plan(cfg, engine, rows, seq, host_ram_bytes=100 * GiB, gpu_bytes=gpu, detect=False)
    assert not estimate.replace(programs=exact.programs).fits

    picked, said = exact_plan(model, estimate, **kw)
    assert picked.fits and picked.gpu_exact
    assert picked.engine_cfg.offload_activations > 0
    assert picked.engine_cfg == dataclasses.replace(engine, offload_activations=picked.engine_cfg.offload_activations)
    assert said is not None and "picked again" in said
    assert f"engine.offload_activations={picked.engine_cfg.offload_activations}" in said
    # the layout picked again counts the run's end as the estimate did (a Hugging Face export, checkpoints)
    import megatrain_jax.plan.layout as layout
    seen = {}
    real = layout.lean_engine
    monkeypatch.setattr(layout, "lean_engine", lambda *a, **k: seen.update(k) or real(*a, **k))
    ending = plan(cfg, engine, rows, seq, host_ram_bytes=100 * GiB, gpu_bytes=gpu, detect=False, export=True,
                  checkpoints=True)
    again, _ = exact_plan(model, ending, **kw)
    assert seen["export"] is True and seen["checkpoints"] is True and again.export and again.checkpoints
    # check=False: XLA's figures for the layout as given, whether it fits or not
    unchecked, said = exact_plan(model, estimate, check=False, **kw)
    assert said is None and unchecked.engine_cfg == engine and unchecked.gpu_exact and not unchecked.fits


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("at_hand", [True, False], ids=["gpu-at-hand", "cpu"])
def test_train_writes_the_plan_it_ran_with(at_hand, tmp_path, monkeypatch):
    from megatrain_jax.cli.commands import main
    if at_hand:  # plan with XLA's figures as on a GPU (the CPU backend has them too)
        monkeypatch.setattr("megatrain_jax.cli.run.gpu_at_hand", lambda: True)
    # demo_tiny's model (2 blocks) on a smaller demo corpus and batch, for seconds on a CPU
    assert main(["train", "--config", str(DEMO_TINY), "train.steps=2", f"train.run_dir={tmp_path}",
                 "train.eval_every=0", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
                 "log.progress=lines", "log.tensorboard=false"]) == 0
    record = json.loads((tmp_path / "memory_plan.json").read_text())
    assert (record["batch_rows"], record["seq_len"]) == (4, 32)
    assert isinstance(record["gpu_total"], int) and record["gpu_total"] > 0
    if at_hand:
        assert record["gpu_exact"] is True
        programs = record["programs"]
        assert (programs["micro_rows"], programs["seq_len"], programs["devices"]) == (4, 32, 1)
        names = [p["program"] for p in programs["programs"]]
        assert {"embed", "forward", "head", "backward", "embed_backward"} <= set(names)
        assert all(p["temp"] >= 0 for p in programs["programs"])
        assert isinstance(record["estimate_gpu_total"], int) and record["estimate_gpu_total"] > 0
        assert not any("rule of thumb" in k for k in record["gpu"])
    else:
        assert record["gpu_exact"] is False and record["programs"] is None
        assert record["estimate_gpu_total"] == record["gpu_total"]  # the estimate is the plan
        assert any("rule of thumb" in k for k in record["gpu"])


def test_plan_exact_needs_a_gpu_and_then_plans_with_xla_figures(monkeypatch, capsys):
    from megatrain_jax.cli.commands import main
    args = ["plan", "--config", str(DEMO_TINY), "data.seq_len=32", "data.batch_size=4", "--exact"]
    assert main(args) == 2
    assert "plan --exact compiles the run's programs on this machine's GPU" in capsys.readouterr().err
    monkeypatch.setattr("megatrain_jax.cli.run.gpu_at_hand", lambda: True)
    main(args)
    out = capsys.readouterr().out
    assert "with XLA's figures for the compiled programs: GPU" in out and "XLA's memory analysis" in out
    assert "compiled programs (XLA's memory analysis, per device" in out
