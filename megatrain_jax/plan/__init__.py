"""The memory plan: how much host and GPU memory a run needs before anything is allocated, and what fits
instead when it does not.

Split by job, each module importing only those above it in this list:
``counts`` (units, parameter counts, which parts update where), ``machine`` (what this machine has, XLA's
pinned pool), ``gpu_ledger`` (the walk over the engine's schedule, one rule per op kind), ``memory``
(``MemoryPlan`` and ``plan()``; not named ``plan.py``, which the package's ``plan`` function would hide),
``levers`` (the search over config changes, the advice, ``lean_engine``).
"""

from megatrain_jax.plan.counts import GiB, io_param_count, layer_param_count, part_param_count
from megatrain_jax.plan.levers import (LEAN_HOST_MARGIN, Option, advice, lean, lean_engine, longest_seq_len, offload,
                                       options, require_fit)
from megatrain_jax.plan.machine import (available_gpu_bytes, available_host_bytes, fitted_pool_limit,
                                        gpu_bytes_before_jax, gpu_fraction)
from megatrain_jax.plan.memory import MemoryPlan, MemoryPlanError, fit_host_pool, plan

__all__ = ["GiB", "LEAN_HOST_MARGIN", "MemoryPlan", "MemoryPlanError", "Option", "advice", "available_gpu_bytes",
           "available_host_bytes", "fit_host_pool", "fitted_pool_limit", "gpu_bytes_before_jax", "gpu_fraction",
           "io_param_count", "layer_param_count", "lean", "lean_engine", "longest_seq_len", "offload", "options",
           "part_param_count", "plan", "require_fit"]
