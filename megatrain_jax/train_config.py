"""``TrainConfig``: what ``fit`` runs (how long, what it reports, where checkpoints go). The command line's
``[train]`` section is this config plus the run folder's settings (``megatrain_jax.cli.run_config``)."""

from __future__ import annotations

import dataclasses
import numbers


def check_path(name: str, value: object, give: str) -> None:
    """Refuse an empty path (``--set train.run_dir=``): it would mean the current directory. ``give`` says what
    to give instead."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name} is an empty path, which would mean the current directory: give {give}")


def _whole(value: object) -> bool:
    """An integer, not a bool (``True`` is an int to Python, never a count of steps)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run.

    - ``steps``: optimizer steps, counted from step 0 (a resumed run ends where the uninterrupted one
      would); None trains until the data ends.
    - ``seed`` initializes an abstract model (``nnx.eval_shape``): from 0 to 2**32 - 1, what JAX's random keys
      hold (a larger or negative seed would repeat another's initialization, or fail).
    - ``log_every``: print a line every so many steps (0: no printing).
    - ``peak_tflops`` (the accelerator's dense bf16 peak, e.g. 989 for an H100 SXM) adds an ``mfu`` metric.
    - Checkpoints: with ``checkpoint_dir``, the whole host state, the data position and the run config are
      saved asynchronously every ``checkpoint_every`` steps (0: only at the end) and at the end, keeping the
      newest ``checkpoint_keep`` and the last known good (never one from a skipped step); SIGTERM/SIGINT/SIGHUP
      finish the step, save and exit. ``resume = True``
      continues from the newest complete checkpoint of ``checkpoint_dir`` (a fresh start when there is
      none); a string names a checkpoint (a root or one step's folder) to start from.
    - ``devices``: how many GPUs to train on, the first of this process's (None: all of them; under
      ``jax.distributed``, all devices of all processes). The state is spread over them, held once.
    - ``profile_step`` (0: off): run that step serialized and add its seconds per lane (GPU compute, PCIe each
      way, host update) to its metrics (``Engine.steps``): what a step's time is made of, against the plan's
      predicted busy time per lane. That one step runs slower.
    """

    steps: int | None = None
    seed: int = 0
    log_every: int = 10
    peak_tflops: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    resume: bool | str = False
    devices: int | None = None
    profile_step: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "checkpoint_every", "checkpoint_keep", "profile_step"):
            value = getattr(self, name)
            if (value is not None or name != "steps") and not _whole(value):
                write = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() else ""
                raise ValueError(f"{name} must be a whole number, got {value!r}{write}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 (or None: until the data ends), got {self.steps}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer from 0 to {2**32 - 1} (JAX's random keys hold 32 bits: "
                             f"another would repeat a seed in that range, or fail), got {self.seed!r}")
        for name in ("log_every", "checkpoint_every", "profile_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, numbers.Real) and self.peak_tflops > 0):
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")
        if self.devices is not None and (not _whole(self.devices) or self.devices < 1):
            raise ValueError(f"devices must be an integer >= 1 (or None: every GPU), got {self.devices!r}")
        check_path("checkpoint_dir", self.checkpoint_dir, "a folder (e.g. runs/x/checkpoints), or leave it unset")
        check_path("resume", self.resume, "true, false, or the path of a checkpoint")
        if self.resume is True and self.checkpoint_dir is None:
            raise ValueError("resume=True continues from checkpoint_dir: set checkpoint_dir too "
                             "(or give resume the path of a checkpoint)")

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_dir is not None or bool(self.resume)
