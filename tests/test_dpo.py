"""Preference training (DPO, ``megatrain_jax.loss.DPO``): the loss against TRL's formula written out here in
numpy, each row's log-probability as the head computes it, the reference pass, and the streamed engine against
the in-memory reference over three steps (micro-batches, accumulation, clipping)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import DPO, Batch, Decoder, Engine, EngineConfig, ReferenceTrainer
from megatrain_jax.contract.layered import io_params, layered
from megatrain_jax.loss import token_nll

from test_engine import ADAMW, TINY3, assert_models_close

CFG = TINY3.replace(loss_chunk_tokens=5)  # chunks that do not divide a row: the head's per-row sums cross them


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def trl_sigmoid_loss(policy_c, policy_r, ref_c, ref_r, beta, label_smoothing):
    """TRL's DPOTrainer, loss_type "sigmoid": logits = (pi_c - pi_r) - (ref_c - ref_r); losses =
    -logsigmoid(beta logits) (1 - ls) - logsigmoid(-beta logits) ls; rewards beta (pi - ref)."""
    logits = (policy_c - policy_r) - (ref_c - ref_r)
    losses = -_log_sigmoid(beta * logits) * (1 - label_smoothing) - _log_sigmoid(-beta * logits) * label_smoothing
    return losses, beta * (policy_c - ref_c), beta * (policy_r - ref_r)


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)])
def test_dpo_loss_is_trls_sigmoid_loss(beta, ls):
    rng = np.random.default_rng(0)
    logps, ref = (rng.normal(-40, 15, 12).astype(np.float32) for _ in range(2))
    losses, chosen, rejected = DPO(beta, ls).pair_terms(jnp.asarray(logps), jnp.asarray(ref))
    want = trl_sigmoid_loss(logps[0::2].astype(np.float64), logps[1::2].astype(np.float64),
                            ref[0::2].astype(np.float64), ref[1::2].astype(np.float64), beta, ls)
    for got, expected in zip((losses, chosen, rejected), want):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=1e-5)
    stats = np.asarray(DPO.stats(chosen, rejected))
    assert stats[3] == 6 and stats[2] == np.sum(want[1] > want[2])


@pytest.mark.parametrize("bad", [dict(beta=0), dict(beta=-1.0), dict(beta=True), dict(label_smoothing=0.5),
                                 dict(label_smoothing=-0.1)])
def test_dpo_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="beta must be|label_smoothing must lie"):
        DPO(**bad)


def pairs(n_pairs, seq=16, vocab=256, seed=0):
    """``n_pairs`` (chosen, rejected) rows: a shared prompt of 6 tokens, then each its own response; the
    loss mask marks the response's targets, the last pair's rejected response shorter (padding after it)."""
    rng = np.random.default_rng(seed)
    rows, mask = [], []
    for i in range(n_pairs):
        prompt = rng.integers(0, vocab, 6)
        for r in range(2):
            rows.append(np.concatenate([prompt, rng.integers(0, vocab, seq + 1 - 6)]))
            m = np.zeros(seq, np.float32)
            m[5:] = 1.0  # targets from the prompt's last token on: the response's tokens
            if i == n_pairs - 1 and r == 1:
                m[12:] = 0.0
            mask.append(m)
    w = np.stack(rows)
    return Batch(w[:, :-1], w[:, 1:], loss_mask=np.stack(mask))


def whole_model_logps(model, batch):
    """Each row's summed log-probability of its masked targets, from the whole model's logits."""
    logits = model(batch.inputs)
    return -np.asarray(jnp.sum(token_nll(logits, batch.targets) * batch.loss_mask, axis=-1))


def test_the_head_sums_each_rows_log_probability_across_loss_chunks():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    batch = pairs(2).filled()
    lm = layered(model)
    x = model.io.embed(batch.inputs, batch.positions, None)
    for block in model.blocks:
        x = block(x, batch.positions, None)
    got = -np.asarray(lm.head_row_nll(io_params(model), x, batch.targets, batch.loss_mask))
    np.testing.assert_allclose(got, whole_model_logps(model, batch), rtol=1e-5)


def with_ref(batches, logps):
    out, at = [], 0
    for b in batches:
        n = b.shape[0]
        out.append(Batch(b.inputs, b.targets, loss_mask=b.loss_mask, ref_logps=logps[at:at + n]))
        at += n
    return out


LAYOUTS = [(EngineConfig(clip_norm=0.05), 1), (EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=None), 1),
           (EngineConfig(resident_layers=1, resident_io=True, clip_norm=0.05), 1),
           (EngineConfig(micro_batches=2, clip_norm=0.05), 2)]


@pytest.mark.parametrize("engine_cfg,n_devices", LAYOUTS, ids=["clip", "micro-accumulate", "resident", "two-devices"])
def test_engine_dpo_equals_the_in_memory_reference(engine_cfg, n_devices):
    """The reference pass (``Engine.row_logps`` on the untrained model) gives the whole model's per-row
    log-probabilities; three steps of DPO then train the streamed engine as the in-memory reference trains
    (loss, norm, parameters), and the first step's loss is log 2 with zero rewards (policy = reference). Over
    two devices each holds whole pairs of each micro-batch."""
    objective = DPO(beta=0.5, label_smoothing=0.1)
    k = engine_cfg.accumulate_steps
    raw = [pairs(2 * n_devices, seed=s) for s in range(3 * k)]
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), ADAMW(), engine_cfg, objective=objective,
                    devices=jax.devices()[:n_devices])
    ref_logps = engine.row_logps(raw)
    np.testing.assert_allclose(ref_logps, np.concatenate([whole_model_logps(Decoder(CFG, rngs=nnx.Rngs(0)), b)
                                                          for b in raw]), rtol=1e-5)
    batches = with_ref(raw, ref_logps)
    reference = ReferenceTrainer(Decoder(CFG, rngs=nnx.Rngs(0)), ADAMW(), clip_norm=engine_cfg.clip_norm,
                                 objective=objective)
    for s in range(3):
        group = batches[s * k:(s + 1) * k]
        r = reference.step(group)
        e = engine.step(group).resolve()
        assert abs(e["loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (s, e, r)
        assert abs(e["grad_norm"] - r["grad_norm"]) <= 1e-4 * r["grad_norm"], (s, e, r)
        if s == 0:
            assert e["loss"] == pytest.approx(np.log(2.0), rel=1e-5)
            assert e["rewards_chosen"] == 0.0 and e["rewards_rejected"] == 0.0 and e["rewards_accuracy"] == 0.0
        assert 0.0 <= e["rewards_accuracy"] <= 1.0
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    engine.write_back(model)
    assert_models_close(reference.model, model)


def test_dpo_learns_to_prefer_the_chosen_responses():
    """Twenty steps on the same pairs: the loss falls below log 2 and the chosen rewards pass the rejected."""
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), optax.adamw(3e-3), EngineConfig(), objective=DPO(beta=0.5))
    raw = [pairs(2, seed=s) for s in range(2)]
    batches = with_ref(raw, engine.row_logps(raw))
    for s in range(20):
        m = engine.step(batches[s % 2]).resolve()
    assert m["loss"] < 0.5 * np.log(2.0) and m["rewards_accuracy"] == 1.0 and m["rewards_margin"] > 0


def test_a_preference_batch_that_cannot_train_is_refused_before_the_step():
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(micro_batches=2), objective=DPO())
    good = with_ref([pairs(2)], np.zeros(4, np.float32))[0]
    with pytest.raises(ValueError, match="whole pairs: 4 rows give 1 per micro-batch; use a batch size divisible by 8"):
        Engine(Decoder(CFG, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(micro_batches=4),
               objective=DPO()).step(good)
    with pytest.raises(ValueError, match="needs each row's reference log-probability"):
        engine.step(Batch(good.inputs, good.targets, loss_mask=good.loss_mask))
    mask = good.loss_mask.copy()
    mask[3] = 0.0
    with pytest.raises(ValueError, match="row 3 of a preference batch has no response token"):
        engine.step(Batch(good.inputs, good.targets, loss_mask=mask, ref_logps=good.ref_logps))
    with pytest.raises(ValueError, match="ref_logps .* has shape \\(3,\\)"):
        engine.step(Batch(good.inputs, good.targets, loss_mask=good.loss_mask, ref_logps=np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="objective must be"):
        Engine(Decoder(CFG, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(), objective="dpo")
    assert int(engine.state.step) == 0  # nothing trained
