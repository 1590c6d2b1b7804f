"""config.json files as the Hub has them, at their edges: a key omitted (transformers' config class then fills in its
own default, which differs between families), a sliding window on some layers by a family's own rule, two RoPE lengths
that transformers' releases read differently. Each is read as transformers computes it, or refused naming the key.

The fixtures under tests/fixtures/hf are edited here; the live tests compare the logits with transformers' own
(``hf_torch``: tests/torch_side.py, in this interpreter or in MEGATRAIN_TORCH_PYTHON), and skip without it.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.hf import UnsupportedConfig, config_from_hf, load_hf

from test_hf import logits_of, model_from, rel_err

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def fixture_config(name: str, drop: tuple[str, ...] = (), **changes) -> dict:
    """The config.json of fixture ``name`` without the keys ``drop``, with ``changes``."""
    c = json.loads((FIXTURES / name / "config.json").read_text())
    return {**{k: v for k, v in c.items() if k not in drop}, **changes}


# --- keys omitted: the config class's defaults ------------------------------------------------------------------

@pytest.mark.parametrize("name, drop, want", [
    # MixtralConfig: rms_norm_eps 1e-5 and rope_theta 1e6 (Mixtral-8x7B's), not Llama's 1e-6 and 1e4
    ("mixtral", ("rms_norm_eps", "rope_parameters"), dict(norm_eps=1e-5, rope_theta=1e6)),
    ("mixtral", ("max_position_embeddings",), dict(max_positions=131072)),
    # MistralConfig: a 4,096-token window unless config.json says otherwise (null: none)
    ("mistral", ("sliding_window", "max_position_embeddings"), dict(sliding_window=4096, max_positions=131072)),
    ("llama", ("max_position_embeddings",), dict(max_positions=2048)),
    ("olmo2", ("max_position_embeddings",), dict(max_positions=2048)),
    ("qwen2", ("max_position_embeddings",), dict(max_positions=32768)),
    ("glm4_moe", ("max_position_embeddings",), dict(max_positions=131072)),
    # Qwen3MoeConfig has no head_dim (Qwen3Config's 128): its attention takes hidden_size / num_attention_heads
    ("qwen3_moe", ("head_dim",), dict(dim_per_head=64 // 4)),
])
def test_omitted_keys_take_the_config_class_defaults(name, drop, want):
    cfg = config_from_hf(fixture_config(name, drop))
    assert {k: getattr(cfg, k) for k in want} == want


@pytest.mark.parametrize("name, kv_heads", [
    ("mistral", 8), ("mixtral", 8), ("qwen2", 32), ("qwen3", 32), ("qwen2_moe", 16), ("qwen3_moe", 4),
    ("gemma3_text", 4), ("glm4_moe", 8), ("gpt_oss", 8),
    # LlamaConfig, Phi3Config and Olmo2Config default to None: as many key-value heads as query heads
    ("llama", 32), ("phi3", 32), ("olmo2", 32),
])
def test_omitted_kv_heads_take_the_config_class_default(name, kv_heads):
    """num_key_value_heads omitted: the config class's own default (MistralConfig's 8, Qwen3MoeConfig's 4, ...), not
    one key-value head per query head; written as null, one per query head, as transformers reads it."""
    c = fixture_config(name, ("num_key_value_heads",), num_attention_heads=32)
    assert config_from_hf(c).kv_heads == kv_heads
    assert config_from_hf(dict(c, num_key_value_heads=None)).kv_heads == 32


def test_qwen_sliding_window_omitted_is_the_config_class_default():
    """Qwen2Config: ``use_sliding_window`` without ``sliding_window`` slides by 4,096 tokens."""
    c = fixture_config("qwen2", ("layer_types", "sliding_window"), use_sliding_window=True, max_window_layers=0)
    assert config_from_hf(c).sliding_window == 4096


def test_yarn_without_lengths_takes_the_config_class_max_positions():
    """YaRN with no original length scales from max_position_embeddings, Llama's 2,048 where omitted."""
    c = fixture_config("llama", ("max_position_embeddings", "rope_parameters"), rope_theta=10000.0,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert config_from_hf(c).rope_scaling.original_max_position == 2048


# --- sliding windows by each Qwen MoE's own rule -----------------------------------------------------------------

def test_qwen3_moe_slides_on_every_layer_whatever_max_window_layers():
    """Qwen3MoeAttention slides on every layer with ``use_sliding_window``: max_window_layers and layer_types are
    not read (Qwen2/3 read them)."""
    c = fixture_config("qwen3_moe", use_sliding_window=True, sliding_window=4, max_window_layers=28)
    assert config_from_hf(c).sliding_window == 4
    assert config_from_hf(dict(c, layer_types=["full_attention"] * 2)).sliding_window == 4
    assert config_from_hf(dict(c, use_sliding_window=False)).sliding_window is None


def test_qwen2_moe_slides_on_every_other_layer_below_max_window_layers():
    """Qwen2MoeConfig's layer_types, where config.json omits them: the first, third, ... layers below
    max_window_layers slide (Qwen2's rule is the layers from it on)."""
    c = fixture_config("qwen2_moe", ("layer_types",), use_sliding_window=True, sliding_window=4)
    assert config_from_hf(dict(c, max_window_layers=0)).sliding_window is None
    assert config_from_hf(dict(c, max_window_layers=28, num_hidden_layers=1)).sliding_window == 4
    with pytest.raises(UnsupportedConfig, match=r"\['sliding_attention', 'full_attention'\].*mix full and sliding"):
        config_from_hf(dict(c, max_window_layers=28))


def test_qwen2_moe_without_qkv_biases_is_refused():
    """Qwen2MoeConfig's qkv_bias=false drops the q/k/v biases (transformers then ignores them in the checkpoint)."""
    with pytest.raises(UnsupportedConfig, match="qkv_bias=False for model_type 'qwen2_moe' is not supported"):
        config_from_hf(fixture_config("qwen2_moe", qkv_bias=False))
    with pytest.raises(UnsupportedConfig, match="qkv_bias=\"no\": must be true or false"):
        config_from_hf(fixture_config("qwen2_moe", qkv_bias="no"))
    assert config_from_hf(fixture_config("qwen2_moe", qkv_bias=True)).qkv_bias


# --- RoPE's original length given twice --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [{"rope_type": "yarn", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0}])
def test_original_length_beside_another_in_rope_scaling_is_refused(kind):
    """transformers 5 scales by a top-level original_max_position_embeddings, 4.x by rope_scaling's: two that differ
    are refused naming both; one, or two alike, are read."""
    base = fixture_config("llama", ("rope_parameters",), rope_theta=10000.0, max_position_embeddings=131072)
    both = dict(base, rope_scaling={**kind, "original_max_position_embeddings": 8192},
                original_max_position_embeddings=4096)
    with pytest.raises(UnsupportedConfig, match=r"original_max_position_embeddings=4096 beside "
                                                r"rope_scaling\.original_max_position_embeddings=8192"):
        config_from_hf(both)
    assert config_from_hf(dict(both, original_max_position_embeddings=8192)).rope_scaling.original_max_position == 8192
    assert config_from_hf(dict(base, rope_scaling=kind, original_max_position_embeddings=4096)
                          ).rope_scaling.original_max_position == 4096


# --- live: the logits transformers computes ----------------------------------------------------------------------

@pytest.mark.parametrize("name, drop, changes", [
    ("mixtral", ("rms_norm_eps", "rope_parameters"), {}),
    # untruncated YaRN, so that the original length (Llama's default 2,048) moves the ramp
    ("llama", ("max_position_embeddings", "rope_parameters"),
     dict(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": False})),
    ("qwen3_moe", ("head_dim",), {}),
    ("qwen3_moe", (), dict(use_sliding_window=True, sliding_window=4, max_window_layers=28)),
    ("qwen2_moe", ("layer_types",), dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
], ids=["mixtral_defaults", "llama_yarn_default_length", "qwen3_moe_head_dim", "qwen3_moe_window",
        "qwen2_moe_window"])
def test_live_edited_configs_load_as_transformers_computes_them(name, drop, changes, tmp_path, hf_torch):
    folder = Path(shutil.copytree(FIXTURES / name, tmp_path / name))
    (folder / "config.json").write_text(json.dumps(fixture_config(name, drop, **changes), indent=2))
    tokens = np.load(folder / "tokens.npy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixtures' own warnings (a pad id past the vocabulary, ...)
        cfg, io, blocks = load_hf(folder, dtype="float32")
    ours = logits_of(model_from(cfg, io, blocks), folder)
    assert rel_err(ours, hf_torch.logits(folder, tokens)) < 1e-4
