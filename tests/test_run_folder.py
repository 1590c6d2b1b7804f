"""Run folders and exit statuses of ``megatrain-jax train``: a folder that holds a run is resumed or
refused, never overwritten; a signal-triggered save exits 128 + the signal and keeps the stopped step's
metrics row; every checkpoint corrupt is an error that lists them; the demo's lines make sense on a CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "log.progress=lines", "log.tensorboard=false"]


def steps_in(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_train_into_a_run_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    assert main(["train", *TINY_RUN, "train.steps=2", f"train.run_dir={tmp_path}"]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=3", f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"run folder {tmp_path} already holds a run" in err
    assert "train.resume=true" in err and "train.run_dir" in err and "resume='auto'" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_resuming_without_a_checkpoint_keeps_the_earlier_metrics(tmp_path):
    assert main(["train", *TINY_RUN, "train.steps=2", f"train.run_dir={tmp_path}"]) == 0
    assert main(["train", *TINY_RUN, "train.steps=3", "train.resume=true", f"train.run_dir={tmp_path}"]) == 0
    assert steps_in(tmp_path) == [1, 2, 3]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.1.jsonl").read_text().splitlines()] == [1, 2]


def test_a_changed_config_on_resume_is_written_next_to_the_first(tmp_path):
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=2"]) == 0
    first = (tmp_path / "config.toml").read_text()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0
    assert (tmp_path / "config.toml").read_text() == first
    assert "steps = 4" in (tmp_path / "config.1.toml").read_text()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0  # nothing to train, nothing new
    assert not (tmp_path / "config.2.toml").exists()


@pytest.mark.parametrize("damaged", ["config.toml", "metrics.jsonl"])
def test_a_damaged_run_file_stops_a_resume_before_it_trains(tmp_path, capsys, damaged):
    """A resume into a folder whose config.toml or metrics.jsonl cannot be read is refused at start (exit 2, the
    file named), rather than after training, when the run would fail writing there and leave its metrics short."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=2"]) == 0
    path = tmp_path / damaged
    text = path.read_text()
    path.write_text("garbage [[[\n" + text if damaged == "config.toml" else "{not json\n" + text)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    steps = committed_steps(tmp_path / "checkpoints")
    capsys.readouterr()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "move it aside" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert committed_steps(tmp_path / "checkpoints") == steps


def test_resuming_an_older_step_where_newer_ones_are_is_refused_at_start(tmp_path, capsys):
    """A resume from an explicit older step of the run's own checkpoint folder would save over the newer steps (and
    rewrite their metrics rows): refused before training, nothing changed."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=4"]) == 0
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", *run, "train.steps=6", f"train.resume={tmp_path / 'checkpoints' / '2'}"]) == 2
    err = capsys.readouterr().err
    assert "also holds newer checkpoints (steps [4])" in err and "train.checkpoint_dir" in err
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    assert committed_steps(tmp_path / "checkpoints") == [4, 2]
    other = tmp_path / "branch"  # the documented way: the same step into another checkpoint folder
    assert main(["train", *run, "train.steps=6", f"train.resume={tmp_path / 'checkpoints' / '2'}",
                 f"train.checkpoint_dir={other}"]) == 0
    assert committed_steps(other) == [6, 4] and committed_steps(tmp_path / "checkpoints") == [4, 2]


def test_every_checkpoint_corrupt_stops_with_a_list(tmp_path, capsys):
    run = [*TINY_RUN, "train.checkpoint_every=1", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=3"]) == 0
    for step in committed_steps(tmp_path / "checkpoints"):
        (tmp_path / "checkpoints" / str(step) / "state" / "MANIFEST.json").unlink()
    capsys.readouterr()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 2
    err = capsys.readouterr().err
    assert "every one is incomplete or corrupt" in err
    assert f"{tmp_path / 'checkpoints' / '2'}:" in err and f"{tmp_path / 'checkpoints' / '3'}:" in err
    assert committed_steps(tmp_path / "checkpoints") == [3, 2] and steps_in(tmp_path) == [1, 2, 3]


def test_sigterm_exits_143_and_the_resumed_run_has_every_metrics_row(tmp_path):
    """A real ``megatrain-jax train`` process: SIGTERM mid-run saves, exits 143 (128 + 15), and the stopped
    step's row is in metrics.jsonl; the resumed run continues with the next step, no row missing or twice."""
    args = [sys.executable, "-m", "megatrain_jax", "train", *TINY_RUN, "train.steps=400", "train.log_every=1",
            "train.checkpoint_every=100", f"train.run_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    saved = committed_steps(tmp_path / "checkpoints")
    assert len(saved) == 1 and f"SIGTERM: saved checkpoint {tmp_path / 'checkpoints' / str(saved[0])}" in err
    stopped = saved[0]
    assert steps_in(tmp_path) == list(range(1, stopped + 1))  # the stopped step's row is kept
    assert main(["train", *TINY_RUN, f"train.steps={stopped + 2}", "train.checkpoint_every=100", "train.resume=true",
                 f"train.run_dir={tmp_path}"]) == 0
    assert steps_in(tmp_path) == list(range(1, stopped + 3))


def test_the_demo_lines_make_sense_on_a_cpu(tmp_path, capsys):
    assert main(["demo", "train.steps=3", "train.log_every=1", "train.eval_every=0", "log.progress=lines",
                 f"train.run_dir={tmp_path}", "model.layers=1", "data.batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "GPU 1.0 GiB" not in out
    assert "0.0 TFLOP/s" not in out and ("GFLOP/s" in out or "MFLOP/s" in out)


@pytest.mark.parametrize("tflops, text", [(455.07, "455.1 TFLOP/s"), (0.0123, "12.3 GFLOP/s"), (4e-6, "4.0 MFLOP/s")])
def test_flops_are_shown_in_a_unit_with_digits(tflops, text):
    from megatrain_jax.flops import format_flops
    assert format_flops(tflops) == text


def test_the_demo_run_again_goes_to_a_new_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    small = ["train.steps=2", "train.eval_every=0", "model.layers=1", "data.batch_size=2", "log.progress=off"]
    assert main(["demo", *small]) == 0 and main(["demo", *small]) == 0
    assert steps_in(tmp_path / "runs" / "demo") == [1, 2] and steps_in(tmp_path / "runs" / "demo-2") == [1, 2]
