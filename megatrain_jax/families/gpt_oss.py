"""GPT-OSS (openai/gpt-oss-20b: 20.9B total, 3.6B active; openai/gpt-oss-120b: 116.8B, 5.1B): attention sinks, q/k/v/o
biases, a biased router whose softmax over the top 4 logits weights the experts, experts with biases and the clamped
SwiGLU, no shared expert. The released checkpoints store the experts as MXFP4 (hf/mxfp4.py)."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import EITHER, Family, UnsupportedConfig
from megatrain_jax.families.tensors import Spec, attention_specs, dense_mlp_specs, norm_specs


def gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """A GPT-OSS model as its released config.json sets it (transformers' GptOssConfig): sliding (128 tokens) and
    full-attention layers alternating, the first sliding; YaRN by 32 over 4,096 positions, untruncated."""
    return dict(
        family="gpt_oss", vocab_size=201088, hidden=2880, ffn=2880, layers=layers, heads=64, kv_heads=8, head_dim=64,
        rope_theta=150000.0, norm_eps=1e-5, qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=128,
        rope_scaling=dict(kind="yarn", factor=32.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                          truncate=False),
        layer_types=tuple("full_attention" if i % 2 else "sliding_attention" for i in range(layers)),
        max_positions=131072,
        moe=dict(experts=experts, top_k=4, expert_ffn=2880, norm_topk_prob=True, router_bias=True, expert_bias=True,
                 activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0, aux_loss_coef=0.9))


PRESETS = {"gpt-oss-20b": gpt_oss(layers=24, experts=32), "gpt-oss-120b": gpt_oss(layers=36, experts=128)}

# GptOssConfig's defaults (GPT-OSS-120B's shape, its YaRN and RoPE base) where config.json omits a field
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
DEFAULTS = dict(num_key_value_heads=8, num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880, head_dim=64,
                sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, rope_theta=150000.0,
                swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001)


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    """Without rope parameters, GptOssConfig's YaRN (factor 32 over 4,096 positions, untruncated) at its base. The
    router (``GptOssTopKRouter``: a softmax over the top-k biased logits) weights as a renormalized top-k does."""
    if not c.get("rope_scaling") and not c.get("rope_parameters"):
        c = dict(c, rope_parameters={**ROPE, "rope_theta": c["rope_theta"]})
    moe = dict(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
               expert_ffn=int(c["intermediate_size"]), norm_topk_prob=True, router_bias=True, expert_bias=True,
               activation="clamped_swiglu", swiglu_alpha=float(c["swiglu_alpha"]),
               swiglu_limit=float(c["swiglu_limit"]), aux_loss_coef=float(c["router_aux_loss_coef"]))
    return dict(hf_json.rope_fields(c, FAMILY, int(c["max_position_embeddings"])),
                qkv_bias=bool(c["attention_bias"]), o_bias=bool(c["attention_bias"]),
                sliding_window=c.get("sliding_window"), layer_types=hf_json.layer_types(c, layers, 2), moe=moe)


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    q = c.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if q and method != "mxfp4":
        raise UnsupportedConfig(f"quantization_config (quant_method {method!r}): of quantized GPT-OSS checkpoints only "
                                f"the released MXFP4 experts (quant_method 'mxfp4') are read (dequantized)")


def write(cfg: Any, out: dict[str, Any]) -> None:
    """rope_parameters, always: GptOssConfig puts its YaRN in place of a missing one."""
    m, rope = cfg.moe, out.pop("rope_scaling")
    del out["rope_theta"]
    out.update(num_local_experts=m.experts, intermediate_size=m.expert_ffn, swiglu_alpha=m.swiglu_alpha,
               swiglu_limit=m.swiglu_limit, attention_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window,
               layer_types=[cfg.layer_type(i) for i in range(cfg.layers)],
               rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": cfg.rope_theta})


def problems(cfg: Any) -> list[str]:
    out = hf_json.softmax_routed_problems(cfg)
    if cfg.o_bias != cfg.qkv_bias:
        out.append(f"o_bias={cfg.o_bias} with qkv_bias={cfg.qkv_bias} (GPT-OSS's attention_bias puts biases on q, k, v "
                   f"and o alike)")
    m = cfg.moe
    if m is not None and (not m.norm_topk_prob or m.shared_expert_ffn is not None):
        out.append("GPT-OSS weights its top-k experts by a softmax over their logits (norm_topk_prob) and has no "
                   "shared expert")
    return out


def moe_specs(cfg: Any, p: str) -> list[Spec]:
    """GPT-OSS's mixture of experts (``GptOssMLP``): ``router`` (weight [E, D], bias), and the experts stacked and
    stored [in, out] (no transpose): ``gate_up_proj`` [E, D, 2F] with gate in the even columns and up in the odd ones
    (``GptOssExperts._apply_gate``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), its bias [E, 2F] likewise,
    ``down_proj`` [E, F, D] and its bias [E, D]."""
    m, D = cfg.moe, cfg.hidden
    E, F = m.experts, m.expert_ffn
    x = p + "mlp.experts."
    specs = [Spec(p + "mlp.router.weight", ("mlp", "router", "kernel"), (E, D), True),
             Spec(p + "mlp.router.bias", ("mlp", "router", "bias"), (E,), False)]
    for ours, start in (("gate", 0), ("up", 1)):
        specs += [Spec(x + "gate_up_proj", ("mlp", "experts", ours), (E, D, 2 * F), False, interleave=(start, 2)),
                  Spec(x + "gate_up_proj_bias", ("mlp", "experts", f"{ours}_bias"), (E, 2 * F), False,
                       interleave=(start, 2))]
    return specs + [Spec(x + "down_proj", ("mlp", "experts", "down"), (E, F, D), False),
                    Spec(x + "down_proj_bias", ("mlp", "experts", "down_bias"), (E, D), False)]


def blocks(cfg: Any, i: int) -> list[Spec]:
    p = f"model.layers.{i}."
    mlp = moe_specs(cfg, p) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, p)
    return norm_specs(cfg, p) + attention_specs(cfg, p) + mlp


FAMILY = Family(name="gpt_oss", title="GPT-OSS", model_type="gpt_oss", hf_class="GptOssForCausalLM", presets=PRESETS,
                moe=True, hf_defaults=DEFAULTS,
                features={"qkv_bias": EITHER, "o_bias": EITHER, "attention_sinks": True, "moe.router_bias": True,
                          "moe.expert_bias": True, "moe.activation": "clamped_swiglu"},
                mixed_layers=True, mxfp4_experts=True, read=read, refuse=refuse, write=write, problems=problems, blocks=blocks)
