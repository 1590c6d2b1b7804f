"""A Hugging Face folder's files are checked as they are read: a value of the wrong type or range in config.json, a
file that is not a JSON object, a weight of a dtype no model has. Each error names the file and the key or tensor,
never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.hf import CheckpointMismatch, SafetensorsError, UnsupportedConfig, load_hf, read_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def llama_copy(tmp_path: Path, **change) -> Path:
    """The tiny Llama fixture copied, its config.json changed (a value of None: the key removed)."""
    folder = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "llama"))
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


@pytest.mark.parametrize("change, match", [
    (dict(num_attention_heads=0), r"num_attention_heads=0: must be a positive integer"),
    (dict(num_hidden_layers=-2), r"num_hidden_layers=-2: must be a positive integer"),
    (dict(hidden_size="64"), r'hidden_size="64": must be a positive integer \(a JSON number, without quotes\)'),
    (dict(intermediate_size=80.5), r"intermediate_size=80.5: must be a positive integer"),
    (dict(vocab_size=True), r"vocab_size=true: must be a positive integer"),
    (dict(rms_norm_eps="1e-5"), r'rms_norm_eps="1e-5": must be a positive, finite number'),
    (dict(tie_word_embeddings="no"), r'tie_word_embeddings="no": must be true or false'),
    (dict(model_type=["llama"]), r'model_type=\["llama"\]: must be a string'),
    (dict(architectures="LlamaForCausalLM"), r"architectures='LlamaForCausalLM' must be a list of class names"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": "8", "original_max_position_embeddings": 64}),
     r'rope_parameters.factor="8": must be a positive, finite number'),
    (dict(head_dim=None, num_attention_heads=3), r"heads=3 does not divide hidden=64.*\(in config.json: hidden is "
                                                 r"hidden_size, heads is num_attention_heads\)"),
    (dict(num_key_value_heads=3), r"kv_heads=3 does not divide heads=4.*heads is num_attention_heads, kv_heads is "
                                  r"num_key_value_heads"),
])
def test_config_values_of_the_wrong_type_or_range_name_the_file_and_key(tmp_path, change, match):
    folder = llama_copy(tmp_path, **change)
    with pytest.raises(UnsupportedConfig, match=rf"{folder / 'config.json'}: {match}"):
        read_config(folder)


def test_a_required_value_that_is_null_is_named(tmp_path):
    folder = llama_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, hidden_size=None)))
    with pytest.raises(UnsupportedConfig, match=r"config.json: hidden_size=null: must be a positive integer;"):
        read_config(folder)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("text, match", [
    ("[1, 2]", r"holds a JSON array, where a JSON object"),
    ('{"vocab_size": ', r"not valid JSON \(Expecting value at line 1, column 16\)"),
    ('{"rms_norm_eps": NaN}', r"NaN is not a JSON value"),
    (b'{"a": "\xff"}', r"not UTF-8 text"),
])
def test_a_json_file_of_the_folder_that_is_not_an_object_is_named(tmp_path, name, text, match):
    folder = llama_copy(tmp_path)
    if name == "model.safetensors.index.json":  # the index is read only where there is no single file
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    path = folder / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    error = SafetensorsError if name.endswith("index.json") else UnsupportedConfig
    with pytest.raises(error, match=rf"{path}: {match}"):
        load_hf(folder)


@pytest.mark.parametrize("code", ["I32", "U8", "BOOL", "F8_E4M3"])
def test_a_weight_of_an_integer_dtype_is_refused_naming_the_file_and_tensor(tmp_path, code):
    """A weight stored as integers (or FP8 without its scales) would be cast to float32 and trained on: refused from
    the header, before any data is read."""
    from megatrain_jax.hf.safetensors_io import DTYPES, read_safetensors
    folder = llama_copy(tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(folder / "model.safetensors").items()}
    name = "model.layers.1.mlp.down_proj.weight"
    others = {k: v for k, v in tensors.items() if k != name}
    write_mixed(folder / "model.safetensors", others, name, tensors[name].astype(DTYPES[code]))
    with pytest.raises(CheckpointMismatch, match=rf"dtype: {name} in {folder / 'model.safetensors'} is {code}; a "
                                                 rf"weight is floating point \(F32, BF16, F16, F64\)"):
        load_hf(folder)


def write_mixed(path: Path, tensors: dict, odd_name: str, odd: np.ndarray) -> None:
    """One safetensors file holding ``tensors`` as they are and ``odd_name`` in ``odd``'s dtype."""
    from megatrain_jax.hf.safetensors_io import dtype_code
    header, blobs, offset = {}, [], 0
    for name, arr in [*tensors.items(), (odd_name, odd)]:
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype_code(arr.dtype), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_mxfp4_experts_stay_allowed():
    """GPT-OSS's released experts are uint8 pairs (MXFP4 blocks and scales): read dequantized, not refused."""
    cfg, _, blocks = load_hf(FIXTURES / "gpt_oss_mxfp4")
    assert blocks[0]["mlp"]["experts"]["gate"].dtype == np.float32


@pytest.mark.parametrize("fixture, key, value, match", [
    ("qwen2", "layer_types", 3, r"layer_types=3: must be a list of strings \(or null\)"),
    ("llama", "rope_parameters", "default", r'rope_parameters="default": must be a JSON object \(or null\)'),
    ("gemma3_text", "rope_parameters", {"full_attention": "linear", "sliding_attention": None},
     r'rope_parameters.full_attention="linear": must be a JSON object'),
    ("gemma3_text", "rope_parameters", {"full_attention": {"rope_type": "linear", "factor": [4]}},
     r"rope_parameters.full_attention.factor=\[4\]: must be a positive, finite number"),
])
def test_nested_and_list_values_are_checked_too(fixture, key, value, match):
    from megatrain_jax.hf import config_from_hf
    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    with pytest.raises(UnsupportedConfig, match=match):
        config_from_hf(dict(config, **{key: value}))


def test_a_file_or_a_hub_cache_folder_given_as_the_model_says_what_to_give(tmp_path):
    src = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
    with pytest.raises(FileNotFoundError, match="config.json is a file: give the folder"):
        read_config(src / "config.json")
    cache = tmp_path / "models--org--tiny"
    (cache / "snapshots" / "abc123").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"a Hugging Face cache folder.*snapshots/<revision> \(here: \['abc123'\]\)"):
        read_config(cache)


def test_a_special_token_id_outside_the_vocabulary_is_warned_about(tmp_path):
    src = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, eos_token_id=config["vocab_size"] + 5)))
    with pytest.warns(UserWarning, match=f"eos_token_id={config['vocab_size'] + 5} outside the vocabulary"):
        read_config(folder)
