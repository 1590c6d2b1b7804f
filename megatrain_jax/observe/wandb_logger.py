"""Weights & Biases, opt-in: used only when asked for (``[log] wandb = true``) and installed."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from megatrain_jax.fit import Hook


class WandbLogger:
    """Logs each step's numeric metrics to a W&B run (``eval_*`` under ``eval/``). Each start is a W&B run of its
    own, from its first step: a resumed run's steps are not merged into the interrupted one's (metrics.jsonl holds
    the continuous line)."""

    def __init__(self, project: str, name: str | None = None, config: dict[str, Any] | None = None,
                 run_dir: str | os.PathLike | None = None):
        if not self.available():
            raise ImportError("W&B logging was asked for ([log] wandb = true) but wandb is not installed: "
                              "pip install wandb, or set log.wandb=false")
        self._init = dict(project=project, name=name, config=config, dir=str(run_dir) if run_dir is not None else None)
        self.run = None  # started at the first record: a run refused at start makes no W&B run (nor its folder)

    @staticmethod
    def available() -> bool:
        try:
            return importlib.util.find_spec("wandb") is not None
        except ValueError:  # already imported without a spec (e.g. a stand-in module)
            return "wandb" in sys.modules

    def write(self, metrics: dict) -> None:
        if self.run is None:
            import wandb
            self.run = wandb.init(**self._init)
        data = {(f"eval/{k[5:]}" if k.startswith("eval_") else k): v for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        self.run.log(data, step=int(metrics["step"]))

    def hook(self) -> Hook:
        return Hook(lambda m, info: self.write(m), every=1)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
