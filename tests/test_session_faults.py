"""A run's checkpoints over its life: a checkpoint folder shared with another run keeps that run's steps, a failed
deletion of an old step is said as such (the save it followed was committed), a parameters-only folder's marker is
whole or absent, and a resumed run's metrics rows are rebuilt from the steps' log kept beside its checkpoints.
Faults are injected as in tests/test_save_failures.py (tests run as root, which writes through permission bits)."""

from __future__ import annotations

import errno
import shutil
import warnings
from pathlib import Path

import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, default_optimizer, preset
from megatrain_jax.checkpoint import Checkpointer, CheckpointWarning, check_step, committed_steps
from megatrain_jax.data import DataConfig

CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)


def data():
    return DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=0, demo_tokens=1 << 14).build(CFG.vocab_size)


def new_engine(seed: int = 0) -> Engine:
    return Engine(Decoder(CFG, rngs=nnx.Rngs(seed)), default_optimizer(1e-3))


def train_and_save(engine: Engine, ckpt: Checkpointer, steps: int) -> list[int]:
    """``steps`` steps of ``engine``, each saved by ``ckpt`` and waited for; the steps saved."""
    batches, saved = iter(data()), []
    for _ in range(steps):
        engine.step(next(batches)).resolve()
        saved.append(ckpt.save(engine, wait=True))
    return saved


def test_a_checkpointer_never_deletes_the_steps_of_another_run_in_its_folder(tmp_path):
    """Two runs saving into one folder with bare Checkpointers (no session to refuse the second): each keeps its own
    newest ``keep``, and neither the other's steps nor its own step just committed are deleted."""
    first = Checkpointer(tmp_path, keep=1)
    theirs = train_and_save(new_engine(), first, 3)
    first.close()
    assert committed_steps(tmp_path) == [3]
    second = Checkpointer(tmp_path, keep=1)
    engine = new_engine(1)
    with pytest.warns(CheckpointWarning, match=r"holds steps \[3\] that this Checkpointer neither saved nor resumed"):
        second.save(engine, wait=True)  # step 0
    assert committed_steps(tmp_path) == [3, 0], "the other run's step, or this one's just committed, was deleted"
    train_and_save(engine, second, 2)  # steps 1 and 2: this run's own newest 1 kept
    second.close()
    assert committed_steps(tmp_path) == [theirs[-1], 2]


def test_a_checkpointer_that_resumed_a_run_prunes_its_steps(tmp_path):
    """Restoring a step of its own folder makes that run's steps (up to it) this Checkpointer's: keep-N goes on
    pruning them."""
    first = Checkpointer(tmp_path, keep=None)
    train_and_save(new_engine(), first, 3)
    first.close()
    ckpt, engine = Checkpointer(tmp_path, keep=2), new_engine(1)
    ckpt.restore(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # nothing said: the folder's steps are this run's
        train_and_save(engine, ckpt, 1)
    ckpt.close()
    assert committed_steps(tmp_path) == [4, 3]


def test_an_old_step_that_cannot_be_deleted_is_said_as_such_and_the_run_goes_on(tmp_path, monkeypatch):
    """The save committed; only deleting the step keep-N drops failed (a file busy on a network file system, a
    permission): a warning names that step and what to do, never "could not write checkpoint" of the saved one."""
    ckpt, engine = Checkpointer(tmp_path, keep=1), new_engine()
    train_and_save(engine, ckpt, 1)
    rmtree = shutil.rmtree

    def busy(path, *args, **kwargs):
        if Path(path).name == "1":
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return rmtree(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", busy)
    from etils import epath
    monkeypatch.setattr(epath.Path, "rmtree", lambda self, *a, **k: busy(self, *a, **k))
    with pytest.warns(CheckpointWarning, match=r"could not delete the old checkpoint .*/1 \(keep=1\).*Device or "
                                               r"resource busy.*checkpoint .*/2 was saved"):
        train_and_save(engine, ckpt, 1)
        ckpt.check()
    monkeypatch.undo()
    train_and_save(engine, ckpt, 1)  # the run goes on saving, and deletes both old steps now
    ckpt.close()
    assert committed_steps(tmp_path) == [3] and check_step(tmp_path / "3") is None


def test_a_parameters_marker_is_never_left_cut_short(tmp_path, monkeypatch):
    """The disk fills while ``save_params`` writes its marker (the file that says the folder holds whole parameters):
    the save fails, and the folder has no marker at all, rather than one cut short, nor a temporary file."""
    from megatrain_jax.checkpoint import load_params, save_model
    from megatrain_jax.checkpoint.params import MARKER
    write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if MARKER in self.name:
            write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_model(tmp_path / "p", Decoder(CFG, rngs=nnx.Rngs(0)))
    monkeypatch.undo()
    assert not (tmp_path / "p" / MARKER).exists(), "a marker cut short was left"
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["params"]
    with pytest.raises(FileNotFoundError, match=f"neither {MARKER}"):
        load_params(tmp_path / "p")


def test_a_folder_whose_file_system_cannot_lock_is_said_and_the_run_goes_on(tmp_path, monkeypatch):
    """``flock`` fails with ENOLCK (an NFS mount without its lock daemon, some FUSE file systems): not an OSError that
    names no folder and ends the run, but a note that the folder is not locked; released as any, leaving no folder
    that it made."""
    import fcntl

    from megatrain_jax.cli.run_lock import RunLock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunLock(tmp_path / "run")
    note = lock.acquire()
    assert note is not None and f"run folder {tmp_path / 'run'} cannot be locked (No locks available" in note
    assert "make sure no other run uses it" in note
    lock.release()
    assert not (tmp_path / "run").exists()


def test_a_resumed_runs_lost_metrics_are_rebuilt_from_the_steps_log_beside_its_checkpoints(tmp_path):
    """The run folder was deleted and the checkpoint folder (elsewhere) kept: the resumed run's ``metrics.jsonl``
    gets the records of steps 1 to the resumed step back from ``fit_history.jsonl``, not only the steps it trains
    now; a file that is there is never touched."""
    import json

    from megatrain_jax import TrainConfig, fit
    from megatrain_jax.cli.run_folder import rebuild_metrics

    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    history = fit(Decoder(CFG, rngs=nnx.Rngs(0)), data(), default_optimizer(1e-3),
                  train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(ckpt), checkpoint_every=1))
    run_dir.mkdir()
    note = rebuild_metrics(run_dir, ckpt, 2)  # resumed from step 2 (step 3's record belongs to no resumed line)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["loss"] for r in rows] == history["loss"][:2]
    assert note is not None and "was missing: its records of steps 1 to 2 were rebuilt from" in note
    (run_dir / "metrics.jsonl").write_text("kept\n")
    assert rebuild_metrics(run_dir, ckpt, 3) is None and (run_dir / "metrics.jsonl").read_text() == "kept\n"
    assert rebuild_metrics(tmp_path / "fresh", ckpt, 0) is None and not (tmp_path / "fresh").exists()


def test_a_second_process_writing_into_a_checkpoint_folder_is_refused_and_changes_nothing(tmp_path):
    """A job requeued while the first still runs (``fit`` from Python: no run-folder lock): the second writer is
    refused at once, naming the first, and the first's unfinished save (its temporary folder) is left alone,
    rather than removed at the second's first save while the first writes it."""
    import subprocess
    import sys

    from megatrain_jax.checkpoint.folder_lock import CheckpointFolderBusyError
    unfinished = tmp_path / "7.orbax-checkpoint-tmp-123"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatrain_jax.checkpoint import Checkpointer; "
                               f"c = Checkpointer({str(tmp_path)!r}); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "ready"
        unfinished.mkdir()  # the first run's save in flight
        with pytest.raises(CheckpointFolderBusyError, match=rf"checkpoint directory {tmp_path} is being written by "
                                                            rf"pid {holder.pid} on host .*Nothing was changed"):
            Checkpointer(tmp_path)
        assert unfinished.is_dir()
    finally:
        holder.stdin.close()
        holder.wait(60)
    with pytest.warns(CheckpointWarning, match="skipping incomplete checkpoint"):  # the first has ended: its save is dead
        ckpt = Checkpointer(tmp_path)
    ckpt.save(new_engine(), wait=True)
    ckpt.close()
    assert not unfinished.exists() and committed_steps(tmp_path) == [0]
