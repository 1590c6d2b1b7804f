"""One run per run folder (issue 32): ``megatrain-jax train`` holds an advisory lock on ``<run_dir>/.lock`` for
the run's life. A second run into the folder is refused at once (exit 2, naming the holder) and changes
nothing of the first's; a lock left by a dead run is taken over, with a note."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli.commands import main
from megatrain_jax.cli.run_lock import RunFolderBusyError, RunLock

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "log.progress=lines", "log.tensorboard=false", "train.eval_every=0", "train.log_every=1"]


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    first = RunLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(RunFolderBusyError) as info:
        RunLock(tmp_path).acquire()  # its own open file: flock refuses it even in this process
    message = str(info.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message and "train.run_dir" in message
    first.release()
    with RunLock(tmp_path) as again:  # free once released, and nothing to take over
        assert again.path.read_text().startswith(f"pid {os.getpid()}")
    assert (tmp_path / ".lock").read_text() == ""


def test_a_dead_runs_lock_is_taken_over_with_a_note(tmp_path):
    (tmp_path / ".lock").write_text("pid 12345 on host elsewhere, started 2026-01-01T00:00:00\n")  # never locked
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note is not None and "no longer running" in note and "pid 12345 on host elsewhere" in note
    lock.release()


@pytest.mark.parametrize("key", ["train.run_dir", "train.checkpoint_dir"])
def test_a_run_or_checkpoint_folder_that_is_a_file_says_so(tmp_path, capsys, key):
    file = tmp_path / "not-a-folder"
    file.write_text("kept")
    run_dir = file if key == "train.run_dir" else tmp_path / "run"
    assert main(["train", *TINY_RUN, "train.steps=1", "train.checkpoint_every=1", f"train.run_dir={run_dir}",
                 *([f"train.checkpoint_dir={file}"] if key == "train.checkpoint_dir" else [])]) == 2
    err = capsys.readouterr().err
    assert f"{file} is a file, not a folder; nothing was changed. Set {key} to a folder" in err
    assert "File exists" not in err and file.read_text() == "kept"


def test_each_process_of_a_distributed_run_locks_its_own_file(tmp_path):
    with RunLock(tmp_path, 0), RunLock(tmp_path, 1) as other:
        assert other.path.name == ".lock.process-1"


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_a_second_train_process_exits_2_and_the_first_trains_as_if_alone(tmp_path):
    """Two real processes into one folder: the second is refused while the first runs; the first's metrics
    and checkpoint are those of the same run alone."""
    folder, alone = tmp_path / "shared", tmp_path / "alone"
    run = [*TINY_RUN, "train.steps=60", "train.checkpoint_every=30"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "megatrain_jax", "train"]
    first = subprocess.Popen([*cmd, *run, f"train.run_dir={folder}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not ((folder / ".lock").exists() and (folder / ".lock").read_text()):  # the first holds it
            assert first.poll() is None and time.time() < deadline, first.communicate()[0]
            time.sleep(0.05)
        second = subprocess.run([*cmd, *run, f"train.run_dir={folder}"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=60)
        assert first.poll() is None, "the first run ended before the second was refused: lengthen it"
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"run folder {folder} is in use by pid {first.pid} on host {socket.gethostname()}" in second.stderr
        out, _ = first.communicate(timeout=300)
        assert first.returncode == 0, out
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
    assert main(["train", *run, f"train.run_dir={alone}"]) == 0
    assert _losses(folder) == _losses(alone) and len(_losses(folder)) == 60
    assert sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name.isdigit()) == ["30", "60"]
    import jax
    from megatrain_jax.checkpoint import load_params
    _, *got = load_params(folder / "checkpoints" / "60")
    _, *want = load_params(alone / "checkpoints" / "60")
    a, b = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [k for k, _ in a] == [k for k, _ in b] and all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_a_config_file_given_as_an_override_says_to_use_config(tmp_path, capsys):
    assert main(["train", "run.toml"]) == 2
    assert "pass it as --config run.toml" in capsys.readouterr().err


def test_a_checkpoint_folder_in_use_by_another_run_is_refused(tmp_path, capsys):
    """Two runs in different run folders that name one checkpoint folder would save over each other (and one would
    remove the other's save in progress as stale): the second is refused at once, naming the setting to change."""
    from megatrain_jax.cli import main
    shared = tmp_path / "a" / "checkpoints"  # run a's own checkpoint folder, named by run b
    with RunLock(shared, what="checkpoint folder", key="train.checkpoint_dir"):
        status = main(["train", "model.layers=1", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
                       "train.steps=1", "log.progress=lines", "log.tensorboard=false",
                       f"train.run_dir={tmp_path / 'b'}", f"train.checkpoint_dir={shared}"])
        assert [p.name for p in shared.iterdir()] == [".lock"]  # the refused run wrote nothing there
    assert status == 2
    err = capsys.readouterr().err
    assert f"checkpoint folder {shared} is in use by pid {os.getpid()}" in err and "train.checkpoint_dir" in err
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    assert not shared.exists()  # the holder made the folder and left it empty: its lock took it away


def test_a_lock_leaves_a_folder_it_did_not_make_and_one_written_to(tmp_path):
    made, there = tmp_path / "made", tmp_path / "there"
    there.mkdir()
    with RunLock(there):
        pass
    assert [p.name for p in there.iterdir()] == [".lock"]
    with RunLock(made):
        (made / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in made.iterdir()) == [".lock", "metrics.jsonl"]
