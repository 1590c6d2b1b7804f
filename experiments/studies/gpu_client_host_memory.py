"""What JAX's GPU client holds in host memory by itself, against the GPU memory XLA takes and the pinned bytes a
run asks for: each case a fresh process that starts the GPU backend (``XLA_PYTHON_CLIENT_MEM_FRACTION``, or no
preallocation), runs one small program, then places ``--pinned-gib`` of arrays in pinned host memory under a pool
cap (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, as ``train`` sets it); after each stage the process's anonymous and
shared resident memory and the /dev/zero mappings (XLA's pinned regions) are recorded.

    PYTHONPATH=. python experiments/studies/gpu_client_host_memory.py --out $OUT/h200_gpu_client_host_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from child import results_header  # noqa: E402

CASES = [("fraction 0.95", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}),
         ("fraction 0.50", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.50"}),
         ("fraction 0.25", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}),
         ("no preallocation", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})]

CHILD = r"""
import json, os, sys
def state():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssShmem", "RssFile"):
            out[k] = round(int(v.split()[0]) / 2**20, 3)
    zero, regions = 0, []
    cur = None
    for line in open("/proc/self/smaps"):
        p = line.split()
        if "-" in p[0] and not p[0].endswith(":"):
            cur = p[5] if len(p) > 5 else ""
            if cur == "/dev/zero":
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                regions.append(round((hi - lo) / 2**20, 1))
    out["dev_zero_regions_mib"] = regions
    out["dev_zero_gib"] = round(sum(regions) / 1024, 3)
    return out
stages = {"python": state()}
import jax, jax.numpy as jnp
import numpy as np
x = jnp.ones((1024, 1024)) @ jnp.ones((1024, 1024)); x.block_until_ready()
stages["backend started"] = {**state(), "bytes_limit_gib": round((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) / 2**30, 2)}
pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
gib = float(sys.argv[1])
held = [jax.device_put(np.ones(2**28, np.float32), pinned) for _ in range(int(gib))]  # 1 GiB each
jax.block_until_ready(held)
stages[f"{int(gib)} GiB pinned"] = state()
print(json.dumps(stages))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pinned-gib", type=int, default=20)
    ap.add_argument("--pool-gib", type=int, default=26)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = []
    for name, env in CASES:
        full = {**os.environ, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": str(args.pool_gib), **env}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.pinned_gib)], env=full, capture_output=True,
                              text=True, timeout=300)
        row = {"case": name, "env": env, "pool_limit_gib": args.pool_gib, "exit_status": proc.returncode}
        try:
            row["stages"] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row["error_tail"] = proc.stderr.strip().splitlines()[-5:]
        runs.append(row)
        print(json.dumps(row)[:600], flush=True)
    header = results_header(args.out, __file__)
    header["device"]["cpu_cores"] = os.cpu_count()
    Path(args.out).write_text(json.dumps({**header, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
