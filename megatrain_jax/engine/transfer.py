"""How things move: memory-kind shardings and the only ``device_put`` calls of the engine.

Host memory comes in two kinds. *Pinned* host memory (jax arrays with memory kind ``pinned_host``) is what
crosses PCIe: the device reads and writes it directly. XLA serves it from a pool that it must pin page by
page (about 1.7 GiB/s on the H100 machines), so it is kept for what moves. *Pageable* host memory (plain,
owned numpy arrays) holds what only the host ever touches, the fused optimizer's moments and the float32
masters of parts that stream a 16-bit copy: it costs nothing to create, and zeros are not even written
until first used (experiments/studies/NOTES.md, issue 13).

Shardings are ``NamedSharding`` on a mesh (of one device or several): a ``SingleDeviceSharding`` with a
host memory kind yields device-typed avals that break later jits mixing them with host arrays
(docs/design.md).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"  # the mesh axis that batches and the state are spread over


def default_devices() -> list:
    """The devices an engine uses when none are given: every device of every process when JAX runs several
    processes (``jax.distributed``), all local GPUs in one process, and one device on CPU (several forced
    CPU devices are a test facility, asked for explicitly)."""
    if jax.process_count() > 1:
        return list(jax.devices())
    devices = jax.local_devices()
    return devices if devices[0].platform == "gpu" else devices[:1]


def select_devices(count: int | None) -> list:
    """The first ``count`` of ``default_devices()`` (all of them for None), or a ValueError saying what there is."""
    devices = default_devices()
    if count is None:
        return devices
    if count > len(devices):
        raise ValueError(f"devices={count} asks for more devices than there are: {len(devices)} "
                         f"({devices[0].platform}); lower devices, or leave it unset to use all of them")
    return devices[:count]



def _put(leaves: list, shardings: list) -> list:
    """``leaves`` moved to ``shardings`` in one batched ``device_put`` (one dispatch for a part's arrays, not one
    each; the same copies)."""
    return jax.device_put(leaves, shardings) if leaves else []

class Placement:
    """Where arrays live: the accelerators' memory and pinned host memory, over a one-axis mesh (``data``)
    of one or more devices, possibly of several processes.

    With several devices, every host array is spread over them along its first axis when that axis
    divides evenly (``spec``), else replicated (small leaves: norms, odd shapes). Each device's shard lives
    in that device's own pinned host memory, so the host holds the state once, and each device fetches
    only its shard over its own PCIe link; the per-part device functions all-gather the weights and
    reduce-scatter the gradients (``megatrain_jax.engine.device_fns``). Batches are spread by rows.

    Pageable (numpy) host arrays always have the array's global shape. With several processes each
    process writes only the rows of its own devices (``local_indices``); the others are never touched,
    so the kernel never backs them with memory."""

    def __init__(self, devices: Sequence | None = None, *, mesh: Mesh | None = None):
        if mesh is None:
            devices = list(devices) if devices is not None else default_devices()
            if not devices:
                raise ValueError("Placement needs at least one device")
            mesh = Mesh(np.array(devices), (DATA,))
        if mesh.axis_names != (DATA,):
            raise ValueError(f"the engine's mesh must have the one axis {DATA!r} (data parallel), got "
                             f"{mesh.axis_names}; build it as jax.sharding.Mesh(devices, ({DATA!r},))")
        self.mesh = mesh
        self.devices = list(mesh.devices.flat)
        self.size = len(self.devices)
        self.device_obj = self.devices[0]
        for d in self.devices:
            kinds = {m.kind for m in d.addressable_memories()} if d.process_index == jax.process_index() else {"pinned_host"}
            if "pinned_host" not in kinds:
                raise RuntimeError(f"device {d} has no pinned_host memory (has {sorted(kinds)}); "
                                   f"megatrain_jax keeps training state in pinned host memory")
        self.local_devices = [d for d in self.devices if d.process_index == jax.process_index()]
        if not self.local_devices:
            raise ValueError(f"none of the mesh's devices belongs to this process ({jax.process_index()})")
        self.processes = len({d.process_index for d in self.devices})
        self.device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")  # replicated
        self.host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
        # Batches: by row (on one device the replicated spec, which is what single-device programs produce).
        self.rows = NamedSharding(mesh, PartitionSpec(DATA) if self.size > 1 else PartitionSpec(), memory_kind="device")

    @property
    def on_gpu(self) -> bool:
        return self.device_obj.platform == "gpu"

    # ------------------------------------------------------------------ shardings
    def spec(self, x: Any) -> PartitionSpec:
        """How an array of ``x``'s shape is spread: by its first axis when that divides evenly over the
        devices, else replicated."""
        shape = np.shape(x) if not hasattr(x, "shape") else x.shape
        if self.size > 1 and len(shape) >= 1 and shape[0] % self.size == 0 and shape[0] > 0:
            return PartitionSpec(DATA)
        return PartitionSpec()

    def specs(self, tree: Any) -> Any:
        return jax.tree.map(self.spec, tree)

    def host_for(self, x: Any) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(x), memory_kind="pinned_host")

    def device_for(self, x: Any) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(x), memory_kind="device")

    def shardings(self, tree: Any, memory_kind: str) -> Any:
        """Each leaf's sharding in ``memory_kind`` (``device`` or ``pinned_host``)."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, self.spec(x), memory_kind=memory_kind), tree)

    def jit_into(self, fn: Callable, memory_kind: str = "pinned_host", donate_argnums: tuple = ()) -> "JitInto":
        """``jax.jit(fn)`` whose outputs land in ``memory_kind``, each leaf spread by ``spec``."""
        return JitInto(fn, self, memory_kind, donate_argnums)

    # ------------------------------------------------------------------ moving
    def to_device(self, tree: Any) -> Any:
        """Copy to the accelerators, each leaf spread by ``spec``: asynchronous for device and pinned leaves
        (returns at once; users of the result wait on it). On a GPU, numpy (pageable) leaves go through pinned
        memory first, a leaf at a time and each copy waited for (this call blocks for them): XLA would otherwise
        stage them through pinned buffers of its own, outside the pool's cap, and keep those (15 GiB when 7B's
        GPU-resident parts loaded, experiments/studies/NOTES.md)."""
        leaves, treedef = jax.tree.flatten(tree)
        out = list(leaves)
        staged = {i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)} if (
            self.on_gpu or self.processes > 1) else set()
        # one leaf at a time, each copy waited for so that its pinned buffer is freed before the next: a part's
        # pageable state (8B's io part's moments, 7.8 GiB) never sits in the pinned pool whole, only its largest
        # leaf, which the pool's headroom holds (plan.machine.fitted_pool_limit)
        for i in sorted(staged):
            out[i] = jax.block_until_ready(_put([self.copy_to_host(leaves[i])], [self.device_for(leaves[i])])[0])
        rest = [i for i in range(len(leaves)) if i not in staged]
        for i, moved in zip(rest, _put([leaves[i] for i in rest], [self.device_for(leaves[i]) for i in rest])):
            out[i] = moved
        return treedef.unflatten(out)

    def rows_to_device(self, tree: Any) -> Any:
        """This process's rows of a batch (numpy leaves ``[rows, ...]``) as global arrays spread by row
        over the devices; with one process, its rows are the whole batch."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.rows, x), tree)

    def copy_to_host(self, tree: Any) -> Any:
        """A copy in pinned host memory that never aliases the source (the engine updates it in place).
        Numpy leaves are read piece by piece, only the pieces of this process's devices (copied first: the
        CPU backend's ``device_put`` aliases an aligned numpy array even with ``may_alias=False``)."""
        def one(x):
            if isinstance(x, np.ndarray):
                return jax.make_array_from_callback(x.shape, self.host_for(x), lambda index: np.array(x[index]))
            return jax.device_put(x, self.host_for(x), may_alias=False)
        return jax.tree.map(one, tree)

    def to_host(self, tree: Any) -> Any:
        """Asynchronous copy into pinned host memory, each leaf spread by ``spec``. Host values go through
        ``copy_to_host``: a ``device_put`` of a numpy value onto several processes' devices first checks,
        with a collective, that every process passed the same value (a deadlock on the update thread)."""
        leaves, treedef = jax.tree.flatten(tree)
        out = [None if isinstance(x, jax.Array) else self.copy_to_host(np.asarray(x)) for x in leaves]
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        for i, moved in zip(arrays, _put([leaves[i] for i in arrays], [self.host_for(leaves[i]) for i in arrays])):
            out[i] = moved
        return treedef.unflatten(out)

    def to_pinned(self, tree: Any) -> Any:
        """Each leaf in pinned host memory: pinned jax arrays as they are, anything else copied there (a
        copy never aliases a numpy source, which its owner may change)."""
        return jax.tree.map(lambda x: x if self.is_pinned(x) else self.copy_to_host(x), tree)

    def is_pinned(self, x: Any) -> bool:
        return isinstance(x, jax.Array) and x.sharding == self.host_for(x)

    def to_pageable(self, tree: Any, adopt: bool = False) -> Any:
        """Each leaf as a numpy array in pageable host memory that the caller owns: a new copy
        (``pageable_copy``), or with ``adopt`` (in a single process) the numpy leaf itself where it is
        writable and C-contiguous (its previous owner hands it over)."""
        keep = lambda x: (adopt and self.processes == 1 and isinstance(x, np.ndarray) and x.flags.writeable
                          and x.flags.c_contiguous)
        return jax.tree.map(lambda x: x if keep(x) else pageable_copy(x, self), tree)

    # ------------------------------------------------------------------ pieces, for in-place kernels
    def local_indices(self, x: Any) -> list[tuple]:
        """The distinct pieces (index tuples of slices) of ``x``'s global array held by this process's
        devices, in device order."""
        seen: dict[tuple, tuple] = {}
        for index in self.host_for(x).addressable_devices_indices_map(x.shape).values():
            seen.setdefault(_index_key(index, x.shape), index)
        return list(seen.values())

    def pieces(self, x: Any) -> dict[tuple, list[int]]:
        """``{piece key: [buffer address of each copy]}`` of a host array (``_index_key`` of its index): one
        address per device holding it for a pinned array, the one address of those rows in a (pageable)
        numpy array. A piece is contiguous: arrays are spread only along their first axis."""
        if isinstance(x, np.ndarray):
            row = x.strides[0] if x.ndim else 0
            return {_index_key(i, x.shape): [x.ctypes.data + (i[0].indices(x.shape[0])[0] * row if x.ndim else 0)]
                    for i in self.local_indices(x)}
        out: dict[tuple, list[int]] = {}
        for shard in x.addressable_shards:
            out.setdefault(_index_key(shard.index, x.shape), []).append(shard.data.unsafe_buffer_pointer())
        return out


def local_array(x: Any) -> Any:
    """This process's copy of a replicated array (its first device's), as an array of its own: with several
    processes a global array cannot be read whole, but each process holds a replicated one entirely. Anything
    else as it is."""
    return x.addressable_shards[0].data if isinstance(x, jax.Array) else x


def local_value(x: Any) -> np.ndarray:
    """A replicated array's (or numpy or Python value's) value, read from this process's copy (``local_array``)."""
    return np.asarray(jax.device_get(local_array(x)))


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of an array spread by row over the devices (``Placement.rows``), in order: the
    whole array with one process."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    pieces: dict[int, Any] = {}
    for shard in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0):
        pieces.setdefault(shard.index[0].start or 0, shard)  # rows held by several devices: once
    return np.concatenate([np.asarray(s.data) for s in pieces.values()])


def _index_key(index: tuple, shape: tuple) -> tuple:
    """A hashable form of an index into an array of ``shape``: ``((start, stop), ...)`` per axis."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class JitInto:
    """``jax.jit`` of ``fn`` with each output leaf placed by ``Placement.shardings`` in one memory kind: one
    compiled program per argument structure and shapes (output shardings depend on the output shapes)."""

    def __init__(self, fn: Callable, placement: Placement, memory_kind: str, donate_argnums: tuple):
        self.fn, self.placement, self.memory_kind, self.donate = fn, placement, memory_kind, donate_argnums
        self._jits: dict[Any, Any] = {}

    def _jit(self, args: tuple):
        key = (jax.tree.structure(args),
               tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x)))) for x in jax.tree.leaves(args)))
        if key not in self._jits:
            out = jax.eval_shape(self.fn, *args)
            self._jits[key] = jax.jit(self.fn, out_shardings=self.placement.shardings(out, self.memory_kind),
                                      donate_argnums=self.donate)
        return self._jits[key]

    def __call__(self, *args):
        return self._jit(args)(*args)

    def lower(self, *args):
        return self._jit(args).lower(*args)

    def cache_size(self) -> int:
        return sum(f._cache_size() for f in self._jits.values())


def pageable_zeros(like: Any, dtype: Any = np.float32) -> Any:
    """Zeros (float32 by default) shaped like each leaf of ``like`` (its global shape), in pageable memory.
    ``np.zeros`` takes fresh pages from the kernel, already zero: nothing is written (or even mapped) until
    first used, so rows that another process updates cost nothing here."""
    return jax.tree.map(lambda x: np.zeros(x.shape, dtype), like)


def pageable_copy(x: Any, placement: Placement) -> np.ndarray:
    """A new, writable, C-contiguous numpy array of ``x``'s global shape (``x`` a numpy array, or a jax array
    anywhere) holding the pieces of this process's devices (all of it, in a single process). A device
    array is copied to pinned memory first and read from there: ``np.asarray`` on a GPU array would keep a
    cached host copy in it for as long as the array lives."""
    if isinstance(x, jax.Array) and not _on_host(x):
        x = placement.copy_to_host(x)
    if isinstance(x, np.ndarray) or len(x.sharding.device_set) == 1:
        return np.array(host_view(x), order="C", copy=True)
    out = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = host_view(shard.data)
    return out


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
