"""The decoder-only language model, written as the layered contract the engine drives.

``Decoder.io`` holds the token embedding, the final norm and the (possibly tied) output projection;
``Decoder.blocks`` holds N ``Block`` (dense) or ``MoEBlock`` modules, of one kind (sharing one graphdef)
unless ``cfg.layer_types`` mixes sliding-window and full-attention layers or ``cfg.first_k_dense_replace``
keeps the first layers of an MoE model dense. Nothing here knows where parameters live or how they move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.models.layers import MLP, Attention, MLAttention, RMSNorm, _init_normal, logits_matmul
from megatrain_jax.models.moe import MoE, RouterStats, SwitchLoss


def residual(norm_in: RMSNorm | None, norm_out: RMSNorm | None, sublayer, x_BTD: jax.Array, *args) -> jax.Array:
    """``x + norm_out(sublayer(norm_in(x)))``, either norm absent (None) where the block has none there."""
    y_BTD = sublayer(x_BTD if norm_in is None else norm_in(x_BTD), *args)
    return x_BTD + (y_BTD if norm_out is None else norm_out(y_BTD))


class Block(nnx.Module):
    """Transformer block with a dense MLP: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (pre-norm), or
    with ``cfg.norm_placement == "post"`` ``x + norm(attn(x))`` then ``x + norm(mlp(x))`` (OLMo 2), or with
    "sandwich" ``x + norm2(attn(norm1(x)))`` then the same around the MLP (Gemma 3).
    ``kind`` (the contract's kind of block) is ``cfg.block_kind(layer)``: the layer's attention type
    (sliding-window and full-attention layers are two kinds, with their own window and RoPE), and in an MoE
    model with leading dense layers whether it is dense or routed (``MoEBlock``).

    ``attn_norm`` / ``mlp_norm`` are each sublayer's one norm (its input's, or with "post" its output's);
    ``attn_post_norm`` / ``mlp_post_norm`` the output norms a "sandwich" block adds (None otherwise)."""

    def __init__(self, cfg: DecoderConfig, layer: int | jax.Array = 0, *, rngs: nnx.Rngs):
        self.kind = cfg.block_kind(layer)
        self.mlp_chunk_tokens = cfg.mlp_chunk_tokens
        self.norm_placement = cfg.norm_placement
        sandwich = cfg.norm_placement == "sandwich"
        norm = lambda: RMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_unit_offset)  # noqa: E731
        self.attn_norm = norm()
        self.attn_post_norm = norm() if sandwich else None
        attention = Attention if cfg.mla is None else MLAttention  # DeepSeek-V3: multi-head latent attention
        self.attn = attention(cfg, layer_type=cfg.layer_type(layer), rngs=rngs)
        self.mlp_norm = norm()
        self.mlp_post_norm = norm() if sandwich else None
        self.mlp = self.new_mlp(cfg, rngs)

    def new_mlp(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MLP(cfg.hidden, cfg.ffn, activation=cfg.mlp_activation, rngs=rngs)

    def _around(self, norm: RMSNorm, post_norm: RMSNorm | None) -> tuple[RMSNorm | None, RMSNorm | None]:
        """A sublayer's (input norm, output norm) as the placement puts them."""
        if self.norm_placement == "pre":
            return norm, None
        if self.norm_placement == "post":
            return None, norm
        return norm, post_norm

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        return self._mlp_residual(self._attn_residual(x_BTD, positions_BT, segment_ids_BT))

    def _attn_residual(self, x_BTD: jax.Array, positions_BT: jax.Array,
                       segment_ids_BT: jax.Array | None) -> jax.Array:
        return residual(*self._around(self.attn_norm, self.attn_post_norm), self.attn, x_BTD, positions_BT,
                        segment_ids_BT)

    def _mlp_residual(self, x_BTD: jax.Array) -> jax.Array:
        """``x + mlp(norm(x))`` (post-norm: ``x + norm(mlp(x))``; sandwich: both), over ``mlp_chunk_tokens``
        tokens at a time when set: a ``lax.map`` over token chunks whose body is rematerialized, so the backward
        pass keeps each chunk's input only and recomputes its [chunk, ffn] activations. Padding tokens (zeros)
        fill the last chunk and are cut."""
        chunk = self.mlp_chunk_tokens
        B, T, D = x_BTD.shape
        if chunk is None or B * T <= chunk:
            return residual(*self._around(self.mlp_norm, self.mlp_post_norm), self.mlp, x_BTD)
        graphdef, state = nnx.split((self._around(self.mlp_norm, self.mlp_post_norm), self.mlp))

        @jax.checkpoint
        def one(state, x_CD):
            (norm_in, norm_out), mlp = nnx.merge(graphdef, state)
            return residual(norm_in, norm_out, mlp, x_CD)

        n = -(-(B * T) // chunk)
        x_ND = jnp.pad(x_BTD.reshape(B * T, D), ((0, n * chunk - B * T), (0, 0)))
        y = jax.lax.map(lambda x_CD: one(state, x_CD), x_ND.reshape(n, chunk, D))
        return y.reshape(n * chunk, D)[:B * T].reshape(B, T, D)


class MoEBlock(Block):
    """A block whose MLP is a mixture of experts (``cfg.moe``). Its ``routed`` also returns the router's
    statistics, which the model's ``aux_loss`` takes summed over the routed blocks (docs/model_contract.md):
    having ``routed`` is what makes a kind of block routed."""

    def new_mlp(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoE(cfg.hidden, cfg.moe, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """The block's output alone (its router's statistics dropped: see ``routed``)."""
        return self.routed(x_BTD, positions_BT, segment_ids_BT)[0]

    def routed(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
        """The block's output, and its router's statistics."""
        x_BTD = self._attn_residual(x_BTD, positions_BT, segment_ids_BT)
        norm_in, norm_out = self._around(self.mlp_norm, self.mlp_post_norm)
        y_BTD, stats = self.mlp(x_BTD if norm_in is None else norm_in(x_BTD))
        return x_BTD + (y_BTD if norm_out is None else norm_out(y_BTD)), stats


class InputOutput(nnx.Module):
    """The embedding and the head: ``embed`` maps tokens to hidden states, ``final_hidden`` applies the
    final norm, ``unembed`` maps normalized hidden states to float32 logits. ``embed`` takes positions and
    segment ids as the contract requires, and ignores them: RoPE is applied inside the blocks."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(_init_normal(rngs.params(), (cfg.vocab_size, cfg.hidden), jnp.float32))
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_unit_offset)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            _init_normal(rngs.params(), (cfg.hidden, cfg.vocab_size), jnp.float32))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def embed(self, tokens_BT: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None) -> jax.Array:
        del positions_BT, segment_ids_BT  # positions enter through RoPE in the attention of each block
        x_BTD = jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.compute_dtype)
        if self.cfg.scale_embeddings:  # sqrt(hidden) rounded to the compute dtype, as transformers' Gemma does
            x_BTD = x_BTD * jnp.asarray(self.cfg.hidden ** 0.5, self.compute_dtype)
        return x_BTD

    def final_hidden(self, x_BTD: jax.Array) -> jax.Array:
        return self.final_norm(x_BTD.astype(jnp.float32))

    def unembed(self, h_TD: jax.Array) -> jax.Array:
        w_DV = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        logits_TV = logits_matmul(h_TD, w_DV, self.compute_dtype)
        cap = self.cfg.final_logit_softcap
        return logits_TV if cap is None else cap * jnp.tanh(logits_TV / cap)


def part_rngs(key: jax.Array, part: int) -> nnx.Rngs:
    """Independent RNG stream of one part (0 for the io part, i + 1 for block i): any part can be
    initialized alone, in any order, and equals the part of a model built whole."""
    return nnx.Rngs(params=jax.random.fold_in(key, part))


class Decoder(nnx.Module):
    """Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, OLMo 2, Gemma 3 by config; the MoE
    families; DeepSeek-V3 / Kimi K2 with multi-head latent attention; GPT-OSS with attention sinks)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # the load-balancing loss of the blocks' summed router statistics (the contract's aux_loss)
        self.aux_loss = (SwitchLoss(cfg.moe.aux_loss_coef, cfg.moe.experts)
                         if cfg.moe is not None and cfg.moe.aux_loss_coef > 0 else None)
        key = rngs.params()
        self.io = self.new_io(key)
        self.blocks = nnx.List([self.new_block(i, key) for i in range(cfg.layers)])

    def new_io(self, key: jax.Array) -> InputOutput:
        return InputOutput(self.cfg, rngs=part_rngs(key, 0))

    def new_block(self, index: int, key: jax.Array) -> Block:
        """Block ``index`` (traced where the blocks are of one kind: ``cfg.block_kind`` and
        ``cfg.is_moe_layer`` then do not read it): an ``MoEBlock`` where ``cfg.is_moe_layer(index)``."""
        block = MoEBlock if self.cfg.is_moe_layer(index) else Block
        return block(self.cfg, index, rngs=part_rngs(key, index + 1))

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """Float32 logits [B, T, V] (materialized whole: for tests and small models). The training loss
        adds ``aux_loss`` of the blocks' router statistics (``megatrain_jax.reference.model_loss``)."""
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        x_BTD = self.io.embed(tokens_BT, positions_BT, segment_ids_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD, positions_BT, segment_ids_BT)
        return self.io.unembed(self.io.final_hidden(x_BTD))
