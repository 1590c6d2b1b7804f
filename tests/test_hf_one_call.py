"""A Decoder from a Hugging Face folder and back in one call each (``from_hf``, ``to_hf``), and the special
token ids an export keeps (issue 34)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import Batch, Engine, EngineConfig, from_hf, to_hf
from megatrain_jax.cli.convert import convert
from megatrain_jax.hf import UnsupportedConfig, config_from_hf, config_to_hf, read_config
from megatrain_jax.hf import load_hf, save_hf
from megatrain_jax.hf.safetensors_io import SafetensorsFile
from megatrain_jax.models import Decoder, preset
from test_hf import FIXTURES, logits_of, rel_err


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_from_hf_reads_each_tensor_once_and_gives_transformers_logits(name, monkeypatch):
    reads: dict[str, int] = {}
    get = SafetensorsFile.get

    def counted(self, tensor):
        reads[tensor] = reads.get(tensor, 0) + 1
        return get(self, tensor)

    monkeypatch.setattr(SafetensorsFile, "get", counted)
    model = from_hf(FIXTURES / name)
    assert isinstance(model, Decoder) and model.cfg.dtype == "float32"
    assert reads and set(reads.values()) == {1}, {k: v for k, v in reads.items() if v != 1}
    assert rel_err(logits_of(model, FIXTURES / name), np.load(FIXTURES / name / "logits.npy")) < 1e-4


def test_from_hf_takes_the_dtype_and_overrides():
    model = from_hf(FIXTURES / "llama", dtype="bfloat16", loss_chunk_tokens=8)
    assert model.cfg.dtype == "bfloat16" and model.cfg.loss_chunk_tokens == 8
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))  # the master copy stays float32, in host memory
    assert leaves and all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in leaves)


def test_to_hf_round_trip_keeps_logits_and_token_ids(tmp_path):
    model = from_hf(FIXTURES / "llama")
    files = to_hf(model, tmp_path / "out", dtype="float32", tokenizer=FIXTURES / "llama")
    names = {f.name for f in files}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, None)
    # the source folder's generation settings came along as they were
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == (
        FIXTURES / "llama" / "generation_config.json").read_bytes()
    again = from_hf(tmp_path / "out")
    assert rel_err(logits_of(again, FIXTURES / "llama"), np.load(FIXTURES / "llama" / "logits.npy")) < 1e-4
    with pytest.raises(FileExistsError):
        to_hf(model, tmp_path / "out")


def test_to_hf_writes_an_engines_trained_state(tmp_path):
    model = from_hf(FIXTURES / "llama")
    engine = Engine(model, optax.sgd(0.1), EngineConfig())
    rng = np.random.default_rng(0)
    engine.step([Batch.from_windows(rng.integers(0, 96, (2, 9)))]).resolve()
    to_hf(model, tmp_path / "trained", dtype="float32", engine=engine)
    to_hf(model, tmp_path / "untrained", dtype="float32")
    trained, untrained = from_hf(tmp_path / "trained"), from_hf(tmp_path / "untrained")
    engine.write_back(model)
    tokens = FIXTURES / "llama"
    assert rel_err(logits_of(trained, tokens), logits_of(model, tokens)) < 1e-6
    assert rel_err(logits_of(untrained, tokens), logits_of(model, tokens)) > 1e-4
    with pytest.raises(TypeError, match="Decoder"):
        to_hf(engine, tmp_path / "x")


def test_token_ids_are_read_kept_and_written():
    base = json.loads((FIXTURES / "llama" / "config.json").read_text())
    cfg = config_from_hf(dict(base, eos_token_id=[2, 7], pad_token_id=0))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, (2, 7), 0)
    out = config_to_hf(cfg)
    assert (out["bos_token_id"], out["eos_token_id"], out["pad_token_id"]) == (1, [2, 7], 0)
    none = config_to_hf(preset("tiny"))  # a preset sets none: none is written (null, not a family's default)
    assert (none["bos_token_id"], none["eos_token_id"], none["pad_token_id"]) == (None, None, None)
    with pytest.raises(UnsupportedConfig, match="eos_token_id"):
        config_from_hf(dict(base, eos_token_id="</s>"))
    with pytest.raises(ValueError, match="pad_token_id"):
        preset("tiny", pad_token_id=[0, 1])


def test_ids_missing_from_config_json_come_from_generation_config(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "llama"))
    config = json.loads((folder / "config.json").read_text())
    del config["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [2, 3]}))
    cfg = read_config(folder)
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == (2, 3)  # config.json's own ids win


def test_every_export_route_writes_generation_config(tmp_path):
    """save_hf without a tokenizer folder, and convert from a checkpoint of ours, write the ids."""
    cfg, io, blocks = load_hf(FIXTURES / "llama", dtype="float32")
    save_hf(tmp_path / "plain", cfg, io, blocks)
    generation = json.loads((tmp_path / "plain" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    convert(FIXTURES / "llama", tmp_path / "model.npz")
    convert(tmp_path / "model.npz", tmp_path / "from_npz", to="hf")
    config = json.loads((tmp_path / "from_npz" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (tmp_path / "from_npz" / "generation_config.json").exists()
    convert(FIXTURES / "llama", tmp_path / "from_hf", to="hf")  # HF to HF: the source's files come along
    assert (tmp_path / "from_hf" / "generation_config.json").read_bytes() == (
        FIXTURES / "llama" / "generation_config.json").read_bytes()
