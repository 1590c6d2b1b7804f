"""The configs of the sublayers a DecoderConfig may swap in: RoPE frequency scaling (``RopeScaling``), a mixture
of experts in place of the dense MLP (``MoEConfig``), and multi-head latent attention (``MLAConfig``)."""

from __future__ import annotations

import dataclasses
import math

ROPE_KINDS: tuple[str, ...] = ("llama3", "linear", "yarn", "longrope")
# How an MoE router scores the experts: "softmax" over all of them (Mixtral, Qwen-MoE), or "sigmoid" of each
# (DeepSeek-V3, GLM-4.5: with a correction bias for choosing, and grouped top-k).
ROUTER_SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")
# An expert's activation: "silu" (SwiGLU, ``down(silu(gate) * up)``) or "clamped_swiglu" (GPT-OSS:
# ``down((clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g))`` with ``g = min(gate, limit)``).
EXPERT_ACTIVATIONS: tuple[str, ...] = ("silu", "clamped_swiglu")


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

