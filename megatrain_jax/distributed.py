"""Several processes, on one host or many: JAX's own distributed runtime (``jax.distributed``).

Launch one process per host (each using all of its GPUs) or one per GPU, and call ``initialize()`` in
each before anything else touches JAX (``megatrain-jax train`` does when the variables below are set).
Every process then sees every device of every process: the engine's default mesh spans them all, the
host state is spread over them (each host holds only its devices' shards), and each process feeds its
own rows of every batch (``TokenBatches(process=...)``; the CLI's data does this by itself).

    # host 0 of 2 (and the same on host 1 with MEGATRAIN_PROCESS_ID=1)
    MEGATRAIN_COORDINATOR=host0:12355 MEGATRAIN_NUM_PROCESSES=2 MEGATRAIN_PROCESS_ID=0 \\
        megatrain-jax train --config run.toml

Under SLURM or Open MPI, ``jax.distributed.initialize()`` finds all three by itself: set only
``MEGATRAIN_DISTRIBUTED=1``. On CPU (tests), cross-process collectives go through gloo.
"""

from __future__ import annotations

import os

ENV = ("MEGATRAIN_COORDINATOR", "MEGATRAIN_NUM_PROCESSES", "MEGATRAIN_PROCESS_ID")


def requested() -> bool:
    """Whether the environment asks for several processes."""
    return bool(os.environ.get("MEGATRAIN_COORDINATOR") or os.environ.get("MEGATRAIN_DISTRIBUTED"))


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_device_ids: list[int] | None = None) -> None:
    """``jax.distributed.initialize`` from the arguments, else the ``MEGATRAIN_*`` variables, else JAX's own
    cluster detection (SLURM, Open MPI). Call it once per process, before JAX starts its backends."""
    import jax

    coordinator = coordinator or os.environ.get("MEGATRAIN_COORDINATOR")
    if num_processes is None and os.environ.get("MEGATRAIN_NUM_PROCESSES"):
        num_processes = int(os.environ["MEGATRAIN_NUM_PROCESSES"])
    if process_id is None and os.environ.get("MEGATRAIN_PROCESS_ID"):
        process_id = int(os.environ["MEGATRAIN_PROCESS_ID"])
    if coordinator is not None and (num_processes is None or process_id is None):
        raise ValueError(f"a coordinator ({coordinator}) needs the number of processes and this process's id: "
                         f"set MEGATRAIN_NUM_PROCESSES and MEGATRAIN_PROCESS_ID (0 .. N-1, one per process)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used where the devices are CPUs
    jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_device_ids)


def process_id() -> int:
    """This process's id once ``initialize`` ran (0 for a single process), read without starting JAX's
    backends (``jax.process_index()`` would start them, before the pinned pool's cap is set)."""
    from jax._src import distributed as jax_distributed

    pid = jax_distributed.global_state.process_id
    return 0 if pid is None else int(pid)
