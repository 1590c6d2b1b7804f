"""The disk tier (``EngineConfig.disk_parts``) when its folder or files go wrong: a ``disk_dir`` that is a file,
tier files deleted or truncated while a run trains, a full disk mid-run, a run resumed with its own files still
there, and ``Engine.close`` in a folder that holds other files. Each says what happened and what to do, and
nothing saved is lost: never zeros read in place of lost moments, never a checkpoint of them."""

from __future__ import annotations

import dataclasses
import errno
import gc
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, TrainConfig, adamw, fit, preset
from megatrain_jax.checkpoint import Checkpointer, committed_steps
from megatrain_jax.cli import disk_room, load_config, main
from megatrain_jax.cli.output_paths import OutputPathError
from megatrain_jax.data import DataConfig
from megatrain_jax.engine.parts import PartId
from megatrain_jax.engine.update import disk_tier
from megatrain_jax.engine.update.disk_tier import DiskTierError

from test_engine import TINY3, make_batches

pytestmark = pytest.mark.usefixtures("lib")  # the kernel must build: conftest.lib fails where it cannot

TX = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731
CFG = preset("tiny", layers=3, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "data.eval_fraction=0.05", "train.eval_batches=1", "log.progress=lines", "log.tensorboard=false"]


def _engine(tmp_path, parts=1, steps=1):
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=parts, disk_dir=str(tmp_path)))
    for b in make_batches(steps, vocab=TINY3.vocab_size):
        engine.step([b]).resolve()
    engine.sync()
    engine.disk_tier.flush()  # the tier's writes done: a file changed after this is what the next read finds
    return engine


# ---------------------------------------------------------------------- the folder
def test_a_disk_dir_that_is_a_file_is_refused_saying_so(tmp_path):
    """From Python: a ValueError naming the folder and the field, not a bare FileExistsError or
    NotADirectoryError from deep inside the tier."""
    (tmp_path / "afile").write_text("mine")
    for where in (tmp_path / "afile", tmp_path / "afile" / "tier"):
        with pytest.raises(ValueError, match=rf"{where} \(engine.disk_dir\).*file.*Set engine.disk_dir"):
            Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=1, disk_dir=str(where)))
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_disk_dir_that_is_a_file_is_refused_before_the_run_starts(tmp_path):
    """``megatrain-jax train`` checks engine.disk_dir with the other output paths: a file there, or on the way
    to it, is said as that, before anything is written."""
    (tmp_path / "afile").write_text("mine")
    for where in (tmp_path / "afile", tmp_path / "afile" / "tier"):
        cfg = load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}"])
        engine = dataclasses.replace(cfg.engine, disk_parts=1, disk_dir=str(where))
        with pytest.raises(OutputPathError, match=r"the disk tier's files .*would be written in .*\(engine.disk_dir\), "
                                                  r"but nothing can be created in .*afile \(a file, not a folder\); "
                                                  r"nothing was trained. Set engine.disk_dir to a folder"):
            disk_room.check_disk_room(cfg.train, cfg.model.build(), engine)


def test_close_deletes_the_tiers_files_and_nothing_else(tmp_path):
    """``Engine.close`` removes the files the tier made; a disk_dir that held other files keeps them."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard0").write_text("mine too")
    _engine(tmp_path, parts=2).close()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "data", "data/shard0", "notes.txt"]
    only_tier = tmp_path / "only_tier"
    _engine(only_tier).close()
    assert not only_tier.exists()  # a folder that held only the tier goes with it


# ---------------------------------------------------------------------- the files, while a run trains
def _tier_without_read_ahead(engine, root):
    """A second tier of block 2 holding the engine's moments for it, written and flushed, with nothing read ahead:
    the next ``load`` reads the files as they are then (a step's tier reads each step's first parts ahead, behind
    its writes, so a file changed between steps may be read before or after the change)."""
    part = PartId.block(2)
    record = engine.disk_tier.load(part, engine.state[part])
    tier = disk_tier.DiskTier(root, [part], read_ahead=0)
    spilled = tier.spill(part, record)
    tier.flush()
    return tier, part, spilled


def test_tier_files_deleted_mid_run_stop_training_instead_of_reading_zeros(tmp_path):
    """The moments of a tier part, deleted between their write and their read (a clean-up of the folder, say),
    read as zeros without a word before: the next update took them, and a checkpoint would have saved them. Now
    the read raises DiskTierError naming the file and saying to resume from the last checkpoint."""
    engine = _engine(tmp_path / "run")
    tier, part, spilled = _tier_without_read_ahead(engine, tmp_path / "tier")
    for chunks in (tmp_path / "tier").glob("block_00002/*/c"):
        shutil.rmtree(chunks)
    with pytest.raises(DiskTierError, match=r"reading .*block_00002/.* failed .*resume from the last checkpoint"):
        tier.load(part, spilled)
    tier.close()
    engine.close()


def test_tier_files_deleted_mid_run_are_never_checkpointed(tmp_path):
    """A save reads the tier's files: lost ones fail it, and the checkpoint folder keeps what it had."""
    engine = _engine(tmp_path / "tier")
    shutil.rmtree(tmp_path / "tier" / "block_00002")
    ck = Checkpointer(tmp_path / "ck")
    with pytest.raises(DiskTierError, match=r"reading .*block_00002/.* failed"):
        ck.save(engine, wait=True)
    ck.close()
    assert committed_steps(tmp_path / "ck") == []


def test_a_truncated_tier_file_is_said_with_what_to_do(tmp_path):
    engine = _engine(tmp_path / "run")
    tier, part, spilled = _tier_without_read_ahead(engine, tmp_path / "tier")
    chunk = next(p for p in (tmp_path / "tier" / "block_00002" / "nu_000" / "c").rglob("*") if p.is_file())
    with open(chunk, "r+b") as f:
        f.truncate(5)
    with pytest.raises(DiskTierError, match=rf"reading {tmp_path}/tier/block_00002/nu_000 failed .*resume from the "
                                            rf"last"):
        tier.load(part, spilled)
    tier.close()
    engine.close()


def test_moments_that_are_all_zero_read_back_as_written(tmp_path):
    """Missing chunks are an error now, so chunks equal to the fill value (0) must be stored, not skipped: a block
    whose moments stay zero in some rows (an expert never routed to) reads them back."""
    engine = _engine(tmp_path)
    tier, part = engine.disk_tier, PartId.block(2)
    record = tier.load(part, engine.state[part])
    for x in (record.opt.mu, record.opt.nu):
        for leaf in jax.tree.leaves(x):
            leaf[...] = 0
    engine.state[part] = tier.store(part, record)
    tier.flush()
    back = tier.load(part, engine.state[part])
    assert all(not np.any(x) for x in jax.tree.leaves((back.opt.mu, back.opt.nu)))
    engine.state[part] = tier.store(part, back)
    engine.close()


# ---------------------------------------------------------------------- a full disk
def _fit(tmp_path, steps, **train):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    data = DataConfig(seq_len=16, batch_size=2, seed=3, demo_tokens=1 << 14).build(CFG.vocab_size)
    return fit(model, data, TX(), train=TrainConfig(steps=steps, log_every=0, **train),
               engine=EngineConfig(disk_parts=2, disk_dir=str(tmp_path / "tier")))


def test_a_full_disk_mid_run_stops_it_and_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    """The tier's writes fail from step 3 on (ENOSPC): training stops with DiskTierError, saying to resume from
    the last checkpoint, which it names; checkpoint 2 is committed and holds what an undisturbed run's does."""
    _fit(tmp_path / "ref", 2, checkpoint_dir=str(tmp_path / "ref" / "ck"))
    write, calls = disk_tier.DiskTier._write, []

    def full_from_step_3(self, keys, arrays):
        calls.append(keys)
        if len(calls) > 4:  # two tier parts a step: steps 1 and 2 write, step 3 meets a full disk
            self._stores.update({k: _Full(self._stores[k]) for k in keys})
        write(self, keys, arrays)

    monkeypatch.setattr(disk_tier.DiskTier, "_write", full_from_step_3)
    with pytest.raises(DiskTierError, match="No space left on device.*resume from the last checkpoint") as err:
        _fit(tmp_path, 6, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    assert f"the last committed checkpoint is {tmp_path / 'ck' / '2'}" in "\n".join(err.value.__notes__)
    assert committed_steps(tmp_path / "ck") == [2]
    monkeypatch.undo()
    got, want = (Engine(Decoder(CFG, rngs=nnx.Rngs(0)), TX()) for _ in range(2))
    Checkpointer(tmp_path / "ck", read_only=True).restore(got)
    Checkpointer(tmp_path / "ref" / "ck", read_only=True).restore(want)
    for a, b in zip(jax.tree.leaves([(p.params, p.opt) for p in got.state.parts]),
                    jax.tree.leaves([(p.params, p.opt) for p in want.state.parts])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


class _Full:
    """A tier array on a full disk: its writes fail."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def write(self, array):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_line_from_the_command_line(tmp_path, monkeypatch, capsys):
    """Through ``megatrain-jax train``: exit 2 and the error with what to do, no traceback."""
    open_ = disk_tier.DiskTier._open

    def full(self, key, shape, dtype):
        open_(self, key, shape, dtype)
        self._stores[key] = _Full(self._stores[key])

    monkeypatch.setattr(disk_tier.DiskTier, "_open", full)
    run = tmp_path / "run"
    status = main(["train", *TINY_RUN, "train.steps=3", f"train.run_dir={run}", "engine.disk_parts=1",
                   f"engine.disk_dir={tmp_path / 'tier'}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "megatrain-jax train: error: writing" in err and "No space left on device" in err, err
    assert "resume from the last checkpoint" in err and "Traceback" not in err, err


def test_a_finished_command_line_run_deletes_its_tier_files_and_keeps_the_rest(tmp_path):
    """``megatrain-jax train`` that ends well removes the tier's files (its checkpoints hold what was trained); a
    file of the user's in engine.disk_dir stays, and so does the folder holding it."""
    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / "notes.txt").write_text("mine")
    status = main(["train", *TINY_RUN, "train.steps=2", "train.eval_every=0", f"train.run_dir={tmp_path / 'run'}",
                   "engine.disk_parts=1", f"engine.disk_dir={tier}"])
    assert status == 0
    assert sorted(p.name for p in tier.iterdir()) == ["notes.txt"]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    status = main(["train", *TINY_RUN, "train.steps=2", "train.eval_every=0", f"train.run_dir={tmp_path / 'run2'}",
                   "engine.disk_parts=1", f"engine.disk_dir={tmp_path / 'made'}"])
    assert status == 0 and not (tmp_path / "made").exists()  # a folder the tier made goes with its files


# ---------------------------------------------------------------------- a resume beside its own files
def test_a_resume_counts_the_tiers_own_files_as_room(tmp_path, monkeypatch):
    """A run stopped with its tier files left in engine.disk_dir resumes there: a new tier replaces those files
    array by array, so the start-of-run check counts their bytes as free, and says so."""
    cfg = load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}"])
    model_cfg = cfg.model.build()
    engine_cfg = dataclasses.replace(cfg.engine, disk_parts=1, disk_dir=str(tmp_path / "tier"))
    need = disk_room.disk_tier_bytes(model_cfg, engine_cfg)
    engine = Engine(Decoder(model_cfg, rngs=nnx.Rngs(0)), TX(), engine_cfg)
    for b in make_batches(1, vocab=model_cfg.vocab_size, seq=32):
        engine.step([b]).resolve()
    engine.sync()
    del engine  # a stopped run: its files stay
    gc.collect()
    there = sum(p.stat().st_size for p in (tmp_path / "tier").rglob("*") if p.is_file())
    assert there >= need
    (write,) = disk_room.writes(cfg.train, model_cfg, engine_cfg)
    assert write.nbytes == 0 and "already there" in write.what
    monkeypatch.setattr(disk_room, "free_space", lambda folder: (need // 2, 7))
    disk_room.check_disk_room(cfg.train, model_cfg, engine_cfg)  # the files there are the room it needs
