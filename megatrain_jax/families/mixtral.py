"""Mixtral (Mixtral-8x7B: 46.7B, 12.9B active): Mistral's blocks with a mixture of experts, the top 2 of 8
renormalized."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family, UnsupportedConfig
from megatrain_jax.families.llama import TINY
from megatrain_jax.families.tensors import Spec, attention_specs, dense_mlp_specs, moe_specs, norm_specs

PRESETS = {
    "tiny-moe": dict(TINY, family="mixtral", moe=dict(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.02)),
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                         rope_theta=1000000.0, max_positions=32768,
                         moe=dict(experts=8, top_k=2, expert_ffn=14336, norm_topk_prob=True, aux_loss_coef=0.02)),
}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    try:
        moe = dict(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                   expert_ffn=int(c["intermediate_size"]), norm_topk_prob=True,
                   aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json of model_type 'mixtral' lacks the required field {e.args[0]!r}") from None
    return dict(sliding_window=c.get("sliding_window"), moe=moe)


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    m = cfg.moe
    out.update(sliding_window=cfg.sliding_window, num_local_experts=m.experts, intermediate_size=m.expert_ffn,
               router_jitter_noise=0.0)


def problems(cfg: Any) -> list[str]:
    m = cfg.moe
    out = hf_json.softmax_routed_problems(cfg)
    if m is not None and (not m.norm_topk_prob or m.shared_expert_ffn is not None):
        out.append("Mixtral renormalizes its top-k and has no shared expert")
    return out


def blocks(cfg: Any, i: int) -> list[Spec]:
    """Mixtral's experts are ``block_sparse_moe.experts.j.w1/w3/w2`` (gate, up, down)."""
    p = f"model.layers.{i}."
    mlp = (moe_specs(cfg, p, "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}) if cfg.is_moe_layer(i)
           else dense_mlp_specs(cfg, p))
    return norm_specs(cfg, p) + attention_specs(cfg, p) + mlp


FAMILY = Family(name="mixtral", title="Mixtral", model_type="mixtral", hf_class="MixtralForCausalLM", presets=PRESETS,
                moe=True, hf_defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                                           max_position_embeddings=131072),
                read=read, refuse=refuse, write=write, problems=problems, blocks=blocks)
