"""A GPT-2-style language model written to megatrain_jax's layered contract (docs/model_contract.md).

What the engine reads: ``model.cfg`` (vocab_size, max_positions, loss_chunk_tokens, dtype; layers and
hidden for FLOP counts), ``model.io.embed / final_hidden / unembed``, ``model.blocks`` (identical
``Block``s) and, for an abstract model from ``nnx.eval_shape``, ``new_io(key)`` / ``new_block(index, key)``.
What ``ReferenceTrainer`` reads: ``model.cfg`` and ``model(tokens, positions, segment_ids)``. Both must
compute the same function, so ``__call__`` is written with the very io and block calls the engine makes.

GPT-2 adds learned absolute position embeddings in ``io.embed`` from ``positions_BT``: packed documents
(positions restarting at each boundary) get the same embeddings as separate rows would.

    python examples/gpt2.py     # checks the model, then trains it a few steps with megatrain_jax.fit
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

_normal = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 512
    max_positions: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype; parameters are float32
    loss_chunk_tokens: int = 256
    norm_eps: float = 1e-5


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs.params(), (d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32))

    def __call__(self, x):
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias, computed in float32; the output has the input's dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head causal self-attention; with segment ids, tokens attend only within their document."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.qkv = Dense(cfg.hidden, 3 * cfg.hidden, rngs=rngs)
        self.proj = Dense(cfg.hidden, cfg.hidden, rngs=rngs)

    def __call__(self, x_BTD, segment_ids_BT):
        B, T, D = x_BTD.shape
        q, k, v = jnp.split(self.qkv(x_BTD).reshape(B, T, 3 * self.heads, D // self.heads), 3, axis=2)
        scores_BNQK = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32)
        mask_BQK = jnp.tril(jnp.ones((T, T), bool))[None]
        if segment_ids_BT is not None:
            mask_BQK = mask_BQK & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
        scores_BNQK = jnp.where(mask_BQK[:, None], scores_BNQK / jnp.sqrt(D // self.heads), -1e30)
        probs = jax.nn.softmax(scores_BNQK, axis=-1).astype(v.dtype)
        return self.proj(jnp.einsum("bnqk,bknh->bqnh", probs, v).reshape(B, T, D))


class Block(nnx.Module):
    """Pre-norm GPT-2 block. Positions are unused here (they were added in ``io.embed``)."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.ln1, self.ln2 = LayerNorm(cfg.hidden, cfg.norm_eps), LayerNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.fc = Dense(cfg.hidden, 4 * cfg.hidden, rngs=rngs)
        self.out = Dense(4 * cfg.hidden, cfg.hidden, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT):
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD), segment_ids_BT)
        return x_BTD + self.out(jax.nn.gelu(self.fc(self.ln2(x_BTD)), approximate=True))


class InputOutput(nnx.Module):
    """Token and position embeddings, the final LayerNorm and the (tied or untied) output projection."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        self.wte = nnx.Param(_normal(rngs.params(), (cfg.vocab_size, cfg.hidden), jnp.float32))
        self.wpe = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_positions, cfg.hidden)))
        self.ln_f = LayerNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            _normal(rngs.params(), (cfg.hidden, cfg.vocab_size), jnp.float32))

    def embed(self, tokens_BT, positions_BT, segment_ids_BT):
        x = jnp.take(self.wte[...], tokens_BT, axis=0) + jnp.take(self.wpe[...], positions_BT, axis=0)
        return x.astype(self.dtype)

    def final_hidden(self, x_BTD):
        return self.ln_f(x_BTD.astype(jnp.float32))

    def unembed(self, h_TD):  # float32 logits
        w_DV = self.wte[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.matmul(h_TD.astype(self.dtype), w_DV.astype(self.dtype), preferred_element_type=jnp.float32)


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        key = rngs.params()
        self.io = self.new_io(key)
        self.blocks = nnx.List([self.new_block(i, key) for i in range(cfg.layers)])

    # Each part has its own RNG stream, so a part built alone equals that part of a model built whole.
    def new_io(self, key) -> InputOutput:
        return InputOutput(self.cfg, rngs=nnx.Rngs(params=jax.random.fold_in(key, 0)))

    def new_block(self, index, key) -> Block:  # index may be traced
        return Block(self.cfg, rngs=nnx.Rngs(params=jax.random.fold_in(key, index + 1)))

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
        """Float32 logits [B, T, V]: what the ReferenceTrainer differentiates."""
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        x_BTD = self.io.embed(tokens_BT, positions_BT, segment_ids_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD, positions_BT, segment_ids_BT)
        return self.io.unembed(self.io.final_hidden(x_BTD))


if __name__ == "__main__":
    import itertools

    import numpy as np

    import megatrain_jax as mt
    from megatrain_jax.check import check_model

    cfg = GPT2Config()
    model = GPT2(cfg, rngs=nnx.Rngs(0))
    print(check_model(model))
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 8, 65))  # 4 batches, cycled
    data = itertools.cycle([mt.Batch.from_windows(w) for w in windows])
    mt.fit(model, data, mt.adamw(3e-3), train=mt.TrainConfig(steps=30, log_every=5))
