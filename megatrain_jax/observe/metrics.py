"""Metrics to disk: one JSON object per step in ``run_dir/metrics.jsonl``, and memory high-water marks
(host: the peak resident set, and the resident set now by kind: ``host_rss_anon_gib`` for the process's
own arrays, ``host_rss_file_gib`` for mapped files such as a checkpoint being read).

Every key of the step's metrics dict is written (loss, grad_norm, lr, tokens_per_s and loss_tokens_per_s (the
tokens whose loss counts, a second: padding and prompts left out; one process only), model_tflops, mfu,
step_time_s, any transfer rates the engine reports, eval_loss / eval_ppl on evaluation steps), plus
``time`` (Unix seconds) and ``elapsed_s`` since the first record.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from megatrain_jax.fit import Hook

GiB = 1024**3


def host_peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_rss_parts() -> dict[str, int]:
    """This process's resident set now, by kind (Linux ``/proc/self/status``): ``anon`` (its own arrays, what
    a host plan must count), ``file`` (mapped files, e.g. safetensors being read: pages the kernel takes
    back under pressure) and ``shmem``; empty where the system does not say."""
    names = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] in names:
                    out[names[words[0]]] = int(words[1]) * 1024  # kB
    except OSError:
        return {}
    return out


def gpu_memory_stats() -> dict[str, int]:
    """``peak_bytes_in_use`` / ``bytes_in_use`` / ``bytes_limit`` of the first device, when it reports them
    (GPUs do; the CPU backend does not)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats is not an error
        return {}
    return {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}


def system_stats() -> dict[str, float]:
    """Host and GPU memory high-water marks in GiB, under the names the metrics file uses."""
    out = {"host_peak_rss_gib": host_peak_rss_bytes() / GiB}
    out.update({f"host_rss_{kind}_gib": b / GiB for kind, b in host_rss_parts().items()})  # now, by kind
    gpu = gpu_memory_stats()
    if "peak_bytes_in_use" in gpu:
        out["gpu_peak_gib"] = gpu["peak_bytes_in_use"] / GiB
    if "bytes_in_use" in gpu:
        out["gpu_in_use_gib"] = gpu["bytes_in_use"] / GiB
    return out


def memory_hook(every: int = 1) -> Hook:
    """Adds ``system_stats()`` to the step's metrics (put it before the writers)."""
    return Hook(lambda m, info: m.update(system_stats()), every=every)


def _plain(value: Any) -> Any:
    """A JSON-ready scalar; None for what JSON cannot hold."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) or (hasattr(value, "shape") and np.shape(value) == ()):
        v = float(value)
        return v if math.isfinite(v) else str(v)  # "nan" / "inf": still visible, still valid JSON
    return None


def free_name(path: Path) -> Path:
    """``metrics.jsonl`` -> the first of ``metrics.1.jsonl``, ``metrics.2.jsonl``, ... that does not exist."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return candidate


class JsonlWriter:
    """Writes each step's metrics as a line of JSON; flushed per line so ``tail -f`` follows a run.

    ``append`` (a resumed run): ``metrics.jsonl`` goes on from its records of the steps before the first step
    written now, so that it holds the line of training being continued, step 1 on (what ``plot`` draws). Records
    already there for that step or later (an interrupted run's steps past its last checkpoint, trained again now;
    another line of training in the same run folder: a run started over, or a branch from an earlier checkpoint
    into another checkpoint folder) are never lost: the whole file is first copied aside (``free_name``:
    ``metrics.1.jsonl``, ...), then ``metrics.jsonl`` is replaced by its earlier records. Each file is whole at
    every moment (written under a temporary name, then renamed), so a crash in between loses nothing.
    ``moved_aside`` names the copy, and a line on stderr says so. The file is touched only at the first record:
    a run that fails to start leaves it as it was.
    """

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.append = append
        self.moved_aside: Path | None = None
        self._f = None
        self._t0: float | None = None

    def _open(self, first_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not (self.append and self.path.exists()):
            self._f = open(self.path, "w")
            return
        text = self.path.read_text()
        records = _lines_and_records(self.path, text)
        kept = [line for line, r in records if r.get("step", 0) < first_step]
        why = (f"it holds records of step {first_step} or later, which this run writes anew" if len(kept) < len(records)
               else "its last line was cut short" if text and not text.endswith("\n") else None)
        last = max((r.get("step", 0) for _, r in records), default=None)
        if last is not None and last < first_step - 1:  # never in silence: the history has a hole from here
            gap = f"step {last + 1}" if last + 1 == first_step - 1 else f"steps {last + 1} to {first_step - 1}"
            print(f"{self.path}: no records of {gap} (the run that saved the checkpoint "
                  f"resumed from stopped before writing them); the metrics go on from step {first_step}",
                  file=sys.stderr, flush=True)
        if why is not None:
            self.moved_aside = free_name(self.path)
            _write_whole(self.moved_aside, text)
            _write_whole(self.path, "".join(kept))
            print(f"{self.path}: kept whole as {self.moved_aside} ({why}); {self.path.name} goes on from its "
                  f"{len(kept)} records before step {first_step}", file=sys.stderr, flush=True)
        self._f = open(self.path, "a")

    def write(self, metrics: dict) -> None:
        if self._f is None:
            self._open(int(metrics["step"]))
        now = time.time()
        self._t0 = now if self._t0 is None else self._t0
        record = {k: _plain(v) for k, v in metrics.items()}
        record = {k: v for k, v in record.items() if v is not None}
        record.update(time=round(now, 3), elapsed_s=round(now - self._t0, 3))
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as err:  # said with the file it failed on; fit then saves no checkpoint past this row
            raise OSError(err.errno, f"{err.strerror or err} (writing the metrics of step {metrics['step']})",
                          str(self.path)) from err

    def hook(self) -> Hook:
        return Hook(lambda m, info: self.write(m), every=1)

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()


def _write_whole(path: Path, text: str) -> None:
    """``path`` holding ``text``, never half written: written and synced under a temporary name, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _lines_and_records(path: Path, text: str) -> list[tuple[str, dict]]:
    """``(line, record)`` for each line of ``text`` (``path``'s) that holds a record, the line ending with a
    newline. Only the last line may be cut short (a run still writing, or killed mid-line): it is left out. A
    line of valid JSON that is not a record (an object with an integer ``step``, as ``JsonlWriter`` writes) is
    refused, naming the line: the file is not a run's metrics, or was edited."""
    lines, out = text.splitlines(keepends=True), []
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n < len(lines):
                    raise ValueError(f"{path}:{n} is not valid JSON") from None
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}:{n} is not a metrics record (a JSON object with an integer step, one per "
                                 f"line, as a training run writes run_dir/metrics.jsonl): {line.strip()[:60]}")
            out.append((line if line.endswith("\n") else line + "\n", record))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl (or of ``path/metrics.jsonl`` for a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}; a training run writes run_dir/metrics.jsonl")
    return [record for _, record in _lines_and_records(path, path.read_text())]
