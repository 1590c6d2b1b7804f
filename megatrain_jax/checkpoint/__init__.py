"""Orbax checkpoints of the whole host state: exact resume, asynchronous part-by-part writes that add no
copy of the state, completeness checks (Orbax commit + a manifest of sizes and CRC-32s), keep-last-N,
and save-then-exit on SIGTERM/SIGINT/SIGHUP. ``Checkpointer`` saves and restores an ``Engine``;
``CheckpointSession`` is what ``fit`` uses. Layout and memory design: ``store``. A failed write is a
``CheckpointWriteError`` (``failures``); no save can hang a run (docs/checkpoints_faults.md)."""

from megatrain_jax.checkpoint.failures import CheckpointWriteError
from megatrain_jax.checkpoint.folder_lock import CheckpointFolderBusyError
from megatrain_jax.checkpoint.manager import (Checkpointer, CheckpointWarning, CorruptCheckpointError,
                                              check_step, committed_steps)
from megatrain_jax.checkpoint.parts import ShapeMismatchError
from megatrain_jax.checkpoint.session import CheckpointedExit, CheckpointSession
from megatrain_jax.checkpoint.store import NonFiniteCheckpointError

__all__ = ["CheckpointFolderBusyError", "CheckpointSession", "CheckpointWarning", "CheckpointWriteError",
           "CheckpointedExit", "Checkpointer", "CorruptCheckpointError", "NonFiniteCheckpointError", "ShapeMismatchError", "check_step", "committed_steps", "load_model", "load_params",
           "save_model", "save_params"]
from megatrain_jax.checkpoint.params import load_model, load_params, save_model, save_params  # noqa: E402
