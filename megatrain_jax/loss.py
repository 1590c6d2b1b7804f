"""Causal-LM loss in float32, plain and chunked over tokens (the full [tokens, vocab] logits never exist), and the
training objectives built on it: the next-token loss (``NextToken``) and preference training (``DPO``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np


def token_nll(logits_TV: jax.Array, targets_T: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood, float32."""
    logits_TV = logits_TV.astype(jnp.float32)
    logz_T = jax.nn.logsumexp(logits_TV, axis=-1)
    picked_T = jnp.take_along_axis(logits_TV, targets_T[..., None], axis=-1)[..., 0]
    return logz_T - picked_T


def causal_lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
    """Mean next-token NLL over tokens whose mask is 1."""
    nll = token_nll(logits_BTV, targets_BT)
    if mask_BT is None:
        return jnp.mean(nll)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def chunked_nll_sum(logits_fn: Callable[[jax.Array], jax.Array], h_TD: jax.Array, targets_T: jax.Array,
                    mask_T: jax.Array, chunk: int) -> jax.Array:
    """Sum of masked NLL, computing logits ``chunk`` tokens at a time (the full [tokens, vocab] logits never exist).

    Differentiated, each chunk's gradient is taken where its logits are made, in the forward: the chunk's logits,
    their gradient (softmax minus the target's one-hot, times the mask) and its pull-back through ``logits_fn`` to
    the hidden states and to the arrays ``logits_fn`` closes over (the head's weight). The backward only scales
    what the forward left by the loss's cotangent. So the logits are made once, not again in the backward: three
    of the head's products instead of four (what Liger's fused linear cross-entropy saves). Not differentiated, it
    makes the logits and sums the NLL, nothing more."""
    hs, ts, ms = _chunked(chunk, h_TD, targets_T, mask_T.astype(jnp.float32))
    fn, consts = jax.closure_convert(logits_fn, hs[0])  # the closed-over arrays become arguments with gradients
    return _fused_nll_sum(fn, hs, ts, ms, *consts)


def _chunk_nll_sum(fn, h_CD, t_C, m_C, consts) -> jax.Array:
    return jnp.sum(token_nll(fn(h_CD, *consts), t_C) * m_C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_nll_sum(fn, hs, ts, ms, *consts) -> jax.Array:
    def one(total, xs):
        h, t, m = xs
        return total + _chunk_nll_sum(fn, h, t, m, consts), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (hs, ts, ms))
    return total


def _fused_nll_sum_fwd(fn, hs, ts, ms, *consts):
    def one(carry, xs):
        total, acc = carry
        h, t, m = xs
        nll, (dh, dc) = jax.value_and_grad(lambda h_, c_: _chunk_nll_sum(fn, h_, t, m, c_), argnums=(0, 1))(
            h, consts)
        # the weight's gradient summed over the chunks in its own dtype, as the differentiated scan sums it
        return (total + nll, jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, dc)), dh

    zeros = jax.tree.map(jnp.zeros_like, consts)
    (total, d_consts), dhs = jax.lax.scan(one, (jnp.zeros((), jnp.float32), zeros), (hs, ts, ms))
    return total, (dhs, d_consts, ts, ms)


def _fused_nll_sum_bwd(fn, res, g):
    dhs, d_consts, ts, ms = res
    scale = lambda x: (x * g).astype(x.dtype)  # noqa: E731
    zero_targets = np.zeros(ts.shape, jax.dtypes.float0)  # integer targets take no cotangent
    return (scale(dhs), zero_targets, jnp.zeros_like(ms), *jax.tree.map(scale, d_consts))


_fused_nll_sum.defvjp(_fused_nll_sum_fwd, _fused_nll_sum_bwd)


def _chunked(chunk: int, h_TD: jax.Array, *per_token: jax.Array) -> tuple[jax.Array, ...]:
    """``h_TD`` and the per-token arrays ``[T]`` zero-padded to whole chunks of ``min(chunk, T)`` tokens and
    reshaped to ``[chunks, chunk, ...]`` (a scan's inputs)."""
    T = h_TD.shape[0]
    chunk = min(chunk, T)
    pad = (-T) % chunk
    n = (T + pad) // chunk
    h = jnp.pad(h_TD, ((0, pad), (0, 0))) if pad else h_TD
    rest = [jnp.pad(x, (0, pad)) if pad else x for x in per_token]
    return (h.reshape(n, chunk, -1), *(x.reshape(n, chunk) for x in rest))


def chunked_token_nll(logits_fn: Callable[[jax.Array], jax.Array], h_TD: jax.Array, targets_T: jax.Array,
                      chunk: int) -> jax.Array:
    """Each token's NLL, float32 [T], computing logits ``chunk`` tokens at a time; each chunk's logits are
    recomputed in the backward pass instead of stored (a per-token loss's cotangent is not known in the forward,
    so ``chunked_nll_sum``'s fused gradient does not apply)."""
    @jax.checkpoint
    def one(carry, xs):
        h, t = xs
        return carry, token_nll(logits_fn(h), t)

    _, nll = jax.lax.scan(one, None, _chunked(chunk, h_TD, targets_T))
    return nll.reshape(-1)[:h_TD.shape[0]]


@dataclasses.dataclass(frozen=True)
class NextToken:
    """The default objective: the mean next-token NLL over the tokens whose ``loss_mask`` is 1."""

    pairs: ClassVar[bool] = False  # rows are independent examples


@dataclasses.dataclass(frozen=True)
class DPO:
    """Direct preference optimization (Rafailov et al. 2023): the sigmoid loss, with label smoothing (the
    conservative DPO of Mitchell 2023), as TRL computes it.

    Rows come in pairs: row 2i is a prompt with its chosen response, row 2i + 1 the same prompt with the
    rejected one. A row's ``loss_mask`` marks its response tokens; ``Batch.ref_logps`` holds each row's
    summed log-probability of them under the reference model (the policy before training), computed once
    before training (``Engine.row_logps``). With ``z = (logp_c - logp_r) - (ref_c - ref_r)``, a pair's loss
    is ``-(1 - label_smoothing) log sigmoid(beta z) - label_smoothing log sigmoid(-beta z)``; the batch's is
    the mean over its pairs. The implicit rewards are ``beta (logp - ref)`` of each response.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    pairs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not (_real(self.beta) and 0 < self.beta < math.inf):
            raise ValueError(f"DPO beta must be a finite number > 0 (0.1 is usual), got {self.beta!r}")
        if not (_real(self.label_smoothing) and 0.0 <= self.label_smoothing < 0.5):
            raise ValueError(f"DPO label_smoothing must lie in [0, 0.5) (the assumed share of flipped preference "
                             f"labels; 0 is plain DPO), got {self.label_smoothing!r}")

    def pair_terms(self, logps_B: jax.Array, ref_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each pair's loss and the chosen and rejected responses' rewards ([B / 2] each), from every row's
        summed log-probability under the policy and under the reference (float32 [B], pairs adjacent)."""
        logps_B, ref_B = logps_B.astype(jnp.float32), ref_B.astype(jnp.float32)
        chosen, rejected = logps_B[0::2] - ref_B[0::2], logps_B[1::2] - ref_B[1::2]
        z = self.beta * (chosen - rejected)
        losses = (-(1.0 - self.label_smoothing) * jax.nn.log_sigmoid(z)
                  - self.label_smoothing * jax.nn.log_sigmoid(-z))
        return losses, self.beta * chosen, self.beta * rejected

    @staticmethod
    def stats(chosen_rewards: jax.Array, rejected_rewards: jax.Array) -> jax.Array:
        """What a step reports of its pairs, summed over them (float32 [4]): the chosen and the rejected
        rewards, the pairs whose chosen reward is higher, and the pairs (``pair_metrics`` reads it)."""
        return jnp.stack([jnp.sum(chosen_rewards), jnp.sum(rejected_rewards),
                          jnp.sum((chosen_rewards > rejected_rewards).astype(jnp.float32)),
                          jnp.float32(chosen_rewards.shape[0])])


def _real(x) -> bool:
    """A real number (a Python or NumPy int or float), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def pair_metrics(stats) -> dict[str, float]:
    """A step's preference metrics from its summed ``DPO.stats`` (over micro-batches, devices, sub-steps)."""
    chosen, rejected, right, pairs = (float(x) for x in stats)
    pairs = max(pairs, 1.0)
    return {"rewards_chosen": chosen / pairs, "rewards_rejected": rejected / pairs,
            "rewards_margin": (chosen - rejected) / pairs, "rewards_accuracy": right / pairs}


Objective = NextToken | DPO
