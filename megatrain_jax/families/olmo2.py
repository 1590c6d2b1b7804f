"""OLMo 2 (published 1.48B, 7.30B, 13.7B): post-norm blocks, a q and a k RMSNorm over all heads at once."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

OLMO2_7B = dict(family="olmo2", vocab_size=100352, hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32,
                rope_theta=500000.0, norm_eps=1e-6, qk_norm=True, qk_norm_width="all_heads", norm_placement="post",
                max_positions=4096)
PRESETS = {"olmo2-1b": dict(OLMO2_7B, hidden=2048, ffn=8192, layers=16, heads=16, kv_heads=16),
           "olmo2-7b": OLMO2_7B,
           "olmo2-13b": dict(OLMO2_7B, hidden=5120, ffn=13824, layers=40, heads=40, kv_heads=40)}


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    out["attention_bias"] = False


def problems(cfg: Any) -> list[str]:
    return [] if cfg.sliding_window is None else [f"sliding_window={cfg.sliding_window} (OLMo 2 has none)"]


FAMILY = Family(name="olmo2", title="OLMo 2", model_type="olmo2", hf_class="Olmo2ForCausalLM", presets=PRESETS,
                hf_defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=2048),
                features=dict(qk_norm=True, qk_norm_width="all_heads", norm_placement="post"),
                refuse=refuse, write=write, problems=problems)
