"""The fault matrix: every fault a long run meets ends in a clear error or a clean recovery, and no
committed checkpoint is lost.

Each case starts from a run with committed checkpoints at steps 2 and 4, injects its fault, then checks
(``settle``) that the outcome is the expected error (type and the words that say what to do) or a run
that finished, and that every checkpoint committed before the fault is still there and complete (except
the one the fault itself damaged, which is kept, moved aside or named, never deleted).

More of the same faults, in depth: tests/test_checkpoint.py (bit-exact resume after each, SIGKILL of a
real process during a save), tests/test_fit.py (failures in hooks and data), tests/test_run_folder.py.
"""

from __future__ import annotations

import errno
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Batch, Decoder, EngineConfig, Hook, NonFiniteError, TrainConfig, default_optimizer, fit, preset
from megatrain_jax.checkpoint import (CheckpointedExit, CheckpointWarning, CorruptCheckpointError, check_step,
                                      committed_steps)
from megatrain_jax.checkpoint import store
from megatrain_jax.data import DataConfig

ROOT = Path(__file__).resolve().parents[1]
CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
ENGINE = EngineConfig(micro_batches=2)


def data():
    return DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=0, demo_tokens=1 << 14).build(CFG.vocab_size)


def run(ck: Path, steps: int, *, cfg=CFG, stream=None, hooks=(), optimizer=None, engine=ENGINE, **train):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return fit(model, data() if stream is None else stream, optimizer or default_optimizer(1e-3), engine=engine,
               hooks=hooks, train=TrainConfig(steps=steps, log_every=0, checkpoint_dir=str(ck), checkpoint_every=2, checkpoint_keep=10,
                                              **train))


def damage(step_dir: Path, how: str) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in p.as_posix()]
    big = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(big.read_bytes())
    if how == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0xFF
    big.write_bytes(bytes(raw))


# ----------------------------------------------------------------------------------------------- the cases
def truncated(ck: Path, monkeypatch):
    damage(ck / "4", "truncate")
    with pytest.warns(CheckpointWarning, match="skipping corrupt checkpoint"):
        h = run(ck, 6, resume=True)
    assert h["step"] == [3, 4, 5, 6]  # recovered from step 2
    assert (ck / "4.corrupt").is_dir()  # kept, moved aside
    return {"damaged": {4}}


def bit_flipped(ck: Path, monkeypatch):
    damage(ck / "4", "flip")
    with pytest.warns(CheckpointWarning, match="CRC|checksum|crc"):
        h = run(ck, 6, resume=True)
    assert h["step"] == [3, 4, 5, 6]
    return {"damaged": {4}}


def all_corrupt(ck: Path, monkeypatch):
    damage(ck / "4", "flip")
    damage(ck / "2", "truncate")
    with pytest.raises(CorruptCheckpointError) as err, pytest.warns(CheckpointWarning):
        run(ck, 6, resume=True)
    msg = str(err.value)
    assert f"{ck / '4'}:" in msg and f"{ck / '2'}:" in msg and "move" in msg and "aside" in msg
    assert committed_steps(ck) == [4, 2]  # nothing moved, nothing started over
    return {"damaged": {2, 4}}


def disk_full(ck: Path, monkeypatch):
    write = store.write_manifest

    def full(directory, entries, *, step, parts):
        if step == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(directory, entries, step=step, parts=parts)
    monkeypatch.setattr(store, "write_manifest", full)
    with pytest.raises(OSError, match="No space left on device"):
        run(ck, 8, resume=True)
    monkeypatch.setattr(store, "write_manifest", write)
    assert 6 not in committed_steps(ck)
    h = run(ck, 8, resume=True)  # space again: the unfinished save is cleaned up and the run goes on
    assert h["step"][0] == 5 and h["step"][-1] == 8
    return {}


def sigterm_mid_step(ck: Path, monkeypatch):
    kill = Hook(lambda m, info: os.kill(os.getpid(), signal.SIGTERM) if m["step"] == 5 else None)
    with pytest.raises(CheckpointedExit) as stop:
        run(ck, 8, resume=True, hooks=[kill])
    assert stop.value.code == 143 and stop.value.history["step"] == [5, 6]
    assert committed_steps(ck)[0] == 6 and check_step(ck / "6") is None
    assert run(ck, 8, resume=True)["step"] == [7, 8]
    return {}


def non_finite(ck: Path, monkeypatch):
    with pytest.raises(NonFiniteError, match="non-finite"):
        run(ck, 12, resume=True, optimizer=default_optimizer(1e30),
            engine=EngineConfig(micro_batches=2, max_nonfinite_steps=2, clip_norm=None))
    return {}


def bad_tokens(ck: Path, monkeypatch):
    good = data()
    stream = [next(good) for _ in range(6)]
    stream.append(Batch(np.full_like(stream[0].inputs, CFG.vocab_size), stream[0].targets))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        run(ck, 8, stream=stream)  # a fresh run, in a directory of its own
    assert committed_steps(ck)[0] == 6  # the six good steps are saved
    return {}


def changed_shape(ck: Path, monkeypatch):
    """Refused before the restore, naming the changed field (the restore would list every tensor)."""
    with pytest.raises(ValueError, match="model.hidden: 32 in the checkpoint, 48 now"):
        run(ck, 6, cfg=CFG.replace(hidden=48), resume=True)
    return {}


def killed_mid_save(ck: Path, monkeypatch):
    """A real process, SIGKILLed while its writer is in the middle of step 6 (it sleeps after each part)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    victim = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "kill_during_save.py"), "--dir", str(ck),
                               "--steps", "8", "--every", "2", "--out", str(ck.parent / "victim.npz"), "--resume",
                               "--part-delay", "0.5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(str(ck / "6.orbax-checkpoint-tmp*" / "**" / "io"), recursive=True):
        assert victim.poll() is None, victim.communicate()
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    with pytest.warns(CheckpointWarning, match="incomplete checkpoint"):
        h = run(ck, 8, resume=True)
    assert h["step"] == [5, 6, 7, 8]
    return {}


CASES = [truncated, bit_flipped, all_corrupt, disk_full, sigterm_mid_step, non_finite, bad_tokens, changed_shape,
         killed_mid_save]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_fault(tmp_path, monkeypatch, case):
    ck = tmp_path / ("fresh" if case is bad_tokens else "ck")
    start = tmp_path / "ck"
    run(start, 4)
    committed = {step: (start / str(step) / "meta" / "meta.json").read_text() for step in committed_steps(start)}
    assert sorted(committed) == [2, 4]
    outcome = case(ck, monkeypatch)
    for step, meta in committed.items():  # every committed checkpoint survives, byte for byte where undamaged
        where = start / str(step) if (start / str(step)).exists() else start / f"{step}.corrupt"
        assert where.is_dir(), f"checkpoint {step} was lost"
        if step not in outcome.get("damaged", ()):
            assert (where / "meta" / "meta.json").read_text() == meta and check_step(where) is None
