"""What a CRC-32C per chunk would cost the disk tier, and what it would catch: the tier's files as they are (zarr3,
uncompressed, the ``bytes`` codec only) against the same files with zarr3's ``crc32c`` codec after it, written and
read back through the tier's own code (``DiskTier``) in turns, the page cache dropped before each read where this
process may. Then one byte of a stored chunk is changed in place, the file's size kept (a disk or a program
writing into it): the read of the plain files returns the changed moment as if nothing happened; with the codec
the read fails.

    PYTHONPATH=. python experiments/studies/disk_tier_checksum.py --dir /tmp/tier_checksum --gib 4 --rounds 2 \
        --out $OUT/h200_disk_tier_checksum.json

The codec is put in by wrapping ``tensorstore.open`` as the tier's module calls it (the study's own patch; the
product has no switch for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # disk_bench.py
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from child import drop_page_cache, git_commit  # noqa: E402
from disk_bench import tier_round  # noqa: E402
from megatrain_jax.engine.parts import Part, PartId  # noqa: E402
from megatrain_jax.engine.update import disk_tier  # noqa: E402
from megatrain_jax.optim import AdamWState  # noqa: E402

SHAPE = (11008, 4096)  # a 7B MLP matrix: 172 MiB per moment array, as disk_bench.py


@contextlib.contextmanager
def checksummed(on: bool):
    """The tier's arrays opened with a ``crc32c`` codec after ``bytes`` while ``on``."""
    real = disk_tier.ts.open

    def open_(spec, *args, **kwargs):
        if on and spec.get("driver") == "zarr3" and "metadata" in spec:
            spec = {**spec, "metadata": {**spec["metadata"],
                                         "codecs": [*spec["metadata"]["codecs"], {"name": "crc32c"}]}}
        return real(spec, *args, **kwargs)

    disk_tier.ts.open = open_
    try:
        yield
    finally:
        disk_tier.ts.open = real


def one_round(folder: str, n: int, data: np.ndarray, checksum: bool) -> dict:
    """``n`` parts' (mu, nu) written through a fresh tier and read back (``disk_bench.tier_round``, the page cache
    dropped before the reads): seconds and GB/s each way."""
    with checksummed(checksum):
        timed = tier_round(folder, n, data, drop_cache=True)
    total = 2 * n * data.nbytes
    return {"checksum": checksum, "bytes": total, "write_s": round(timed["write_s"], 3),
            "read_s": round(timed["read_s"], 3), "write_gb_s": round(total / timed["write_s"] / 1e9, 3),
            "read_gb_s": round(total / timed["read_s"] / 1e9, 3), "page_cache_dropped": timed["page_cache_dropped"],
            "read_back_equal": timed["read_back_equal"]}


def corruption(folder: str, data: np.ndarray, checksum: bool) -> dict:
    """One byte of a stored chunk of block 0's mu changed in place (the file keeps its size): what a read gives."""
    part = PartId.block(0)
    small = data[:512]
    with checksummed(checksum):
        tier = disk_tier.DiskTier(folder, [part], read_ahead=0)
        empty = Part({}, AdamWState(np.int32(0), np.zeros_like(small), np.zeros_like(small)), None)
        record = tier.spill(part, empty, fresh=True)
        tier.store(part, Part({}, AdamWState(np.int32(0), small, small), None))
        tier.flush()
        chunks = sorted(p for p in (tier.root / part.name).rglob("*") if p.is_file() and "zarr.json" not in p.name
                        and "mu" in str(p.relative_to(tier.root)))
        victim = chunks[0]
        size = victim.stat().st_size
        with open(victim, "r+b") as f:  # a byte in the middle of the chunk's data, flipped
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        size_kept = victim.stat().st_size == size
        drop_page_cache()
        try:
            got = np.asarray(tier.load(part, record).opt.mu)
            outcome = "read, equal" if np.array_equal(got, small) else "read, CHANGED moments returned silently"
        except Exception as e:  # noqa: BLE001  (what the tier raises is what is recorded)
            outcome = f"refused: {type(e).__name__}: {str(e)[:200]}"
        tier.remove()
    return {"checksum": checksum, "file": str(victim.relative_to(folder)), "size_kept": size_kept, "outcome": outcome}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (removed afterwards)")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB written, then read, per round and variant")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    n = max(1, int(args.gib * 2**30 // (2 * data.nbytes)))
    runs = []
    for r in range(args.rounds):  # in turns, so that a drift of the disk's rate reaches both
        for checksum in (False, True):
            run = one_round(os.path.join(args.dir, f"r{r}_{int(checksum)}"), n, data, checksum)
            runs.append({"round": r, **run})
            print(json.dumps(runs[-1]), flush=True)
    checks = [corruption(os.path.join(args.dir, f"c{int(c)}"), data, c) for c in (False, True)]
    for c in checks:
        print(json.dumps(c), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)

    def mean(key: str, checksum: bool) -> float:
        return round(float(np.mean([x[key] for x in runs if x["checksum"] == checksum])), 3)

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    import datetime
    result = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/studies/disk_tier_checksum.py " + " ".join(sys.argv[1:]),
              "git_commit": git_commit(), "date": datetime.date.today().isoformat(),
              "device": {"name": "host (no GPU used)", "host_ram_gib": round(pages / 2**30, 1),
                         "cpu_cores": os.cpu_count()},
              "tensorstore_context": disk_tier.IO_CONTEXT, "shape": list(SHAPE), "runs": runs,
              "summary": {variant: {"write_gb_s": mean("write_gb_s", c), "read_gb_s": mean("read_gb_s", c)}
                          for variant, c in (("plain", False), ("crc32c", True))},
              "corruption": checks}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
