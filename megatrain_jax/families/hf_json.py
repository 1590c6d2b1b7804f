"""config.json readers and writers that several families share: RoPE's parameters, Qwen's sliding window, the
per-layer attention types, and the sigmoid-routed mixtures of experts (GLM-4.5, DeepSeek-V3).

They give DecoderConfig fields as plain values (a nested config as a dict of its fields); ``hf.config`` builds the
DecoderConfig. Both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x one
(``rope_parameters``) are read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from megatrain_jax.families.family import Family, Fields, UnsupportedConfig


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one config.json key holds: a JSON ``type`` ("int", "number", "bool", "str", "object", "list of numbers",
    "list of strings"), the ``least`` a number may be (``above``: strictly), and whether null means "unset" for it."""

    type: str
    least: float | None = None
    above: bool = False
    nullable: bool = False

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.type in ("bool", "str"):
            return isinstance(value, bool if self.type == "bool" else str)
        if self.type == "object":
            return isinstance(value, dict)
        if self.type.startswith("list of "):
            return isinstance(value, list) and all(_number(v) if self.type.endswith("numbers") else isinstance(v, str)
                                                   for v in value)
        if not _number(value) or (self.type == "int" and not isinstance(value, int)):
            return False
        return self.least is None or (value > self.least if self.above else value >= self.least)

    def __str__(self) -> str:
        """What the value must be, in words: "a positive integer", "true or false (or null)", ..."""
        if self.type in ("int", "number"):
            what = "an integer" if self.type == "int" else "a finite number"
            if self.least == 0:
                positive = "a positive integer" if self.type == "int" else "a positive, finite number"
                what = positive if self.above else f"{what} >= 0"
        else:
            words = {"bool": "true or false", "str": "a string", "object": "a JSON object"}
            what = words.get(self.type, f"a {self.type}")
        return f"{what} (or null)" if self.nullable else what


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


POSITIVE, COUNT, FLAG = Kind("int", 0, above=True), Kind("int", 0), Kind("bool")
POSITIVE_NUMBER, NONNEGATIVE_NUMBER = Kind("number", 0, above=True), Kind("number", 0)
UNSET_OR_POSITIVE = Kind("int", 0, above=True, nullable=True)
UNSET_OR_NUMBER = Kind("number", 0, nullable=True)
# The config.json keys any family reads, and what each must hold where it is present: checked before any is used.
KINDS: dict[str, Kind] = {
    "model_type": Kind("str", nullable=True), "vocab_size": POSITIVE, "hidden_size": POSITIVE,
    "intermediate_size": POSITIVE, "num_hidden_layers": POSITIVE, "num_attention_heads": POSITIVE,
    "num_key_value_heads": UNSET_OR_POSITIVE, "head_dim": UNSET_OR_POSITIVE, "max_position_embeddings": POSITIVE,
    "rms_norm_eps": POSITIVE_NUMBER, "rope_theta": POSITIVE_NUMBER, "partial_rotary_factor": POSITIVE_NUMBER,
    "original_max_position_embeddings": UNSET_OR_POSITIVE, "tie_word_embeddings": FLAG,
    "sliding_window": Kind("int", 0, nullable=True), "use_sliding_window": FLAG,
    "max_window_layers": Kind("int", 0, nullable=True),
    "sliding_window_pattern": POSITIVE, "attention_bias": FLAG, "mlp_bias": FLAG, "qkv_bias": FLAG,
    "use_qk_norm": FLAG,
    "attention_dropout": UNSET_OR_NUMBER, "resid_pdrop": UNSET_OR_NUMBER, "embd_pdrop": UNSET_OR_NUMBER,
    "query_pre_attn_scalar": POSITIVE_NUMBER, "final_logit_softcapping": Kind("number", 0, above=True, nullable=True),
    "num_experts": POSITIVE, "num_local_experts": POSITIVE, "n_routed_experts": POSITIVE,
    "num_experts_per_tok": POSITIVE, "moe_intermediate_size": POSITIVE, "n_shared_experts": COUNT,
    "shared_expert_intermediate_size": Kind("int", 0, nullable=True), "n_group": POSITIVE, "topk_group": POSITIVE,
    "norm_topk_prob": FLAG, "routed_scaling_factor": POSITIVE_NUMBER, "router_aux_loss_coef": NONNEGATIVE_NUMBER,
    "router_jitter_noise": UNSET_OR_NUMBER, "decoder_sparse_step": POSITIVE, "moe_layer_freq": POSITIVE,
    "first_k_dense_replace": COUNT, "swiglu_alpha": POSITIVE_NUMBER, "swiglu_limit": POSITIVE_NUMBER,
    "kv_lora_rank": POSITIVE, "q_lora_rank": UNSET_OR_POSITIVE, "qk_nope_head_dim": POSITIVE,
    "qk_rope_head_dim": POSITIVE, "v_head_dim": POSITIVE, "rope_interleave": FLAG,
    "layer_types": Kind("list of strings", nullable=True), "rope_scaling": Kind("object", nullable=True),
    "rope_parameters": Kind("object", nullable=True), "rope_local_base_freq": POSITIVE_NUMBER,
}
# The keys of ``rope_scaling`` (``rope_parameters``).
ROPE_KINDS: dict[str, Kind] = {
    "rope_type": Kind("str"), "type": Kind("str"), "rope_theta": POSITIVE_NUMBER,
    "partial_rotary_factor": POSITIVE_NUMBER, "factor": POSITIVE_NUMBER, "low_freq_factor": POSITIVE_NUMBER,
    "high_freq_factor": POSITIVE_NUMBER, "original_max_position_embeddings": UNSET_OR_POSITIVE,
    "beta_fast": UNSET_OR_NUMBER, "beta_slow": UNSET_OR_NUMBER, "attention_factor": UNSET_OR_NUMBER,
    "mscale": UNSET_OR_NUMBER, "mscale_all_dim": UNSET_OR_NUMBER, "truncate": FLAG,
    "short_factor": Kind("list of numbers", nullable=True), "long_factor": Kind("list of numbers", nullable=True),
}


def check_kinds(c: dict[str, Any]) -> None:
    """Raise UnsupportedConfig naming the first key of config.json ``c`` (or of its rope parameters) whose value is
    not of its ``KINDS``: a string where a number belongs, null for a required number, zero heads, ..."""
    tables = [("", c, KINDS)]
    for key in ("rope_scaling", "rope_parameters"):
        params = c.get(key)
        if isinstance(params, dict) and params and set(params) <= {"full_attention", "sliding_attention"}:
            tables += [(f"{key}.", params, {layer_type: Kind("object", nullable=True) for layer_type in params})]
            tables += [(f"{key}.{t}.", p, ROPE_KINDS) for t, p in params.items() if isinstance(p, dict)]
        elif isinstance(params, dict):
            tables.append((f"{key}.", params, ROPE_KINDS))
    for prefix, table, kinds in tables:
        for key, kind in kinds.items():
            if key in table and not kind.holds(table[key]):
                quoted = " (a JSON number, without quotes)" if kind.type in ("int", "number") and isinstance(
                    table[key], str) else ""
                raise UnsupportedConfig(f"{prefix}{key}={_json(table[key])}: must be {kind}{quoted}; correct it, or "
                                        f"take config.json again from the model's source")


def _json(value: Any) -> str:
    """``value`` as config.json writes it."""
    return json.dumps(value, default=repr)


def rope_fields(c: dict[str, Any], family: Family, max_pos: int) -> Fields:
    """``rope_theta``, ``partial_rotary_factor`` and ``rope_scaling`` (a dict of RopeScaling's fields, or None) as
    ``family``'s config class reads them: its ``rope_kinds`` (LongRoPE's older names "su" and "yarn" where it takes
    longrope), a partial rotation only where its ``hf_defaults`` name one, and a top-level
    ``original_max_position_embeddings`` that wins over the scaling's where its defaults give one (Phi-3's)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UnsupportedConfig(f"rope parameters {params!r} are not a dict")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedConfig(f"per-layer-type rope parameters {sorted(params)} are not supported")
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if "longrope" in family.rope_kinds and kind in ("su", "yarn"):  # Phi3Config reads its older names as longrope
        kind = "longrope"
    if kind not in family.rope_kinds:
        raise UnsupportedConfig(f"rope_scaling type {kind!r} is not supported for model_type {family.model_type!r}; "
                                f"supported: {list(family.rope_kinds)}")
    partial = float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and "partial_rotary_factor" not in family.hf_defaults:
        raise UnsupportedConfig(f"partial_rotary_factor {partial!r} is not supported for model_type "
                                f"{family.model_type!r} (its attention rotates the whole head)")
    fields = dict(rope_theta=theta, partial_rotary_factor=partial, rope_scaling=None)
    if kind == "default":
        return fields
    if "original_max_position_embeddings" in family.hf_defaults:  # the config class's own field wins (Phi-3)
        original = int(c.get("original_max_position_embeddings") or family.hf_defaults["original_max_position_embeddings"])
    else:
        inner, outer = params.get("original_max_position_embeddings"), c.get("original_max_position_embeddings")
        if inner and outer and int(inner) != int(outer):  # transformers 5 takes the top-level one, 4.x the inner one
            where = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
            raise UnsupportedConfig(f"original_max_position_embeddings={outer} beside {where}."
                                    f"original_max_position_embeddings={inner}: transformers 5 scales RoPE by the "
                                    f"first, 4.x by the second; keep one of them (the length the model was "
                                    f"pre-trained at) in config.json")
        original = int(inner or outer or max_pos)
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):  # transformers: the ratio of the two lengths
        factor = max_pos / original
    if factor is None:
        raise UnsupportedConfig(f"rope_scaling {params!r} of type {kind!r} lacks 'factor'")
    if kind == "longrope" and (params.get("short_factor") is None or params.get("long_factor") is None):
        raise UnsupportedConfig(f"rope_scaling {params!r} of type 'longrope' lacks short_factor or long_factor")
    optional = {k: float(params[k]) for k in ("attention_factor", "mscale", "mscale_all_dim")
                if params.get(k) is not None}
    factors = {k: tuple(float(v) for v in params[k]) for k in ("short_factor", "long_factor")
               if params.get(k) is not None}
    fields["rope_scaling"] = dict(
        factor=float(factor), low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)), original_max_position=original, kind=kind,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), **optional, **factors)
    return fields


def rope_to_hf(s: Any) -> dict[str, Any]:
    """The ``rope_scaling`` dict transformers reads for RopeScaling ``s``."""
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.kind == "longrope":  # Phi-3: original_max_position_embeddings is a top-level field (phi3.write)
        out = {"rope_type": "longrope", "factor": s.factor, "short_factor": list(s.short_factor),
               "long_factor": list(s.long_factor)}
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
        return out
    if s.kind == "yarn":
        out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_position,
               "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
        out.update({k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(s, k) is not None})
        return out
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}


def layer_types(c: dict[str, Any], layers: int, pattern: int) -> tuple[str, ...]:
    """Each layer's attention: ``layer_types``, or where a config omits it every ``pattern``-th layer full
    attention, the rest sliding (Gemma3TextConfig's rule with its ``sliding_window_pattern``, 6 by default;
    GptOssConfig's with 2)."""
    types = c.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(types)


def qwen_sliding_window(c: dict[str, Any], layers: int, every_other_below: bool = False) -> int | None:
    """Qwen2/3 and Qwen2-MoE (``c`` with the config class's defaults filled in): a window only when
    ``use_sliding_window``, on the layers ``layer_types`` names, or where a config omits it on those its config class
    picks by ``max_window_layers``: Qwen2Config's and Qwen3Config's layers >= it, Qwen2MoeConfig's
    (``every_other_below``) every other layer below it (the first, the third, ...). Our blocks take all-full or
    all-sliding. (Qwen3-MoE reads neither key: ``qwen3_moe.read``.)"""
    window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    types = c.get("layer_types")
    if types is None:
        mwl = c.get("max_window_layers", 28)
        slides = (lambda i: i % 2 == 0 and i < mwl) if every_other_below else (lambda i: i >= mwl)
        types = ["sliding_attention" if window is not None and slides(i) else "full_attention" for i in range(layers)]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return int(window)
    raise UnsupportedConfig(f"layer_types {types} (use_sliding_window={c.get('use_sliding_window')}, "
                            f"sliding_window={window}, max_window_layers={c.get('max_window_layers')}) "
                            f"mix full and sliding attention; only all-full or all-sliding is supported")


def write_qwen_sliding_window(cfg: Any, out: dict[str, Any]) -> None:
    sliding = cfg.sliding_window is not None
    out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
               max_window_layers=0 if sliding else cfg.layers,
               layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.layers)


def qwen_moe(c: dict[str, Any], shared: bool) -> Fields:
    """Qwen2-MoE's (with a gated ``shared`` expert) and Qwen3-MoE's mixture of experts."""
    try:
        experts = c.get("num_experts", c.get("num_local_experts"))  # transformers 5 writes the latter for Qwen3-MoE
        if experts is None:
            raise KeyError("num_experts")
        width = c["shared_expert_intermediate_size"] if shared else None
        return dict(experts=int(experts), top_k=int(c["num_experts_per_tok"]),
                    expert_ffn=int(c["moe_intermediate_size"]),
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)),  # transformers' default
                    shared_expert_ffn=int(width) if width else None,
                    aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json of model_type {c.get('model_type')!r} lacks the required field "
                                f"{e.args[0]!r}") from None


def write_qwen_moe(cfg: Any, out: dict[str, Any]) -> None:
    m = cfg.moe
    out.update(num_experts=m.experts, moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
               decoder_sparse_step=1, mlp_only_layers=[])


def sigmoid_routed_moe(c: dict[str, Any]) -> Fields:
    """GLM-4.5's and DeepSeek-V3's mixture of experts (``c`` with the config class's defaults filled in): a sigmoid
    router with a correction bias over grouped experts and ungated shared experts, trained without a load-balancing
    loss (the correction bias balances, and is not trained here)."""
    try:
        ffn = int(c["moe_intermediate_size"])
        shared = int(c.get("n_shared_experts", 1))
        return dict(experts=int(c.get("n_routed_experts", c.get("num_local_experts", 128))),
                    top_k=int(c["num_experts_per_tok"]), expert_ffn=ffn, norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                    shared_expert_ffn=shared * ffn if shared else None, shared_expert_gate=False, scoring="sigmoid",
                    groups=int(c.get("n_group", 1)), topk_groups=int(c.get("topk_group", 1)),
                    routed_scale=float(c.get("routed_scaling_factor", 1.0)), aux_loss_coef=0.0)
    except KeyError as e:
        raise UnsupportedConfig(f"config.json of model_type {c.get('model_type')!r} lacks the required field "
                                f"{e.args[0]!r}") from None


def refuse_sigmoid_router(c: dict[str, Any], family: Family) -> None:
    """What transformers' TopkRouter of GLM-4.5 / DeepSeek-V3 computes and ours would not: anything but the sigmoid
    router with grouped top-k. Their multi-token-prediction layers (``num_nextn_predict_layers``, the tensors of
    layers ``num_hidden_layers`` onwards in the released checkpoints) are no part of the causal LM transformers builds
    (it ignores them on load): ``check_checkpoint`` skips them knowingly and an export does not write them."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):  # DeepSeek-V3's spellings
        if c.get(key, want) != want:
            raise UnsupportedConfig(f"{key}={c[key]!r} for model_type {family.model_type!r} is not supported "
                                    f"(transformers' {family.hf_class.removesuffix('ForCausalLM')}TopkRouter scores by "
                                    f"sigmoid with a correction bias: {want!r})")


def write_sigmoid_routed(cfg: Any, out: dict[str, Any]) -> None:
    """GLM-4.5's and DeepSeek-V3's MoE keys; no multi-token-prediction layers: none are trained or written."""
    m = cfg.moe
    del out["router_aux_loss_coef"]
    out.update(n_routed_experts=m.experts, moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
               n_shared_experts=m.shared_expert_ffn // m.expert_ffn, n_group=m.groups, topk_group=m.topk_groups,
               routed_scaling_factor=m.routed_scale, first_k_dense_replace=cfg.first_k_dense_replace,
               attention_bias=cfg.qkv_bias, num_nextn_predict_layers=0)


def sigmoid_routed_problems(cfg: Any, title: str) -> list[str]:
    m = cfg.moe
    if m is None or m.scoring != "sigmoid":  # the scoring itself: Family.features
        return []
    if m.shared_expert_ffn is None or m.shared_expert_gate or m.shared_expert_ffn % m.expert_ffn:
        return [f"{title} has ungated shared experts n_shared_experts x moe.expert_ffn wide (moe.shared_expert_ffn a "
                f"multiple of moe.expert_ffn, shared_expert_gate=False)"]
    return []


def softmax_routed_problems(cfg: Any) -> list[str]:
    """A softmax router (Mixtral, Qwen-MoE, GPT-OSS; the scoring itself is in Family.features): no grouped or scaled
    routing."""
    m = cfg.moe
    if m is not None and (m.groups != 1 or m.routed_scale != 1.0):
        return [f"moe.groups={m.groups}, moe.routed_scale={m.routed_scale} (grouped, scaled routing is GLM-4.5's and "
                f"DeepSeek-V3's)"]
    return []


def refuse_silu(c: dict[str, Any]) -> None:
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedConfig(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")


def refuse_attention_bias(c: dict[str, Any]) -> None:
    if c.get("attention_bias", False):
        raise UnsupportedConfig(f"attention_bias=True for model_type {c.get('model_type')!r} is not supported (it also "
                                f"puts a bias on o_proj; only Qwen2-style q/k/v biases are)")
