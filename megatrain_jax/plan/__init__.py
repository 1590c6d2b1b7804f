"""The memory plan: how much host and GPU memory a run needs before anything is allocated, which layout runs on a
machine, and what fits instead when it does not.

Split by job, each module importing only those above it in this list: ``counts`` (units, parameter counts, which
parts update where), ``machine`` (what this machine has, XLA's pinned pool, the GPUs a run counts), ``activations``
(what one block's programs keep and need per micro-batch), ``gpu_ledger`` (the walk over the engine's schedule, one
rule per op kind), ``memory`` (``MemoryPlan`` and ``plan()``; not named ``plan.py``, which the package's ``plan``
function would hide), ``speeds`` (a machine's rates: GPU compute, PCIe, host update) and ``step_time`` (the
step-time model: the engine's schedule walked at those rates), ``layout`` (what ``train`` runs: ``resolve``, the
engine config a run config becomes on a machine), ``modes`` (the run re-planned in each precision mode: bytes per
parameter, fits or not, host RAM needed), ``levers`` (what fits instead: the options, the advice).
"""

from megatrain_jax.plan.counts import GiB, io_param_count, layer_param_count, part_param_count
from megatrain_jax.plan.levers import Option, advice, longest_seq_len, machine_needed, options, require_fit
from megatrain_jax.plan.machine import (Machine, available_gpu_bytes, available_host_bytes, fitted_pool_limit,
                                        gpu_bytes_before_jax, gpu_fraction, run_gpus)
from megatrain_jax.plan.memory import MemoryPlan, MemoryPlanError, fit_host_pool, plan
from megatrain_jax.plan.layout import LEAN_HOST_MARGIN, Resolved, exact_plan, lean, lean_engine, offload, resolve
from megatrain_jax.plan.modes import InMode, in_each_mode, modes_table
from megatrain_jax.plan.speeds import Speeds
from megatrain_jax.plan.step_time import StepTime, for_machine, predict

__all__ = ["GiB", "InMode", "LEAN_HOST_MARGIN", "Machine", "MemoryPlan", "MemoryPlanError", "Option", "Resolved",
           "Speeds", "StepTime", "advice", "available_gpu_bytes", "available_host_bytes", "exact_plan",
           "fit_host_pool", "fitted_pool_limit", "for_machine", "gpu_bytes_before_jax", "gpu_fraction", "in_each_mode",
           "io_param_count", "layer_param_count", "lean", "lean_engine", "longest_seq_len", "machine_needed",
           "modes_table", "offload", "options", "part_param_count", "plan", "predict", "require_fit", "resolve",
           "run_gpus"]
