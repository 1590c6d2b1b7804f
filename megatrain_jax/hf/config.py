"""Hugging Face ``config.json`` <-> DecoderConfig: the keys every family shares, and each family's own through its
record (``megatrain_jax.families``: one file per family).

Both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and the 5.x one
(``rope_parameters``, ``dtype``) are read; we write the 4.x spelling, which 5.x still reads. Anything
our decoder cannot reproduce exactly is an error naming the offending value, never silently dropped.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from megatrain_jax.families import FAMILIES, FEATURES, EITHER, Family, UnsupportedConfig, by_model_type
from megatrain_jax.families.hf_json import check_kinds, rope_fields, rope_to_hf
from megatrain_jax.models.config import DecoderConfig, MLAConfig, MoEConfig, RopeScaling

# model_type -> (our family, the causal-LM class transformers builds)
ARCHITECTURES: dict[str, tuple[str, str]] = {f.model_type: (f.name, f.hf_class) for f in FAMILIES.values()}
# Hybrid models whose layers keep a recurrent state (linear attention, state-space layers) between tokens:
# out of scope for this engine's blocks, refused by name with what they are.
HYBRID_TYPES: dict[str, str] = {
    "qwen3_next": "Gated DeltaNet linear attention mixed with full attention",
    "qwen3_5": "Gated DeltaNet linear attention mixed with full attention",
    "qwen3_5_moe": "Gated DeltaNet linear attention mixed with full attention",
    "jamba": "Mamba state-space layers mixed with attention",
    "bamba": "Mamba-2 state-space layers mixed with attention",
    "zamba": "Mamba state-space layers with shared attention",
    "zamba2": "Mamba-2 state-space layers with shared attention",
    "falcon_h1": "Mamba-2 state-space heads beside attention heads",
    "granitemoehybrid": "Mamba-2 state-space layers mixed with attention",
    "nemotron_h": "Mamba-2 state-space layers mixed with attention",
    "lfm2": "short convolutions mixed with attention",
    "minimax": "lightning (linear) attention mixed with softmax attention",
    "recurrent_gemma": "RG-LRU recurrent layers mixed with local attention",
    "mamba": "Mamba state-space layers, no attention",
    "mamba2": "Mamba-2 state-space layers, no attention",
    "rwkv": "RWKV recurrent layers, no attention",
}
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def family_of(c: dict[str, Any]) -> Family:
    """The family a config.json describes, from its ``model_type`` (or its class name); an unsupported model type or
    class is an error naming what is supported."""
    mt = c.get("model_type")
    archs = c.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UnsupportedConfig(f"architectures={archs!r} must be a list of class names, e.g. [\"LlamaForCausalLM\"]")
    if mt is None and archs:  # derive from the class name, e.g. LlamaForCausalLM
        mt = next((f.model_type for f in FAMILIES.values() if f.hf_class in archs), None)
    if mt in HYBRID_TYPES:
        raise UnsupportedConfig(f"model_type {mt!r} is a hybrid model ({HYBRID_TYPES[mt]}): its layers keep a "
                                f"recurrent state between tokens, which this engine's blocks do not implement; "
                                f"supported model types: {sorted(ARCHITECTURES)}")
    family = by_model_type().get(mt)
    if family is None:
        raise UnsupportedConfig(f"model_type {mt!r} (architectures {archs}) is not supported; supported "
                                f"model types: {sorted(ARCHITECTURES)}")
    if family.other_model_types.get(mt):  # a model type this family's file refuses, saying why
        raise UnsupportedConfig(family.other_model_types[mt])
    bad = [a for a in archs if a != family.hf_class]
    if bad or (mt != family.model_type and not archs):
        raise UnsupportedConfig(f"architectures {bad or archs} not supported for model_type {mt!r}; only "
                                f"{family.hf_class!r} (a causal LM with an lm_head) is")
    return family


def _refuse_common(c: dict[str, Any], family: Family) -> None:
    q = c.get("quantization_config")
    if q and not family.mxfp4_experts:  # a family that reads its own quantized release says so in its refuse hook
        method = q.get("quant_method") if isinstance(q, dict) else None
        raise UnsupportedConfig(f"quantization_config (quant_method {method!r}): a quantized checkpoint (FP8, AWQ, GPTQ, "
                                f"bitsandbytes, ...) is not read: training updates full-precision weights. Use the "
                                f"model's bfloat16 release, or dequantize it to bfloat16 and drop quantization_config "
                                f"from config.json")
    if c.get("mlp_bias", False):
        raise UnsupportedConfig("mlp_bias=True is not supported (the MLP has no biases)")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):  # the last two: Phi-3's
        dropout = c.get(key) or 0.0
        if dropout != 0.0:
            raise UnsupportedConfig(f"{key}={dropout!r} is not supported (the engine trains without dropout: "
                                    f"docs/model_contract.md); set it to 0.0 in config.json to train without "
                                    f"dropout (the model's outputs at inference are unchanged)")
    if family.moe:
        if float(c.get("router_jitter_noise") or 0.0) != 0.0:
            raise UnsupportedConfig(f"router_jitter_noise={c['router_jitter_noise']!r} is not supported (routing is "
                                    f"deterministic); set it to 0.0 in config.json")
        if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
            raise UnsupportedConfig(f"decoder_sparse_step={c.get('decoder_sparse_step')!r}, mlp_only_layers="
                                    f"{c.get('mlp_only_layers')!r}: only models whose every layer is a mixture of "
                                    f"experts are supported (one block template serves every layer)")


def config_from_hf(config_json: dict[str, Any], **overrides) -> DecoderConfig:
    """The DecoderConfig of a Hugging Face ``config.json`` (as a dict). ``overrides`` replace fields
    that config.json does not determine (``dtype``, ``attention_impl``, ``loss_chunk_tokens``, ...). A value of
    the wrong type or range is an UnsupportedConfig naming its key."""
    if not isinstance(config_json, dict):
        raise UnsupportedConfig(f"a config.json holds a JSON object, got {type(config_json).__name__}")
    check_kinds(config_json)
    family = family_of(config_json)
    c = {**family.hf_defaults, **config_json}  # the family's config class fills what config.json omits
    family.refuse(c)
    _refuse_common(c, family)
    try:
        hidden, heads, layers = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        fields: dict[str, Any] = dict(
            family=family.name, vocab_size=int(c["vocab_size"]), hidden=hidden, ffn=int(c["intermediate_size"]),
            layers=layers, heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json lacks the required field {e.args[0]!r}") from None
    head_dim = c.get("head_dim") or family.hf_defaults.get("head_dim")
    max_pos = int(c.get("max_position_embeddings", 4096))
    fields.update(
        head_dim=None if head_dim is None or (hidden % heads == 0 and head_dim == hidden // heads) else int(head_dim),
        max_positions=max_pos, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        **{k: v for k, v in family.features.items() if "." not in k and v != EITHER}, **token_ids(c))
    try:
        fields.update(family.read(c, layers))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json of model_type {family.model_type!r} lacks the required field "
                                f"{e.args[0]!r}") from None
    if "rope_theta" not in fields:
        fields.update(rope_fields(c, family, max_pos))
    fields.update(overrides)
    try:
        cfg = DecoderConfig(**_configs(fields))
    except UnsupportedConfig:
        raise
    except ValueError as e:  # DecoderConfig's own rules (heads divide hidden, ...), in its names
        raise UnsupportedConfig(f"{e}{_in_hf_names(str(e))}") from None
    _warn_ids_past_vocab(cfg)
    return cfg


def _warn_ids_past_vocab(cfg: DecoderConfig) -> None:
    """A special token id at or past ``vocab_size`` names no row of the embedding: the model can never emit it (an
    ``eos_token_id`` there: generation never stops on it). Loaded as it is, with a warning: some published configs
    carry such a pad id, and training does not read the ids."""
    past = {name: value for name in TOKEN_ID_FIELDS if (value := getattr(cfg, name)) is not None
            and any(i >= cfg.vocab_size or i < 0 for i in (value if isinstance(value, tuple) else (value,)))}
    if past:
        warnings.warn(f"config.json: {', '.join(f'{k}={v}' for k, v in past.items())} outside the vocabulary "
                      f"(vocab_size {cfg.vocab_size}): no row of the embedding is that token, so the model never "
                      f"emits it; an export keeps the value as it is", UserWarning, stacklevel=3)


# config.json's names of DecoderConfig's fields, where they differ (for DecoderConfig's errors)
HF_NAMES = {"hidden": "hidden_size", "ffn": "intermediate_size", "layers": "num_hidden_layers",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "max_positions": "max_position_embeddings", "norm_eps": "rms_norm_eps",
            "tie_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
            "final_logit_softcap": "final_logit_softcapping"}


def _in_hf_names(message: str) -> str:
    """`` (in config.json: hidden is hidden_size, ...)`` for the fields ``message`` names by DecoderConfig's names."""
    named = [f"{ours} is {theirs}" for ours, theirs in HF_NAMES.items() if re.search(rf"\b{ours}\b", message)]
    return f" (in config.json: {', '.join(named)})" if named else ""


def _configs(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the nested configs a family file gives as dicts made into their dataclasses."""
    out = dict(fields)
    if isinstance(out.get("rope_scaling"), dict):
        try:
            out["rope_scaling"] = RopeScaling(**out["rope_scaling"])
        except ValueError as e:
            raise UnsupportedConfig(f"rope_scaling {fields['rope_scaling']!r}: {e}") from None
    if isinstance(out.get("mla"), dict):
        try:
            out["mla"] = MLAConfig(**out["mla"])
        except ValueError as e:
            raise UnsupportedConfig(f"multi-head latent attention: {e}") from None
    if isinstance(out.get("moe"), dict):
        out["moe"] = MoEConfig(**out["moe"])
    return out


def token_ids(c: dict[str, Any]) -> dict[str, Any]:
    """The special token ids a Hugging Face ``config.json`` (or ``generation_config.json``) sets: an id each,
    the end of sequence possibly a list of them; absent or null ones are left out."""
    out = {}
    for name in TOKEN_ID_FIELDS:
        value = c.get(name)
        if value is None:
            continue
        if isinstance(value, list):
            value = tuple(value)
        ids = value if isinstance(value, tuple) else (value,)
        if name != "eos_token_id" and isinstance(value, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UnsupportedConfig(f"{name}={value!r}: a token id is an integer"
                                    f"{' (or a list of them)' if name == 'eos_token_id' else ''}")
        out[name] = value
    return out


def generation_config(cfg: DecoderConfig) -> dict[str, Any] | None:
    """The ``generation_config.json`` transformers writes for a model of these special ids (None where the
    config sets none): generation stops at the end-of-sequence id(s) and pads with the padding id."""
    ids = {name: _json_id(getattr(cfg, name)) for name in TOKEN_ID_FIELDS if getattr(cfg, name) is not None}
    return {**ids, "_from_model_config": True} if ids else None


def _json_id(value: int | tuple[int, ...]) -> int | list[int]:
    return list(value) if isinstance(value, tuple) else value


# How a problem names the value the architecture has (default: "the {family} architecture has {value!r}").
_HAS = {"norm_placement": lambda v: f"architecture has {v}-norm blocks",
        "qk_norm_width": lambda v: f"architecture normalizes {'all heads at once' if v == 'all_heads' else 'each head'}",
        "o_bias": lambda v: f"architecture has {'a' if v else 'no'} bias on o_proj",
        "moe.scoring": lambda v: f"router scores by {v}"}


def _feature_problems(cfg: DecoderConfig, family: Family) -> list[str]:
    """Where ``cfg`` differs from what the family's architecture fixes (``Family.features``)."""
    problems = []
    for name in FEATURES:
        want = family.feature(name)
        moe_field = name.startswith("moe.")
        if want == EITHER or (moe_field and (cfg.moe is None or not family.moe)) or (
                name == "qk_norm_width" and (not cfg.qk_norm or family.feature("qk_norm") is False)):
            continue
        value = getattr(cfg.moe, name[4:]) if moe_field else getattr(cfg, name)
        if value == want:
            continue
        if want is None:  # a feature of other families alone
            owners = " and ".join(f.title for f in FAMILIES.values() if f.feature(name) != FEATURES[name])
            problems.append(f"{name}={value!r} ({owners}'s alone; the {cfg.family} architecture has none)")
        else:
            problems.append(f"{name}={value!r} (the {cfg.family} "
                            f"{_HAS.get(name, lambda v: f'architecture has {v!r}')(want)})")
    return problems


def check_exportable(cfg: DecoderConfig) -> None:
    """Raise if transformers' class for ``cfg.family`` cannot express ``cfg`` exactly."""
    family = FAMILIES[cfg.family]
    problems = []
    if (cfg.moe is not None) != family.moe:
        problems.append(f"moe={'set' if cfg.moe is not None else 'None'} (a {cfg.family} model "
                        f"{'is' if family.moe else 'is not'} a mixture of experts)")
    if (cfg.mla is not None) != family.mla:
        owners = " and ".join(f.title for f in FAMILIES.values() if f.mla)
        problems.append(f"mla={'set' if cfg.mla is not None else 'None'} (multi-head latent attention is {owners}'s "
                        f"alone, and its only attention)")
    problems += _feature_problems(cfg, family)
    if cfg.partial_rotary_factor != 1.0 and "partial_rotary_factor" not in family.hf_defaults:
        owners = " and ".join(f"{f.title}'s" for f in FAMILIES.values() if "partial_rotary_factor" in f.hf_defaults)
        problems.append(f"partial_rotary_factor={cfg.partial_rotary_factor} (only {owners} attention rotate part of "
                        f"a head)")
    s = cfg.rope_scaling
    if s is not None and s.kind not in family.rope_kinds:
        problems.append(f"rope_scaling kind {s.kind!r} (the {cfg.family} architecture takes {list(family.rope_kinds)})")
    if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1 and not family.mixed_layers:
        problems.append("layer_types mixes sliding and full attention (not written to Hugging Face configs yet)")
    if cfg.first_k_dense_replace and not family.dense_layers:
        problems.append(f"first_k_dense_replace={cfg.first_k_dense_replace} (leading dense layers: not written to "
                        f"Hugging Face configs yet)")
    problems += family.problems(cfg)
    if problems:
        raise UnsupportedConfig(f"family {cfg.family!r} cannot be exported as {family.hf_class}: "
                                f"{'; '.join(problems)}")


def config_to_hf(cfg: DecoderConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads into the matching ``*ForCausalLM``."""
    check_exportable(cfg)
    family = FAMILIES[cfg.family]
    out: dict[str, Any] = {
        "architectures": [family.hf_class], "model_type": family.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling is None else rope_to_hf(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,
        # every special id, null where the model has none: a family's config class must not put its own
        # defaults (Gemma 3's pad 0, Phi-3's pad 32000, past a small vocabulary) in their place
        **{name: None if getattr(cfg, name) is None else _json_id(getattr(cfg, name)) for name in TOKEN_ID_FIELDS},
    }
    if cfg.moe is not None:
        out.update(num_experts_per_tok=cfg.moe.top_k, router_aux_loss_coef=cfg.moe.aux_loss_coef,
                   output_router_logits=False)
    family.write(cfg, out)
    return out
