"""Every optax transformation the reference trainer runs also runs in the engine, on whichever route
serves (fused kernel, XLA on pinned-host arrays, or the state sent to the accelerator and back), with the
reference's results; transformations that look across parameters are refused at engine build."""

from __future__ import annotations

import optax
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, ReferenceTrainer, UnsupportedOptimizerError, adamw, preset
from tests.test_engine import assert_models_close, make_batches

TINY = preset("tiny")
SCHEDULE = optax.linear_schedule(1e-4, 1e-3, 3)

# name -> (optimizer factory, the route its updates take on the CPU backend)
OPTIMIZERS = {
    "adamw": (lambda: optax.adamw(1e-3, eps=1e-6, weight_decay=0.1), "host"),
    "sgd_momentum": (lambda: optax.sgd(0.1, momentum=0.9), "host"),
    "lion_schedule": (lambda: optax.lion(SCHEDULE, weight_decay=0.1), "host"),
    "adafactor": (lambda: optax.adafactor(1e-2), "device"),
    "lamb": (lambda: optax.lamb(1e-3, eps=1e-6), "device"),
    "lars": (lambda: optax.lars(1e-2), "device"),
    "adagrad": (lambda: optax.adagrad(1e-2), "device"),
    "apply_if_finite": (lambda: optax.apply_if_finite(optax.adamw(1e-3, eps=1e-6), 3), "device"),
    "multi_steps": (lambda: optax.MultiSteps(optax.adamw(1e-3, eps=1e-6), every_k_schedule=2), "device"),
    "fused_adamw": (lambda: adamw(1e-3, eps=1e-6), "fused"),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_reference_over_three_steps(name):
    make, route = OPTIMIZERS[name]
    batches = make_batches(3, vocab=TINY.vocab_size)
    ref = ReferenceTrainer(Decoder(TINY, rngs=nnx.Rngs(0)), make(), clip_norm=1.0)
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    engine = Engine(model, make(), EngineConfig(micro_batches=2, clip_norm=1.0))
    assert engine.update_route == route
    for b in batches:
        r, e = ref.step(b), engine.step(b).resolve()
        assert abs(e["loss"] - r["loss"]) < 1e-4 * abs(r["loss"]), (name, e, r)
    engine.write_back(model)
    assert_models_close(ref.model, model, tol=1e-4)


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)), every_k_schedule=2),
], ids=["chain", "nested"])
def test_clip_by_global_norm_in_the_optimizer_points_at_clip_norm(tx):
    with pytest.raises(UnsupportedOptimizerError, match=r"clip_by_global_norm.*EngineConfig\(clip_norm"):
        Engine(Decoder(TINY, rngs=nnx.Rngs(0)), tx)


def test_a_transformation_that_looks_across_arrays_is_refused_by_name():
    """Noise drawn per number of leaves differs part by part from the whole model's: refused, named."""
    with pytest.raises(UnsupportedOptimizerError, match="optax.chain.*looks across parameter arrays"):
        Engine(Decoder(TINY, rngs=nnx.Rngs(0)), optax.noisy_sgd(0.1, key=0))


def test_the_learning_rate_the_host_reads_is_the_schedules_computed_once_per_step_on_the_cpu():
    """``AdamWSpec.lr_value``: the schedule's value as a float, computed on the host CPU (on a GPU machine a
    schedule called with an integer would run on the GPU, and reading it would wait for the GPU's queued work)
    and remembered, so the host kernel's parts and the training loop's metrics of one step compute it once."""
    import jax
    from megatrain_jax.optim import fused_spec, schedule_value
    calls = []

    def schedule(count):
        calls.append(jax.numpy.asarray(count).devices())
        return optax.warmup_cosine_decay_schedule(0.0, 3e-4, 10, 100, 3e-5)(count)

    spec = fused_spec(adamw(schedule))
    reference = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 10, 100, 3e-5)
    for count in (0, 5, 5, 10, 57, 5):
        assert spec.lr_value(count) == float(reference(count))
    assert len(calls) == 4 and all(d == {jax.devices("cpu")[0]} for d in calls), calls  # 0, 5, 10, 57 once each
    assert schedule_value(schedule, 57) == float(reference(57)) and len(calls) == 4
    assert fused_spec(adamw(1e-3)).lr_value(7) == 1e-3

    class Unhashable:  # a schedule that cannot be a cache key is computed each time, on the CPU all the same
        __hash__ = None

        def __call__(self, count):
            return reference(count)

    assert fused_spec(adamw(Unhashable())).lr_value(57) == float(reference(57))
