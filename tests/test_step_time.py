"""The step-time model (``plan.step_time``): its walk of the schedule against hand-counted steps, what bounds a
step, the bytes it moves against the schedule's own fetches, the calibration file's checks, and the committed
runs it must predict (``experiments/step_time_vs_runs.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatrain_jax.batch import RowMix
from megatrain_jax.cli.commands import main
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import IO, PartId
from megatrain_jax.engine.schedule import step_ops
from megatrain_jax.models import preset
from megatrain_jax.plan import Machine, for_machine, predict
from megatrain_jax.plan.speeds import H100, SPEEDS, from_file, kind_of
from megatrain_jax.plan.counts import io_param_count
from megatrain_jax.plan import step_time
from megatrain_jax.plan.step_time import lengths

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "step_time_vs_runs.py"
CFG = preset("7b", layers=8, vocab_size=32000)
QUIET = H100.replace(dispatch={})  # no Python-thread cost: the hand counts below are the GPU's alone


def test_all_resident_step_is_the_gpu_work_in_a_row():
    """Nothing streams and nothing updates on the host: a step is every compute op and every device update (and,
    where the resident parts keep no compute copy, its cast at each fetch), one after another on the GPU."""
    for copy in (True, False):
        e = EngineConfig(micro_batches=2, resident_layers=CFG.layers, resident_io=True, resident_copy=copy,
                         stream_dtype="bfloat16")
        n = lengths(CFG, e, 8, 2048, QUIET)
        casts = sum(n.cast[op.part] for op in step_ops(CFG.layers, 2, e.prefetch_depth) if op.kind == "fetch")
        assert casts == 0 if copy else n.cast[PartId.block(0)] == CFG.block_param_count(0) * 6 / QUIET.hbm_bytes
        gpu = (2 * sum(n.forward.values()) + 2 * sum(n.backward.values()) + 2 * n.head + 4 * n.embed
               + sum(n.device_update.values()) + casts)
        p = predict(CFG, e, 8, 2048, QUIET)
        assert p.bound == "gpu" and p.h2d_bytes == p.d2h_bytes == 0 and p.resident_share == 1.0
        assert math.isclose(p.seconds, gpu, rel_tol=1e-9), (p.seconds, gpu)


def test_streamed_bytes_are_the_schedules_fetches():
    """Bytes to the GPU: each fetch of a host part in the schedule (the last ``depth`` blocks stay for the
    backward) times its weights in the stream dtype; back: each host part's float32 gradient once."""
    e = EngineConfig(micro_batches=1, prefetch_depth=2, resident_layers=3, stream_dtype="bfloat16")
    count = lambda p: CFG.block_param_count(p.layer) if not p.is_io else (  # noqa: E731
        CFG.vocab_size * CFG.hidden * 2 + CFG.hidden)  # untied embedding and head, final norm
    ops = step_ops(CFG.layers, 1, 2)
    fetched = [op.part for op in ops if op.kind == "fetch" and (op.part.is_io or op.part.layer >= 3)]
    sent = [op.part for op in ops if op.kind == "send_grads" and (op.part.is_io or op.part.layer >= 3)]
    p = predict(CFG, e, 8, 2048, QUIET)
    assert p.h2d_bytes == sum(2 * count(part) for part in fetched)
    assert p.d2h_bytes == sum(4 * count(part) for part in sent)
    assert 0 < p.resident_share < 1


def test_a_slow_host_bounds_the_step_by_its_update():
    e = EngineConfig(micro_batches=1)
    slow = QUIET.replace(host_update={**QUIET.host_update, "full": 1e8})
    p = predict(CFG, e, 2, 2048, slow)
    update = CFG.param_count() / 1e8
    assert p.bound in ("host", "memory") and p.busy["host"] == pytest.approx(update, rel=1e-6)
    assert update <= p.seconds <= max(update + p.busy["gpu"] + p.busy["d2h"], p.busy["memory"]) + 1e-9, (
        p.seconds, update)


def test_the_hosts_memory_bounds_a_step_by_the_updates_and_the_transfers_bytes():
    """The host's memory serves the host update and both copy engines at once: a step is at least their bytes at
    the memory's rate, full precision's split update's 46 bytes a parameter at its rate. Counted by hand: every
    part split (io and 8 blocks), float32 gradients home, the weights' fetches and the gradients' sends."""
    e = EngineConfig(micro_batches=1)
    rate = 1e9
    slow = QUIET.replace(host_update={**QUIET.host_update, "full": rate})
    p = predict(CFG, e, 2, 2048, slow)
    host_bytes = CFG.param_count() * 46  # read 16 twice, write 14 (the split update)
    assert p.busy["memory"] == pytest.approx((host_bytes + p.h2d_bytes + p.d2h_bytes) / (rate * 46), rel=1e-6)
    assert p.bound == "memory" and p.seconds == pytest.approx(p.busy["memory"], rel=1e-9)
    assert p.busy["memory"] > p.busy["host"]  # the transfers' bytes on top of the update's


def test_blocks_updated_on_the_gpu_move_their_state_instead_of_their_gradient_and_leave_the_host():
    """``gpu_updated_layers``: each such block brings its float32 masters and moments over (12 B/param) instead of
    its forward's weights (2), and sends them home with its copy (14) instead of its gradient (4); it has no host
    update, and its update runs on the GPU. Where the host's memory bounds the step, that is faster."""
    e = EngineConfig(micro_batches=1, stream_dtype="bfloat16")
    g = dataclasses.replace(e, gpu_updated_layers=3)
    a, b = predict(CFG, e, 2, 2048, QUIET), predict(CFG, g, 2, 2048, QUIET)
    blocks = 3 * CFG.block_param_count(0)
    assert b.h2d_bytes - a.h2d_bytes == (12 - 2) * blocks and b.d2h_bytes - a.d2h_bytes == (14 - 4) * blocks
    n = lengths(CFG, g, 2, 2048, QUIET)
    assert [p.layer for p in n.visit] == [0, 1, 2] and not any(p in n.host_update for p in n.visit)
    assert b.busy["host"] < a.busy["host"] and b.resident_share == a.resident_share == 0.0
    slow = QUIET.replace(host_update={**QUIET.host_update, "full": 5e8})
    assert predict(CFG, g, 2, 2048, slow).seconds < predict(CFG, e, 2, 2048, slow).seconds


def test_the_io_part_updated_on_the_gpu_moves_its_state_during_the_backward_and_leaves_the_host():
    """``gpu_updated_io``: the io part brings its float32 masters and moments over (12 B/param) instead of its
    weights, during the backward before, and sends them home with its copy (14) instead of its gradient (4); it has
    no host update. The next forward's first op then waits for no host update: where the host's first passes hold
    the forward's start (exact clipping), the step is shorter."""
    e = EngineConfig(micro_batches=1, stream_dtype="bfloat16")
    io = dataclasses.replace(e, gpu_updated_io=True)
    a, b = predict(CFG, e, 2, 2048, QUIET), predict(CFG, io, 2, 2048, QUIET)
    n = io_param_count(CFG)
    assert b.h2d_bytes - a.h2d_bytes == (12 - 2) * n and b.d2h_bytes - a.d2h_bytes == (14 - 4) * n
    assert IO not in lengths(CFG, io, 2, 2048, QUIET).host_update and b.busy["host"] < a.busy["host"]
    slow = QUIET.replace(host_update={**QUIET.host_update, "full": 5e8})
    assert predict(CFG, io, 2, 2048, slow).seconds < predict(CFG, e, 2, 2048, slow).seconds


def test_a_slow_link_bounds_the_step_by_pcie():
    e = EngineConfig(micro_batches=1)
    slow = QUIET.replace(h2d_bytes=1e9)
    p = predict(CFG, e, 2, 2048, slow)
    assert p.bound == "h2d" and p.seconds >= p.h2d_bytes / 1e9


def test_a_link_shared_by_both_directions_slows_copies_that_meet_on_it_and_no_others():
    """``link_bytes``: copies each way share the link. Blocks updated on the GPU send their state home while the
    next blocks' fetches come over: with a shared link the step is slower than with a full-duplex one, and the
    link's busy seconds are both directions' bytes at its rate. A link as fast as need be changes nothing, even
    where a copy home waits for the GPU's work before it starts (a copy that has not started holds no link)."""
    e = EngineConfig(micro_batches=1, stream_dtype="bfloat16", gpu_updated_layers=4)
    fast_host = QUIET.replace(host_update={k: 20 * v for k, v in QUIET.host_update.items()})  # not memory-bound
    full = predict(CFG, e, 8, 2048, fast_host)
    rate = QUIET.h2d_bytes + QUIET.d2h_bytes
    shared = predict(CFG, e, 8, 2048, fast_host.replace(link_bytes=0.6 * rate))
    assert full.seconds > full.busy["memory"] and full.busy["link"] == 0.0
    assert shared.seconds > 1.05 * full.seconds
    assert shared.busy["link"] == pytest.approx((shared.h2d_bytes + shared.d2h_bytes) / (0.6 * rate), rel=1e-6)
    for g in (e, dataclasses.replace(e, accumulate_steps=2)):
        wide = predict(CFG, g, 8, 2048, fast_host.replace(link_bytes=1e6 * rate))
        assert wide.seconds == pytest.approx(predict(CFG, g, 8, 2048, fast_host).seconds, rel=1e-4)
    assert SPEEDS["H200"].link_bytes < SPEEDS["H200"].h2d_bytes + SPEEDS["H200"].d2h_bytes
    assert SPEEDS["GH200"].link_bytes is None  # its host link is not the H200's PCIe


def test_resident_blocks_trade_transfers_for_their_update_on_the_gpu():
    """Each more GPU-resident block takes its weights off PCIe and puts its AdamW on the GPU: the bytes fall with
    every block, and a step never slows by more than that block's update and the casts of its compute copy at
    its fetches (all resident beats none here); blocks keeping their products shorten the GPU's backward."""
    fetches = sum(op.kind == "fetch" and op.part == PartId.block(0) for op in step_ops(CFG.layers, 1, 1))
    for copy in (True, False):
        e = lambda r: EngineConfig(resident_layers=r, resident_io=True, resident_copy=copy,  # noqa: E731
                                   stream_dtype="bfloat16")
        ps = [predict(CFG, e(r), 16, 2048, H100) for r in range(CFG.layers + 1)]
        n = lengths(CFG, e(CFG.layers), 16, 2048, H100)
        assert (n.cast[PartId.block(0)] > 0) is not copy
        most = n.device_update[PartId.block(0)] + fetches * n.cast[PartId.block(0)]
        assert all(a.h2d_bytes > b.h2d_bytes for a, b in zip(ps, ps[1:]))
        assert all(b.seconds <= a.seconds + most + 1e-9 for a, b in zip(ps, ps[1:]))
        assert ps[-1].seconds < ps[0].seconds
    kept = predict(CFG, EngineConfig(resident_layers=0, kept_layers=4, keep_residuals=True), 16, 2048, H100)
    plain = predict(CFG, EngineConfig(resident_layers=0, keep_residuals=True), 16, 2048, H100)
    assert kept.busy["gpu"] < plain.busy["gpu"]


def test_predict_wants_a_number_of_resident_blocks():
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        predict(CFG, EngineConfig(resident_layers="auto"), 8, 2048, H100)


def test_gpu_kinds_by_name():
    assert kind_of("NVIDIA H100 80GB HBM3") == "H100"
    assert kind_of("NVIDIA H200") == "H200"
    assert kind_of("NVIDIA GH200 480GB") == "GH200"
    assert kind_of("NVIDIA A100-SXM4-80GB") is None and kind_of(None) is None
    assert for_machine(CFG, EngineConfig(), 8, 2048, Machine(None, None)) is None  # no GPU, no file: no prediction


def test_a_calibration_file_replaces_the_rates_it_names(tmp_path):
    f = tmp_path / "speeds.json"
    f.write_text(json.dumps({"h2d_bytes": 25e9, "host_update": {"full": 1.5e9}}))
    s = from_file(f, H100)
    assert s.h2d_bytes == 25e9 and s.host_update["full"] == 1.5e9 and s.host_update["q8"] == H100.host_update["q8"]
    assert s.matmul_flops == H100.matmul_flops and "speeds.json" in s.name
    for bad, words in (({"h2d": 1}, "unknown fields"), ({"h2d_bytes": -1}, "positive number"),
                       ({"host_update": {"full": "fast"}}, "positive numbers"), ([1, 2], "JSON object"),
                       ({"no_gradient_backward": 1.0}, "up to \\(not including\\) 1"),
                       ({"no_gradient_backward": True}, "from 0")):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=words):
            from_file(f, H100)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the calibration file"):
        from_file(f, H100)
    f.write_text(json.dumps({"no_gradient_backward": 0}))  # 0: not measured, allowed
    assert from_file(f, SPEEDS["H200"]).no_gradient_backward == 0
    for given, link in ((5e10, 5e10), (None, None)):  # null: each way at its own rate, whatever the base says
        f.write_text(json.dumps({"link_bytes": given}))
        assert from_file(f, SPEEDS["H200"]).link_bytes == link


def test_plan_prints_the_predicted_step_for_a_named_gpu(capsys):
    args = ["plan", "model.preset=7b", "model.layers=16", "data.seq_len=2048", "data.batch_size=16",
            "--host-gib", "125", "--gpu-gib", "141"]
    main(args + ["--gpu", "H200"])
    out = capsys.readouterr().out
    assert "predicted step: " in out and "tokens/s" in out and SPEEDS["H200"].name in out, out
    main(args)  # this machine has no GPU
    assert "predicted step: none (no GPU;" in capsys.readouterr().out
    assert main(args + ["--gpu", "A100"]) == 2
    assert "no rates for that GPU" in capsys.readouterr().err


def test_plan_predicts_with_what_the_data_rows_hold(tmp_path, capsys):
    """``plan`` reads the data's rows as ``train`` makes them (``DataConfig.row_mix``) and predicts with them:
    short documents packed with padding at the rows' ends count their runs' attention and the padding no loss
    reaches; the same data in windows mode is not read (whole rows, every token in the loss)."""
    from megatrain_jax.data import demo_tokens, write_tokens
    tokens, starts = demo_tokens(256, 40000)
    path = write_tokens(tmp_path / "d.bin", tokens, 256, starts)
    args = ["plan", "model.preset=7b", "model.layers=4", "model.vocab_size=256", f"data.path={path}",
            "data.seq_len=2048", "data.batch_size=8", "model.max_segments=4"]
    flags = ["--host-gib", "125", "--gpu-gib", "141", "--gpu", "H200"]
    main(args + ["data.mode=packed"] + flags)
    out = capsys.readouterr().out
    assert "packed rows' attention within their runs" in out and "reached by no loss" in out, out
    main(args + ["data.mode=windows"] + flags)
    out = capsys.readouterr().out
    assert "predicted step: " in out and "packed rows" not in out and "no loss" not in out, out


def test_the_committed_runs_are_predicted_within_ten_percent(tmp_path):
    """The rates in ``speeds.SPEEDS`` against every committed run of the engine as it runs now (the study's
    ``runs``, the shipped configs' runs with the rows of the chats they trained on, generated in ``tmp_path``):
    nine in ten within 10%, none off by more than 25% (the bars of experiments/studies/NOTES.md)."""
    spec = importlib.util.spec_from_file_location("step_time_vs_runs", STUDY)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    rs = [r for r in study.runs(work=str(tmp_path)) if not r["older"]]
    assert any(r["mix"] is not None and r["mix"].no_gradient > 0.5 for r in rs)  # the chats' rows were read
    assert len(rs) >= 40
    errs = []
    for kind in {r["kind"] for r in rs}:
        errs += study.errors([r for r in rs if r["kind"] == kind], SPEEDS[kind])
    assert sum(abs(e) <= 0.10 for e in errs) >= 0.9 * len(errs), sorted(errs)
    assert max(abs(e) for e in errs) <= 0.25, sorted(errs)


def test_auto_picks_the_fastest_layout_that_fits_where_the_gpu_is_known():
    """``resident_layers`` and ``kept_layers`` "auto" on a named GPU: the pick fits, and no layout among those
    that fit (every count of resident blocks, each with every count of kept blocks that fits) is predicted
    faster; without a GPU name, the most resident blocks that fit and none keeping products (as before)."""
    from megatrain_jax.plan import plan, resolve
    cfg = preset("7b", layers=12, vocab_size=32000)
    e = EngineConfig(micro_batches=1, prefetch_depth=2, keep_residuals=True, resident_layers="auto",
                     kept_layers="auto", resident_io=True)
    kw = dict(host_ram_bytes=96 * 2**30, gpu_bytes=60 * 2**30)
    fast = resolve(cfg, e, 16, 2048, Machine(kw["host_ram_bytes"], kw["gpu_bytes"], gpu_name="NVIDIA H200"))
    picked = fast.engine_cfg
    assert isinstance(picked.resident_layers, int) and isinstance(picked.kept_layers, int)
    assert plan(cfg, picked, 16, 2048, detect=False, **kw).fits
    assert "the fastest of" in fast.said and "step-time model" in fast.said, fast.said
    best = predict(cfg, picked, 16, 2048, SPEEDS["H200"]).seconds
    for r in range(cfg.layers + 1):
        for k in range(cfg.layers + 1):
            other = EngineConfig(micro_batches=1, prefetch_depth=2, keep_residuals=True, resident_layers=r,
                                 kept_layers=k, resident_io=True)
            if plan(cfg, other, 16, 2048, detect=False, **kw).fits:
                assert predict(cfg, other, 16, 2048, SPEEDS["H200"]).seconds >= best - 1e-9, (r, k)
    plain = resolve(cfg, e, 16, 2048, Machine(kw["host_ram_bytes"], kw["gpu_bytes"])).engine_cfg
    assert plain.kept_layers == 0 and plain.resident_layers >= picked.resident_layers
    assert plain.resident_layers == cfg.layers or not plan(
        cfg, dataclasses.replace(plain, resident_layers=plain.resident_layers + 1), 16, 2048, detect=False, **kw).gpu_fits


def test_an_engine_refuses_kept_layers_left_to_the_plan():
    from flax import nnx

    from megatrain_jax import Engine
    from megatrain_jax.models import Decoder
    from megatrain_jax.fit import default_optimizer
    model = nnx.eval_shape(lambda: Decoder(preset("tiny", layers=2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="kept_layers='auto'"):
        Engine(model, default_optimizer(1e-3), EngineConfig(kept_layers="auto"))
    with pytest.raises(ValueError, match="integer >= 0 or 'auto'"):
        EngineConfig(kept_layers="most")


def test_the_host_update_follows_the_measured_hosts_and_scales_with_cores_between_them(tmp_path):
    """A host of the cores of one measured for the GPU kind takes that host's rates; another takes the nearest
    measured host's, scaled by cores ** CORE_SCALING; a calibration file's rates are its own host's."""
    from megatrain_jax.plan.speeds import CORE_SCALING, for_gpu
    h200 = SPEEDS["H200"]
    assert h200.on_host(None) is h200 and h200.on_host(16) is h200
    x2 = h200.on_host(32)  # the 2-GPU machine's 32-core host, measured
    assert x2.host_update == h200.hosts[32]["host_update"] and x2.host_cores == 32 and "measured" in x2.name
    assert x2.first_half_share == h200.hosts[32]["first_half_share"] and x2.h2d_bytes == h200.h2d_bytes
    assert x2.host_update["q8"] > 2 * h200.host_update["q8"]  # AVX-512 and the cores
    between = h200.on_host(24)  # nearer 32 than 16 by their ratio
    assert between.host_update["full"] == pytest.approx(x2.host_update["full"] * (24 / 32) ** CORE_SCALING)
    assert between.host_cores == 24 and "scaled to 24 cores" in between.name
    assert h200.on_host(20).host_update["full"] == pytest.approx(h200.host_update["full"] * (20 / 16) ** CORE_SCALING)
    assert for_gpu("NVIDIA H200", host_cores=64).host_update["capacity"] == h200.hosts[64]["host_update"]["capacity"]
    e = EngineConfig()
    assert predict(CFG, e, 2, 2048, x2).busy["host"] < predict(CFG, e, 2, 2048, h200).busy["host"]
    # a calibration file describes its own host: measured at 16 cores, on 32 it scales, whatever the records hold
    f = tmp_path / "speeds.json"
    f.write_text(json.dumps({"host_update": {"full": 1e9}, "host_cores": 16}))
    mine = for_gpu("NVIDIA H200", f, 32)
    assert mine.host_update["full"] == pytest.approx(1e9 * 2 ** CORE_SCALING) and not mine.hosts
    f.write_text(json.dumps({"hosts": {}}))
    with pytest.raises(ValueError, match="one host's rates"):
        for_gpu("NVIDIA H200", f)
    f.write_text(json.dumps({"host_in_step": {"capacity": 0.9}}))  # a file's rates are a step's, as they are
    with pytest.raises(ValueError, match="not a calibration field"):
        for_gpu("NVIDIA H200", f)


def test_the_host_update_timed_on_the_host_at_hand_replaces_the_records_unless_a_calibration_file_is_given(
        tmp_path, lib):
    """The kernel timed here (``host_kernel.mode_rates``: full precision as the engine splits it, then each other
    mode) gives positive rates for every mode; ``Speeds.measured_here`` gives a timed mode its kernel's rate times
    the record's ``host_in_step``, scales a mode not timed (and the lean mode) by the measured full-precision rate
    over the record's, and takes the split's share and one-pass speedup as measured; ``for_gpu`` takes it over the
    kind's record (after the host's cores) but not over a calibration file, which the user chose; the model then
    predicts a host-bound step from it, faster on a faster host."""
    from megatrain_jax.engine.update.host_kernel import mode_rates
    from megatrain_jax.plan.speeds import for_gpu
    timed = mode_rates(1 << 20, reps=2, lib=lib)
    assert timed["lean"] > timed["full"] > 0 and 0 < timed["first_half_share"] < 1 and timed["one_pass_speedup"] > 0
    assert set(SPEEDS["H200"].host_update) <= set(timed) and all(v > 0 for v in timed.values())
    h200 = SPEEDS["H200"]
    fast = {"full": 2 * h200.host_update["full"], "lean": 9e9, "first_half_share": 0.4, "one_pass_speedup": 1.3}
    here = for_gpu("NVIDIA H200", None, 16, fast)  # full precision timed alone (the runs before every mode was)
    assert here.host_update == pytest.approx({k: 2 * v for k, v in h200.host_update.items()})
    # capacity mode's kernel timed no faster than the record's although full precision's doubled: its own rate
    every = {**fast, "capacity": 6.94e9, "q8": 5.24e9, "m7v5": 4.0e9}
    step_rates = for_gpu("NVIDIA H200", None, 16, every).host_update
    assert step_rates["capacity"] == pytest.approx(6.94e9 * h200.host_in_step["capacity"])
    assert step_rates["m7v5"] == pytest.approx(4.0e9 * h200.host_in_step["m7v5"])
    assert step_rates["full"] == pytest.approx(fast["full"])
    assert step_rates["lean"] == pytest.approx(here.host_update["lean"])
    assert for_gpu("NVIDIA H200", None, 32, every).host_update["capacity"] == pytest.approx(6.94e9)  # its kernel's
    assert (here.first_half_share, here.one_pass_speedup, here.host_cores) == (0.4, 1.3, 16)
    assert "measured here at" in here.name and here.h2d_bytes == h200.h2d_bytes
    x2 = for_gpu("NVIDIA H200", None, 32, fast)  # the 32-core record's mode ratios, scaled to the measured rate
    ratio = h200.hosts[32]["host_update"]["q8"] / h200.hosts[32]["host_update"]["full"]
    assert x2.host_update["q8"] == pytest.approx(ratio * fast["full"]) and x2.host_cores == 32
    f = tmp_path / "speeds.json"
    f.write_text(json.dumps({"host_update": {"full": 1e9}, "host_cores": 16}))
    assert for_gpu("NVIDIA H200", f, 16, fast).host_update["full"] == pytest.approx(1e9)  # the file wins
    e = EngineConfig(resident_layers=0)
    slow_host = dataclasses.replace(Machine(None, None, gpu_name="NVIDIA H200", host_cores=16),
                                    host_measured={**fast, "full": h200.host_update["full"] / 2})
    fast_host = dataclasses.replace(slow_host, host_measured=fast)
    assert for_machine(CFG, e, 2, 2048, fast_host).busy["host"] < for_machine(CFG, e, 2, 2048, slow_host).busy["host"]
    assert for_machine(CFG, e, 2, 2048, Machine(None, None, gpu_name="NVIDIA H200", host_cores=16)).busy["host"] == \
        pytest.approx(predict(CFG, e, 2, 2048, h200).busy["host"])  # not measured: the record's
    # the record of the prediction keeps the timed rates, and the study predicts the run again from them
    record = for_machine(CFG, e, 2, 2048, fast_host).as_dict()
    assert record["host_measured"]["full"] == pytest.approx(fast["full"], rel=1e-3)
    assert "host_measured" not in predict(CFG, e, 2, 2048, h200).as_dict()
    spec = importlib.util.spec_from_file_location("step_time_vs_runs", STUDY)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    run = {"host_cores": 16, "host_measured": study._host_measured(record)}
    assert study._speeds_for(run, h200).host_update["full"] == pytest.approx(fast["full"], rel=1e-3)
    assert study._speeds_for(run, h200, measured=False) is h200
    assert study._host_measured(predict(CFG, e, 2, 2048, h200).as_dict()) is None


def test_a_slow_timing_is_taken_again_and_the_fastest_kept(monkeypatch):
    """A start's timing under SLOW_HOST of the kind's measured host is taken again after a pause, up to
    SLOW_TIMING_RETAKES times until one is not slow, and the fastest kept: low readings came and went a second or
    two apart on hosts whose steps ran at the usual pace; a host that times slow every time is slow (its note
    stays)."""
    from megatrain_jax.plan import machine as machine_mod
    from megatrain_jax.plan.step_time import slow_host
    usual = {"full": 3.6e9, "lean": 6.5e9, "first_half_share": 0.45, "one_pass_speedup": 1.6}
    low = dict(usual, full=2.0e9)
    monkeypatch.setattr(machine_mod, "gpu_name_before_jax", lambda: "NVIDIA H200")
    monkeypatch.setattr(machine_mod.time, "sleep", lambda s: None)
    assert slow_host("NVIDIA H200", 16, low) is not None and slow_host("NVIDIA H200", 16, usual) is None
    lower, low_again = dict(low, full=1.9e9), dict(low, full=2.05e9)
    assert machine_mod.SLOW_TIMING_RETAKES == 3
    for readings, kept, calls in (([usual], usual, 1), ([low, usual], usual, 2),
                                  ([low, lower, usual], usual, 3),  # stops at the first reading not slow
                                  ([low, lower, low_again, lower], low_again, 4)):  # slow every time: the fastest
        queue = list(readings)
        monkeypatch.setattr(machine_mod, "kernel_rates", lambda: queue.pop(0))
        monkeypatch.setattr(machine_mod.os, "sched_getaffinity", lambda pid: set(range(16)))
        machine_mod.measured_host_update.cache_clear()
        assert Machine.here(host_ram_bytes=1, gpu_bytes=1).host_measured == kept
        assert len(readings) - len(queue) == calls
        assert Machine.here(host_ram_bytes=1, gpu_bytes=1).host_measured == kept  # once a process
        assert len(readings) - len(queue) == calls
    machine_mod.measured_host_update.cache_clear()


def test_machine_here_times_the_host_update_only_where_the_plan_is_for_this_host_and_no_file_wins(monkeypatch,
                                                                                                  tmp_path, capsys):
    """``Machine.here`` times the host update where a GPU is (the plan is then for this host); not with no GPU,
    with the distributed runtime (several processes on one host), with ``time_host`` off (``plan --gpu``: another
    machine's plan) or with a calibration file (it wins); ``plan --gpu`` on a machine with a GPU predicts with
    that GPU's record, not with this host's timing."""
    from megatrain_jax.plan import machine as machine_mod
    timed = {"full": 3.3e9, "lean": 6e9, "first_half_share": 0.43, "one_pass_speedup": 1.5}
    calls = []
    monkeypatch.setattr(machine_mod, "measured_host_update", lambda *args: calls.append(1) or timed)
    monkeypatch.setattr(machine_mod, "gpu_name_before_jax", lambda: None)
    assert Machine.here(host_ram_bytes=1, gpu_bytes=1).host_measured is None and not calls
    monkeypatch.setattr(machine_mod, "gpu_name_before_jax", lambda: "NVIDIA H200")
    assert Machine.here(host_ram_bytes=1, gpu_bytes=1).host_measured == timed and calls == [1]
    assert Machine.here(host_ram_bytes=1, gpu_bytes=1, several_processes=True).host_measured is None
    assert Machine.here(host_ram_bytes=1, gpu_bytes=1, time_host=False).host_measured is None
    monkeypatch.setenv("MEGATRAIN_SPEEDS", str(tmp_path / "speeds.json"))
    assert Machine.here(host_ram_bytes=1, gpu_bytes=1).host_measured is None
    assert calls == [1]
    monkeypatch.delenv("MEGATRAIN_SPEEDS")
    config = tmp_path / "run.toml"
    config.write_text('[model]\npreset = "tiny"\n')
    assert main(["plan", "--config", str(config), "--host-gib", "64", "--gpu-gib", "80", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "predicted step: " in out and "measured here" not in out and calls == [1], out


def test_every_gpu_kind_and_measured_host_has_a_host_update_rate_for_every_precision_mode():
    """The step-time model asks each record for the rate of the mode a run picks: none may be missing (a new mode
    is one precision record and one rate per host), and m7v5 runs at its ratio to the 8-bit kernel, as the two
    kernels measured alone on both H200 hosts (each format's block, every core, the working tree's build)."""
    from megatrain_jax.engine.precision import MODES
    from megatrain_jax.engine.update.m7v5 import M7V5_BLOCK
    from megatrain_jax.engine.update.q8 import Q8_BLOCK
    from megatrain_jax.plan.speeds import M7V5_OVER_Q8
    for kind, speeds in SPEEDS.items():
        for host in (None, *speeds.hosts):
            rates = speeds.on_host(host)
            for mode in MODES:
                assert rates.host_update_rate(mode) > 0, (kind, host, mode)
    for host in (None, 32):
        rates = SPEEDS["H200"].on_host(host).host_update
        assert rates["m7v5"] == pytest.approx(rates["q8"] * M7V5_OVER_Q8)
    results = Path(__file__).resolve().parents[1] / "experiments" / "results"
    for name in ("h200_host_kernel_ab_8645a2f.json", "h200x2_host_kernel_ab_8645a2f.json"):
        runs = json.loads((results / name).read_text())["runs"]
        cores = max(r.get("threads", 0) for r in runs)

        def median(fmt, block):
            rates = sorted(r["params_per_s"] for r in runs if r.get("build") == "tree" and r["threads"] == cores
                           and r["system"] == f"{fmt}_kernel_bf16_grad" and r["block"] == block)
            return rates[len(rates) // 2]
        assert median("m7v5", M7V5_BLOCK) / median("q8", Q8_BLOCK) == pytest.approx(M7V5_OVER_Q8, abs=0.02), name


def test_gradients_that_wait_on_the_gpu_come_home_with_their_update_unsplit():
    """``grads_on_gpu`` parts send nothing at their backward; their update copies the float32 gradient home and
    runs whole (the engine never splits it): a step's bytes home are the same, its host work changes."""
    plain = EngineConfig(micro_batches=1, stream_dtype="bfloat16")
    waiting = dataclasses.replace(plain, grads_on_gpu=4)
    n = lengths(CFG, waiting, 8, 2048, H100)
    assert [p for p, b in n.grads.items() if b == 0 and not p.is_io][:4] == [PartId.block(i) for i in range(4)]
    assert set(n.home) == {PartId.block(i) for i in range(4)}
    assert all(n.host_update[PartId.block(i)][1] == 0 for i in range(4)) and n.host_update[PartId.block(5)][1] > 0
    a, b = predict(CFG, plain, 8, 2048, H100), predict(CFG, waiting, 8, 2048, H100)
    assert a.d2h_bytes == b.d2h_bytes and a.seconds != b.seconds


def test_accumulated_gradients_go_back_to_the_gpu_to_be_added():
    one = predict(CFG, EngineConfig(micro_batches=1), 4, 2048, QUIET)
    two = predict(CFG, EngineConfig(micro_batches=1, accumulate_steps=2), 4, 2048, QUIET)
    assert two.d2h_bytes == 2 * one.d2h_bytes  # each sub-step's sum goes home
    assert two.h2d_bytes == 2 * one.h2d_bytes + one.d2h_bytes  # weights twice, and the first sum comes back


def test_a_calibration_file_refuses_flags_and_non_finite_rates(tmp_path):
    f = tmp_path / "speeds.json"
    for bad in ({"h2d_bytes": True}, {"hbm_bytes": float("inf")}, {"host_update": {"full": float("nan")}}):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="positive number"):
            from_file(f, H100)


def test_a_host_bound_step_splits_fewer_updates_and_a_gpu_bound_one_all():
    """``split_parts`` "auto": where the host update bounds the step (few rows), some parts update in one pass
    (fewer bytes; the short backward hides only a few second passes), and the pick is the fastest count; where
    the GPU bounds it (many rows), every part splits. Without a GPU to plan for it stays "auto"."""
    from megatrain_jax.plan import resolve
    cfg = preset("7b", layers=16, vocab_size=32000)
    e = EngineConfig(micro_batches=1, resident_layers=0, kept_layers="auto", keep_residuals=True)
    machine = Machine(118 * 2**30, 132 * 2**30, gpu_name="NVIDIA H200")
    small = resolve(cfg, e, 4, 2048, machine)
    k = small.engine_cfg.split_parts
    assert isinstance(k, int) and 0 <= k < cfg.layers + 1
    assert "engine.split_parts='auto'" in small.said, small.said
    times = [predict(cfg, dataclasses.replace(small.engine_cfg, split_parts=j), 4, 2048, SPEEDS["H200"]).seconds
             for j in range(cfg.layers + 2)]
    assert times[k] == min(times) and times[k] < times[-1]
    long = resolve(cfg, e, 16, 2048, machine).engine_cfg
    assert long.split_parts == cfg.layers + 1
    assert resolve(cfg, e, 4, 2048, Machine(118 * 2**30, None)).engine_cfg.split_parts == "auto"


def test_an_update_in_one_pass_runs_at_its_own_rate():
    """A part left whole by ``split_parts`` takes its mode's rate times ``one_pass_speedup``, in the first
    half's slot (the next forward waits for all of it); a split one, the two halves at the mode's rate."""
    e = EngineConfig(micro_batches=1, stream_dtype="bfloat16", split_parts=3)
    n = lengths(CFG, e, 8, 2048, H100)
    whole, split = n.host_update[PartId.block(0)], n.host_update[PartId.block(7)]
    count = CFG.block_param_count(0)
    assert whole[1] == 0 and math.isclose(whole[0], count / (H100.host_update["full"] * H100.one_pass_speedup))
    assert math.isclose(sum(split), count / H100.host_update["full"])
    assert [p for p, (a, b) in n.host_update.items() if b > 0] == [PartId.block(i) for i in (5, 6, 7)]


def test_auto_layout_is_timed_with_the_lean_host_layout_when_nothing_fits_as_configured():
    """With the GPU's rates known but a host too small for any layout as configured, the host's lean layout is
    made first and the "auto" fields are then picked by the step-time model with it: the pick is ``fastest``'s
    over the lean config on the host less the lean pick's margin, it fits there, and the sentence says both; where
    even the lean layout leaves nothing to time, "auto" keeps no products and says that nothing fit (not that
    rates are missing)."""
    from megatrain_jax.plan import plan, resolve
    from megatrain_jax.plan.layout import LEAN_HOST_MARGIN, fastest
    cfg = preset("7b", layers=32, vocab_size=32000)
    e = EngineConfig(micro_batches=1, resident_layers=0, kept_layers="auto")
    machine = Machine(125 * 2**30, 133 * 2**30, gpu_name="NVIDIA H200")
    kw = dict(host_ram_bytes=machine.host_ram_bytes, gpu_bytes=machine.gpu_bytes)
    assert fastest(cfg, e, 4, 2048, SPEEDS["H200"], **kw)[1] is None  # nothing fits as configured
    picked = resolve(cfg, e, 4, 2048, machine)
    lean = picked.engine_cfg
    assert lean.stream_dtype == "float32" and "host RAM is short" in picked.said, picked.said
    again = dataclasses.replace(lean, kept_layers="auto", split_parts="auto")
    room = dict(kw, host_ram_bytes=int(kw["host_ram_bytes"] * (1 - LEAN_HOST_MARGIN)))  # the lean pick's margin
    best, said = fastest(cfg, again, 4, 2048, SPEEDS["H200"], **room)
    assert said is not None and lean.kept_layers == best.kept_layers > 0, (lean, best)
    assert said.split(" (")[0] in picked.said and "no layout fits" not in picked.said
    assert plan(cfg, lean, 4, 2048, detect=False, **room).fits
    short = resolve(cfg, e, 4, 2048, Machine(40 * 2**30, 133 * 2**30, gpu_name="NVIDIA H200")).said
    assert "no layout fits host and GPU as configured" in short and "no rates" not in short, short


def test_packed_rows_cost_their_runs_attention_where_cudnn_packs_them():
    """Packed rows attend within each run (documents, and the padding as one more): at a span of 512 keys a token
    the blocks' attention is 512/4096 of whole rows' (the products unchanged), the step shorter by that, and the
    prediction says so; a span past the row counts as the row. On a GPU without cuDNN's packed layout (Ada: XLA's
    masked attention), or for a model cuDNN does not take (float32), whole rows are counted."""
    cfg = preset("7b", layers=4, vocab_size=32000)
    e = EngineConfig(micro_batches=1, resident_layers=4, kept_layers=0)
    h200 = SPEEDS["H200"]
    whole, packed = (lengths(cfg, e, 8, 4096, h200, mix=m) for m in (None, RowMix(512)))
    attn = 2.0 * cfg.heads * cfg.dim_per_head * 4096 * 8 * 4096  # whole rows, one block's forward
    assert math.isclose(whole.forward[0] - packed.forward[0], attn * (1 - 512 / 4096) / h200.attention_flops)
    assert lengths(cfg, e, 8, 4096, h200, mix=RowMix(10**6)).forward == whole.forward
    for no_packing in (lengths(cfg, e, 8, 4096, SPEEDS["RTX 4090"], mix=RowMix(512)),
                       lengths(dataclasses.replace(cfg, dtype="float32"), e, 8, 4096, h200, mix=RowMix(512))):
        assert no_packing.mix is None
    assert SPEEDS["L40S"].packed_flash is False and SPEEDS["H100"].packed_flash and SPEEDS["GH200"].packed_flash
    a, b = (predict(cfg, e, 8, 4096, h200, mix=m) for m in (None, RowMix(512)))
    assert b.seconds < a.seconds and a.mix is None and b.mix == RowMix(512)
    assert b.as_dict()["attention_span"] == 512 and "attention_span" not in a.as_dict()
    assert "packed rows' attention within their runs, 512 keys a token" in b.describe()
    rtx = predict(cfg, e, 8, 4096, SPEEDS["RTX 4090"], mix=RowMix(512))
    assert rtx.mix is None and "packed rows" not in rtx.describe()


def test_tokens_no_loss_reaches_shorten_the_blocks_backward_by_the_gpus_measured_share():
    """A share of the rows' tokens no loss reaches (their gradients zeros) shortens every block's backward, kept
    or recomputing, by ``Speeds.no_gradient_backward`` times that share, and nothing else (forward, head,
    transfers); the prediction records and says it. A GPU without a measured share (0: the H100's record, the
    workstation cards) predicts, records and says nothing of it; a calibration file may set it, from 0 up to 1."""
    cfg = preset("7b", layers=4, vocab_size=32000)
    e = EngineConfig(micro_batches=1, resident_layers=4, kept_layers=2)
    h200 = SPEEDS["H200"]
    assert h200.no_gradient_backward == 0.12 and SPEEDS["H100"].no_gradient_backward == 0.0
    all_in, most_out = (lengths(cfg, e, 8, 4096, h200, mix=m) for m in (None, RowMix(None, 0.89)))
    for i in range(cfg.layers):
        assert math.isclose(most_out.backward[i], all_in.backward[i] * (1 - 0.12 * 0.89))
        assert most_out.forward[i] == all_in.forward[i]
    assert most_out.head == all_in.head and most_out.fetch == all_in.fetch
    a, b = (predict(cfg, e, 8, 4096, h200, mix=m) for m in (None, RowMix(None, 0.89)))
    assert b.seconds < a.seconds and b.as_dict()["no_gradient"] == 0.89 and "no_gradient" not in a.as_dict()
    assert "89% of the rows' tokens reached by no loss" in b.describe()
    h100 = SPEEDS["H100"]
    c = predict(cfg, e, 8, 4096, h100, mix=RowMix(None, 0.89))
    assert c.seconds == predict(cfg, e, 8, 4096, h100).seconds and c.mix is None and "no loss" not in c.describe()

def test_a_norm_first_step_runs_two_passes_and_updates_beside_the_second_backward():
    """The two-pass step: the weights cross PCIe once more for the second backward (every part), the gradients
    come home once, the GPU computes the first pass and the second's head and backward (no forward), no update
    splits; on a host-bound step the updates start in the second backward (each as its gradient is home), so the
    step is shorter than the two passes and the host's work put end to end."""
    one = EngineConfig(micro_batches=1)
    two = dataclasses.replace(one, norm_first=True)
    a, b = predict(CFG, one, 4, 2048, QUIET), predict(CFG, two, 4, 2048, QUIET)
    n = lengths(CFG, two, 4, 2048, QUIET)
    assert b.h2d_bytes == a.h2d_bytes + sum(n.fetch.values()) and b.d2h_bytes == a.d2h_bytes
    assert all(second == 0 for _, second in n.host_update.values())  # never split
    forward = sum(n.forward[i] for i in range(CFG.layers)) + n.embed
    assert b.busy["gpu"] == pytest.approx(2 * a.busy["gpu"] - forward + sum(n.norm.values()), rel=1e-6)
    slow = QUIET.replace(host_update={**QUIET.host_update, "full": 3e9})
    p = predict(CFG, two, 4, 2048, slow)
    assert p.bound in ("host", "memory")
    assert p.seconds < p.busy["host"] + p.busy["gpu"]  # the second backward hides part of the host's work



def test_workstation_gpus_have_rates_predicted_from_their_specifications(capsys):
    """Issue 53's workstation cards: their names map to records (marked as predictions, PCIe Gen4, a desktop host
    at about half the H200 host's update rate), and ``plan --gpu`` predicts a step with them."""
    from megatrain_jax.plan.speeds import kind_of
    assert kind_of("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert kind_of("NVIDIA RTX 6000 Ada Generation") == "RTX 6000 ADA" and kind_of("NVIDIA L40S") == "L40S"
    card = SPEEDS["RTX 4090"]
    assert "predicted from specifications" in card.name and card.h2d_bytes == 25e9
    assert card.host_update["full"] < SPEEDS["H200"].host_update["full"]
    main(["plan", "model.preset=llama3.1-8b", "data.seq_len=2048", "data.batch_size=8", "engine.micro_batches=2",
          "engine.master_dtype=bfloat16", "engine.stream_dtype=bfloat16", "engine.resident_layers=0",
          "--host-gib", "128", "--gpu-gib", "24", "--gpu", "RTX 4090"])
    out = capsys.readouterr().out
    assert "predicted step: " in out and "RTX 4090 (24 GB)" in out and "fits" in out, out


def test_plan_for_a_named_gpu_plans_its_memory_unless_told(capsys, monkeypatch):
    """``plan --gpu NAME`` without ``--gpu-gib`` plans the GPU side for that card's memory (not this machine's GPU,
    nor none): an 8B model with 20 blocks resident fits an H200's 140 GiB and not a 24 GB RTX 4090; ``--gpu-gib``
    still wins, and on a machine with that GPU its own reading is kept."""
    from megatrain_jax.plan import machine as machine_mod
    monkeypatch.setattr(machine_mod, "gpu_name_before_jax", lambda: None)
    run = ["plan", "model.preset=llama3.1-8b", "data.seq_len=2048", "data.batch_size=8", "engine.resident_layers=20",
           "--host-gib", "256"]
    assert main(run + ["--gpu", "RTX 4090"]) == 1
    out = capsys.readouterr().out
    assert "GPU of 24 GiB (the RTX 4090's; --gpu-gib for another)" in out and "no limit known" not in out, out
    assert main(run + ["--gpu", "H200"]) == 0
    assert "GPU of 140.4 GiB (the H200's" in capsys.readouterr().out
    assert main(run + ["--gpu", "RTX 4090", "--gpu-gib", "140"]) == 0
    out = capsys.readouterr().out
    assert "GPU of 140 GiB:" in out and "the RTX 4090's" not in out
    monkeypatch.setattr(machine_mod, "gpu_name_before_jax", lambda: "NVIDIA H200")
    monkeypatch.setattr(machine_mod, "measured_host_update", lambda *args: None)
    main(run + ["--gpu", "H200"])
    assert "GPU of" not in capsys.readouterr().out  # this machine's own H200: its reading (Machine.here's)


def test_plan_on_a_24_gb_gpu_with_64_gb_of_ram_says_what_fits_and_what_does_not(capsys):
    """An 8B model on a 24 GB card with 64 GB of RAM: the plan says the run as configured does not fit, how much
    each precision mode needs (the leanest's host RAM within 64 GiB), and never a negative shortfall."""
    status = main(["plan", "model.preset=llama3.1-8b", "data.seq_len=2048", "data.batch_size=8",
                   "engine.micro_batches=2", "--host-gib", "64", "--gpu-gib", "24", "--gpu", "RTX 4090"])
    out = capsys.readouterr().out
    assert status == 1 and "does not fit." in out  # exit status 1: it does not fit as configured
    modes = {line.strip().split("  ")[0]: line for line in out.splitlines() if "B/param" in line and "GiB host" in line}
    assert "does not fit: host RAM short by" in modes["full precision (this run)"]
    assert modes["capacity mode with 8-bit moments"].endswith("fits")
    assert modes["capacity mode with 7-bit m and 5-bit v"].endswith("fits")
    assert "options that fit" in out and "engine.moment_dtype=m7v5" in out and "short by -" not in out


def test_the_layout_search_casts_the_resident_copies_where_more_resident_blocks_are_faster():
    """``resident_copy`` "auto" with the layout: 13B at 8K tokens on one H200 of a 32-core host is bound by the
    host update, so the resident blocks' copies are cast at each fetch, which leaves room for more of them;
    3.5B at 8K fits on the GPU with its copies, so they are kept (a cast at each fetch would only cost)."""
    from megatrain_jax.plan.counts import GiB
    from megatrain_jax.plan.layout import fastest
    e = EngineConfig(micro_batches=1, resident_layers="auto", kept_layers="auto", resident_io=True,
                     keep_residuals=True, prefetch_depth=2, host_grad_dtype="bfloat16")
    big, x2 = preset("llama2-13b"), SPEEDS["H200"].on_host(32)
    kw = dict(host_ram_bytes=240 * GiB, gpu_bytes=int(126.4 * GiB))
    cast, said = fastest(big, e, 4, 2048, x2, **kw)
    kept, _ = fastest(big, dataclasses.replace(e, resident_copy=True), 4, 2048, x2, **kw)
    assert cast.resident_copy is False and "cast at each fetch" in said, said
    assert kept.resident_copy is True and cast.resident_layers > kept.resident_layers
    assert predict(big, cast, 4, 2048, x2).seconds < predict(big, kept, 4, 2048, x2).seconds
    small, said = fastest(preset("7b", layers=16), e, 4, 2048, SPEEDS["H200"], host_ram_bytes=125 * GiB,
                          gpu_bytes=int(132.8 * GiB))
    assert small.resident_copy is True and "copies kept" in said, said


def test_the_rate_sweep_counts_what_the_study_counts(tmp_path, monkeypatch):
    """studies/step_time_rate_sweep.py: its base row is the study's own count of H200 runs within 10% at the
    record's rates, and each swept value changes only its field."""
    monkeypatch.syspath_prepend(str(STUDY.parent))  # child.py, step_time_vs_runs.py
    spec = importlib.util.spec_from_file_location("step_time_rate_sweep", STUDY.parent / "studies" /
                                                  "step_time_rate_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    monkeypatch.setattr(sweep, "SWEEPS", [("matmul_flops", [SPEEDS["H200"].matmul_flops, 1e14])])
    record = sweep.main(["--out", str(tmp_path / "sweep.json"), "--work", "none"])  # packed runs at whole rows
    base, same, slow = record["runs"]
    rs = [r for r in sweep.study.runs() if r["kind"] == "H200" and not r["older"]]
    errs = sweep.study.errors(rs, SPEEDS["H200"])
    assert base["all"]["within_10pct"] == sum(abs(e) <= 0.10 for e in errs) and base["all"]["runs"] == len(rs)
    assert same["all"] == base["all"] and slow["all"]["within_10pct"] < base["all"]["within_10pct"]
    assert json.loads((tmp_path / "sweep.json").read_text())["command"].startswith(
        "PYTHONPATH=. python experiments/studies/step_time_rate_sweep.py")


def test_train_says_so_where_the_host_timed_itself_far_under_its_kinds_record():
    """A host that times its update under ``SLOW_HOST`` of what the measured host of its kind nearest in cores
    timed (another process using its cores, as on one loan of an H200: 1.61 G params/s against 3.00) gets a note
    beside the predicted step, with both rates; a host at its record's pace, one not timed, one of cores no host was
    measured at but timing as the nearest measured one (128: the 64-core host's, not scaled by cores), and a card
    whose record comes from specification sheets get none."""
    e = EngineConfig(resident_layers=0)
    rates = {"full": 3.3e9, "lean": 5.5e9, "first_half_share": 0.43, "one_pass_speedup": 1.5}
    quiet = Machine(None, None, gpu_name="NVIDIA H200", host_cores=16, host_measured=rates)
    busy = dataclasses.replace(quiet, host_measured={**rates, "full": 1.61e9})
    assert "note" not in step_time.step_line(for_machine(CFG, e, 2, 2048, quiet), 4096, quiet)
    line = step_time.step_line(for_machine(CFG, e, 2, 2048, busy), 4096, busy)
    assert "note: the host update timed at 1.61 G params/s" in line and "of the 3.00 measured" in line
    untimed = dataclasses.replace(quiet, host_measured=None)
    assert "note" not in step_time.step_line(for_machine(CFG, e, 2, 2048, untimed), 4096, untimed)
    x4 = SPEEDS["H200"].hosts[64]["host_update"]["full"]
    wide = Machine(None, None, gpu_name="NVIDIA H200", host_cores=128, host_measured={**rates, "full": x4})
    assert step_time.slow_host(wide.gpu_name, 128, wide.host_measured) is None
    assert step_time.slow_host(wide.gpu_name, 128, {**rates, "full": 0.6 * x4}) == pytest.approx(x4)
    assert step_time.slow_host("NVIDIA GeForce RTX 4090", 16, {**rates, "full": 0.1e9}) is None


def test_a_sustained_timing_is_the_mean_over_at_least_the_calls_and_the_window_asked():
    """``host_kernel.sustained_seconds``: one untimed call first, then back-to-back calls until both the count and
    the window are reached; the mean a call (a long run of updates' rate), not the fastest call's: calls of 1 and
    5 ms in turn time at about 3 ms, not 1."""
    import time
    from megatrain_jax.engine.update.host_kernel import sustained_seconds
    calls = []
    took = sustained_seconds(lambda: (calls.append(None), time.sleep(0.001 if len(calls) % 2 else 0.005)),
                             calls=3, window=0.04)
    assert len(calls) >= 1 + 3 and 0.0025 < took < 0.02
    calls.clear()
    sustained_seconds(lambda: calls.append(None), calls=7, window=0.0)
    assert len(calls) == 8  # the untimed call and the seven asked
    with pytest.raises(ValueError, match="at least one timed call"):
        sustained_seconds(lambda: None, calls=0, window=0.0)
