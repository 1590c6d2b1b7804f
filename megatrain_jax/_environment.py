"""Process settings that must be in place before JAX starts its GPU backend.

XLA's GPU client allocates pinned host memory from a pool capped at 64 GB by default
(``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``). Host memory is where all of megatrain_jax's state lives, so the
default here is 90% of physical RAM. An explicit setting in the environment always wins.
"""

from __future__ import annotations

import os

HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def physical_ram_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def set_host_memory_limit(fraction: float = 0.9) -> None:
    if HOST_LIMIT_VAR not in os.environ:
        os.environ[HOST_LIMIT_VAR] = str(max(1, int(physical_ram_bytes() * fraction / 2**30)))


set_host_memory_limit()
