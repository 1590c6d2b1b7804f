"""How things move: memory-kind shardings and the only ``device_put`` calls of the engine.

Host memory comes in two kinds. *Pinned* host memory (jax arrays with memory kind ``pinned_host``) is what
crosses PCIe: the device reads and writes it directly. XLA serves it from a pool that it must pin page by
page (about 1.7 GiB/s on the H100 machines), so it is kept for what moves. *Pageable* host memory (plain,
owned numpy arrays) holds what only the host ever touches, the fused optimizer's moments and the float32
masters of parts that stream a 16-bit copy: it costs nothing to create, and zeros are not even written
until first used (experiments/NOTES.md, issue 13).

Shardings are ``NamedSharding`` on a one-device mesh: a ``SingleDeviceSharding`` with a host memory kind
yields device-typed avals that break later jits mixing them with host arrays (docs/design.md).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class Placement:
    """The two places an array can be: the accelerator's memory and pinned host memory."""

    def __init__(self, device: jax.Device | None = None):
        self.device_obj = device or jax.devices()[0]
        mesh = Mesh(np.array([self.device_obj]), ("x",))
        kinds = {m.kind for m in self.device_obj.addressable_memories()}
        if "pinned_host" not in kinds:
            raise RuntimeError(f"device {self.device_obj} has no pinned_host memory (has {sorted(kinds)}); "
                               f"megatrain_jax keeps training state in pinned host memory")
        self.device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
        self.host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")

    @property
    def on_gpu(self) -> bool:
        return self.device_obj.platform == "gpu"

    def to_device(self, tree: Any) -> Any:
        """Asynchronous copy to the accelerator (returns at once; users of the result wait on it). On a GPU,
        numpy (pageable) leaves go through pinned memory first: XLA would otherwise stage them through pinned
        buffers of its own, outside the pool's cap, and keep those (15 GiB when 7B's GPU-resident parts
        loaded, experiments/NOTES.md)."""
        if self.on_gpu:
            tree = jax.tree.map(lambda x: self.copy_to_host(x) if isinstance(x, np.ndarray) else x, tree)
        return jax.device_put(tree, self.device)

    def copy_to_host(self, tree: Any) -> Any:
        """A copy in pinned host memory that never aliases the source (the engine updates it in place).
        The CPU backend's ``device_put`` aliases an aligned numpy array even with ``may_alias=False``, so
        there numpy leaves are copied first."""
        if not self.on_gpu:
            tree = jax.tree.map(lambda x: np.array(x) if isinstance(x, np.ndarray) else x, tree)
        return jax.device_put(tree, self.host, may_alias=False)

    def to_host(self, tree: Any) -> Any:
        """Asynchronous copy into pinned host memory."""
        return jax.device_put(tree, self.host)

    def to_pinned(self, tree: Any) -> Any:
        """Each leaf in pinned host memory: pinned jax arrays as they are, anything else copied there (a
        copy never aliases a numpy source, which its owner may change)."""
        return jax.tree.map(lambda x: x if self.is_pinned(x) else self.copy_to_host(x), tree)

    def is_pinned(self, x: Any) -> bool:
        return isinstance(x, jax.Array) and x.sharding == self.host

    def to_pageable(self, tree: Any, adopt: bool = False) -> Any:
        """Each leaf as a numpy array in pageable host memory that the caller owns: a new copy
        (``pageable_copy``), or with ``adopt`` the numpy leaf itself where it is writable and C-contiguous
        (its previous owner hands it over)."""
        keep = lambda x: adopt and isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous
        return jax.tree.map(lambda x: x if keep(x) else pageable_copy(x, self), tree)


def pageable_zeros(like: Any) -> Any:
    """Float32 zeros shaped like each leaf of ``like``, in pageable memory. ``np.zeros`` takes fresh pages
    from the kernel, already zero: nothing is written (or even mapped) until first used."""
    return jax.tree.map(lambda x: np.zeros(x.shape, np.float32), like)


def pageable_copy(x: Any, placement: Placement) -> np.ndarray:
    """A new, writable, C-contiguous numpy copy of ``x`` (a numpy array, or a jax array anywhere). A device
    array is copied to pinned memory first and read from there: ``np.asarray`` on a GPU array would keep a
    cached host copy in it for as long as the array lives."""
    if isinstance(x, jax.Array) and not _on_host(x):
        x = placement.copy_to_host(x)
    return np.array(host_view(x), order="C", copy=True)


def _on_host(x: jax.Array) -> bool:
    return (getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")
            or next(iter(x.sharding.device_set)).platform == "cpu")


@functools.cache
def _pointers_readable(sharding) -> bool:
    """Whether a host array's buffer address can be read as what the array holds (pinned host memory is
    host-addressable on CPU and GPU clients; checked once per sharding)."""
    try:
        x = jax.device_put(jnp.arange(1, 5, dtype=jnp.float32), sharding, may_alias=False)
        x.block_until_ready()
        view = np.frombuffer((ctypes.c_char * 16).from_address(x.unsafe_buffer_pointer()), np.float32)
        return bool(np.array_equal(view, np.arange(1, 5, dtype=np.float32)))
    except Exception:  # noqa: BLE001 - no buffer address here: take the copying path
        return False


def host_view(x: Any) -> np.ndarray:
    """A numpy view of a host-memory array without copying it (nor caching a copy on it: ``np.asarray``
    on a GPU client keeps one in the array, which in-place updates would then make stale). Numpy arrays
    are returned as they are; a jax array whose buffer cannot be viewed is copied."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    x.block_until_ready()
    if x.nbytes and _on_host(x) and len(x.sharding.device_set) == 1 and _pointers_readable(x.sharding):
        buffer = (ctypes.c_char * x.nbytes).from_address(x.unsafe_buffer_pointer())
        return np.frombuffer(buffer, dtype=x.dtype).reshape(x.shape)
    return np.asarray(jax.device_put(x, x.sharding, may_alias=False))  # a temporary copy


def address(x: Any) -> int:
    """The buffer address of a host array (pinned jax array or numpy array), for in-place kernels."""
    return x.ctypes.data if isinstance(x, np.ndarray) else x.unsafe_buffer_pointer()
