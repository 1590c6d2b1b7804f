"""Each precision mode on this machine: the run re-planned in every mode of the precision table
(``engine.precision.MODES``), its host bytes per parameter, whether it fits, and the host RAM it needs. What
``megatrain-jax plan`` and ``check`` print under the memory table, so that a newcomer sees every mode that
fits, not only the one configured; ``levers.machine_needed`` names the leanest mode's need from here.
"""

from __future__ import annotations

import dataclasses
import math

from megatrain_jax.engine import precision
from megatrain_jax.plan.counts import GiB
from megatrain_jax.plan.layout import legal
from megatrain_jax.plan.machine import HOST_POOL_FRACTION
from megatrain_jax.plan.machine import GPU_FRAGMENTATION_MARGIN
from megatrain_jax.plan.memory import MemoryPlan


@dataclasses.dataclass(frozen=True)
class InMode:
    """The run in one precision mode: ``plan`` is it re-planned in that mode (None where the config cannot
    run in it), ``host_gib`` the host RAM on which that plan fits (GiB, rounded up)."""

    mode: precision.Precision
    plan: MemoryPlan | None
    host_gib: int | None

    @property
    def bytes_per_param(self) -> float:
        """Host bytes per parameter, everything counted (pinned pool, runtime)."""
        return self.plan.host_total / self.plan.params

    def status(self) -> str:
        """``fits``, or which memory is short and by how much; a mode whose quality is under the quality table's
        bar says so."""
        q = self.plan
        if q is None:
            return "not with this config (the engine refuses the combination)"
        if q.fits:
            return "fits" + QUALITY_MARKS[self.mode.quality_met]
        short = []
        if not q.host_fits:
            over = None if q.host_available is None else q.host_total - q.host_available
            short.append(f"host RAM short by {shortfall(over)}" if over is not None and over > 0 else
                         "pinned memory over XLA's pool limit")
        if not q.gpu_fits:
            # the peak and the allocator's fragmentation margin, as ``MemoryPlan.gpu_fits`` counts them
            short.append(f"GPU short by {shortfall(q.gpu_total + GPU_FRAGMENTATION_MARGIN - q.gpu_available)}")
        if not q.disk_fits:
            short.append("disk short")
        return "does not fit: " + ", ".join(short)


# What ``plan``'s table of modes adds to a mode that fits, by its ``quality_met``.
QUALITY_MARKS = {True: "", False: " (trains worse: over the quality bar, docs/capacity.md)",
                 None: " (quality not yet measured, docs/capacity.md)"}


def shortfall(nbytes: float) -> str:
    """A memory shortfall in words: GiB to one decimal, or MiB where that would read 0.0 GiB."""
    if nbytes >= 0.05 * GiB:
        return f"{nbytes / GiB:,.1f} GiB"
    return f"{max(math.ceil(nbytes / 2**20), 1):,} MiB"


def host_gib_needed(p: MemoryPlan) -> int:
    """The host RAM (GiB) on which ``p``'s host side fits: its total, or XLA's pinned pool's limit if that is
    larger, then raised a GiB at a time until the plan (whose pool is rounded to the RAM) fits."""
    ram = math.ceil(max(p.host_pinned / HOST_POOL_FRACTION, p.host_total) / GiB)
    while not p.replace(host_ram_bytes=ram * GiB, host_pool_limit=None).host_fits:
        ram += 1
    return ram


def in_each_mode(p: MemoryPlan) -> list[InMode]:
    """The run re-planned in each mode of the precision table, in its order (``p`` itself for its own mode)."""
    out = []
    for mode in precision.MODES.values():
        if mode == p.mode:
            q = p
        else:
            changes = precision.switch(p.engine_cfg, mode, p.stream_dtype)
            q = p.applied(changes) if legal(p, changes) else None
        out.append(InMode(mode, q, None if q is None else host_gib_needed(q)))
    return out


def leanest(modes: list[InMode]) -> InMode:
    """The mode that needs the least host RAM."""
    return min((m for m in modes if m.host_gib is not None), key=lambda m: m.host_gib)


def modes_table(p: MemoryPlan, modes: list[InMode] | None = None) -> str:
    """The lines printed under the memory table: each mode's host bytes per parameter, the host RAM it
    needs, and whether it fits this machine (``modes``: ``in_each_mode(p)`` when already made)."""
    modes = in_each_mode(p) if modes is None else modes
    width = max(len(m.mode.title) for m in modes) + len(" (this run)")
    lines = ["  precision modes, this run re-planned in each (host bytes per parameter, host RAM it needs; "
             "docs/capacity.md):"]
    for m in modes:
        name = m.mode.title + (" (this run)" if m.plan is p else "")
        if m.plan is None:
            lines.append(f"    {name:<{width}s} {'':>17s} {'':>16s}  {m.status()}")
        else:
            lines.append(f"    {name:<{width}s} {m.bytes_per_param:9,.1f} B/param {m.host_gib:7,d} GiB host  "
                         f"{m.status()}")
    return "\n".join(lines)
