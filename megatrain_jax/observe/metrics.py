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
import numbers
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


def _scalar(value: Any) -> Any:
    """A numpy or JAX 0-d value as its Python scalar (``np.bool_`` -> bool, ``np.float32`` -> float); else ``value``."""
    if hasattr(value, "shape") and np.shape(value) == ():
        return np.asarray(value).item()
    return value


def _plain(value: Any) -> Any:
    """A JSON-ready scalar; None for what JSON cannot hold."""
    value = _scalar(value)
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else str(v)  # "nan" / "inf": still visible, still valid JSON
    return None


def number(value: Any) -> float | None:
    """``value`` as a float where it is a number (Python, numpy or a 0-d array; NaN and inf included), None for
    anything else (flags, text): what TensorBoard and W&B take."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def writes_here() -> bool:
    """Whether this process writes the run's records: process 0 only under ``jax.distributed`` (every process
    reports the same steps; several writing one run folder's files would interleave them, or, at a fresh start,
    write over each other's lines). Asked at the first record: asking earlier would start JAX's backends."""
    return jax.process_index() == 0


def say_logging_stopped(what: str, step: int | None, err: BaseException) -> None:
    """The one line a writer that failed (TensorBoard, W&B) says: it logs no more, and the run goes on."""
    at = f"at step {step}" if step is not None else "as the run ended"
    print(f"note: {what} logging stopped {at} ({type(err).__name__}: {err}); the run goes on, and metrics.jsonl "
          f"still gets every step", file=sys.stderr, flush=True)


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
    a run that fails to start leaves it as it was. Under ``jax.distributed`` only process 0 writes (``writes_here``).
    """

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.append = append
        self.moved_aside: Path | None = None
        self._f = None
        self._here: bool | None = None  # whether this process writes: known at the first record
        self._t0: float | None = None

    def _open(self, first_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not (self.append and self.path.exists()):
            self._f = open(self.path, "w")
            return
        text = _read_text(self.path)
        records = _lines_and_records(self.path, text)
        earlier = [line for line, r in records if r["step"] < first_step]
        kept = [line for line, r in _latest_per_step(records) if r["step"] < first_step]
        why = (f"it holds records of step {first_step} or later, which this run writes anew"
               if len(earlier) < len(records) else
               "it holds a step more than once, or out of order: each step's last record is kept, in step order"
               if kept != earlier else "its last line was cut short" if text and not text.endswith("\n") else None)
        last = max((r["step"] for _, r in records), default=None)
        if last is not None and last < first_step - 1:  # never in silence: the history has a hole from here
            gap = f"step {last + 1}" if last + 1 == first_step - 1 else f"steps {last + 1} to {first_step - 1}"
            print(f"{self.path}: no records of {gap} (the run that saved the checkpoint "
                  f"resumed from stopped before writing them); the metrics go on from step {first_step}",
                  file=sys.stderr, flush=True)
        if why is not None:
            self.moved_aside = free_name(self.path)
            write_whole(self.moved_aside, text)
            write_whole(self.path, "".join(kept))
            print(f"{self.path}: kept whole as {self.moved_aside} ({why}); {self.path.name} goes on from its "
                  f"{len(kept)} records before step {first_step}", file=sys.stderr, flush=True)
        self._f = open(self.path, "a")

    def write(self, metrics: dict) -> None:
        if self._here is None:
            self._here = writes_here()
        if not self._here:
            return
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


def write_whole(path: Path, text: str) -> None:
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
                    raise ValueError(f"{path}:{n} is not valid JSON (a damaged line: fix it or remove it)") from None
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}:{n} is not a metrics record (a JSON object with an integer step, one per "
                                 f"line, as a training run writes run_dir/metrics.jsonl): {line.strip()[:60]}")
            out.append((line if line.endswith("\n") else line + "\n", record))
    return out


def _latest_per_step(records: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Each step's last ``(line, record)``, in step order: a step written more than once (histories joined by
    hand, or by an older version that appended a resumed run's steps) counts once, as last written."""
    by_step = {r["step"]: (line, r) for line, r in records}
    return [by_step[step] for step in sorted(by_step)]


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a metrics file: it is not text (a training run writes run_dir/metrics.jsonl, "
                         f"one JSON object a line)") from None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl (or of ``path/metrics.jsonl`` for a run folder): each step's last record, in
    step order (a step written more than once counts once, as last written; a last line cut short is left out)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.jsonl").exists():
            raise FileNotFoundError(f"no metrics file in {path} ({path / 'metrics.jsonl'}): it is not a run folder, "
                                    f"or its run has not finished a step yet; a training run writes "
                                    f"run_dir/metrics.jsonl from its first step")
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder (the train.run_dir that holds "
                                f"metrics.jsonl) or a metrics .jsonl file")
    return [record for _, record in _latest_per_step(_lines_and_records(path, _read_text(path)))]
