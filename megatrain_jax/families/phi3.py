"""Phi-3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): Llama's blocks stored with fused q/k/v and gate/up tensors, LongRoPE,
RoPE on part of each head (Phi-4-mini's 0.75)."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family
from megatrain_jax.families.tensors import Spec, norm_specs

# Phi-3 (microsoft/Phi-3-mini-4k-instruct, Phi-3-medium-4k-instruct: 3.82B, 13.96B) and Phi-4 (14.66B): the 4k
# models' 2,047-token window.
PHI3_MINI = dict(family="phi3", vocab_size=32064, hidden=3072, ffn=8192, layers=32, heads=32, kv_heads=32,
                 rope_theta=10000.0, norm_eps=1e-5, sliding_window=2047, max_positions=4096)
PHI3_MEDIUM = dict(PHI3_MINI, hidden=5120, ffn=17920, layers=40, heads=40, kv_heads=10)
PRESETS = {"phi3-mini": PHI3_MINI, "phi3-medium": PHI3_MEDIUM,
           "phi4": dict(PHI3_MEDIUM, vocab_size=100352, rope_theta=250000.0, sliding_window=None, max_positions=16384)}


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(sliding_window=c.get("sliding_window"))  # Phi3Model masks by sliding_window whenever it is set


def write(cfg: Any, out: dict[str, Any]) -> None:
    s = cfg.rope_scaling
    # Phi3Config's default original length (4096) would otherwise override rope_scaling's
    out.update(sliding_window=cfg.sliding_window, partial_rotary_factor=cfg.partial_rotary_factor, resid_pdrop=0.0,
               embd_pdrop=0.0,
               original_max_position_embeddings=cfg.max_positions if s is None else s.original_max_position)


def blocks(cfg: Any, i: int) -> list[Spec]:
    """Phi-3's fused projections: ``qkv_proj`` [q + k + v rows, D] (Phi3Attention slices q, k, v in that order) and
    ``gate_up_proj`` [2F, D] (Phi3MLP's ``chunk(2)``: gate, then up)."""
    p = f"model.layers.{i}."
    D, F, hd = cfg.hidden, cfg.ffn, cfg.dim_per_head
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    qkv, gate_up = (q + 2 * kv, D), (2 * F, D)
    return norm_specs(cfg, p) + [
        Spec(p + "self_attn.qkv_proj.weight", ("attn", "q", "kernel"), qkv, True, rows=(0, q)),
        Spec(p + "self_attn.qkv_proj.weight", ("attn", "k", "kernel"), qkv, True, rows=(q, q + kv)),
        Spec(p + "self_attn.qkv_proj.weight", ("attn", "v", "kernel"), qkv, True, rows=(q + kv, q + 2 * kv)),
        Spec(p + "self_attn.o_proj.weight", ("attn", "o", "kernel"), (D, q), True),
        Spec(p + "mlp.gate_up_proj.weight", ("mlp", "gate", "kernel"), gate_up, True, rows=(0, F)),
        Spec(p + "mlp.gate_up_proj.weight", ("mlp", "up", "kernel"), gate_up, True, rows=(F, 2 * F)),
        Spec(p + "mlp.down_proj.weight", ("mlp", "down", "kernel"), (D, F), True)]


# Phi3Config reads rope_scaling "longrope" (and its older names "su", "yarn") only; its own
# original_max_position_embeddings (default 4096) wins over the scaling's.
FAMILY = Family(name="phi3", title="Phi-3", model_type="phi3", hf_class="Phi3ForCausalLM", presets=PRESETS,
                hf_defaults=dict(rms_norm_eps=1e-5, partial_rotary_factor=1.0, original_max_position_embeddings=4096),
                rope_kinds=("default", "longrope"), read=read, refuse=hf_json.refuse_silu, write=write, blocks=blocks)
