"""Hugging Face tensor names of the sublayers families share, and the block most of them store (``block_specs``).

HF ``nn.Linear`` weights are [out, in] and our kernels [in, out], so every projection is transposed. A family
whose checkpoints store a block otherwise (Phi-3's fused projections, GPT-OSS's stacked experts) gives its own
``Family.blocks`` from these pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Spec:
    """One HF tensor: where it goes in our tree, and its shape on each side."""

    hf_name: str
    path: tuple[str, ...]  # key path in our part's pure dict
    hf_shape: tuple[int, ...]
    transpose: bool
    expert: int | None = None  # one expert's slice [expert] of a leaf stacked over experts
    rows: tuple[int, int] | None = None  # our leaf is rows [start, stop) of a fused HF tensor (Phi-3's)
    # our leaf is every ``step``-th entry of the HF tensor's last axis from ``start`` (GPT-OSS's gate_up_proj)
    interleave: tuple[int, int] | None = None

    @property
    def our_shape(self) -> tuple[int, ...]:
        shape = self.hf_shape if self.rows is None else (self.rows[1] - self.rows[0], *self.hf_shape[1:])
        if self.interleave is not None:
            shape = (*shape[:-1], shape[-1] // self.interleave[1])
        return tuple(reversed(shape)) if self.transpose else shape

    def of(self, tensor: Any) -> Any:
        """Our leaf's part of the HF tensor as stored (a view of it), not yet transposed."""
        if self.interleave is not None:
            return tensor[..., self.interleave[0]::self.interleave[1]]
        return tensor if self.rows is None else tensor[self.rows[0]:self.rows[1]]


def io_specs(cfg: Any) -> list[Spec]:
    V, D = cfg.vocab_size, cfg.hidden
    specs = [Spec("model.embed_tokens.weight", ("embedding",), (V, D), False),
             Spec("model.norm.weight", ("final_norm", "scale"), (D,), False)]
    if not cfg.tie_embeddings:
        specs.append(Spec("lm_head.weight", ("lm_head",), (V, D), True))
    return specs


def norm_specs(cfg: Any, p: str) -> list[Spec]:
    """A block's hidden-width norms: pre-norm blocks name them by position in the block (Llama: the input's and the
    one after attention), post-norm ones by the sublayer they follow (OLMo 2); sandwich blocks (Gemma 3) have all
    four."""
    norms = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
             "post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"},
             "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
             }[cfg.norm_placement]
    return [Spec(p + f"{hf}.weight", (ours, "scale"), (cfg.hidden,), False) for ours, hf in norms.items()]


def attention_specs(cfg: Any, p: str) -> list[Spec]:
    """Grouped-query attention: ``q/k/v/o_proj`` (q/k/v biases with ``qkv_bias``, o's with ``o_bias``), GPT-OSS's
    ``sinks``, and the q/k norms (each head's, or all heads' at once)."""
    D, hd = cfg.hidden, cfg.dim_per_head
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    specs = []
    for ours, out_dim in (("q", q), ("k", kv), ("v", kv)):
        specs.append(Spec(p + f"self_attn.{ours}_proj.weight", ("attn", ours, "kernel"), (out_dim, D), True))
        if cfg.qkv_bias:
            specs.append(Spec(p + f"self_attn.{ours}_proj.bias", ("attn", ours, "bias"), (out_dim,), False))
    specs.append(Spec(p + "self_attn.o_proj.weight", ("attn", "o", "kernel"), (D, q), True))
    if cfg.o_bias:
        specs.append(Spec(p + "self_attn.o_proj.bias", ("attn", "o", "bias"), (D,), False))
    if cfg.attention_sinks:
        specs.append(Spec(p + "self_attn.sinks", ("attn", "sinks"), (cfg.heads,), False))
    if cfg.qk_norm:
        q_width, k_width = (hd, hd) if cfg.qk_norm_width == "head" else (q, kv)
        specs += [Spec(p + "self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (q_width,), False),
                  Spec(p + "self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (k_width,), False)]
    return specs


def dense_mlp_specs(cfg: Any, p: str) -> list[Spec]:
    D, F = cfg.hidden, cfg.ffn
    return [Spec(p + f"mlp.{name}_proj.weight", ("mlp", name, "kernel"), shape, True)
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))]


def moe_specs(cfg: Any, p: str, moe: str = "mlp.", names: dict[str, str] | None = None) -> list[Spec]:
    """A mixture of experts' tensors as released checkpoints store them: one [out, in] matrix per expert
    (``{moe}experts.j.gate/up/down_proj``, or ``names`` for them: Mixtral's w1/w3/w2), our leaves stacked over the
    experts. A sigmoid router also holds ``gate.e_score_correction_bias``; a shared expert is ``shared_expert`` with
    its gate (Qwen2-MoE), ungated ``shared_experts`` (one MLP of n_shared_experts x moe_intermediate_size:
    DeepSeek-V3, GLM-4.5)."""
    m, D = cfg.moe, cfg.hidden
    F, E = m.expert_ffn, m.experts
    moe = p + moe
    names = names or {n: f"{n}_proj" for n in ("gate", "up", "down")}
    specs = [Spec(moe + "gate.weight", ("mlp", "router", "kernel"), (E, D), True)]
    if m.scoring == "sigmoid":
        specs.append(Spec(moe + "gate.e_score_correction_bias", ("mlp", "correction_bias"), (E,), False))
    for j in range(E):
        for ours, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            specs.append(Spec(f"{moe}experts.{j}.{names[ours]}.weight", ("mlp", "experts", ours), shape, True, j))
    if m.shared_expert_ffn is not None:
        S = m.shared_expert_ffn
        shared = "shared_expert" if m.shared_expert_gate else "shared_experts"
        for ours, shape in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
            specs.append(Spec(f"{moe}{shared}.{ours}_proj.weight", ("mlp", "shared", ours, "kernel"), shape, True))
        if m.shared_expert_gate:
            specs.append(Spec(f"{moe}shared_expert_gate.weight", ("mlp", "shared_gate", "kernel"), (1, D), True))
    return specs


def block_specs(cfg: Any, i: int) -> list[Spec]:
    """Block ``i`` as most families store it: norms, attention, and a dense MLP or (an MoE layer) experts."""
    p = f"model.layers.{i}."
    mlp = moe_specs(cfg, p) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, p)
    return norm_specs(cfg, p) + attention_specs(cfg, p) + mlp
