"""How the GPU's copies between pinned host memory and the device queue against each other, against compute, and
against the host's own memory traffic: the facts the step-time model's PCIe and memory lanes assume (issue 51).

    PYTHONPATH=. python experiments/studies/transfer_queues.py --out $OUT/transfer_queues.json

Every copy goes through the engine's own ``Placement`` (``to_device``, ``to_host``), one 13B block's arrays at a
time by default (Llama-2-13B: 317M parameters; its float32 masters and two moments, 3.8 GB, are what a
GPU-updated block brings at the step's start; its bfloat16 copy, 0.64 GB, is a streamed block's fetch). Each case
polls ``is_ready`` of every result on the calling thread (0.2 ms apart) and records when each became ready:
- ``h2d`` / ``d2h``: one block's state each way alone (GB/s), and how long the ``device_put`` call itself held its
  caller;
- ``h2d_behind_d2h``: a bfloat16 fetch issued just after two blocks' state started home: does it wait for them?
  (and ``d2h_behind_h2d``, the other way round);
- ``h2d_in_a_row``: four blocks' state issued back to back from one thread: ready in order, or all at the end?
- ``compute_behind_h2d``: a program on the device that does not read an arriving block, queued after one that
  does: does the first wait for the copy? (``compute_behind_d2h``: the same behind a copy home);
- ``h2d_under_host_load``: one block's state to the device while the host's cores copy memory (numpy, half the
  cores): its GB/s against ``h2d``'s, and the host copy's own GB/s;
- ``torch_duplex`` (where torch with CUDA is importable): the same bytes with torch's pinned tensors and two CUDA
  streams, each way alone and both at once: whether the link itself carries both directions at full rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from child import results_header  # noqa: E402
from megatrain_jax.engine.transfer import Placement  # noqa: E402

# one Llama-2-13B block's matrices (hidden 5120, ffn 13824): q, k, v, o, gate, up, down
BLOCK_SHAPES = [(5120, 5120)] * 4 + [(5120, 13824), (5120, 13824), (13824, 5120)]


def shapes(scale: float) -> list[tuple]:
    return [(max(1, int(a * scale)), b) for a, b in BLOCK_SHAPES]


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def host_block(p: Placement, shp: list, dtype, copies: int) -> list:
    """``copies`` arrays of each shape in pinned host memory (masters and moments: 3), made there directly."""
    out = []
    for s in shp:
        for _ in range(copies):
            out.append(jax.jit(lambda s=s: jnp.ones(s, dtype), out_shardings=p.host)())
    jax.block_until_ready(out)
    return out


def watch(groups: dict[str, list], t0: float, limit: float = 60.0) -> dict[str, float]:
    """Seconds from ``t0`` until every array of each group is ready, polled on this thread."""
    left, seen = dict(groups), {}
    while left and time.perf_counter() - t0 < limit:
        for name in list(left):
            if all(x.is_ready() for x in jax.tree.leaves(left[name])):
                seen[name] = round(time.perf_counter() - t0, 4)
                del left[name]
        time.sleep(0.0002)
    return seen


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, t0, round(time.perf_counter() - t0, 4)


def run(scale: float, load_threads: int) -> dict:
    p = Placement(jax.devices()[:1])
    shp = shapes(scale)
    state = [host_block(p, shp, jnp.float32, 3) for _ in range(4)]  # four blocks' masters and moments
    copy = host_block(p, shp, jnp.bfloat16, 1)  # a streamed block's fetch
    gb = lambda tree: nbytes(tree) / 1e9  # noqa: E731
    out = {"block_params": sum(a * b for a, b in shp), "state_gb": round(gb(state[0]), 3), "copy_gb": round(gb(copy), 3)}

    # warm the programs and the pools once
    jax.block_until_ready(p.to_host(p.to_device(state[0])))
    jax.block_until_ready(p.to_device(copy))

    def rate(key, tree, seconds):
        return {key + "_s": seconds, key + "_gb_per_s": round(gb(tree) / seconds, 2) if seconds else None}

    res = {}
    dev, t0, call = timed(lambda: p.to_device(state[0]))
    r = watch({"h2d": dev}, t0)
    res["h2d"] = {"call_s": call, **rate("ready", state[0], r.get("h2d"))}
    home, t0, call = timed(lambda: p.to_host(dev))
    r = watch({"d2h": home}, t0)
    res["d2h"] = {"call_s": call, **rate("ready", state[0], r.get("d2h"))}

    # a fetch issued just after two blocks' state started home, and the other way round
    devs = [p.to_device(s) for s in state[:2]]
    jax.block_until_ready(devs)
    t0 = time.perf_counter()
    homes = [p.to_host(d) for d in devs]
    fetch = p.to_device(copy)
    res["h2d_behind_d2h"] = {"issued": "2 blocks' state home, then one bfloat16 fetch",
                             **watch({"fetch": fetch, "home_0": homes[0], "home_1": homes[1]}, t0)}
    del homes, fetch
    t0 = time.perf_counter()
    ins = [p.to_device(s) for s in state[2:4]]
    small = p.to_host(devs[0][: len(shp)])  # one block's masters home (a third of its state)
    res["d2h_behind_h2d"] = {"issued": "2 blocks' state to the device, then one block's masters home",
                             **watch({"home": small, "in_0": ins[0], "in_1": ins[1]}, t0)}
    del ins, small, devs

    # four blocks' state back to back from one thread (the bring thread's pattern)
    t0 = time.perf_counter()
    brought = [p.to_device(s) for s in state]
    calls = round(time.perf_counter() - t0, 4)
    res["h2d_in_a_row"] = {"calls_s": calls, **watch({f"block_{i}": b for i, b in enumerate(brought)}, t0)}
    del brought

    # compute behind copies: f reads the arriving block, g does not (a matmul on data already there)
    a = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16), p.device)
    g = jax.jit(lambda x: (x @ x).sum())
    f = jax.jit(lambda t: sum(x[0, 0] for x in t))
    jax.block_until_ready((g(a), f(p.to_device(copy))))
    t0 = time.perf_counter()
    g_alone = g(a)
    res["compute_alone"] = watch({"g": g_alone}, t0)
    t0 = time.perf_counter()
    arriving = p.to_device(state[0])
    fo = f(arriving)
    go = g(a)
    res["compute_behind_h2d"] = {"issued": "one block's state to the device, f(it), then g (independent)",
                                 **watch({"g": go, "f": fo, "h2d": arriving}, t0)}
    jax.block_until_ready(arriving)
    t0 = time.perf_counter()
    leaving = p.to_host(arriving)
    go = g(a)
    res["compute_behind_d2h"] = {"issued": "one block's state home, then g (independent)",
                                 **watch({"g": go, "d2h": leaving}, t0)}
    del arriving, leaving

    # one block's state to the device while half the cores copy memory
    stop = threading.Event()
    moved = []

    def load():
        src = np.ones(64 * 2**20, np.float32)  # 256 MiB each way per copy
        dst = np.empty_like(src)
        n, start = 0, time.perf_counter()
        while not stop.is_set():
            np.copyto(dst, src)
            n += 1
        moved.append(2 * n * src.nbytes / (time.perf_counter() - start))

    threads = [threading.Thread(target=load) for _ in range(load_threads)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    dev, t0, call = timed(lambda: p.to_device(state[1]))
    r = watch({"h2d": dev}, t0)
    home, t0, hcall = timed(lambda: p.to_host(dev))
    rh = watch({"d2h": home}, t0)
    stop.set()
    for t in threads:
        t.join()
    res["h2d_under_host_load"] = {"load_threads": load_threads, "call_s": call, **rate("ready", state[1], r.get("h2d")),
                                  "d2h_call_s": hcall, **rate("d2h_ready", state[1], rh.get("d2h")),
                                  "host_copy_gb_per_s": round(sum(moved) / 1e9, 1)}
    out["cases"] = res
    out["torch_duplex"] = torch_duplex(nbytes(state[0]))
    return out


def torch_duplex(n: int) -> dict | None:
    """``n`` bytes each way between pinned host memory and the GPU with torch, on two streams: alone and at once."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    host_in = torch.ones(n // 4, dtype=torch.float32).pin_memory()
    host_out = torch.empty(n // 4, dtype=torch.float32).pin_memory()
    dev_in = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    dev_out = torch.ones(n // 4, dtype=torch.float32, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def once(h2d: bool, d2h: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if h2d:
            with torch.cuda.stream(up):
                dev_in.copy_(host_in, non_blocking=True)
        if d2h:
            with torch.cuda.stream(down):
                host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    once(True, True)
    cases = {"h2d": (True, False), "d2h": (False, True), "both": (True, True)}
    out = {}
    for name, (a, b) in cases.items():
        t = min(once(a, b) for _ in range(3))
        out[name + "_s"] = round(t, 4)
        out[name + "_gb_per_s"] = round((a + b) * n / 1e9 / t, 2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0, help="the block's rows times this (a small run: 0.01)")
    ap.add_argument("--load-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()
    result = run(args.scale, args.load_threads)
    doc = {**results_header(args.out, __file__), "runs": [{"system": "megatrain_jax", "config": "transfer_queues",
                                                            **result}]}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
