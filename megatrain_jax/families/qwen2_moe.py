"""Qwen2-MoE (Qwen2-57B-A14B: 57.4B, 14.2B active): Qwen2's blocks with a mixture of experts and a gated shared
expert; the routed weights are not renormalized."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family, UnsupportedConfig

PRESETS = {"qwen2-57b-a14b": dict(
    family="qwen2_moe", vocab_size=151936, hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4,
    rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_positions=32768,
    moe=dict(experts=64, top_k=8, expert_ffn=2560, norm_topk_prob=False, shared_expert_ffn=20480,
             aux_loss_coef=0.001))}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(sliding_window=hf_json.qwen_sliding_window(c, layers, every_other_below=True),
                moe=hf_json.qwen_moe(c, shared=True))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    if not c.get("qkv_bias", True):  # Qwen2MoeAttention: biases on q, k and v only where qkv_bias (the default)
        raise UnsupportedConfig("qkv_bias=False for model_type 'qwen2_moe' is not supported (a Qwen2-MoE model's q, k "
                                "and v projections have biases here, Qwen2MoeConfig's default)")


def write(cfg: Any, out: dict[str, Any]) -> None:
    hf_json.write_qwen_moe(cfg, out)
    out["shared_expert_intermediate_size"] = cfg.moe.shared_expert_ffn
    hf_json.write_qwen_sliding_window(cfg, out)


def problems(cfg: Any) -> list[str]:
    m = cfg.moe
    out = hf_json.softmax_routed_problems(cfg)
    if m is not None and (m.shared_expert_ffn is None or not m.shared_expert_gate):
        out.append("Qwen2-MoE has a gated shared expert (moe.shared_expert_ffn, shared_expert_gate)")
    return out


FAMILY = Family(name="qwen2_moe", title="Qwen2-MoE", model_type="qwen2_moe", hf_class="Qwen2MoeForCausalLM",
                presets=PRESETS, moe=True,
                hf_defaults=dict(num_key_value_heads=16, max_position_embeddings=32768, sliding_window=4096),
                features=dict(qkv_bias=True), read=read, refuse=refuse,
                write=write, problems=problems)
