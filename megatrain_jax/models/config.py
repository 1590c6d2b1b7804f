"""Decoder configuration: one dataclass, ``DecoderConfig``, for every family (``megatrain_jax.families`` holds
each family's defaults, presets and Hugging Face format; ``models.presets`` the named shapes), and its validation."""

from __future__ import annotations

import dataclasses
import math
import difflib
from typing import Any, Literal

from megatrain_jax.families import FAMILIES as _FAMILY_RECORDS
from megatrain_jax.models.sublayers import MLAConfig, MoEConfig, RopeScaling

# The family names, as the registry (``megatrain_jax.families``) lists them.
FAMILIES: tuple[str, ...] = tuple(_FAMILY_RECORDS)
Family = Literal[FAMILIES]  # type: ignore[valid-type]  (a TOML value is checked against these names)
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "xla", "cudnn")
# Default bound on packed documents per row times the row's tokens (DecoderConfig.max_segments).
SEGMENT_TOKENS = 2**16


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


# Queries per chunk of ``layers.sink_attention`` (GPT-OSS): its scores exist for this many queries at a time.
SINK_QUERY_CHUNK = 512
# Head widths that ``layers.sink_as_key`` adds (the sink's logit as two of them; 8 keeps cuDNN's multiple).
SINK_WIDTH = 8


def cudnn_takes_heads(head_dim: int, hopper: bool) -> bool:
    """Whether cuDNN's flash attention takes heads this wide: a multiple of 8, at most 256 on Hopper and later, 128
    before. (``layers`` asks it of the GPU at hand; the plan, which knows no GPU, of both generations.)"""
    return head_dim % 8 == 0 and head_dim <= (256 if hopper else 128)


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

    def block_active_param_count(self, index: int) -> int:
        """Parameters of block ``index`` one token's forward uses (``active_param_count``'s per block)."""
        common, dense, moe = self._block_counts(active=True)
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
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in ("head_dim", "max_segments", "mlp_chunk_tokens", "sliding_window"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            default = " (unset: hidden // heads)" if name == "head_dim" else ""
            raise ValueError(f"{name} must be a positive integer or None{default}, got {value!r}")
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
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"{name} must be a positive, finite number or None, got {value!r}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, name)
        ids = value if isinstance(value, tuple) and name == "eos_token_id" else (value,)
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{name} must be an integer token id{' or a list of them' if name == 'eos_token_id' else ''}"
                             f" or None, got {value!r}")
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
    family = _FAMILY_RECORDS[cfg.family]
    if family.mla and cfg.mla is None:
        raise ValueError(f"family {cfg.family!r} uses multi-head latent attention: set mla (an MLAConfig)")
    if family.moe and cfg.moe is None:
        raise ValueError(f"family {cfg.family!r} is a mixture of experts: set moe (a MoEConfig)")
