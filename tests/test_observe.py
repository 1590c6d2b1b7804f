"""Evaluation from the streamed host state, and the observers: progress, metrics.jsonl, TensorBoard, W&B, plot."""

from __future__ import annotations

import io
import json
import struct
import sys
import time
import types

import numpy as np
import pytest

from megatrain_jax import Batch, Engine, EngineConfig, TrainConfig, adamw, fit
from megatrain_jax.evaluate import eval_hook, evaluate
from megatrain_jax.observe import (JsonlWriter, Progress, TensorBoardWriter, WandbLogger, plot_run, read_metrics,
                                   system_stats)
from megatrain_jax.reference import model_loss

SEQ = 32


def batches_of(tokens, n: int, rows: int, vocab: int, seed: int = 0, masked: bool = False) -> list[Batch]:
    out = []
    for i in range(n):
        t = tokens(rows, SEQ + 1, vocab, seed=seed + i)
        mask = None
        if masked:  # some rows and tokens excluded, as padded eval batches have
            mask = np.ones((rows, SEQ), np.float32)
            mask[-1] = 0.0
            mask[0, : SEQ // 2] = 0.0
        out.append(Batch(t[:, :-1], t[:, 1:], loss_mask=mask))
    return out


def reference_loss(model, batches: list[Batch]) -> float:
    """Token-weighted mean of the whole-model loss over batches."""
    total = count = 0.0
    for b in batches:
        f = b.filled()
        n = float(f.loss_mask.sum())
        total += float(model_loss(model, f)) * n
        count += n
    return total / count


# ------------------------------------------------------------------------------------------ evaluation
def test_evaluate_matches_the_reference_loss(tiny_cfg, build_model, tokens):
    model = build_model(tiny_cfg)
    eval_b = batches_of(tokens, 3, 4, tiny_cfg.vocab_size, seed=10, masked=True)
    engine = Engine(model, adamw(1e-2), EngineConfig(micro_batches=2))
    got = evaluate(engine, eval_b)
    want = reference_loss(model, eval_b)
    assert got["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert got["eval_ppl"] == pytest.approx(np.exp(want), rel=1e-5)
    assert got["eval_tokens"] == int(sum(b.filled().loss_mask.sum() for b in eval_b))
    # after a training step it reads the updated host state
    engine.step(batches_of(tokens, 1, 4, tiny_cfg.vocab_size)[0])
    engine.write_back(model)
    after = evaluate(engine, eval_b)
    assert after["eval_loss"] != pytest.approx(got["eval_loss"], rel=1e-6)
    assert after["eval_loss"] == pytest.approx(reference_loss(model, eval_b), rel=1e-5)


def test_evaluate_needs_batches(tiny_cfg, build_model):
    engine = Engine(build_model(tiny_cfg), adamw(1e-2))
    with pytest.raises(ValueError, match="no batches"):
        evaluate(engine, [])


def test_eval_hook_evaluates_the_parameters_of_its_step(tiny_cfg, build_model, tokens):
    train_b = batches_of(tokens, 5, 4, tiny_cfg.vocab_size)
    eval_b = batches_of(tokens, 1, 4, tiny_cfg.vocab_size, seed=50)
    h5 = fit(build_model(tiny_cfg), train_b, adamw(1e-2), train=TrainConfig(steps=5, log_every=0),
             hooks=[eval_hook(eval_b, 2, 5)], write_back=False)
    evals = {r["step"]: r["eval_loss"] for r in h5.records if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 5]
    h2 = fit(build_model(tiny_cfg), train_b[:2], adamw(1e-2), train=TrainConfig(steps=2, log_every=0), write_back=False)
    assert evaluate(h2.engine, eval_b)["eval_loss"] == pytest.approx(evals[2], rel=1e-6)
    assert evaluate(h5.engine, eval_b)["eval_loss"] == pytest.approx(evals[5], rel=1e-6)


# ------------------------------------------------------------------------------------------ writers
def test_jsonl_writer_and_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    for s in (1, 2, 3):
        w.write({"step": s, "loss": 1.0 / s, "grad_norm": np.float32(0.5), "nonfinite": float("nan"),
                 "skipped": False, "obj": object()})
    w.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["grad_norm"] == 0.5 and records[0]["nonfinite"] == "nan" and "obj" not in records[0]
    assert "time" in records[0] and records[0]["elapsed_s"] == 0.0
    # a resumed run from step 2 goes on from step 1's record, kept as it was; the whole file is kept aside first
    before = path.read_text()
    w = JsonlWriter(path, append=True)
    assert w.moved_aside is None and path.read_text() == before  # nothing changes before the first record
    w.write({"step": 2, "loss": 9.0})
    w.close()
    records = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 9.0)]
    assert path.read_text().startswith(before.splitlines(keepends=True)[0])
    assert w.moved_aside == tmp_path / "metrics.1.jsonl" and w.moved_aside.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.1.jsonl", "metrics.jsonl"]  # no temporary left
    w = JsonlWriter(path, append=True)  # nothing to replace: appended after the last record, nothing moved
    w.write({"step": 3, "loss": 8.0})
    w.close()
    assert w.moved_aside is None and [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # a run killed mid-line
    w = JsonlWriter(path, append=True)
    w.write({"step": 4, "loss": 7.0})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4] and w.moved_aside == tmp_path / "metrics.2.jsonl"
    assert w.moved_aside.read_text().endswith('{"step": 4, "lo')
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nowhere")


def test_system_stats_report_host_memory():
    stats = system_stats()
    assert stats["host_peak_rss_gib"] > 0.01
    # the resident set now, by kind (Linux): this process's own arrays and its mapped files
    import mmap

    import numpy as np
    before = system_stats()["host_rss_anon_gib"]
    # 64 MiB of private anonymous memory in a mapping of its own, touched: new pages (a numpy array may take
    # memory the allocator kept resident from earlier tests; mmap's default mapping is shared, which counts as
    # RssShmem). In small pages: the counts /proc/self/status shows may lag a few huge pages' faults.
    area = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    block = np.frombuffer(area, np.float64)
    block[:] = 1.0
    after = system_stats()["host_rss_anon_gib"]
    assert after - before > 0.05 and stats["host_rss_file_gib"] > 0 and block.sum() > 0
    del block
    assert after <= system_stats()["host_peak_rss_gib"] + 1e-9


def metrics(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "lr": 1e-3, "tokens": 2048,
            "tokens_per_s": 1e5 + step, "model_tflops": 0.2, "step_time_s": 0.02, **extra}


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(total=4, log_every=2, mode="auto", stream=out)
    for s in range(1, 5):
        p(metrics(s, **({"eval_loss": 2.0, "eval_ppl": 7.39, "eval_tokens": 128, "eval_s": 0.1} if s == 4 else {})))
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("step")] == ["1/4", "2/4", "4/4"]
    assert "ETA" in lines[1] and "tok/s" in lines[1] and "lr 1.00e-03" in lines[1]
    assert lines[-1].startswith("eval      4  eval_loss 2.0000  ppl 7.39")


def test_progress_lines_name_the_rate_in_the_loss_where_tokens_are_out_of_it():
    """A step with tokens out of the loss (padding, prompts: ``loss_tokens`` < ``tokens``) prints the rate of those
    in it beside tok/s, at the median rate's share; a step with all of them in the loss does not."""
    p = Progress(total=2, mode="lines", stream=io.StringIO())
    p(metrics(1, loss_tokens=512))
    assert f"({p.tokens_per_s() * 512 / 2048:,.0f} in the loss)" in p.line(metrics(1, loss_tokens=512))
    assert "in the loss" not in p.line(metrics(1, loss_tokens=2048)) and "in the loss" not in p.line(metrics(1))


def test_progress_bar_on_a_terminal():
    out = FakeTTY()
    p = Progress(total=4, log_every=100, mode="auto", stream=out)
    for s in range(1, 5):
        p(metrics(s))
    p.close()
    text = out.getvalue()
    assert "\r" in text and "4/4 [" in text and "100%" in text and "ETA" in text and text.endswith("\n")
    silent = io.StringIO()
    q = Progress(total=4, mode="off", stream=silent)
    q(metrics(1))
    q.close()
    assert silent.getvalue() == ""


def _read_events(path) -> list:
    from tensorboardX.proto import event_pb2
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
        at += 12 + n + 4
    return events


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboardX")
    w = TensorBoardWriter(tmp_path)
    assert w.backend == "tensorboardX"
    assert not list(tmp_path.iterdir())  # no event file before the first record: a run refused at start writes none
    w.write(metrics(1))
    w.write(metrics(2, eval_loss=2.5, eval_ppl=12.2, gpu_peak_gib=3.0))
    w.close()
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    scalars = {(v.tag, e.step): v.simple_value for e in _read_events(event_file) for v in e.summary.value}
    assert scalars[("train/loss", 1)] == pytest.approx(4.9)
    assert scalars[("eval/loss", 2)] == pytest.approx(2.5)
    assert ("perf/tokens_per_s", 2) in scalars and ("memory/gpu_peak_gib", 2) in scalars
    assert not any(tag in ("train/step", "train/tokens") for tag, _ in scalars)


def test_a_resumed_tensorboard_writer_marks_a_restart_at_its_first_step(tmp_path):
    """TensorBoard hides what earlier event files hold for the resumed run's steps (``purge_step``): one line, as in
    metrics.jsonl, the replaced records still in their file."""
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2
    w = TensorBoardWriter(tmp_path)
    for s in (1, 2, 3):
        w.write(metrics(s))
    w.close()
    time.sleep(1.1)  # event files are named by the second
    w = TensorBoardWriter(tmp_path)
    w.write(metrics(2))
    w.close()
    first, resumed = sorted(tmp_path.glob("events.out.tfevents.*"))
    starts = [e.step for e in _read_events(resumed) if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [2] and {e.step for e in _read_events(first) if e.summary.value} == {1, 2, 3}


def test_wandb_only_when_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    assert not WandbLogger.available()
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbLogger("p")
    logged, inits = [], []

    class Run:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            logged.append("finished")

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = WandbLogger("proj", "name", {"train": {"steps": 3}}, tmp_path)
    assert not inits  # no W&B run before the first record: a run refused at start makes none
    w.write(metrics(3, eval_loss=2.0))
    w.close()
    assert inits[0]["project"] == "proj" and inits[0]["config"] == {"train": {"steps": 3}}
    step, data = logged[0]
    assert step == 3 and data["loss"] == pytest.approx(4.7) and data["eval/loss"] == 2.0 and "step" not in data
    assert logged[-1] == "finished"


# ------------------------------------------------------------------------------------------ plot
def test_plot_run(tmp_path):
    pytest.importorskip("matplotlib")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 121):
            rec = metrics(s, loss=5.5 * np.exp(-s / 30) + 1.3)
            if s % 40 == 0:
                rec.update(eval_loss=5.5 * np.exp(-s / 30) + 1.2, eval_ppl=1.0)
            f.write(json.dumps(rec) + "\n")
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_plot_takes_a_metrics_file_and_says_what_another_file_is(tmp_path):
    pytest.importorskip("matplotlib")
    kept = tmp_path / "metrics.1.jsonl"  # kept aside by a resumed run
    kept.write_text("".join(json.dumps(metrics(s)) + "\n" for s in range(1, 4)))
    assert plot_run(kept) == tmp_path / "metrics.1.png"
    (tmp_path / "config.toml").write_text("[train]\nsteps = 3\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.toml'} is a file, not a run folder: plot takes a run "
                                         f"folder, .*megatrain-jax plot {tmp_path}\\)"):
        plot_run(tmp_path / "config.toml")


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install"):
        plot_run(tmp_path)
