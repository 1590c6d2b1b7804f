"""Resuming from checkpoints as ``megatrain-jax train`` meets them: a step whose JSON files hold JSON of another
shape is a corrupt step (skipped, or refused with a line), never a traceback; the run's own checkpoint folder named
in ``train.resume`` is resumed as ``train.resume=true`` is (a broken newest step set aside, not saved over); a broken
step named is refused before the model loads; a folder without checkpoints says what to give instead."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from megatrain_jax.checkpoint import CheckpointWarning, check_step, committed_steps
from megatrain_jax.cli import main

TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "log.progress=lines", "log.tensorboard=false", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run folder trained 4 steps, checkpointed at steps 2 and 4 (copied by each test)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert main(["train", *TINY_RUN, "train.steps=4", f"train.run_dir={run_dir}"]) == 0
    return run_dir


def copy_of(saved_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def first_array_file(step_dir: Path) -> Path:
    return next(p for p in sorted((step_dir / "state" / "io" / "d").iterdir()) if p.is_file())


SHAPES = {  # (file under the step folder, what it is made to hold)
    "manifest a list": ("state/MANIFEST.json", "[]"),
    "manifest files a list": ("state/MANIFEST.json", '{"format": 1, "files": []}'),
    "manifest entry without size": ("state/MANIFEST.json", None),
    "meta a list": ("meta/meta.json", "[]"),
    "meta without step": ("meta/meta.json", '{"format": 1}'),
    "meta of another step": ("meta/meta.json", None),
    "config null": ("config/config.json", "null"),
}


def damage(step_dir: Path, how: str) -> None:
    name, text = SHAPES[how]
    path = step_dir / name
    if how == "manifest entry without size":
        record = json.loads(path.read_text())
        record["files"][next(iter(record["files"]))] = {}
        text = json.dumps(record)
    elif how == "meta of another step":
        text = json.dumps({**json.loads(path.read_text()), "step": 2})
    path.write_text(text)


@pytest.mark.parametrize("how", list(SHAPES))
def test_json_of_another_shape_makes_a_step_corrupt_not_a_crash(saved_run, tmp_path, how):
    run_dir = copy_of(saved_run, tmp_path)
    step_dir = run_dir / "checkpoints" / "4"
    assert check_step(step_dir) is None
    damage(step_dir, how)
    problem = check_step(step_dir)
    assert isinstance(problem, str) and SHAPES[how][0].split("/")[-1] in problem


@pytest.mark.parametrize("how", ["manifest a list", "meta without step"])
def test_a_resume_past_a_step_with_json_of_another_shape_goes_on_from_the_one_before(saved_run, tmp_path, capsys, how):
    run_dir = copy_of(saved_run, tmp_path)
    damage(run_dir / "checkpoints" / "4", how)
    capsys.readouterr()
    with pytest.warns(CheckpointWarning, match="moved aside to 4.corrupt"):
        assert main(["train", *TINY_RUN, "train.steps=6", "train.resume=true", f"train.run_dir={run_dir}"]) == 0
    assert f"resumed from {run_dir / 'checkpoints' / '2'}" in capsys.readouterr().err
    assert committed_steps(run_dir / "checkpoints") == [6, 4, 2] and (run_dir / "checkpoints" / "4.corrupt").is_dir()


def test_resuming_from_the_runs_own_checkpoint_folder_sets_a_broken_newest_step_aside(saved_run, tmp_path, capsys):
    """``train.resume=RUN/checkpoints`` names what ``train.resume=true`` finds: the broken step 4 is set aside as
    then, so that the steps trained from step 2 are saved (step 4 again) instead of failing at the first save."""
    run_dir = copy_of(saved_run, tmp_path)
    first_array_file(run_dir / "checkpoints" / "4").write_bytes(b"truncated")
    capsys.readouterr()
    with pytest.warns(CheckpointWarning, match="moved aside to 4.corrupt"):
        assert main(["train", *TINY_RUN, "train.steps=6", f"train.resume={run_dir / 'checkpoints'}",
                     f"train.run_dir={run_dir}"]) == 0
    assert f"resumed from {run_dir / 'checkpoints' / '2'}" in capsys.readouterr().err
    assert committed_steps(run_dir / "checkpoints") == [6, 4, 2] and (run_dir / "checkpoints" / "4.corrupt").is_dir()
    assert check_step(run_dir / "checkpoints" / "4") is None


def test_a_broken_step_named_is_refused_before_the_model_loads(saved_run, tmp_path, monkeypatch, capsys):
    source = copy_of(saved_run, tmp_path)
    first_array_file(source / "checkpoints" / "4").write_bytes(b"truncated")
    before = files_of(source)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built (the model loaded) before the checkpoint was refused")
    monkeypatch.setattr(importlib.import_module("megatrain_jax.fit"), "Engine", no_engine)
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=6", f"train.resume={source / 'checkpoints' / '4'}",
                 f"train.run_dir={tmp_path / 'branch'}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {source / 'checkpoints' / '4'}" in err and "truncated" in err
    assert f"train.resume={source / 'checkpoints'}" in err and "Traceback" not in err
    assert files_of(source) == before


def test_another_master_dtype_is_refused_before_the_model_loads(saved_run, tmp_path, monkeypatch, capsys):
    run_dir = copy_of(saved_run, tmp_path)
    before = files_of(run_dir)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built (the model loaded) before the checkpoint was refused")
    monkeypatch.setattr(importlib.import_module("megatrain_jax.fit"), "Engine", no_engine)
    capsys.readouterr()
    assert main(["train", *TINY_RUN, "train.steps=6", "train.resume=true", "engine.master_dtype=bfloat16",
                 f"train.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "it holds float32 master weights" in err and "set engine.master_dtype=float32" in err
    assert files_of(run_dir) == before


def test_a_folder_without_checkpoints_says_what_to_give(saved_run, tmp_path, capsys):
    source = copy_of(saved_run, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    for given, said in ((source, f"it is a run folder, whose checkpoints are in {source / 'checkpoints'}; give that "
                                 f"folder: train.resume={source / 'checkpoints'}"),
                        (empty, "a run's checkpoints/ folder, or one step of it")):
        capsys.readouterr()
        assert main(["train", *TINY_RUN, "train.steps=6", f"train.resume={given}",
                     f"train.run_dir={tmp_path / 'branch'}"]) == 2
        assert said in capsys.readouterr().err
    # the run's own folder named: what it holds is resumed with train.resume=true
    before = files_of(source)
    assert main(["train", *TINY_RUN, "train.steps=6", f"train.resume={source}", f"train.run_dir={source}"]) == 2
    err = capsys.readouterr().err
    assert "is this run's folder, not a checkpoint folder" in err and "train.resume=true" in err
    assert files_of(source) == before
