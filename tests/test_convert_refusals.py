"""``megatrain-jax convert`` met with bad paths and damaged inputs: each is refused with exit status 2 and a message
that says what to give, before anything is written, and a failed conversion leaves nothing half-written behind."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli import convert as convert_module
from megatrain_jax.cli.commands import main
from megatrain_jax.hf import load_hf

HF_LLAMA = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"


def test_an_npz_output_that_is_a_folder_is_refused_as_one_forced_or_not(tmp_path, capsys):
    folder = tmp_path / "out.npz"
    folder.mkdir()
    (folder / "mine.txt").write_text("kept")
    for force in ([], ["--force"]):
        assert main(["convert", str(HF_LLAMA), str(folder), *force]) == 2
        err = capsys.readouterr().err
        assert f"{folder} is a folder, not a .npz file" in err and "add --force" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz"] and (folder / "mine.txt").read_text() == "kept"


def _npz(tmp_path: Path, name: str, drop: str = "", corrupt: bool = False) -> Path:
    whole = tmp_path / "whole.npz"
    if not whole.exists():
        assert main(["convert", str(HF_LLAMA), str(whole)]) == 0
    with np.load(whole) as z:
        arrays = {k: z[k] for k in z.files if not (drop and k.startswith(drop))}
    path = tmp_path / name
    np.savez(path, **arrays)
    if corrupt:  # a byte of a tensor's data flipped: the zip's CRC no longer matches
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("drop, corrupt, match", [
    ("blocks/1/", False, "has no parameters of block 1 (its config has 2 layers)"),
    ("io/", False, "has no parameters of io (embedding, final norm, head)"),
    ("", True, "is damaged (Bad CRC-32 for file"),
])
def test_an_npz_missing_a_part_or_damaged_says_so_without_a_traceback(tmp_path, capsys, drop, corrupt, match):
    src = _npz(tmp_path, "bad.npz", drop, corrupt)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert match in err and "make it again" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_an_orbax_output_that_is_not_new_is_refused_before_the_source_is_read(tmp_path, capsys, monkeypatch):
    import megatrain_jax.hf as hf
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    read = []
    monkeypatch.setattr(hf, "load_hf", lambda *a, **k: read.append(a) or pytest.fail("the source was read"))
    for dst, match in (("taken", "is not empty"), ("file", "is a file, not a folder")):
        assert main(["convert", str(HF_LLAMA), str(tmp_path / dst), "--to", "orbax"]) == 2
        assert f"{tmp_path / dst} {match}" in capsys.readouterr().err
    assert not read and (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_a_failed_orbax_output_leaves_nothing_that_blocks_the_retry(tmp_path, capsys, monkeypatch):
    """A conversion to Orbax that fails while writing (a full disk) leaves no folder behind, so the same command
    succeeds once there is room (Orbax's half-written params.orbax-checkpoint-tmp folder made it "not empty")."""
    import megatrain_jax.checkpoint as checkpoint
    save_params = checkpoint.save_params

    def full_disk(path, *args):
        (Path(path) / "params.orbax-checkpoint-tmp").mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "orbax"
    monkeypatch.setattr(checkpoint, "save_params", full_disk)
    assert main(["convert", str(HF_LLAMA), str(out), "--to", "orbax"]) == 2
    assert "the disk is full" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(checkpoint, "save_params", save_params)
    assert main(["convert", str(HF_LLAMA), str(out), "--to", "orbax"]) == 0
    assert main(["convert", str(out), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "orbax"]


def test_a_folder_that_holds_no_checkpoint_says_what_to_give(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    no_config = tmp_path / "download"
    shutil.copytree(HF_LLAMA, no_config)
    (no_config / "config.json").unlink()
    cut = tmp_path / "ck"
    (cut / "5.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    broken = tmp_path / "broken"
    (broken / "7" / "meta").mkdir(parents=True)  # a step folder without its state
    cases = [(broken, f"{broken} holds no whole checkpoint, and nothing was read from it (step 7: "),
             (run, f"{run} is a run folder, not a checkpoint: its checkpoints are in {run / 'checkpoints'}: "
                   f"megatrain-jax convert {run / 'checkpoints'}"),
             (no_config, f"{no_config} holds Hugging Face weights (model.safetensors) but no config.json"),
             (cut, f"{cut} holds only saves that never finished (5.orbax-checkpoint-tmp-1700000000)")]
    for src, match in cases:
        assert main(["convert", str(src), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert match in err, err
    assert not (tmp_path / "out").exists()


def test_an_export_through_a_symlinked_folder_replaces_the_model_where_the_link_points(tmp_path, capsys):
    """``models/current -> v1``: a forced export to ``current`` writes into ``v1`` (the link stays a link), keeps
    ``v1``'s own files there, and leaves no ``.current.partial-PID`` link beside it."""
    real, link = tmp_path / "v1", tmp_path / "current"
    assert main(["convert", str(HF_LLAMA), str(real)]) == 0
    (real / "NOTES.md").write_text("mine")
    link.symlink_to(real.name)
    assert main(["convert", str(HF_LLAMA), str(link), "--force", "--dtype", "float32"]) == 0
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["current", "v1"]
    assert (real / "NOTES.md").read_text() == "mine"
    assert json.loads((real / "config.json").read_text())["torch_dtype"] == "float32"
    _, io, _ = load_hf(real, dtype="float32")
    _, want, _ = load_hf(HF_LLAMA, dtype="float32")
    np.testing.assert_array_equal(io["embedding"], want["embedding"])


@pytest.mark.parametrize("to, dst, size", [("hf", "hf", "bfloat16, 2 bytes"), ("npz", "out.npz", "float32, 4 bytes"),
                                           ("orbax", "orbax", "float32, 4 bytes")])
def test_an_output_its_disk_cannot_hold_is_refused_before_it_is_written(tmp_path, capsys, monkeypatch, to, dst, size):
    monkeypatch.setattr(convert_module, "free_space", lambda folder: (1000, 0))
    assert main(["convert", str(HF_LLAMA), str(tmp_path / dst), "--to", to]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / dst} needs about" in err and f"parameters in {size} each)" in err and "1000 B free" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_npz_output_with_a_trailing_slash_is_refused_saying_which_was_meant(tmp_path, capsys):
    """``convert SRC out.npz/`` would write a Hugging Face folder named out.npz: asked which was meant instead."""
    out = tmp_path / "out.npz"
    assert main(["convert", str(HF_LLAMA), f"{out}/"]) == 2
    err = capsys.readouterr().err
    assert f"give {out} for a .npz file, or add --to hf" in err and "Traceback" not in err, err
    assert not out.exists()
