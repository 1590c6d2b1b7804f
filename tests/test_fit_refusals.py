"""What ``fit``, ``evaluate`` and their batches refuse, and say, when a user gets something wrong: token ids out of
the vocabulary (named with their place, never wrapped), masks and positions no model can use, arguments of the wrong
kind (found before the model loads), learning rates that climb the loss, data that runs out before the run does, and
evaluation sets with nothing to score."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import (Batch, Decoder, Engine, EngineConfig, Hook, TrainConfig, check_model, default_optimizer,
                           eval_hook, evaluate, fit, preset)
from megatrain_jax.batch import check_batch
from megatrain_jax.data import DataConfig

CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
ENGINE = EngineConfig(micro_batches=2)
V = CFG.vocab_size


def batches(n: int) -> list[Batch]:
    data = DataConfig(seq_len=16, batch_size=2, seed=3, prefetch=0, demo_tokens=1 << 14).build(V)
    return list(itertools.islice(data, n))


def train(stream, steps, *, engine=ENGINE, optimizer=None, **kw):
    return fit(Decoder(CFG, rngs=nnx.Rngs(0)), stream, optimizer or default_optimizer(1e-3), engine=engine,
               train=TrainConfig(steps=steps, log_every=0), **kw)


def abstract():
    return nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))


# ------------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("bad", [V, V + 100, -1])
def test_a_token_id_outside_the_vocabulary_is_refused_with_its_place(bad):
    b = batches(1)[0]
    inputs = b.inputs.copy()
    inputs[1, 7] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} in batch inputs is outside the model's vocabulary "
                                         rf"\[0, {V}\) \(row 1, column 7\)"):
        check_batch(Batch(inputs, b.targets), V)
    targets = b.targets.copy()
    targets[0, 3] = targets[1, 2] = bad
    with pytest.raises(ValueError, match=r"in batch targets .*\(row 0, column 3; 2 such values in the batch\)"):
        check_batch(Batch(b.inputs, targets), V)


def test_float_token_ids_are_refused_saying_how_to_give_them():
    b = batches(1)[0]
    with pytest.raises(ValueError, match=r"integer token ids, got dtype float32; .*np.asarray\(ids, np.int32\)"):
        check_batch(Batch(b.inputs.astype(np.float32), b.targets), V)


@pytest.mark.parametrize("shape", [(2, 0), (0, 16)])
def test_a_batch_without_tokens_is_refused(shape):
    """A batch of rows of no token reached the loss and failed there (a division by zero inside the step)."""
    empty = np.zeros(shape, np.int32)
    with pytest.raises(ValueError, match="hold no token"):
        check_batch(Batch(empty, empty), V)


@pytest.mark.parametrize("value", [-1.0, np.nan, np.inf])
def test_a_loss_mask_with_a_negative_or_non_finite_weight_is_refused(value):
    """A negative weight climbs the loss (a run 'trained' to a loss of -155), a NaN one makes it NaN."""
    b = batches(1)[0]
    mask = np.ones(b.shape, np.float32)
    mask[1, 4] = value
    with pytest.raises(ValueError, match=r"loss_mask holds .* \(row 1, column 4\): .* finite number >= 0"):
        check_batch(Batch(b.inputs, b.targets, loss_mask=mask), V)
    check_batch(Batch(b.inputs, b.targets, loss_mask=mask != 1), V)  # a boolean mask is fine


def test_negative_or_fractional_positions_are_refused():
    b = batches(1)[0]
    ramp = np.broadcast_to(np.arange(16), b.shape)
    with pytest.raises(ValueError, match=r"positions hold -3 \(row 0, column 0; 6 such values"):
        check_batch(Batch(b.inputs, b.targets, positions=ramp - 3), V)
    with pytest.raises(ValueError, match="positions must be integers"):
        check_batch(Batch(b.inputs, b.targets, positions=ramp + 0.5), V)


def test_a_batch_of_python_lists_trains_like_arrays():
    """Batch(inputs, targets) given nested lists failed with "'list' object has no attribute 'shape'"."""
    b = batches(2)
    as_lists = [Batch(x.inputs.tolist(), x.targets.tolist()) for x in b]
    assert as_lists[0].shape == (2, 16) and as_lists[0].tokens == 32
    assert train(as_lists, 2)["loss"] == train(b, 2)["loss"]


def test_fit_refuses_a_batch_with_no_token_in_its_loss():
    """All-zero loss masks trained with a loss of 0.0, the optimizer stepping on weight decay alone."""
    b = batches(2)
    silent = Batch(b[1].inputs, b[1].targets, loss_mask=np.zeros(b[1].shape, np.float32))
    with pytest.raises(ValueError, match=r"no token in its loss \(its loss_mask is all zero\)") as err:
        train([b[0], silent], 2)
    assert err.value.history["step"] == [1]  # the step before it trained and was reported


# ------------------------------------------------------------------------------------------ arguments
def test_arguments_of_the_wrong_kind_are_refused_before_the_model_loads():
    b = batches(2)
    with pytest.raises(TypeError, match="third argument is the optimizer.*got TrainConfig: pass it by name, train="):
        fit(abstract(), b, TrainConfig(steps=2))
    with pytest.raises(TypeError, match=r"engine= takes an EngineConfig \(how a step runs\), got TrainConfig"):
        fit(abstract(), b, engine=TrainConfig(steps=2))
    with pytest.raises(TypeError, match="train= takes a TrainConfig"):
        fit(abstract(), b, train=None)
    with pytest.raises(TypeError, match=r"data is an iterable of Batch.*got Batch; .*itertools.repeat\(batch, steps\)"):
        fit(abstract(), b[0], train=TrainConfig(steps=2))


def test_hooks_that_are_not_hooks_are_refused_before_training():
    """A plain function as a hook trained every step, then failed (no attribute 'every') when reporting the first."""
    with pytest.raises(TypeError, match=r"must be a megatrain_jax.Hook, got function: wrap a function as Hook\(fn"):
        fit(abstract(), batches(2), hooks=[lambda m, info: None], train=TrainConfig(steps=2))
    with pytest.raises(TypeError, match=r"hooks=\[hook\]"):
        fit(abstract(), batches(2), hooks=Hook(lambda m, info: None), train=TrainConfig(steps=2))


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_hook_runs_every_whole_number_of_steps(every):
    """every=0 failed with a ZeroDivisionError once the first step's metrics came."""
    with pytest.raises(ValueError, match="every must be a whole number of steps >= 1"):
        Hook(lambda m, info: None, every=every)
    with pytest.raises(TypeError, match="takes a function"):
        Hook("print")


@pytest.mark.parametrize("field, value", [("steps", 2.5), ("steps", 100.0), ("steps", "5"), ("steps", True),
                                          ("log_every", 1.5), ("checkpoint_every", 0.5), ("checkpoint_keep", 2.0),
                                          ("profile_step", "3"), ("devices", True)])
def test_step_counts_must_be_whole_numbers(field, value):
    with pytest.raises(ValueError, match=f"{field} .*got {value!r}"):
        TrainConfig(**{field: value})


# ------------------------------------------------------------------------------------------ learning rate
@pytest.mark.parametrize("optimizer, at", [
    (default_optimizer(-1e-3), 0), (default_optimizer(float("nan")), 0),
    (optax.adamw(lambda k: 1e-3 if k < 60 else -1e-3), 60), (optax.adamw(-1e-3), 0), (optax.sgd(float("nan")), 0)])
def test_a_negative_or_nan_learning_rate_is_refused_before_the_model_loads(optimizer, at):
    """default_optimizer(-1e-3) trained on, climbing the loss; a plain optax optimizer's constant negative rate was
    not even found (its one ``optax.scale`` is then positive: ``optim.learning_rate_of``)."""
    with pytest.raises(ValueError, match=f"learning rate at step {at} is .*: it must be a finite number >= 0"):
        fit(abstract(), batches(2), optimizer, train=TrainConfig(steps=100))


def test_a_warmup_longer_than_the_run_is_warned_about():
    rising = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)
    with pytest.warns(UserWarning, match=r"still rising at the run's last step .*TrainConfig\(steps=2\)"):
        train(batches(2), 2, optimizer=optax.adamw(rising))
    with warnings.catch_warnings(record=True) as seen:  # a warmup that ends within the run: no warning
        warnings.simplefilter("always")
        train(batches(2), 2, optimizer=optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 1, 2)))
    assert not [w for w in seen if "still rising" in str(w.message)]


# ------------------------------------------------------------------------------------------ data ending early
def test_data_that_runs_out_before_the_steps_asked_for_is_warned_about():
    """It ended silently: a history of 2 steps for steps=5, with nothing saying why."""
    with pytest.warns(UserWarning, match=r"the data ran out at step 2 of the 5 asked for"):
        h = train(batches(2), 5)
    assert h["step"] == [1, 2]
    with pytest.warns(UserWarning, match="the data gave no batch, so nothing was trained"):
        fit(Decoder(CFG, rngs=nnx.Rngs(0)), iter([]), engine=ENGINE, train=TrainConfig(log_every=0))


def test_data_ending_in_the_middle_of_a_step_says_what_was_left():
    acc = EngineConfig(micro_batches=2, accumulate_steps=2)
    with pytest.warns(UserWarning, match=r"middle of an optimizer step: its last 1 batch\(es\), of the 2"):
        h = train(batches(3), None, engine=acc)
    assert h["step"] == [1]


# ------------------------------------------------------------------------------------------ evaluation
@pytest.fixture(scope="module")
def engine():
    return Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3), ENGINE)


def test_evaluation_with_no_token_in_the_loss_is_refused(engine):
    """It scored a loss of 0 and a perplexity of 1: a perfect model, from nothing."""
    b = batches(1)[0]
    silent = Batch(b.inputs, b.targets, loss_mask=np.zeros(b.shape, np.float32))
    with pytest.raises(ValueError, match=r"hold no token in the loss \(every loss_mask is all zero\)"):
        evaluate(engine, [silent])
    with pytest.raises(ValueError, match="hold no token in the loss"):
        eval_hook([silent, silent], every=1)


def test_an_empty_eval_set_is_refused_when_the_hook_is_made(engine):
    """It was refused only when the hook first ran, after the first steps had trained."""
    with pytest.raises(ValueError, match=r"no batches; is the held-out split empty \(smaller than one batch\)"):
        eval_hook([], every=1)


def test_evaluate_takes_one_batch(engine):
    b = batches(1)[0]
    assert evaluate(engine, b) == evaluate(engine, [b])


def test_a_finished_run_run_again_reads_its_last_evaluation(tmp_path):
    """fit_history.jsonl was written by the first hook, before eval_hook added eval_loss to the step's metrics: a
    finished run run again (nothing left to train) read history["eval_loss"] as [] though its last step had one."""
    b = batches(3)
    run = dict(engine=ENGINE, hooks=[eval_hook(b[:1], every=1)])
    first = fit(Decoder(CFG, rngs=nnx.Rngs(0)), b, default_optimizer(1e-3), **run,
                train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path)))
    again = fit(Decoder(CFG, rngs=nnx.Rngs(0)), b, default_optimizer(1e-3), **run,
                train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path), resume=True))
    assert len(again) == 0 and again["eval_loss"] == first["eval_loss"][-1:] and again["step"] == [3]


def test_check_model_refuses_batches_of_no_rows():
    """rows=0 failed inside the engine's step, as a batch with no token."""
    with pytest.raises(ValueError, match=r"check_model needs rows >= 1 \(the rows of each batch"):
        check_model(Decoder(CFG, rngs=nnx.Rngs(0)), rows=0)
