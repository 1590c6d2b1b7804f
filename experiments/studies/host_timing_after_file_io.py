"""Whether the host update's timing at a run's start reads slow after large file writes or after a process frees
much memory, and for how long.

Two starts on the 16-core H200 host timed full precision at 2.01 and 2.04 G params/s (56-57% of the host's usual
3.4-3.7) with steps at the usual pace after: `h200_sft_8b` right after its script wrote the 8B checkpoint
(~16 GB), and the DPO config on a loan that had just written an 8B export. This times ``kernel_rates`` (what
``train`` times at its start) on a quiet host, then right after writing ``--gib`` of file data without syncing,
once a second while the kernel writes the dirty pages back, after a sync, after the file's pages are dropped and
read back from the disk, and ``measured_host_update`` (the start's timing with its retake) right after a second
write. The 'freed' phase times it once a second after a child process has taken, touched and freed
``--free-gib`` of memory (an 8B checkpoint's maker or a finished 8B run exits just before such starts), and
``measured_host_update`` after a second such child. Each reading records /proc/meminfo's Dirty, Writeback,
Cached and MemFree, and each NUMA node's free memory. CPU only; needs ``--gib`` free on the disk of ``--dir`` (one file at a time, removed after).

    PYTHONPATH=. python experiments/studies/host_timing_after_file_io.py --gib 24 --dir /tmp \
        --free-gib 64 --phases freed,write --out $OUT/h200_host_timing_after_file_io_<sha>.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GiB = 1 << 30
MEMINFO = ("MemFree", "MemAvailable", "Cached", "Dirty", "Writeback")


def meminfo() -> dict[str, float]:
    """The host's memory counters that file writes move, in GiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in MEMINFO:
                out[key] = round(int(value.split()[0]) / (1 << 20), 2)
    return out


def node_free() -> dict[str, float]:
    """Each NUMA node's free memory in GiB (one entry on a host of one node)."""
    out = {}
    for path in sorted(glob.glob("/sys/devices/system/node/node*/meminfo")):
        with open(path) as f:
            for line in f:
                if "MemFree:" in line:
                    out[path.split("/")[-2]] = round(int(line.split()[-2]) / (1 << 20), 2)
    return out


def reading(label: str, t0: float, fn) -> dict:
    """One timing with the counters before it."""
    before = {**meminfo(), "nodes_free": node_free()}
    t = time.perf_counter()
    rates = fn()
    return {"label": label, "at_s": round(t - t0, 2), "took_s": round(time.perf_counter() - t, 2), "memory": before,
            "rates": rates}


def write_file(path: str, gib: float) -> float:
    """``gib`` of incompressible bytes written to ``path`` without a sync; the seconds it took."""
    import numpy as np
    block = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8).tobytes()
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(int(gib * GiB // len(block))):
            f.write(block)
    return time.perf_counter() - t


def drop_pages(path: str) -> None:
    """The file's cached pages dropped (clean pages: after a sync), so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: str) -> float:
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t


def topology() -> dict:
    out = {"nodes": sorted(os.path.basename(p) for p in glob.glob("/sys/devices/system/node/node[0-9]*")),
           "cores": len(os.sched_getaffinity(0))}
    for cmd in (["numactl", "--hardware"], ["lscpu"]):
        try:
            out[cmd[0]] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout[-3000:]
        except (OSError, subprocess.SubprocessError):
            out[cmd[0]] = None
    for key in ("dirty_ratio", "dirty_background_ratio", "dirty_expire_centisecs", "zone_reclaim_mode"):
        try:
            out[key] = open(f"/proc/sys/vm/{key}").read().strip()
        except OSError:
            out[key] = None
    return out


def free_after_touching(gib: float) -> float:
    """A child process that takes ``gib`` of memory, touches every page and exits; the seconds it took."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import numpy as np; a = np.ones({int(gib * GiB)}, np.uint8); "
                    "print(int(a[::4096].sum()))"], check=True, capture_output=True)
    return time.perf_counter() - t


PHASES = ("write", "freed")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=24.0, help="file data written in each write phase")
    ap.add_argument("--dir", default="/tmp", help="where the file is written (removed after)")
    ap.add_argument("--after-write", type=int, default=10, help="timings once a second after the first write")
    ap.add_argument("--free-gib", type=float, default=64.0,
                    help="memory a child process takes, touches and frees in the 'freed' phase")
    ap.add_argument("--after-free", type=int, default=12, help="timings once a second after it exits")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"which of {', '.join(PHASES)} to run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    phases_run = [p for p in args.phases.split(",") if p]
    if not set(phases_run) <= set(PHASES):
        raise SystemExit(f"--phases takes {', '.join(PHASES)}, got {args.phases!r}")
    from child import results_header
    from megatrain_jax.plan import machine
    path = os.path.join(args.dir, "host_timing_after_file_io.bin")
    gpu, cores = machine.gpu_name_before_jax(), len(os.sched_getaffinity(0))
    rows, t0, phases = [], time.perf_counter(), {}
    rates = machine.kernel_rates
    gib = 0.0
    try:
        for i in range(3):
            rows.append(reading("quiet", t0, rates))
            time.sleep(1)
        if "freed" in phases_run:
            phases["freed_child_s"] = round(free_after_touching(args.free_gib), 2)
            for i in range(args.after_free):
                rows.append(reading(f"after {args.free_gib:g} GiB freed +{i}", t0, rates))
                time.sleep(1)
            phases["freed_child_again_s"] = round(free_after_touching(args.free_gib), 2)
            rows.append(reading(f"measured_host_update after {args.free_gib:g} GiB freed", t0,
                                lambda: machine.measured_host_update.__wrapped__(gpu, cores)))
            rows.append(reading(f"after {args.free_gib:g} GiB freed, then", t0, rates))
        if "write" in phases_run:
            free = shutil.disk_usage(args.dir).free / GiB
            gib = min(args.gib, free - 6)
            if gib < 4:
                raise SystemExit(f"{args.dir} has {free:.1f} GiB free: too little to write a file of some size")
            phases["first_write_s"] = round(write_file(path, gib), 2)
            for i in range(args.after_write):
                rows.append(reading(f"after write +{i}", t0, rates))
                time.sleep(1)
            t = time.perf_counter()
            os.sync()
            phases["sync_s"] = round(time.perf_counter() - t, 2)
            rows.append(reading("after sync", t0, rates))
            drop_pages(path)
            for i in range(3):
                rows.append(reading(f"pages dropped +{i}", t0, rates))
                time.sleep(1)
            phases["read_back_s"] = round(read_file(path), 2)
            rows.append(reading("after read back", t0, rates))
            os.remove(path)
            os.sync()
            time.sleep(2)
            phases["second_write_s"] = round(write_file(path, gib), 2)
            rows.append(reading("measured_host_update after the second write", t0,
                                lambda: machine.measured_host_update.__wrapped__(gpu, cores)))
            rows.append(reading("after the second write, then", t0, rates))
    finally:
        if os.path.exists(path):
            os.remove(path)
    record = {**results_header(args.out, __file__),
              "runs": [{"phases_run": phases_run, "gib_written": gib, "free_gib": args.free_gib, "gpu": gpu,
                        "topology": topology(), "phases": phases, "readings": rows,
                        "note": "rates in parameters per second (kernel_rates: full precision split in two passes, "
                                "lean, capacity, q8, m7v5); memory in GiB before each reading"}]}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for r in rows:
        print(f"{r['label']:<46} t={r['at_s']:7.1f}s full {r['rates']['full'] / 1e9:5.2f} capacity "
              f"{r['rates']['capacity'] / 1e9:5.2f}  dirty {r['memory'].get('Dirty')} wb {r['memory'].get('Writeback')}"
              f" cached {r['memory'].get('Cached')} free {r['memory'].get('MemFree')} nodes {r['memory']['nodes_free']}")
    print(json.dumps(phases))
    return record


if __name__ == "__main__":
    main()
