"""``fit`` as Keras/HF users expect it: hooks stop training cleanly, any failure keeps the history and what
was trained, endless data without ``steps`` is refused at once, the learning rate is logged for any optax
schedule, and evaluation is public."""

from __future__ import annotations

import itertools
import json

import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

import megatrain_jax
from megatrain_jax import Decoder, EngineConfig, Hook, TrainConfig, default_optimizer, fit, preset
from megatrain_jax.checkpoint import committed_steps
from megatrain_jax.data import DataConfig
from megatrain_jax.fit import Feed, endless

CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)
ENGINE = EngineConfig(micro_batches=2)


def data(batch_size=2):
    return DataConfig(seq_len=16, batch_size=batch_size, seed=3, prefetch=0, demo_tokens=1 << 14).build(CFG.vocab_size)


def params_of(model) -> dict:
    return {k: np.asarray(v) for k, v in
            traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs"


def train(steps, *, hooks=(), stream=None, engine=ENGINE, optimizer=None, **kw):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    h = fit(model, data() if stream is None else stream, optimizer or default_optimizer(1e-3),
            train=TrainConfig(steps=steps, log_every=0, **kw), engine=engine, hooks=hooks)
    return model, h


@pytest.fixture(scope="module")
def reference():
    """Uninterrupted runs: params after 3 and after 6 steps, and the 6 losses."""
    m3, _ = train(3)
    m6, h6 = train(6)
    acc, hacc = train(4, engine=EngineConfig(micro_batches=2, accumulate_steps=2))
    return {"3": params_of(m3), "6": params_of(m6), "loss": h6["loss"], "acc": params_of(acc), "acc_loss": hacc["loss"]}


# ------------------------------------------------------------------------------------------ stopping
def test_a_hook_stops_training_cleanly(tmp_path, reference):
    """stop() at step 2: step 3 is already running, finishes, is reported to every hook, and is saved."""
    seen = []

    def early_stop(m, info):
        if m["step"] == 2:
            info.stop("eval loss stopped improving")
    model, h = train(6, hooks=[Hook(early_stop), Hook(lambda m, info: seen.append(m["step"]))],
                     checkpoint_dir=str(tmp_path))
    assert h["step"] == [1, 2, 3] and seen == [1, 2, 3]
    assert h.stopped == "eval loss stopped improving"
    assert_same(params_of(model), reference["3"])
    assert committed_steps(tmp_path) == [3]
    resumed, h2 = train(6, checkpoint_dir=str(tmp_path), resume=True)  # and the run goes on exactly
    assert_same(params_of(resumed), reference["6"])
    assert h2["loss"] == reference["loss"][3:]


def test_a_run_resumed_with_nothing_left_to_train_reads_its_last_steps_metrics(tmp_path, reference):
    """Each step's metrics are kept beside the checkpoints (fit_history.jsonl): a run stopped after step 3 and
    resumed to 6, then run again, has no records and reads step 6's loss; steps an interrupted run trained
    past its last checkpoint are cut from the file when trained again."""
    import json
    stop = Hook(lambda m, info: info.stop("paused") if m["step"] == 2 else None)
    train(6, hooks=[stop], checkpoint_dir=str(tmp_path))
    _, h = train(6, checkpoint_dir=str(tmp_path), resume=True)
    assert h.resumed["step"] == 3 and h["step"] == [4, 5, 6]  # records: this call's steps only
    _, again = train(6, checkpoint_dir=str(tmp_path), resume=True)
    assert len(again) == 0 and again["step"] == [6] and again["loss"] == [pytest.approx(reference["loss"][-1])]
    log = tmp_path / "fit_history.jsonl"
    with open(log, "a") as f:  # a step trained past the last checkpoint before a kill
        f.write(json.dumps({"step": 7, "loss": 123.0}) + "\n")
    _, more = train(8, checkpoint_dir=str(tmp_path), resume=True)
    assert more["step"] == [7, 8] and more["loss"][0] != 123.0
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == list(range(1, 9))


def test_a_finished_run_is_not_marked_stopped():
    _, h = train(2)
    assert h.stopped is None and h["step"] == [1, 2]


# ------------------------------------------------------------------------------------------ failures
class Boom(RuntimeError):
    pass


def test_a_failing_hook_keeps_history_weights_and_a_checkpoint(tmp_path, reference):
    def fail(m, info):
        if m["step"] == 2:
            raise Boom("the hook broke")
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(Boom) as err:
        fit(model, data(), default_optimizer(1e-3), engine=ENGINE, hooks=[Hook(fail)],
            train=TrainConfig(steps=6, log_every=0, checkpoint_dir=str(tmp_path)))
    # step 3, in flight when step 2's hook failed, is reported (to the other hooks) before it is saved
    assert err.value.history["step"] == [1, 2, 3]
    assert err.value.history["loss"] == reference["loss"][:3]
    notes = "\n".join(err.value.__notes__)
    assert "written back" in notes and f"saved to {tmp_path / '3'}" in notes
    assert_same(params_of(model), reference["3"])  # step 3 was in flight when step 2's hook ran
    assert committed_steps(tmp_path) == [3]
    resumed, h = train(6, checkpoint_dir=str(tmp_path), resume=True)
    assert_same(params_of(resumed), reference["6"]) and h["loss"] == reference["loss"][3:]


class Failing:
    """A restorable batch stream whose ``fail_at``-th batch (0-based) raises, once."""

    def __init__(self, inner, fail_at):
        self.inner, self.fail_at, self.n = inner, fail_at, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.n == self.fail_at:
            self.fail_at = None
            raise OSError("disk read error in the middle of a step")
        self.n += 1
        return next(self.inner)

    def state(self):
        return self.inner.state()

    def restore(self, state):
        self.inner.restore(state)


def test_a_data_failure_mid_step_saves_the_last_whole_step(tmp_path, reference):
    """accumulate_steps=2: the data fails on the 2nd batch of step 3 (batch index 5). The checkpoint holds
    step 2 with the data position after step 2's 4 batches, so the resumed run is exact."""
    acc = EngineConfig(micro_batches=2, accumulate_steps=2)
    with pytest.raises(OSError) as err:
        train(4, stream=Failing(data(), fail_at=5), engine=acc, checkpoint_dir=str(tmp_path))
    assert err.value.history["step"] == [1, 2]  # step 2's metrics, due after step 3's launch, are reported first
    assert committed_steps(tmp_path) == [2]
    resumed, h = train(4, engine=acc, checkpoint_dir=str(tmp_path), resume=True)
    assert_same(params_of(resumed), reference["acc"])
    assert h["loss"] == reference["acc_loss"][2:]


def test_bad_tokens_are_the_datas_failure(tmp_path, reference):
    """Out-of-range token ids: a clear error, found before the engine starts the step; what was trained
    is saved, and every step saved has reached the hooks (its metrics row) first: step 2's metrics, which come
    one step late, are reported before the error is raised. The notes say where the metrics are for a command
    line user, and to fix the data before resuming."""
    good = list(itertools.islice(data(), 3))
    bad = good[2].__class__(np.full_like(good[2].inputs, CFG.vocab_size + 5), good[2].targets)
    model, seen = Decoder(CFG, rngs=nnx.Rngs(0)), []
    with pytest.raises(ValueError, match=f"token id {CFG.vocab_size + 5} in batch inputs is outside") as err:
        fit(model, good[:2] + [bad], default_optimizer(1e-3), engine=ENGINE,
            hooks=[Hook(lambda m, info: seen.append(m["step"]))],
            train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path)))
    assert committed_steps(tmp_path) == [2]
    assert seen == [1, 2] and err.value.history["loss"] == reference["loss"][:2]
    assert [json.loads(x)["step"] for x in (tmp_path / "fit_history.jsonl").read_text().splitlines()] == [1, 2]
    notes = "\n".join(err.value.__notes__)
    assert "the metrics of steps 1 to 2 were reported before the failure" in notes
    assert "metrics.jsonl" in notes and "from Python they are in err.history" in notes
    assert f"saved to {tmp_path / '2'}; fix the data first, then resume from it" in notes


def test_a_hook_failing_on_the_last_step_after_the_data_failed_names_both(tmp_path):
    """The data fails at the 3rd batch; reporting step 2 then fails in a hook: that failure is raised (its own
    rules decide what is kept), with the data's error in a note."""
    def fail(m, info):
        if m["step"] == 2:
            raise Boom("the hook broke")
    with pytest.raises(Boom) as err:
        train(5, stream=Failing(data(), fail_at=2), hooks=[Hook(fail)], checkpoint_dir=str(tmp_path))
    notes = "\n".join(err.value.__notes__)
    assert "after the data failed: OSError: disk read error in the middle of a step" in notes
    assert err.value.history["step"] == [1, 2] and committed_steps(tmp_path) == [2]


def test_a_failure_inside_the_engine_writes_nothing_back(monkeypatch):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    before = params_of(model)
    calls = {"n": 0}
    original = megatrain_jax.Engine.step

    def step(self, batches):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("device lost")
        return original(self, batches)
    monkeypatch.setattr(megatrain_jax.Engine, "step", step)
    with pytest.raises(Boom) as err:
        fit(model, data(), default_optimizer(1e-3), engine=ENGINE, train=TrainConfig(steps=5, log_every=0))
    assert err.value.history["step"] == [1]
    assert "nothing was written back" in "\n".join(err.value.__notes__)
    assert_same(params_of(model), before)


# ------------------------------------------------------------------------------------------ endless data
@pytest.mark.parametrize("stream", [itertools.cycle([1]), itertools.count(), itertools.repeat(1)])
def test_endless_data_without_steps_is_refused_at_once(stream):
    with pytest.raises(ValueError, match="never ends.*TrainConfig\\(steps=N\\)"):
        fit(nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0))), stream, train=TrainConfig(log_every=0))


def test_looping_token_batches_say_they_are_endless():
    assert endless(data()) and endless(DataConfig(seq_len=16, batch_size=2, prefetch=2, demo_tokens=1 << 14).build(128))
    assert not endless(itertools.repeat(1, 3)) and not endless([1, 2]) and not endless(iter([1]))


def test_feed_stops_only_at_step_boundaries():
    feed = Feed(iter(range(100)), accumulate=3, limit=9)
    got = [next(feed), next(feed)]
    feed.stop("signal")
    got.append(next(feed))  # the step in progress is completed
    assert got == [0, 1, 2] and list(feed) == [] and feed.stopped == "signal"
    assert list(Feed(iter(range(100)), accumulate=2, limit=6)) == list(range(6))


def test_feed_ends_where_the_data_fails_and_keeps_the_error():
    """So that the engine reports the step it trained last (its metrics come one step late) before fit raises."""
    def failing():
        yield from range(3)
        raise OSError("disk read error")
    feed = Feed(failing(), accumulate=2)
    assert list(feed) == [0, 1, 2] and isinstance(feed.error, OSError) and feed.state() is None


# ------------------------------------------------------------------------------------------ learning rate
SCHEDULE = optax.linear_schedule(1e-3, 1e-4, 4)


@pytest.mark.parametrize("optimizer", [
    optax.adamw(SCHEDULE), optax.sgd(SCHEDULE, momentum=0.9), optax.lion(SCHEDULE),
    optax.chain(optax.clip(1.0), optax.adam(SCHEDULE)), optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE),
    megatrain_jax.adamw(SCHEDULE)], ids=["adamw", "sgd", "lion", "chain", "inject", "fused"])
def test_the_learning_rate_is_logged_for_any_optax_schedule(optimizer):
    _, h = train(3, optimizer=optimizer)
    assert h["lr"] == pytest.approx([float(SCHEDULE(s)) for s in range(3)])


@pytest.mark.parametrize("optimizer, lr", [(optax.sgd(0.05), 0.05), (optax.adam(2e-3), 2e-3),
                                           (optax.inject_hyperparams(optax.adamw)(learning_rate=0.01), 0.01)])
def test_a_constant_learning_rate_is_logged(optimizer, lr):
    _, h = train(2, optimizer=optimizer)
    assert h["lr"] == pytest.approx([lr, lr])


# ------------------------------------------------------------------------------------------ evaluation
def test_evaluation_is_public():
    from megatrain_jax import eval_hook, evaluate
    batches = list(itertools.islice(data(), 2))
    _, h = train(3, hooks=[eval_hook(batches, every=1)])
    # Step 1's parameters are gone when its metrics arrive (step 2 already runs): steps 2 and 3 are evaluated.
    assert [r["step"] for r in h.records if "eval_loss" in r] == [2, 3] and all(np.isfinite(h["eval_loss"]))
    result = evaluate(h.engine, batches)
    assert result["eval_loss"] == pytest.approx(h["eval_loss"][-1]) and result["eval_tokens"] == 2 * 2 * 16
