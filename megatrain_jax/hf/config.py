"""Hugging Face ``config.json`` <-> DecoderConfig, for Llama, Mistral, Qwen2, Qwen3, Phi-3 (Phi-3, Phi-3.5,
Phi-4, Phi-4-mini), OLMo 2, Gemma 3 (text: ``gemma3_text``) and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4.5 (``glm4_moe``), DeepSeek-V3 / Kimi K2 (``deepseek_v3``) and GPT-OSS (``gpt_oss``).

Both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and the 5.x one
(``rope_parameters``, ``dtype``) are read; we write the 4.x spelling, which 5.x still reads. Anything
our decoder cannot reproduce exactly is an error naming the offending value, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from megatrain_jax.models.config import DecoderConfig, MLAConfig, MoEConfig, RopeScaling

# model_type -> (our family, the causal-LM class transformers builds)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
_SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3")  # sigmoid routers with a correction bias, grouped top-k, shared experts
# DeepseekV3Config's defaults (DeepSeek-V3's shape) where config.json omits a field
_DEEPSEEK_V3_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                             n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                             kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, rope_interleave=True, intermediate_size=18432)
# GptOssConfig's defaults (GPT-OSS-120B's shape, its YaRN and RoPE base) where config.json omits a field
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GPT_OSS_DEFAULTS = dict(num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880, head_dim=64,
                         sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
                         rope_theta=150000.0, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001)
_FAMILY_TO_TYPE = {family: mt for mt, (family, _) in ARCHITECTURES.items()}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_moe": 128, "gemma3_text": 256}  # transformers' default when config.json omits head_dim
_SUPPORTED_ROPE = ("default", "llama3", "linear", "yarn")
_PHI3_ROPE = ("default", "longrope")  # what Phi3Config accepts (after reading "su" and "yarn" as longrope)
_DEFAULT_NORM_EPS = {"phi3": 1e-5, "olmo2": 1e-5, "glm4_moe": 1e-5}  # transformers' default when config.json omits rms_norm_eps (else 1e-6)
_PHI3_ORIGINAL_MAX_POSITION = 4096  # Phi3Config's default original_max_position_embeddings
_PARTIAL_ROTARY = {"phi3": 1.0, "glm4_moe": 0.5}  # who rotates part of a head, and transformers' default share
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


class UnsupportedConfig(ValueError):
    """The checkpoint uses a model type or feature our decoder does not implement."""


def _model_type(c: dict[str, Any]) -> str:
    mt = c.get("model_type")
    archs = c.get("architectures") or []
    if mt == "kimi_k2" and archs == ["DeepseekV3ForCausalLM"]:  # Kimi K2's folders: DeepSeek-V3's architecture
        mt = "deepseek_v3"
    if mt is None and archs:  # derive from the class name, e.g. LlamaForCausalLM
        mt = next((t for t, (_, cls) in ARCHITECTURES.items() if cls in archs), None)
    if mt == "gemma3":
        raise UnsupportedConfig(
            "model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B: a vision "
            "tower beside the language model, whose config is under text_config); only its text part as a "
            "Gemma3ForCausalLM folder (model_type 'gemma3_text') is read: write config.json from text_config (with "
            "model_type 'gemma3_text', architectures ['Gemma3ForCausalLM']) and the language model's tensors "
            "renamed to model.* (language_model.model.* in the released files, model.language_model.* as "
            "transformers 5 saves them), leaving out the vision tower and the projector")
    if mt in HYBRID_TYPES:
        raise UnsupportedConfig(f"model_type {mt!r} is a hybrid model ({HYBRID_TYPES[mt]}): its layers keep a "
                                f"recurrent state between tokens, which this engine's blocks do not implement; "
                                f"supported model types: {sorted(ARCHITECTURES)}")
    if mt not in ARCHITECTURES:
        raise UnsupportedConfig(f"model_type {mt!r} (architectures {archs}) is not supported; supported "
                                f"model types: {sorted(ARCHITECTURES)}")
    expected = ARCHITECTURES[mt][1]
    bad = [a for a in archs if a != expected]
    if bad:
        raise UnsupportedConfig(f"architectures {bad} not supported for model_type {mt!r}; only "
                                f"{expected!r} (a causal LM with an lm_head) is")
    return mt


def _rope(c: dict[str, Any], mt: str, max_pos: int) -> tuple[float, float, RopeScaling | None]:
    """(rope_theta, partial_rotary_factor, scaling)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UnsupportedConfig(f"rope parameters {params!r} are not a dict")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedConfig(f"per-layer-type rope parameters {sorted(params)} are not supported")
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if mt == "phi3" and kind in ("su", "yarn"):  # Phi3Config reads its older names as longrope
        kind = "longrope"
    supported = _PHI3_ROPE if mt == "phi3" else _SUPPORTED_ROPE
    if kind not in supported:
        raise UnsupportedConfig(f"rope_scaling type {kind!r} is not supported for model_type {mt!r}; supported: "
                                f"{list(supported)}")
    partial = float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", _PARTIAL_ROTARY.get(mt, 1.0))))
    if partial != 1.0 and mt not in _PARTIAL_ROTARY:
        raise UnsupportedConfig(f"partial_rotary_factor {partial!r} is not supported for model_type {mt!r} (RoPE on "
                                f"the whole head; only Phi-3's and GLM-4.5's attention rotate part of it)")
    if kind == "default":
        return theta, partial, None
    if mt == "phi3":  # Phi3Config's own original_max_position_embeddings (default 4096) wins over rope_scaling's
        original = int(c.get("original_max_position_embeddings") or _PHI3_ORIGINAL_MAX_POSITION)
    else:
        original = int(params.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
                       or max_pos)
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):  # transformers: the ratio of the two lengths
        factor = max_pos / original
    if factor is None:
        raise UnsupportedConfig(f"rope_scaling {params!r} of type {kind!r} lacks 'factor'")
    optional = lambda key: None if params.get(key) is None else float(params[key])  # noqa: E731
    factors = lambda key: None if params.get(key) is None else tuple(float(v) for v in params[key])  # noqa: E731
    if kind == "longrope" and (params.get("short_factor") is None or params.get("long_factor") is None):
        raise UnsupportedConfig(f"rope_scaling {params!r} of type 'longrope' lacks short_factor or long_factor")
    try:
        return theta, partial, RopeScaling(
            factor=float(factor), low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)), original_max_position=original, kind=kind,
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=optional("attention_factor"), mscale=optional("mscale"),
            mscale_all_dim=optional("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
            short_factor=factors("short_factor"), long_factor=factors("long_factor"))
    except ValueError as e:
        raise UnsupportedConfig(f"rope_scaling {params!r}: {e}") from None


def _gemma3_rope(c: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling, sliding_rope_theta) of a Gemma 3 config: transformers 5 writes
    ``rope_parameters`` per layer type, 4.x ``rope_theta`` + ``rope_scaling`` for the full-attention layers
    and ``rope_local_base_freq`` for the sliding ones (Gemma3TextConfig's defaults: 1e6 and 1e4)."""
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
    theta, _, scaling = _rope({"rope_parameters": full}, "gemma3_text", max_pos)
    return theta, scaling, float(local.get("rope_theta", c.get("rope_local_base_freq", 10000.0)))


def _layer_types(c: dict[str, Any], layers: int, pattern: int) -> tuple[str, ...]:
    """Each layer's attention: ``layer_types``, or where a config omits it every ``pattern``-th layer full
    attention, the rest sliding (Gemma3TextConfig's rule with its ``sliding_window_pattern``, 6 by default;
    GptOssConfig's with 2)."""
    types = c.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(types)


def _sliding_window(c: dict[str, Any], mt: str, layers: int) -> int | None:
    if mt in ("mistral", "mixtral", "phi3"):  # Phi3Model masks by sliding_window whenever it is set
        return c.get("sliding_window")
    if mt in ("llama", "olmo2", "glm4_moe", "deepseek_v3"):
        return None
    if mt == "gpt_oss":  # on the layers of type sliding_attention (layer_types)
        return c.get("sliding_window")
    if mt == "gemma3_text":
        return c.get("sliding_window", 4096)  # Gemma3TextConfig's default
    # Qwen2/3: a window only when use_sliding_window, and then only on layers >= max_window_layers
    window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    types = c.get("layer_types")
    if types is None:
        mwl = c.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
                 for i in range(layers)]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return int(window)
    raise UnsupportedConfig(f"layer_types {types} (use_sliding_window={c.get('use_sliding_window')}, "
                            f"sliding_window={window}, max_window_layers={c.get('max_window_layers')}) "
                            f"mix full and sliding attention; only all-full or all-sliding is supported")


def _check_unsupported(c: dict[str, Any], mt: str) -> None:
    if mt == "gemma3_text":
        _check_gemma3(c)
    else:
        act = c.get("hidden_act", c.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise UnsupportedConfig(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if c.get("mlp_bias", False):
        raise UnsupportedConfig("mlp_bias=True is not supported (the MLP has no biases)")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):  # the last two: Phi-3's
        dropout = c.get(key) or 0.0
        if dropout != 0.0:
            raise UnsupportedConfig(f"{key}={dropout!r} is not supported (the engine trains without dropout: "
                                    f"docs/model_contract.md); set it to 0.0 in config.json to train without "
                                    f"dropout (the model's outputs at inference are unchanged)")
    if mt == "gpt_oss" and c.get("quantization_config"):
        q = c["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method != "mxfp4":
            raise UnsupportedConfig(f"quantization_config (quant_method {method!r}): of quantized GPT-OSS checkpoints only "
                                    f"the released MXFP4 experts (quant_method 'mxfp4') are read (dequantized)")
    if mt in _SIGMOID_ROUTED:
        _check_glm4_moe(c, mt)
    if mt in _MOE_TYPES:
        if float(c.get("router_jitter_noise") or 0.0) != 0.0:
            raise UnsupportedConfig(f"router_jitter_noise={c['router_jitter_noise']!r} is not supported (routing is "
                                    f"deterministic); set it to 0.0 in config.json")
        if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
            raise UnsupportedConfig(f"decoder_sparse_step={c.get('decoder_sparse_step')!r}, mlp_only_layers="
                                    f"{c.get('mlp_only_layers')!r}: only models whose every layer is a mixture of "
                                    f"experts are supported (one block template serves every layer)")
    no_bias = ("llama", "mistral", "qwen3", "olmo2", "gemma3_text", "mixtral", "qwen3_moe")  # GLM-4.5: q/k/v only
    if mt in no_bias and c.get("attention_bias", False):
        raise UnsupportedConfig(f"attention_bias=True for model_type {mt!r} is not supported (it also "
                                f"puts a bias on o_proj; only Qwen2-style q/k/v biases are)")


def _check_glm4_moe(c: dict[str, Any], mt: str = "glm4_moe") -> None:
    """What Glm4MoeForCausalLM (DeepseekV3ForCausalLM) computes and our blocks would not: anything but its sigmoid
    router with grouped top-k (DeepSeek-V3: every layer past ``first_k_dense_replace`` routed). Its
    multi-token-prediction layers (``num_nextn_predict_layers``, the tensors of layers
    ``num_hidden_layers`` onwards in the released checkpoints) are no part of the causal LM transformers builds
    (it ignores them on load): ``check_checkpoint`` skips them knowingly and an export does not write them."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):  # DeepSeek-V3's spellings
        if c.get(key, want) != want:
            raise UnsupportedConfig(f"{key}={c[key]!r} for model_type {mt!r} is not supported (transformers' "
                                    f"{'Glm4Moe' if mt == 'glm4_moe' else 'DeepseekV3'}TopkRouter scores by sigmoid "
                                    f"with a correction bias: {want!r})")
    if mt == "deepseek_v3" and c.get("quantization_config"):
        method = (c["quantization_config"] or {}).get("quant_method") if isinstance(c["quantization_config"], dict) else None
        raise UnsupportedConfig(f"quantization_config (quant_method {method!r}): quantized weights (DeepSeek-V3's and "
                                f"Kimi K2's released FP8 blocks with their weight_scale_inv tensors) are not read; "
                                f"dequantize the checkpoint to bfloat16 first and drop quantization_config")
    if mt == "deepseek_v3" and int(c.get("moe_layer_freq", 1)) != 1:
        raise UnsupportedConfig(f"moe_layer_freq={c['moe_layer_freq']!r}: transformers' DeepseekV3 routes every layer "
                                f"past first_k_dense_replace (moe_layer_freq 1)")
    if mt == "deepseek_v3" and c.get("num_key_value_heads") not in (None, c.get("num_attention_heads")):
        raise UnsupportedConfig(f"num_key_value_heads={c['num_key_value_heads']!r} differs from num_attention_heads="
                                f"{c.get('num_attention_heads')!r}: multi-head latent attention gives every head its "
                                f"own key and value")


def _check_gemma3(c: dict[str, Any]) -> None:
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedConfig(f"hidden_activation {act!r} is not supported for Gemma 3 (GeGLU with "
                                f"'gelu_pytorch_tanh' only)")
    if c.get("attn_logit_softcapping") is not None:
        raise UnsupportedConfig(f"attn_logit_softcapping={c['attn_logit_softcapping']!r} is not supported (attention "
                                f"scores are not capped here; released Gemma 3 models set null)")
    if c.get("use_bidirectional_attention"):
        raise UnsupportedConfig("use_bidirectional_attention=True is not supported (causal attention only)")


def _gemma3_fields(c: dict[str, Any], layers: int, max_pos: int) -> dict[str, Any]:
    theta, scaling, local_theta = _gemma3_rope(c, max_pos)
    return dict(rope_theta=theta, rope_scaling=scaling, sliding_rope_theta=local_theta,
                layer_types=_layer_types(c, layers, int(c.get("sliding_window_pattern", 6))), norm_placement="sandwich", norm_unit_offset=True,
                scale_embeddings=True, mlp_activation="gelu_tanh",
                query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
                final_logit_softcap=None if c.get("final_logit_softcapping") is None
                else float(c["final_logit_softcapping"]),
                tie_embeddings=bool(c.get("tie_word_embeddings", True)),  # Gemma3TextConfig's default
                max_positions=int(c.get("max_position_embeddings", 131072)))


def config_from_hf(config_json: dict[str, Any], **overrides) -> DecoderConfig:
    """The DecoderConfig of a Hugging Face ``config.json`` (as a dict). ``overrides`` replace fields
    that config.json does not determine (``dtype``, ``attention_impl``, ``loss_chunk_tokens``, ...)."""
    c = config_json
    mt = _model_type(c)
    if mt == "gpt_oss":
        c = _gpt_oss_defaults(c)
    _check_unsupported(c, mt)
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
        deepseek = {**_DEEPSEEK_V3_DEFAULTS, **c} if mt == "deepseek_v3" else c
        fields: dict[str, Any] = dict(
            vocab_size=int(c["vocab_size"]), hidden=hidden, ffn=int(deepseek["intermediate_size"]),
            layers=layers, heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json lacks the required field {e.args[0]!r}") from None
    head_dim = None if mt == "deepseek_v3" else c.get("head_dim") or _DEFAULT_HEAD_DIM.get(mt)
    max_pos = int(c.get("max_position_embeddings", 4096))
    gemma3 = _gemma3_fields(c, layers, max_pos) if mt == "gemma3_text" else {}
    theta, partial, scaling = (None, 1.0, None) if gemma3 else _rope(c, mt, max_pos)
    fields.update(
        family=ARCHITECTURES[mt][0],
        head_dim=None if head_dim is None or (hidden % heads == 0 and head_dim == hidden // heads)
        else int(head_dim),
        rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        norm_eps=float(c.get("rms_norm_eps", _DEFAULT_NORM_EPS.get(mt, 1e-6))),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=mt in ("qwen2", "qwen2_moe") or (mt in _SIGMOID_ROUTED + ("gpt_oss",) and bool(c.get("attention_bias", False))),
        o_bias=mt == "gpt_oss" and bool(c["attention_bias"]), attention_sinks=mt == "gpt_oss",
        qk_norm=mt in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text") or (mt == "glm4_moe" and bool(c.get("use_qk_norm", False))),
        qk_norm_width="all_heads" if mt == "olmo2" else "head", norm_placement="post" if mt == "olmo2" else "pre",
        sliding_window=_sliding_window(c, mt, layers), max_positions=max_pos, moe=_moe(c, mt),
        first_k_dense_replace=int(deepseek.get("first_k_dense_replace", 1)) if mt in _SIGMOID_ROUTED else 0,
        mla=_mla(deepseek) if mt == "deepseek_v3" else None,
        **token_ids(c))
    fields.update(gemma3)
    if mt == "gpt_oss":
        fields["layer_types"] = _layer_types(c, layers, 2)
    fields.update(overrides)
    return DecoderConfig(**fields)


def _gpt_oss_defaults(c: dict[str, Any]) -> dict[str, Any]:
    """A GPT-OSS config.json with GptOssConfig's defaults where it omits a field; without rope parameters, its
    YaRN (factor 32 over 4,096 positions, untruncated) at base 150,000."""
    c = {**_GPT_OSS_DEFAULTS, **c}
    if not c.get("rope_scaling") and not c.get("rope_parameters"):
        c["rope_parameters"] = {**_GPT_OSS_ROPE, "rope_theta": c["rope_theta"]}
    return c


def _mla(c: dict[str, Any]) -> MLAConfig:
    """DeepSeek-V3's multi-head latent attention (``c`` with DeepseekV3Config's defaults filled in)."""
    q_lora = c.get("q_lora_rank")
    try:
        return MLAConfig(kv_lora_rank=int(c["kv_lora_rank"]), q_lora_rank=None if q_lora is None else int(q_lora),
                         qk_nope_dim=int(c["qk_nope_head_dim"]), qk_rope_dim=int(c["qk_rope_head_dim"]),
                         v_dim=int(c["v_head_dim"]), rope_interleave=bool(c["rope_interleave"]))
    except ValueError as e:
        raise UnsupportedConfig(f"multi-head latent attention: {e}") from None


TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


def _moe(c: dict[str, Any], mt: str) -> MoEConfig | None:
    """The mixture of experts of a Mixtral / Qwen2-MoE / Qwen3-MoE / GLM-4.5 config. GLM-4.5 trains without a
    load-balancing loss (its router's correction bias balances, and is not trained here). The load-balancing coefficient
    is ``router_aux_loss_coef``, used in training whatever ``output_router_logits`` says (set
    ``model.moe.aux_loss_coef = 0`` to train without it). A capacity factor is a training choice: an export
    writes the dropless model transformers runs."""
    if mt not in _MOE_TYPES:
        return None
    try:
        if mt == "deepseek_v3":
            c = {**_DEEPSEEK_V3_DEFAULTS, **c}
        if mt in _SIGMOID_ROUTED:  # Glm4MoeConfig's (DeepseekV3Config's) defaults where config.json omits a field
            ffn = int(c["moe_intermediate_size"])
            shared = int(c.get("n_shared_experts", 1))
            return MoEConfig(experts=int(c.get("n_routed_experts", c.get("num_local_experts", 128))),
                             top_k=int(c["num_experts_per_tok"]), expert_ffn=ffn,
                             norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                             shared_expert_ffn=shared * ffn if shared else None, shared_expert_gate=False,
                             scoring="sigmoid", groups=int(c.get("n_group", 1)), topk_groups=int(c.get("topk_group", 1)),
                             routed_scale=float(c.get("routed_scaling_factor", 1.0)), aux_loss_coef=0.0)
        if mt == "gpt_oss":  # GptOssTopKRouter: softmax over the top-k (biased) logits = the renormalized top-k
            return MoEConfig(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                             expert_ffn=int(c["intermediate_size"]), norm_topk_prob=True, router_bias=True,
                             expert_bias=True, activation="clamped_swiglu", swiglu_alpha=float(c["swiglu_alpha"]),
                             swiglu_limit=float(c["swiglu_limit"]), aux_loss_coef=float(c["router_aux_loss_coef"]))
        if mt == "mixtral":
            return MoEConfig(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                             expert_ffn=int(c["intermediate_size"]), norm_topk_prob=True,
                             aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))
        shared = c["shared_expert_intermediate_size"] if mt == "qwen2_moe" else None
        experts = c.get("num_experts", c.get("num_local_experts"))  # transformers 5 writes the latter for Qwen3-MoE
        if experts is None:
            raise KeyError("num_experts")
        return MoEConfig(experts=int(experts), top_k=int(c["num_experts_per_tok"]),
                         expert_ffn=int(c["moe_intermediate_size"]),
                         norm_topk_prob=bool(c.get("norm_topk_prob", False)),  # transformers' default
                         shared_expert_ffn=int(shared) if shared else None,
                         aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))
    except KeyError as e:
        raise UnsupportedConfig(f"config.json of model_type {mt!r} lacks the required field {e.args[0]!r}") from None


def check_exportable(cfg: DecoderConfig) -> None:
    """Raise if transformers' class for ``cfg.family`` cannot express ``cfg`` exactly."""
    want = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True),
            "phi3": (False, False), "olmo2": (False, True), "gemma3": (False, True), "mixtral": (False, False),
            "qwen2_moe": (True, False),
            "qwen3_moe": (False, True), "glm4_moe": (cfg.qkv_bias, cfg.qk_norm),  # GLM-4.5: either, by config
            "deepseek_v3": (cfg.qkv_bias, False),  # DeepSeek-V3: attention_bias either way, by config
            "gpt_oss": (cfg.qkv_bias, False)}  # GPT-OSS: attention_bias (q/k/v and o) either way, by config
    bias, norm = want[cfg.family]
    olmo2 = cfg.family == "olmo2"  # post-norm blocks, q/k norm over all heads; every other family the opposite
    gemma3 = cfg.family == "gemma3"  # sandwich norms offset from 1, GeGLU, scaled embeddings, per-layer-type RoPE
    problems = []
    if (cfg.moe is not None) != (cfg.family in _MOE_TYPES):
        problems.append(f"moe={'set' if cfg.moe is not None else 'None'} (a {cfg.family} model "
                        f"{'is' if cfg.family in _MOE_TYPES else 'is not'} a mixture of experts)")
    elif cfg.moe is not None:
        m = cfg.moe
        if cfg.family == "mixtral" and (not m.norm_topk_prob or m.shared_expert_ffn is not None):
            problems.append("Mixtral renormalizes its top-k and has no shared expert")
        if cfg.family == "qwen3_moe" and m.shared_expert_ffn is not None:
            problems.append("Qwen3-MoE has no shared expert")
        if cfg.family == "qwen2_moe" and (m.shared_expert_ffn is None or not m.shared_expert_gate):
            problems.append("Qwen2-MoE has a gated shared expert (moe.shared_expert_ffn, shared_expert_gate)")
        glm = cfg.family in _SIGMOID_ROUTED
        if (m.scoring == "sigmoid") != glm:
            problems.append(f"moe.scoring={m.scoring!r} (the {cfg.family} router scores by "
                            f"{'sigmoid' if glm else 'softmax'})")
        if not glm and (m.groups != 1 or m.routed_scale != 1.0):
            problems.append(f"moe.groups={m.groups}, moe.routed_scale={m.routed_scale} (grouped, scaled routing is "
                            f"GLM-4.5's and DeepSeek-V3's)")
        if glm and (m.shared_expert_ffn is None or m.shared_expert_gate or m.shared_expert_ffn % m.expert_ffn):
            problems.append(f"{'GLM-4.5' if cfg.family == 'glm4_moe' else 'DeepSeek-V3'} has ungated shared experts "
                            f"n_shared_experts x moe.expert_ffn wide (moe.shared_expert_ffn a multiple of moe.expert_ffn, "
                            f"shared_expert_gate=False)")
    problems += _gpt_oss_problems(cfg)
    if (cfg.mla is not None) != (cfg.family == "deepseek_v3"):
        problems.append(f"mla={'set' if cfg.mla is not None else 'None'} (multi-head latent attention is DeepSeek-V3's "
                        f"alone, and its only attention)")
    if cfg.qkv_bias != bias:
        problems.append(f"qkv_bias={cfg.qkv_bias} (the {cfg.family} architecture has {bias})")
    if cfg.qk_norm != norm:
        problems.append(f"qk_norm={cfg.qk_norm} (the {cfg.family} architecture has {norm})")
    elif norm and cfg.qk_norm_width != ("all_heads" if olmo2 else "head"):
        problems.append(f"qk_norm_width={cfg.qk_norm_width!r} (the {cfg.family} architecture normalizes "
                        f"{'all heads at once' if olmo2 else 'each head'})")
    placement = "post" if olmo2 else "sandwich" if gemma3 else "pre"
    if cfg.norm_placement != placement:
        problems.append(f"norm_placement={cfg.norm_placement!r} (the {cfg.family} architecture has "
                        f"{placement}-norm blocks)")
    for name, value in (("norm_unit_offset", gemma3), ("scale_embeddings", gemma3),
                        ("mlp_activation", "gelu_tanh" if gemma3 else "silu")):
        if getattr(cfg, name) != value:
            problems.append(f"{name}={getattr(cfg, name)!r} (the {cfg.family} architecture has {value!r})")
    for name in () if gemma3 else ("query_pre_attn_scalar", "sliding_rope_theta", "final_logit_softcap"):
        if getattr(cfg, name) is not None:
            problems.append(f"{name}={getattr(cfg, name)!r} (Gemma 3's alone; the {cfg.family} architecture has none)")
    if gemma3 and cfg.sliding_rope_theta is None and cfg.rope_scaling is not None and any(
            cfg.layer_type(i) == "sliding_attention" for i in range(cfg.layers)):
        problems.append("sliding_rope_theta=None with rope_scaling set (Gemma 3's sliding-window layers rotate "
                        "unscaled: set sliding_rope_theta)")
    if olmo2 and cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window} (OLMo 2 has none)")
    if cfg.family == "llama" and cfg.sliding_window is not None:
        problems.append(f"sliding_window={cfg.sliding_window} (Llama has none; use family='mistral')")
    if cfg.partial_rotary_factor != 1.0 and cfg.family not in ("phi3", "glm4_moe"):
        problems.append(f"partial_rotary_factor={cfg.partial_rotary_factor} (only Phi-3's and GLM-4.5's attention "
                        f"rotate part of a head)")
    s = cfg.rope_scaling
    if s is not None and (s.kind == "longrope") != (cfg.family == "phi3"):
        problems.append(f"rope_scaling kind {s.kind!r} (Phi-3 takes no scaling or longrope only, and longrope is "
                        f"Phi-3's alone)")
    if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1 and cfg.family not in ("gemma3", "gpt_oss"):
        problems.append("layer_types mixes sliding and full attention (not written to Hugging Face configs yet)")
    if cfg.first_k_dense_replace and cfg.family not in _SIGMOID_ROUTED:
        problems.append(f"first_k_dense_replace={cfg.first_k_dense_replace} (leading dense layers: not written to "
                        f"Hugging Face configs yet)")
    if problems:
        raise UnsupportedConfig(f"family {cfg.family!r} cannot be exported as "
                                f"{ARCHITECTURES[_FAMILY_TO_TYPE[cfg.family]][1]}: {'; '.join(problems)}")


def _gpt_oss_problems(cfg: DecoderConfig) -> list[str]:
    """What GptOssForCausalLM cannot express of ``cfg`` (its attention sinks, o bias, and router and experts are
    GPT-OSS's alone, and GPT-OSS has all of them)."""
    gpt_oss, m, problems = cfg.family == "gpt_oss", cfg.moe, []
    if cfg.attention_sinks != gpt_oss:
        problems.append(f"attention_sinks={cfg.attention_sinks} (the {cfg.family} architecture has {gpt_oss})")
    if cfg.o_bias != (gpt_oss and cfg.qkv_bias):
        problems.append(f"o_bias={cfg.o_bias} with qkv_bias={cfg.qkv_bias} (" + (
            "GPT-OSS's attention_bias puts biases on q, k, v and o alike)" if gpt_oss else f"the {cfg.family} "
            "architecture has no bias on o_proj)"))
    if m is None:
        return problems
    ours = (m.router_bias, m.expert_bias, m.activation == "clamped_swiglu")
    if ours != (gpt_oss,) * 3:
        problems.append(f"moe.router_bias={m.router_bias}, moe.expert_bias={m.expert_bias}, moe.activation="
                        f"{m.activation!r} (GPT-OSS's router and experts have biases and the clamped SwiGLU; no other "
                        f"architecture's do)")
    if gpt_oss and (not m.norm_topk_prob or m.shared_expert_ffn is not None):
        problems.append("GPT-OSS weights its top-k experts by a softmax over their logits (norm_topk_prob) and has no "
                        "shared expert")
    return problems


def rope_to_hf(s: RopeScaling) -> dict[str, Any]:
    """The ``rope_scaling`` dict transformers reads for ``s``."""
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.kind == "longrope":  # Phi-3: original_max_position_embeddings is a top-level field (config_to_hf)
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


def config_to_hf(cfg: DecoderConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads into the matching ``*ForCausalLM``."""
    check_exportable(cfg)
    mt = _FAMILY_TO_TYPE[cfg.family]
    rope = None
    if cfg.rope_scaling is not None:
        rope = rope_to_hf(cfg.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[mt][1]], "model_type": mt,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,
        # every special id, null where the model has none: a family's config class must not put its own
        # defaults (Gemma 3's pad 0, Phi-3's pad 32000, past a small vocabulary) in their place
        **{name: None if getattr(cfg, name) is None else _json_id(getattr(cfg, name)) for name in TOKEN_ID_FIELDS},
    }
    if mt in ("llama", "qwen3", "olmo2"):
        out["attention_bias"] = False
    if mt == "gemma3_text":
        del out["hidden_act"]
        types = [cfg.layer_type(i) for i in range(cfg.layers)]
        scalar = cfg.dim_per_head if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
        out.update(hidden_activation="gelu_pytorch_tanh",  # Gemma3TextConfig takes an int where it is one
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar, sliding_window=cfg.sliding_window, layer_types=types,
                   rope_local_base_freq=cfg.sliding_rope_theta if cfg.sliding_rope_theta is not None else cfg.rope_theta,
                   final_logit_softcapping=cfg.final_logit_softcap, attn_logit_softcapping=None, attention_bias=False,
                   use_bidirectional_attention=False)
    if mt == "llama":
        out["mlp_bias"] = False
    if mt in ("mistral", "mixtral", "phi3"):
        out["sliding_window"] = cfg.sliding_window
    if mt == "phi3":
        s = cfg.rope_scaling
        # Phi3Config's default original length (4096) would otherwise override rope_scaling's
        out.update(original_max_position_embeddings=cfg.max_positions if s is None else s.original_max_position,
                   partial_rotary_factor=cfg.partial_rotary_factor, resid_pdrop=0.0, embd_pdrop=0.0)
    if cfg.moe is not None:
        m = cfg.moe
        out.update(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
        if mt == "mixtral":
            out.update(num_local_experts=m.experts, intermediate_size=m.expert_ffn, router_jitter_noise=0.0)
        elif mt == "gpt_oss":  # rope_parameters, always: GptOssConfig puts its YaRN in place of a missing one
            del out["rope_scaling"], out["rope_theta"]
            out.update(num_local_experts=m.experts, intermediate_size=m.expert_ffn, swiglu_alpha=m.swiglu_alpha,
                       swiglu_limit=m.swiglu_limit, attention_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window,
                       layer_types=[cfg.layer_type(i) for i in range(cfg.layers)],
                       rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": cfg.rope_theta})
        elif mt == "deepseek_v3":  # no multi-token-prediction layers: none are trained or written
            del out["router_aux_loss_coef"], out["head_dim"]  # DeepseekV3Config derives head_dim (qk_rope_head_dim)
            a = cfg.mla
            out.update(n_routed_experts=m.experts, moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
                       n_shared_experts=m.shared_expert_ffn // m.expert_ffn, n_group=m.groups, topk_group=m.topk_groups,
                       routed_scaling_factor=m.routed_scale, first_k_dense_replace=cfg.first_k_dense_replace,
                       attention_bias=cfg.qkv_bias, num_nextn_predict_layers=0, q_lora_rank=a.q_lora_rank,
                       kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_dim, qk_rope_head_dim=a.qk_rope_dim,
                       v_head_dim=a.v_dim, rope_interleave=a.rope_interleave, scoring_func="sigmoid",
                       topk_method="noaux_tc")
        elif mt == "glm4_moe":  # no multi-token-prediction layers: none are trained or written
            del out["router_aux_loss_coef"]
            out.update(n_routed_experts=m.experts, moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
                       n_shared_experts=m.shared_expert_ffn // m.expert_ffn, n_group=m.groups, topk_group=m.topk_groups,
                       routed_scaling_factor=m.routed_scale, first_k_dense_replace=cfg.first_k_dense_replace,
                       attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm,
                       partial_rotary_factor=cfg.partial_rotary_factor, num_nextn_predict_layers=0)
        else:
            out.update(num_experts=m.experts, moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=[])
        if mt == "qwen2_moe":
            out["shared_expert_intermediate_size"] = m.shared_expert_ffn
        if mt == "qwen3_moe":
            out["attention_bias"] = False
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        sliding = cfg.sliding_window is not None
        out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if sliding else cfg.layers,
                   layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.layers)
    return out
