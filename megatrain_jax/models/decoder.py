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
from megatrain_jax.models.layers import MLP, Attention, RMSNorm, _init_normal
from megatrain_jax.models.moe import MoE, RouterStats, SwitchLoss


def residual(norm: RMSNorm, sublayer, x_BTD: jax.Array, placement: str, *args) -> jax.Array:
    """``x + sublayer(norm(x))`` (``placement`` "pre") or ``x + norm(sublayer(x))`` ("post", OLMo 2)."""
    if placement == "pre":
        return x_BTD + sublayer(norm(x_BTD), *args)
    return x_BTD + norm(sublayer(x_BTD, *args))


class Block(nnx.Module):
    """Transformer block with a dense MLP: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (pre-norm), or
    with ``cfg.norm_placement == "post"`` ``x + norm(attn(x))`` then ``x + norm(mlp(x))`` (OLMo 2).
    ``kind`` (the contract's kind of block) is ``cfg.block_kind(layer)``: the layer's attention type
    (sliding-window and full-attention layers are two kinds), and in an MoE model with leading dense layers
    whether it is dense or routed (``MoEBlock``)."""

    def __init__(self, cfg: DecoderConfig, layer: int | jax.Array = 0, *, rngs: nnx.Rngs):
        self.kind = cfg.block_kind(layer)
        self.mlp_chunk_tokens = cfg.mlp_chunk_tokens
        self.norm_placement = cfg.norm_placement
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, layer_type=cfg.layer_type(layer), rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = self.new_mlp(cfg, rngs)

    def new_mlp(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MLP(cfg.hidden, cfg.ffn, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        return self._mlp_residual(self._attn_residual(x_BTD, positions_BT, segment_ids_BT))

    def _attn_residual(self, x_BTD: jax.Array, positions_BT: jax.Array,
                       segment_ids_BT: jax.Array | None) -> jax.Array:
        return residual(self.attn_norm, self.attn, x_BTD, self.norm_placement, positions_BT, segment_ids_BT)

    def _mlp_residual(self, x_BTD: jax.Array) -> jax.Array:
        """``x + mlp(norm(x))`` (post-norm: ``x + norm(mlp(x))``), over ``mlp_chunk_tokens`` tokens at a time
        when set: a ``lax.map`` over token chunks whose body is rematerialized, so the backward pass keeps each
        chunk's input only and recomputes its [chunk, ffn] activations. Padding tokens (zeros) fill the last
        chunk and are cut."""
        chunk = self.mlp_chunk_tokens
        B, T, D = x_BTD.shape
        if chunk is None or B * T <= chunk:
            return residual(self.mlp_norm, self.mlp, x_BTD, self.norm_placement)
        graphdef, state = nnx.split((self.mlp_norm, self.mlp))
        placement = self.norm_placement

        @jax.checkpoint
        def one(state, x_CD):
            norm, mlp = nnx.merge(graphdef, state)
            return residual(norm, mlp, x_CD, placement)

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
        if self.norm_placement == "pre":
            y_BTD, stats = self.mlp(self.mlp_norm(x_BTD))
            return x_BTD + y_BTD, stats
        y_BTD, stats = self.mlp(x_BTD)
        return x_BTD + self.mlp_norm(y_BTD), stats


class InputOutput(nnx.Module):
    """The embedding and the head: ``embed`` maps tokens to hidden states, ``final_hidden`` applies the
    final norm, ``unembed`` maps normalized hidden states to float32 logits. ``embed`` takes positions and
    segment ids as the contract requires, and ignores them: RoPE is applied inside the blocks."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(_init_normal(rngs.params(), (cfg.vocab_size, cfg.hidden), jnp.float32))
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            _init_normal(rngs.params(), (cfg.hidden, cfg.vocab_size), jnp.float32))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def embed(self, tokens_BT: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None) -> jax.Array:
        del positions_BT, segment_ids_BT  # positions enter through RoPE in the attention of each block
        return jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.compute_dtype)

    def final_hidden(self, x_BTD: jax.Array) -> jax.Array:
        return self.final_norm(x_BTD.astype(jnp.float32))

    def unembed(self, h_TD: jax.Array) -> jax.Array:
        w_DV = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        dt = self.compute_dtype
        return jnp.matmul(h_TD.astype(dt), w_DV.astype(dt), preferred_element_type=jnp.float32)


def part_rngs(key: jax.Array, part: int) -> nnx.Rngs:
    """Independent RNG stream of one part (0 for the io part, i + 1 for block i): any part can be
    initialized alone, in any order, and equals the part of a model built whole."""
    return nnx.Rngs(params=jax.random.fold_in(key, part))


class Decoder(nnx.Module):
    """Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, OLMo 2 by config)."""

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
