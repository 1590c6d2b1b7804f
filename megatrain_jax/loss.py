"""Causal-LM loss in float32, plain and chunked over tokens (the full [tokens, vocab] logits never exist)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


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
    """Sum of masked NLL, computing logits ``chunk`` tokens at a time; each chunk's logits are recomputed
    in the backward pass instead of stored."""
    T = h_TD.shape[0]
    chunk = min(chunk, T)
    pad = (-T) % chunk
    if pad:
        h_TD = jnp.pad(h_TD, ((0, pad), (0, 0)))
        targets_T = jnp.pad(targets_T, (0, pad))
        mask_T = jnp.pad(mask_T, (0, pad))
    n = (T + pad) // chunk

    @jax.checkpoint
    def one(carry, xs):
        h, t, m = xs
        return carry + jnp.sum(token_nll(logits_fn(h), t) * m), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32),
                            (h_TD.reshape(n, chunk, -1), targets_T.reshape(n, chunk),
                             mask_T.astype(jnp.float32).reshape(n, chunk)))
    return total
