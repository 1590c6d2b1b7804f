"""Why is the host AdamW kernel slower on XLA's pinned-host buffers than on numpy memory?

Runs the same kernel (and torch's fused CPU AdamW) over the same amount of memory obtained in different
ways, and reports for each region the page size the kernel actually saw (AnonHugePages in smaps):

- ``numpy``: np.empty (numpy asks for transparent huge pages on large arrays);
- ``mmap_4k`` / ``mmap_huge``: anonymous mmap with MADV_NOHUGEPAGE / MADV_HUGEPAGE;
- ``torch_default``: torch.empty (what torch's own AdamW runs on in host_adam_bench);
- ``torch_pinned``: torch.empty(pin_memory=True) (cudaHostAlloc);
- ``xla_pinned``: jax arrays in the GPU client's pinned_host memory (what the engine uses);
- ``mmap_huge_registered``: MADV_HUGEPAGE mmap, then cudaHostRegister (pinned and huge pages).

    PYTHONPATH=. python experiments/studies/host_memory_probe.py --params 256 --out $OUT/host_memory_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import subprocess
import sys

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

from megatrain_jax.engine.update.host_kernel import adamw_inplace, adamw_stream_inplace, load  # noqa: E402
from child import median_seconds, system_info  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)


def smaps_for(addr: int, nbytes: int) -> dict:
    """Totals over the mappings that cover [addr, addr + nbytes): their names and huge-page coverage."""
    tot = {"mappings": 0, "names": [], "Rss": 0, "AnonHugePages": 0, "Locked": 0, "KernelPageSize": set()}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and ":" not in parts[0]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inside = lo < addr + nbytes and addr < hi
                if inside:
                    tot["mappings"] += 1
                    name = parts[5] if len(parts) > 5 else "[anon]"
                    if name not in tot["names"]:
                        tot["names"].append(name)
            elif inside and parts and parts[0][:-1] in ("Rss", "AnonHugePages", "Locked"):
                tot[parts[0][:-1]] += int(parts[1])
            elif inside and parts and parts[0] == "KernelPageSize:":
                tot["KernelPageSize"].add(int(parts[1]))
    tot["KernelPageSize"] = sorted(tot["KernelPageSize"])
    return tot


class Region:
    """Four float32 arrays (p, m, v, g) of n elements and a bf16 output, in one kind of memory."""

    def __init__(self, kind: str, n: int):
        self.kind, self.n, self.keep = kind, n, []
        self.arrays = [self._alloc(kind, n * 4) for _ in range(4)]
        out = self._alloc(kind, n * 2)
        self.out = out.view(np.uint16)
        for a, x in zip(self.arrays, (0.5, 0.0, 0.0, 0.01)):
            a[:] = x
        self.out[:] = 0

    def _alloc(self, kind: str, nbytes: int) -> np.ndarray:
        if kind == "numpy":
            return np.empty(nbytes // 4, np.float32)
        if kind.startswith("mmap"):
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.madvise(mmap.MADV_NOHUGEPAGE if kind == "mmap_4k" else mmap.MADV_HUGEPAGE)
            arr = np.frombuffer(mm, np.float32)
            if kind == "mmap_huge_registered":
                import torch
                arr[:] = 0  # fault the pages in (as huge pages) before pinning them
                ptr = arr.ctypes.data
                err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
                assert int(err) == 0, f"cudaHostRegister failed: {err}"
                self.keep.append(("registered", ptr))
            self.keep.append(mm)
            return arr
        if kind.startswith("torch"):
            import torch
            t = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=kind == "torch_pinned")
            self.keep.append(t)
            return t.numpy()
        if kind == "xla_pinned":
            import jax
            from megatrain_jax.engine.transfer import Placement
            x = Placement().copy_to_host(np.zeros(nbytes // 4, np.float32))
            jax.block_until_ready(x)
            self.keep.append(x)
            ptr = x.unsafe_buffer_pointer()
            return np.ctypeslib.as_array((ctypes.c_float * (nbytes // 4)).from_address(ptr))
        raise ValueError(kind)

    def close(self) -> None:
        for k in self.keep:
            if isinstance(k, tuple):
                import torch
                torch.cuda.cudart().cudaHostUnregister(k[1])
        self.arrays = self.out = None
        self.keep.clear()


def bench_region(r: Region, reps: int, libs: dict) -> dict:
    p, m, v, g = (a.ctypes.data for a in r.arrays)
    out = {"smaps": smaps_for(p, r.n * 4)}
    for name, lib in libs.items():
        out[f"kernel_{name}_fp32"] = r.n / median_seconds(lambda: adamw_inplace(lib, p, m, v, g, None, r.n, **HP), reps)
        out[f"kernel_{name}_bf16"] = r.n / median_seconds(
            lambda: adamw_inplace(lib, p, m, v, g, r.out.ctypes.data, r.n, **HP), reps)
        out[f"kernel_{name}_stream_only"] = r.n / median_seconds(
            lambda: adamw_stream_inplace(lib, p, m, v, g, r.out.ctypes.data, r.n, **HP), reps)
    try:
        import torch
        ts = [torch.from_numpy(a) for a in r.arrays]
        param = torch.nn.Parameter(ts[0])
        param.grad = ts[3]
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=True)
        opt.step()  # creates its moments (torch-allocated)
        st = opt.state[param]
        st["exp_avg"], st["exp_avg_sq"] = ts[1], ts[2]  # ... then runs on this region's memory
        out["torch_fused_adamw"] = r.n / median_seconds(opt.step, reps)
    except Exception as e:  # torch missing, or no CUDA for the pinned kinds
        out["torch_fused_adamw"] = f"error: {type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=256, help="millions of fp32 parameters per array")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="numpy,mmap_4k,mmap_huge,torch_default,torch_pinned,xla_pinned,"
                                       "mmap_huge_registered")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.params * 2**20
    # One kernel build (its layout switches, once measured here as variants, are fixed: experiments/studies/NOTES.md).
    libs = {"base": load()}
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        gpu = "unknown (no torch)"
    result = {"name": "host_memory_probe", "command": "PYTHONPATH=. python experiments/studies/host_memory_probe.py "
              + " ".join(sys.argv[1:]), "git_commit": commit,
              "device": {"name": gpu, "host_ram_gib": round(pages / 2**30, 1), "cpu_cores": os.cpu_count()},
              "date": datetime.date.today().isoformat(), "params": n,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
              "system_info": system_info(), "memory": {}, "runs": []}
    print(json.dumps(result["system_info"], indent=1), flush=True)
    for kind in args.kinds.split(","):
        try:
            r = Region(kind, n)
            found = bench_region(r, args.reps, libs)
            r.close()
        except Exception as e:
            found = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        result["memory"][kind] = found.pop("smaps", None)
        for system, value in found.items():
            entry = {"system": system, "memory": kind}
            entry.update({"params_per_s": value, "status": "ok"} if isinstance(value, float)
                         else {"status": str(value)})
            result["runs"].append(entry)
        print(kind, json.dumps(result["memory"][kind]), json.dumps(found), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
