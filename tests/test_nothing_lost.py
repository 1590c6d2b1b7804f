"""Nothing committed is lost, ever: a diverging run keeps its last good checkpoint, an export never writes NaN
weights and a failed one keeps the trained state, every output path is checked before training, convert never
falls back to an older step in silence, checkpoints never run ahead of metrics.jsonl, a refused or failed start
leaves the run folder as it was (SIGHUP saving as SIGTERM does: tests/test_run_folder.py). Faults are injected as in
tests/test_save_failures.py (tests run as root, which writes through permission bits)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, EngineConfig, NonFiniteError, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import committed_steps, load_params
from megatrain_jax.cli import main
from megatrain_jax.cli.run_folder import run_files
from megatrain_jax.hf import load_hf
from megatrain_jax.observe import metrics as metrics_module
from tests.test_faults import CFG, data
from tests.test_run_folder import TINY_RUN, copy_of, files_of, saved_run, steps_in  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"


def test_a_diverging_run_saves_no_skipped_step_and_keeps_its_last_good_checkpoint(tmp_path, capsys):
    """The learning rate jumps at step 5, so steps 6 on are skipped (non-finite); every step is checkpointed and
    one is kept. Without the rules the skipped steps' checkpoints push every good one out; the checkpoint of step 5
    (finite, but the weights step 6 diverged from) is no good either, so step 4's, the last that a finite step
    trained from, is kept."""
    lr = lambda count: jnp.where(count < 4, 1e-3, 1e35)  # noqa: E731
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(NonFiniteError) as err:
        fit(model, data(), default_optimizer(lr), engine=EngineConfig(micro_batches=2, max_nonfinite_steps=3),
            train=TrainConfig(steps=12, log_every=0, checkpoint_dir=str(tmp_path), checkpoint_every=1, checkpoint_keep=1))
    records = err.value.history.records
    skipped = {r["step"] for r in records if r["skipped"]}
    assert skipped, "the run did not diverge"
    last_good = max(r["step"] - 1 for r in records if not r["skipped"])  # a finite step was trained from it
    kept = committed_steps(tmp_path)
    assert not skipped & set(kept) and max(kept) < min(skipped) and last_good in kept, (kept, skipped)
    assert "a checkpoint is never written from a skipped step" in capsys.readouterr().err


def test_a_model_with_a_nan_weight_is_never_exported(tmp_path, capsys):
    """Every step is skipped; the run refuses to export (exit 3, nothing in the export folder) and saves no
    checkpoint of the NaN model."""
    from safetensors.numpy import load_file, save_file
    src = tmp_path / "nan_model"
    shutil.copytree(HF_LLAMA, src)
    tensors = load_file(src / "model.safetensors")
    name = next(k for k in tensors if k.endswith("norm.weight"))
    tensors[name] = tensors[name].copy()
    tensors[name][0] = np.nan
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    run_dir, export = tmp_path / "run", tmp_path / "export"
    status = main(["train", f"model.hf_checkpoint={src}", "model.dtype=float32", *TINY_RUN[1:], "train.steps=2",
                   "train.checkpoint_every=1", f"train.run_dir={run_dir}", f"train.export_hf={export}"])
    err = capsys.readouterr().err
    assert status == 3, err
    assert f"not exporting to {export}" in err and "holds a NaN or an infinity" in err
    assert not export.exists() and committed_steps(run_dir / "checkpoints") == []


def train_onto_a_full_disk(run_dir: Path, export: Path, monkeypatch) -> int:
    """``train`` for 2 steps with its export to ``export``, whose staging folder cannot be made (ENOSPC)."""
    mkdir = os.mkdir

    def full(path, *args, **kwargs):
        if f".{export.name}.partial-" in os.fspath(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", full)
    status = main(["train", *TINY_RUN, "train.steps=2", f"train.run_dir={run_dir}", f"train.export_hf={export}"])
    monkeypatch.undo()
    return status


def test_a_failed_export_names_its_folder_and_keeps_the_trained_weights(tmp_path, monkeypatch, capsys):
    """A full disk under the export folder, in a run that saves no checkpoints: the error names the folder and the
    cause, and the trained weights were written first (into the run folder) and convert back to the model."""
    run_dir, export = tmp_path / "run", tmp_path / "export"
    status = train_onto_a_full_disk(run_dir, export, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2, err
    kept = run_dir / "trained_params"
    assert f"could not export the trained model to {export}: the disk is full" in err
    assert f"the trained state is kept in {kept}" in err and f"megatrain-jax convert {kept}" in err
    cfg, io, blocks = load_hf(kept, dtype="float32")  # a float32 Hugging Face folder, written tensor by tensor
    assert cfg.layers == 2 and len(blocks) == 2 and np.isfinite(io["embedding"]).all()
    assert main(["convert", str(kept), str(export), "--to", "hf"]) == 0


def test_without_room_for_a_copy_beside_the_export_the_weights_are_written_when_it_fails(tmp_path, monkeypatch,
                                                                                          capsys):
    """A disk that holds the export but not also a float32 copy (an 8B fine-tune on a 64 GB disk): no copy
    first, said; when the export then fails, the weights are written to the run folder after all, and named."""
    from megatrain_jax.cli import export_guard
    run_dir, export = tmp_path / "run", tmp_path / "export"
    monkeypatch.setattr(export_guard, "free_space", lambda folder: (1, 0))  # no room: nothing written first
    status = train_onto_a_full_disk(run_dir, export, monkeypatch)
    out, err = capsys.readouterr()
    kept = run_dir / "trained_params"
    assert status == 2, err
    assert "are kept in" not in out and "written there only if the export fails" in out + err
    assert f"the trained state is kept in {kept}" in err
    assert load_hf(kept, dtype="float32")[0].layers == 2


@pytest.mark.parametrize("where", ["export_parent", "run_dir", "checkpoint_parent", "metrics"])
def test_every_output_path_is_checked_before_training(tmp_path, capsys, where):
    (tmp_path / "file").write_text("not a folder")
    run_dir = tmp_path / "run"
    args = {"export_parent": [f"train.export_hf={tmp_path / 'file' / 'hf'}"],
            "run_dir": [],
            "checkpoint_parent": ["train.checkpoint_every=1", f"train.checkpoint_dir={tmp_path / 'file' / 'ck'}"],
            "metrics": []}[where]
    if where == "run_dir":
        run_dir = tmp_path / "file"
    if where == "metrics":
        (run_dir / "metrics.jsonl").mkdir(parents=True)
    field, path = {"export_parent": ("train.export_hf", tmp_path / "file" / "hf"), "run_dir": ("train.run_dir", run_dir),
                   "checkpoint_parent": ("train.checkpoint_dir", tmp_path / "file" / "ck"),
                   "metrics": ("train.run_dir (its metrics.jsonl)", run_dir / "metrics.jsonl")}[where]
    assert main(["train", *TINY_RUN, "train.steps=2", f"train.run_dir={run_dir}", *args]) == 2
    out, err = capsys.readouterr()
    assert f"{field} = {path}" in err and "step " not in out, err
    assert (tmp_path / "file").read_text() == "not a folder"


def test_convert_refuses_a_run_whose_newest_checkpoint_is_broken(tmp_path, capsys):
    ck = tmp_path / "ck"
    fit(Decoder(CFG, rngs=nnx.Rngs(0)), data(), default_optimizer(1e-3), engine=EngineConfig(micro_batches=2),
        train=TrainConfig(steps=4, log_every=0, checkpoint_dir=str(ck), checkpoint_every=2))
    assert committed_steps(ck) == [4, 2]
    (ck / "4" / "state" / "MANIFEST.json").write_text("{")
    capsys.readouterr()
    assert main(["convert", str(ck), str(tmp_path / "hf"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "the newest checkpoint" in err and "step 4, fails its check" in err
    assert f"The newest complete one is step 2: to use it, give its folder ({ck / '2'})" in err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", str(ck / "2"), str(tmp_path / "hf"), "--to", "hf"]) == 0


def test_a_metrics_file_that_cannot_be_written_leaves_no_checkpoint_ahead_of_it(tmp_path, monkeypatch, capsys):
    """The write of step 3's row fails (a full disk): no checkpoint past step 2 is saved, and the resumed run's
    metrics.jsonl has every row, 1 to 6."""
    write = metrics_module.JsonlWriter.write

    def full_at_3(self, m):
        if m["step"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        write(self, m)
    monkeypatch.setattr(metrics_module.JsonlWriter, "write", full_at_3)
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=6"]) == 2
    monkeypatch.undo()
    assert committed_steps(tmp_path / "checkpoints") == [2] and steps_in(tmp_path) == [1, 2]
    assert "nothing was saved past what it wrote" in capsys.readouterr().err
    assert main(["train", *run, "train.steps=6", "train.resume=true"]) == 0
    assert steps_in(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_a_resume_refused_by_its_data_leaves_the_run_folder_byte_for_byte(saved_run, tmp_path, capsys):
    """Refused before the model loads (the data's saved position does not fit another batch size and seed), each
    setting named with both values, and before a broken newer checkpoint is moved aside: the folder stays as it
    was."""
    run_dir, resume = copy_of(saved_run, tmp_path)
    before = files_of(run_dir)
    capsys.readouterr()
    assert main(["train", *resume, "train.steps=4", "data.batch_size=8", "data.seed=7"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {run_dir / 'checkpoints' / '2'}: the data differs from the run's" in err
    assert "data.batch_size: 4 saved, 8 now; data.seed: 0 saved, 7 now" in err and "Nothing was changed" in err
    assert "loading" not in err and files_of(run_dir) == before
    shutil.copytree(run_dir / "checkpoints" / "2", run_dir / "checkpoints" / "3")  # a newer one, broken
    (run_dir / "checkpoints" / "3" / "state" / "MANIFEST.json").unlink()
    before = files_of(run_dir)
    assert main(["train", *resume, "train.steps=4", "data.batch_size=8"]) == 2
    assert files_of(run_dir) == before and not (run_dir / "checkpoints" / "3.corrupt").exists()


def test_a_start_that_fails_at_its_first_batch_blocks_no_corrected_command(tmp_path, monkeypatch, capsys):
    from megatrain_jax.engine.engine import Engine

    def refuse(self, batch):
        raise ValueError("this batch is refused")
    run = [*TINY_RUN, "train.steps=2", "train.checkpoint_every=1", f"train.run_dir={tmp_path}"]
    with monkeypatch.context() as m:
        m.setattr(Engine, "check_batch", refuse)
        assert main(["train", *run]) == 2
    assert "no step was trained, so no checkpoint was saved" in capsys.readouterr().err
    assert not run_files(tmp_path, tmp_path / "checkpoints") and committed_steps(tmp_path / "checkpoints") == []
    assert not (tmp_path / "memory_plan.json").exists()
    assert main(["train", *run, "train.resume=true"]) == 0 and steps_in(tmp_path) == [1, 2]



def test_a_resume_past_the_last_metrics_row_says_which_rows_are_missing(tmp_path, capsys):
    """Killed between a checkpoint's commit and its step's metrics row (metrics are reported one step late): the
    resumed run says which rows its metrics.jsonl lacks instead of leaving the hole in silence."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    assert main(["train", *run, "train.steps=4"]) == 0
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(rows[:3]))  # as if killed before step 4's row
    capsys.readouterr()
    assert main(["train", *run, "train.steps=5", "train.resume=true"]) == 0
    assert "no records of step 4 (the run that saved the checkpoint" in capsys.readouterr().err and steps_in(tmp_path) == [1, 2, 3, 5]


def test_with_several_processes_an_export_is_preceded_by_a_checkpoint(tmp_path):
    """Each process holds its own share of the trained state and only a checkpoint writes it whole: a run of
    several processes that exports and saves no checkpoint saves one at its end (in the run's checkpoint folder),
    so that the export's guard finds the state on disk; one process, or a run that saves checkpoints, is as
    given."""
    from megatrain_jax.cli.run import checkpoint_for_export
    from megatrain_jax.cli.run_config import TrainSection
    t = TrainSection(run_dir=str(tmp_path / "run"), export_hf=str(tmp_path / "hf"))
    assert t.for_fit().checkpoint_dir is None
    several, why = checkpoint_for_export(t, True)
    assert several.for_fit().checkpoint_dir == str(tmp_path / "run" / "checkpoints") and several.for_fit().checkpointing
    assert "written whole only by a checkpoint" in why and str(tmp_path / "hf") in why
    assert checkpoint_for_export(t, False) == (t, None)
    saving = TrainSection(run_dir=str(tmp_path / "run"), export_hf=str(tmp_path / "hf"), checkpoint_every=5)
    assert checkpoint_for_export(saving, True) == (saving, None)
    no_export = TrainSection(run_dir=str(tmp_path / "run"))
    assert checkpoint_for_export(no_export, True) == (no_export, None)
