"""Qwen3: Llama's blocks with an RMSNorm on each query and key head."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

PRESETS = {"qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden=4096, ffn=12288, layers=36, heads=32,
                            kv_heads=8, head_dim=128, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                            max_positions=40960)}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(qk_norm=True, sliding_window=hf_json.qwen_sliding_window(c, layers))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    out["attention_bias"] = False
    hf_json.write_qwen_sliding_window(cfg, out)


FAMILY = Family(name="qwen3", title="Qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM", presets=PRESETS,
                hf_defaults=dict(head_dim=128, num_key_value_heads=32, max_position_embeddings=32768,
                                 sliding_window=4096),
                features=dict(qk_norm=True), read=read, refuse=refuse, write=write)
