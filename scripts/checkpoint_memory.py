"""Peak host memory added by a checkpoint save, measured with the kernel's high-water mark (Linux).

A model of a few hundred MB of state (fp32 masters + AdamW moments, in pinned host memory) is saved
three ways, each from the same warm baseline (``/proc/self/clear_refs`` resets ``VmHWM``):

- ``megatrain``: ``Checkpointer.save`` (asynchronous, part by part) while training steps run;
  the training steps alone are measured too, so the save's own share is the difference;
- ``orbax_numpy``: one ``StandardCheckpointer`` save of the whole state as numpy (Orbax's default
  ``NumpyHandler`` deep-copies it);
- ``orbax_jax``: the same with the jax arrays (``ArrayHandler``: zero-copy on CPU; on a GPU each
  ``pinned_host`` array becomes a numpy copy first).

    python scripts/checkpoint_memory.py [--hidden 1024 --layers 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(fn) -> tuple[int, float]:
    """(peak RSS above the RSS before ``fn``, seconds) for ``fn()``."""
    jax.effects_barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base, t = _status("VmRSS"), time.perf_counter()
    fn()
    return _status("VmHWM") - base, time.perf_counter() - t


SCENARIOS = ("training_alone", "megatrain_save_while_training", "megatrain_save_only", "orbax_whole_state_numpy",
             "orbax_whole_state_jax")


def run_scenario(name: str, args) -> dict:
    """One measurement, in this (fresh) process, from a warm baseline."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from megatrain_jax import Decoder, Engine, EngineConfig, default_optimizer, preset
    from megatrain_jax.checkpoint import Checkpointer
    from megatrain_jax.data import DataConfig

    h = args.hidden
    cfg = preset("tiny", layers=args.layers, vocab_size=args.vocab, hidden=h, ffn=h * 11 // 4, heads=8, kv_heads=8)
    engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), default_optimizer(1e-4),
                    EngineConfig(), seed=0)
    data = DataConfig(seq_len=16, batch_size=1, prefetch=0, demo_tokens=1 << 14).build(cfg.vocab_size)
    batches = iter(list(itertools.islice(data, 8)))
    state = engine.state
    part_bytes = [sum(x.nbytes for x in jax.tree.leaves((p.params, p.opt))) for p in state.parts]
    root = Path(tempfile.mkdtemp(prefix="ckpt_mem_"))

    def train(n):
        for _ in range(n):
            engine.step(next(batches)).resolve()
        engine.sync()

    train(2)  # compile, and allocate what training allocates
    if name.startswith("megatrain"):
        ckpt = Checkpointer(root, keep=1)
        ckpt.save(engine, wait=True)  # warm the save path (threads, TensorStore pools)
        train(1)
        fn = {"megatrain_save_while_training": lambda: (ckpt.save(engine), train(2), ckpt.wait()),
              "megatrain_save_only": lambda: ckpt.save(engine, wait=True)}[name]
    elif name == "training_alone":
        fn = lambda: train(2)
    else:
        tree = [(p.params, p.opt) for p in state.parts]
        if name == "orbax_whole_state_numpy":
            tree = jax.tree.map(np.asarray, tree)  # zero-copy views on CPU
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(root / "warm", tree)
        checkpointer.wait_until_finished()
        fn = lambda: (checkpointer.save(root / "x", tree), checkpointer.wait_until_finished())
    peak, seconds = measure(fn)
    return {"peak_MiB": round(peak / 2**20, 1), "seconds": round(seconds, 2),
            "state_MiB": round(sum(part_bytes) / 2**20, 1), "largest_part_MiB": round(max(part_bytes) / 2**20, 1),
            "parts": len(part_bytes), "device": str(jax.devices()[0])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--scenario", choices=SCENARIOS, help="run one scenario in this process (internal)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.scenario:
        print("RESULT " + json.dumps(run_scenario(args.scenario, args)), flush=True)
        return 0
    # Each scenario in a fresh process; large blocks mmap'ed so that freed memory leaves RSS at once
    # (otherwise the allocator's cache of an earlier phase hides a later phase's allocations).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    report = {}
    for name in SCENARIOS:
        cmd = [sys.executable, __file__, "--scenario", name, "--hidden", str(args.hidden), "--layers",
               str(args.layers), "--vocab", str(args.vocab)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        report[name] = json.loads(out.split("RESULT ", 1)[1])
    first = report[SCENARIOS[0]]
    summary = {k: first[k] for k in ("device", "state_MiB", "largest_part_MiB", "parts")}
    summary.update({f"{name}_peak_MiB": r["peak_MiB"] for name, r in report.items()})
    summary["megatrain_save_share_MiB"] = round(report["megatrain_save_while_training"]["peak_MiB"]
                                                - report["training_alone"]["peak_MiB"], 1)
    summary["megatrain_save_while_training_s"] = report["megatrain_save_while_training"]["seconds"]
    summary["command"] = "MALLOC_MMAP_THRESHOLD_=65536 (set by the script) python scripts/checkpoint_memory.py " + \
        " ".join(sys.argv[1:] if argv is None else argv)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
