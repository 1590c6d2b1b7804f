"""TensorBoard event files, through tensorboardX or else the ``tensorboard`` package's own event writer
(neither TensorFlow nor torch is needed). Without either, ``TensorBoardWriter.available()`` is False and
the run goes on with metrics.jsonl alone; so it does when writing them fails (a line on stderr says so, once)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from megatrain_jax.fit import Hook
from megatrain_jax.observe.metrics import number, say_logging_stopped, writes_here

# metric -> TensorBoard tag; anything else numeric goes under train/
_GROUPS = {"tokens_per_s": "perf", "loss_tokens_per_s": "perf", "model_tflops": "perf", "mfu": "perf",
           "step_time_s": "perf", "dispatch_s": "perf", "host_peak_rss_gib": "memory", "gpu_peak_gib": "memory",
           "gpu_in_use_gib": "memory"}
_SKIP = {"step", "tokens", "loss_tokens", "time", "elapsed_s", "eval_tokens"}


def tag(key: str) -> str:
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    if key.startswith(("h2d", "d2h")):
        return f"perf/{key}"
    return f"{_GROUPS.get(key, 'train')}/{key}"


class _EventFileScalars:
    """Scalars through ``tensorboard.summary.writer.event_file_writer`` (the writer torch uses)."""

    def __init__(self, logdir: str, purge_step: int):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(logdir)
        # as tensorboardX's and torch's SummaryWriter(purge_step=...) write it
        self._writer.add_event(event_pb2.Event(step=purge_step, file_version="brain.Event:2"))
        self._writer.add_event(event_pb2.Event(step=purge_step, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)))

    def add_scalar(self, name: str, value: float, step: int) -> None:
        summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=name, simple_value=value)])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TensorBoardWriter:
    """Writes every numeric metric of each step as a scalar, tagged ``train/``, ``eval/``, ``perf/`` or
    ``memory/``, into event files in ``logdir`` (view with ``tensorboard --logdir runs``).

    The event file is created at the first record, marked as a restart at that step (``purge_step``): TensorBoard
    then hides what earlier event files in ``logdir`` hold for that step and later, so that a resumed run (or a
    branch) shows one line, as ``metrics.jsonl`` does; the hidden records stay in their files.

    Under ``jax.distributed`` only process 0 writes. A failure (the backend's import, e.g. a protobuf it cannot
    use; a write) never ends the run: it is said once on stderr and nothing more is logged to TensorBoard
    (``failed`` holds it)."""

    def __init__(self, logdir: str | os.PathLike, flush_every: int = 50):
        self.logdir = Path(logdir)
        if importlib.util.find_spec("tensorboardX") is not None:
            self.backend = "tensorboardX"
        elif importlib.util.find_spec("tensorboard") is not None:
            self.backend = "tensorboard"
        else:
            raise ImportError("TensorBoard logging needs tensorboardX or tensorboard: pip install tensorboardX")
        self.flush_every = flush_every
        self.failed: Exception | None = None
        self._here: bool | None = None  # whether this process writes (``writes_here``): known at the first record
        self._n = 0
        self._writer = None  # the event file is created at the first record: a run refused at start writes none

    def _open(self, first_step: int):
        self.logdir.mkdir(parents=True, exist_ok=True)
        if self.backend == "tensorboardX":
            from tensorboardX import SummaryWriter
            return SummaryWriter(logdir=str(self.logdir), purge_step=first_step)
        return _EventFileScalars(str(self.logdir), first_step)

    @staticmethod
    def available() -> bool:
        return any(importlib.util.find_spec(m) is not None for m in ("tensorboardX", "tensorboard"))

    def write(self, metrics: dict) -> None:
        if self._here is None:
            self._here = writes_here()
        if self.failed is not None or not self._here:
            return
        try:
            self._write(metrics)
        except Exception as err:  # noqa: BLE001 - TensorBoard is a view of the run, never a reason to end it
            self._stop(int(metrics["step"]), err)

    def _write(self, metrics: dict) -> None:
        step = int(metrics["step"])
        if self._writer is None:
            self._writer = self._open(step)
        for key, value in metrics.items():
            if key not in _SKIP and (value := number(value)) is not None:
                self._writer.add_scalar(tag(key), value, step)
        self._n += 1
        if self._n % self.flush_every == 0 or "eval_loss" in metrics:
            self._writer.flush()

    def _stop(self, step: int | None, err: Exception) -> None:
        self.failed = err
        say_logging_stopped(f"TensorBoard ({self.logdir})", step, err)
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - already failed and said
                pass

    def hook(self) -> Hook:
        return Hook(lambda m, info: self.write(m), every=1)

    def close(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            writer.flush()
            writer.close()
        except Exception as err:  # noqa: BLE001 - closed in the run's finally: never hides how the run ended
            self.failed = err
            say_logging_stopped(f"TensorBoard ({self.logdir})", None, err)
