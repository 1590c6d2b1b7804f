"""Nothing committed is lost, ever: a diverging run keeps its last good checkpoint, an export never writes NaN
weights and a failed one keeps the trained state, every output path is checked before training, convert never
falls back to an older step in silence, checkpoints never run ahead of metrics.jsonl, a refused or failed start
leaves the run folder as it was (SIGHUP saving as SIGTERM does: tests/test_run_folder.py). Faults are injected as in
tests/test_save_failures.py (tests run as root, which writes through permission bits)."""

from __future__ import annotations

import errno
import os

import jax.numpy as jnp
import pytest
from flax import nnx

from megatrain_jax import Decoder, EngineConfig, NonFiniteError, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.cli import main
from megatrain_jax.observe import metrics as metrics_module
from tests.test_faults import CFG, data
from tests.test_run_folder import TINY_RUN, steps_in


def test_a_diverging_run_saves_no_skipped_step_and_keeps_its_last_good_checkpoint(tmp_path, capsys):
    """The learning rate jumps at step 5, so steps 6 on are skipped (non-finite); every step is checkpointed and
    two are kept. Without the rule the skipped steps' checkpoints push every good one out."""
    lr = lambda count: jnp.where(count < 4, 1e-3, 1e35)  # noqa: E731
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(NonFiniteError) as err:
        fit(model, data(), default_optimizer(lr), engine=EngineConfig(micro_batches=2, max_nonfinite_steps=3),
            train=TrainConfig(steps=12, log_every=0, checkpoint_dir=str(tmp_path), checkpoint_every=1, checkpoint_keep=2))
    skipped = {r["step"] for r in err.value.history.records if r["skipped"]}
    assert skipped, "the run did not diverge"
    kept = committed_steps(tmp_path)
    assert kept and not skipped & set(kept) and max(kept) < min(skipped)
    assert "a checkpoint is never written from a skipped step" in capsys.readouterr().err


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
