"""A newcomer's first fine-tune (docs/fine_tuning.md, "A first fine-tune on a tiny model"): the script writes a
tiny random Llama folder with a tokenizer and a chat template, chat data and an SFT config, and
``megatrain-jax train`` runs that config on a CPU and exports the fine-tuned model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_hf.py"


def test_the_tiny_hf_folder_fine_tunes_on_a_cpu(tmp_path, capsys):
    from megatrain_jax.cli import main
    from megatrain_jax.data.instruct import ChatTokenizer
    from megatrain_jax.hf import load_hf
    spec = importlib.util.spec_from_file_location("make_tiny_hf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path / "tiny"), "--examples", "60", "--steps", "4"]) == 0
    out = tmp_path / "tiny"
    model = out / "model"
    assert {p.name for p in model.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json"}
    cfg, io, blocks = load_hf(model, dtype="float32")
    assert cfg.family == "llama" and len(blocks) == cfg.layers == 2
    chat = ChatTokenizer.from_folder(model)  # as train reads it: the template renders the script's chats
    first = json.loads((out / "chat.jsonl").read_text().splitlines()[1])
    assert chat.render(first["messages"], False).startswith("<|im_start|>user\nSpell river backwards.<|im_end|>")
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
    assert len((out / "chat.jsonl").read_text().splitlines()) == 60
    capsys.readouterr()

    status = main(["train", "--config", str(out / "sft.toml"), f"data.cache_dir={tmp_path / 'cache'}",
                   "log.tensorboard=false", "train.eval_every=2"])
    assert status == 0, capsys.readouterr().err
    run = out / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and np.isfinite(losses).all()
    assert any("eval_loss" in r for r in records)
    assert (run / "hf" / "model.safetensors").exists() and (run / "hf" / "tokenizer.json").exists()
    assert json.loads((run / "hf" / "tokenizer_config.json").read_text())["chat_template"] == config["chat_template"]
    # plan reads the chats with the folder's tokenizer, as train does, and counts attention within them (a 16-bit
    # model on an H200: cuDNN's packed layout)
    capsys.readouterr()
    assert main(["plan", "--config", str(out / "sft.toml"), f"data.cache_dir={tmp_path / 'cache'}",
                 "model.dtype=bfloat16", "--gpu", "H200", "--host-gib", "64", "--gpu-gib", "80"]) == 0
    plan_out = capsys.readouterr().out
    assert "packed rows' attention within their runs" in plan_out and "cannot be read" not in plan_out, plan_out


def test_an_export_onto_the_model_it_fine_tunes_is_refused_at_start(tmp_path, capsys):
    """``train.export_hf`` naming ``model.hf_checkpoint`` (overwrite or not) would replace the base model with the
    fine-tune: refused before anything loads, the base model untouched."""
    from megatrain_jax.cli import main
    spec = importlib.util.spec_from_file_location("make_tiny_hf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path / "tiny"), "--examples", "8", "--steps", "2"]) == 0
    model = tmp_path / "tiny" / "model"
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    capsys.readouterr()
    status = main(["train", "--config", str(tmp_path / "tiny" / "sft.toml"), f"data.cache_dir={tmp_path / 'cache'}",
                   "log.tensorboard=false", f"train.export_hf={model}", "train.export_overwrite=true"])
    assert status != 0 and "is the folder the model was loaded from" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
