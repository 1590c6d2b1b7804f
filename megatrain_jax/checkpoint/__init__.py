"""Orbax checkpoints of the whole host state with exact resume, asynchronous part-by-part writes of
bounded memory, completeness checks, and save-then-exit on SIGTERM/SIGINT. See ``manager`` and ``store``."""

from megatrain_jax.checkpoint.manager import (Checkpointer, CheckpointWarning, CorruptCheckpointError,
                                              check_step, committed_steps)
from megatrain_jax.checkpoint.parts import ShapeMismatchError

__all__ = ["CheckpointWarning", "Checkpointer", "CorruptCheckpointError", "ShapeMismatchError", "check_step",
           "committed_steps"]
