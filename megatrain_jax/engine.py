"""The streamed engine: walks the schedule, moving parts between host and device and running the
per-part jitted functions. Host memory holds all persistent state; the device holds only the layers
in flight, the io part, gradients being accumulated and layer-boundary activations."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megatrain_jax.batch import Batch, check_batch
from megatrain_jax.device_fns import device_fns
from megatrain_jax.host_optimizer import HostOptimizer, clip_scale
from megatrain_jax.host_updater import HostUpdater
from megatrain_jax.resident import ResidentUpdater
from megatrain_jax.host_state import HostState, master_params
from megatrain_jax.layered import layered, write_back
from megatrain_jax.schedule import Op, step_ops
from megatrain_jax.transfer import Placement


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How a step is run. ``micro_batches`` bounds transient activation memory only: weights cross
    PCIe twice per step whatever it is. ``accumulate_steps`` batches make one optimizer step.
    ``stream_dtype`` is the dtype of the weights sent to the device (None: the model's compute dtype).
    A step whose loss or gradient norm is not finite is skipped (state unchanged); more than
    ``max_nonfinite_steps`` in a row stop training with ``NonFiniteError``. ``host_kernel=False`` forces
    the JAX host optimizer even for ``megatrain_jax.adamw``. ``resident_layers`` (the first blocks) and
    ``resident_io`` keep parts on the GPU with their optimizer state (see ``megatrain_jax.resident``):
    faster when GPU memory allows, about 18 bytes per parameter. ``split_update`` (fused AdamW with a
    bfloat16 stream copy only) computes, right after the norm, just the bfloat16 weights the next forward
    needs, and writes the fp32 masters and moments in a second pass off the critical path: the same
    values bit for bit, with the next forward waiting on 18 instead of 30 bytes of host traffic per
    parameter."""

    micro_batches: int = 1
    prefetch_depth: int = 1
    clip_norm: float | None = 1.0
    accumulate_steps: int = 1
    stream_dtype: str | None = None
    max_nonfinite_steps: int = 10
    host_kernel: bool = True
    resident_layers: int = 0
    resident_io: bool = False
    split_update: bool = True

    def __post_init__(self) -> None:
        for name in ("micro_batches", "prefetch_depth", "accumulate_steps", "max_nonfinite_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"EngineConfig.clip_norm must be positive or None, got {self.clip_norm!r}")
        if not isinstance(self.resident_layers, int) or self.resident_layers < 0:
            raise ValueError(f"EngineConfig.resident_layers must be an integer >= 0, got {self.resident_layers!r}")
        if self.stream_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"EngineConfig.stream_dtype must be None, 'float32' or 'bfloat16', "
                             f"got {self.stream_dtype!r}")


# What each op is, for the time breakdown.
_CATEGORY = {"fetch_io": "h2d", "fetch": "h2d", "embed": "compute", "forward": "compute", "head": "compute",
             "backward": "compute", "embed_backward": "compute", "grad_norm": "compute",
             "send_grads": "d2h", "send_io_grads": "d2h", "update_io": "optimizer", "update": "optimizer",
             "commit": "optimizer"}


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a non-finite loss or gradient norm; host state is the last good one."""


@dataclasses.dataclass
class StepOutput:
    """One optimizer step's results, still on the device: read them after the next step is launched."""

    step: int
    loss: jax.Array
    grad_norm: jax.Array
    tokens: int
    dispatch_s: float  # host time spent issuing the step's work

    def resolve(self) -> dict[str, float]:
        loss, norm = float(self.loss), float(self.grad_norm)
        return {"step": self.step, "loss": loss, "grad_norm": norm, "tokens": self.tokens,
                "dispatch_s": self.dispatch_s, "skipped": not (math.isfinite(loss) and math.isfinite(norm))}


@dataclasses.dataclass
class _Pass:
    """Device-side values of one forward+backward pass."""

    micro: list[Batch]
    device_batches: list[Any]
    io: Any = None
    resident: dict[int, Any] = dataclasses.field(default_factory=dict)
    acts: dict[int, list] = dataclasses.field(default_factory=dict)  # layer -> inputs per micro-batch
    dy: list = dataclasses.field(default_factory=list)
    grads: Any = None
    io_grads: Any = None
    losses: list = dataclasses.field(default_factory=list)


class Engine:
    """Streams a layered model through one device, with all persistent state in pinned host memory.

    ``step(batches)`` runs one optimizer step on ``accumulate_steps`` batches and returns a ``StepOutput``
    without waiting for the device; ``steps(data)`` is the public iterator that yields each step's
    metrics one step late, so the host never waits on the device to log.
    """

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
                 config: EngineConfig = EngineConfig(), *, seed: int = 0, placement: Placement | None = None):
        self.lm = layered(model)
        self.cfg = config
        self.placement = placement or Placement()
        compute_dtype = getattr(model.cfg, "dtype", "float32")
        stream_dtype = jnp.dtype(config.stream_dtype or compute_dtype)
        self.opt = HostOptimizer(optimizer, self.placement, stream_dtype, use_kernel=config.host_kernel)
        self.updater = HostUpdater()
        # Called with the part index (-1: io) on the update thread just before a host part is updated in
        # place; a checkpoint writer uses it to hold updates until it has written that part.
        self.update_guards: list[Callable[[int], None]] = []
        self.skipped_steps = 0
        self._nonfinite_in_row = 0
        self.fns = device_fns(self.lm)
        io, blocks = master_params(model, self.placement, nnx.Rngs(seed).params())
        self.state = HostState(
            io=io, blocks=blocks, io_opt=self.opt.init(io), blocks_opt=[self.opt.init(b) for b in blocks],
            stream_io=self.opt.cast(io), stream_blocks=None if self.opt.stream_dtype is None
            else [self.opt.cast(b) for b in blocks], step=0)
        self._clip = jax.jit(lambda sq, loss: clip_scale(sq, config.clip_norm, config.accumulate_steps)
                             + (jnp.isfinite(loss) & jnp.isfinite(jnp.sqrt(sum(sq))),))
        if config.resident_layers > self.lm.n_blocks:
            raise ValueError(f"resident_layers={config.resident_layers} exceeds the model's {self.lm.n_blocks} blocks")
        self.resident_parts = ([-1] if config.resident_io else []) + list(range(config.resident_layers))
        self._res = ResidentUpdater(optimizer, self.placement, self.opt.stream_dtype)
        self.resident: dict[int, Any] = {}
        self._load_resident()
        self._split = config.split_update and self.opt.splits
        self._commits: list[tuple[int, Callable[[], None]]] = []  # second halves of this step's split updates
        self._host_grads: list[Any] = [None] * (self.lm.n_blocks + 1)  # index -1 is the io part
        self._sq_norms: list[Any] = [None] * (self.lm.n_blocks + 1)
        self.last_seq_len = 0
        self.profile: dict[str, float] | None = None  # set to {} to time each op category (syncs!)
        self.timeline = None  # set_timeline(Timeline()) records when ops ran (no syncs; diagnosis)

    # ------------------------------------------------------------------ public API
    def check(self, batches: Sequence[Batch]) -> None:
        """Every check that can fail, before anything is sent to the device."""
        if len(batches) != self.cfg.accumulate_steps:
            raise ValueError(f"one optimizer step takes accumulate_steps={self.cfg.accumulate_steps} "
                             f"batches, got {len(batches)}")
        for batch in batches:
            check_batch(batch, self.lm.vocab_size, self.lm.max_positions)
            if batch.shape[0] % self.cfg.micro_batches:
                raise ValueError(f"batch of {batch.shape[0]} rows cannot be split into micro_batches="
                                 f"{self.cfg.micro_batches}; use a batch size divisible by it")

    def step(self, batches: Batch | Sequence[Batch]) -> StepOutput:
        batches = [batches] if isinstance(batches, Batch) else list(batches)
        self.check(batches)
        self.updater.poll(-2)  # a too-long run of non-finite steps stops training here
        self.last_seq_len = batches[0].shape[1]
        t0 = time.perf_counter()
        losses = []
        for j, batch in enumerate(batches):
            losses.append(self._run_pass(batch.filled(), sub_step=j, last=j == len(batches) - 1))
        loss = sum(losses) / len(losses)
        self.state.step += 1
        return StepOutput(self.state.step, loss, self._norm, sum(b.tokens for b in batches),
                          time.perf_counter() - t0)

    def steps(self, data: Iterable[Batch]) -> Iterator[dict[str, float]]:
        """Run a step per ``accumulate_steps`` batches of ``data``; yield metrics one step late."""
        pending, t_last = None, time.perf_counter()
        group: list[Batch] = []
        for batch in data:
            group.append(batch)
            if len(group) < self.cfg.accumulate_steps:
                continue
            out, group = self.step(group), []
            if pending is not None:
                m = self._metrics(pending, t_last)
                t_last = time.perf_counter()
                yield m
            pending = out
        if pending is not None:
            self.sync()
            yield self._metrics(pending, t_last)

    def sync(self) -> None:
        """Wait for every pending host update (re-raising NonFiniteError) and copy GPU-resident parts back:
        host state is then current."""
        self.updater.wait_all()
        s = self.state
        for i, part in self.resident.items():
            if i == -1:
                s.io, s.io_opt, s.stream_io = self._res.to_host(part)
            else:
                s.blocks[i], s.blocks_opt[i], stream = self._res.to_host(part)
                if s.stream_blocks is not None:
                    s.stream_blocks[i] = stream

    def load_state(self, state: HostState) -> None:
        """Replace the host state (e.g. restored from a checkpoint) and reload GPU-resident parts from it."""
        self.updater.wait_all()
        self.state = state
        self._load_resident()

    def _load_resident(self) -> None:
        s = self.state
        self.resident = {i: self._res.load(s.io, s.io_opt) if i == -1 else self._res.load(s.blocks[i], s.blocks_opt[i])
                         for i in self.resident_parts}

    def write_back(self, model: nnx.Module) -> None:
        """Copy the float32 master parameters into the user's model."""
        self.sync()
        write_back(model, self.state.io, self.state.blocks, self.placement.to_device)

    def set_timeline(self, timeline) -> None:
        """Record host ops, device readiness and host-update tasks into ``timeline`` (None: stop)."""
        self.timeline = timeline
        self.updater.timeline = timeline

    # ------------------------------------------------------------------ one pass
    def _metrics(self, out: StepOutput, t_prev: float) -> dict[str, float]:
        m = out.resolve()
        m["step_time_s"] = time.perf_counter() - t_prev
        m["tokens_per_s"] = m["tokens"] / m["step_time_s"]
        return m

    def _run_pass(self, batch: Batch, sub_step: int, last: bool) -> jax.Array:
        micro = batch.split(self.cfg.micro_batches)
        p = _Pass(micro=micro, device_batches=[self.placement.to_device(m) for m in micro])
        self._sub_step, self._last = sub_step, last
        try:
            self._walk(p, step_ops(self.lm.n_blocks, len(micro), self.cfg.prefetch_depth, update=last))
        finally:
            # A step cut short after some first halves were queued still queues their second halves, so
            # masters, moments and stream copies never disagree (and no stale task joins a later step).
            if self._commits:
                self._op_commit(p, None)
        return sum(p.losses)

    def _walk(self, p: _Pass, ops: list[Op]) -> None:
        for op in ops:
            t = time.perf_counter() if self.profile is not None else 0.0
            t_op = time.perf_counter() if self.timeline is not None else 0.0
            out = getattr(self, f"_op_{op.kind}")(p, op)
            if self.timeline is not None:
                self.timeline.op(op.kind, op.layer, op.micro, t_op, time.perf_counter(), out)
            if self.profile is not None and op.kind in _CATEGORY:
                if op.kind == "commit":
                    self.updater.wait_all()
                elif op.kind.startswith("update"):  # op.layer is -1 for the io part
                    if op.layer in self.resident:
                        jax.block_until_ready(self.resident[op.layer])
                    else:
                        self.updater.wait(op.layer)
                else:
                    jax.block_until_ready(out)
                key = _CATEGORY[op.kind]
                self.profile[key] = self.profile.get(key, 0.0) + time.perf_counter() - t

    def _op_fetch_io(self, p: _Pass, op: Op):
        if -1 in self.resident:
            p.io = self.resident[-1].stream
            return p.io
        self.updater.wait(-1)
        self.updater.poll(("commit", -1))
        p.io = self.placement.to_device(self.state.params_for_stream(None))
        return p.io

    def _op_release_io(self, p: _Pass, op: Op):
        p.io = None

    def _op_fetch(self, p: _Pass, op: Op):
        if op.layer in self.resident:
            p.resident[op.layer] = self.resident[op.layer].stream
            return p.resident[op.layer]
        self.updater.wait(op.layer)
        self.updater.poll(("commit", op.layer))  # a failed second half stops training here, not later
        p.resident[op.layer] = self.placement.to_device(self.state.params_for_stream(op.layer))
        return p.resident[op.layer]

    def _op_release(self, p: _Pass, op: Op):
        del p.resident[op.layer]

    def _op_embed(self, p: _Pass, op: Op):
        x = self.fns.embed(p.io, p.device_batches[op.micro].inputs)
        p.acts.setdefault(0, []).append(x)
        return x

    def _op_forward(self, p: _Pass, op: Op):
        b = p.device_batches[op.micro]
        y = self.fns.forward(p.resident[op.layer], p.acts[op.layer][op.micro], b.positions, b.segment_ids)
        p.acts.setdefault(op.layer + 1, []).append(y)
        return y

    def _op_head(self, p: _Pass, op: Op):
        b = p.device_batches[op.micro]
        if op.micro == 0:
            self._inv_count = 1.0 / max(float(sum(np.sum(mb.loss_mask) for mb in p.micro)), 1.0)
        loss, dx, p.io_grads = self.fns.head(p.io, p.acts[self.lm.n_blocks][op.micro], b.targets, b.loss_mask,
                                             np.float32(self._inv_count), p.io_grads)
        p.losses.append(loss)
        p.dy.append(dx)
        if op.micro == len(p.micro) - 1:
            del p.acts[self.lm.n_blocks]
        return dx

    def _op_backward(self, p: _Pass, op: Op):
        b = p.device_batches[op.micro]
        x = p.acts[op.layer][op.micro]
        p.dy[op.micro], p.grads = self.fns.backward(p.resident[op.layer], x, b.positions, b.segment_ids,
                                                    p.dy[op.micro], p.grads)
        if op.layer > 0 and op.micro == len(p.micro) - 1:
            del p.acts[op.layer]  # layer 0's inputs are the embeddings, still needed by embed_backward
        return p.dy[op.micro]

    def _send(self, index: int, grads: Any):
        """Gradients of one part to host memory, summed with earlier sub-steps' when accumulating."""
        if self._sub_step > 0:
            earlier = self._host_grads[index]
            grads = self.fns.add(grads, earlier if index in self.resident else self.placement.to_device(earlier))
        if self._last:
            self._sq_norms[index] = self.fns.sq_norm(grads)
        # GPU-resident parts keep their gradients on the device.
        self._host_grads[index] = grads if index in self.resident else self.placement.to_host(grads)
        return self._host_grads[index]

    def _op_send_grads(self, p: _Pass, op: Op):
        out, p.grads = self._send(op.layer, p.grads), None
        return out

    def _op_embed_backward(self, p: _Pass, op: Op):
        b = p.device_batches[op.micro]
        p.io_grads = self.fns.embed_backward(p.io, b.inputs, p.dy[op.micro], p.io_grads)
        if op.micro == len(p.micro) - 1:
            p.acts.clear()
            p.dy = []
        return p.io_grads

    def _op_send_io_grads(self, p: _Pass, op: Op):
        out, p.io_grads = self._send(-1, p.io_grads), None
        return out

    def _op_grad_norm(self, p: _Pass, op: Op):
        loss = sum(p.losses)
        self._norm, self._scale, self._ok = self._clip(self._sq_norms, loss)
        self.updater.submit(-2, lambda norm=self._norm, loss=loss: self._decide(norm, loss))
        return self._scale

    def _decide(self, norm: jax.Array, loss: jax.Array) -> None:
        """Runs first on the update thread for each step: should its updates apply? Counts skipped steps."""
        ok = math.isfinite(float(norm)) and math.isfinite(float(loss))
        self._step_ok = ok
        self._nonfinite_in_row = 0 if ok else self._nonfinite_in_row + 1
        self.skipped_steps += not ok
        if self._nonfinite_in_row > self.cfg.max_nonfinite_steps:
            raise NonFiniteError(f"{self._nonfinite_in_row} consecutive steps had a non-finite loss or "
                                 f"gradient norm (limit max_nonfinite_steps={self.cfg.max_nonfinite_steps}); "
                                 f"host state is the last good step's. Lower the learning rate or check the data")

    def _submit_update(self, part: int, grads: Any) -> Any:
        """Returns the updated part for GPU-resident parts (None for host ones: they update on the thread)."""
        if part in self.resident:  # on the device, right away; a skipped step keeps the old values there
            self.resident[part] = self._res.update(self.resident[part], grads, self._scale, self._ok)
            return self.resident[part]
        scale, s = self._scale, self.state

        def guarded() -> bool:
            if not self._step_ok:
                return False
            for guard in self.update_guards:
                guard(part)
            return True

        def update() -> None:
            if not guarded():
                return
            if part == -1:
                s.io, s.io_opt, s.stream_io = self.opt.update(s.io, s.io_opt, grads, s.stream_io, scale)
                return
            stream = None if s.stream_blocks is None else s.stream_blocks[part]
            s.blocks[part], s.blocks_opt[part], stream = self.opt.update(
                s.blocks[part], s.blocks_opt[part], grads, stream, scale)
            if s.stream_blocks is not None:
                s.stream_blocks[part] = stream

        if not self._split:
            self.updater.submit(part, update)
            return
        count = []

        def first_half() -> None:  # the next forward waits on this one only
            if self._step_ok:
                params, opt, stream = ((s.io, s.io_opt, s.stream_io) if part == -1
                                       else (s.blocks[part], s.blocks_opt[part], s.stream_blocks[part]))
                count.append(self.opt.update_stream(params, opt, grads, stream, scale))

        def second_half() -> None:
            if not count or not guarded():  # first half skipped (non-finite step) or failed (raised there)
                return
            if part == -1:
                s.io, s.io_opt = self.opt.commit(s.io, s.io_opt, grads, scale, count[0])
            else:
                s.blocks[part], s.blocks_opt[part] = self.opt.commit(s.blocks[part], s.blocks_opt[part], grads,
                                                                     scale, count[0])
        self.updater.submit(part, first_half)
        self._commits.append((part, second_half))

    def _op_commit(self, p: _Pass, op: Op):
        """Queue the second halves, last block first: the next backward sends that block's gradients first,
        and the previous ones are released as their part commits."""
        for part, fn in reversed(self._commits):
            self.updater.submit(("commit", part), fn)
        self._commits = []

    def _op_update_io(self, p: _Pass, op: Op):
        out, self._host_grads[-1] = self._submit_update(-1, self._host_grads[-1]), None
        return out

    def _op_update(self, p: _Pass, op: Op):
        out, self._host_grads[op.layer] = self._submit_update(op.layer, self._host_grads[op.layer]), None
        return out
