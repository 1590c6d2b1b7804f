"""The streamed engine: one or more devices, all persistent state in host memory.

``Engine`` assembles the pieces and offers the public API: ``step``/``steps`` for training, ``evaluate``
for held-out loss, ``sync``/``write_back`` to read the trained state, ``observe`` for profiling and
timelines, and the seams a checkpointer needs (``hold_updates``, ``restore_part``, ``restored``). What
moves when is ``megatrain_jax.engine.schedule``; how each op runs, ``megatrain_jax.engine.passes``; when and
how parts are updated, ``megatrain_jax.engine.update.policy``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from megatrain_jax._environment import enable_compilation_cache
from megatrain_jax.batch import Batch, check_batch
from megatrain_jax.contract.layered import Params, layered, write_back
from megatrain_jax.engine.config import AUTO, EngineConfig
from megatrain_jax.engine.device_fns import device_fns
from megatrain_jax.engine.host_state import initial_state
from megatrain_jax.engine.observers import Profile
from megatrain_jax.engine.parts import IO, HostRoles, Part, PartId
from megatrain_jax.engine.out_of_memory import DeviceOutOfMemoryError, reported_late
from megatrain_jax.engine.passes import Pass, PassRunner, device_batches
from megatrain_jax.engine.precision import streamed_dtype
from megatrain_jax.engine.schedule import eval_ops, step_passes
from megatrain_jax.engine.step_clock import StepClock
from megatrain_jax.engine.transfer import Placement, local_rows, local_value
from megatrain_jax.engine.update.disk_tier import DiskTier
from megatrain_jax.engine.update.policy import NonFiniteError, UpdatePolicy
from megatrain_jax.loss import DPO, NextToken, Objective, pair_metrics
from megatrain_jax.optim import check_partwise

__all__ = ["DeviceOutOfMemoryError", "Engine", "EngineConfig", "NonFiniteError", "StepOutput"]


@dataclasses.dataclass
class StepOutput:
    """One optimizer step's results, still on the device: read them after the next step is launched."""

    step: int
    loss: jax.Array
    grad_norm: jax.Array
    tokens: int
    dispatch_s: float  # host time spent issuing the step's work
    aux_loss: jax.Array | None = None  # a routed model's load-balancing loss, included in ``loss``
    pair_stats: jax.Array | None = None  # a pair objective's summed statistics (``megatrain_jax.loss.DPO.stats``)
    # the tokens whose loss counts (their loss mask not 0; ``tokens`` counts padding and prompts too); None with
    # several processes, each of which sees its own rows only
    loss_tokens: int | None = None

    def resolve(self) -> dict[str, float]:
        """The step's metrics as numbers; a routed model's also give ``aux_loss`` (the load-balancing term of
        ``loss``) and ``lm_loss`` (``loss`` without it: the next-token loss); preference training's give the
        rewards of its pairs (``megatrain_jax.loss.pair_metrics``)."""
        loss, norm = float(local_value(self.loss)), float(local_value(self.grad_norm))
        out = {"step": self.step, "loss": loss, "grad_norm": norm, "tokens": self.tokens,
               "dispatch_s": self.dispatch_s, "skipped": not (math.isfinite(loss) and math.isfinite(norm))}
        if self.loss_tokens is not None:
            out["loss_tokens"] = self.loss_tokens
        if self.aux_loss is not None:
            aux = float(local_value(self.aux_loss))
            out.update(aux_loss=aux, lm_loss=loss - aux)
        if self.pair_stats is not None:
            out.update(pair_metrics(local_value(self.pair_stats)))
        return out


class Engine:
    """Streams a layered model through one or more devices, with all persistent state in host memory.

    ``devices`` (a list of devices, or a ``jax.sharding.Mesh`` with the one axis ``data``) defaults to every
    local GPU (``transfer.default_devices``; every process's devices under ``jax.distributed``). Over
    several devices the host state is spread over them (``transfer.Placement``), each micro-batch's rows
    are split between them, and each device computes on its rows with the layer's weights all-gathered
    and its gradients reduce-scattered (``device_fns``): data parallelism with one copy of the state.

    ``objective`` is the loss (``megatrain_jax.loss``): the next-token loss, or ``DPO`` (batches of (chosen,
    rejected) row pairs with ``Batch.ref_logps``, from ``row_logps`` of the untrained model; ``check_pairs``).

    ``step(batches)`` runs one optimizer step on ``accumulate_steps`` batches and returns a ``StepOutput``
    without waiting for the device; ``steps(data)`` is the public iterator that yields each step's
    metrics one step late, so the host never waits on the device to log.
    """

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
                 config: EngineConfig = EngineConfig(), *, seed: int = 0,
                 devices: Sequence[jax.Device] | Mesh | None = None, placement: Placement | None = None,
                 init_from=None, objective: Objective = NextToken()):
        enable_compilation_cache()  # per-user persistent cache, unless configured otherwise (_environment)
        for field in ("resident_layers", "kept_layers", "gpu_updated_layers", "gpu_updated_io"):
            if getattr(config, field) == AUTO:
                raise ValueError(f"EngineConfig({field}='auto') is resolved by the plan, before the engine: "
                                 f"megatrain-jax train and plan do it (megatrain_jax.plan.resolve returns the "
                                 f"config with the value); an Engine takes a value")
        self.lm = layered(model)
        self.cfg = config
        if config.resident_layers > self.lm.n_blocks:
            raise ValueError(f"resident_layers={config.resident_layers} exceeds the model's {self.lm.n_blocks} blocks")
        if config.offload_activations > self.lm.n_blocks:
            raise ValueError(f"offload_activations={config.offload_activations} exceeds the model's "
                             f"{self.lm.n_blocks} blocks; use at most {max(self.lm.n_blocks - config.prefetch_depth, 0)} "
                             f"(the last prefetch_depth blocks' inputs go straight to their backward)")
        config.check_layers(self.lm.n_blocks)
        check_partwise(optimizer)
        roles = HostRoles.of_config(self.lm.n_blocks, config)  # checked before the state is built
        if placement is None:
            placement = Placement(mesh=devices) if isinstance(devices, Mesh) else Placement(devices)
        self.placement = placement
        moe = getattr(getattr(model, "cfg", None), "moe", None)
        if moe is not None and moe.capacity_factor is not None and config.micro_batches * placement.size > 1:
            raise ValueError(f"moe.capacity_factor={moe.capacity_factor} caps each expert per call of a block, which "
                             f"here sees 1/{config.micro_batches * placement.size} of the batch "
                             f"(micro_batches={config.micro_batches} x {placement.size} device(s)), so it would drop "
                             f"other tokens than the whole-batch model does. Use micro_batches = 1 on one device "
                             f"with a capacity factor, or leave capacity_factor unset (dropless)")
        stream_dtype = jnp.dtype(streamed_dtype(config, getattr(model.cfg, "dtype", "float32")))
        self._observers: list = []
        self.policy = UpdatePolicy(optimizer, self.placement, stream_dtype, config, self._observers,
                                   split=() if config.norm_first else roles.splitting(config.split_parts))
        if not isinstance(objective, (NextToken, DPO)):
            raise TypeError(f"objective must be megatrain_jax.loss.NextToken() or DPO(...), got {objective!r}")
        self.objective = objective
        self.fns = device_fns(self.lm, self.placement, objective)
        self.state = initial_state(model, self.placement, nnx.Rngs(seed).params(), self.policy.opt.fresh,
                                   self.policy.opt.home, init_from=init_from)
        for part in self.state.ids():
            self.policy.opt.route(self.state[part])  # decide each part's update route now, not mid-step
        self.resident_parts = ([IO] if config.resident_io else []) + [PartId.block(i) for i in range(config.resident_layers)]
        self.grads_on_gpu_parts = list(roles.grads_on_gpu)  # their gradients wait on the GPU
        self.gpu_updated_parts = list(roles.gpu_updated)  # streamed, updated on the GPU at their next forward
        self._roles = roles
        self.disk_tier = None
        if roles.disk:
            if not self.policy.opt.fused:
                raise ValueError("the disk tier (disk_parts) holds the moments of megatrain_jax.adamw run by the "
                                 "fused host kernel; this optimizer or machine runs another route")
            self.disk_tier = DiskTier(config.disk_dir, roles.disk)
            for part in self.disk_tier.parts:  # a fresh state's moments are zeros: files created empty
                self.state[part] = self.disk_tier.spill(part, self.state[part], fresh=True)
            self.policy.use_disk_tier(self.disk_tier)
        for part in self.gpu_updated_parts:  # their state crosses PCIe each step: pinned, as it comes home
            self.state[part] = self._pinned(self.state[part])
        self._resident: dict[PartId, Part] = {}
        self._load_resident()
        self._runner = PassRunner(self.fns, self.placement, self.state, self.policy, self._resident, self._observers,
                                  grads_on_gpu=self.grads_on_gpu_parts, host_grad_dtype=config.host_grad_dtype,
                                  gpu_updated=self.gpu_updated_parts, device_grad_dtype=config.device_grad_dtype)
        self.last_seq_len = 0

    # ------------------------------------------------------------------ training
    def check(self, batches: Sequence[Batch]) -> None:
        """Every check that can fail, before anything is sent to the device."""
        if len(batches) != self.cfg.accumulate_steps:
            raise ValueError(f"one optimizer step takes accumulate_steps={self.cfg.accumulate_steps} "
                             f"batches, got {len(batches)}")
        for batch in batches:
            self.check_batch(batch)

    def check_batch(self, batch: Batch) -> None:
        """Raise ValueError saying what to fix unless ``batch`` fits the model and the micro-batching."""
        check_batch(batch, self.lm.vocab_size, self.lm.max_positions, self.lm.segments_per_row)
        self.cfg.check_rows(batch.shape[0], len(self.placement.local_devices))
        if self.objective.pairs:
            self.check_pairs(batch)

    def check_pairs(self, batch: Batch) -> None:
        """A pair objective's batch (``DPO``): each micro-batch of each device holds whole (chosen, rejected)
        pairs, each row has its reference log-probability, and each has response tokens to score."""
        self.cfg.check_rows(batch.shape[0], len(self.placement.local_devices), pairs=True)
        if batch.ref_logps is None:
            raise ValueError("preference training needs each row's reference log-probability (Batch.ref_logps): "
                             "compute them once before training with Engine.row_logps on the untrained model")
        mask = np.ones(batch.shape) if batch.loss_mask is None else np.asarray(batch.loss_mask)
        empty = np.flatnonzero(mask.sum(axis=1) == 0)
        if empty.size:
            raise ValueError(f"row {int(empty[0])} of a preference batch has no response token in its loss_mask "
                             f"({empty.size} such rows): every chosen and rejected row needs one")

    def step(self, batches: Batch | Sequence[Batch]) -> StepOutput:
        batches = [batches] if isinstance(batches, Batch) else list(batches)
        self.check(batches)
        with reported_late():
            self.policy.check()  # a too-long run of non-finite steps stops training here
        self.last_seq_len = batches[0].shape[1]
        self._home_at = None  # the resident parts change on the device from here on
        in_loss = (sum(b.tokens if b.loss_mask is None else int(np.count_nonzero(b.loss_mask)) for b in batches)
                   if self.placement.processes == 1 else None)  # each process sees its own rows only
        t0 = time.perf_counter()
        losses, auxes, pair_stats = [], [], []
        self._runner.begin_step()
        passes = step_passes(self.lm.n_blocks, self.cfg, self._roles)  # the step's op lists, pass by pass
        try:
            for j, batch in enumerate(batches):
                micro = device_batches(self.placement, batch.filled(), self.cfg.micro_batches)
                pairs = sum(b.inputs.shape[0] for b in micro) // 2 if self.objective.pairs else 0
                new_pass = functools.partial(
                    Pass, micro, self.fns.inv_count([b.loss_mask for b in micro]), accumulate=j > 0,
                    inv_pairs=jnp.float32(1.0 / pairs) if pairs else None,
                    last=j == len(batches) - 1, keep_residuals=self.cfg.keep_residuals,
                    kept_from=self.lm.n_blocks - self.cfg.kept_layers if self.cfg.kept_layers else None)
                p = new_pass(keeps_forward=self.cfg.norm_first)
                if self.cfg.norm_first:  # the norm first, then the same gradients again, each updating its part
                    self._runner.run(p, passes[0])  # the second runs no forward: it takes the first's
                    second = new_pass(norm_known=True, decision=p.decision, **p.hand_on())
                    self._runner.run(second, passes[1])
                else:
                    # the first pass's forward runs the GPU-updated parts' updates of the step before
                    self._runner.run(p, passes[j])
                losses.append(sum(p.losses))
                auxes.append(p.aux)
                pair_stats.append(p.pair_stats)
        except DeviceOutOfMemoryError as err:
            err.step = int(self.state.step)
            err.add_note(f"step {err.step + 1} ran out of {err.memory} in {err.phase} " + (
                "after its update began: parts hold different steps; resume from the last saved checkpoint"
                if err.updated else f"before any part was updated: the state is that of step {err.step}"))
            raise
        self.state.step += 1
        tokens = sum(b.tokens for b in batches) * self.placement.processes  # each process feeds its own rows
        aux = None if auxes[0] is None else sum(auxes) / len(auxes)
        stats = None if pair_stats[0] is None else sum(pair_stats)
        return StepOutput(self.state.step, sum(losses) / len(losses), self._runner.decision.norm, tokens,
                          time.perf_counter() - t0, aux, stats, in_loss)

    def steps(self, data: Iterable[Batch], profile_step: int | None = None) -> Iterator[dict[str, float]]:
        """Run a step per ``accumulate_steps`` batches of ``data``; yield metrics one step late. A step's
        ``step_time_s`` is the gap between its results and the previous step's on the device (``StepClock``).

        ``profile_step`` (numbered as the metrics' ``step``, from 1): that step runs serialized under a
        ``Profile`` (each op waited for before the next is dispatched) and its metrics gain ``profiled`` = 1 and
        its seconds per lane: ``profile_serialized_s`` (the whole serialized step, pending updates included),
        ``profile_compute_s``, ``profile_h2d_s``, ``profile_d2h_s``, ``profile_host_update_s`` and
        ``profile_device_update_s`` (``Profile.lanes``): where a step's time goes, lane by lane against the
        step-time model's busy queues. The numbers trained are the same; that step (and its timing) is slower."""
        pending, clock = None, StepClock()
        group: list[Batch] = []
        extra: dict[int, dict[str, float]] = {}  # a profiled step's lanes, by step

        def metrics(out: StepOutput) -> dict[str, float]:
            m = _metrics(out, clock)
            m.update(extra.pop(out.step, {}))
            return m

        try:
            for batch in data:
                group.append(batch)
                if len(group) < self.cfg.accumulate_steps:
                    continue
                try:
                    with reported_late():
                        if profile_step is not None and int(self.state.step) + 1 == profile_step:
                            out, lanes = self._profiled_step(group, pending)
                            extra[out.step] = lanes
                        else:
                            out = self.step(group)
                        group = []
                    clock.watch(out.step, (out.loss, out.grad_norm))
                except DeviceOutOfMemoryError as err:
                    if pending is not None and not err.updated:  # the last whole step's metrics, not yet reported
                        try:
                            with reported_late():
                                err.pending_metrics = metrics(pending)
                        except DeviceOutOfMemoryError:  # the last step's own work failed too: nothing is whole
                            err.updated = True
                    raise
                if pending is not None:
                    with reported_late():
                        m = metrics(pending)
                    yield m
                pending = out
            if pending is not None:
                with reported_late():
                    m = metrics(pending)  # before the sync: parts coming home are not the step's work
                    self.sync()
                yield m
        finally:
            clock.close()

    def _profiled_step(self, batches: Sequence[Batch], previous: StepOutput | None) -> tuple[StepOutput, dict[str, float]]:
        """``step`` under a ``Profile``, started once the ``previous`` step's work is done (its host updates and
        its GPU work: else the first fetches would count the wait for them) and waited for to its own last host
        update: the output and its lanes."""
        self.policy.drain()
        jax.block_until_ready((None if previous is None else previous.loss, list(self._resident.values())))
        profile = Profile()
        self.observe(profile)
        t = time.perf_counter()
        try:
            out = self.step(batches)
            jax.block_until_ready((out.loss, list(self._resident.values())))
            self.policy.drain()  # not sync(): the resident parts' copy home is not the step's work
        finally:
            self.stop_observing(profile)
        lanes = {f"profile_{lane}_s": seconds for lane, seconds in profile.lanes(self.resident_parts).items()}
        return out, {"profiled": 1.0, "profile_serialized_s": time.perf_counter() - t, **lanes}

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far for a non-finite loss or gradient norm (counted as their updates run)."""
        return self.policy.skipped_steps

    def last_step_skipped(self) -> bool:
        """Whether the state's last step was skipped (a non-finite loss or gradient norm): its parameters are then
        the last good step's under a later step number, and a diverging run's (checkpoints are never saved from it).
        Waits for the pending updates (``sync``)."""
        self.sync()
        return self.policy.nonfinite_in_row > 0

    # ------------------------------------------------------------------ evaluation
    def eval_nll(self, batches: Sequence[Batch]) -> tuple[float, float]:
        """The summed masked next-token loss of the current parameters over ``batches`` and the number of
        tokens it counts, streamed like training's forward (no gradients, no update)."""
        nll = count = 0.0
        for micro, p in self._evaluated(batches, per_row=False):
            nll += float(local_value(sum(p.losses)))
            count += float(local_value(self.fns.mask_sum([m.loss_mask for m in micro])))
        return nll, count

    def row_logps(self, batches: Sequence[Batch]) -> np.ndarray:
        """Each row's summed log-probability of its masked targets under the current parameters (float32, the
        rows of ``batches`` in order), streamed like evaluation: preference training's reference pass
        (``Batch.ref_logps``), run once on the untrained model."""
        out = [-np.asarray(local_rows(x), np.float32) for _, p in self._evaluated(batches, per_row=True)
               for x in p.losses]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _evaluated(self, batches: Sequence[Batch], per_row: bool) -> Iterator[tuple[list[Batch], Pass]]:
        """Each batch's forward with the current parameters: its micro-batches and the evaluation pass that
        ran over them (``Pass.losses``: the micro-batches' summed NLLs, or with ``per_row`` each row's)."""
        self.sync()  # host updates may run in place on the worker: read the parameters once they are done
        devices = len(self.placement.local_devices)
        for batch in batches:
            check_batch(batch, self.lm.vocab_size, self.lm.max_positions, self.lm.segments_per_row)
            if batch.shape[0] % devices:
                raise ValueError(f"an evaluation batch of {batch.shape[0]} rows cannot be split over the {devices} "
                                 f"devices of this process; use a batch size divisible by {devices}")
            n_micro = self.cfg.micro_batches if self.cfg.splits(batch.shape[0], devices) else 1
            micro = device_batches(self.placement, batch.filled(), n_micro)
            p = Pass(micro, keep_inputs=False, per_row=per_row)
            self._runner.run(p, eval_ops(self.lm.n_blocks, n_micro, self.cfg.prefetch_depth))
            yield micro, p

    # ------------------------------------------------------------------ reading and restoring state
    def sync(self) -> None:
        """Wait for every pending host update (re-raising NonFiniteError), run the GPU-updated parts' pending
        updates (``gpu_updated_layers``: each at its next fetch otherwise) and copy GPU-resident parts back:
        host state is then current. Each resident part is written into its own host arrays, a leaf at a time
        (``HostOptimizer.home_into``), once the update gates let it (a checkpoint still writing it); a part
        already home since its last step is not copied again (``steps`` ends with a sync, and
        ``parameters`` syncs again)."""
        self.policy.drain()
        self._runner.flush()
        if self.disk_tier is not None:
            self.disk_tier.flush()
        if self._home_at == self.state.step:
            return
        for part, on_device in self._resident.items():
            self.policy.pass_gates(part)
            self.state[part] = self.policy.opt.home_into(self.state[part], self.policy.device.with_copy(on_device))
        self._home_at = self.state.step

    def close(self) -> None:
        """Finish pending work and release what outlives a step: the disk tier's files are deleted (they are
        this engine's live state; checkpoints hold copies). The engine cannot train afterwards."""
        self.policy.drain()
        self._runner.close()  # the GPU-updated parts' pending updates run; the thread bringing their state stops
        if self.disk_tier is not None:
            self.disk_tier.remove()

    def parameters(self) -> tuple[Params, list[Params]]:
        """The master parameters once every pending update is done, as ``(io, [block 0, block 1, ...])`` in
        host memory (float32; capacity mode's bfloat16). They are the engine's own: read, do not change."""
        self.sync()
        return self.state.params()

    def write_back(self, model: nnx.Module) -> None:
        """Copy the master parameters into the user's model, as float32 (capacity mode's are bfloat16)."""
        io, blocks = jax.tree.map(lambda x: x.astype(jnp.float32), self.parameters())
        write_back(model, io, blocks, self.placement.to_device)

    def hold_updates(self, gate: Callable[[PartId], None]) -> Callable[[], None]:
        """Call ``gate(part)`` on the update thread before a host part's masters or moments change (in
        place, or by replacing and donating them); a checkpoint writer holds a part there until it has
        written it. Returns the function that removes the gate."""
        return self.policy.hold(gate)

    def restore_part(self, part: PartId, params: Params, opt: Any) -> None:
        """Install a part's masters and optimizer state, e.g. read from a checkpoint; its stream copy is
        recomputed from the masters. Numpy arrays given here become the engine's own (do not change them
        afterwards); each array is placed in pinned or pageable host memory (``HostOptimizer.home``)."""
        self.policy.drain()
        self._runner.forget(part)  # a GPU-updated part's pending update was of the record being replaced
        self.state[part] = self.policy.opt.home(Part(params, opt, self.policy.opt.cast(params)), adopt=True)
        if self.disk_tier is not None and part in self.disk_tier.parts:
            self.state[part] = self.disk_tier.spill(part, self.state[part])
        if part in self.gpu_updated_parts:
            self.state[part] = self._pinned(self.state[part])

    def _pinned(self, part: Part) -> Part:
        """A GPU-updated part's record with its masters and moments in pinned host memory: they cross PCIe
        each step (``gpu_updated_layers``), and come home pinned."""
        return Part(self.placement.to_pinned(part.params), self.placement.to_pinned(part.opt), part.stream)

    def restored(self, step: int) -> None:
        """Finish a restore: the state is at optimizer step ``step``; GPU-resident parts reload from it."""
        self.policy.drain()
        self.state.step = int(step)
        self._load_resident()

    def _load_resident(self) -> None:
        self._resident.clear()
        self._resident.update({part: self.policy.device.load(self.state[part]) for part in self.resident_parts})
        self._home_at = self.state.step  # the host state is what the device parts were loaded from

    # ------------------------------------------------------------------ observers
    def observe(self, observer) -> None:
        """Add an observer (``megatrain_jax.engine.observers``): it sees every op and host-worker task from now on."""
        self._observers.append(observer)

    def stop_observing(self, observer) -> None:
        self._observers.remove(observer)

    @property
    def update_route(self) -> str:
        """How host parts' updates run: ``fused`` (the C++ AdamW), ``host`` (XLA on pinned-host arrays) or
        ``device`` (state moved to the accelerator and back); see ``megatrain_jax.engine.update.host_optimizer``."""
        routes = {self.policy.opt.route(self.state[p]) for p in self.state.ids()}
        return "+".join(sorted(routes))


def _metrics(out: StepOutput, clock: StepClock) -> dict[str, float]:
    m = out.resolve()
    m["step_time_s"] = clock.seconds(out.step)
    m["tokens_per_s"] = m["tokens"] / m["step_time_s"]
    if "loss_tokens" in m:
        m["loss_tokens_per_s"] = m["loss_tokens"] / m["step_time_s"]
    return m
