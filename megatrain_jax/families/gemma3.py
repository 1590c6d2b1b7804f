"""Gemma 3 (google/gemma-3-1b-pt and the text parts of gemma-3-4b/12b/27b-pt, ``gemma3_text``): sandwich norms with
weights offset from 1, GeGLU, scaled tied embeddings, per-head q/k norms; five sliding-window layers (RoPE base
10,000) to each full-attention one (base 1,000,000, linear scaling by 8 past 1B)."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import EITHER, Family, UnsupportedConfig

SCALING = dict(kind="linear", factor=8.0, original_max_position=131072)


def gemma3(layers: int, **shape: Any) -> dict[str, Any]:
    """A Gemma 3 text model as its config.json sets it: every 6th layer full attention, the rest sliding; the
    multimodal models' text part has 262,208 tokens (Gemma3TextConfig's default)."""
    fields = dict(family="gemma3", vocab_size=262208, head_dim=256, rope_theta=1000000.0, sliding_rope_theta=10000.0,
                  norm_eps=1e-6, tie_embeddings=True, qk_norm=True, norm_placement="sandwich", norm_unit_offset=True,
                  scale_embeddings=True, mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0,
                  sliding_window=1024, max_positions=131072, layers=layers,
                  layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(layers)))
    return {**fields, **shape}


PRESETS = {
    "gemma3-1b": gemma3(vocab_size=262144, hidden=1152, ffn=6912, layers=26, heads=4, kv_heads=1, sliding_window=512,
                        max_positions=32768),
    "gemma3-4b": gemma3(hidden=2560, ffn=10240, layers=34, heads=8, kv_heads=4, rope_scaling=SCALING),
    "gemma3-12b": gemma3(hidden=3840, ffn=15360, layers=48, heads=16, kv_heads=8, rope_scaling=SCALING),
    "gemma3-27b": gemma3(hidden=5376, ffn=21504, layers=62, heads=32, kv_heads=16, head_dim=128,
                         query_pre_attn_scalar=168.0, rope_scaling=SCALING),
}

MULTIMODAL = (
    "model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B: a vision tower beside "
    "the language model, whose config is under text_config); only its text part as a Gemma3ForCausalLM folder "
    "(model_type 'gemma3_text') is read: write config.json from text_config (with model_type 'gemma3_text', "
    "architectures ['Gemma3ForCausalLM']) and the language model's tensors renamed to model.* "
    "(language_model.model.* in the released files, model.language_model.* as transformers 5 saves them), leaving "
    "out the vision tower and the projector")


def rope(c: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """RoPE of a Gemma 3 config: transformers 5 writes ``rope_parameters`` per layer type, 4.x ``rope_theta`` +
    ``rope_scaling`` for the full-attention layers and ``rope_local_base_freq`` for the sliding ones
    (Gemma3TextConfig's defaults: 1e6 and 1e4)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= {"full_attention", "sliding_attention"}:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = dict(c.get("rope_scaling") or params or {})
        local = {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", c.get("rope_theta", 1000000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedConfig(f"sliding_attention rope parameters {local!r}: Gemma 3's sliding-window layers rotate "
                                f"without scaling here (rope_type 'default')")
    fields = hf_json.rope_fields({"rope_parameters": full}, FAMILY, max_pos)
    return dict(fields, sliding_rope_theta=float(local.get("rope_theta", c.get("rope_local_base_freq", 10000.0))))


def read(c: dict[str, Any], layers: int) -> dict[str, Any]:
    return dict(rope(c, int(c["max_position_embeddings"])), sliding_window=c.get("sliding_window", 4096),
                layer_types=hf_json.layer_types(c, layers, int(c.get("sliding_window_pattern", 6))),
                query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
                final_logit_softcap=None if c.get("final_logit_softcapping") is None
                else float(c["final_logit_softcapping"]))


def refuse(c: dict[str, Any]) -> None:
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedConfig(f"hidden_activation {act!r} is not supported for Gemma 3 (GeGLU with "
                                f"'gelu_pytorch_tanh' only)")
    if c.get("attn_logit_softcapping") is not None:
        raise UnsupportedConfig(f"attn_logit_softcapping={c['attn_logit_softcapping']!r} is not supported (attention "
                                f"scores are not capped here; released Gemma 3 models set null)")
    if c.get("use_bidirectional_attention"):
        raise UnsupportedConfig("use_bidirectional_attention=True is not supported (causal attention only)")
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    del out["hidden_act"]
    scalar = cfg.dim_per_head if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
    out.update(hidden_activation="gelu_pytorch_tanh",  # Gemma3TextConfig takes an int where it is one
               query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               sliding_window=cfg.sliding_window, layer_types=[cfg.layer_type(i) for i in range(cfg.layers)],
               rope_local_base_freq=cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else cfg.rope_theta,
               final_logit_softcapping=cfg.final_logit_softcap, attn_logit_softcapping=None, attention_bias=False,
               use_bidirectional_attention=False)


def problems(cfg: Any) -> list[str]:
    if cfg.sliding_rope_theta is None and cfg.rope_scaling is not None and any(
            cfg.layer_type(i) == "sliding_attention" for i in range(cfg.layers)):
        return ["sliding_rope_theta=None with rope_scaling set (Gemma 3's sliding-window layers rotate unscaled: set "
                "sliding_rope_theta)"]
    return []


FAMILY = Family(name="gemma3", title="Gemma 3", model_type="gemma3_text", hf_class="Gemma3ForCausalLM",
                presets=PRESETS, other_model_types={"gemma3": MULTIMODAL},
                hf_defaults=dict(head_dim=256, num_key_value_heads=4, tie_word_embeddings=True,
                                 max_position_embeddings=131072),
                features=dict(qk_norm=True, norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True,
                              mlp_activation="gelu_tanh", query_pre_attn_scalar=EITHER, sliding_rope_theta=EITHER,
                              final_logit_softcap=EITHER),
                mixed_layers=True, read=read, refuse=refuse, write=write, problems=problems)
