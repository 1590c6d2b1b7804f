"""What a part of the model is: the io part (embedding, final norm, head) or one block.

A ``PartId`` names a part once for every module: its position in the host state, the block it is (if
any), and its checkpoint name (``io``, ``block_00003``). A ``Part`` is the record of one part's
persistent arrays: float32 master parameters, optimizer state and the compute-dtype copy that is sent
to the device. The same record holds a part kept on the GPU (``megatrain_jax.engine.update.resident``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from megatrain_jax.contract.layered import Params


@dataclasses.dataclass(frozen=True, order=True)
class PartId:
    """A part of the model. ``index`` is its position in ``HostState.parts`` and in update order: 0 is the
    io part, ``i + 1`` is block ``i``."""

    index: int

    @classmethod
    def block(cls, layer: int) -> "PartId":
        return cls(layer + 1)

    @classmethod
    def from_name(cls, name: str) -> "PartId":
        """The inverse of ``name``."""
        if name == "io":
            return IO
        if name.startswith("block_") and name[6:].isdigit():
            return cls.block(int(name[6:]))
        raise ValueError(f"{name!r} is not a part name ('io' or 'block_NNNNN')")

    @property
    def is_io(self) -> bool:
        return self.index == 0

    @property
    def layer(self) -> int:
        """The block number; the io part has none."""
        if self.is_io:
            raise ValueError("the io part is not a block")
        return self.index - 1

    @property
    def name(self) -> str:
        """The checkpoint name: ``io`` or ``block_00003``."""
        return "io" if self.is_io else f"block_{self.index - 1:05d}"

    def __str__(self) -> str:
        return self.name


IO = PartId(0)


def part_ids(n_blocks: int) -> list[PartId]:
    """Every part in update order: io, then blocks 0 .. n_blocks - 1."""
    return [PartId(i) for i in range(n_blocks + 1)]


@dataclasses.dataclass(frozen=True)
class HostRoles:
    """Where each part's gradient waits and where its moments live, from ``EngineConfig``'s counts. After the
    GPU-resident blocks, the first ``gpu_updated`` blocks stream but update on the GPU (``gpu_updated_layers``:
    their gradients wait there for the next forward), and so does the io part where ``gpu_updated_io`` (it
    comes first in ``gpu_updated``). The parts updated on the host are the blocks after those, then the io part
    unless it is resident or updated on the GPU. ``grads_on_gpu``: the first host parts in that order keep
    their gradients on the GPU. ``disk``: the last ``disk_parts`` blocks keep their Adam moments in the disk
    tier."""

    host_updated: tuple[PartId, ...]
    grads_on_gpu: tuple[PartId, ...]
    disk: tuple[PartId, ...]
    gpu_updated: tuple[PartId, ...] = ()

    @classmethod
    def of(cls, n_blocks: int, resident_layers: int, resident_io: bool, grads_on_gpu: int = 0,
           disk_parts: int = 0, gpu_updated: int = 0, gpu_updated_io: bool = False) -> "HostRoles":
        streamed = [PartId.block(i) for i in range(resident_layers, n_blocks)]
        if gpu_updated > len(streamed):
            raise ValueError(f"gpu_updated_layers={gpu_updated} exceeds the {len(streamed)} blocks that are not "
                             f"GPU-resident (resident_layers={resident_layers} of {n_blocks})")
        if gpu_updated_io and resident_io:
            raise ValueError("gpu_updated_io streams the io part, and resident_io keeps it on the GPU: set one of them")
        blocks = streamed[gpu_updated:]
        host = tuple(blocks + ([] if resident_io or gpu_updated_io else [IO]))
        if grads_on_gpu > len(host):
            raise ValueError(f"grads_on_gpu={grads_on_gpu} exceeds the {len(host)} parts updated on the host (the "
                             f"blocks that are not GPU-resident or GPU-updated, and the io part unless it is)")
        if disk_parts > len(blocks):
            raise ValueError(f"disk_parts={disk_parts} exceeds the {len(blocks)} blocks updated on the host")
        return cls(host, host[:grads_on_gpu], tuple(blocks[len(blocks) - disk_parts:]),
                   tuple(([IO] if gpu_updated_io else []) + streamed[:gpu_updated]))

    @classmethod
    def of_config(cls, n_blocks: int, e: Any, resident_layers: int | None = None) -> "HostRoles":
        """``of`` with an ``EngineConfig``'s counts (``resident_layers`` in place of its own where given); a
        ``gpu_updated_layers`` or ``gpu_updated_io`` still "auto" (not yet picked by the plan) counts as none."""
        gpu_updated = e.gpu_updated_layers if isinstance(e.gpu_updated_layers, int) else 0
        return cls.of(n_blocks, e.resident_layers if resident_layers is None else resident_layers, e.resident_io,
                      e.grads_on_gpu, e.disk_parts, gpu_updated, e.gpu_updated_io is True)

    @property
    def visited_layers(self) -> tuple[int, ...]:
        """The blocks of ``gpu_updated`` (``schedule.step_ops``' ``visited``)."""
        return tuple(p.layer for p in self.gpu_updated if not p.is_io)

    @property
    def io_visited(self) -> bool:
        """Whether the io part is updated on the GPU (``gpu_updated_io``)."""
        return any(p.is_io for p in self.gpu_updated)

    def splitting(self, split_parts: int | str) -> tuple[PartId, ...]:
        """The host parts whose update runs in two passes where the optimizer splits
        (``EngineConfig.split_parts``): of those that can split (not one whose gradient waits on the GPU or
        whose moments are on disk), the last ``split_parts`` in update order; "auto", or a count above theirs,
        all of them."""
        order = [p for p in sorted(self.host_updated, key=lambda p: p.index)
                 if p not in self.grads_on_gpu and p not in self.disk]
        if split_parts == "auto":
            return tuple(order)
        if not isinstance(split_parts, int) or isinstance(split_parts, bool) or split_parts < 0:
            raise ValueError(f"split_parts={split_parts!r}: set an integer >= 0, or 'auto'")
        return tuple(order[max(len(order) - split_parts, 0):])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Part:
    """One part's persistent arrays. ``stream`` is None when the masters themselves are sent, and on a
    GPU-resident part that keeps no compute copy (``EngineConfig.resident_copy``: it is cast at each use)."""

    params: Params
    opt: Any
    stream: Params | None

    def streamed(self) -> Params:
        """What the per-part device functions consume."""
        return self.params if self.stream is None else self.stream
