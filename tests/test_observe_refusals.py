"""What a run reports and records, where things go wrong: plot of a folder with no metrics, of a damaged or
repeated history, to a path that cannot be written; the progress line of a resumed run and of skipped steps;
TensorBoard and W&B failing mid-run (the run goes on, said once); metrics that are numpy or JAX scalars."""

from __future__ import annotations

import io
import json
import sys
import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import Batch, TrainConfig, adamw, fit
from megatrain_jax.observe import JsonlWriter, Progress, TensorBoardWriter, WandbLogger, plot_run, read_metrics


def write_records(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def row(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "tokens": 2048, "tokens_per_s": 1e5,
            "model_tflops": 0.2, **extra}


# ------------------------------------------------------------------------------------------ plot: what it is given
def test_plot_of_a_path_that_does_not_exist_says_so(tmp_path):
    """Before: 'no metrics file at runs/typo', as if runs/typo were meant to be the file."""
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'typo'} does not exist: give a run folder"):
        plot_run(tmp_path / "typo")


def test_plot_of_a_folder_that_is_not_a_run_says_so(tmp_path, capsys):
    """Before: 'no metrics file at DIR/metrics.jsonl' and no word of why (not a run, or no step trained yet)."""
    from megatrain_jax.cli.commands import main
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no metrics file in {tmp_path}" in err and "not a run folder, or its run has not finished a step" in err


def test_plot_of_a_metrics_file_that_is_not_text_names_it(tmp_path):
    """Before: "'utf-8' codec can't decode byte 0x89 in position 0", naming no file."""
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=f"{tmp_path / 'metrics.jsonl'} is not a metrics file: it is not text"):
        plot_run(tmp_path)


def test_plot_with_nothing_finite_to_draw_says_so(tmp_path):
    """A run that diverged from its first step (every loss written "nan"): before, an empty PNG and a matplotlib
    warning; now a refusal that says why."""
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl", [{"step": s, "loss": "nan", "tokens_per_s": "inf"} for s in (1, 2)])
    with pytest.raises(ValueError, match="holds nothing to plot: none of its 2 records has a finite loss"):
        plot_run(tmp_path)
    assert not (tmp_path / "metrics.png").exists()


def test_plot_of_eval_rows_or_throughput_alone_draws_without_warnings(tmp_path):
    """Records with eval_loss and no train loss, or tokens/s alone: a plot, and no matplotlib warning (before:
    'No artists with labels found to put in legend' for the empty loss panel)."""
    pytest.importorskip("matplotlib")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_records(tmp_path / "metrics.jsonl", [{"step": s, "eval_loss": 3.0 - s / 10} for s in (10, 20, 30)])
        assert plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"
        write_records(tmp_path / "metrics.jsonl", [{"step": s, "tokens_per_s": 1e5 + s} for s in (1, 2, 3)])
        assert plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------ plot: where it goes
def test_plot_out_without_a_suffix_returns_the_file_written(tmp_path, capsys):
    """matplotlib adds .png to a name without one: before, plot said 'wrote DIR/curves', a file that is not there."""
    from megatrain_jax.cli.commands import main
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl", [row(s) for s in (1, 2, 3)])
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_out_to_a_folder_writes_the_default_name_in_it(tmp_path):
    """Before: matplotlib's IsADirectoryError."""
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl", [row(s) for s in (1, 2, 3)])
    (tmp_path / "figs").mkdir()
    assert plot_run(tmp_path, tmp_path / "figs") == tmp_path / "figs" / "metrics.png"
    assert (tmp_path / "figs" / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_out_in_a_missing_folder_says_so_before_drawing(tmp_path, capsys):
    """Before: '[Errno 2] No such file or directory: ...' from deep in matplotlib, saying nothing of what to do."""
    from megatrain_jax.cli.commands import main
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl", [row(s) for s in (1, 2, 3)])
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "no" / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"its folder {tmp_path / 'no'} does not exist; create the folder or give another path" in err, err


def test_a_plot_that_cannot_be_written_names_the_path_and_leaves_no_figure_open(tmp_path, monkeypatch):
    """A write refused (permission, full disk): the error names the file and says to give another path, and the
    figure is closed (before: left open in a caller that goes on, e.g. a notebook plotting many runs)."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    import matplotlib.pyplot as plt
    write_records(tmp_path / "metrics.jsonl", [row(s) for s in (1, 2, 3)])

    def refuse(self, fname, **kw):
        raise PermissionError(13, "Permission denied", str(fname))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refuse)
    plt.close("all")
    with pytest.raises(PermissionError, match="cannot be written there; give another path .*--out PATH") as e:
        plot_run(tmp_path)
    assert e.value.filename == str(tmp_path / "metrics.png") and plt.get_fignums() == []


# ------------------------------------------------------------------------------------------ a history written twice
def test_read_metrics_and_plot_show_each_step_once_the_latest(tmp_path):
    """A history with steps written again (an older version appended a resumed run's steps; files joined by hand):
    each step once, as last written, in step order. Before: [1, 2, 3, 2, 3, 4], a zigzag in the plot."""
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl",
                  [row(1), row(2), row(3), row(2, loss=9.0), row(3, loss=8.0), row(4)])
    records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 4.9), (2, 9.0), (3, 8.0), (4, 4.6)]
    assert plot_run(tmp_path).exists()


def test_a_resumed_run_over_repeated_steps_keeps_each_step_once(tmp_path, capsys):
    """Resuming at step 4 over such a history: metrics.jsonl holds steps 1 to 3 once each (the last written), then
    4; the file as it was is kept aside. Before: the repeated rows stayed, and nothing was kept aside."""
    path = tmp_path / "metrics.jsonl"
    write_records(path, [row(1), row(2), row(3), row(2, loss=9.0), row(3, loss=8.0)])
    before = path.read_text()
    w = JsonlWriter(path, append=True)
    w.write(row(4))
    w.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 4.9), (2, 9.0), (3, 8.0), (4, 4.6)]
    assert w.moved_aside == tmp_path / "metrics.1.jsonl" and w.moved_aside.read_text() == before
    assert "more than once" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ values
def test_numpy_and_jax_scalars_are_written_as_what_they_are(tmp_path):
    """A hook's numpy or JAX values: a flag stays a flag (before: np.bool_ was written 1.0), numbers are numbers,
    and each line is JSON that json.loads reads."""
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "flag": np.bool_(True), "jflag": jnp.asarray(False), "lr": np.float32(0.5),
             "n": np.int64(7), "x": jnp.float32(2.0), "bad": np.float32("nan")})
    w.close()
    (rec,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert rec["flag"] is True and rec["jflag"] is False and rec["lr"] == 0.5 and rec["n"] == 7
    assert rec["x"] == 2.0 and rec["bad"] == "nan"


def test_tensorboard_and_wandb_take_numpy_and_jax_numbers(tmp_path, monkeypatch):
    """Before: an ``np.float32`` or JAX scalar a hook added was written to metrics.jsonl but left out of TensorBoard
    and W&B without a word."""
    scalars, logged = [], []

    class Events:
        def add_scalar(self, name, value, step):
            scalars.append((name, value, step))

        def flush(self):
            pass

        def close(self):
            pass
    monkeypatch.setattr(TensorBoardWriter, "available", staticmethod(lambda: True))
    monkeypatch.setattr(TensorBoardWriter, "_open", lambda self, step: Events())
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: types.SimpleNamespace(log=lambda data, step: logged.append((step, data)),
                                                   finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    m = {"step": 1, "loss": 2.0, "my_metric": np.float32(0.25), "jax_metric": jnp.float32(0.5), "flag": np.bool_(1)}
    tb, wb = TensorBoardWriter(tmp_path), WandbLogger("p")
    tb.write(m)
    wb.write(m)
    tb.close()
    wb.close()
    assert {name for name, _, _ in scalars} == {"train/loss", "train/my_metric", "train/jax_metric"}
    assert logged == [(1, {"loss": 2.0, "my_metric": 0.25, "jax_metric": 0.5})]


# ------------------------------------------------------------------------------------------ a writer that fails
def test_tensorboard_failing_mid_run_is_said_once_and_the_run_goes_on(tiny_cfg, build_model, tokens, tmp_path,
                                                                     monkeypatch, capsys):
    """TensorBoard's event writer failing at step 2 (a broken protobuf, a full disk): before, fit raised and the run
    ended; now the run trains its steps, metrics.jsonl gets every one, and one line says TensorBoard stopped."""
    class Events:
        def add_scalar(self, name, value, step):
            if step >= 2:
                raise RuntimeError("event file writer died")

        def flush(self):
            pass

        def close(self):
            raise RuntimeError("event file writer died")
    monkeypatch.setattr(TensorBoardWriter, "_open", lambda self, step: Events())
    tb, jsonl = TensorBoardWriter(tmp_path), JsonlWriter(tmp_path / "metrics.jsonl")
    data = [Batch(t[:, :-1], t[:, 1:]) for t in (tokens(2, 9, tiny_cfg.vocab_size, seed=s) for s in range(4))]
    history = fit(build_model(tiny_cfg), data, adamw(1e-2), train=TrainConfig(steps=4, log_every=0),
                  hooks=[jsonl.hook(), tb.hook()], write_back=False)
    tb.close()
    jsonl.close()
    assert len(history) == 4 and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    err = capsys.readouterr().err
    assert err.count("logging stopped") == 1, err
    assert "TensorBoard" in err and "at step 2 (RuntimeError: event file writer died); the run goes on" in err


def test_tensorboard_that_cannot_start_is_said_once(tmp_path, monkeypatch, capsys):
    """The backend found but not importable (tensorboard with a protobuf it cannot use raises TypeError at import):
    before, the first step's hook raised and ended the run."""
    def broken(self, step):
        raise TypeError("Descriptors cannot be created directly.")
    monkeypatch.setattr(TensorBoardWriter, "_open", broken)
    w = TensorBoardWriter(tmp_path)
    for s in (1, 2, 3):
        w.write(row(s))
    w.close()
    err = capsys.readouterr().err
    assert err.count("logging stopped") == 1 and "at step 1 (TypeError: Descriptors" in err
    assert isinstance(w.failed, TypeError)


def test_wandb_failing_is_said_once_and_never_ends_the_run(monkeypatch, capsys):
    """wandb.init refused (no login, no network), or a log and then finish failing mid-run: before, the exception
    ended the run (or, from close() in the run's finally, hid how it ended); now one line, and nothing more to W&B."""
    fake = types.ModuleType("wandb")

    def no_login(**kw):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
    fake.init = no_login
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = WandbLogger("p")
    for s in (1, 2, 3):
        w.write(row(s))
    w.close()
    err = capsys.readouterr().err
    assert err.count("logging stopped") == 1 and "W&B logging stopped at step 1 (RuntimeError: api_key" in err

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(step)
            if step == 2:
                raise ConnectionError("network unreachable")

        def finish(self):
            raise ConnectionError("network unreachable")
    fake.init = lambda **kw: Run()
    w = WandbLogger("p")
    for s in (1, 2, 3):
        w.write(row(s))
    w.close()
    err = capsys.readouterr().err
    assert calls == [1, 2] and err.count("logging stopped") == 1 and "at step 2 (ConnectionError" in err


# ------------------------------------------------------------------------------------------ the progress line
def test_a_resumed_run_prints_its_first_step_at_once():
    """A run resumed at step 13 of 100 with log_every=10: before, no line until step 20 (on a log file: nothing
    for ten steps); now its first step's line, as a fresh run's step 1."""
    out = io.StringIO()
    p = Progress(total=100, log_every=10, mode="lines", stream=out)
    for s in (13, 14, 15):
        p(row(s))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step     13/100")
    assert "ETA" not in lines[0]  # one step seen: no rate to tell the rest by yet


def test_a_skipped_step_gets_a_line_that_says_so():
    """A step skipped as non-finite between log lines: before, nothing on screen (the next line showed a finite
    loss again); now a line of its own that says the update was not applied."""
    out = io.StringIO()
    p = Progress(total=100, log_every=10, mode="lines", stream=out)
    for s in range(1, 6):
        p(row(s, **({"loss": float("nan"), "grad_norm": float("inf"), "skipped": True} if s == 3 else
                    {"skipped": False})))
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/100", "3/100"]
    assert "loss nan" in lines[1] and "SKIPPED (loss or gradient norm not finite: no update)" in lines[1]
    assert "SKIPPED" not in lines[0]


def test_an_eval_loss_of_ones_own_hook_is_shown_without_a_perplexity():
    """A hook of one's own that adds eval_loss alone (``eval_hook`` adds eval_ppl too): before, a KeyError in the
    progress hook ended the run."""
    out = io.StringIO()
    p = Progress(total=10, mode="lines", stream=out)
    p(row(1, eval_loss=2.5))
    assert out.getvalue().splitlines()[-1].startswith("eval      1  eval_loss 2.5000  (0 tokens")


# ------------------------------------------------------------------------------------------ several processes
def test_only_process_0_writes_the_run_records(tmp_path, monkeypatch):
    """Under jax.distributed every process runs the same train command into the same run folder: before, each wrote
    metrics.jsonl (at a fresh start over each other's lines: a damaged file that plot and resume refuse), its own
    TensorBoard event file and its own W&B run. Now process 0 alone writes them."""
    import jax
    inits = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda data, step: None,
                                                                        finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    pytest.importorskip("tensorboardX")
    first = JsonlWriter(tmp_path / "metrics.jsonl")
    first.write(row(1))  # process 0
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    writers = [JsonlWriter(tmp_path / "metrics.jsonl"), TensorBoardWriter(tmp_path / "tb"), WandbLogger("p")]
    for s in (1, 2):
        for w in writers:
            w.write(row(s, dispatch_s=0.123456789))
    for w in writers:
        w.close()
    first.write(row(2))
    first.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert "dispatch_s" not in (tmp_path / "metrics.jsonl").read_text()
    assert not (tmp_path / "tb").exists() and not inits


def test_plot_out_with_a_trailing_slash_is_a_folder(tmp_path, capsys):
    """``--out nope/`` wrote ./nope.png; a trailing slash names a folder: refused where it does not exist, and the
    default name in it where it does."""
    from megatrain_jax.cli.commands import main
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "metrics.jsonl", [row(s) for s in (1, 2, 3)])
    assert main(["plot", str(tmp_path), "--out", f"{tmp_path / 'nope'}/"]) == 2
    assert f"its folder {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nope.png").exists()
    (tmp_path / "figs").mkdir()
    assert main(["plot", str(tmp_path), "--out", f"{tmp_path / 'figs'}/"]) == 0
    assert (tmp_path / "figs" / "metrics.png").exists()
