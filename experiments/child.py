"""What the experiment scripts (here and in studies/) share for running one measurement per process: the
commit being measured, a results file's header, a child process whose result is the JSON object on its last
line of output, an empty page cache, the host's description for host-optimizer measurements, and a median
timer."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median_seconds(fn, reps: int) -> float:
    """The median seconds of ``reps`` calls of ``fn`` after one warm-up call (pass a ``fn`` that waits for
    its own work, e.g. ``jax.block_until_ready``)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def drop_page_cache() -> bool:
    """Write dirty pages out and empty the page cache (root only), so that the next reads come from the
    disk; False where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def git_commit() -> str | None:
    """``MEGATRAIN_GIT_COMMIT`` (set where the tree is a copy without .git), else the checkout's HEAD."""
    return os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None


def script_path(script: str) -> str:
    """``script`` as the command line of a results file names it: relative to the repository root
    (``experiments/bench.py``, ``experiments/studies/op_memory.py``)."""
    return os.path.relpath(os.path.abspath(script), REPO)


def system_info() -> dict:
    """The host's CPU vector flags, transparent-huge-page settings, lscpu and meminfo lines and the host
    AdamW kernel's OpenMP threads: what a host-optimizer measurement depends on beyond the code."""
    from megatrain_jax.engine.update.host_kernel import load

    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            return f"unreadable: {e}"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model", "CPU family", "Stepping", "BogoMIPS", "Hypervisor", "NUMA", "Thread", "Core", "Socket",
            "L1d", "L2", "L3", "CPU(s)")
    flags = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines() if ln.startswith("Flags")), [])
    return {"cpu_vector_flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "prefetchw"))),
            "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "lscpu": [ln for ln in lscpu.splitlines() if ln.strip().startswith(keep)],
            "meminfo": [ln for ln in read("/proc/meminfo").splitlines() if "Huge" in ln or "Mem" in ln],
            "omp_threads": load().megatrain_omp_threads()}


def results_header(out: str, script: str) -> dict:
    """The fields every results file starts with (docs/results.md): its name (from ``out``), the command
    that wrote it (``script`` and this process's arguments), the commit, the date, JAX's version and the
    device. Call it once the measurement is done: it starts JAX's backend."""
    import datetime

    import jax
    dev = jax.devices()[0]
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    flags = os.environ.get("XLA_FLAGS")  # a variant set from outside (e.g. a flag's A/B) belongs with the command
    return {"name": os.path.splitext(os.path.basename(out))[0],
            "command": f"PYTHONPATH=. python {script_path(script)} " + shlex.join(sys.argv[1:]),
            **({"xla_flags": flags} if flags else {}),
            "git_commit": git_commit(), "date": datetime.date.today().isoformat(), "jax_version": jax.__version__,
            "device": {"name": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
                       "host_ram_gib": round(pages / 2**30, 1), "cpu_cores": os.cpu_count()}}


def pick_configs(ap, value: str, known) -> list[str]:
    """The comma-separated configuration names of ``value``; an argparse error names the unknown ones."""
    names = value.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(known)}")
    return names


def run_child(cmd: list[str], timeout: float | None = None, **fields) -> dict:
    """Run ``cmd`` in the repository; its result is the JSON object its last output line holds. A failure
    is a result too: ``status`` says how it ended (a negative exit code is the signal: -9 is usually the
    kernel's OOM killer). ``fields`` go into the result of a failure; ``wall_s`` into every result."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout)
        lines = proc.stdout.strip().splitlines()
        out = (json.loads(lines[-1]) if proc.returncode == 0 and lines else
               {**fields, "status": f"error: exit {proc.returncode} (a negative code is the signal: -9 is "
                                    f"usually the OOM killer)"})
    except subprocess.TimeoutExpired:
        out = {**fields, "status": f"error: no result within {timeout} s"}
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def run_configs(script: str, names: list[str], extra: list[str], timeout: float | None, result: dict, out: str,
                line) -> None:
    """Each configuration of ``script`` in its own process (``script --child NAME *extra``): its record is
    added to ``result["runs"]`` (the first record's ``device`` goes to ``result``), the file ``out`` is
    rewritten after each, and ``line(name, run)`` is printed."""
    for name in names:
        run = run_child([sys.executable, os.path.abspath(script), "--child", name, *extra], timeout, config=name)
        result["device"] = result.get("device") or run.pop("device", None)
        run.pop("device", None)
        result["runs"].append(run)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(line(name, run), flush=True)
