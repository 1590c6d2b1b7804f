"""When a hook fails mid-run, ``fit`` tells the truth about what was written and loses no metrics row: the step
whose metrics a hook failed on still reaches the other hooks (the metrics writer among them), the step in flight
(trained, its metrics one step late) is reported before anything is saved, and the notes name the last step a failed
write holds. The writer is ``megatrain_jax.observe.JsonlWriter`` (metrics.jsonl), as ``megatrain-jax train`` uses it.
More failures of hooks and data: tests/test_fit.py; of the command line: tests/test_nothing_lost.py."""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import pytest
from flax import nnx

from megatrain_jax import Decoder, Hook, TrainConfig, default_optimizer, fit
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.checkpoint.session import CheckpointSession
from megatrain_jax.observe import JsonlWriter
from tests.test_fit import CFG, ENGINE, Boom, Failing, data


class FullAt(JsonlWriter):
    """metrics.jsonl on a disk that is full when step ``at``'s row is written."""

    def __init__(self, path: Path, at: int):
        super().__init__(path)
        self.at = at

    def write(self, metrics: dict) -> None:
        if metrics["step"] == self.at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        super().write(metrics)


def rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def run(tmp_path: Path, hooks: list[Hook], steps: int = 6, stream=None, **train):
    """``fit`` with checkpoints in ``tmp_path/checkpoints``; returns the exception it raised."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(BaseException) as err:
        fit(model, data() if stream is None else stream, default_optimizer(1e-3), engine=ENGINE, hooks=hooks,
            train=TrainConfig(steps=steps, log_every=0, checkpoint_dir=str(tmp_path / "checkpoints"), **train))
    return err.value


def fail_at(step: int, error=Boom("the hook broke")) -> Hook:
    def fail(m, info):
        if m["step"] == step:
            raise error
    return Hook(fail)


def notes_of(err: BaseException) -> str:
    return "\n".join(getattr(err, "__notes__", ()))


# ------------------------------------------------------------------------------------ the metrics writer fails
def test_a_failed_metrics_write_is_never_said_to_have_been_recorded(tmp_path):
    """Step 3's row cannot be written (a full disk), with checkpoints every 2 steps: metrics.jsonl holds steps 1
    and 2, checkpoint 2 is in step with it, and the notes say the file holds nothing after step 2 (not that the
    metrics of step 3 went to metrics.jsonl)."""
    writer = FullAt(tmp_path / "metrics.jsonl", at=3)
    err = run(tmp_path, [writer.hook()], checkpoint_every=2)
    writer.close()
    assert isinstance(err, OSError) and rows(tmp_path / "metrics.jsonl") == [1, 2]
    assert committed_steps(tmp_path / "checkpoints") == [2]
    notes = notes_of(err)
    assert "megatrain-jax train writes them to metrics.jsonl" not in notes, notes
    assert f"a hook's write failed ({tmp_path / 'metrics.jsonl'}) on step 3's metrics: it holds none after " \
           f"step 2's" in notes, notes
    assert f"the last checkpoint is {tmp_path / 'checkpoints' / '2'}: resume from it" in notes, notes


def test_a_failed_metrics_write_names_the_rows_a_checkpoint_saved_before_it_lacks(tmp_path):
    """Step 2's row cannot be written, and checkpoint 2 was saved (as step 1's metrics were reported, one step
    late) before it failed: it is kept, and the notes say that a run resumed from it has no row of step 2 instead
    of saying that nothing was saved past what the writer wrote."""
    writer = FullAt(tmp_path / "metrics.jsonl", at=2)
    err = run(tmp_path, [writer.hook()], checkpoint_every=2)
    writer.close()
    assert isinstance(err, OSError) and rows(tmp_path / "metrics.jsonl") == [1]
    assert committed_steps(tmp_path / "checkpoints") == [2]
    notes = notes_of(err)
    assert "nothing was saved past" not in notes, notes
    assert f"the last checkpoint, {tmp_path / 'checkpoints' / '2'}, was saved before it failed (nothing was saved " \
           f"after it): resume from it, and the resumed run's metrics have no row of step 2" in notes, notes


# ------------------------------------------------------------------------------------ another hook fails
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_hook_leaves_no_saved_step_without_its_metrics_row(tmp_path, where):
    """A hook (an evaluation before the writer, or a display after it) fails on step 2's metrics while step 3
    trains: step 2 still reaches the writer, and step 3, which the rescue checkpoint holds, is reported (to every
    hook but the failed one) before it is saved: metrics.jsonl and fit_history.jsonl hold steps 1 to 3."""
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    seen = []
    failing = fail_at(2)
    hooks = [failing, writer.hook()] if where == "before" else [writer.hook(), failing]
    err = run(tmp_path, hooks + [Hook(lambda m, info: seen.append(m["step"]))])
    writer.close()
    assert isinstance(err, Boom)
    assert committed_steps(tmp_path / "checkpoints") == [3]
    assert rows(tmp_path / "metrics.jsonl") == [1, 2, 3] and seen == [1, 2, 3]
    assert rows(tmp_path / "checkpoints" / "fit_history.jsonl") == [1, 2, 3]
    assert err.history["step"] == [1, 2, 3]
    notes = notes_of(err)
    assert "the metrics of steps 1 to 3 were reported before the failure" in notes, notes
    assert "a hook failed on step 2's metrics and took none after step 1's" in notes, notes
    assert f"the state after step 3 was saved to {tmp_path / 'checkpoints' / '3'}; resume from it" in notes, notes


def test_a_failing_checkpoint_hook_still_reports_the_step_written_back(tmp_path, monkeypatch):
    """The checkpoint session's hook fails after step 2's metrics were written (a save's error, raised at the
    next step): the parameters written back are step 3's, and step 3's metrics reach the writer first."""
    after_step = CheckpointSession.after_step

    def broken(self, metrics, info):
        if metrics["step"] == 2:
            raise OSError(errno.EIO, "the save of step 2 failed")
        after_step(self, metrics, info)
    monkeypatch.setattr(CheckpointSession, "after_step", broken)
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    err = run(tmp_path, [writer.hook()])
    writer.close()
    assert isinstance(err, OSError) and err.history["step"] == [1, 2, 3]
    assert rows(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert "the parameters after step 3 were written back" in notes_of(err)


def test_a_hook_failing_on_the_last_step_after_the_data_failed_still_writes_its_row(tmp_path):
    """The data fails at its 3rd batch, so step 2 is the last trained; an evaluation hook before the writer
    fails on step 2's metrics: step 2's row is still written before step 2 is saved."""
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    err = run(tmp_path, [fail_at(2), writer.hook()], steps=5, stream=Failing(data(), fail_at=2))
    writer.close()
    assert isinstance(err, Boom) and "after the data failed" in notes_of(err)
    assert committed_steps(tmp_path / "checkpoints") == [2] and rows(tmp_path / "metrics.jsonl") == [1, 2]


def test_an_interrupt_from_the_data_says_the_saved_step_has_no_metrics(tmp_path):
    """An interrupt is raised at once (the data's third batch: Ctrl-C while it loads), before the engine reports
    step 2, which trained: step 2 is still saved, and the notes say that it has no metrics instead of telling the
    user to fix the data."""
    def interrupted():
        yield from itertools.islice(data(), 2)
        raise KeyboardInterrupt
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    err = run(tmp_path, [writer.hook()], stream=interrupted())
    writer.close()
    assert isinstance(err, KeyboardInterrupt) and err.history["step"] == [1]
    assert committed_steps(tmp_path / "checkpoints") == [2] and rows(tmp_path / "metrics.jsonl") == [1]
    notes = notes_of(err)
    saved = f"the state after step 2 was saved to {tmp_path / 'checkpoints' / '2'}; its metrics were never reported"
    assert f"{saved} (the failure came first), so a run resumed from it has no metrics of step 2; resume from it" \
           in notes and "fix the data" not in notes, notes
