"""Hugging Face interop: logits parity with transformers, safetensors I/O, round trips, clear errors.

The fixtures under tests/fixtures/hf were written by scripts/make_hf_fixtures.py with torch +
transformers; the tests here need neither, except the live ones, which ask transformers with torch (``hf_torch``:
in this interpreter or in MEGATRAIN_TORCH_PYTHON, tests/torch_side.py) and skip without it, or fail where CI is set.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from megatrain_jax.families import FAMILIES
from megatrain_jax.hf import (Checkpoint, CheckpointMismatch, SafetensorsError, UnsupportedConfig,
                              config_from_hf, config_to_hf, load_hf, load_hf_into, read_safetensors, save_hf,
                              write_safetensors)
from megatrain_jax.models import Decoder, preset

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# each registered family's fixture (tests/test_families.py: what a new family must pass), and variants of some
NAMES = [family.model_type for family in FAMILIES.values()] + ["llama_tied_rope3", "phi3_longrope", "deepseek_v3_noqlora"]


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def logits_of(model: Decoder, folder: Path) -> np.ndarray:
    """One compiled forward (eager dispatch of every op costs seconds of compiles), at full fp32
    matmul precision so that the parity also holds on a GPU (whose default for fp32 is TF32)."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(jnp.asarray, state)
    with jax.default_matmul_precision("highest"):
        return np.asarray(_forward(graphdef, state, jnp.asarray(np.load(folder / "tokens.npy"))))


def model_from(cfg, io, blocks) -> Decoder:
    """A Decoder holding given pure-dict parameters."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    for part, tree in [(model.io, io)] + list(zip(model.blocks, blocks)):
        state = nnx.state(part, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, tree))
        nnx.update(part, state)
    return model


def assert_mtp_layer_skipped(tmp_path: Path, fixture: str, extra: dict) -> tuple[Path, dict]:
    """A copy of ``fixture`` with ``extra`` tensors of a multi-token-prediction layer added reads with a warning
    that names them and gives the fixture's logits; returns the copy and its original tensors."""
    folder = shutil.copytree(FIXTURES / fixture, tmp_path / fixture)
    tensors = dict(read_safetensors(folder / "model.safetensors"))
    write_safetensors(folder / "model.safetensors", {**tensors, **extra})
    with pytest.warns(UserWarning, match=f"ignoring the {len(extra)} tensors of the multi-token-prediction layer"):
        cfg, io, blocks = load_hf(folder, dtype="float32")
    assert rel_err(logits_of(model_from(cfg, io, blocks), folder), np.load(folder / "logits.npy")) < 1e-4
    return folder, tensors


def concrete_zeros(cfg) -> Decoder:
    """A concrete Decoder (JAX arrays) without paying for eager random init."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))

    def zeros(part):
        return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), nnx.to_pure_dict(nnx.state(part, nnx.Param)))

    return model_from(cfg, zeros(abstract.io), [zeros(b) for b in abstract.blocks])


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def fixture_copy(tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(FIXTURES / name, tmp_path / name))
    return copy


# --- parity with transformers' logits -------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    folder = FIXTURES / name
    cfg, io, blocks = load_hf(folder, dtype="float32")
    assert all(a.dtype == np.float32 and isinstance(a, np.ndarray) for a in jax.tree.leaves((io, blocks)))
    err = rel_err(logits_of(model_from(cfg, io, blocks), folder), np.load(folder / "logits.npy"))
    assert err < 1e-4, f"{name}: relative error {err:.2e} on {jax.default_backend()}"


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_load_hf_into_concrete_and_abstract(name):
    folder = FIXTURES / name
    cfg, _, _ = load_hf(folder, dtype="float32")
    want = np.load(folder / "logits.npy")
    concrete = concrete_zeros(cfg)
    load_hf_into(concrete, folder)
    assert isinstance(concrete.io.embedding[...], jax.Array)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    load_hf_into(abstract, folder)
    assert isinstance(abstract.io.embedding[...], np.ndarray)  # host memory, never a GPU
    for model in (concrete, abstract):
        assert rel_err(logits_of(model, folder), want) < 1e-4


def test_fixtures_are_discriminative():
    """Dropping the sliding window, the llama3 RoPE scaling or LongRoPE's (or taking its short factors where
    transformers takes the long ones), or Gemma 3's window, local RoPE base, global scaling or logit cap changes
    the logits: parity means something."""
    from megatrain_jax.models import RopeScaling
    longrope = RopeScaling(kind="longrope", factor=16.0, original_max_position=8,
                           short_factor=(1.0, 1.1, 1.3, 1.7, 2.2, 3.0), long_factor=(1.0, 1.1, 1.3, 1.7, 2.2, 3.0))
    for name, change in (("mistral", dict(sliding_window=None)), ("llama_tied_rope3", dict(rope_scaling=None)),
                         ("phi3", dict(sliding_window=None)), ("phi3_longrope", dict(rope_scaling=None)),
                         ("phi3_longrope", dict(rope_scaling=longrope)), ("gemma3_text", dict(sliding_window=100)),
                         ("gemma3_text", dict(sliding_rope_theta=None)), ("gemma3_text", dict(rope_scaling=None)),
                         ("gemma3_text", dict(final_logit_softcap=None))):
        folder = FIXTURES / name
        cfg, io, blocks = load_hf(folder, dtype="float32", **change)
        assert rel_err(logits_of(model_from(cfg, io, blocks), folder), np.load(folder / "logits.npy")) > 1e-3


def test_tied_embeddings():
    folder = FIXTURES / "llama_tied_rope3"
    assert "lm_head.weight" not in Checkpoint(folder).names()
    cfg, io, _ = load_hf(folder)
    assert cfg.tie_embeddings and cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position == 64
    assert set(io) == {"embedding", "final_norm"}
    model = concrete_zeros(cfg)
    load_hf_into(model, folder)
    assert model.io.lm_head is None and isinstance(model.io.embedding[...], jax.Array)


def test_tied_checkpoint_with_redundant_lm_head_is_accepted(fixture_copy):
    folder = fixture_copy("qwen3")
    tensors = {k: np.array(v) for k, v in read_safetensors(folder / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    write_safetensors(folder / "model.safetensors", tensors)
    with warnings.catch_warnings():  # a copy of the embedding is dropped without a word
        warnings.simplefilter("error")
        cfg, io, blocks = load_hf(folder, dtype="float32")
    assert rel_err(logits_of(model_from(cfg, io, blocks), folder), np.load(folder / "logits.npy")) < 1e-4


def test_tied_checkpoint_with_a_head_of_its_own_is_loaded_tied_and_said(fixture_copy):
    """tie_word_embeddings = true and an lm_head.weight unlike the embedding: loaded tied, as transformers loads it,
    and the warning names both tensors and the way to the untied head."""
    folder = fixture_copy("qwen3")
    tensors = {k: np.array(v) for k, v in read_safetensors(folder / "model.safetensors").items()}
    head = tensors["model.embed_tokens.weight"].copy()
    head[-1] += 1.0  # one row of the last token: the rows compared include the first and the last
    tensors["lm_head.weight"] = head
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.warns(UserWarning) as said:
        cfg, io, blocks = load_hf(folder, dtype="float32")
    message = " ".join(str(w.message) for w in said)
    assert ("tie_word_embeddings = true, but the checkpoint also holds lm_head.weight" in message
            and "differs from model.embed_tokens.weight: the model is loaded tied" in message
            and f'"tie_word_embeddings": false in {folder / "config.json"}' in message)
    assert cfg.tie_embeddings and "lm_head" not in io  # tied: the head is the embedding, the tensor ignored
    assert rel_err(logits_of(model_from(cfg, io, blocks), folder), np.load(folder / "logits.npy")) < 1e-4


# --- safetensors I/O -----------------------------------------------------------------------------

def test_sharded_checkpoint_round_trip(tmp_path):
    cfg, io, blocks = load_hf(FIXTURES / "qwen2", dtype="float32")
    files = save_hf(tmp_path, cfg, io, blocks, dtype="float32", max_shard_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in jax.tree.leaves((io, blocks)))
    assert set(files) >= set(shards)
    cfg2, io2, blocks2 = load_hf(tmp_path, dtype="float32")
    assert cfg2 == cfg
    assert_trees_equal((io, blocks), (io2, blocks2))
    shards[1].unlink()
    with pytest.raises(SafetensorsError, match=f"shard '{shards[1].name}' .* is missing"):
        Checkpoint(tmp_path)
    # a later save is refused unless it may overwrite; then the unsharded files replace the shards as a set
    with pytest.raises(FileExistsError, match="already holds a model.*overwrite=True"):
        save_hf(tmp_path, cfg, io, blocks, dtype="float32")
    save_hf(tmp_path, cfg, io, blocks, dtype="float32", overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_bf16_read_via_memmap_equals_rounding(tmp_path):
    cfg, io, blocks = load_hf(FIXTURES / "llama", dtype="float32")
    save_hf(tmp_path, cfg, io, blocks, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    raw = Checkpoint(tmp_path).get("model.layers.1.mlp.down_proj.weight")
    assert raw.dtype == ml_dtypes.bfloat16 and isinstance(raw.base, np.memmap) and not raw.flags.writeable
    _, io2, blocks2 = load_hf(tmp_path)
    rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), (io, blocks))
    assert_trees_equal(rounded, (io2, blocks2))
    assert not np.array_equal(io2["embedding"], io["embedding"])  # it really is bf16 on disk


def test_f32_output_readable_by_safetensors_package(tmp_path):
    from safetensors.numpy import load_file
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b.c": np.ones((5,), np.float32),
               "empty": np.zeros((0, 3), np.float32)}
    write_safetensors(tmp_path / "x.safetensors", tensors)
    assert_trees_equal(load_file(tmp_path / "x.safetensors"), tensors)
    cfg, io, blocks = load_hf(FIXTURES / "llama", dtype="float32")
    save_hf(tmp_path / "m", cfg, io, blocks, dtype="float32")
    theirs = load_file(tmp_path / "m" / "model.safetensors")
    np.testing.assert_array_equal(theirs["lm_head.weight"], io["lm_head"].T)
    np.testing.assert_array_equal(theirs["model.layers.0.self_attn.q_proj.weight"],
                                  blocks[0]["attn"]["q"]["kernel"].T)


def test_reader_reads_files_written_by_safetensors_package(tmp_path):
    from safetensors.numpy import save_file
    tensors = {"x": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float16),
               "y": np.arange(7, dtype=np.int64)}
    save_file(tensors, tmp_path / "t.safetensors")
    assert_trees_equal(read_safetensors(tmp_path / "t.safetensors"), tensors)


def test_truncated_file_error(fixture_copy):
    folder = fixture_copy("llama")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SafetensorsError, match="truncated: tensor"):
        load_hf(folder)
    path.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(SafetensorsError, match="truncated: header claims"):
        Checkpoint(folder)
    path.write_bytes(data[:5])
    with pytest.raises(SafetensorsError, match="truncated"):
        Checkpoint(folder)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        Checkpoint(folder)


def test_missing_weights_and_pickle_only_folder(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SafetensorsError, match="never unpickle"):
        Checkpoint(tmp_path)


def test_reader_never_imports_torch_or_unpickles(tmp_path):
    src = Path(__file__).parent.parent / "megatrain_jax" / "hf"
    for path in src.glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "import torch" not in text, path
    code = f"""
import pickle, sys
def refuse(*a, **k): raise AssertionError("pickle used")
pickle.load = pickle.loads = refuse
pickle.Unpickler = refuse
from megatrain_jax.hf import load_hf, save_hf
for name in {NAMES!r}:
    cfg, io, blocks = load_hf({str(FIXTURES)!r} + "/" + name)
save_hf({str(tmp_path)!r}, cfg, io, blocks)
load_hf({str(tmp_path)!r})
assert "torch" not in sys.modules and "safetensors" not in sys.modules, "torch/safetensors imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --- round trip and errors --------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_hf_round_trip(name, tmp_path):
    cfg, io, blocks = load_hf(FIXTURES / name, dtype="float32")
    save_hf(tmp_path, cfg, io, blocks, dtype="float32")
    cfg2, io2, blocks2 = load_hf(tmp_path, dtype="float32")
    assert cfg2 == cfg
    assert_trees_equal((io, blocks), (io2, blocks2))
    a, b = Checkpoint(FIXTURES / name), Checkpoint(tmp_path)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        np.testing.assert_array_equal(a.get(n), b.get(n))


def test_save_from_model_state_and_jax_arrays(tmp_path):
    """save_hf takes what a model holds: nnx.State of JAX arrays."""
    cfg, io, blocks = load_hf(FIXTURES / "qwen3", dtype="float32")
    model = model_from(cfg, io, blocks)
    io_state = nnx.state(model.io, nnx.Param)
    block_states = [nnx.state(b, nnx.Param) for b in model.blocks]
    assert isinstance(jax.tree.leaves(io_state)[0], jax.Array)
    save_hf(tmp_path, cfg, io_state, block_states, dtype="float32")
    cfg2, io2, blocks2 = load_hf(tmp_path, dtype="float32")
    assert cfg2 == cfg
    assert_trees_equal((io, blocks), (io2, blocks2))


def _rewrite(folder: Path, edit) -> None:
    tensors = {k: np.array(v) for k, v in read_safetensors(folder / "model.safetensors").items()}
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def test_renamed_and_removed_tensors_are_listed(fixture_copy):
    folder = fixture_copy("llama")
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight_renamed"] = t.pop("model.layers.1.mlp.up_proj.weight")
        del t["model.norm.weight"]
    _rewrite(folder, edit)
    with pytest.raises(CheckpointMismatch) as e:
        load_hf(folder)
    msg = str(e.value)
    assert "missing: model.layers.1.mlp.up_proj.weight (expected shape [80, 64])" in msg
    assert "missing: model.norm.weight (expected shape [64])" in msg
    assert "unexpected: model.layers.1.mlp.up_proj.weight_renamed (shape [80, 64])" in msg


def test_hundreds_of_extra_tensors_are_counted_by_prefix_not_listed(fixture_copy):
    """A multimodal checkpoint's vision tower in the files: the first tensors are named, the rest counted under their
    prefix, so that the message says what the extra part is in a few lines."""
    folder = fixture_copy("llama")
    def edit(t):
        t.update({f"model.vision_tower.blocks.{i}.weight": np.zeros((2, 2), np.float32) for i in range(300)})
    _rewrite(folder, edit)
    with pytest.raises(CheckpointMismatch) as e:
        load_hf(folder)
    lines = str(e.value).splitlines()
    assert len(lines) == 1 + 12 + 1, lines
    assert lines[-1] == "  unexpected: 288 more (model.vision_tower.*: 288)"


def test_wrong_shapes_are_listed(fixture_copy):
    folder = fixture_copy("qwen2")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatch) as e:
        load_hf(folder)
    msg = str(e.value)
    for i in range(2):
        assert f"shape mismatch: model.layers.{i}.mlp.gate_proj.weight: expected [96, 64], found [80, 64]" in msg
        assert f"shape mismatch: model.layers.{i}.mlp.down_proj.weight: expected [64, 96], found [64, 80]" in msg
    assert msg.count("shape mismatch") == 6


def test_load_into_a_different_model_is_refused():
    model = nnx.eval_shape(lambda: Decoder(preset("tiny"), rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointMismatch, match="vocab_size: model has 256, .* has 96"):
        load_hf_into(model, FIXTURES / "llama")


def test_load_into_a_model_with_another_rotary_fraction_is_refused():
    """A model that rotates part of each head (``partial_rotary_factor``) keeps every tensor's shape: the
    checkpoint's own config is what tells them apart."""
    cfg = load_hf(FIXTURES / "llama", dtype="float32")[0]
    model = nnx.eval_shape(lambda: Decoder(cfg.replace(partial_rotary_factor=0.5), rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointMismatch, match="partial_rotary_factor: model has 0.5, .* has 1.0"):
        load_hf_into(model, FIXTURES / "llama")


def test_save_checks_shapes_and_family(tmp_path):
    cfg, io, blocks = load_hf(FIXTURES / "llama", dtype="float32")
    bad = dict(blocks[1], mlp=dict(blocks[1]["mlp"], down={"kernel": np.zeros((64, 80), np.float32)}))
    with pytest.raises(CheckpointMismatch, match=r"block 1 mlp.down.kernel .*expected \[80, 64\], found \[64, 80\]"):
        save_hf(tmp_path, cfg, io, [blocks[0], bad])
    with pytest.raises(UnsupportedConfig, match="sliding_window=8.*family='mistral'"):
        save_hf(tmp_path, cfg.replace(sliding_window=8), io, blocks)
    with pytest.raises(UnsupportedConfig, match="qkv_bias=False"):
        config_to_hf(cfg.replace(family="qwen2"))


# --- config.json mapping ----------------------------------------------------------------------------

LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "torch_dtype": "bfloat16"}


def test_config_from_hf_matches_presets():
    assert config_from_hf(LLAMA31) == preset("llama3.1-8b", norm_eps=1e-5)
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(LLAMA31["rope_scaling"], rope_theta=500000.0)
    assert config_from_hf(v5) == config_from_hf(LLAMA31)
    mistral = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "sliding_window": 4096, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5}
    assert config_from_hf(mistral) == preset("mistral-7b")
    qwen2 = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
             "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
             "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 48}
    assert config_from_hf(qwen2) == preset("qwen2.5-14b")
    qwen3 = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
    assert config_from_hf(qwen3).replace(head_dim=128) == preset("qwen3-8b")


@pytest.mark.parametrize("name", ["tiny", "llama3.2-1b", "llama3.1-8b", "mistral-7b", "qwen2.5-14b", "qwen3-8b",
                                  "phi3-mini", "phi3-medium", "phi4", "olmo2-1b", "olmo2-13b"])
def test_config_round_trip(name):
    cfg = preset(name)
    back = config_from_hf(json.loads(json.dumps(config_to_hf(cfg))), dtype=cfg.dtype,
                          loss_chunk_tokens=cfg.loss_chunk_tokens)
    assert back.replace(head_dim=cfg.head_dim) == cfg and back.dim_per_head == cfg.dim_per_head


@pytest.mark.parametrize("change, match", [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "model_type 'gemma'"),
    (dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
     r"model_type 'qwen3_next' is a hybrid model \(Gated DeltaNet linear attention.*supported model types"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling type 'dynamic'"),
    (dict(rope_scaling={"type": "longrope", "factor": 2.0}), "rope_scaling type 'longrope'"),
    (dict(rope_scaling={"type": "linear"}), "of type 'linear' lacks 'factor'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(quantization_config={"quant_method": "fp8"}), r"quant_method 'fp8'\): a quantized checkpoint .* bfloat16"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), r"quant_method 'awq'"),
    (dict(attention_dropout=0.1), r"attention_dropout=0.1 .*set it to 0.0 in config.json"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported for model_type 'llama'"),
    (dict(model_type="phi3", architectures=["Phi3ForCausalLM"], resid_pdrop=0.1), r"resid_pdrop=0.1 .*set it to 0.0"),
    (dict(model_type="phi3", architectures=["Phi3ForCausalLM"], embd_pdrop=0.1), r"embd_pdrop=0.1"),
    (dict(model_type="phi3", architectures=["Phi3ForCausalLM"]),  # Llama 3.1's scaling on a Phi-3
     r"rope_scaling type 'llama3' is not supported for model_type 'phi3'; supported: \['default', 'longrope'\]"),
    (dict(model_type="phi3", architectures=["Phi3ForCausalLM"], rope_scaling={"type": "longrope", "factor": 2.0}),
     "lacks short_factor or long_factor"),
])
def test_unsupported_configs_name_the_value(change, match):
    config = dict(LLAMA31, **change)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(UnsupportedConfig, match=match):
        config_from_hf(config)


# Phi-3 as published (config.json of microsoft/Phi-3-mini-4k-instruct, Phi-3-medium-4k-instruct, phi-4), and the
# parameter counts their model cards give
PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_dropout": 0.0, "embd_pdrop": 0.0,
        "resid_pdrop": 0.0, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 32000,
        "pad_token_id": 32000}
PHI3_MINI = dict(PHI3, vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=2047)
PHI3_MEDIUM = dict(PHI3_MINI, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                   num_key_value_heads=10)
PHI4 = dict(PHI3_MEDIUM, vocab_size=100352, max_position_embeddings=16384, original_max_position_embeddings=16384,
            rope_theta=250000, sliding_window=None, attention_bias=False, bos_token_id=100257, eos_token_id=100265,
            pad_token_id=100349)


@pytest.mark.parametrize("name, config, published", [("phi3-mini", PHI3_MINI, 3.82e9),
                                                     ("phi3-medium", PHI3_MEDIUM, 13.96e9), ("phi4", PHI4, 14.66e9)])
def test_phi3_configs_match_presets_and_published_sizes(name, config, published):
    read = config_from_hf(config)  # the special ids are the checkpoint's (presets set none)
    assert read.eos_token_id == config.get("eos_token_id") and read.pad_token_id == config.get("pad_token_id")
    assert dataclasses.replace(read, bos_token_id=None, eos_token_id=None, pad_token_id=None) == preset(name)
    assert abs(preset(name).param_count() / published - 1) < 0.005


# LongRoPE as transformers 5.23 computes it (_compute_longrope_parameters, Phi3RotaryEmbedding), for factors
# short_i = 1 + 0.02 i, long_i = 1 + 0.75 i: inv_freq at dimension pairs 0, 16 and 47 of the 48, and the factor
# cos and sin are scaled by (transformers takes the long factors once the largest position + 1 exceeds 4096)
LONGROPE_HF = [
    # Phi-4-mini's shape: head 128, 3/4 rotated, 128k of 4k: attention factor sqrt(1 + ln 32 / ln 4096)
    (dict(rope_theta=10000.0), 1.1902380714238083, (1.0, 0.03516354411840439, 6.244987162062898e-05),
     (1.0, 0.0035704525653272867, 3.3421447369619273e-06)),
    (dict(rope_theta=250000.0, max_position_embeddings=16384, attention_factor=1.25), 1.25,
     (1.0, 0.012025764212012291, 2.671254151209723e-06), (1.0, 0.0012210775166749954, 1.429581573120231e-07)),
]


def _longrope_config(rope_theta, max_position_embeddings=131072, attention_factor=None):
    rope = {"rope_type": "longrope", "short_factor": [1 + 0.02 * i for i in range(48)],
            "long_factor": [1 + 0.75 * i for i in range(48)], "partial_rotary_factor": 0.75}
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    return dict(PHI3_MINI, num_attention_heads=24, num_key_value_heads=8, rope_theta=rope_theta, sliding_window=None,
                max_position_embeddings=max_position_embeddings, rope_scaling=rope)


@pytest.mark.parametrize("change, attention, short, long", LONGROPE_HF)
def test_longrope_frequencies_and_attention_factor_match_transformers(change, attention, short, long):
    from megatrain_jax.models.rope import rope_frequencies, rope_inv_freq
    cfg = config_from_hf(_longrope_config(**change))
    s = cfg.rope_scaling
    assert (cfg.rotary_dim, s.kind, s.original_max_position) == (96, "longrope", 4096)
    assert s.cos_sin_scale == pytest.approx(attention, rel=1e-12)
    pick = [0, 16, 47]
    np.testing.assert_allclose(rope_inv_freq(96, cfg.rope_theta, s)[pick], short, rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(96, cfg.rope_theta, s, long=True)[pick], long, rtol=1e-6)
    for length, want in ((4096, short), (4097, long)):  # the choice follows the batch's largest position
        positions = jnp.broadcast_to(jnp.arange(length), (2, length))
        np.testing.assert_allclose(np.asarray(jax.jit(lambda p: rope_frequencies(cfg, p))(positions))[pick], want,
                                   rtol=1e-6)
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg))), dtype=cfg.dtype) == cfg


@pytest.mark.parametrize("change", [c for c, *_ in LONGROPE_HF])
def test_live_longrope_matches_transformers(change, hf_torch):
    from megatrain_jax.models.rope import rope_inv_freq
    config = _longrope_config(**change)
    cfg = config_from_hf(config)
    for long, seq_len in ((False, None), (True, 4097)):
        inv, attention = hf_torch.longrope(config, seq_len)
        np.testing.assert_allclose(rope_inv_freq(96, cfg.rope_theta, cfg.rope_scaling, long=long), inv, rtol=1e-6)
        assert cfg.rope_scaling.cos_sin_scale == pytest.approx(attention)


def test_phi3_fused_tensors_split_and_fuse(tmp_path):
    """qkv_proj's rows are q, k, v; gate_up_proj's are gate, then up (Phi3MLP's chunk(2)); an export fuses them back."""
    folder = FIXTURES / "phi3"
    ckpt = Checkpoint(folder)
    _, _, blocks = load_hf(folder, dtype="float32")
    qkv = ckpt.get("model.layers.1.self_attn.qkv_proj.weight")
    gate_up = ckpt.get("model.layers.1.mlp.gate_up_proj.weight")
    attn, mlp = blocks[1]["attn"], blocks[1]["mlp"]
    assert qkv.shape == (64 + 2 * 32, 64) and gate_up.shape == (2 * 80, 64)
    np.testing.assert_array_equal(np.concatenate([attn[n]["kernel"].T for n in "qkv"]), qkv)
    np.testing.assert_array_equal(np.concatenate([mlp["gate"]["kernel"].T, mlp["up"]["kernel"].T]), gate_up)
    assert not any("q_proj" in n or "gate_proj" in n for n in ckpt.names())


def test_qwen_sliding_window_layers():
    base = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "sliding_window": 16}
    assert config_from_hf(dict(base, use_sliding_window=False)).sliding_window is None
    assert config_from_hf(dict(base, use_sliding_window=True, max_window_layers=0)).sliding_window == 16
    with pytest.raises(UnsupportedConfig, match="mix full and sliding"):
        config_from_hf(dict(base, use_sliding_window=True, max_window_layers=2))


# --- live checks against transformers (torch beside it: tests/torch_side.py) ----------------------

@pytest.mark.parametrize("name", NAMES)
def test_live_transformers_parity_and_export(name, tmp_path, hf_torch):
    """transformers gives the fixture's logits, and loads our export of it with the logits we compute."""
    folder = FIXTURES / name
    tokens = np.load(folder / "tokens.npy")
    assert rel_err(hf_torch.logits(folder, tokens), np.load(folder / "logits.npy")) < 1e-4
    cfg, io, blocks = load_hf(folder, dtype="float32")
    save_hf(tmp_path, cfg, io, blocks, dtype="float32")
    ours = logits_of(model_from(cfg, io, blocks), folder)
    assert rel_err(hf_torch.logits(tmp_path, tokens), ours) < 1e-4


def test_the_test_extra_pins_the_transformers_that_wrote_the_fixtures():
    """In-process transformers (the test extra) and the torch venv (.ci/run) are the fixtures' release."""
    import tomllib
    extra = tomllib.loads((FIXTURES.parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"transformers=={json.loads((FIXTURES / 'VERSIONS.json').read_text())['transformers']}" in extra["test"]


# --- a crafted index may not reach outside its folder ---------------------------------------------

def _sharded(tmp_path: Path) -> tuple[Path, dict]:
    """A sharded copy of the qwen2 fixture in tmp_path/ckpt, and its index."""
    cfg, io, blocks = load_hf(FIXTURES / "qwen2", dtype="float32")
    folder = tmp_path / "ckpt"
    save_hf(folder, cfg, io, blocks, dtype="float32", max_shard_bytes=40_000)
    return folder, json.loads((folder / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/model-00001-of-00009.safetensors",
                                 "..", "", "..\\outside.safetensors", 7])
def test_index_shard_entries_must_be_plain_names_in_the_folder(tmp_path, bad):
    folder, index = _sharded(tmp_path)
    first = sorted(index["weight_map"].values())[0]
    (tmp_path / "outside.safetensors").write_bytes((folder / first).read_bytes())  # a valid file to lure to
    (folder / "sub").mkdir()
    shutil.copy(folder / first, folder / "sub" / "model-00001-of-00009.safetensors")
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = bad
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError) as err:
        Checkpoint(folder)
    msg = str(err.value)
    assert "model.safetensors.index.json" in msg and f"refused shard entry {bad!r}" in msg and name in msg, msg
    assert "plain name of a file" in msg


def test_shard_symlinks_out_of_the_folder_are_refused(tmp_path):
    folder, index = _sharded(tmp_path)
    shard = folder / sorted(index["weight_map"].values())[0]
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(SafetensorsError, match=rf"shard entry '{shard.name}'.*symlink to .*elsewhere\.safetensors, "
                                               rf"outside the checkpoint folder"):
        Checkpoint(folder)
    # a link to a file inside the folder is fine
    shard.unlink()
    inside = folder / "renamed.bin"
    outside.rename(inside)
    shard.symlink_to(inside.name)
    Checkpoint(folder)


def test_hugging_face_cache_snapshots_link_to_their_blobs(tmp_path):
    """The HF hub cache keeps files in <repo>/blobs and links them from <repo>/snapshots/<rev>: allowed."""
    folder, index = _sharded(tmp_path)
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    _, io, _ = load_hf(snapshot, dtype="float32")
    _, io2, _ = load_hf(folder, dtype="float32")
    assert_trees_equal(io, io2)
    # a blob store of another repo is outside
    other = tmp_path / "models--other--x" / "blobs"
    other.mkdir(parents=True)
    shard = sorted(index["weight_map"].values())[0]
    shutil.copy(folder / shard, other / "x")
    (snapshot / shard).unlink()
    (snapshot / shard).symlink_to(other / "x")
    with pytest.raises(SafetensorsError, match="outside the checkpoint folder"):
        Checkpoint(snapshot)


def test_single_file_symlinked_out_of_the_folder_is_refused(fixture_copy, tmp_path):
    folder = fixture_copy("llama")
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(SafetensorsError, match="symlink to .*outside the checkpoint folder"):
        Checkpoint(folder)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's long-context
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": False},
    {"rope_type": "yarn", "attention_factor": 1.2, "original_max_position_embeddings": 8192},  # no factor
])
def test_linear_and_yarn_rope_scaling_read_and_written_as_transformers_does(rope):
    from megatrain_jax.families.hf_json import rope_to_hf
    base = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rope_theta": 10000.0, "rope_scaling": rope}
    cfg = config_from_hf(base)
    s = cfg.rope_scaling
    assert s.kind == rope.get("rope_type", rope.get("type"))
    if "factor" not in rope:  # transformers: max_position_embeddings / original_max_position_embeddings
        assert s.factor == 32768 / 8192 and s.cos_sin_scale == 1.2
    if rope.get("mscale"):
        assert s.cos_sin_scale == pytest.approx(1.0)  # equal mscales cancel
    again = config_from_hf({**base, "rope_scaling": rope_to_hf(s)})
    assert again == cfg


@pytest.mark.parametrize("name", ["llama", "phi3", "glm4_moe", "deepseek_v3", "gpt_oss_mxfp4"])  # phi3: each kernel a piece of a fused tensor; glm4_moe, deepseek_v3: a dense then MoE blocks; gpt_oss_mxfp4: MXFP4 experts, gate/up interleaved
def test_engine_state_read_part_by_part_from_the_checkpoint_equals_a_filled_model(name):
    """``init_from=HFParts``: the state built from the safetensors, the model abstract throughout, equals
    the state of a model filled with load_hf_into first."""
    from flax import nnx

    from megatrain_jax import Decoder, Engine, adamw
    from megatrain_jax.hf import HFParts, load_hf_into, read_config
    cfg = read_config(FIXTURES / name, dtype="float32")
    filled = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    load_hf_into(filled, FIXTURES / name)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    a = Engine(filled, adamw(1e-3)).state
    parts = HFParts(FIXTURES / name, cfg)  # held, as train holds it through the run
    b = Engine(abstract, adamw(1e-3), init_from=parts).state
    # once the state is built, the checkpoint's files are unmapped: the run does not carry their pages
    mapped = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else None
    assert mapped is None or str((FIXTURES / name).resolve()) not in mapped
    for x, y in zip(jax.tree.leaves([p.params for p in a.parts]), jax.tree.leaves([p.params for p in b.parts])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_engine_state_from_a_bfloat16_checkpoint_is_widened_and_transposed_on_the_device(tmp_path):
    """A bf16 checkpoint (what releases ship): ``HFParts`` hands the stored bf16 tensors over untouched
    (memory-mapped, HF layout) and the builder's program transposes and widens them; the masters equal
    the host conversion exactly, sharded over several files or not."""
    import ml_dtypes
    from flax import nnx

    from megatrain_jax import Decoder, Engine, adamw
    from megatrain_jax.hf import HFParts, load_hf, read_config, save_hf
    cfg, io, blocks = load_hf(FIXTURES / "llama", dtype="float32")
    save_hf(tmp_path, cfg, io, blocks, dtype="bfloat16", max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    parts = HFParts(tmp_path, cfg)
    stored = jax.tree.leaves(parts.block(0))
    assert all(x.dtype == ml_dtypes.bfloat16 and not x.flags.owndata for x in stored)  # views of the files
    _, io16, blocks16 = load_hf(tmp_path, dtype="float32")  # the host conversion: bf16 -> float32, transposed
    abstract = nnx.eval_shape(lambda: Decoder(read_config(tmp_path, dtype="float32"), rngs=nnx.Rngs(0)))
    state = Engine(abstract, adamw(1e-3), init_from=parts).state
    want = [io16] + blocks16
    for part, ref in zip(state.parts, want):
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), y),
                     nnx.to_pure_dict(part.params), ref)
