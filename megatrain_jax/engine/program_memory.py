"""XLA's own memory figures for the per-part programs of a run, read before the run executes them.

The memory plan (``megatrain_jax.plan``) walks the schedule with a ledger of the buffers each op creates
and frees. The one figure it cannot count from shapes is the scratch memory (temp) a compiled program
needs while it runs; on a machine with the GPU at hand, ``program_memory`` compiles each program the
run will call, for the run's micro-batch shape and layout, and reads ``memory_analysis()`` from XLA: the
temp, argument, output and alias bytes, and XLA's own peak. The programs are compiled exactly as the
engine's calls will compile them (the same arguments' shapes, dtypes and shardings), so the first step
finds them compiled and pays nothing twice.

Which programs a step calls, per micro-batch ``m`` of ``M`` over ``D`` devices (``passes``):
``embed``/``forward`` gather a fetched part at ``m = 0`` (``D > 1``); ``head``, ``backward`` and
``embed_backward`` start their float32 gradient accumulator at ``m = 0`` and add to it after; the last
micro-batch's ``backward``/``embed_backward`` sum it over the mesh. A block kept on the GPU from its
forward to its backward (the last ``prefetch_depth`` blocks) is not gathered again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.contract.layered import io_params, layered
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.device_fns import BLOCK_PROGRAMS, Shards, device_fns
from megatrain_jax.engine.precision import streamed_dtype
from megatrain_jax.engine.transfer import Placement

# The op kind each program runs for (the plan's ledger charges a program's temp to that op kind).
OP_KIND = {"embed": "embed", "forward": "forward", "forward_keep": "forward", "forward_products": "forward",
           "head": "head", "backward": "backward", "backward_kept": "backward", "backward_products": "backward",
           "embed_backward": "embed_backward"}


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
    """``memory_analysis()`` of one compiled program, in bytes (per device)."""

    program: str  # a DeviceFns program: "forward", "backward_kept", ...
    variant: str  # which call of it: "gathers the part, starts the accumulator", ...
    temp: int
    argument: int
    output: int
    alias: int  # outputs that reuse donated arguments' buffers
    peak: int  # XLA's own peak estimate of the program (on a GPU; the CPU backend's is not comparable)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """XLA's figures for the programs of one micro-batch shape: ``micro_rows`` rows of ``seq_len`` tokens
    per device, weights streamed as ``stream_dtype``, over ``devices`` GPUs; ``packed`` rows carry
    segment ids."""

    micro_rows: int
    seq_len: int
    stream_dtype: str
    packed: bool
    devices: int
    keep_residuals: bool
    figures: tuple[CompiledFigures, ...]
    keeps_products: bool = False  # the programs of blocks that keep their matrix products were compiled too

    def temp(self, program: str) -> int | None:
        """The largest temp of ``program``'s variants; None where it was not compiled."""
        temps = [f.temp for f in self.figures if f.program == program]
        return max(temps) if temps else None

    def op_temp(self, kind: str) -> int | None:
        """The largest temp of the programs an op of ``kind`` runs (``OP_KIND``); None where none was compiled."""
        temps = [f.temp for f in self.figures if OP_KIND[f.program] == kind]
        return max(temps) if temps else None

    def matches(self, micro_rows: int, seq_len: int, stream_bytes: int, packed: bool, devices: int,
                keep_residuals: bool = False, keeps_products: bool = False) -> bool:
        """Whether these figures are for that micro-batch shape and layout (kept residuals or not, blocks
        that keep their matrix products or not)."""
        return (self.micro_rows, self.seq_len, jnp.dtype(self.stream_dtype).itemsize, self.packed, self.devices,
                self.keep_residuals, self.keeps_products) == (micro_rows, seq_len, stream_bytes, packed, devices,
                                                              keep_residuals, keeps_products)

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "figures"},
                "programs": [f.as_dict() for f in self.figures]}


def program_memory(model: nnx.Module, config: EngineConfig, rows: int, seq_len: int, *, packed: bool = False,
                   placement: Placement | None = None) -> ProgramMemory:
    """Compile the per-part programs one optimizer step of ``config`` calls on batches of ``rows`` x
    ``seq_len`` tokens (this process's rows) and read XLA's memory analysis of each. ``model`` may be
    abstract (``nnx.eval_shape``); nothing runs on the devices. ``placement``: the devices, as the engine
    will use them (default: every local GPU, as ``Engine`` does)."""
    placement = Placement() if placement is None else placement
    config.check_rows(rows, len(placement.local_devices))
    lm = layered(model)
    fns = device_fns(lm, placement)
    stream = jnp.dtype(streamed_dtype(config, getattr(model.cfg, "dtype", "float32")))
    M, D = config.micro_batches, placement.size
    micro = rows * placement.processes // M  # global rows of one micro-batch
    batch = lambda dtype: jax.ShapeDtypeStruct((micro, seq_len), dtype, sharding=placement.rows)  # noqa: E731
    tokens, positions, mask = batch(jnp.int32), batch(jnp.int32), batch(jnp.float32)
    segments = batch(jnp.int32) if packed else None
    figures: list[CompiledFigures] = []

    def fetched(params: Any) -> Any:
        """A part as ``PassRunner.fetch`` hands it to the programs: each device its shard."""
        return fns.fetched(jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, stream, sharding=placement.device_for(a)), params))

    done: dict[tuple[str, str], tuple[Any, Any]] = {}

    def call(name: str, variant: str, params: Any, *args, last: bool = False, kind: int = 0) -> tuple[Any, Any]:
        """As ``DeviceFns``' calls: (outputs, the part whole on every device), compiled, not run (once per
        program and variant; a block program once per kind of block, named in the variant where the model
        has several)."""
        if lm.n_kinds > 1 and name in BLOCK_PROGRAMS:
            variant = f"kind {kind} (model.blocks[{lm.first_of_kind(kind)}]): {variant}"
        if (name, variant) not in done:
            compiled = fns.compiled(name, params, *args, last=last, kind=kind)
            m = compiled.memory_analysis()
            figures.append(CompiledFigures(name, variant, int(m.temp_size_in_bytes), int(m.argument_size_in_bytes),
                                           int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                                           int(getattr(m, "peak_memory_in_bytes", 0) or 0)))
            out = compiled.out_info
            done[name, variant] = (out[0], out[1]) if isinstance(params, Shards) else (out, params)
        return done[name, variant]

    gathers = D > 1
    # The forward: the first micro-batch's call gathers the fetched part (over several devices).
    x, io = call("embed", _variant(gathers), fetched(io_params(model)), tokens, positions, segments)
    if M > 1 and gathers:
        call("embed", _variant(False), io, tokens, positions, segments)
    keep = config.keep_residuals
    # the block programs: as configured, and where the last blocks keep their matrix products, those too
    # (per kind of block that has such a block)
    variants = [("forward_keep" if keep else "forward", "backward_kept" if keep else "backward", keep, set(
        range(lm.n_kinds)))]
    if config.kept_layers:
        variants.append(("forward_products", "backward_products", True,
                         {lm.block_kinds[i] for i in range(lm.n_blocks - config.kept_layers, lm.n_blocks)}))
    blocks, kept = {}, {}  # per (variant, kind of block): its part as the programs return it, its kept residuals
    for forward, _, keeps, kinds in variants:
        for kind in sorted(kinds):
            params = fetched(nnx.state(model.blocks[lm.first_of_kind(kind)], nnx.Param))
            y, blocks[forward, kind] = call(forward, _variant(gathers), params, x, positions, segments, kind=kind)
            if M > 1 and gathers:
                call(forward, _variant(False), blocks[forward, kind], x, positions, segments, kind=kind)
            kept[forward, kind] = None
            if keeps:
                y, kept[forward, kind] = y
            if lm.routes(kind):
                y, stats = y
    extra = ()
    if fns.routed:  # the auxiliary loss's gradient with respect to the blocks' statistics
        extra = (fns.aux.lower(stats).compile().out_info[1],)
    inv_count = fns.inv_count.lower([mask] * M).compile().out_info
    # The head: the first micro-batch starts the io gradient's accumulator, the others add to it.
    (_, dy, io_acc), _ = call("head", _variant(False, first=True), io, y, tokens, mask, inv_count, None)
    if M > 1:
        call("head", _variant(False, first=False), io, y, tokens, mask, inv_count, io_acc)
    # The backward: blocks fetched again (gathered by the first micro-batch), or kept on the GPU from
    # their forward (the last prefetch_depth blocks); the last micro-batch sums the gradient over the mesh.
    for forward, backward, keeps, kinds in variants:
        for kind in sorted(kinds):
            before = (x, positions, segments) + ((kept[forward, kind],) if keeps else ())
            for fresh in ([True, False] if gathers else [False]):
                acc = None
                for first, last in _calls(M, D):
                    params = (fetched(nnx.state(model.blocks[lm.first_of_kind(kind)], nnx.Param)) if fresh and first
                              else blocks[forward, kind])
                    (_, acc_out), _ = call(backward, _variant(fresh and first, first, last), params, *before, dy,
                                           *(extra if lm.routes(kind) else ()), None if first else acc, last=last,
                                           kind=kind)
                    acc = acc_out if first else acc
    for first, last in {(False, last) for _, last in _calls(M, D)}:  # the head started io's accumulator
        call("embed_backward", _variant(False, first, last), io, tokens, positions, segments, dy, io_acc,
             last=last)
    return ProgramMemory(micro_rows=micro // D, seq_len=seq_len, stream_dtype=str(stream), packed=packed, devices=D,
                         keep_residuals=keep, figures=tuple(figures), keeps_products=config.kept_layers > 0)


def _calls(M: int, D: int) -> list[tuple[bool, bool]]:
    """The distinct (first micro-batch, sums over the mesh) calls of a pass's accumulating programs: the
    first and a later micro-batch, and the last one where it differs (several devices)."""
    calls = [(m == 0, m == M - 1 and D > 1) for m in range(M)]
    return list(dict.fromkeys(calls))


def _variant(gathers: bool, first: bool | None = None, last: bool = False) -> str:
    words = ["gathers the part"] if gathers else []
    if first is not None:
        words.append("starts the accumulator" if first else "adds to the accumulator")
    if last:
        words.append("sums the gradient over the devices")
    return ", ".join(words) or "plain"
