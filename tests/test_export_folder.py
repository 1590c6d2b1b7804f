"""Exports that never clobber (issue 32): a Hugging Face export into a folder holding a model is refused
unless asked to overwrite; then the model's files are replaced as a set (the tokenizer's too: never left
from the folder's past), the folder's other files are kept, and a SIGKILL at any moment of the re-export
leaves the old model or the new one whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, preset
from megatrain_jax.cli.commands import main
from megatrain_jax.hf import load_hf, save_hf

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# About 100 MB of float32: an export that takes a while to write, so that kills land inside it.
BIG = preset("tiny", vocab_size=4096, hidden=512, ffn=1024, layers=8, heads=8, kv_heads=4, max_positions=128)


def params(cfg, seed: int):
    """Random parameters of ``cfg`` as (io, [blocks]) numpy pure dicts, the same for the same seed."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    tree = lambda module: jax.tree.map(  # noqa: E731
        lambda a: rng.standard_normal(a.shape).astype(np.float32), nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    return tree(model.io), [tree(b) for b in model.blocks]


def same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def test_a_model_is_replaced_only_when_asked_and_as_a_whole(tmp_path, capsys):
    cfg = preset("tiny", layers=2)
    folder = tmp_path / "export"
    old, new = params(cfg, 1), params(cfg, 2)
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"new": true}')
    save_hf(folder, cfg, *old, dtype="float32", max_shard_bytes=20_000)  # sharded
    (folder / "tokenizer_config.json").write_text("{}")  # a tokenizer file of the folder's past
    (folder / "NOTES.txt").write_text("mine")  # and a file of the user's
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FileExistsError, match="already holds a model"):
        save_hf(folder, cfg, *new, dtype="float32")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written
    save_hf(folder, cfg, *new, dtype="float32", overwrite=True, extra_files=[tok])
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["NOTES.txt", "config.json", "model.safetensors", "tokenizer.json"]  # no old shard, no old
    assert same(load_hf(folder, dtype="float32")[1:], new)                                # tokenizer_config
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # nothing left beside it
    # convert: refused without --force, as a whole with it
    npz = tmp_path / "m.npz"
    assert main(["convert", str(folder), str(npz)]) == 0
    capsys.readouterr()
    assert main(["convert", str(npz), str(folder)]) == 2
    assert "add --force" in capsys.readouterr().err
    assert main(["convert", str(npz), str(folder), "--force", "--dtype", "float32"]) == 0
    assert same(load_hf(folder, dtype="float32")[1:], new) and (folder / "NOTES.txt").exists()


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from test_export_folder import BIG, params
from megatrain_jax.hf import save_hf
new = params(BIG, 2)
print("start", flush=True)
save_hf({folder!r}, BIG, *new, dtype="float32", overwrite=True)
print("done", flush=True)
time.sleep(60)
"""


def test_a_kill_at_any_moment_of_a_re_export_leaves_one_model_whole(tmp_path):
    folder = tmp_path / "export"
    old, new = params(BIG, 1), params(BIG, 2)
    t = time.perf_counter()
    save_hf(folder, BIG, *old, dtype="float32", max_shard_bytes=30_000_000)
    took = time.perf_counter() - t
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    seen = set()
    for fraction in (0.0, 0.35, 0.7, None):  # None: once the child says the export is done
        child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(TESTS), folder=str(folder))],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert child.stdout.readline().strip() == "start", child.communicate()[0]
        if fraction is None:  # a loaded machine may export slower than ``took``: wait for the swap itself
            assert child.stdout.readline().strip() == "done", child.communicate()[0]
        else:
            time.sleep(fraction * took)
        child.send_signal(signal.SIGKILL)
        child.wait()
        got = load_hf(folder, dtype="float32")[1:]
        is_old, is_new = same(got, old), same(got, new)
        assert is_old or is_new, f"killed {fraction} x {took:.2f} s into the export: neither model whole"
        seen.add("old" if is_old else "new")
        if is_new:  # the next kill needs the old model in place again
            save_hf(folder, BIG, *old, dtype="float32", max_shard_bytes=30_000_000, overwrite=True)
    assert seen == {"old", "new"}, seen  # the kills landed before and after the swap


def test_a_folder_without_a_model_keeps_every_file_the_export_does_not_replace(tmp_path):
    """A folder holding only a tokenizer (and notes) is no model: an export into it adds the weights and config and
    keeps the user's tokenizer files, which it does not bring itself."""
    cfg = preset("tiny", layers=1)
    io, blocks = params(cfg, 0)
    folder = tmp_path / "mytok"
    folder.mkdir()
    mine = {"tokenizer.json": '{"mine": 1}', "tokenizer_config.json": '{"mine": 2}', "notes.txt": "n"}
    for name, text in mine.items():
        (folder / name).write_text(text)
    save_hf(folder, cfg, io, blocks, dtype="float32")
    for name, text in mine.items():
        assert (folder / name).read_text() == text, name
    assert (folder / "config.json").exists()
    _, io2, _ = load_hf(folder, dtype="float32")
    assert same(io2, io)


def test_convert_never_overwrites_an_npz_unless_forced(tmp_path, capsys):
    """``convert`` to an existing .npz is refused (exit 2, the file unchanged) without --force, and the .npz suffix
    numpy adds is the path it reports."""
    src = TESTS / "fixtures" / "hf" / "llama"
    out = tmp_path / "out.npz"
    assert main(["convert", str(src), str(out)]) == 0
    out.write_bytes(b"the user's file")
    assert main(["convert", str(src), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"the user's file"
    assert main(["convert", str(src), str(out), "--force"]) == 0 and out.read_bytes() != b"the user's file"
    assert main(["convert", str(src), str(tmp_path / "plain"), "--to", "npz"]) == 0
    assert f"wrote {tmp_path / 'plain.npz'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "plain.npz"]  # no partial file left


def test_a_re_export_without_a_tokenizer_keeps_the_same_models_and_drops_anothers_saying_so(tmp_path):
    """The same model written again (another dtype, say) with no tokenizer keeps the folder's tokenizer: a folder
    transformers loads whole. A model of another vocabulary size takes the old tokenizer away. Both say so."""
    cfg = preset("tiny", layers=1)
    folder = tmp_path / "m"
    save_hf(folder, cfg, *params(cfg, 0), dtype="float32")
    (folder / "tokenizer.json").write_text('{"mine": 1}')
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.warns(UserWarning, match="kept the one the folder held .*tokenizer.json"):
        save_hf(folder, cfg, *params(cfg, 1), overwrite=True)
    assert (folder / "tokenizer.json").read_text() == '{"mine": 1}' and (folder / "tokenizer_config.json").exists()
    other = preset("tiny", layers=1, vocab_size=cfg.vocab_size * 2)
    with pytest.warns(UserWarning, match="removed the tokenizer of the model it held"):
        save_hf(folder, other, *params(other, 0), overwrite=True)
    assert not (folder / "tokenizer.json").exists()


def test_a_tokenizer_named_for_an_export_must_be_one(tmp_path, capsys):
    """to_hf(tokenizer=...) and convert --tokenizer: a path that is missing, a file, or a folder without
    tokenizer.json is refused before anything is written; a training checkpoint converted with --tokenizer gets it,
    and without one the output says it has none."""
    from megatrain_jax import to_hf
    from megatrain_jax.hf import from_hf
    src = TESTS / "fixtures" / "hf" / "llama"
    model = from_hf(src)
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, match in ((tmp_path / "nowhere", "does not exist"), (src / "config.json", "is a file"),
                       (empty, "holds none of tokenizer.json")):
        with pytest.raises((FileNotFoundError, ValueError), match=match):
            to_hf(model, tmp_path / "out", tokenizer=bad)
        assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="has no tokenizer.json: the export gets its generation_config.json only"):
        to_hf(model, tmp_path / "generation_only", tokenizer=src)  # a model folder without a tokenizer
    npz = tmp_path / "m.npz"
    assert main(["convert", str(src), str(npz)]) == 0
    capsys.readouterr()
    assert main(["convert", str(npz), str(tmp_path / "bare")]) == 0
    assert "has no tokenizer" in capsys.readouterr().out and not (tmp_path / "bare" / "tokenizer.json").exists()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    assert main(["convert", str(npz), str(tmp_path / "whole"), "--tokenizer", str(tok)]) == 0
    assert (tmp_path / "whole" / "tokenizer.json").exists() and "has no tokenizer" not in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
