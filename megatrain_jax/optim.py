"""AdamW whose update the engine can run as a fused, in-place host kernel.

``adamw(...)`` returns an ordinary optax ``GradientTransformation`` (usable by the reference trainer or
any optax code). The engine recognizes it through ``fused_spec`` and then runs ``kernels/host_adamw``
on the pinned-host buffers instead of a JAX host computation. Both paths compute the same float32 math.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

Schedule = Callable[[Any], Any]


def schedule_value(schedule: float | Schedule, count: int) -> float:
    """``schedule(count)`` (a constant: itself) as a Python float, computed on the host CPU and remembered (where
    the schedule can be a dictionary key). An optax schedule is JAX code: called with a plain integer on a GPU machine it
    would run on the GPU, and reading its value would wait for every computation queued there before it (the
    host optimizer's worker and the training loop ask every step, while the GPU works through the step
    ahead)."""
    if not callable(schedule):
        return float(schedule)
    if isinstance(schedule, collections.abc.Hashable):
        return _remembered(schedule, int(count))
    return _on_host(schedule, int(count))


@functools.lru_cache(maxsize=256)
def _remembered(schedule: Schedule, count: int) -> float:
    return _on_host(schedule, count)


def _on_host(schedule: Schedule, count: int) -> float:
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX started without its CPU backend (JAX_PLATFORMS): where JAX computes by default
        return float(schedule(count))
    with jax.default_device(cpu):
        return float(schedule(count))


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (not on norms' scales or biases)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdamWState:
    count: jax.Array  # int32: updates applied so far
    mu: Any
    nu: Any


@dataclasses.dataclass(frozen=True)
class AdamWSpec:
    """Hyperparameters; ``learning_rate`` may be an optax schedule of the update count."""

    learning_rate: float | Schedule
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    mask: Callable[[Any], Any] | None = decay_mask

    def lr_at(self, count: Any) -> Any:
        return self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate

    def lr_value(self, count: int) -> float:
        """The learning rate of update ``count`` (0-based) as a float, without touching an accelerator
        (``schedule_value``)."""
        return schedule_value(self.learning_rate, count)

    def bias_corrections(self, t: Any) -> tuple[Any, Any]:
        """``1 - b^t`` for the update number ``t`` (1-based)."""
        return 1 - self.b1 ** t, 1 - self.b2 ** t

    def decays(self, params: Any) -> Any:
        """Per leaf: does weight decay apply."""
        return jax.tree.map(lambda _: True, params) if self.mask is None else self.mask(params)

    def init(self, params: Any) -> AdamWState:
        zeros = lambda p: jnp.zeros_like(p, jnp.float32)
        return AdamWState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def update(self, grads: Any, state: AdamWState, params: Any) -> tuple[Any, AdamWState]:
        t = state.count + 1
        bc1, bc2 = self.bias_corrections(t.astype(jnp.float32))
        lr = self.lr_at(state.count)
        mu = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, state.nu, grads)

        def step(m, v, p, decay):
            u = (m / bc1) / (jnp.sqrt(v / bc2) + self.eps)
            return -lr * (u + self.weight_decay * p if decay else u)
        updates = jax.tree.map(step, mu, nu, params, self.decays(params))
        return updates, AdamWState(t, mu, nu)


def adamw(learning_rate: float | Schedule = 3e-4, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.1, mask: Callable[[Any], Any] | None = decay_mask) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, on matrices by default) that the engine runs as a fused host kernel."""
    spec = AdamWSpec(learning_rate, b1, b2, eps, weight_decay, mask)
    return optax.GradientTransformation(spec.init, spec.update)


def fused_spec(tx: optax.GradientTransformation) -> AdamWSpec | None:
    """The spec behind a transformation made by ``adamw``, else None."""
    owner = getattr(tx.init, "__self__", None)
    return owner if isinstance(owner, AdamWSpec) else None


def learning_rate_of(tx: optax.GradientTransformation) -> Schedule | None:
    """The learning-rate schedule of ``tx`` (for logging): step -> rate, or None when it has none to find.

    Found in what builds it: ``megatrain_jax.adamw``'s spec; the ``learning_rate`` optax's
    ``scale_by_learning_rate`` wraps (every optax optimizer given a schedule: ``adamw``, ``sgd``, ``lion``,
    ``adafactor``, ... in chains too); the ``learning_rate`` hyperparameter of ``optax.inject_hyperparams``;
    a constant rate as the single negative ``optax.scale`` of the chain, or in ``inject_hyperparams``' state. A chain
    whose one ``optax.scale`` is positive or not a number (``optax.adamw(-1e-3)``, ``optax.sgd(nan)``) reads as that
    rate negated, so that ``fit`` refuses it rather than climb the loss."""
    spec = fused_spec(tx)
    if spec is not None:
        lr = spec.learning_rate
        return lr if callable(lr) else (lambda _: lr)
    scales, other = [], []
    for fn in _update_fns(tx.update):
        cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), fn.__closure__ or ()))
        value = _cell(cells.get("learning_rate"))
        if callable(value) and "scale_by_learning_rate" in getattr(fn, "__qualname__", ""):
            return value
        for name in ("sched_hps", "other_hps"):  # optax.inject_hyperparams
            hps = _cell(cells.get(name))
            if isinstance(hps, dict) and "learning_rate" in hps:
                lr = hps["learning_rate"]
                lr = getattr(lr, "schedule_fn", lr)  # optax wraps schedules to read the count from its state
                return lr if callable(lr) else (lambda _: lr)
        step = _cell(cells.get("step_size"))
        if getattr(fn, "__qualname__", "").startswith("scale.") and isinstance(step, (int, float)):
            (scales if step < 0 else other).append(-float(step))
    if len(scales) == 1 or (not scales and len(other) == 1):
        rate = (scales or other)[0]
        return lambda _: rate
    try:  # inject_hyperparams keeps a numeric rate in its state
        hps = getattr(tx.init({"probe": jnp.zeros((1,), jnp.float32)}), "hyperparams", {})
    except Exception:  # noqa: BLE001 - a transformation that cannot init on the probe has no rate to show
        hps = {}
    if "learning_rate" in hps:
        lr = float(hps["learning_rate"])
        return lambda _: lr
    return None


def _cell(cell: Any) -> Any:
    try:
        return None if cell is None else cell.cell_contents
    except ValueError:  # an empty cell
        return None


# ------------------------------------------------------------------------------------ part-wise check
class UnsupportedOptimizerError(ValueError):
    """The optimizer cannot run part by part; the message names the transformation and what to use."""


def check_partwise(tx: optax.GradientTransformation) -> None:
    """Raise ``UnsupportedOptimizerError`` unless ``tx`` updates each array from that array alone.

    The engine updates the model part by part (the io part, then each block), each as its own tree, so a
    transformation that looks across arrays, like ``clip_by_global_norm``, would see one part at a time
    and compute something else than on the whole model. This is checked on a probe of two arrays: two
    steps updating them together must equal two steps updating each alone. A transformation that cannot
    run on the probe at all is not judged here (its own error, if any, comes at the first step)."""
    if fused_spec(tx) is not None:
        return
    names = [_name(fn) for fn in _update_fns(tx.update)]
    if "clip_by_global_norm" not in names and _acts_per_array(tx) is not False:
        return
    if "clip_by_global_norm" in names:
        raise UnsupportedOptimizerError(
            "optax.clip_by_global_norm inside the optimizer would clip each part of the model by its own "
            "norm: remove it from the optimizer and set EngineConfig(clip_norm=...) instead (the engine clips "
            "by the exact norm of the whole gradient)")
    raise UnsupportedOptimizerError(
        f"{names[0]} looks across parameter arrays (its update of one array depends on the others), but the "
        f"engine updates the model part by part, so it would compute something else than on the whole "
        f"model. Use a per-array transformation instead (optax.adamw, megatrain_jax.adamw, lamb, lion, "
        f"adafactor, ...); for global-norm clipping use EngineConfig(clip_norm=...)")


# shape, gradient size, seed. One array's gradient dwarfs the other's, so that a global norm (which scale-
# invariant optimizers such as Adam would otherwise hide) pushes the small one below Adam's eps.
_PROBE = {"kernel": ((8, 4), 1e6, 1), "scale": ((4,), 0.03, 2)}


def _probe(tx: optax.GradientTransformation, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Two steps of ``tx`` on the probe arrays ``keys``; each array's values do not depend on the others."""
    draw = lambda k, i: np.random.default_rng(10 * _PROBE[k][2] + i).standard_normal(_PROBE[k][0])
    params = {k: jnp.asarray(draw(k, 0), jnp.float32) for k in keys}
    state = tx.init(params)
    for step in (1, 2):  # large gradients on one array: any cross-array scaling shows
        grads = {k: jnp.asarray(draw(k, step) * _PROBE[k][1], jnp.float32) for k in keys}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def _acts_per_array(tx: optax.GradientTransformation) -> bool | None:
    """Whether ``tx`` updates each array from that array alone (None: the probe could not run)."""
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            both = _probe(tx, ("kernel", "scale"))
            alone = {k: _probe(tx, (k,))[k] for k in both}
    except Exception:  # noqa: BLE001 - e.g. a mask tree shaped like some other model: not judged here
        return None
    return all(np.allclose(both[k], alone[k], rtol=1e-5, atol=1e-7) for k in both)


def _update_fns(fn: Any, seen: set[int] | None = None) -> list[Any]:
    """``fn`` (an update function) and every update function it wraps (chain members, inner optimizers)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    found = [fn]

    def visit(x: Any) -> None:
        if isinstance(x, (tuple, list)):
            for y in x:
                visit(y)
        elif callable(getattr(x, "update", None)) and callable(getattr(x, "init", None)):
            found.extend(_update_fns(x.update, seen))
        elif callable(x) and hasattr(x, "__code__"):
            found.extend(_update_fns(x, seen))

    for cell in getattr(fn, "__closure__", None) or ():
        try:
            visit(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    owner = getattr(fn, "__self__", None)  # class-based transformations such as optax.MultiSteps
    if owner is not None:
        for value in vars(owner).values():
            visit(value)
    return found


def _name(update: Any) -> str:
    owner = getattr(update, "__self__", None)
    if owner is not None:
        return f"optax.{type(owner).__name__}"
    name = getattr(update, "__qualname__", repr(update)).split(".<locals>")[0]
    return name if name == "clip_by_global_norm" else f"optax.{name}"
