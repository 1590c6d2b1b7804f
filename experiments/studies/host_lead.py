"""How far the host runs ahead of the GPU in a training step, measured without synchronizing: for each op,
when the host issued it and when its outputs became ready on the device (a thread polls ``is_ready``).
From those: at every op, how many issued device ops were unfinished (the queue), and how many released
blocks' weights were still in use by queued work (what the memory plan counts as "dropped by the host,
still used by queued GPU work"), per phase (forward, head, backward). Issue 16: the plan's 8K overshoot.

    PYTHONPATH=. python experiments/studies/host_lead.py --configs 3b_8k,3b_32k,7b16_32k_m2 --out $OUT/host_lead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

CONFIGS = {  # preset, layers (None: the preset's), rows, seq_len, micro-batches
    "tiny_cpu": ("tiny", None, 2, 128, 1),
    "3b_8k": ("llama3.2-3b", None, 1, 8192, 1),
    "3b_32k": ("llama3.2-3b", None, 1, 32768, 1),
    "7b16_32k_m2": ("7b", 16, 16, 2048, 2),  # h100_plan_check's 3p5b_32k_streamed
}


class Lead:
    """Observer: each op's issue time, and (from a polling thread) when its device outputs were ready."""

    def __init__(self):
        self.ops: list[dict] = []
        self._pending: list[tuple[int, list]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def on_op(self, op, start, end, out):
        import jax
        arrays = [x for x in jax.tree.leaves(out) if hasattr(x, "is_ready")]
        rec = {"op": repr(op), "kind": op.kind, "issued": end, "ready": end if not arrays else None}
        with self._lock:
            self.ops.append(rec)
            if arrays:
                self._pending.append((len(self.ops) - 1, arrays))

    def on_task(self, *a, **k):
        pass

    def _poll(self):
        while not self._stop:
            with self._lock:
                now, still = time.perf_counter(), []
                for i, arrays in self._pending:
                    if all(_ready(x) for x in arrays):
                        self.ops[i]["ready"] = now
                    else:
                        still.append((i, arrays))
                self._pending = still
            time.sleep(0.0002)

    def close(self, timeout: float = 60.0):
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.01)
        self._stop = True


def _ready(x) -> bool:
    """Whether a device array is computed; one deleted since (donated to a later program, or freed) counts as
    ready when first seen so: an approximation, late by at most the polling interval after its consumer ran."""
    try:
        return x.is_ready()
    except Exception:  # deleted
        return True


def summarize(ops: list[dict]) -> dict:
    """Per phase: the most unfinished device ops at an op's issue, and the most released blocks whose last
    use was unfinished."""
    last_use: dict[str, int] = {}  # part -> index of the last op that used it before its release
    held_at: list[int] = []
    released: list[tuple[str, int]] = []
    for i, o in enumerate(ops):
        part = o["op"].split("(")[1].split(",")[0].rstrip(")") if "(" in o["op"] else ""
        if o["kind"] in ("forward", "backward", "fetch"):
            last_use[part] = i
        if o["kind"] == "release" and part in last_use:
            released.append((part, last_use[part]))
        t = o["issued"]
        held_at.append(sum(1 for _, j in released if (ops[j]["ready"] or 1e18) > t))
    phase, out = "forward", {}
    for i, o in enumerate(ops):
        if o["kind"] == "head":
            phase = "head"
        elif o["kind"] == "backward":
            phase = "backward"
        elif o["kind"] in ("grad_norm", "update", "commit"):
            phase = "update"
        queue = sum(1 for p in ops[:i] if p["ready"] is not None and p["ready"] > o["issued"])
        s = out.setdefault(phase, {"max_unfinished_ops": 0, "max_held_blocks": 0})
        s["max_unfinished_ops"] = max(s["max_unfinished_ops"], queue)
        s["max_held_blocks"] = max(s["max_held_blocks"], held_at[i])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="3b_8k,3b_32k,7b16_32k_m2")
    ap.add_argument("--steps", type=int, default=3, help="steps per config; the first (compiling) is not summarized")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    from flax import nnx

    from child import results_header
    from megatrain_jax import Decoder, Engine, EngineConfig, default_optimizer, preset
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens

    runs = []
    for name in args.configs.split(","):
        pre, layers, rows, seq, micro = CONFIGS[name]
        cfg = preset(pre, max_positions=max(seq, 2048), **({"layers": layers} if layers else {}))
        engine_cfg = EngineConfig(micro_batches=micro)
        engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), default_optimizer(3e-4), engine_cfg)
        toks, starts = demo_tokens(cfg.vocab_size, (args.steps + 1) * rows * seq + seq + 1, seed=0)
        data = iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), seq).batches(rows))
        engine.step(next(data)).resolve()
        engine.sync()
        steps = []
        for _ in range(args.steps - 1):
            lead = Lead()
            engine.observe(lead)
            engine.step(next(data)).resolve()
            engine.sync()
            engine.stop_observing(lead)
            lead.close()
            steps.append(summarize(lead.ops))
        run = {"system": "megatrain_jax", "config": name, "preset": pre, "layers": cfg.layers, "rows": rows,
               "seq_len": seq, "engine": dataclasses.asdict(engine_cfg), "steps_summarized": steps}
        print(json.dumps({k: run[k] for k in ("config", "steps_summarized")}), flush=True)
        runs.append(run)
        del engine
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
