"""Mixture-of-experts MLP: a top-k router over SwiGLU experts, dispatched without dropping tokens.

Shape suffixes as in layers.py, plus E experts, K chosen per token (``top_k``), A = T * K assignments,
F the expert width. Parameters are float32 (the master copy) and cast to the input's dtype.

Dispatch: the A (token, expert) assignments are sorted by expert, so each expert's tokens are one
contiguous group, and one grouped matmul multiplies every group by its expert's weights: on Hopper GPUs
JAX's Pallas Mosaic-GPU kernels (XLA's own ``ragged_dot`` there computes every row against every expert and
masks), ``jax.lax.ragged_dot`` elsewhere.
Nothing is padded to a capacity and no token is dropped, unless ``capacity_factor`` asks for it. The work
is the active experts' only; the shapes are static (A rows), so the program compiles once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.models.config import MoEConfig
from megatrain_jax.models.layers import MLP, Linear, _init_normal, gpu_compute_capability


class RouterStats(NamedTuple):
    """What the load-balancing loss needs from one block, over the tokens it routed: ``counts_E`` how many
    assignments each expert got (no gradient), ``prob_sums_E`` the sum over tokens of each expert's routing
    probability (differentiable), and ``tokens`` how many tokens were routed (float32). Every field is a
    sum over tokens, so the statistics of several blocks, micro-batches or devices add up."""

    counts_E: jax.Array
    prob_sums_E: jax.Array
    tokens: jax.Array


def load_balancing_loss(stats: list[RouterStats] | RouterStats, coef: float, experts: int) -> jax.Array:
    """The Switch-Transformer auxiliary loss as transformers computes it (``load_balancing_loss_func``
    without an attention mask) over all blocks' routed tokens together:
    ``coef * E * sum_e (assignments to e / N) * (sum of e's probability / N)``, N the tokens of all
    blocks. It is not a sum of per-block losses: both factors are totals over the blocks."""
    stats = [stats] if isinstance(stats, RouterStats) else list(stats)
    n = jax.lax.stop_gradient(sum(s.tokens for s in stats))
    counts = sum(s.counts_E for s in stats)
    probs = sum(s.prob_sums_E for s in stats)
    return coef * experts * jnp.sum(jax.lax.stop_gradient(counts) * probs) / (n * n)


@dataclasses.dataclass(frozen=True)
class SwitchLoss:
    """A model's ``aux_loss`` (docs/model_contract.md): the load-balancing loss of the summed
    ``RouterStats`` of all its blocks. Compared by value, so engines of equal models share programs."""

    coef: float
    experts: int

    def __call__(self, stats: RouterStats) -> jax.Array:
        return load_balancing_loss(stats, self.coef, self.experts)


# Tiles of the Mosaic-GPU grouped matmuls, the best of a sweep on the H100 at the Mixtral-8x7B and
# Qwen3-30B-A3B shapes (tests/assets/measured/h100_kernels.json): forward and dx 588-601 / 255-370 TFLOP/s,
# dw 597 / 394 (XLA's ragged_dot: 97 at Mixtral's shape; one dense matmul of the same FLOPs: 752 / 480).
_GROUPED_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4)
_GROUPED_TILES_T = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def _use_mosaic_grouped(x_AD: jax.Array) -> bool:
    """The Mosaic-GPU kernels take 16-bit operands on Hopper (sm_90) (widths: see ``padded_grouped``)."""
    return gpu_compute_capability() == (9, 0) and x_AD.dtype in (jnp.bfloat16, jnp.float16)


@jax.custom_vjp
def _grouped_mosaic(x_AD: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array) -> jax.Array:
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    return ragged_dot(x_AD, w_EDF, group_sizes=sizes_E, **_GROUPED_TILES)


def _grouped_mosaic_fwd(x_AD, w_EDF, sizes_E):
    return _grouped_mosaic(x_AD, w_EDF, sizes_E), (x_AD, w_EDF, sizes_E)


def _grouped_mosaic_bwd(res, dy_AF):
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot
    x_AD, w_EDF, sizes_E = res
    dx_AD = ragged_dot(dy_AF, w_EDF, group_sizes=sizes_E, transpose_rhs=True, **_GROUPED_TILES)
    dw_EDF = transposed_ragged_dot(x_AD, dy_AF, group_sizes=sizes_E, **_GROUPED_TILES_T)
    return dx_AD, dw_EDF, None


_grouped_mosaic.defvjp(_grouped_mosaic_fwd, _grouped_mosaic_bwd)


def padded_grouped(x_AD: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array, matmul, multiple: int = 128) -> jax.Array:
    """``matmul(x_AD, w_EDF, sizes_E)`` with D and F zero-padded to multiples of ``multiple`` and the output cut
    back to F columns: the Mosaic-GPU kernels tile both widths by 128 (GPT-OSS's are 2880). The padding adds
    nothing to any product, and its gradient is the slice of the padded one."""
    D, F = w_EDF.shape[1:]
    pad_D, pad_F = -D % multiple, -F % multiple
    if not (pad_D or pad_F):
        return matmul(x_AD, w_EDF, sizes_E)
    x_AD = jnp.pad(x_AD, ((0, 0), (0, pad_D)))
    w_EDF = jnp.pad(w_EDF, ((0, 0), (0, pad_D), (0, pad_F)))
    return matmul(x_AD, w_EDF, sizes_E)[:, :F]


def grouped_matmul(x_AD: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot``: rows of ``x_AD`` in consecutive groups of ``sizes_E`` (summing to A), each
    times its group's [D, F] matrix. Mosaic-GPU kernels where they apply (widths padded to 128), XLA's ragged_dot
    otherwise: on the GPU XLA lowers it as one dense product per group over every row (E times the FLOPs; GPT-OSS-20B
    at 2,880 wide took 62 s a step that way: experiments/results/h200x2_gpt_oss_20b_xla_ragged_cli.json)."""
    if _use_mosaic_grouped(x_AD):
        return padded_grouped(x_AD, w_EDF, sizes_E, _grouped_mosaic)
    return jax.lax.ragged_dot(x_AD, w_EDF, sizes_E)


class Experts(nnx.Module):
    """``E`` gated experts stored stacked: ``gate``/``up`` [E, D, F], ``down`` [E, F, D]; with ``bias`` (GPT-OSS)
    ``gate_bias``/``up_bias`` [E, F] and ``down_bias`` [E, D]. ``activation``: "silu" (SwiGLU,
    ``down(silu(gate) * up)``) or "clamped_swiglu" (GPT-OSS, transformers' ``GptOssExperts._apply_gate``:
    ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``, ``down((u + 1) * g * sigmoid(alpha * g))``)."""

    def __init__(self, experts: int, hidden: int, ffn: int, *, bias: bool = False, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, rngs: nnx.Rngs):
        self.gate = nnx.Param(_init_normal(rngs.params(), (experts, hidden, ffn), jnp.float32))
        self.up = nnx.Param(_init_normal(rngs.params(), (experts, hidden, ffn), jnp.float32))
        self.down = nnx.Param(_init_normal(rngs.params(), (experts, ffn, hidden), jnp.float32))
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.float32)) if bias else None  # noqa: E731
        self.gate_bias, self.up_bias, self.down_bias = zeros(experts, ffn), zeros(experts, ffn), zeros(experts, hidden)
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def __call__(self, x_AD: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
        """Rows of ``x_AD`` sorted by expert, ``group_sizes_E`` rows each -> each row through its expert."""
        dt = x_AD.dtype

        def dot(x, w, b):
            if b is None:
                return grouped_matmul(x, w[...].astype(dt), group_sizes_E)
            # the bias as one more input width: a column of ones on x and the bias as w's last row, so the grouped
            # matmul adds it and its gradient is each group's sum of dy (a gather of the bias per row had a
            # scatter-add of 131K rows into E as its gradient)
            x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), dt)], axis=1)
            return grouped_matmul(x, jnp.concatenate([w[...].astype(dt), b[...].astype(dt)[:, None, :]], axis=1),
                                  group_sizes_E)

        gate, up = dot(x_AD, self.gate, self.gate_bias), dot(x_AD, self.up, self.up_bias)
        if self.activation == "silu":
            h = jax.nn.silu(gate) * up
        else:
            gate = jnp.minimum(gate, self.limit)
            h = (jnp.clip(up, -self.limit, self.limit) + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        return dot(h, self.down, self.down_bias)


class MoE(nnx.Module):
    """The MoE MLP of one block: ``(y_BTD, RouterStats)`` for ``x_BTD``."""

    def __init__(self, hidden: int, moe: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = moe
        self.router = Linear(hidden, moe.experts, bias=moe.router_bias, rngs=rngs)
        # a sigmoid router's bias for choosing experts: a Param (the contract's only kind of variable) that
        # no gradient reaches (``route``); zeros until a checkpoint sets it
        self.correction_bias = (nnx.Param(jnp.zeros((moe.experts,), jnp.float32)) if moe.scoring == "sigmoid"
                                else None)
        self.experts = Experts(moe.experts, hidden, moe.expert_ffn, bias=moe.expert_bias, activation=moe.activation,
                               alpha=moe.swiglu_alpha, limit=moe.swiglu_limit, rngs=rngs)
        self.shared = MLP(hidden, moe.shared_expert_ffn, rngs=rngs) if moe.shared_expert_ffn is not None else None
        self.shared_gate = (Linear(hidden, 1, rngs=rngs) if moe.shared_expert_ffn is not None and moe.shared_expert_gate
                            else None)

    def route(self, x_TD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Routing probabilities [T, E] (float32; a sigmoid router's scores), and the chosen experts [T, K] with
        their weights [T, K]."""
        if self.cfg.scoring == "sigmoid":
            return self._route_sigmoid(x_TD)
        probs_TE = jax.nn.softmax(self.router(x_TD).astype(jnp.float32), axis=-1)
        weights_TK, experts_TK = jax.lax.top_k(probs_TE, self.cfg.top_k)
        if self.cfg.norm_topk_prob:
            weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
        return probs_TE, experts_TK, weights_TK * self.cfg.routed_scale

    def _route_sigmoid(self, x_TD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """DeepSeek-V3 / GLM-4.5 (transformers' ``Glm4MoeTopkRouter``): float32 logits, sigmoid scores; the
        experts chosen by score + correction bias among the ``topk_groups`` groups whose two best corrected
        scores sum highest; weighted by their uncorrected scores (renormalized), times ``routed_scale``."""
        m = self.cfg
        T, E, G = x_TD.shape[0], m.experts, m.groups
        scores_TE = jax.nn.sigmoid(self.router(x_TD.astype(jnp.float32)))
        choice_TE = scores_TE + jax.lax.stop_gradient(self.correction_bias[...])
        if G > 1:
            group_TG = jnp.sum(jax.lax.top_k(choice_TE.reshape(T, G, E // G), 2)[0], axis=-1)
            keep_TG = jnp.any(jax.nn.one_hot(jax.lax.top_k(group_TG, m.topk_groups)[1], G, dtype=bool), axis=1)
            choice_TE = jnp.where(jnp.repeat(keep_TG, E // G, axis=1), choice_TE, -jnp.inf)
        experts_TK = jax.lax.top_k(choice_TE, m.top_k)[1]
        weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=1)
        if m.norm_topk_prob:
            weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
        return scores_TE, experts_TK, weights_TK * m.routed_scale

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, RouterStats]:
        B, T, D = x_BTD.shape
        E, K = self.cfg.experts, self.cfg.top_k
        x_TD = x_BTD.reshape(B * T, D)
        probs_TE, experts_TK, weights_TK = self.route(x_TD)
        expert_A = experts_TK.reshape(-1)
        order_A = jnp.argsort(expert_A, stable=True)  # each expert's assignments together, in token order
        token_A = order_A // K
        sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
        y_AD = self.experts(x_TD[token_A], sizes_E)
        weight_A = weights_TK.reshape(-1)[order_A]
        if self.cfg.capacity_factor is not None:  # drop the assignments past each expert's capacity
            capacity = math.ceil(self.cfg.capacity_factor * B * T * K / E)
            starts_E = jnp.cumsum(sizes_E) - sizes_E
            rank_A = jnp.arange(B * T * K) - starts_E[expert_A[order_A]]
            weight_A = jnp.where(rank_A < capacity, weight_A, 0.0)
        y_AD = y_AD * weight_A[:, None].astype(y_AD.dtype)
        y_TD = jnp.zeros_like(x_TD).at[token_A].add(y_AD)
        if self.shared_gate is not None:  # Qwen2-MoE: a gated shared expert
            gate_T1 = jax.nn.sigmoid(self.shared_gate(x_TD).astype(jnp.float32)).astype(x_TD.dtype)
            y_TD = y_TD + gate_T1 * self.shared(x_TD)
        elif self.shared is not None:  # DeepSeek-V3, GLM-4.5: added as it is
            y_TD = y_TD + self.shared(x_TD)
        stats = RouterStats(counts_E=sizes_E.astype(jnp.float32),
                            prob_sums_E=jnp.sum(probs_TE, axis=0), tokens=jnp.float32(B * T))
        return y_TD.reshape(B, T, D), stats
