"""The update policy: when and how each part's optimizer update runs, and whether a step applies at all.

Per optimizer step, on the main thread, in this order:

1. ``decide(sq_norms, loss)`` makes the step's ``StepDecision`` from the whole gradient: the global norm,
   the factor every part's gradient is scaled by (exact clipping and accumulation averaging), and whether
   the step applies (loss and norm finite). The same program writes the scale and the verdict to host memory
   (``StepDecision``), and the decision's *resolution* (the host's reading) is queued on the host worker.
2. ``update(part, ...)`` for each part in forward order (io, block 0, block 1, ...): GPU-resident parts
   update on the device at once (a skipped step keeps the old values there); GPU-updated parts at their next
   fetch (``update_visiting``); host parts queue their update. With the fused AdamW and a bfloat16 stream copy
   the update is split in two halves (the parts ``EngineConfig.split_parts`` names): the first writes only the
   stream copy the next forward needs; the second, the fp32 masters and moments.
3. ``commit()`` queues the second halves, last part first (the next backward sends that part's gradients
   first, and each gradient buffer is released once its part commits).

The ordering this relies on, and how it is enforced:

- the host worker (``HostUpdater``) runs one task at a time in submission order;
- so a step's decision is resolved before any of its updates reads it: ``StepDecision.applies`` raises
  if it is read unresolved;
- and a part's second half runs after its first half: the commit task checks that the first half's
  future is done before reading the step count it returns;
- the next step's first half of a part runs after this step's second half of that part (both queued in
  step order), and the next forward fetches a part only after ``ready(part)``: its first half is done.

``NonFiniteError`` is raised on the worker when too many steps in a row were skipped; it surfaces at the
next ``check()`` (the start of a step) or ``drain()``.

Gates (``hold``) run on the worker just before a host part's masters or moments change in place; a
checkpoint writer holds a part there until it has written it.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.contract.layered import Params
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.host_state import HostState
from megatrain_jax.engine.parts import Part, PartId
from megatrain_jax.engine.precision import mode_of
from megatrain_jax.engine.transfer import Placement, local_array
from megatrain_jax.engine.update.host_optimizer import HostOptimizer
from megatrain_jax.engine.update.resident import DeviceUpdater
from megatrain_jax.engine.update.worker import HostUpdater


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a non-finite loss or gradient norm; host state is the last good one."""


@dataclasses.dataclass(frozen=True)
class Task:
    """The key of a host-worker task: the step's decision, a part's (first-half) update, or its commit."""

    stage: Literal["decide", "update", "commit"]
    part: PartId | None = None

    def __str__(self) -> str:
        return self.stage if self.part is None else f"{self.stage} {self.part}"


DECIDE = Task("decide")


def clip_scale(sq_norms: Sequence[jax.Array], clip_norm: float | None, accumulate: int) -> tuple[jax.Array, jax.Array]:
    """Global norm of the mean gradient (the host holds the sum of ``accumulate`` gradients) and the factor
    that turns the summed gradient into the clipped mean: ``min(1, clip / norm) / accumulate``."""
    norm = jnp.sqrt(sum(jnp.asarray(s, jnp.float32) for s in sq_norms)) / accumulate
    scale = jnp.float32(1.0 / accumulate)
    if clip_norm is not None:
        scale = jnp.where(norm < clip_norm, scale, scale * clip_norm / norm)
    return norm, scale


class StepDecision:
    """One optimizer step's decision, made once from the whole gradient. ``norm``, ``scale`` and ``ok`` are
    device scalars (GPU-resident parts use them without a host sync); ``home`` holds this process's ``scale`` and
    ``ok`` in host memory, written by the program that made the decision. ``applies`` is the host's reading of
    ``ok``, set by ``resolve`` on the worker, and ``scale_value`` the host's reading of ``scale`` (what the host
    updates use).

    The decision's program writes them home itself because a copy from the device issued afterwards, even one
    started right away, runs behind whatever copies home the next forward had already queued (a GPU-updated part's
    masters and moments, gigabytes): the runtime issues such a copy only once its source is ready, and on this GPU
    the copy engines run it after the copies issued before it, whatever their stream
    (experiments/studies/NOTES.md, 2026-12-01). Every host update, which the next forward waits for, would wait
    with it."""

    def __init__(self, norm: jax.Array, scale: jax.Array, ok: jax.Array, home: tuple[jax.Array, jax.Array]):
        self.norm, self.scale, self.ok = norm, scale, ok
        self.home = tuple(local_array(x) for x in home)  # this process's copies in host memory: (scale, ok)
        self._scale: float | None = None
        self._applies: bool | None = None
        self._failed: BaseException | None = None  # the device work behind ``ok`` failed (out of memory, say)
        self._lock = threading.Lock()

    def resolve(self) -> bool:
        """Read the decision on the host (waits for the norm); idempotent. If the device work it depends on
        failed, that failure is raised here and by every update that asks ``applies``: no part updates."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._applies is None:
                try:
                    self._scale, self._applies = float(np.asarray(self.home[0])), bool(np.asarray(self.home[1]))
                except Exception as err:
                    self._failed = err
                    raise
            return self._applies

    @property
    def scale_value(self) -> float:
        """The factor the host updates scale the gradient by, read on the host with the verdict (``resolve``);
        ``applies`` raises before that, or where the device work failed."""
        self.applies  # noqa: B018 - raises where the decision is unresolved or failed
        return self._scale

    @property
    def applies(self) -> bool:
        if self._failed is not None:
            raise self._failed
        if self._applies is None:
            raise RuntimeError("a part's update ran before its step's decision was resolved: host-worker tasks "
                               "must run one at a time in submission order")
        return self._applies


@dataclasses.dataclass
class _FirstHalf:
    part: PartId
    done: Future  # returns the step count the first half used, or None when the step was skipped
    grads: Params
    decision: StepDecision


class UpdatePolicy:
    """Per-step decision, part updates (host and GPU-resident), split halves, gates and the skipped-step
    count. See the module docstring for the order it relies on."""

    def __init__(self, tx: optax.GradientTransformation, placement: Placement, stream_dtype: Any,
                 config: EngineConfig, observers: Sequence = (), split: Sequence[PartId] = ()):
        self.placement = placement
        precision = mode_of(config, jnp.dtype(stream_dtype).name)  # the mode's record: what the host keeps
        self.opt = HostOptimizer(tx, placement, stream_dtype, use_kernel=config.host_kernel, precision=precision)
        self.split = set(split)  # the parts whose update splits where the optimizer can (HostRoles.splitting)
        self.device = DeviceUpdater(tx, placement, self.opt.stream_dtype, keep_copy=config.keeps_resident_copy)
        self.worker = HostUpdater(observers)
        self.max_nonfinite = config.max_nonfinite_steps
        self.skipped_steps = 0
        self._nonfinite_in_row = 0  # written by the worker only
        self._gates: list[Callable[[PartId], None]] = []
        self.disk_tier = None  # megatrain_jax.engine.update.disk_tier.DiskTier, when some parts' moments live on disk
        self._first_halves: list[_FirstHalf] = []
        clip, accumulate = config.clip_norm, config.accumulate_steps

        def decide(sq, loss):  # the scale and verdict twice: on the device, and written home (``StepDecision``)
            norm, scale = clip_scale(sq, clip, accumulate)
            ok = jnp.isfinite(loss) & jnp.isfinite(jnp.sqrt(sum(sq)))
            return norm, scale, ok, (scale, ok)
        device, host = placement.device, placement.host
        self._decide = jax.jit(decide, out_shardings=(device, device, device, (host, host)))

    @property
    def nonfinite_in_row(self) -> int:
        """Steps skipped in a row up to the last decision the worker has counted (``drain`` first for the last
        step's)."""
        return self._nonfinite_in_row

    # ------------------------------------------------------------------ per step
    def check(self) -> None:
        """Re-raise a ``NonFiniteError`` (or another failure) of an earlier step's decision; never blocks."""
        self.worker.poll(DECIDE)

    def decide(self, sq_norms: Sequence[jax.Array], loss: jax.Array) -> StepDecision:
        decision = StepDecision(*self._decide(list(sq_norms), loss))
        self.worker.submit(DECIDE, lambda: self._count(decision))
        if self.disk_tier is not None:  # the updates follow: the first tier parts' moments start loading
            self.disk_tier.start_step()
        return decision

    def _count(self, decision: StepDecision) -> None:
        ok = decision.resolve()
        self._nonfinite_in_row = 0 if ok else self._nonfinite_in_row + 1
        self.skipped_steps += not ok
        if self._nonfinite_in_row > self.max_nonfinite:
            raise NonFiniteError(f"{self._nonfinite_in_row} consecutive steps had a non-finite loss or "
                                 f"gradient norm (limit max_nonfinite_steps={self.max_nonfinite}); host state "
                                 f"is the last good step's. Lower the learning rate or check the data")

    def update_device(self, part: Part, grads: Params, decision: StepDecision) -> Part:
        """A GPU-resident part's update, dispatched at once."""
        return self.device.update(part, grads, decision.scale, decision.ok)

    def update_visiting(self, state: HostState, part: PartId, brought: tuple, grads: Params,
                        decision: StepDecision) -> Params:
        """A GPU-updated part's update (``EngineConfig.gpu_updated_layers``), run at its next fetch from the state
        ``DeviceUpdater.bring`` copied over; the updated record replaces the host's once the update gates let it
        (a checkpoint still writing the part). Returns the new weights on the device."""
        home, weights = self.device.visit(brought, grads, decision.scale, decision.ok)
        self.pass_gates(part)
        state[part] = home
        return weights

    def use_disk_tier(self, tier) -> None:
        """Updates of ``tier.parts`` take their moments from the disk tier and give them back."""
        self.disk_tier = tier

    def update_host(self, state: HostState, part: PartId, grads: Params, decision: StepDecision,
                    on_device: bool = False) -> Future:
        """Queue a host part's update (its first half when split); the future is done when the next
        forward may fetch the part. Gradients ``on_device`` (``EngineConfig.grads_on_gpu``) are copied to
        pinned memory by the task itself, so that one such part's gradient at a time is in host memory, and
        their update is never split (a second half would keep the host copy until the step's commit). Nor
        is a disk-tier part's: its moments are in memory for one update, not until the commit."""
        on_disk = self.disk_tier is not None and part in self.disk_tier.parts
        split = self.opt.splits and part in self.split  # never one on_device or on_disk (HostRoles.splitting)

        def first() -> int | None:
            if not decision.applies:
                return None
            if split:
                return self.opt.update_stream(state[part], grads, decision.scale_value)
            self.pass_gates(part)
            home = self.placement.to_host(grads) if on_device else grads
            record = self.disk_tier.load(part, state[part]) if on_disk else state[part]
            record = self.opt.update(record, home, decision.scale_value, salt=part.index)
            state[part] = self.disk_tier.store(part, record) if on_disk else record
            return None

        done = self.worker.submit(Task("update", part), first)
        if split:
            self._first_halves.append(_FirstHalf(part, done, grads, decision))
        return done

    def commit(self, state: HostState) -> list[Future]:
        """Queue the second halves of this step's split updates, last part first."""
        futures = []
        for half in reversed(self._first_halves):
            def second(half: _FirstHalf = half) -> None:
                if not half.done.done():
                    raise RuntimeError(f"the commit of {half.part} ran before its first half: host-worker tasks "
                                       f"must run one at a time in submission order")
                if half.done.exception() is not None or half.done.result() is None:
                    return  # the first half failed (reported under its own key) or the step was skipped
                self.pass_gates(half.part)
                state[half.part] = self.opt.commit(state[half.part], half.grads, half.decision.scale_value,
                                                   half.done.result())
            futures.append(self.worker.submit(Task("commit", half.part), second))
        self._first_halves = []
        return futures

    @property
    def commits_pending(self) -> bool:
        """Whether first halves were queued whose second halves are not (a step cut short)."""
        return bool(self._first_halves)

    def ready(self, part: PartId) -> None:
        """Block until ``part`` may be fetched (its update, or first half, is done); a failed second half
        of an earlier update stops training here rather than later."""
        self.worker.wait(Task("update", part))
        self.worker.poll(Task("commit", part))

    def drain(self) -> None:
        """Wait for every queued task, re-raising the first failure."""
        self.worker.wait_all()

    # ------------------------------------------------------------------ gates
    def hold(self, gate: Callable[[PartId], None]) -> Callable[[], None]:
        """Call ``gate(part)`` on the worker before a host part's masters or moments change; returns the
        function that removes the gate."""
        self._gates.append(gate)
        return lambda: self._gates.remove(gate) if gate in self._gates else None

    def pass_gates(self, part: PartId) -> None:
        """Wait at every gate for ``part``: its host arrays may then change (``hold``)."""
        for gate in list(self._gates):
            gate(part)

