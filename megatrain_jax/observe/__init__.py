"""Observability as fit hooks: progress display, metrics.jsonl, TensorBoard, W&B (opt-in), and a plot.

Each writer has ``hook()`` (a ``fit`` Hook called every step) and ``close()``. Hooks run in list order
on the same metrics dict, so put hooks that add keys (``eval_hook``, ``memory_hook``) before writers.
"""

from megatrain_jax.observe.metrics import JsonlWriter, memory_hook, read_metrics, system_stats
from megatrain_jax.observe.plot import plot_run
from megatrain_jax.observe.progress import Progress
from megatrain_jax.observe.tensorboard import TensorBoardWriter
from megatrain_jax.observe.wandb_logger import WandbLogger

__all__ = ["JsonlWriter", "Progress", "TensorBoardWriter", "WandbLogger", "memory_hook", "plot_run",
           "read_metrics", "system_stats"]
