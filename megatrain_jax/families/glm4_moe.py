"""GLM-4.5 (zai-org/GLM-4.5-Air: 106B total, 12B active; zai-org/GLM-4.5: 355B, 32B): sigmoid routers with a correction
bias, one shared expert, leading dense layers, q/k/v biases, RoPE on half of each head; GLM-4.5 adds per-head q/k norms
and scales the routed weights by 2.5. Their checkpoints also hold one multi-token-prediction layer
(num_nextn_predict_layers) past the last, which is not part of this model."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import EITHER, Family

GLM45_AIR = dict(family="glm4_moe", vocab_size=151552, hidden=4096, ffn=10944, layers=46, heads=96, kv_heads=8,
                 head_dim=128, rope_theta=1000000.0, partial_rotary_factor=0.5, norm_eps=1e-5, qkv_bias=True,
                 max_positions=131072, first_k_dense_replace=1,
                 moe=dict(experts=128, top_k=8, expert_ffn=1408, norm_topk_prob=True, shared_expert_ffn=1408,
                          shared_expert_gate=False, scoring="sigmoid", routed_scale=1.0))
PRESETS = {"glm4.5-air": GLM45_AIR,
           "glm4.5": dict(GLM45_AIR, hidden=5120, ffn=12288, layers=92, qk_norm=True, first_k_dense_replace=3,
                          moe=dict(GLM45_AIR["moe"], experts=160, expert_ffn=1536, shared_expert_ffn=1536,
                                   routed_scale=2.5))}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=bool(c.get("use_qk_norm", False)),
                first_k_dense_replace=int(c.get("first_k_dense_replace", 1)), moe=hf_json.sigmoid_routed_moe(c))


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_sigmoid_router(c, FAMILY)


def write(cfg: Any, out: dict[str, Any]) -> None:
    hf_json.write_sigmoid_routed(cfg, out)
    out.update(use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)


FAMILY = Family(name="glm4_moe", title="GLM-4.5", model_type="glm4_moe", hf_class="Glm4MoeForCausalLM",
                presets=PRESETS, moe=True, hf_defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5,
                                                               partial_rotary_factor=0.5,
                                                               max_position_embeddings=131072),
                features={"qkv_bias": EITHER, "qk_norm": EITHER, "moe.scoring": "sigmoid"}, dense_layers=True, mtp_layers=True,
                read=read, refuse=refuse, write=write,
                problems=lambda cfg: hf_json.sigmoid_routed_problems(cfg, "GLM-4.5"))
