"""Mistral: Llama's blocks with a sliding attention window on every layer."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

PRESETS = {"mistral-7b": dict(family="mistral", vocab_size=32000, hidden=4096, ffn=14336, layers=32, heads=32,
                              kv_heads=8, sliding_window=4096, max_positions=32768)}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(sliding_window=c.get("sliding_window"))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    out["sliding_window"] = cfg.sliding_window


FAMILY = Family(name="mistral", title="Mistral", model_type="mistral", hf_class="MistralForCausalLM", presets=PRESETS,
                hf_defaults=dict(num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
                read=read, refuse=refuse, write=write)
