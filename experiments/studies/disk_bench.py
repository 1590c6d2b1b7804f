"""How fast this machine's disk reads and writes the disk tier's files (issue 15), before a training run.

    PYTHONPATH=. python experiments/studies/disk_bench.py --dir /tmp/megatrain_disk_tier --gib 4 --out $OUT/disk.json

Writes ``--gib`` GiB of float32 arrays shaped like a 7B block's Adam moments through the disk tier's own
code (``DiskTier``: zarr3, uncompressed, 64 MiB row chunks, tensorstore), waits for every write, then
reads them back, and reports GB/s for each; ``--drop-cache`` (root only) empties the page cache between
the two, so the reads come from the disk rather than from memory. The disk tier needs roughly
(moment bytes of the tier blocks per step) / (step time) in each direction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from child import drop_page_cache, git_commit  # noqa: E402
from megatrain_jax.engine.update.disk_tier import IO_CONTEXT, DiskTier  # noqa: E402
from megatrain_jax.optim import AdamWState  # noqa: E402
from megatrain_jax.engine.parts import Part, PartId  # noqa: E402


def raw_direct(folder: str, total: int, block: int = 64 * 2**20) -> dict:
    """The disk's own sequential rate, for comparison: ``total`` bytes written to one file and read back
    with O_DIRECT in ``block``-byte calls from one page-aligned buffer, no tensorstore, no page cache."""
    import mmap
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).bytes(block))
    path = os.path.join(folder, "raw_direct.bin")
    os.makedirs(folder, exist_ok=True)
    n = max(1, total // block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    try:
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t
    finally:
        os.close(fd)
        os.remove(path)
    return {"system": "raw O_DIRECT file I/O", "bytes": n * block, "block_bytes": block,
            "write_gb_s": round(n * block / write_s / 1e9, 3), "read_gb_s": round(n * block / read_s / 1e9, 3),
            "status": "ok"}


def tier_round(folder: str, n: int, data: np.ndarray, drop_cache: bool) -> dict:
    """``n`` parts' moments (mu and nu, each ``data``) written through a new ``DiskTier`` in ``folder`` and read back,
    its files created empty first and removed after: the seconds each way. Reads are not started ahead (the tier's
    ``read_ahead`` would start them behind the last write, before the timed loads)."""
    parts = [PartId.block(i) for i in range(n)]
    tier = DiskTier(folder, parts, read_ahead=0)
    empty = Part({}, AdamWState(np.int32(0), np.zeros_like(data), np.zeros_like(data)), None)
    records = {part: tier.spill(part, empty, fresh=True) for part in parts}
    t = time.perf_counter()
    for part in parts:
        tier.store(part, Part({}, AdamWState(np.int32(0), data, data), None))
    tier.flush()
    write_s = time.perf_counter() - t
    dropped = drop_page_cache() if drop_cache else False
    t = time.perf_counter()
    loaded = [tier.load(part, records[part]) for part in parts]
    read_s = time.perf_counter() - t
    same = all(np.array_equal(x.opt.mu, data) and np.array_equal(x.opt.nu, data) for x in loaded)
    del loaded
    tier.remove()
    return {"write_s": write_s, "read_s": read_s, "page_cache_dropped": dropped, "read_back_equal": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (removed afterwards)")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB written, then read")
    ap.add_argument("--out", required=True)
    ap.add_argument("--drop-cache", action="store_true", help="sync and drop the page cache before reading")
    args = ap.parse_args()
    shape = (11008, 4096)  # a 7B MLP matrix: 172 MiB per moment array
    per = int(np.prod(shape)) * 4
    n = max(1, int(args.gib * 2**30 // (2 * per)))  # parts of (mu, nu)
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    timed = tier_round(args.dir, n, data, args.drop_cache)
    if args.drop_cache and not timed["page_cache_dropped"]:
        print("could not drop the page cache (not root?); reads may come from memory", file=sys.stderr)
    assert timed["read_back_equal"]
    write_s, read_s, total = timed["write_s"], timed["read_s"], 2 * n * per
    dev = subprocess.run(["df", "--output=source", args.dir if os.path.exists(args.dir) else "/"],
                         capture_output=True, text=True).stdout.split()[-1:]
    run = {"system": "megatrain_jax.engine.update.disk_tier", "config": f"{n} parts of two {shape} float32 arrays",
           "dir": args.dir, "disk": dev, "free_gib": round(free / 2**30, 1), "bytes": total,
           "write_s": round(write_s, 3), "read_s": round(read_s, 3), "write_gb_s": round(total / write_s / 1e9, 3),
           "read_gb_s": round(total / read_s / 1e9, 3), "page_cache_dropped": args.drop_cache,
           "tensorstore_context": IO_CONTEXT, "status": "ok",
           "note": "one I/O thread (the tier's), tensorstore's own parallelism within each array, no read ahead; "
                   "without --drop-cache the reads may come from the page cache"}
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/disk_bench.py " + " ".join(sys.argv[1:]),
              "git_commit": git_commit(), "date": datetime.date.today().isoformat(),
              "device": {"name": "host (no GPU used)", "host_ram_gib": round(pages / 2**30, 1),
                         "cpu_cores": os.cpu_count()}, "runs": [run, raw_direct(args.dir, total)]}
    shutil.rmtree(args.dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["runs"]:
        print(json.dumps({k: r.get(k) for k in ("system", "write_gb_s", "read_gb_s", "bytes", "disk")}))


if __name__ == "__main__":
    main()
