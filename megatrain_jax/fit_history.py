"""Each step's metrics kept beside the run's checkpoints (``checkpoint_dir/fit_history.jsonl``), so that a run
resumed with nothing left to train can still say how its last step went: ``fit``'s ``History.resumed`` is the
record of the step it resumed from, and ``history["loss"][-1]`` reads it (the README's example, run twice).

One JSON object per step, appended as the step's metrics reach the hooks (one step late, already on the host),
by the first process only. A run that starts from step ``k`` first cuts the file back to the steps up to
``k`` (what an interrupted run trained past its last checkpoint is trained again), written whole under a
temporary name; a run that trains nothing leaves the file as it was.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
from pathlib import Path
from typing import Any

import jax

FILE = "fit_history.jsonl"


def _plain(value: Any) -> Any:
    """A metric as a JSON value (None: not a number, left out)."""
    if isinstance(value, (bool, numbers.Integral)):
        return int(value) if not isinstance(value, bool) else value
    if isinstance(value, numbers.Real) or getattr(value, "shape", None) == ():
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def read(root: str | os.PathLike | None) -> list[dict]:
    """The records in ``root/fit_history.jsonl`` (none without the file); a line cut short is left out."""
    path = None if root is None else Path(root) / FILE
    if path is None or not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def step_record(root: str | os.PathLike | None, step: int) -> dict | None:
    """The last record of ``step`` in ``root``'s file (None: not kept)."""
    return next((r for r in reversed(read(root)) if r.get("step") == step), None)


class StepLog:
    """Appends each step's metrics to ``root/fit_history.jsonl``, for a run starting from ``start_step``."""

    def __init__(self, root: str | os.PathLike, start_step: int):
        self.path, self.start_step = Path(root) / FILE, start_step
        self._f = None
        self.failed = False

    def write(self, metrics: dict) -> None:
        """Append ``metrics``. A file that cannot be written is said once on stderr and given up: the run and
        its checkpoints go on (their own failures are the checkpoint's to report)."""
        if jax.process_index() != 0 or self.failed:
            return
        try:
            if self._f is None:  # the first step: the file goes on from the steps before this run's start
                self.path.parent.mkdir(parents=True, exist_ok=True)
                kept = [r for r in read(self.path.parent) if r.get("step", 0) <= self.start_step]
                tmp = self.path.with_name(f".{FILE}.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
                self._f = open(self.path, "a")
            record = {k: v for k, v in ((k, _plain(v)) for k, v in metrics.items()) if v is not None}
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:
            self.failed = True
            print(f"{self.path}: cannot write the steps' metrics ({e}); a run resumed from these checkpoints "
                  f"with nothing left to train will have no metrics to show", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
