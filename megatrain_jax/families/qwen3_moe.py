"""Qwen3-MoE (Qwen3-30B-A3B: 30.5B total, 3.3B active): Qwen3's blocks (per-head q/k norms, no biases) with a mixture
of experts in every layer and no shared expert."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

PRESETS = {
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, renormalized
    "qwen3-30b-a3b": dict(family="qwen3_moe", vocab_size=151936, hidden=2048, ffn=6144, layers=48, heads=32,
                          kv_heads=4, head_dim=128, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                          max_positions=40960,
                          moe=dict(experts=128, top_k=8, expert_ffn=768, norm_topk_prob=True, aux_loss_coef=0.001)),
}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    """The sliding window, and the experts (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``:
    Qwen3MoeConfig's default False). Qwen3MoeConfig keeps ``sliding_window`` only with ``use_sliding_window``, and
    then every layer slides: unlike Qwen2/3, it reads neither ``max_window_layers`` nor ``layer_types``."""
    window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    return dict(sliding_window=window, moe=hf_json.qwen_moe(c, shared=False))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)  # Qwen3MoeAttention's attention_bias also puts a bias on o_proj


def write(cfg: Any, out: dict[str, Any]) -> None:
    hf_json.write_qwen_moe(cfg, out)
    hf_json.write_qwen_sliding_window(cfg, out)
    out["attention_bias"] = False


def problems(cfg: Any) -> list[str]:
    out = hf_json.softmax_routed_problems(cfg)
    if cfg.moe is not None and cfg.moe.shared_expert_ffn is not None:
        out.append("Qwen3-MoE has no shared expert")
    return out


FAMILY = Family(name="qwen3_moe", title="Qwen3-MoE", model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
                # no head_dim: Qwen3MoeConfig has none, and its attention takes hidden_size / num_attention_heads
                presets=PRESETS, moe=True,
                hf_defaults=dict(num_key_value_heads=4, max_position_embeddings=32768, sliding_window=4096),
                features=dict(qk_norm=True),
                read=read, refuse=refuse, write=write, problems=problems)
