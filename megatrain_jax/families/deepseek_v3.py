"""DeepSeek-V3 (deepseek-ai/DeepSeek-V3: 671B total, 37B active) and Kimi K2 (moonshotai/Kimi-K2-Base / -Instruct:
1.04T total, 32B active), one architecture (DeepseekV3ForCausalLM): multi-head latent attention with interleaved
RoPE under YaRN, a sigmoid router with a correction bias over grouped experts, one shared expert, leading dense
layers. Their checkpoints also hold one multi-token-prediction layer (num_nextn_predict_layers), not part of this
model."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import EITHER, Family, UnsupportedConfig
from megatrain_jax.families.tensors import Spec, dense_mlp_specs, moe_specs, norm_specs

DSV3 = dict(family="deepseek_v3", vocab_size=129280, hidden=7168, ffn=18432, layers=61, heads=128, kv_heads=128,
            rope_theta=10000.0, norm_eps=1e-6, max_positions=163840, first_k_dense_replace=3,
            rope_scaling=dict(kind="yarn", factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                              mscale=1.0, mscale_all_dim=1.0),
            mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_dim=128, qk_rope_dim=64, v_dim=128),
            moe=dict(experts=256, top_k=8, expert_ffn=2048, norm_topk_prob=True, shared_expert_ffn=2048,
                     shared_expert_gate=False, scoring="sigmoid", groups=8, topk_groups=4, routed_scale=2.5))
PRESETS = {
    "deepseek-v3": DSV3,
    # the same architecture: fewer heads, more experts, one dense layer
    "kimi-k2": dict(DSV3, vocab_size=163840, heads=64, kv_heads=64, rope_theta=50000.0, max_positions=131072,
                    first_k_dense_replace=1, rope_scaling=dict(DSV3["rope_scaling"], factor=32.0, beta_fast=1.0),
                    moe=dict(DSV3["moe"], experts=384, groups=1, topk_groups=1, routed_scale=2.827)),
}

# DeepseekV3Config's defaults (DeepSeek-V3's shape) where config.json omits a field
DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, n_group=8,
                topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, intermediate_size=18432)


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    q_lora = c.get("q_lora_rank")
    mla = dict(kv_lora_rank=int(c["kv_lora_rank"]), q_lora_rank=None if q_lora is None else int(q_lora),
               qk_nope_dim=int(c["qk_nope_head_dim"]), qk_rope_dim=int(c["qk_rope_head_dim"]),
               v_dim=int(c["v_head_dim"]), rope_interleave=bool(c["rope_interleave"]))
    return dict(head_dim=None, qkv_bias=bool(c.get("attention_bias", False)),
                first_k_dense_replace=int(c.get("first_k_dense_replace", 1)), mla=mla,
                moe=hf_json.sigmoid_routed_moe(c))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_sigmoid_router(c, FAMILY)
    if c.get("quantization_config"):
        q = c["quantization_config"]
        method = (q or {}).get("quant_method") if isinstance(q, dict) else None
        raise UnsupportedConfig(f"quantization_config (quant_method {method!r}): quantized weights (DeepSeek-V3's and "
                                f"Kimi K2's released FP8 blocks with their weight_scale_inv tensors) are not read; "
                                f"dequantize the checkpoint to bfloat16 first and drop quantization_config")
    if int(c.get("moe_layer_freq", 1)) != 1:
        raise UnsupportedConfig(f"moe_layer_freq={c['moe_layer_freq']!r}: transformers' DeepseekV3 routes every layer "
                                f"past first_k_dense_replace (moe_layer_freq 1)")
    if c.get("num_key_value_heads") not in (None, c.get("num_attention_heads")):
        raise UnsupportedConfig(f"num_key_value_heads={c['num_key_value_heads']!r} differs from num_attention_heads="
                                f"{c.get('num_attention_heads')!r}: multi-head latent attention gives every head its "
                                f"own key and value")


def write(cfg: Any, out: dict[str, Any]) -> None:
    hf_json.write_sigmoid_routed(cfg, out)
    del out["head_dim"]  # DeepseekV3Config derives head_dim (qk_rope_head_dim)
    a = cfg.mla
    out.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_dim,
               qk_rope_head_dim=a.qk_rope_dim, v_head_dim=a.v_dim, rope_interleave=a.rope_interleave,
               scoring_func="sigmoid", topk_method="noaux_tc")


def mla_specs(cfg: Any, p: str) -> list[Spec]:
    """Multi-head latent attention (``DeepseekV3Attention``): ``q_proj``, or ``q_a_proj`` / ``q_a_layernorm`` /
    ``q_b_proj``; ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``; ``o_proj``. ``attention_bias`` puts
    biases on q_a_proj, kv_a_proj_with_mqa and o_proj (not on q_proj or the b's). The rotated dimensions stay in the
    checkpoint's (interleaved) order: the attention reads them as they are."""
    m, D, N = cfg.mla, cfg.hidden, cfg.heads
    a, bias = p + "self_attn.", cfg.qkv_bias
    specs = []
    if m.q_lora_rank is None:
        specs.append(Spec(a + "q_proj.weight", ("attn", "q", "kernel"), (N * m.qk_dim, D), True))
    else:
        r = m.q_lora_rank
        specs += [Spec(a + "q_a_proj.weight", ("attn", "q_a", "kernel"), (r, D), True),
                  Spec(a + "q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), (r,), False),
                  Spec(a + "q_b_proj.weight", ("attn", "q_b", "kernel"), (N * m.qk_dim, r), True)]
        if bias:
            specs.append(Spec(a + "q_a_proj.bias", ("attn", "q_a", "bias"), (r,), False))
    kv_a = m.kv_lora_rank + m.qk_rope_dim
    specs += [Spec(a + "kv_a_proj_with_mqa.weight", ("attn", "kv_a", "kernel"), (kv_a, D), True),
              Spec(a + "kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), (m.kv_lora_rank,), False),
              Spec(a + "kv_b_proj.weight", ("attn", "kv_b", "kernel"), (N * (m.qk_nope_dim + m.v_dim), m.kv_lora_rank),
                   True),
              Spec(a + "o_proj.weight", ("attn", "o", "kernel"), (D, N * m.v_dim), True)]
    if bias:
        specs += [Spec(a + "kv_a_proj_with_mqa.bias", ("attn", "kv_a", "bias"), (kv_a,), False),
                  Spec(a + "o_proj.bias", ("attn", "o", "bias"), (D,), False)]
    return specs


def blocks(cfg: Any, i: int) -> list[Spec]:
    p = f"model.layers.{i}."
    return norm_specs(cfg, p) + mla_specs(cfg, p) + (moe_specs(cfg, p) if cfg.is_moe_layer(i)
                                                     else dense_mlp_specs(cfg, p))


FAMILY = Family(name="deepseek_v3", title="DeepSeek-V3", model_type="deepseek_v3", hf_class="DeepseekV3ForCausalLM",
                presets=PRESETS, other_model_types={"kimi_k2": None},  # Kimi K2's folders: DeepSeek-V3's architecture
                moe=True, mla=True, hf_defaults=DEFAULTS, features={"qkv_bias": EITHER, "moe.scoring": "sigmoid"},
                dense_layers=True, mtp_layers=True, read=read, refuse=refuse, write=write, blocks=blocks,
                problems=lambda cfg: hf_json.sigmoid_routed_problems(cfg, "DeepSeek-V3"))
