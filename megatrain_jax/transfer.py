"""How things move: memory-kind shardings and the only ``device_put`` calls of the engine.

Shardings are ``NamedSharding`` on a one-device mesh: a ``SingleDeviceSharding`` with a host memory kind
yields device-typed avals that break later jits mixing them with host arrays (docs/design.md).
"""

from __future__ import annotations

from typing import Any

import jax
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
        """Asynchronous copy to the accelerator (returns at once; users of the result wait on it)."""
        return jax.device_put(tree, self.device)

    def copy_to_host(self, tree: Any) -> Any:
        """A copy in pinned host memory that never aliases the source (the engine updates it in place)."""
        return jax.device_put(tree, self.host, may_alias=False)

    def to_host(self, tree: Any) -> Any:
        """Asynchronous copy into pinned host memory."""
        return jax.device_put(tree, self.host)
