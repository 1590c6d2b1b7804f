"""Qwen2 (Qwen2, Qwen2.5): Llama's blocks with biases on q, k and v."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

QWEN25_14B = dict(family="qwen2", vocab_size=152064, hidden=5120, ffn=13824, layers=48, heads=40, kv_heads=8,
                  rope_theta=1000000.0, norm_eps=1e-5, qkv_bias=True, max_positions=32768)
QWEN25_32B = dict(QWEN25_14B, ffn=27648, layers=64)
PRESETS = {"qwen2.5-14b": QWEN25_14B, "14b": QWEN25_14B, "qwen2.5-32b": QWEN25_32B, "32b": QWEN25_32B}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(qkv_bias=True, sliding_window=hf_json.qwen_sliding_window(c, layers))


FAMILY = Family(name="qwen2", title="Qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM", presets=PRESETS,
                hf_defaults=dict(num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096),
                features=dict(qkv_bias=True),
                read=read, refuse=hf_json.refuse_silu,
                write=hf_json.write_qwen_sliding_window)
