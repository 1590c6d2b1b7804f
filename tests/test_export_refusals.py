"""Exports that lose nothing already saved and say what is wrong before writing: a folder of other things is never
swapped (an entry that cannot be moved is never deleted), the tokenizer files all come along and none stays from a
replaced model, a dtype given as a numpy or JAX type is the one written, and a disk without room, a mount point
holding a model or the folder the model came from are refused before anything is written."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export_folder import params, same  # noqa: E402

from megatrain_jax import preset  # noqa: E402
from megatrain_jax.hf import export_folder, load_hf, save_hf  # noqa: E402
from megatrain_jax.hf.export_folder import ExportExistsError, check_target, tokenizer_files  # noqa: E402
from megatrain_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402

CFG = preset("tiny", layers=1)


def busy_entry(monkeypatch, name: str) -> None:
    """``os.rename`` of an entry called ``name`` fails as a mount point's does (EBUSY): a bind mount in the folder."""
    rename = os.rename

    def refuse(src, dst, *args, **kwargs):
        if Path(src).name == name:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), os.fspath(src))
        return rename(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "rename", refuse)


def test_an_export_into_a_folder_of_other_things_leaves_it_in_place_with_all_of_them(tmp_path, monkeypatch):
    """``to_hf(model, "~/models")``, a folder of other models with a mount in it: the folder is not swapped for a
    new one (it keeps its inode, and the entries that cannot be renamed are never touched), and the export lands."""
    models = tmp_path / "models"
    (models / "data").mkdir(parents=True)
    (models / "data" / "corpus.bin").write_text("precious")
    (models / "llama").mkdir()
    (models / "llama" / "model.safetensors").write_text("another model")
    (models / "notes.txt").write_text("mine")
    inode = models.stat().st_ino
    busy_entry(monkeypatch, "data")
    io, blocks = params(CFG, 0)
    save_hf(models, CFG, io, blocks, dtype="float32")
    monkeypatch.undo()
    assert (models / "data" / "corpus.bin").read_text() == "precious"
    assert (models / "notes.txt").read_text() == "mine"
    assert (models / "llama" / "model.safetensors").read_text() == "another model"
    assert models.stat().st_ino == inode
    assert same(load_hf(models, dtype="float32")[1], io)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    assert not [p for p in models.iterdir() if p.name.startswith(".")]


def test_a_replaced_models_folder_entry_that_cannot_be_moved_back_is_kept_and_named(tmp_path, monkeypatch):
    """A model folder replaced (overwrite) whose own subfolder cannot be moved into the new one (a mount): the error
    names where it is, and nothing of the user's is deleted."""
    folder = tmp_path / "export"
    save_hf(folder, CFG, *params(CFG, 1), dtype="float32")
    (folder / "data").mkdir()
    (folder / "data" / "corpus.bin").write_text("precious")
    (folder / "notes.txt").write_text("mine")
    busy_entry(monkeypatch, "data")
    new = params(CFG, 2)
    with pytest.raises(OSError, match="could not be moved back") as caught:
        save_hf(folder, CFG, *new, dtype="float32", overwrite=True)
    monkeypatch.undo()
    assert same(load_hf(folder, dtype="float32")[1:], new)  # the new model is whole in place
    assert (folder / "notes.txt").read_text() == "mine"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".export.partial-")]
    assert len(kept) == 1 and str(kept[0]) in str(caught.value)
    assert (kept[0] / "data" / "corpus.bin").read_text() == "precious"


def test_a_mount_point_holding_a_model_is_refused_before_the_export_is_written(tmp_path, monkeypatch):
    """A model in a mount point (a container's volume) cannot be swapped for a new folder, and a staging folder
    beside it lies on another disk: refused at once, saying to export into a folder inside it."""
    folder = tmp_path / "volume"
    save_hf(folder, CFG, *params(CFG, 1), dtype="float32")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == folder or ismount(p))
    with pytest.raises(ExportExistsError, match="mount point holding a model.*Export to a new folder inside it"):
        save_hf(folder, CFG, *params(CFG, 2), dtype="float32", overwrite=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"]


@pytest.mark.parametrize("dtype, code, name", [(np.dtype("float32"), "F32", "float32"), (np.float32, "F32", "float32"),
                                               (jnp.bfloat16, "BF16", "bfloat16")])
def test_a_dtype_given_as_a_numpy_or_jax_type_is_the_one_written(tmp_path, dtype, code, name):
    """``to_hf(model, dir, dtype=np.float32)`` wrote every tensor and then failed on config.json (np.dtype), or was
    refused as unsupported (np.float32, jnp.bfloat16): each is now the dtype written, and config.json says it."""
    folder = tmp_path / "out"
    save_hf(folder, CFG, *params(CFG, 0), dtype=dtype)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == name
    assert {t.dtype for t in SafetensorsFile(folder / "model.safetensors").tensors.values()} == {code}
    for other in ("float16", "fp32", np.float64):  # and any other is refused before anything is written
        with pytest.raises(ValueError, match="use 'bfloat16' or 'float32'"):
            save_hf(tmp_path / "other", CFG, *params(CFG, 0), dtype=other)
    assert not (tmp_path / "other").exists()


def sentencepiece_tokenizer(folder: Path) -> Path:
    """A tokenizer folder as Llama 2, Mistral and Gemma ship it, and Qwen's BPE files."""
    folder.mkdir()
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt"):
        (folder / name).write_text(f"{name} of {folder.name}")
    return folder


def test_every_tokenizer_file_goes_with_the_export_and_none_stays_from_a_replaced_model(tmp_path):
    """tokenizer.model (llama.cpp's converter needs it), vocab.json, merges.txt and added_tokens.json go along; an
    export with another tokenizer over that model takes the old model's away, as it does tokenizer.json."""
    folder = tmp_path / "export"
    source = sentencepiece_tokenizer(tmp_path / "base")
    save_hf(folder, CFG, *params(CFG, 0), extra_files=tokenizer_files(source, given=True))
    for name in ("tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt"):
        assert (folder / name).read_text() == f"{name} of base", name
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("tokenizer.json of other")
    save_hf(folder, CFG, *params(CFG, 1), overwrite=True, extra_files=tokenizer_files(other, given=True))
    assert (folder / "tokenizer.json").read_text() == "tokenizer.json of other"
    for name in ("tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        assert not (folder / name).exists(), f"{name} of the replaced model stayed"


def test_a_sentencepiece_tokenizer_alone_is_not_warned_about_as_no_tokenizer(tmp_path, recwarn):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.model").write_text("sp")
    (folder / "tokenizer_config.json").write_text("{}")
    assert [p.name for p in tokenizer_files(folder, given=True)] == ["tokenizer.model", "tokenizer_config.json"]
    assert not [w for w in recwarn if "loads no tokenizer" in str(w.message)]


def test_a_disk_without_room_for_the_export_is_refused_before_it_is_written(tmp_path, monkeypatch):
    """``to_hf`` and ``save_hf`` asked the disk nothing: a 70B export wrote until the disk was full. Now it is
    refused at once, an OSError (ENOSPC, so a run's export guard says the disk is full) naming both sizes."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage._replace(free=1000))
    with pytest.raises(OSError, match=r"needs about .* but its disk has 1000 B free; nothing was written") as caught:
        save_hf(tmp_path / "out", CFG, *params(CFG, 0))
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_the_folder_the_model_came_from_is_never_the_export_target(tmp_path):
    """``train model.hf_checkpoint=X train.export_hf=X train.export_overwrite=true`` would replace the base model
    with the fine-tune (and the refusal without overwrite said to set it): refused either way, through a link too."""
    base = tmp_path / "llama"
    save_hf(base, CFG, *params(CFG, 0))
    (tmp_path / "link").symlink_to(base.name)
    for overwrite in (False, True):
        with pytest.raises(ExportExistsError, match="the folder the model was loaded from .* Export to another folder"):
            check_target(tmp_path / "link", overwrite, "set train.export_overwrite=true", source=base)
    check_target(tmp_path / "sft", False, "set train.export_overwrite=true", source=base)


def test_a_path_through_a_file_is_refused_before_the_source_is_read(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ExportExistsError, match=r"file is a file, not a folder; nothing was written"):
        check_target(tmp_path / "file" / "out", False, "add --force")


def test_a_killed_exports_leftovers_are_cleared_and_a_replaced_folders_files_kept_and_named(tmp_path):
    """A SIGKILLed export leaves its hidden staging folder (gigabytes): the next export to that folder removes it.
    One that holds anything but an export's files (a replaced folder's, killed while moved back) is named instead."""
    dead = 4194303  # past any pid the kernel hands out (pid_max's ceiling)
    with pytest.raises(ProcessLookupError):
        os.kill(dead, 0)
    stale = tmp_path / f".export.partial-{dead}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (stale / "model-00002-of-00002.safetensors.tmp").write_bytes(b"x" * 1000)
    users = tmp_path / f".export.partial-{dead}-0a1b2c3d"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=f"holds {users.name}, left by an export that was killed"):
        save_hf(tmp_path / "export", CFG, *params(CFG, 0))
    assert not stale.exists() and (users / "notes.txt").read_text() == "mine"
    assert export_folder.holds_model(tmp_path / "export")


def test_every_file_of_an_export_is_on_the_disk_before_it_is_put_in_place(tmp_path, monkeypatch):
    """No file was flushed: a power cut after the rename could leave a folder that looks whole (config.json, index)
    with shards the disk never got. Each file, and the staging folder, is flushed before the folder is put in place."""
    synced, fsync = set(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    publish = export_folder.publish

    def check_then_publish(staged, folder):
        unsynced = [p.name for p in [*staged.iterdir(), staged] if str(p) not in synced]
        assert not unsynced, f"put in place before these reached the disk: {unsynced}"
        return publish(staged, folder)
    monkeypatch.setattr(export_folder, "publish", check_then_publish)
    monkeypatch.setattr("megatrain_jax.hf.export.publish", check_then_publish)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    save_hf(tmp_path / "out", CFG, *params(CFG, 0), max_shard_bytes=20_000, extra_files=tokenizer_files(tok))
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
