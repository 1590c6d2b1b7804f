"""Checkpoint save and restore of a large engine state: seconds, peak host RSS during the save, and a check
that the restored state equals the saved one. Writes a results JSON (docs/results.md).

    PYTHONPATH=. python experiments/studies/checkpoint_bench.py --preset 7b --layers 16 --dir /tmp/ckpt --out $OUT/ckpt.json
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
import zlib

import jax
import numpy as np
from flax import nnx

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, default_optimizer, preset  # noqa: E402
from megatrain_jax.checkpoint import Checkpointer  # noqa: E402


def rss_gib(key: str = "VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 2**20
    return float("nan")


def fingerprint(engine: Engine, full_parts: int = 2, sample: int = 1 << 20) -> int:
    """CRC-32 over the io part and the first ``full_parts`` blocks in full (parameters and optimizer state),
    and over the first and last ``sample`` bytes of every other array: seconds, not minutes, at 7B."""
    engine.sync()
    s = engine.state
    crc = 0
    for i, part in enumerate(s.parts):
        for leaf in jax.tree.leaves((part.params, part.opt)):
            if not hasattr(leaf, "dtype"):
                continue
            raw = np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1)
            if i > full_parts and raw.size > 2 * sample:
                raw = np.concatenate([raw[:sample], raw[-sample:]])
            crc = zlib.crc32(raw, crc)
    return crc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dir", required=True, help="checkpoint directory (emptied first)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = preset(args.preset, **({"layers": args.layers} if args.layers else {}))
    shutil.rmtree(args.dir, ignore_errors=True)
    engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), default_optimizer(3e-4),
                    EngineConfig(), seed=0)
    rows, seq = 2, min(512, cfg.max_positions)
    rng = np.random.default_rng(0)
    engine.step(Batch.from_windows(rng.integers(0, cfg.vocab_size, (rows, seq + 1)))).resolve()
    engine.sync()
    before = fingerprint(engine)
    state_gib = engine.state.nbytes() / 2**30
    ck = Checkpointer(args.dir, keep=1)
    with open("/proc/self/clear_refs", "w") as f:  # reset the RSS high-water mark
        f.write("5")
    rss0 = rss_gib()
    t = time.perf_counter()
    ck.save(engine, wait=True)
    save_s = time.perf_counter() - t
    peak_added = rss_gib("VmHWM") - rss0
    disk_gib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.dir) for f in fs) / 2**30
    # Restore into the same engine after scrambling nothing but the step: equality is the test.
    t = time.perf_counter()
    ck.restore(engine)
    restore_s = time.perf_counter() - t
    after = fingerprint(engine)
    dev = jax.devices()[0]
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    out = {"name": f"checkpoint_{args.preset}_{cfg.layers}l", "command": "PYTHONPATH=. python experiments/studies/checkpoint_bench.py "
           + " ".join(sys.argv[1:]), "git_commit": commit,
           "device": {"name": getattr(dev, "device_kind", str(dev)), "cpu_cores": os.cpu_count(),
                      "host_ram_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)},
           "date": datetime.date.today().isoformat(),
           "runs": [{"system": "megatrain_jax", "model": {"layers": cfg.layers, "hidden": cfg.hidden,
                                                          "params": cfg.param_count()},
                     "state_gib": round(state_gib, 2), "checkpoint_on_disk_gib": round(disk_gib, 2),
                     "save_s": round(save_s, 2), "restore_s": round(restore_s, 2),
                     "save_gb_per_s": round(disk_gib * 2**30 / 1e9 / save_s, 2),
                     "host_rss_before_save_gib": round(rss0, 2), "host_rss_added_during_save_gib": round(peak_added, 2),
                     "restored_equals_saved": before == after, "status": "ok" if before == after else "error: mismatch"}]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["runs"][0]))


if __name__ == "__main__":
    main()
