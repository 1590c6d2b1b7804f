"""Weights & Biases, opt-in: used only when asked for (``[log] wandb = true``) and installed. A failure (no login,
no network) never ends the run: a line on stderr says so, once, and W&B gets no more."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from megatrain_jax.fit import Hook
from megatrain_jax.observe.metrics import number, say_logging_stopped, writes_here


class WandbLogger:
    """Logs each step's numeric metrics to a W&B run (``eval_*`` under ``eval/``). Each start is a W&B run of its
    own, from its first step: a resumed run's steps are not merged into the interrupted one's (metrics.jsonl holds
    the continuous line). Under ``jax.distributed`` only process 0 logs: one W&B run, not one a process."""

    def __init__(self, project: str, name: str | None = None, config: dict[str, Any] | None = None,
                 run_dir: str | os.PathLike | None = None):
        if not self.available():
            raise ImportError("W&B logging was asked for ([log] wandb = true) but wandb is not installed: "
                              "pip install wandb, or set log.wandb=false")
        self._init = dict(project=project, name=name, config=config, dir=str(run_dir) if run_dir is not None else None)
        self.run = None  # started at the first record: a run refused at start makes no W&B run (nor its folder)
        self.failed: Exception | None = None
        self._here: bool | None = None  # whether this process logs (``writes_here``): known at the first record

    @staticmethod
    def available() -> bool:
        try:
            return importlib.util.find_spec("wandb") is not None
        except ValueError:  # already imported without a spec (e.g. a stand-in module)
            return "wandb" in sys.modules

    def write(self, metrics: dict) -> None:
        if self._here is None:
            self._here = writes_here()
        if self.failed is not None or not self._here:
            return
        try:
            if self.run is None:
                import wandb
                self.run = wandb.init(**self._init)
            values = {k: number(v) for k, v in metrics.items() if k != "step"}
            data = {(f"eval/{k[5:]}" if k.startswith("eval_") else k): v for k, v in values.items() if v is not None}
            self.run.log(data, step=int(metrics["step"]))
        except Exception as err:  # noqa: BLE001 - W&B is a view of the run, never a reason to end it
            self.failed = err
            say_logging_stopped("W&B", int(metrics["step"]), err)

    def hook(self) -> Hook:
        return Hook(lambda m, info: self.write(m), every=1)

    def close(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish()
        except Exception as err:  # noqa: BLE001 - closed in the run's finally: never hides how the run ended
            if self.failed is None:
                self.failed = err
                say_logging_stopped("W&B", None, err)
