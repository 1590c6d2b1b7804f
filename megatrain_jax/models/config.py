"""Decoder configuration: one dataclass for the Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / OLMo 2 / Gemma 3 family,
the mixtures of experts (Mixtral, Qwen-MoE, GLM-4.5, DeepSeek-V3, GPT-OSS), and named presets."""

from __future__ import annotations

import dataclasses
import math
import difflib
from typing import Any, Literal

Family = Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma3", "mixtral", "qwen2_moe",
                 "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss"]
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma3", "mixtral", "qwen2_moe",
                             "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "xla", "cudnn")
# Default bound on packed documents per row times the row's tokens (DecoderConfig.max_segments).
SEGMENT_TOKENS = 2**16


ROPE_KINDS: tuple[str, ...] = ("llama3", "linear", "yarn", "longrope")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
# Where a block's RMSNorms sit: "pre" normalizes each sublayer's input (``x + f(norm(x))``, Llama and
# most others); "post" normalizes its output before the residual add (``x + norm(f(x))``, OLMo 2);
# "sandwich" both, with a norm of its own on each side (``x + norm2(f(norm1(x)))``: four per block, Gemma 3).
NORM_PLACEMENTS: tuple[str, ...] = ("pre", "post", "sandwich")
# The gated MLP's activation: ``down(act(gate(x)) * up(x))``. "silu": SwiGLU; "gelu_tanh": GELU's tanh
# approximation (GeGLU, transformers' "gelu_pytorch_tanh", Gemma 3).
MLP_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")
# What one q (k) RMSNorm normalizes: each head's vector alone, with one scale of head_dim shared by every
# head (Qwen3), or all heads' projection at once, with a scale of heads x head_dim (OLMo 2).
QK_NORM_WIDTHS: tuple[str, ...] = ("head", "all_heads")
# How an MoE router scores the experts: "softmax" over all of them (Mixtral, Qwen-MoE), or "sigmoid" of each
# (DeepSeek-V3, GLM-4.5: with a correction bias for choosing, and grouped top-k).
ROUTER_SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")
# An expert's activation: "silu" (SwiGLU, ``down(silu(gate) * up)``) or "clamped_swiglu" (GPT-OSS:
# ``down((clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g))`` with ``g = min(gate, limit)``).
EXPERT_ACTIVATIONS: tuple[str, ...] = ("silu", "clamped_swiglu")


# Queries per chunk of ``layers.sink_attention`` (GPT-OSS): its scores exist for this many queries at a time.
SINK_QUERY_CHUNK = 512
# Head widths that ``layers.sink_as_key`` adds (the sink's logit as two of them; 8 keeps cuDNN's multiple).
SINK_WIDTH = 8


def cudnn_takes_heads(head_dim: int, hopper: bool) -> bool:
    """Whether cuDNN's flash attention takes heads this wide: a multiple of 8, at most 256 on Hopper and later, 128
    before. (``layers`` asks it of the GPU at hand; the plan, which knows no GPU, of both generations.)"""
    return head_dim % 8 == 0 and head_dim <= (256 if hopper else 128)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for positions past the pre-training length, as Hugging Face computes it
    (``transformers.modeling_rope_utils``):

    - ``llama3`` (Llama 3.1+): low frequencies divided by ``factor``, high ones kept, a smooth blend
      between (``low_freq_factor``, ``high_freq_factor``);
    - ``linear``: every frequency divided by ``factor`` (position interpolation);
    - ``yarn``: per-dimension blend of interpolation and extrapolation between the dimensions that turn
      ``beta_fast`` and ``beta_slow`` times over ``original_max_position`` (rounded outwards unless not
      ``truncate``), and cos/sin scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the
      ratio of the ``mscale`` / ``mscale_all_dim`` ones when both are given);
    - ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini): each frequency divided by its own factor, from
      ``short_factor`` or ``long_factor`` (one per rotated dimension pair): the long ones when the batch's
      largest position + 1 exceeds ``original_max_position``, the short ones otherwise (transformers decides
      per forward pass the same way), and cos/sin scaled by ``attention_factor`` (default
      ``sqrt(1 + ln(factor) / ln(original_max_position))``, where ``factor`` is the context extension, for
      both factor sets).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # as stored in JSON or TOML: hashable, like every field
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling kind {self.kind!r} is not supported; supported: {list(ROPE_KINDS)}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor!r}")
        longrope = self.kind == "longrope"
        for name in ("short_factor", "long_factor"):
            if longrope != (getattr(self, name) is not None):
                raise ValueError(f"rope_scaling {name} is {'required' if longrope else 'only read'} for kind "
                                 f"'longrope' (kind is {self.kind!r})")
        if longrope and len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"rope_scaling short_factor and long_factor differ in length "
                             f"({len(self.short_factor)} and {len(self.long_factor)})")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "longrope":
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position))

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP in every MoE block (``DecoderConfig.moe``; the first
    ``DecoderConfig.first_k_dense_replace`` blocks stay dense): a router picks ``top_k`` of
    ``experts`` SwiGLU experts (each of width ``expert_ffn``) per token.

    - Routing probabilities are a softmax over all experts, in float32. ``norm_topk_prob`` renormalizes
      the chosen ``top_k`` to sum to 1 (Mixtral, which takes a softmax over the top-k logits: the same
      numbers; Qwen3-MoE's ``norm_topk_prob``); otherwise they are used as they are (Qwen2-MoE).
    - ``shared_expert_ffn``: a SwiGLU expert every token goes through, scaled by ``sigmoid`` of its own
      one-unit gate (Qwen2-MoE).
    - ``scoring="sigmoid"`` (DeepSeek-V3, GLM-4.5, transformers' ``Glm4MoeTopkRouter``): each expert's score
      is the sigmoid of its router logit (computed in float32). The experts are chosen by the scores plus a
      per-expert ``correction_bias`` (HF's ``e_score_correction_bias``), within ``topk_groups`` of ``groups``
      equal groups of experts (HF's ``topk_group`` / ``n_group``), the groups ranked by the sum of their two
      best corrected scores; the chosen experts' weights are their uncorrected scores (renormalized when
      ``norm_topk_prob``). The correction bias is loaded and exported but never trained: the router reads it
      through ``stop_gradient`` and only to choose, so its gradient is zero and an optimizer without weight
      decay on vectors (``megatrain_jax.adamw``'s default mask) leaves it unchanged. DeepSeek and GLM move it by
      a balancing rule outside the gradient, which is not implemented here.
    - ``routed_scale``: the routed experts' weights are multiplied by it (HF's ``routed_scaling_factor``).
    - ``shared_expert_gate``: with ``shared_expert_ffn``, whether the shared expert is gated (Qwen2-MoE) or
      simply added (DeepSeek-V3, GLM-4.5: HF's ``n_shared_experts`` x ``moe_intermediate_size`` wide).
    - ``aux_loss_coef``: the load-balancing loss (Switch Transformer, as transformers computes it over all
      layers' router outputs together) enters the training loss with this weight.
    - ``capacity_factor``: None is dropless (every routed token is computed). A number caps each expert at
      ``ceil(capacity_factor * tokens * top_k / experts)`` tokens per batch; the assignments past it (in
      token order) are dropped and contribute nothing.
    - ``router_bias``: the router's logits have a bias (GPT-OSS); ``expert_bias``: every expert's gate, up and
      down projections have biases (GPT-OSS).
    - ``activation``: EXPERT_ACTIVATIONS; "clamped_swiglu" (GPT-OSS) reads ``swiglu_alpha`` and ``swiglu_limit``.
    """

    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 14336
    norm_topk_prob: bool = True
    shared_expert_ffn: int | None = None
    aux_loss_coef: float = 0.0
    capacity_factor: float | None = None
    scoring: str = "softmax"  # ROUTER_SCORINGS
    groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0
    shared_expert_gate: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "expert_ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.experts={self.experts}: a token cannot go to "
                             f"more experts than there are")
        if self.shared_expert_ffn is not None and (not isinstance(self.shared_expert_ffn, int)
                                                   or self.shared_expert_ffn <= 0):
            raise ValueError(f"moe.shared_expert_ffn must be a positive integer or None, got {self.shared_expert_ffn!r}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"moe.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor must be positive or None (dropless), got {self.capacity_factor!r}")
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"moe.scoring {self.scoring!r} not supported; allowed: {list(ROUTER_SCORINGS)}")
        for name in ("groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe.{name} must be a positive integer, got {value!r}")
        if self.groups > 1 and self.scoring != "sigmoid":
            raise ValueError(f"moe.groups={self.groups}: grouped top-k (DeepSeek-V3 / GLM-4.5's) is read only with "
                             f"scoring='sigmoid'")
        if self.experts % self.groups or (self.groups > 1 and self.experts // self.groups < 2):
            raise ValueError(f"moe.groups={self.groups} must divide moe.experts={self.experts} into groups of at "
                             f"least 2 (a group is ranked by its two best experts)")
        if self.topk_groups > self.groups or self.top_k > self.topk_groups * (self.experts // self.groups):
            raise ValueError(f"moe.topk_groups={self.topk_groups} of moe.groups={self.groups} must hold moe.top_k="
                             f"{self.top_k} experts")
        if not self.routed_scale > 0:
            raise ValueError(f"moe.routed_scale must be positive, got {self.routed_scale!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"moe.activation {self.activation!r} not supported; allowed: {list(EXPERT_ACTIVATIONS)}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name} must be positive, got {getattr(self, name)!r}")
        if self.scoring == "sigmoid" and self.aux_loss_coef > 0:
            raise ValueError(f"moe.aux_loss_coef={self.aux_loss_coef!r} with scoring='sigmoid': the load-balancing "
                             f"loss here is Switch Transformer's over softmax probabilities; sigmoid routers "
                             f"(DeepSeek-V3, GLM-4.5) train without one: set aux_loss_coef=0")

    def mlp_params(self, hidden: int) -> tuple[int, int]:
        """(all, active per token) parameters of one block's MoE MLP: router (with its bias, or a sigmoid
        router's correction bias), experts (with their biases), shared expert (with its gate)."""
        expert = 3 * hidden * self.expert_ffn + (2 * self.expert_ffn + hidden if self.expert_bias else 0)
        shared = 0 if self.shared_expert_ffn is None else (
            3 * hidden * self.shared_expert_ffn + (hidden if self.shared_expert_gate else 0))
        router = (hidden + (self.scoring == "sigmoid") + self.router_bias) * self.experts
        return router + self.experts * expert + shared, router + self.top_k * expert + shared


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3's multi-head latent attention (transformers' ``DeepseekV3Attention``; ``DecoderConfig.mla``).

    - queries: ``q_proj`` [D -> heads x (qk_nope_dim + qk_rope_dim)], or with ``q_lora_rank`` a low-rank pair
      ``q_b(norm(q_a(x)))`` through a ``q_lora_rank``-wide RMSNorm;
    - keys and values: ``kv_a`` [D -> kv_lora_rank + qk_rope_dim] splits into a latent (RMSNorm, then ``kv_b``
      to heads x (qk_nope_dim + v_dim): each head's key part and value) and one ``qk_rope_dim``-wide key part
      that every head shares;
    - RoPE rotates the query's and the shared key's ``qk_rope_dim`` dimensions only (the last ones of each
      head's key / query), in ``rope_interleave`` layout (pairs ``(x0, x1), (x2, x3), ...``: DeepSeek's
      checkpoints, transformers' default) or rotate-half; scores are scaled by (qk_nope_dim + qk_rope_dim)^-0.5
      (times YaRN's ``mscale_all_dim`` correction squared: ``DecoderConfig.attention_scale``);
    - the heads' ``v_dim``-wide outputs go through ``o`` [heads x v_dim -> D].
    The latent norms take transformers' default eps (1e-6), not ``norm_eps``."""

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_dim: int = 128
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"mla.{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"mla.q_lora_rank must be a positive integer or None (a full q_proj), got "
                             f"{self.q_lora_rank!r}")
        if self.qk_rope_dim % 2:
            raise ValueError(f"mla.qk_rope_dim={self.qk_rope_dim} must be even for RoPE")

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def leaf_shapes(self, hidden: int, heads: int, bias: bool) -> list[tuple[int, ...]]:
        """The attention's parameter shapes as ``MLAttention`` creates them (kernels [in, out]); ``bias``:
        transformers' ``attention_bias`` (on q_a, kv_a and o)."""
        D, N, r = hidden, heads, self.q_lora_rank
        q = [(D, N * self.qk_dim)] if r is None else [(D, r), (r,), (r, N * self.qk_dim)] + ([(r,)] if bias else [])
        kv = [(D, self.kv_lora_rank + self.qk_rope_dim), (self.kv_lora_rank,),
              (self.kv_lora_rank, N * (self.qk_nope_dim + self.v_dim))]
        if bias:
            kv.append((self.kv_lora_rank + self.qk_rope_dim,))
        return q + kv + [(N * self.v_dim, D)] + ([(D,)] if bias else [])


# The DecoderConfig fields whose effective value (``DecoderConfig.effective``) can differ from the value as set.
EFFECTIVE_FIELDS = ("head_dim", "query_pre_attn_scalar", "layer_types", "ffn", "qk_norm_width")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a decoder-only transformer.

    Family switches: Mistral uses ``sliding_window`` (on every layer, or, with ``layer_types``, on the
    layers of type ``sliding_attention`` only); Qwen2 sets ``qkv_bias``; Qwen3 sets ``qk_norm`` (per head);
    OLMo 2 sets ``qk_norm`` with ``qk_norm_width="all_heads"`` and ``norm_placement="post"``; Gemma 3 sets
    ``qk_norm``, ``norm_placement="sandwich"``, ``norm_unit_offset``, ``scale_embeddings``,
    ``mlp_activation="gelu_tanh"``, ``query_pre_attn_scalar`` and ``sliding_rope_theta`` (with ``layer_types``);
    ``moe`` (a ``MoEConfig``) replaces every block's MLP by a mixture of experts (Mixtral, Qwen2-MoE,
    Qwen3-MoE, GLM-4.5) but the first ``first_k_dense_replace`` (DeepSeek-V3, GLM-4.5: HF's field), which keep a
    dense MLP of width ``ffn`` (HF's ``intermediate_size``); ``ffn`` is unused where no layer is dense. GPT-OSS sets
    ``attention_sinks``, ``qkv_bias`` and ``o_bias``, ``layer_types``, and a ``moe`` with router and expert biases and
    the clamped SwiGLU. ``dtype`` is the compute dtype; parameters are always created
    in float32 (the master copy).
    """

    family: Family = "llama"
    vocab_size: int = 32000
    hidden: int = 4096
    ffn: int = 11008
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    head_dim: int | None = None  # default hidden // heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # The fraction of each head's dimensions RoPE rotates (the first ``rotary_dim``; Phi-4-mini's 0.75), the
    # rest passing through unrotated; 1.0: all of them.
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_width: str = "head"  # QK_NORM_WIDTHS; read only with qk_norm
    norm_placement: str = "pre"  # NORM_PLACEMENTS
    # Every RMSNorm's weight w is an offset from 1: ``norm(x) * (1 + w)``, w starting at 0 (Gemma 3).
    norm_unit_offset: bool = False
    # Token embeddings multiplied by sqrt(hidden), rounded to the compute dtype first (Gemma 3, as
    # transformers casts its normalizer to the embedding's dtype).
    scale_embeddings: bool = False
    mlp_activation: str = "silu"  # MLP_ACTIVATIONS
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # The RoPE base of "sliding_attention" layers, which rotate without ``rope_scaling`` (Gemma 3's
    # rope_local_base_freq); "full_attention" layers take ``rope_theta`` and ``rope_scaling``. None: every
    # layer takes those. Part of a layer's kind of block, as its window is.
    sliding_rope_theta: float | None = None
    # Logits capped as ``cap * tanh(logits / cap)`` (Gemma 2's final_logit_softcapping); None: uncapped.
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    # Each layer's attention, as Hugging Face configs write it: "sliding_attention" (``sliding_window``) or
    # "full_attention". None: every layer sliding when ``sliding_window`` is set, else full. Layers of two
    # types are two kinds of block (docs/model_contract.md).
    layer_types: tuple[str, ...] | None = None
    max_positions: int = 4096
    dtype: str = "bfloat16"
    attention_impl: str = "auto"
    # Packed rows (segment ids): the most documents (runs of equal segment ids, padding included) one row
    # may hold, a static bound of cuDNN's packed flash attention: its backward keeps a float32 [rows x
    # max_segments, heads, seq_len, head_dim] workspace, and its time grows with the bound. None:
    # SEGMENT_TOKENS // seq_len, at least 8 (32 at 2,048 tokens, 8 from 8,192 on). Batches with more are
    # refused before they run; the packed data mode closes rows at the bound.
    max_segments: int | None = None
    loss_chunk_tokens: int = 8192  # logits of at most this many tokens exist at once
    # The MLP (with its norm and residual) over at most this many tokens at a time, each chunk recomputed
    # in the backward pass: its [tokens, ffn] temporaries scale with the chunk, not the sequence. None: whole.
    mlp_chunk_tokens: int | None = None
    moe: MoEConfig | None = None
    # With ``moe``: how many leading layers keep a dense MLP (of width ``ffn``); the rest route. Dense and
    # MoE layers are two kinds of block (docs/model_contract.md).
    first_k_dense_replace: int = 0
    # DeepSeek-V3's multi-head latent attention (an ``MLAConfig``) in place of grouped-query attention: then
    # ``head_dim`` is unused (a query/key head is mla.qk_dim wide, a value mla.v_dim), ``kv_heads`` equals
    # ``heads``, and ``qkv_bias`` means transformers' ``attention_bias`` (biases on q_a, kv_a and o).
    mla: MLAConfig | None = None
    # A bias on the attention's output projection (GPT-OSS's attention_bias, with ``qkv_bias``).
    o_bias: bool = False
    # A learned logit per query head that joins each softmax's denominator and attends to nothing (GPT-OSS's
    # ``sinks``): ``softmax([scores, sink])`` with the sink's weight dropped. ``layers.attend`` takes its
    # sink paths for it (cuDNN's ``layers.sink_as_key`` and ``layers.sink_rescaled``, XLA's
    # ``layers.sink_attention``).
    attention_sinks: bool = False
    # The vocabulary's special ids as a Hugging Face config gives them (an end-of-sequence may be several
    # ids); not used by the computation, kept so that an export writes them back (config.json and
    # generation_config.json).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("layer_types", "eos_token_id"):  # as stored in JSON or TOML: hashable, like every field
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        validate(self)

    def layer_type(self, index: int) -> str:
        """Layer ``index``'s attention: "sliding_attention" or "full_attention". ``index`` is read only where
        the layers' types differ (it may be traced otherwise)."""
        if self.layer_types is not None and len(set(self.layer_types)) > 1:
            return self.layer_types[index]
        if self.layer_types is not None:
            return self.layer_types[0]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts. ``index`` is read only where some layers are
        dense and others not (it may be traced otherwise)."""
        return self.moe is not None and (self.first_k_dense_replace == 0 or index >= self.first_k_dense_replace)

    def block_kind(self, index: int) -> str | tuple[str, str]:
        """Layer ``index``'s kind of block (the contract's ``block.kind``): its attention type, or where an
        MoE model has leading dense layers "dense" / "moe" (a pair of the two where attention types mix too).
        ``index`` is read only where the layers differ."""
        attention = self.layer_type(index)
        if self.moe is None or self.first_k_dense_replace == 0:
            return attention
        mlp = "moe" if self.is_moe_layer(index) else "dense"
        return mlp if self.layer_types is None or len(set(self.layer_types)) == 1 else (attention, mlp)

    def rope_of(self, layer_type: str) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of a layer of type ``layer_type``: ``sliding_rope_theta`` unscaled on a
        sliding-window layer where it is set, else ``rope_theta`` with ``rope_scaling``."""
        if layer_type == "sliding_attention" and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """What attention scores q.k are multiplied by before the softmax."""
        scalar = self.dim_per_head if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        scale = 1.0 / math.sqrt(scalar)
        s = self.rope_scaling
        if self.mla is not None and s is not None and s.mscale_all_dim:  # transformers' yarn_apply_mscale
            m = 1.0 if s.factor <= 1 else 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale = scale * m * m
        return scale

    @property
    def norms_per_block(self) -> int:
        """The block's hidden-width RMSNorms: one per sublayer, two with ``norm_placement="sandwich"``."""
        return 4 if self.norm_placement == "sandwich" else 2

    def effective(self, field: str) -> Any:
        """Field ``field`` as the computation reads it: a default left unset (None) made explicit, and a value
        the model does not read None. Configs that agree on every field's effective value compute the same
        function: loading a Hugging Face checkpoint and resuming a run compare these (``EFFECTIVE_FIELDS`` are
        the fields where it can differ from the field as set)."""
        if field == "head_dim":  # None: hidden // heads; with mla unused
            return None if self.mla is not None else self.dim_per_head
        if field == "query_pre_attn_scalar":  # None: the head width
            return float(self.dim_per_head) if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        if field == "layer_types":  # None and a list of one type alike
            return tuple(self.layer_type(i) for i in range(self.layers))
        if field == "ffn" and self.moe is not None and not self.first_k_dense_replace:
            return None  # unused by a mixture of experts without dense layers: its experts' width is moe.expert_ffn
        if field == "qk_norm_width" and not self.qk_norm:
            return None  # no q/k norm: its width means nothing
        return getattr(self, field)

    @property
    def dim_per_head(self) -> int:
        """A query's (and key's) head width: with ``mla``, its unrotated and rotated parts together."""
        if self.mla is not None:
            return self.mla.qk_dim
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (as transformers rounds it); with ``mla``, the
        width of the rotated part of a query / key head (its last dimensions)."""
        if self.mla is not None:
            return self.mla.qk_rope_dim
        return int(self.dim_per_head * self.partial_rotary_factor)

    def segments_per_row(self, seq_len: int) -> int:
        """The most packed documents a row of ``seq_len`` tokens may hold (``max_segments``)."""
        if self.max_segments is not None:
            return self.max_segments
        return max(8, SEGMENT_TOKENS // seq_len)

    def replace(self, **changes) -> "DecoderConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown DecoderConfig field(s) {unknown}; valid fields: "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        layers = changes.get("layers", self.layers)
        if self.layer_types is not None and "layer_types" not in changes and layers != len(self.layer_types):
            # Another depth of the same model (``model.layers=4`` on a preset, the plan's smaller-model option):
            # the per-layer pattern continues as it was (Gemma 3's five local layers to one global one).
            changes["layer_types"] = tuple(self.layer_types[i % len(self.layer_types)] for i in range(layers))
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        """Inverse of ``dataclasses.asdict`` (as stored in checkpoints); unknown keys are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DecoderConfig field(s) {unknown} in a stored config")
        d = dict(d)
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if isinstance(d.get("moe"), dict):
            d["moe"] = MoEConfig(**d["moe"])
        if isinstance(d.get("mla"), dict):
            d["mla"] = MLAConfig(**d["mla"])
        return cls(**d)

    def param_count(self) -> int:
        """Trainable parameters, counted from the shapes (matches the published model for presets)."""
        return self._count(active=False)

    def active_param_count(self) -> int:
        """Parameters one token's forward pass uses: all of them for a dense model; for an MoE, the router,
        ``top_k`` experts and the shared expert of each block (what model FLOPs count)."""
        return self._count(active=True)

    def block_param_count(self, index: int) -> int:
        """Trainable parameters of block ``index``: its attention and norms, and its MLP, dense or a mixture
        of experts (``is_moe_layer``)."""
        common, dense, moe = self._block_counts(active=False)
        return common + (moe if self.is_moe_layer(index) else dense)

    def _block_counts(self, active: bool) -> tuple[int, int, int]:
        """One block's attention and norms, a dense MLP, and an MoE MLP (all, or active per token)."""
        d, hd = self.hidden, self.dim_per_head
        q, kv = self.heads * hd, self.kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + (d if self.o_bias else 0) + (self.heads if self.attention_sinks else 0)
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.mla is not None:
            attn = sum(math.prod(s) for s in self.mla.leaf_shapes(d, self.heads, self.qkv_bias))
        if self.qk_norm:
            attn += 2 * hd if self.qk_norm_width == "head" else q + kv
        moe = 0 if self.moe is None else self.moe.mlp_params(d)[int(active)]
        return attn + self.norms_per_block * d, 3 * d * self.ffn, moe

    def _count(self, active: bool) -> int:
        common, dense, moe = self._block_counts(active)
        n_moe = 0 if self.moe is None else self.layers - self.first_k_dense_replace
        d = self.hidden
        io = self.vocab_size * d + d + (0 if self.tie_embeddings else d * self.vocab_size)
        return self.layers * common + (self.layers - n_moe) * dense + n_moe * moe + io


def _did_you_mean(value: object, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def validate(cfg: DecoderConfig) -> None:
    """Raise ValueError naming the offending value and what is allowed."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; allowed: {list(FAMILIES)}"
                         f"{_did_you_mean(cfg.family, FAMILIES)}")
    for name in ("vocab_size", "hidden", "ffn", "layers", "heads", "kv_heads", "max_positions",
                 "loss_chunk_tokens"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if cfg.max_segments is not None and (not isinstance(cfg.max_segments, int) or cfg.max_segments <= 0):
        raise ValueError(f"max_segments must be a positive integer or None, got {cfg.max_segments!r}")
    if cfg.mlp_chunk_tokens is not None and (not isinstance(cfg.mlp_chunk_tokens, int) or cfg.mlp_chunk_tokens <= 0):
        raise ValueError(f"mlp_chunk_tokens must be a positive integer or None, got {cfg.mlp_chunk_tokens!r}")
    if cfg.head_dim is None and cfg.hidden % cfg.heads and cfg.mla is None:
        raise ValueError(f"heads={cfg.heads} does not divide hidden={cfg.hidden}; choose heads dividing "
                         f"hidden or set head_dim explicitly")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"kv_heads={cfg.kv_heads} does not divide heads={cfg.heads} (grouped-query "
                         f"attention needs heads to be a multiple of kv_heads)")
    if cfg.dim_per_head % 2:
        raise ValueError(f"head dimension {cfg.dim_per_head} must be even for RoPE")
    if not 0 < cfg.partial_rotary_factor <= 1 or cfg.rotary_dim % 2 or cfg.rotary_dim == 0:
        raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor!r} must be in (0, 1] and rotate an even, "
                         f"nonzero number of the head's {cfg.dim_per_head} dimensions (it rotates {cfg.rotary_dim})")
    s = cfg.rope_scaling
    if s is not None and s.kind == "longrope" and len(s.short_factor) != cfg.rotary_dim // 2:
        raise ValueError(f"rope_scaling short_factor and long_factor have {len(s.short_factor)} entries; the "
                         f"{cfg.rotary_dim} rotated dimensions of a head need {cfg.rotary_dim // 2}")
    for name, allowed in (("qk_norm_width", QK_NORM_WIDTHS), ("norm_placement", NORM_PLACEMENTS),
                          ("mlp_activation", MLP_ACTIVATIONS), ("dtype", DTYPES), ("attention_impl", ATTENTION_IMPLS)):
        value = getattr(cfg, name)
        if value not in allowed:
            raise ValueError(f"{name} {value!r} not supported; allowed: {list(allowed)}{_did_you_mean(value, allowed)}")
    for name in ("rope_theta", "norm_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
    for name in ("query_pre_attn_scalar", "sliding_rope_theta", "final_logit_softcap"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, name)
        ids = value if isinstance(value, tuple) and name == "eos_token_id" else (value,)
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{name} must be an integer token id{' or a list of them' if name == 'eos_token_id' else ''}"
                             f" or None, got {value!r}")
    if cfg.sliding_window is not None and cfg.sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {cfg.sliding_window}")
    if cfg.layer_types is not None:
        if len(cfg.layer_types) != cfg.layers or not set(cfg.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must give each of the {cfg.layers} layers one of {list(LAYER_TYPES)}, got "
                             f"{list(cfg.layer_types)}")
        if "sliding_attention" in cfg.layer_types and cfg.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set: set the window")
    if cfg.moe is not None and not isinstance(cfg.moe, MoEConfig):
        raise ValueError(f"moe must be a MoEConfig or None, got {type(cfg.moe).__name__}")
    if cfg.moe is not None and cfg.mlp_chunk_tokens is not None:
        raise ValueError("mlp_chunk_tokens chunks a dense MLP; a mixture of experts (moe) routes the whole batch "
                         "at once: leave mlp_chunk_tokens unset")
    k = cfg.first_k_dense_replace
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"first_k_dense_replace must be a non-negative integer, got {k!r}")
    if k and cfg.moe is None:
        raise ValueError(f"first_k_dense_replace={k} keeps the first layers of a mixture of experts dense, but moe "
                         f"is not set: set moe, or leave first_k_dense_replace at 0")
    if k and k >= cfg.layers:
        raise ValueError(f"first_k_dense_replace={k} leaves none of the {cfg.layers} layers a mixture of experts: "
                         f"choose fewer than {cfg.layers} dense layers, or unset moe")
    if cfg.moe is not None and cfg.mlp_activation != "silu":
        raise ValueError(f"mlp_activation={cfg.mlp_activation!r}: a mixture of experts' experts are SwiGLU (silu)")
    if cfg.mla is not None:
        if not isinstance(cfg.mla, MLAConfig):
            raise ValueError(f"mla must be an MLAConfig or None, got {type(cfg.mla).__name__}")
        if cfg.kv_heads != cfg.heads:
            raise ValueError(f"kv_heads={cfg.kv_heads}: multi-head latent attention (mla) gives every one of the "
                             f"{cfg.heads} heads its own key and value: set kv_heads={cfg.heads}")
        if cfg.qk_norm or cfg.norm_placement != "pre" or cfg.partial_rotary_factor != 1.0:
            raise ValueError("mla (DeepSeek-V3's attention) has no q/k norm, pre-norm blocks, and rotates its "
                             "mla.qk_rope_dim dimensions: leave qk_norm, norm_placement and partial_rotary_factor "
                             "at their defaults")
        if cfg.sliding_window is not None or cfg.layer_types is not None:
            raise ValueError("mla (DeepSeek-V3's attention) attends over the whole sequence: no sliding_window or "
                             "layer_types")
        if cfg.o_bias or cfg.attention_sinks:
            raise ValueError("mla (DeepSeek-V3's attention) takes its biases from qkv_bias and has no sinks: leave "
                             "o_bias and attention_sinks False")
    if cfg.attention_sinks and cfg.attention_impl == "cudnn":
        raise ValueError("attention_sinks (GPT-OSS) cannot all take cuDNN's flash attention: 'auto' gives it the "
                         "layers of unpacked rows (full ones with the sink as one more key, sliding ones rescaled "
                         "by the log-sum-exp) and XLA's sink attention packed rows and heads cuDNN does not take. "
                         "Leave attention_impl at 'auto' (or set 'xla')")
    if cfg.family == "deepseek_v3" and cfg.mla is None:
        raise ValueError("family 'deepseek_v3' uses multi-head latent attention: set mla (an MLAConfig)")
    if cfg.family in MOE_FAMILIES and cfg.moe is None:
        raise ValueError(f"family {cfg.family!r} is a mixture of experts: set moe (a MoEConfig)")


_LLAMA3_SCALING = RopeScaling(factor=8.0, original_max_position=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, original_max_position=8192)

_GEMMA3_SCALING = RopeScaling(kind="linear", factor=8.0, original_max_position=131072)


def _gemma3(layers: int, **shape) -> DecoderConfig:
    """A Gemma 3 text model as its config.json sets it: every 6th layer full attention, the rest sliding;
    the multimodal models' text part has 262,208 tokens (Gemma3TextConfig's default)."""
    fields = dict(family="gemma3", vocab_size=262208, head_dim=256, rope_theta=1000000.0, sliding_rope_theta=10000.0,
                  norm_eps=1e-6, tie_embeddings=True, qk_norm=True, norm_placement="sandwich", norm_unit_offset=True,
                  scale_embeddings=True, mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0,
                  sliding_window=1024, max_positions=131072, layers=layers,
                  layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(layers)))
    return DecoderConfig(**{**fields, **shape})


PRESETS: dict[str, DecoderConfig] = {
    # Seconds on a CPU: the test and demo model.
    "tiny": DecoderConfig(vocab_size=256, hidden=64, ffn=160, layers=2, heads=4, kv_heads=2,
                          max_positions=512, dtype="float32", loss_chunk_tokens=256),
    "llama3.2-1b": DecoderConfig(vocab_size=128256, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8,
                                 head_dim=64, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                                 tie_embeddings=True, max_positions=131072),
    "llama3.2-3b": DecoderConfig(vocab_size=128256, hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8,
                                 rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
                                 max_positions=131072),
    # The 7B layer shape every benchmark in docs/design.md uses; "3.5b" is its first 16 layers.
    "llama2-7b": DecoderConfig(vocab_size=32000, hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32),
    "llama3-8b": DecoderConfig(vocab_size=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                               rope_theta=500000.0, max_positions=8192),
    "llama3.1-8b": DecoderConfig(vocab_size=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                                 rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_positions=131072),
    "mistral-7b": DecoderConfig(family="mistral", vocab_size=32000, hidden=4096, ffn=14336, layers=32,
                                heads=32, kv_heads=8, sliding_window=4096, max_positions=32768),
    "qwen2.5-14b": DecoderConfig(family="qwen2", vocab_size=152064, hidden=5120, ffn=13824, layers=48,
                                 heads=40, kv_heads=8, rope_theta=1000000.0, norm_eps=1e-5, qkv_bias=True,
                                 max_positions=32768),
    "qwen2.5-32b": DecoderConfig(family="qwen2", vocab_size=152064, hidden=5120, ffn=27648, layers=64,
                                 heads=40, kv_heads=8, rope_theta=1000000.0, norm_eps=1e-5, qkv_bias=True,
                                 max_positions=32768),
    "qwen3-8b": DecoderConfig(family="qwen3", vocab_size=151936, hidden=4096, ffn=12288, layers=36, heads=32,
                              kv_heads=8, head_dim=128, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                              max_positions=40960),
    # Phi-3 (microsoft/Phi-3-mini-4k-instruct, Phi-3-medium-4k-instruct: 3.82B, 13.96B) and Phi-4 (14.66B):
    # fused q/k/v and gate/up tensors in their checkpoints (hf/mapping.py), the 4k models' 2,047-token window.
    "phi3-mini": DecoderConfig(family="phi3", vocab_size=32064, hidden=3072, ffn=8192, layers=32, heads=32,
                               kv_heads=32, rope_theta=10000.0, norm_eps=1e-5, sliding_window=2047,
                               max_positions=4096),
    "phi3-medium": DecoderConfig(family="phi3", vocab_size=32064, hidden=5120, ffn=17920, layers=40, heads=40,
                                 kv_heads=10, rope_theta=10000.0, norm_eps=1e-5, sliding_window=2047,
                                 max_positions=4096),
    "phi4": DecoderConfig(family="phi3", vocab_size=100352, hidden=5120, ffn=17920, layers=40, heads=40,
                          kv_heads=10, rope_theta=250000.0, norm_eps=1e-5, max_positions=16384),
    # OLMo 2 (published 1.48B, 7.30B, 13.7B): post-norm blocks, q/k RMSNorm over all heads at once.
    "olmo2-1b": DecoderConfig(family="olmo2", vocab_size=100352, hidden=2048, ffn=8192, layers=16, heads=16,
                              kv_heads=16, rope_theta=500000.0, norm_eps=1e-6, qk_norm=True,
                              qk_norm_width="all_heads", norm_placement="post", max_positions=4096),
    "olmo2-7b": DecoderConfig(family="olmo2", vocab_size=100352, hidden=4096, ffn=11008, layers=32, heads=32,
                              kv_heads=32, rope_theta=500000.0, norm_eps=1e-6, qk_norm=True,
                              qk_norm_width="all_heads", norm_placement="post", max_positions=4096),
    "olmo2-13b": DecoderConfig(family="olmo2", vocab_size=100352, hidden=5120, ffn=13824, layers=40, heads=40,
                               kv_heads=40, rope_theta=500000.0, norm_eps=1e-6, qk_norm=True,
                               qk_norm_width="all_heads", norm_placement="post", max_positions=4096),
    # Gemma 3 (google/gemma-3-1b-pt and the text parts of gemma-3-4b/12b/27b-pt): sandwich norms with weights
    # offset from 1, GeGLU, scaled tied embeddings, per-head q/k norms; five sliding-window layers (RoPE base
    # 10,000) to each full-attention one (base 1,000,000, linear scaling by 8 past 1B).
    "gemma3-1b": _gemma3(vocab_size=262144, hidden=1152, ffn=6912, layers=26, heads=4, kv_heads=1,
                         sliding_window=512, max_positions=32768),
    "gemma3-4b": _gemma3(hidden=2560, ffn=10240, layers=34, heads=8, kv_heads=4, rope_scaling=_GEMMA3_SCALING),
    "gemma3-12b": _gemma3(hidden=3840, ffn=15360, layers=48, heads=16, kv_heads=8, rope_scaling=_GEMMA3_SCALING),
    "gemma3-27b": _gemma3(hidden=5376, ffn=21504, layers=62, heads=32, kv_heads=16, head_dim=128,
                          query_pre_attn_scalar=168.0, rope_scaling=_GEMMA3_SCALING),
    "llama3-70b": DecoderConfig(vocab_size=128256, hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8,
                                rope_theta=500000.0, max_positions=8192),
    # A dense 120B Llama-style shape (no published checkpoint; sized like MegaTrain's 120B claim).
    "dense-120b": DecoderConfig(vocab_size=128256, hidden=12288, ffn=32768, layers=78, heads=96, kv_heads=8,
                                rope_theta=500000.0, max_positions=8192),
}
# Mixtures of experts. Published sizes: Mixtral-8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B (3.3B
# active), Qwen2-57B-A14B 57.4B (14.2B active); tests/test_moe.py checks the counts.
PRESETS["tiny-moe"] = PRESETS["tiny"].replace(
    family="mixtral", moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.02))
PRESETS["mixtral-8x7b"] = DecoderConfig(
    family="mixtral", vocab_size=32000, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
    rope_theta=1000000.0, max_positions=32768,
    moe=MoEConfig(experts=8, top_k=2, expert_ffn=14336, norm_topk_prob=True, aux_loss_coef=0.02))
PRESETS["qwen3-30b-a3b"] = DecoderConfig(
    family="qwen3_moe", vocab_size=151936, hidden=2048, ffn=6144, layers=48, heads=32, kv_heads=4, head_dim=128,
    rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_positions=40960,
    moe=MoEConfig(experts=128, top_k=8, expert_ffn=768, norm_topk_prob=True, aux_loss_coef=0.001))
PRESETS["qwen2-57b-a14b"] = DecoderConfig(
    family="qwen2_moe", vocab_size=151936, hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4,
    rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_positions=32768,
    moe=MoEConfig(experts=64, top_k=8, expert_ffn=2560, norm_topk_prob=False, shared_expert_ffn=20480,
                  aux_loss_coef=0.001))
# GLM-4.5 (zai-org/GLM-4.5-Air: 106B total, 12B active; zai-org/GLM-4.5: 355B, 32B): sigmoid routers with a
# correction bias, one shared expert, leading dense layers, q/k/v biases, RoPE on half of each head; GLM-4.5
# adds per-head q/k norms and scales the routed weights by 2.5. Their checkpoints also hold one
# multi-token-prediction layer (num_nextn_predict_layers) past the last, which is not part of this model.
PRESETS["glm4.5-air"] = DecoderConfig(
    family="glm4_moe", vocab_size=151552, hidden=4096, ffn=10944, layers=46, heads=96, kv_heads=8, head_dim=128,
    rope_theta=1000000.0, partial_rotary_factor=0.5, norm_eps=1e-5, qkv_bias=True, max_positions=131072,
    first_k_dense_replace=1,
    moe=MoEConfig(experts=128, top_k=8, expert_ffn=1408, norm_topk_prob=True, shared_expert_ffn=1408,
                  shared_expert_gate=False, scoring="sigmoid", routed_scale=1.0))
PRESETS["glm4.5"] = DecoderConfig(
    family="glm4_moe", vocab_size=151552, hidden=5120, ffn=12288, layers=92, heads=96, kv_heads=8, head_dim=128,
    rope_theta=1000000.0, partial_rotary_factor=0.5, norm_eps=1e-5, qkv_bias=True, qk_norm=True,
    max_positions=131072, first_k_dense_replace=3,
    moe=MoEConfig(experts=160, top_k=8, expert_ffn=1536, norm_topk_prob=True, shared_expert_ffn=1536,
                  shared_expert_gate=False, scoring="sigmoid", routed_scale=2.5))
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3: 671B total, 37B active) and Kimi K2 (moonshotai/Kimi-K2-Base / -Instruct:
# 1.04T total, 32B active), one architecture (DeepseekV3ForCausalLM): multi-head latent attention with
# interleaved RoPE under YaRN, a sigmoid router with a correction bias over grouped experts, one shared expert,
# leading dense layers. Their checkpoints also hold one multi-token-prediction layer (num_nextn_predict_layers),
# not part of this model.
PRESETS["deepseek-v3"] = DecoderConfig(
    family="deepseek_v3", vocab_size=129280, hidden=7168, ffn=18432, layers=61, heads=128, kv_heads=128,
    rope_theta=10000.0, norm_eps=1e-6, max_positions=163840, first_k_dense_replace=3,
    rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_dim=128, qk_rope_dim=64, v_dim=128),
    moe=MoEConfig(experts=256, top_k=8, expert_ffn=2048, norm_topk_prob=True, shared_expert_ffn=2048,
                  shared_expert_gate=False, scoring="sigmoid", groups=8, topk_groups=4, routed_scale=2.5))
_DSV3 = PRESETS["deepseek-v3"]
PRESETS["kimi-k2"] = _DSV3.replace(  # the same architecture: fewer heads, more experts, one dense layer
    vocab_size=163840, heads=64, kv_heads=64, rope_theta=50000.0, max_positions=131072, first_k_dense_replace=1,
    rope_scaling=dataclasses.replace(_DSV3.rope_scaling, factor=32.0, beta_fast=1.0),
    moe=dataclasses.replace(_DSV3.moe, experts=384, groups=1, topk_groups=1, routed_scale=2.827))


def _gpt_oss(layers: int, experts: int) -> DecoderConfig:
    """A GPT-OSS model as its released config.json sets it (transformers' GptOssConfig): sliding (128 tokens) and
    full-attention layers alternating, the first sliding; YaRN by 32 over 4,096 positions, untruncated."""
    return DecoderConfig(
        family="gpt_oss", vocab_size=201088, hidden=2880, ffn=2880, layers=layers, heads=64, kv_heads=8, head_dim=64,
        rope_theta=150000.0, norm_eps=1e-5, qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=128,
        rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False),
        layer_types=tuple("full_attention" if i % 2 else "sliding_attention" for i in range(layers)),
        max_positions=131072,
        moe=MoEConfig(experts=experts, top_k=4, expert_ffn=2880, norm_topk_prob=True, router_bias=True,
                      expert_bias=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0,
                      aux_loss_coef=0.9))


# GPT-OSS (openai/gpt-oss-20b: 20.9B total, 3.6B active; openai/gpt-oss-120b: 116.8B, 5.1B): attention sinks,
# q/k/v/o biases, a biased router whose softmax over the top 4 logits weights the experts, experts with biases
# and the clamped SwiGLU, no shared expert. The released checkpoints store the experts as MXFP4 (hf/mxfp4.py).
PRESETS["gpt-oss-20b"] = _gpt_oss(layers=24, experts=32)
PRESETS["gpt-oss-120b"] = _gpt_oss(layers=36, experts=128)
PRESETS["7b"] = PRESETS["llama2-7b"]
PRESETS["3.5b"] = PRESETS["llama2-7b"].replace(layers=16)
PRESETS["1b"] = PRESETS["llama3.2-1b"]
PRESETS["3b"] = PRESETS["llama3.2-3b"]
PRESETS["8b"] = PRESETS["llama3-8b"]
PRESETS["14b"] = PRESETS["qwen2.5-14b"]
PRESETS["32b"] = PRESETS["qwen2.5-32b"]
PRESETS["70b"] = PRESETS["llama3-70b"]
PRESETS["120b"] = PRESETS["dense-120b"]


def preset(name: str, **overrides) -> DecoderConfig:
    """A named preset, optionally with fields replaced (e.g. ``preset('7b', layers=16)``)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise ValueError(f"unknown preset {name!r}.{hint} Available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
