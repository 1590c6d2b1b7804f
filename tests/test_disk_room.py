"""The start-of-run disk check (``cli/disk_room.py``) and the output paths (``cli/output_paths.py``): as many
checkpoints as the keep-N rule holds at once, the disk tier's files, sizes in a unit that says them, and a folder
that cannot be written said as that, not as a full disk."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, TrainConfig, adamw, fit
from megatrain_jax.checkpoint import committed_steps, manager
from megatrain_jax.checkpoint.failures import format_size, free_space
from megatrain_jax.cli import disk_room, load_config, main
from megatrain_jax.cli.output_paths import OutputPathError, check_output_path
from megatrain_jax.engine.update import disk_tier
from megatrain_jax.plan import plan

from test_engine import TINY3, make_batches
from test_faults import CFG, data

TINY_RUN = ["model.layers=2", "data.seq_len=32", "data.batch_size=4", "data.demo_tokens=20000",
            "data.eval_fraction=0.05", "train.eval_batches=1", "log.progress=lines", "log.tensorboard=false"]
PROC = Path("/proc/self").is_dir()


def _cfg(tmp_path: Path, *overrides: str):
    cfg = load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}", *overrides])
    return cfg, cfg.model.build()


# ---------------------------------------------------------------------- (a) how many checkpoints at once
@pytest.mark.parametrize("keep, every, peak", [(1, 1, 4), (1, 2, 3), (1, 5, 3), (2, 1, 4), (2, 2, 3), (3, 1, 4),
                                               (3, 2, 4), (5, 1, 6)])
def test_the_peak_is_the_kept_the_spared_known_good_and_the_one_written(keep, every, peak):
    assert disk_room.peak_checkpoints(keep, every) == peak


def test_keep_1_every_1_counts_four_checkpoints(tmp_path):
    """The reviewer's run: keep=1, every=1 counted 2 and its save at step 4 met a full disk."""
    cfg, model = _cfg(tmp_path, "train.checkpoint_every=1", "train.checkpoint_keep=1", "train.steps=10")
    size = disk_room.checkpoint_bytes(model, cfg.engine)
    (folder, total, what, key), = disk_room.writes(cfg.train, model, cfg.engine)
    assert total == 4 * size and what.startswith("4 checkpoints") and "up to 4 on disk at once" in what
    assert key == "train.checkpoint_dir" and folder == tmp_path / "run" / "checkpoints"


def test_those_already_there_count_as_on_disk(tmp_path, monkeypatch):
    cfg, model = _cfg(tmp_path, "train.checkpoint_every=1", "train.checkpoint_keep=1", "train.steps=10")
    size = disk_room.checkpoint_bytes(model, cfg.engine)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for there, count in [(0, 4), (1, 3), (3, 1), (7, 1)]:  # the first save needs room for one at least
        monkeypatch.setattr(disk_room, "committed_steps", lambda folder, n=there: list(range(n, 0, -1)))
        (_, total, what, _), = disk_room.writes(cfg.train, model, cfg.engine)
        assert total == count * size and f"{there} already there" in what
    short = dataclasses.replace(cfg.train, steps=1)  # never more than the run saves: step 1 and the end
    monkeypatch.setattr(disk_room, "committed_steps", lambda folder: [])
    assert disk_room.writes(short, model, cfg.engine)[0].nbytes == 2 * size


@pytest.mark.parametrize("keep, every, steps", [(1, 1, 7), (1, 2, 8), (2, 1, 7)])
def test_the_peak_is_what_the_checkpointer_holds(tmp_path, monkeypatch, keep, every, steps):
    """Count the checkpoints on disk as each save starts (after the prune of the one before), each save committed
    before the next step's metrics (waited for: a fast disk, the worst case): the peak is ``peak_checkpoints``, and
    the end prunes back to ``keep``."""
    seen = []
    probe, save = manager.probe_writable, manager.Checkpointer.save

    def counting(root, name):
        seen.append(len(committed_steps(root)) + 1)  # those committed, and the one about to be written
        probe(root, name)
    monkeypatch.setattr(manager, "probe_writable", counting)
    monkeypatch.setattr(manager.Checkpointer, "save",
                        lambda self, engine, **kw: save(self, engine, **{**kw, "wait": True}))
    ck = tmp_path / "ck"
    fit(Decoder(CFG, rngs=nnx.Rngs(0)), data(), adamw(1e-3), engine=EngineConfig(micro_batches=2),
        train=TrainConfig(steps=steps, log_every=0, checkpoint_dir=str(ck), checkpoint_every=every,
                          checkpoint_keep=keep))
    assert max(seen) == disk_room.peak_checkpoints(keep, every), seen
    assert len(committed_steps(ck)) == keep


# ---------------------------------------------------------------------- (b) the disk tier
def test_the_disk_tier_is_counted_on_its_disk(tmp_path, monkeypatch):
    tier_dir = tmp_path / "tier"
    cfg, model = _cfg(tmp_path, "train.checkpoint_every=2", "train.steps=10")
    engine = dataclasses.replace(cfg.engine, disk_parts=2, disk_dir=str(tier_dir))
    moments = plan(model, engine, 4, 32, detect=False).disk  # the memory plan's figure: m and v of 2 blocks
    tier = disk_room.disk_tier_bytes(model, engine)
    assert moments > 0 and moments <= tier < moments + 2**20  # and the last chunks' padding
    ck, on_disk = disk_room.writes(cfg.train, model, engine)
    assert on_disk == (tier_dir, tier, on_disk.what, "engine.disk_dir") and "engine.disk_parts" in on_disk.what
    assert disk_room.disk_tier_bytes(model, cfg.engine) == 0
    assert len(disk_room.writes(cfg.train, model, cfg.engine)) == 1
    # one disk: the checkpoints fit alone, not beside the tier's files
    monkeypatch.setattr(disk_room, "free_space", lambda folder: (ck.nbytes + tier - 1, 7))
    with pytest.raises(ValueError, match="not enough disk for this run: .*checkpoints.*; the disk tier's files") as e:
        disk_room.check_disk_room(cfg.train, model, engine)
    assert "engine.disk_dir" in str(e.value)
    disk_room.check_disk_room(cfg.train, model, dataclasses.replace(engine, disk_parts=0))  # without it: fits
    # two disks: each fits what goes on it
    monkeypatch.setattr(disk_room, "free_space",
                        lambda folder: (tier, 8) if Path(folder) == tier_dir else (ck.nbytes, 7))
    disk_room.check_disk_room(cfg.train, model, engine)


@pytest.mark.usefixtures("lib")
def test_the_disk_tier_bytes_are_its_files(tmp_path, monkeypatch):
    """What ``disk_tier_bytes`` says is what the tier's files take, the last chunk of each leaf padded included
    (small chunks here, so that every leaf has a partial one)."""
    monkeypatch.setattr(disk_tier, "CHUNK_BYTES", 3000)
    engine_cfg = EngineConfig(disk_parts=2, disk_dir=str(tmp_path))
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), adamw(1e-3), engine_cfg)
    for b in make_batches(2, vocab=TINY3.vocab_size):
        engine.step([b]).resolve()
    engine.sync()
    files = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p.name not in ("zarr.json", ".lock"))
    moments = plan(TINY3, engine_cfg, 2, 16, detect=False).disk
    assert disk_room.disk_tier_bytes(TINY3, engine_cfg) == files > moments
    engine.close()


# ---------------------------------------------------------------------- (c) sizes said in a unit that says them
@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"),
                                     (3 * 2**30, "3.0 GiB"), (2 * 2**40, "2.0 TiB")])
def test_format_size_picks_the_unit(n, text):
    assert format_size(n) == text


def test_a_small_run_is_refused_in_small_units(tmp_path, monkeypatch):
    cfg, model = _cfg(tmp_path, "train.checkpoint_every=2", "train.steps=10")
    size = disk_room.checkpoint_bytes(model, cfg.engine)
    monkeypatch.setattr(disk_room, "free_space", lambda folder: (size, 7))
    with pytest.raises(ValueError) as e:
        disk_room.check_disk_room(cfg.train, model, cfg.engine)
    assert "0.0 GiB" not in str(e.value) and f"need {format_size(4 * size)} on one disk, which has " \
        f"{format_size(size)} free" in str(e.value)
    assert "0.0 GiB" not in "".join(disk_room.disk_lines(cfg.train, model, cfg.engine))


# ---------------------------------------------------------------------- (d) read-only and special file systems
def _failing_mkdir(monkeypatch, code: int):
    """``os.mkdir`` fails with ``code`` for the write probe of ``output_paths``, as a read-only mount would."""
    real = os.mkdir

    def mkdir(path, *args, **kw):
        if ".megatrain-path-probe-" in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, *args, **kw)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("code, said", [(errno.EROFS, "read-only file system"), (errno.EACCES, "no permission"),
                                        (errno.ENOSPC, "no space or inodes left")])
def test_an_output_path_that_cannot_be_written_says_why(tmp_path, monkeypatch, code, said):
    _failing_mkdir(monkeypatch, code)
    with pytest.raises(OutputPathError, match=f"it cannot be created in {tmp_path} \\({said}") as e:
        check_output_path("train.export_hf", tmp_path / "a" / "hf", True)
    assert "train.export_hf" in str(e.value) and ("remount" in str(e.value)) == (code == errno.EROFS)
    (tmp_path / "run").mkdir()
    with pytest.raises(OutputPathError, match=f"it cannot be written \\({said}"):
        check_output_path("train.run_dir", tmp_path / "run", True)


def test_a_read_only_mount_is_said_whatever_the_errno(tmp_path, monkeypatch):
    """The file system's own flag (``statvfs``) names a read-only mount, also for a file that exists, which is not
    opened: ``os.access`` says no and the mount says why."""
    real = os.statvfs

    class ReadOnly:
        def __init__(self, path):
            self._st = real(path)

        def __getattr__(self, name):
            return os.ST_RDONLY if name == "f_flag" else getattr(self._st, name)
    monkeypatch.setattr(os, "statvfs", ReadOnly)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(OutputPathError, match=r"it cannot be written \(read-only file system\)"):
        check_output_path("train.run_dir (its metrics.jsonl)", tmp_path / "metrics.jsonl", False)
    _failing_mkdir(monkeypatch, errno.EACCES)
    with pytest.raises(OutputPathError, match=r"\(read-only file system\)"):
        check_output_path("train.run_dir", tmp_path / "run", True)


def test_a_writable_folder_passes_and_the_probe_leaves_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    check_output_path("train.run_dir", tmp_path / "run", True)
    check_output_path("train.export_hf", tmp_path / "new" / "hf", True)
    assert [p.name for p in tmp_path.rglob("*")] == ["run"]


@pytest.mark.skipif(not PROC, reason="no /proc here")
def test_proc_is_said_as_a_special_file_system_not_a_full_disk(tmp_path):
    assert free_space(Path("/proc/megatrain-nowhere")) is None  # no size: its 0 bytes free mean nothing
    with pytest.raises(OutputPathError, match=r"cannot be created in /proc \(a special file system"):
        check_output_path("train.checkpoint_dir", Path("/proc/megatrain-nowhere/ck"), True)
    cfg, model = _cfg(tmp_path, "train.checkpoint_every=2", "train.steps=10",
                      "train.checkpoint_dir=/proc/megatrain-nowhere/ck")
    with pytest.raises(OutputPathError, match=r"checkpoints.*in /proc/megatrain-nowhere/ck \(train.checkpoint_dir\), "
                                              r"but nothing can be created in /proc \(a special file system") as e:
        disk_room.check_disk_room(cfg.train, model, cfg.engine)
    assert "not enough disk" not in str(e.value)
    engine = dataclasses.replace(cfg.engine, disk_parts=1, disk_dir="/proc/megatrain-nowhere/tier")
    cfg, model = _cfg(tmp_path, "train.steps=10")
    with pytest.raises(OutputPathError, match=r"the disk tier's files .*\(engine.disk_dir\).*special file system.*"
                                              r"Set engine.disk_dir to a folder on a disk"):
        disk_room.check_disk_room(cfg.train, model, engine)
    assert "CANNOT BE WRITTEN (a special file system" in disk_room.disk_lines(cfg.train, model, engine)[0]


def test_a_read_only_checkpoint_folder_is_refused_at_start_as_read_only(tmp_path, monkeypatch, capsys):
    """Through ``megatrain-jax train``: exit 2, said as a read-only file system, nothing trained."""
    _failing_mkdir(monkeypatch, errno.EROFS)
    run = tmp_path / "run"
    assert main(["train", *TINY_RUN, "train.checkpoint_every=2", "train.steps=2", f"train.run_dir={run}"]) == 2
    out, err = capsys.readouterr()
    assert "read-only file system" in err and "not enough disk" not in err and "no permission" not in err, err
    assert not run.exists()


@pytest.mark.parametrize("where", ["run", "checkpoints"])
def test_an_export_into_the_run_folder_or_its_checkpoint_folder_is_refused(tmp_path, where):
    """The export's config.json and weights among the run's own files (``convert`` of the checkpoint folder would
    then read the export): refused before anything is written, naming a folder of its own."""
    from megatrain_jax.cli.output_paths import check_output_paths
    from megatrain_jax.cli.run_config import TrainSection
    run = tmp_path / "run"
    folder = run if where == "run" else run / "checkpoints"
    t = TrainSection(run_dir=str(run), checkpoint_every=2, export_hf=str(folder))
    with pytest.raises(OutputPathError, match=f"is the folder of train.run_dir.*such as {folder / 'hf'}"):
        check_output_paths(t)
    check_output_paths(TrainSection(run_dir=str(run), checkpoint_every=2, export_hf=str(run / "hf")))
    assert not run.exists()
