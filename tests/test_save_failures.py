"""No save can hang (issue 32): a checkpoint write that fails ends the run at once with a message saying what
to do (``CheckpointWriteError``; the command line exits 2), a stop signal ends a save that cannot finish
within a bound (143, naming the last complete checkpoint), and no committed checkpoint is lost.
Behaviour and bounds: docs/checkpoints_faults.md.

Tests run as root here, and root writes through permission bits, so the failures are injected where the
checkpoint code meets the file system: ``os.mkdir`` (the step's temporary directory that Orbax creates on its
own thread, and the write probe of every save) and ``os.fsync`` of the manifest (the writer thread's last
write, where a full disk or a quota often shows on network file systems). A hung file system is a writer
that never returns from ``Snapshot.take``.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, default_optimizer, preset
from megatrain_jax.checkpoint import (Checkpointer, CheckpointSession, CheckpointWarning, CheckpointWriteError,
                                      check_step, committed_steps)
from megatrain_jax.cli import main
from megatrain_jax.data import DataConfig

REPO = Path(__file__).resolve().parents[1]
CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "log.progress=lines", "log.tensorboard=false", "train.eval_every=0"]

# Each kind of write failure, and the words of the message that say what it is.
KINDS = {errno.EROFS: "read-only", errno.EACCES: "permission", errno.ENOSPC: "disk is full",
         errno.EDQUOT: "quota", errno.EIO: "I/O error"}


def data():
    return DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=0, demo_tokens=1 << 14).build(CFG.vocab_size)


@pytest.fixture
def no_hang():
    """A test that hangs ends its process after 90 s with every thread's traceback, rather than the CI job."""
    faulthandler.dump_traceback_later(90, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def fail_mkdir(monkeypatch, code: int, marker: str) -> None:
    mkdir = os.mkdir

    def failing(path, *args, **kwargs):
        if marker in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", failing)


def fail_manifest_fsync(monkeypatch, code: int) -> None:
    fsync = os.fsync

    def failing(fd):
        if "MANIFEST" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", failing)


@pytest.fixture(scope="module")
def engine():
    return Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3))


@pytest.mark.parametrize("where", ["folder", "writer"])
@pytest.mark.parametrize("code", list(KINDS), ids=[errno.errorcode[c] for c in KINDS])
def test_each_write_failure_is_raised_at_once_and_says_what_to_do(tmp_path, monkeypatch, engine, no_hang, where, code):
    """In the folder (every save's probe meets it on the training thread) or in the writer thread (the
    manifest's fsync): a ``CheckpointWriteError`` with the cause, the checkpoint kept and what to do; the
    engine is never left held, and the committed checkpoint stays complete."""
    ckpt = Checkpointer(tmp_path)
    good = ckpt.save(engine, wait=True)
    engine.step(next(data())).resolve()
    (fail_mkdir(monkeypatch, code, ".megatrain-write-probe") if where == "folder"
     else fail_manifest_fsync(monkeypatch, code))
    with pytest.raises(CheckpointWriteError) as err:
        ckpt.save(engine)
        ckpt.wait()
    msg = str(err.value)
    assert err.value.errno == code and KINDS[code] in msg and os.strerror(code) in msg
    assert f"could not write checkpoint {tmp_path / str(good + 1)}" in msg
    assert f"the newest: {tmp_path / str(good)}" in msg and "train.checkpoint_dir" in msg
    engine.step(next(data())).resolve()  # every part was let go
    monkeypatch.undo()
    ckpt.close()
    assert committed_steps(tmp_path) == [good] and check_step(tmp_path / str(good)) is None


def fail_tensorstore_write(monkeypatch, code: int, marker: str = "") -> None:
    """Orbax's array writer fails as TensorStore does on a full disk or quota: a ValueError with no errno, the OS
    error's code at the end of its message (the message of a real full tmpfs, its paths this write's)."""
    import orbax.checkpoint as ocp
    save = ocp.PyTreeCheckpointHandler.save

    def failing(self, directory, *args, **kwargs):
        if marker not in os.fspath(directory):
            return save(self, directory, *args, **kwargs)
        db = f"{os.fspath(directory)}/ocdbt.process_0/"
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "opt.mu.final_norm.scale.value/0" in OCDBT database at '
                         f'local file "{db}": Failed writing: "{db}d/1bb0537d1da0850fbd712e1dc65a1807": Failed to '
                         f"write 103131 bytes to file 17: {os.strerror(code)} [os_error_code='{code}']")
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "save", failing)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_inside_tensorstore_says_what_to_do_and_keeps_the_checkpoint(tmp_path, monkeypatch, engine,
                                                                                 no_hang, code):
    """TensorStore's own error (no errno) is a ``CheckpointWriteError`` with the errno, the space the checkpoint
    takes and the space free, and what to do; the committed checkpoint stays complete, also with keep=1."""
    ckpt = Checkpointer(tmp_path, keep=1)
    good = ckpt.save(engine, wait=True)
    engine.step(next(data())).resolve()
    fail_tensorstore_write(monkeypatch, code)
    with pytest.raises(CheckpointWriteError) as err:
        ckpt.save(engine)
        ckpt.wait()
    msg = str(err.value)
    assert err.value.errno == code and KINDS[code] in msg and "RESOURCE_EXHAUSTED" not in msg
    assert f"could not write checkpoint {tmp_path / str(good + 1)}: " in msg
    assert re.search(r"\(the checkpoint takes about [\d.]+ KiB; [\d.]+ [KMG]iB free there now\)", msg), msg
    assert f"the checkpoints committed before are untouched (the newest: {tmp_path / str(good)})" in msg
    engine.step(next(data())).resolve()  # every part was let go
    monkeypatch.undo()
    ckpt.close()
    assert committed_steps(tmp_path) == [good] and check_step(tmp_path / str(good)) is None


def test_a_full_disk_inside_tensorstore_ends_train_with_status_2(tmp_path, monkeypatch, no_hang, capsys):
    fail_tensorstore_write(monkeypatch, errno.ENOSPC, marker="/4.orbax-checkpoint-tmp")
    ckpt_dir = tmp_path / "checkpoints"
    assert main(["train", *TINY_RUN, "train.steps=6", "train.checkpoint_every=2", "train.checkpoint_keep=1",
                 f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"could not write checkpoint {ckpt_dir / '4'}: the disk is full" in err
    assert f"(the newest: {ckpt_dir / '2'})" in err and f"free space on the disk of {ckpt_dir}" in err
    monkeypatch.undo()
    assert committed_steps(ckpt_dir) == [2] and check_step(ckpt_dir / "2") is None


def test_a_folder_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    fail_mkdir(monkeypatch, errno.EROFS, ".megatrain-write-probe")
    with pytest.raises(CheckpointWriteError, match=f"could not write checkpoint {tmp_path}: the file system is "
                                                   f"read-only .*no checkpoint had been committed"):
        CheckpointSession(tmp_path, every=2)


# Code run before ``megatrain-jax train`` in a real process (``python -c CODE train ...``), injecting a fault
# into the save of step 6; each prints "injected" when the fault begins, for the test to send SIGTERM then.
RUN_CLI = """
import sys
from megatrain_jax.cli import main
sys.exit(main())
"""
# The file system turns read-only under the checkpoint of step 6: Orbax's own thread fails to create the
# step's directory (after the save's probe passed, as when a disk is remounted read-only after an error).
# The failing call takes a second; SIGTERM is sent during it.
READ_ONLY_FROM_STEP_6 = """
import errno, os, sys, time
mkdir = os.mkdir
def read_only(path, *args, **kwargs):
    if f"{os.sep}6.orbax-checkpoint-tmp" in os.fspath(path):
        print("injected: read-only", file=sys.stderr, flush=True)
        time.sleep(1.0)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
    return mkdir(path, *args, **kwargs)
os.mkdir = read_only
""" + RUN_CLI
# The writer of step 6 blocks for good in its second block (a hung file system), holding the engine; the
# stall bound is 2 s instead of 60.
STUCK_AT_STEP_6 = """
import sys, threading
from megatrain_jax.checkpoint import session, store
session.STOP_STALL_S = 2.0
take = store.Snapshot.take
def stuck(self, name):
    if self.step == 6 and name == "block_00001":
        print("injected: stuck", file=sys.stderr, flush=True)
        threading.Event().wait()
    return take(self, name)
store.Snapshot.take = stuck
""" + RUN_CLI


def sigterm_at_the_fault(code: str, run: list[str]) -> tuple[int, str, float]:
    """Run ``megatrain-jax train`` with ``code`` injected, SIGTERM it when the fault begins; returns the exit
    status, stderr and the seconds from the signal to the exit (fails after 60)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code, "train", *run], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("injected"):
            proc.send_signal(signal.SIGTERM)
            break
    sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 60 s after SIGTERM: {''.join(lines)}{proc.communicate()[1]}")
    return proc.returncode, "".join(lines) + err, time.monotonic() - sent


def test_sigterm_during_a_save_into_a_read_only_folder_exits_2_and_the_last_checkpoint_loads(tmp_path):
    """The report of issue 32: this save hung, and SIGTERM did not end it. Now the process exits 2 at once
    with the message, and checkpoint 4 resumes."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    status, err, took = sigterm_at_the_fault(READ_ONLY_FROM_STEP_6, [*run, "train.steps=20"])
    ck = tmp_path / "checkpoints"
    assert status == 2 and took < 60, err
    assert f"megatrain-jax train: error: could not write checkpoint {ck / '6'}: the file system is read-only" in err
    assert f"the newest: {ck / '4'}" in err and "train.checkpoint_dir" in err
    assert committed_steps(ck) == [4, 2] and check_step(ck / "4") is None
    assert main(["train", *run, "train.steps=5", "train.resume=true"]) == 0  # it loads
    assert committed_steps(ck)[0] == 5


def test_sigterm_ends_a_save_that_cannot_finish_and_names_the_last_checkpoint(tmp_path):
    """A writer that never returns: SIGTERM abandons the save once it made no progress for the stall bound,
    and the process exits 143 (though the writer thread still hangs) naming checkpoint 4, which resumes."""
    run = [*TINY_RUN, "train.checkpoint_every=2", f"train.run_dir={tmp_path}"]
    status, err, took = sigterm_at_the_fault(STUCK_AT_STEP_6, [*run, "train.steps=20"])
    ck = tmp_path / "checkpoints"
    assert status == 143 and took < 2.0 + 28, err  # the bound, the step in flight, and a loaded machine
    assert "the save of step 6 made no progress for 2 s: abandoned" in err
    assert f"the last complete checkpoint is {ck / '4'}" in err
    assert committed_steps(ck) == [4, 2] and check_step(ck / "4") is None
    with pytest.warns(CheckpointWarning, match="incomplete checkpoint"):  # the abandoned save's folder goes
        assert main(["train", *run, "train.steps=5", "train.resume=true"]) == 0
    assert committed_steps(ck)[0] == 5


def test_the_command_line_holds_back_orbaxs_own_reports_of_a_failed_save():
    """A failed save's story is the command line's one message (CheckpointWriteError); what Orbax prints of it (absl
    ERROR records from its files, TensorStore callbacks' "Event loop is closed" into its closed loop: hundreds of lines
    for a full disk) is held back, and nothing else is."""
    code = textwrap.dedent("""
        import asyncio, logging, sys
        from megatrain_jax.cli.commands import _quiet_orbax_failures
        _quiet_orbax_failures()
        log = logging.getLogger("absl")
        log.handle(log.makeRecord("absl", logging.ERROR, "/site-packages/orbax/checkpoint/x.py", 1, "ORBAX-ERROR", (), None))
        log.handle(log.makeRecord("absl", logging.ERROR, "/site-packages/other/y.py", 1, "OTHER-ERROR", (), None))
        loop = asyncio.new_event_loop(); loop.close()
        class Callback:
            def __del__(self):
                loop.call_soon_threadsafe(print)
        Callback()
        class Other:
            def __del__(self):
                raise RuntimeError("OTHER-UNRAISABLE")
        Other()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "ORBAX-ERROR" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr
    assert "OTHER-ERROR" in out.stderr and "OTHER-UNRAISABLE" in out.stderr, out.stderr
