"""What the end of a run allocates in host memory, on CPU with a small model (numpy buffers, seen by tracemalloc):
``Engine.sync`` bringing the GPU-resident parts home after a step, a second ``sync`` (``Engine.parameters``, as
``train``'s export calls it), and the Hugging Face export. Bytes per parameter of the resident parts (sync) and of
the model (export): peak beyond what was held before, and what stays held after.

    PYTHONPATH=. python experiments/studies/end_of_run_host_memory.py

What CPU cannot show: on a GPU client ``np.asarray`` of a pinned-host array keeps its host copy in the array (the
export's old read: +4 B/param of every float32 master, held to the end); on CPU it takes the buffer protocol.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import tracemalloc
from pathlib import Path

import jax
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, default_optimizer, preset
from megatrain_jax.data import DataConfig
from megatrain_jax.hf import save_hf

CFG = preset("tiny", layers=8, vocab_size=8192, hidden=256, ffn=1024, heads=4, kv_heads=2, max_positions=64,
             tie_embeddings=False)


def measured(fn) -> tuple[int, int]:
    """(peak beyond the start, held after) in bytes, for ``fn()``; tracemalloc runs from before the engine is
    built, so that arrays freed here count as freed."""
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    fn()
    after, peak = tracemalloc.get_traced_memory()
    return peak - before, after - before


def main() -> dict:
    tracemalloc.start()
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3),
                    EngineConfig(resident_layers=4, resident_io=True, stream_dtype="float32"))
    data = DataConfig(seq_len=32, batch_size=4, seed=3, demo_tokens=1 << 14).build(CFG.vocab_size)
    for batch in itertools.islice(data, 2):
        engine.step(batch)
    resident = sum(x.size for p in engine.resident_parts for x in jax.tree.leaves(engine.state[p].params))
    total = CFG.param_count()
    out = {"params": total, "resident_params": resident}
    for name, fn, per in (("first sync", engine.sync, resident), ("second sync", engine.sync, resident)):
        peak, held = measured(fn)
        out[name] = {"peak_B_per_param": round(peak / per, 2), "held_B_per_param": round(held / per, 2)}
    io, blocks = engine.parameters()
    with tempfile.TemporaryDirectory() as d:
        peak, held = measured(lambda: save_hf(Path(d) / "hf", CFG, io, blocks))
    out["export"] = {"peak_B_per_param": round(peak / total, 3), "held_B_per_param": round(held / total, 3),
                     "largest_tensor_share": round(CFG.vocab_size * CFG.hidden / total, 3)}
    tracemalloc.stop()
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
