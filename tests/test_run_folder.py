"""Run folders and exit statuses of ``megatrain-jax train``: a folder that holds a run is resumed or
refused, never overwritten; a signal-triggered save exits 128 + the signal and keeps the stopped step's
metrics row; every checkpoint corrupt is an error that lists them; the demo's lines make sense on a CPU."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_jax.checkpoint import CheckpointWarning, committed_steps
from megatrain_jax.cli import main
from megatrain_jax.cli.run_folder import run_files
from megatrain_jax.observe import read_metrics

REPO = Path(__file__).resolve().parents[1]
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "log.progress=lines", "log.tensorboard=false"]


def steps_in(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines()]


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (checkpoints included), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run folder trained 2 steps, checkpointed at step 2, with TensorBoard event files (copied by each test)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert main(["train", *TINY_RUN, "log.tensorboard=true", "train.checkpoint_every=2", "train.steps=2",
                 f"train.run_dir={run_dir}"]) == 0
    return run_dir


def copy_of(saved_run: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of ``saved_run`` in ``tmp_path``, and the arguments that resume it."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir, [*TINY_RUN, "log.tensorboard=true", "train.checkpoint_every=2", "train.resume=true",
                     f"train.run_dir={run_dir}"]


def test_a_second_train_into_a_run_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    assert main(["train", *TINY_RUN, "train.steps=2", "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=3", f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"run folder {tmp_path} already holds a run" in err
    assert "train.resume=true" in err and "train.run_dir" in err and "resume='auto'" not in err
    assert "train.checkpoint_dir" not in err  # its checkpoints are where a resume looks: no folder to add
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_second_train_into_a_relative_run_folder_names_no_checkpoint_folder(tmp_path, capsys, monkeypatch):
    """The first run's config.toml holds its unset checkpoint_dir as "none", and its run folder was given relative:
    the refusal says to add train.resume=true only, not a checkpoint folder named "none" or the same one again."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_RUN, "train.steps=2", "train.checkpoint_every=2", "train.run_dir=runs/a"]) == 0
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=3", "train.run_dir=runs/a"]) == 2
    err = capsys.readouterr().err
    assert "To continue it, add train.resume=true; to start a new run" in err and "none" not in err, err


def test_resuming_without_a_checkpoint_keeps_the_earlier_metrics(tmp_path, capsys):
    """A run that saved no checkpoint cannot be continued: a second start is told so (not to resume); resume=true
    (a job script's every start) starts over, saying it, and keeps the earlier metrics."""
    assert main(["train", *TINY_RUN, "train.steps=2", f"train.run_dir={tmp_path}"]) == 0
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=3", f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "It saved no checkpoint" in err and "cannot be continued" in err and "train.resume=true" not in err
    assert main(["train", *TINY_RUN, "train.steps=3", "train.resume=true", f"train.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"the run in {tmp_path} trained 2 step(s) but left no checkpoint" in out and "starts from step 0" in out
    assert steps_in(tmp_path) == [1, 2, 3]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.1.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_true_finds_no_checkpoint_where_the_run_saved_elsewhere_and_says_where(tmp_path, capsys):
    """The run saved its checkpoints to a train.checkpoint_dir that the resuming command does not name: refused,
    naming the folder the run's config.toml records, not started over."""
    elsewhere = tmp_path / "ck"
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path / 'run'}"]
    assert main(["train", *run, "train.steps=2", f"train.checkpoint_dir={elsewhere}"]) == 0
    before = files_of(tmp_path)
    capsys.readouterr()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"saved its checkpoints to {elsewhere} (steps [2])" in err and f"train.checkpoint_dir={elsewhere}" in err
    assert files_of(tmp_path) == before
    assert main(["train", *run, "train.steps=3", "train.resume=true", f"train.checkpoint_dir={elsewhere}"]) == 0
    assert steps_in(tmp_path / "run") == [1, 2, 3]


def test_a_resume_from_another_folder_into_one_holding_checkpoints_is_refused(saved_run, tmp_path, capsys):
    """Resuming from another run's checkpoint into a checkpoint folder that holds checkpoints would mix the two runs'
    steps there and let the keep rule delete the other run's: refused at start, nothing changed."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    source = tmp_path / "source"
    shutil.copytree(saved_run / "checkpoints", source)
    before = files_of(run_dir)
    capsys.readouterr()
    assert main(["train", *resume[:-2], f"train.run_dir={run_dir}", "train.steps=4",
                 f"train.resume={source / '2'}"]) == 2
    err = capsys.readouterr().err
    assert "which holds another run's checkpoints (steps [2])" in err and "Nothing was changed" in err
    assert files_of(run_dir) == before


def test_a_resume_from_a_missing_path_or_a_file_says_what_it_is(saved_run, tmp_path, capsys):
    run_dir, resume = copy_of(saved_run, tmp_path)
    for given, said in ((tmp_path / "nowhere", "does not exist"), (run_dir / "config.toml", "is a file, not a "
                                                                                           "checkpoint folder")):
        capsys.readouterr()
        assert main(["train", *resume[:-2], f"train.run_dir={run_dir}", "train.steps=4",
                     f"train.resume={given}"]) == 2
        err = capsys.readouterr().err
        assert f"train.resume={given}" in err and said in err and "WARNING:absl" not in err


def test_a_resume_with_another_learning_rate_or_length_says_so(saved_run, tmp_path, capsys):
    """Changing the optimizer or the schedule's length on resume is allowed (a lower rate after a spike, a longer
    run) and said, with both values."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    capsys.readouterr()
    assert main(["train", *resume, "train.steps=3", "optimizer.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "resuming with another optimizer or schedule" in out
    assert "optimizer.lr 0.0003 then, 0.0001 now" in out and "train.steps 2 then, 3 now" in out
    assert main(["train", *resume, "train.steps=4", "optimizer.lr=1e-4"]) == 0  # compared with the last start's
    out = capsys.readouterr().out
    assert "train.steps 3 then, 4 now" in out and "optimizer.lr" not in out


def test_a_changed_config_on_resume_is_written_next_to_the_first(tmp_path):
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=2"]) == 0
    first = (tmp_path / "config.toml").read_text()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0
    assert (tmp_path / "config.toml").read_text() == first
    assert "steps = 4" in (tmp_path / "config.1.toml").read_text()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0  # nothing to train, nothing new
    assert not (tmp_path / "config.2.toml").exists()


def test_a_config_saved_before_a_section_existed_is_the_same_run_on_resume(tmp_path):
    """A run folder's config.toml written by a version without a section or key that now has defaults (``[dpo]``
    came later) is the same configuration: resuming writes no config.1.toml; a saved key that no longer reads
    counts as a change."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=2"]) == 0
    saved = (tmp_path / "config.toml").read_text()
    # as saved by a run of 4 steps cut after its checkpoint at step 2, by a version without [dpo] and without a
    # key whose default is what the run used
    older = saved.split("\n[dpo]")[0].replace("eval_fraction = ", "# eval_fraction = ").replace("\nsteps = 2\n",
                                                                                                 "\nsteps = 4\n")
    assert "[dpo]" not in older and "# eval_fraction" in older and "\nsteps = 4\n" in older
    (tmp_path / "config.toml").write_text(older)
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0
    assert steps_in(tmp_path) == [1, 2, 3, 4]
    assert not (tmp_path / "config.1.toml").exists() and (tmp_path / "config.toml").read_text() == older
    (tmp_path / "config.toml").write_text(older.replace("[engine]", "[engine]\nretired_key = 1"))
    assert main(["train", *run, "train.steps=6", "train.resume=true"]) == 0
    assert "retired_key" not in (tmp_path / "config.1.toml").read_text()


def test_a_run_whose_hugging_face_folder_moved_resumes_comparing_its_config(tmp_path, capsys):
    """The run's model came from a Hugging Face folder that has since moved: its config.toml still reads for what a
    resume compares (the optimizer, the schedule's length, where the checkpoints went), which needs no model folder.
    The resume is not taken for a start over, says what changed, and says the old folder is gone."""
    hf, moved, elsewhere = tmp_path / "hf", tmp_path / "hf_moved", tmp_path / "ck"
    shutil.copytree(HF_LLAMA, hf)
    run = [*TINY_RUN[1:], "model.dtype=float32", "train.checkpoint_every=2", f"train.run_dir={tmp_path / 'run'}"]
    assert main(["train", f"model.hf_checkpoint={hf}", *run, "train.steps=2", f"train.checkpoint_dir={elsewhere}"]) == 0
    hf.rename(moved)
    capsys.readouterr()
    # resume=true without the run's checkpoint_dir: refused naming where the run saved, not started over from step 0
    assert main(["train", f"model.hf_checkpoint={moved}", *run, "train.steps=4", "train.resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"saved its checkpoints to {elsewhere} (steps [2])" in err
    assert main(["train", f"model.hf_checkpoint={moved}", *run, "train.steps=3", "train.resume=true",
                 f"train.checkpoint_dir={elsewhere}", "optimizer.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "optimizer.lr 0.0003 then, 0.0001 now" in out and "train.steps 2 then, 3 now" in out
    assert f"model.hf_checkpoint {hf} no longer exists" in out
    assert steps_in(tmp_path / "run") == [1, 2, 3]


def test_a_relative_hugging_face_folder_resumed_from_elsewhere_is_not_called_gone(tmp_path, capsys, monkeypatch):
    """The run named its model folder by a relative path; its resume runs from another working directory, naming the
    same folder by another path. The old path is not found from here, but nothing says the folder moved."""
    shutil.copytree(HF_LLAMA, tmp_path / "hf")
    (tmp_path / "sub").mkdir()
    run = [*TINY_RUN[1:], "model.dtype=float32", "train.checkpoint_every=2", f"train.run_dir={tmp_path / 'run'}"]
    monkeypatch.chdir(tmp_path)
    assert main(["train", "model.hf_checkpoint=hf", *run, "train.steps=2"]) == 0
    monkeypatch.chdir(tmp_path / "sub")
    capsys.readouterr()
    assert main(["train", "model.hf_checkpoint=../hf", *run, "train.steps=3", "train.resume=true"]) == 0
    out = capsys.readouterr().out
    assert "model.hf_checkpoint hf is not found from this working directory" in out and "no longer exists" not in out


def test_a_saved_config_reads_without_its_hugging_face_folder(tmp_path):
    """``last_config`` reads a run's config.toml whose model folder was deleted: the values as saved, not None."""
    from megatrain_jax.cli.run_config import load_config, to_toml
    from megatrain_jax.cli.run_folder import last_config, schedule_changes
    hf = tmp_path / "hf"
    shutil.copytree(HF_LLAMA, hf)
    cfg = load_config(None, [f"model.hf_checkpoint={hf}", "data.seq_len=32", "optimizer.lr=1e-3", "train.steps=5"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    shutil.rmtree(hf)
    recorded = last_config(tmp_path)
    assert recorded is not None and recorded["model"]["hf_checkpoint"] == str(hf)
    assert recorded["optimizer"]["lr"] == 1e-3 and recorded["train"]["steps"] == 5
    assert schedule_changes(recorded, cfg) == {}


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


def test_a_resume_that_changes_the_model_but_no_shape_is_refused_naming_each_key(saved_run, tmp_path, capsys):
    """A RoPE base, norm epsilon, head split (the same heads x head_dim), window or activation changed on resume
    keeps every tensor's shape: refused at start (exit 2) naming each key with both values and the ways on,
    nothing changed. What may change on resume (steps, the schedule, the attention kernel, chunk sizes) still
    resumes."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    before = files_of(run_dir)
    capsys.readouterr()
    changed = ["model.rope_theta=20000", "model.norm_eps=1e-6", "model.heads=8", "model.kv_heads=4",
               "model.head_dim=8", "model.sliding_window=16", "model.mlp_activation=gelu_tanh"]
    assert main(["train", *resume, "train.steps=4", *changed]) == 2
    err = capsys.readouterr().err
    for line in ("model.rope_theta: 10000.0 in the checkpoint, 20000.0 now", "model.norm_eps: 1e-05 in the "
                 "checkpoint, 1e-06 now", "model.heads: 4 in the checkpoint, 8 now", "model.kv_heads: 2 in the "
                 "checkpoint, 4 now", "model.head_dim: 16 in the checkpoint, 8 now", "model.sliding_window: none in "
                 "the checkpoint, 16 now", "model.mlp_activation: silu in the checkpoint, gelu_tanh now"):
        assert line in err
    assert "model.head_dim: none" not in err  # unset in the checkpoint: named by its value, hidden // heads
    assert f"cannot resume from {run_dir / 'checkpoints' / '2'}" in err
    assert "model.rope_theta=10000.0 model.norm_eps=1e-05" in err  # put them back ...
    assert "megatrain-jax convert" in err and "model.hf_checkpoint=NEW_DIR" in err  # ... or a new run from the weights
    assert files_of(run_dir) == before
    back = shlex.split(err.split("put the checkpoint's values back (")[1].split("). To train")[0])
    assert main(["train", *resume, "train.steps=3", *changed, *back, "optimizer.lr=1e-3", "model.attention_impl=xla",
                 "model.loss_chunk_tokens=64"]) == 0
    assert steps_in(run_dir) == [1, 2, 3]


def test_a_refused_start_leaves_the_run_folder_byte_for_byte(saved_run, tmp_path, capsys):
    """Refused once its memory plan is made (another batch size: another plan), by the data, by the packing bound
    or by the model check inside fit: memory_plan.json, config.toml, metrics.jsonl, the TensorBoard files and the
    checkpoints are all as they were."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    before = files_of(run_dir)
    for refused in (["data.path=missing.bin"], ["data.mode=packed", "model.max_segments=1"], ["model.rope_theta=2e4"]):
        assert main(["train", *resume, "train.steps=4", "data.batch_size=8", *refused]) == 2, refused
        assert files_of(run_dir) == before, refused


def test_resuming_at_or_past_train_steps_says_so_and_writes_nothing(saved_run, tmp_path, capsys):
    """train.steps counts from step 0: a checkpoint at or past it leaves nothing to train. Said, with what to set to
    train on; exit 0 (the run is done, as a finished run started again is), and the folder is as it was."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    before = files_of(run_dir)
    capsys.readouterr()
    assert main(["train", *resume, "train.steps=1"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint this run resumed from holds step 2, and train.steps = 1" in out
    assert "set train.steps above 2 (train.steps=3 trains 1 more)" in out
    assert files_of(run_dir) == before


def test_a_run_killed_past_its_last_checkpoint_resumes_into_one_continuous_metrics_file(tmp_path, capsys):
    """The commonest resume: killed at step 6 (its row half written) with the last checkpoint at step 4, resumed with
    the same config. metrics.jsonl is the history of the line being continued, rows 1-4 as they were and 5-8 from
    the resumed run, which is what plot draws; the replaced rows (5, 6 and the cut one) are in metrics.1.jsonl, the
    old file byte for byte."""
    run = [*TINY_RUN, "train.checkpoint_every=4", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=6"]) == 0
    shutil.rmtree(tmp_path / "checkpoints" / "6")  # the kill came before step 6's checkpoint ...
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # ... and in the middle of step 7's row
    old = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *run, "train.steps=8", "train.resume=true"]) == 0
    assert f"{tmp_path / 'metrics.jsonl'}: kept whole as {tmp_path / 'metrics.1.jsonl'}" in capsys.readouterr().err
    assert steps_in(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (tmp_path / "metrics.jsonl").read_text().startswith("".join(old.splitlines(keepends=True)[:4]))
    assert (tmp_path / "metrics.1.jsonl").read_text() == old
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))  # what plot reads
    pytest.importorskip("matplotlib")
    from megatrain_jax.observe import plot_run
    assert plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_dies_before_its_first_step_leaves_its_memory_plan(tmp_path, monkeypatch, capsys):
    """Killed while the model loads (here: the engine fails to build), after every check passed: memory_plan.json is
    there to debug it, and nothing that makes the folder hold a run, so the same command runs again as it was."""
    fit_module = importlib.import_module("megatrain_jax.fit")  # (the package's ``fit`` is the function)

    def dies(*args, **kwargs):
        raise MemoryError("killed while loading the model")
    monkeypatch.setattr(fit_module, "Engine", dies)
    run = ["train", *TINY_RUN, "train.steps=2", "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    with pytest.raises(MemoryError):
        main(run)
    assert json.loads((tmp_path / "memory_plan.json").read_text())["batch_rows"] == 4
    assert not run_files(tmp_path)
    monkeypatch.undo()
    assert main(run) == 0 and steps_in(tmp_path) == [1, 2]


def test_a_branch_and_going_back_to_the_first_line_lose_no_metrics_row(tmp_path, capsys):
    """A branch (an earlier step resumed into another checkpoint folder, in the same run folder), then the first line
    resumed again: each writes records for steps the file already holds, and every record ever written stays in
    one of the metrics files (the replaced file kept whole as metrics.N.jsonl)."""
    run = [*TINY_RUN, "train.checkpoint_every=1", f"train.run_dir={tmp_path}"]

    def rows() -> set[str]:
        return {line for p in tmp_path.glob("metrics*.jsonl") for line in p.read_text().splitlines()}
    assert main(["train", *run, "train.steps=3"]) == 0  # checkpoints of steps 2 and 3
    first = rows()
    assert main(["train", *run, "train.steps=4", f"train.resume={tmp_path / 'checkpoints' / '2'}",
                 f"train.checkpoint_dir={tmp_path / 'branch'}"]) == 0
    assert first <= rows() and steps_in(tmp_path) == [1, 2, 3, 4] and steps_in(tmp_path, "metrics.1.jsonl") == [1, 2, 3]
    assert "kept whole as" in capsys.readouterr().err
    branch = rows()
    assert main(["train", *run, "train.steps=4", "train.resume=true"]) == 0  # the first line, from its step 3
    assert branch <= rows() and steps_in(tmp_path) == [1, 2, 3, 4]
    assert steps_in(tmp_path, "metrics.2.jsonl") == [1, 2, 3, 4]  # the branch's file, whole


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


def test_a_resume_refused_by_the_model_check_leaves_a_corrupt_newest_checkpoint_in_place(tmp_path, capsys):
    """The newest checkpoint is broken and the run resumes from the one before: it is set aside (``N.corrupt``) only
    once the resume goes ahead, and a killed save's leftover removed only by the first save, so a refused one (here a
    changed model) leaves the folder byte for byte."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=4"]) == 0
    (tmp_path / "checkpoints" / "4" / "state" / "MANIFEST.json").unlink()
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234" / "state" / "x").write_text("")
    before = files_of(tmp_path)
    capsys.readouterr()
    assert main(["train", *run, "train.steps=5", "train.resume=true", "model.rope_theta=2e4"]) == 2
    assert "this run's model differs" in capsys.readouterr().err
    assert files_of(tmp_path) == before and not (tmp_path / "checkpoints" / "4.corrupt").exists()
    with pytest.warns(CheckpointWarning, match="moved aside to 4.corrupt"):
        assert main(["train", *run, "train.steps=5", "train.resume=true"]) == 0
    assert (tmp_path / "checkpoints" / "4.corrupt").is_dir() and committed_steps(tmp_path / "checkpoints") == [5, 4, 2]
    assert not (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_exits_143_and_the_resumed_run_has_every_metrics_row(tmp_path, sig):
    """A real ``megatrain-jax train`` process: SIGTERM mid-run saves, exits 143 (128 + 15), and the stopped
    step's row is in metrics.jsonl; the resumed run continues with the next step, no row missing or twice. SIGHUP
    (the terminal closed) does the same, with 129."""
    args = [sys.executable, "-m", "megatrain_jax", "train", *TINY_RUN, "train.steps=400", "train.log_every=1",
            "train.checkpoint_every=100", f"train.run_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 3:
            proc.send_signal(sig)
            break
        assert time.time() < deadline
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    saved = committed_steps(tmp_path / "checkpoints")
    assert len(saved) == 1 and f"{sig.name}: saved checkpoint {tmp_path / 'checkpoints' / str(saved[0])}" in err
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


def test_a_run_folder_deleted_beside_kept_checkpoints_gets_its_metrics_back_on_resume(tmp_path, capsys):
    """The run folder lost (deleted, a new machine), the checkpoint folder elsewhere kept: the resumed run's
    metrics.jsonl holds steps 1 to 4 again, the first two rebuilt from the steps' log beside the checkpoints."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = [*TINY_RUN, "train.checkpoint_every=2", f"train.checkpoint_dir={ckpt}", f"train.run_dir={run_dir}"]
    assert main(["train", *common, "train.steps=2"]) == 0
    first = read_metrics(run_dir)
    shutil.rmtree(run_dir)
    capsys.readouterr()
    assert main(["train", *common, "train.steps=4", "train.resume=true"]) == 0
    assert "metrics.jsonl was missing: its records of steps 1 to 2 were rebuilt" in capsys.readouterr().out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows[:2]] == [r["loss"] for r in first]


def test_checkpoints_in_the_run_folder_itself_train_and_resume(tmp_path):
    """``train.checkpoint_dir`` = ``train.run_dir``: one folder, locked once (it was refused as in use by the run's
    own process)."""
    common = [*TINY_RUN, "train.checkpoint_every=2", f"train.checkpoint_dir={tmp_path}", f"train.run_dir={tmp_path}"]
    assert main(["train", *common, "train.steps=2"]) == 0
    assert main(["train", *common, "train.steps=4", "train.resume=true"]) == 0
    assert steps_in(tmp_path) == [1, 2, 3, 4] and committed_steps(tmp_path)[0] == 4
