"""Where a `megatrain-jax train` run's host memory goes, phase by phase: the CLI run in this process, as a user runs
it, with its resident set sampled every 0.25 s by kind (anonymous, shared: XLA's pinned pool, mapped files) and, at
each phase mark (the run's start, the engine's first and last ``sync``, the export's start and end), glibc's heap
figures (``mallinfo2``), the thread count and the largest mappings by anonymous memory (``/proc/self/smaps``). At the
end, ``malloc_trim(0)`` shows how much of the anonymous memory is freed heap that glibc kept.

    PYTHONPATH=. python experiments/studies/host_memory_phases.py --config h200_sft_8b --steps 8 \
        --set train.export_hf=/tmp/shipped_configs/runs/h200_sft_8b/hf --out $OUT/h200_host_memory_phases.json

A config that names a Hugging Face folder gets a random one of its shape and generated chats (``shipped_configs``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from child import results_header  # noqa: E402
from shipped_configs import CONFIGS, hf_inputs  # noqa: E402

GiB = 2**30


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def status() -> dict:
    """The process's resident set by kind and its threads (GiB), and the host's MemAvailable."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = round(int(value.split()[0]) / 2**20, 3)
            elif key == "Threads":
                out[key] = int(value)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                out["MemAvailable"] = round(int(line.split()[1]) / 2**20, 3)
    return out


def heap() -> dict:
    m = LIBC.mallinfo2()
    return {"arena_gib": round(m.arena / GiB, 3), "in_use_gib": round(m.uordblks / GiB, 3),
            "free_gib": round(m.fordblks / GiB, 3), "mmapped_gib": round(m.hblkhd / GiB, 3), "mmapped": m.hblks}


def mappings(top: int = 12) -> list[dict]:
    """The mappings holding the most anonymous (or shared) memory, with their names."""
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = {"name": parts[5] if len(parts) > 5 else "", "size_gib": (hi - lo) / GiB}
                rows.append(cur)
            elif parts[0] in ("Anonymous:", "Rss:", "Shared_Dirty:", "Shared_Clean:") and cur is not None:
                cur[parts[0][:-1]] = int(parts[1]) / 2**20
    by_name: dict[str, dict] = {}
    for r in rows:  # anonymous regions grouped by name ('' for unnamed, '[heap]', a device file, ...)
        key = r["name"] if r["name"] else "(unnamed)"
        agg = by_name.setdefault(key, {"name": key, "regions": 0, "rss_gib": 0.0, "anon_gib": 0.0, "size_gib": 0.0})
        agg["regions"] += 1
        agg["rss_gib"] += r.get("Rss", 0)
        agg["anon_gib"] += r.get("Anonymous", 0)
        agg["size_gib"] += r["size_gib"]
    unnamed = sorted((r for r in rows if not r["name"]), key=lambda r: -r.get("Anonymous", 0))[:top]
    return {"by_name": sorted(({k: (round(v, 3) if isinstance(v, float) else v) for k, v in a.items()}
                               for a in by_name.values()), key=lambda a: -a["rss_gib"])[:top],
            "largest_unnamed_anon_gib": [round(r.get("Anonymous", 0), 3) for r in unnamed]}


class Recorder:
    def __init__(self):
        self.t0 = time.time()
        self.samples, self.marks = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.25):
            self.samples.append({"t": round(time.time() - self.t0, 2), **status()})

    def mark(self, what: str, detail: bool = True) -> None:
        row = {"t": round(time.time() - self.t0, 2), "what": what, **status(), "heap": heap()}
        if detail:
            row["mappings"] = mappings()
        self.marks.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "mappings"}), flush=True)

    def stop(self):
        self._stop.set()
        self._thread.join()


def wrap(owner, name: str, rec: Recorder, label: str, every: bool = False):
    """Mark before and after ``owner.name`` (its first and every later call where ``every``, else the first and
    the latest: the latest's marks replace each other)."""
    fn = getattr(owner, name)
    calls = [0]

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        calls[0] += 1
        n = calls[0]
        if every or n == 1:
            rec.mark(f"{label} {n} start")
        out = fn(*args, **kwargs)
        rec.mark(f"{label} {n} end", detail=every or n == 1)
        return out
    setattr(owner, name, marked)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--work", default="/tmp/shipped_configs")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    path = CONFIGS / f"{args.config}.toml"
    work = Path(args.work)
    run_dir = work / "runs" / path.stem
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*hf_inputs(path, work), f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
                 f"train.run_dir={run_dir}", "train.export_hf=none", *args.set]
    rec = Recorder()
    rec.mark("before import")
    import megatrain_jax.cli.run as run
    import megatrain_jax.hf as hf
    from megatrain_jax.cli import export_guard, main as cli_main
    from megatrain_jax.engine.engine import Engine
    rec.mark("imported")
    wrap(run, "fit", rec, "fit")
    wrap(Engine, "sync", rec, "sync")
    wrap(export_guard, "first_nonfinite", rec, "finiteness scan")
    wrap(hf, "save_hf", rec, "export", every=True)
    t = time.time()
    code = cli_main(["train", "--config", str(path), *overrides])
    wall = time.time() - t
    rec.mark("train returned")
    trimmed = LIBC.malloc_trim(0)
    rec.mark("after malloc_trim(0)")
    rec.stop()
    samples = rec.samples
    peak = max(samples, key=lambda s: s.get("RssAnon", 0) + s.get("RssShmem", 0)) if samples else {}
    plan = json.loads((run_dir / "memory_plan.json").read_text()) if (run_dir / "memory_plan.json").exists() else {}
    header = results_header(args.out, __file__)
    header["device"]["cpu_cores"] = os.cpu_count()
    out = {**header, "runs": [{
        "config": args.config, "overrides": overrides, "exit_status": code, "wall_s": round(wall, 1),
        "planned_host_gib": round(plan["host_total"] / GiB, 3) if plan else None,
        "planned_host_items_gib": {k: round(v / GiB, 3) for k, v in plan.get("host", {}).items()} if plan else None,
        "peak_anon_plus_shmem": peak, "malloc_trim_released": bool(trimmed),
        "marks": rec.marks, "samples": samples[::4]}]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("peak anon+shmem", peak, "->", args.out)
    return code


if __name__ == "__main__":
    sys.exit(main())
