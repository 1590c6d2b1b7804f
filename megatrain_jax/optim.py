"""AdamW whose update the engine can run as a fused, in-place host kernel.

``adamw(...)`` returns an ordinary optax ``GradientTransformation`` (usable by the reference trainer or
any optax code). The engine recognizes it through ``fused_spec`` and then runs ``kernels/host_adamw``
on the pinned-host buffers instead of a JAX host computation. Both paths compute the same float32 math.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[Any], Any]


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
