"""The in-memory reference trainer (ground truth for the engine), its batch checks, and the chunked loss."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax.batch import Batch
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.loss import chunked_nll_sum, token_nll
from megatrain_jax.reference import ReferenceTrainer


def params_of(trainer: ReferenceTrainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]


# ---------------------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------------------

def test_reference_trainer_lowers_the_loss(tiny_cfg, build_model, tokens):
    """30 AdamW steps on one repeated batch memorize it: the trainer's gradient, optimizer wiring and
    write-back into the model all work (a sign error or a lost update would not halve the loss)."""
    model = build_model(tiny_cfg, random_params=False)
    trainer = ReferenceTrainer(model, optax.adamw(1e-2), clip_norm=1.0)
    batch = Batch.from_windows(tokens(4, 17, tiny_cfg.vocab_size))
    losses = [trainer.step(batch)["loss"] for _ in range(30)]
    assert abs(losses[0] - np.log(tiny_cfg.vocab_size)) < 0.1  # near-uniform logits at initialization
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    # The trained weights were written back into the user's model.
    for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(trainer.params)):
        np.testing.assert_array_equal(got, want)


def test_accumulation_equals_one_step_on_the_concatenated_batch(tiny_cfg, build_model, tokens):
    """With full loss masks and equal-sized batches, the mean of the per-batch mean losses is the mean
    over the concatenation, so accumulating 2 batches must equal one step on both at once."""
    windows = tokens(4, 13, tiny_cfg.vocab_size, seed=3)
    whole = Batch.from_windows(windows)
    halves = [Batch.from_windows(windows[:2]), Batch.from_windows(windows[2:])]
    # SGD: the update is proportional to the gradient, so any error in averaging shows in the weights.
    # No clipping: it is scale-invariant and would hide a sum-instead-of-mean error in the weights.
    accumulated = ReferenceTrainer(build_model(tiny_cfg, seed=7), optax.sgd(0.1), clip_norm=None)
    single = ReferenceTrainer(build_model(tiny_cfg, seed=7), optax.sgd(0.1), clip_norm=None)
    before = params_of(single)
    for _ in range(2):
        logs_acc, logs_one = accumulated.step(halves), single.step(whole)
        np.testing.assert_allclose(logs_acc["loss"], logs_one["loss"], rtol=1e-5)
        np.testing.assert_allclose(logs_acc["grad_norm"], logs_one["grad_norm"], rtol=1e-5)
    for a, b, b0 in zip(params_of(accumulated), params_of(single), before):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(b, b0) for b, b0 in zip(params_of(single), before))  # it did train


def test_default_clipping_matches_the_engine(tiny_cfg, build_model, tokens):
    """Both trainers clip at 1.0 by default (issue 13): with the defaults, a step whose gradient norm is
    above 1 moves the weights as explicit clip_norm=1.0 does, and not as no clipping does."""
    default = inspect.signature(ReferenceTrainer).parameters["clip_norm"].default
    assert default == EngineConfig().clip_norm == 1.0
    batch = Batch.from_windows(tokens(4, 13, tiny_cfg.vocab_size, seed=5))
    runs = {}
    for name, kw in {"default": {}, "clip 1.0": {"clip_norm": 1.0}, "no clip": {"clip_norm": None}}.items():
        trainer = ReferenceTrainer(build_model(tiny_cfg, seed=7), optax.sgd(1.0), **kw)
        logs = trainer.step(batch)
        runs[name] = params_of(trainer)
    assert logs["grad_norm"] > 1.0  # so that clipping at 1.0 changes the update
    for a, b in zip(runs["default"], runs["clip 1.0"]):
        np.testing.assert_array_equal(a, b)
    assert any(not np.allclose(a, b) for a, b in zip(runs["default"], runs["no clip"]))


@pytest.mark.parametrize("clip_norm", [0.0, -1.0])
def test_clip_norm_must_be_positive_or_none(clip_norm, tiny_cfg, build_model):
    with pytest.raises(ValueError, match="clip_norm must be positive or None"):
        ReferenceTrainer(build_model(tiny_cfg), optax.sgd(0.1), clip_norm=clip_norm)


# ---------------------------------------------------------------------------------------------------
# Bad batches are rejected on the host, with the value and the fix, before anything is updated.
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def trainer(tiny_cfg, build_model):
    return ReferenceTrainer(build_model(tiny_cfg), optax.sgd(0.1))


@pytest.mark.parametrize("field", ["inputs", "targets"])
def test_token_id_outside_vocab(field, trainer, tiny_cfg, tokens):
    """A tokenizer/model vocabulary mismatch names the bad id and the vocabulary size."""
    inputs, targets = tokens(2, 8, tiny_cfg.vocab_size), tokens(2, 8, tiny_cfg.vocab_size, seed=1)
    bad = {"inputs": inputs, "targets": targets}
    bad[field] = bad[field].copy()
    bad[field][1, 3] = tiny_cfg.vocab_size + 5
    before = params_of(trainer)
    with pytest.raises(ValueError, match=rf"token id {tiny_cfg.vocab_size + 5} in batch {field}.*"
                                         rf"\[0, {tiny_cfg.vocab_size}\)"):
        trainer.step(Batch(**bad))
    for a, b in zip(params_of(trainer), before):
        np.testing.assert_array_equal(a, b)


def test_negative_token_id(trainer, tiny_cfg, tokens):
    inputs = tokens(2, 8, tiny_cfg.vocab_size)
    inputs[0, 0] = -1
    with pytest.raises(ValueError, match=r"token id -1 in batch inputs"):
        trainer.step(Batch(inputs, tokens(2, 8, tiny_cfg.vocab_size)))


def test_sequence_longer_than_max_positions(trainer, tiny_cfg, tokens):
    """RoPE past max_positions is untrained territory: the trainer refuses instead of extrapolating."""
    T = tiny_cfg.max_positions + 1
    with pytest.raises(ValueError, match=rf"positions reach {T} .*max_positions={tiny_cfg.max_positions}"):
        trainer.step(Batch.from_windows(tokens(1, T + 1, tiny_cfg.vocab_size)))


def test_explicit_positions_beyond_max_positions(trainer, tiny_cfg, tokens):
    """Explicit positions (e.g. a later window of a long document) are checked, not just the length."""
    toks = tokens(1, 8, tiny_cfg.vocab_size)
    positions = np.arange(tiny_cfg.max_positions - 4, tiny_cfg.max_positions + 4)[None]
    with pytest.raises(ValueError, match=rf"max_positions={tiny_cfg.max_positions}"):
        trainer.step(Batch(toks, toks, positions=positions))


# ---------------------------------------------------------------------------------------------------
# The chunked loss that keeps [tokens, vocab] logits from existing at once.
# ---------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=4)
def _chunked(h, w, targets, mask, chunk):
    return chunked_nll_sum(lambda x: x @ w, h, targets, mask, chunk)


@jax.jit
def _plain(h, w, targets, mask):
    return jnp.sum(token_nll(h @ w, targets) * mask)


@pytest.mark.parametrize("chunk", [1, 4, 5, 12, 50])
def test_chunked_nll_sum_equals_plain_sum(chunk):
    """Chunks that divide T (1, 4, 12), that do not (5: padded tail) and larger than T (50) give the
    plain masked NLL sum, and the same gradients for the hidden states and the head weights."""
    T, D, V = 12, 8, 11
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, T), jnp.float32).at[-1].set(1.0)  # the padded tail's neighbour counts
    want, want_grads = jax.value_and_grad(_plain, argnums=(0, 1))(h, w, targets, mask)
    got, got_grads = jax.value_and_grad(_chunked, argnums=(0, 1))(h, w, targets, mask, chunk)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, wg in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-6)
    assert float(want) != pytest.approx(float(_plain(h, w, targets, jnp.ones(T))))  # the mask matters


def _dots(jaxpr) -> int:
    """The matrix products in a jaxpr, those inside a scan's body counted once per iteration."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        n += times * sum(_dots(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
    return n


def test_chunked_nll_sum_makes_each_chunks_logits_once():
    """Differentiated, the loss's head takes three products a chunk (the logits, then the hidden states' and the
    weight's gradients), not four: the logits are not made again in the backward. Not differentiated, one."""
    T, D, V, chunk = 12, 8, 11, 4
    h, w = jnp.ones((T, D)), jnp.ones((D, V))
    targets, mask = jnp.zeros(T, jnp.int32), jnp.ones(T)
    loss = lambda h, w: chunked_nll_sum(lambda x: x @ w, h, targets, mask, chunk)  # noqa: E731
    assert _dots(jax.make_jaxpr(loss)(h, w).jaxpr) == T // chunk
    assert _dots(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(h, w).jaxpr) == 3 * T // chunk


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_nll_sum_through_the_models_head_matches_the_checkpointed_scan(dtype):
    """The fused gradient through the models' own head (``logits_matmul`` in the compute dtype, a final logit
    softcap, the loss scaled as the engine scales it) against the chunks differentiated as written with their
    logits recomputed (the form it replaced)."""
    from megatrain_jax.loss import chunked_token_nll
    from megatrain_jax.models.layers import logits_matmul

    T, D, V, chunk, cap = 20, 16, 40, 8, 30.0
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, T), jnp.float32).at[0].set(1.0)

    def head(w):
        return lambda x: cap * jnp.tanh(logits_matmul(x, w, jnp.dtype(dtype)) / cap)

    def fused(h, w):
        return chunked_nll_sum(head(w), h, targets, mask, chunk) / 7.0

    def checkpointed(h, w):
        return jnp.sum(chunked_token_nll(head(w), h, targets, chunk) * mask) / 7.0

    got, got_g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
    want, want_g = jax.jit(jax.value_and_grad(checkpointed, argnums=(0, 1)))(h, w)
    assert float(got) == float(want)  # the same forward
    tol = 1e-5 if dtype == "float32" else 1e-2  # bfloat16: the cotangent rounded before or after the 1/7
    for g, wg in zip(got_g, want_g):
        assert g.dtype == wg.dtype
        np.testing.assert_allclose(g, wg, rtol=tol, atol=tol * float(jnp.max(jnp.abs(wg))))
