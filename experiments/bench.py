"""Benchmark the streamed engine on named configurations and write a results JSON (docs/results.md).

    PYTHONPATH=. python experiments/bench.py --configs 3p5b_32k --out $OUT/bench.json

Each configuration trains a randomly initialized model (built part by part from an abstract model, never
whole on the GPU) on the demo Markov corpus at the model's vocabulary, times steps after warm-up, then runs
one profiled step (synchronizing after every op) for the breakdown of where step time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# This process is the GPU's only user: XLA takes the share of its memory that megatrain_jax gives it when imported
# (_environment.ENGINE_GPU_FRACTION, 0.95), as `megatrain-jax train` runs, unless the environment says otherwise.
# Until 2026-11-30 bench.py set 0.9 here: its rows ran with ~6.4 GiB less of an H200 than a user's run has.
import megatrain_jax  # noqa: E402,F401  (first: the GPU memory fraction and the pinned pool, as the product sets them)
import jax  # noqa: E402
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax import Batch, Decoder, Engine, EngineConfig, default_optimizer, preset  # noqa: E402
from megatrain_jax.batch import RowMix  # noqa: E402
from megatrain_jax.data import TokenDataset, TokenFile  # noqa: E402
from megatrain_jax.data.demo import demo_tokens  # noqa: E402
from megatrain_jax.engine.observers import Profile  # noqa: E402
from megatrain_jax.flops import model_flops_per_token  # noqa: E402
from megatrain_jax.plan import fit_host_pool  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    preset: str
    layers: int | None
    seq_len: int
    rows: int  # sequences per step: tokens per step = rows * seq_len
    engine: EngineConfig
    packed_docs: int = 0  # > 0: each row is that many packed documents (segment ids, positions restarting)
    vocab: int | None = None  # the preset's vocabulary unless set

    def model(self):
        """The model's config: the preset, with ``layers`` and ``vocab`` where set."""
        return preset(self.preset, **({"layers": self.layers} if self.layers else {}),
                      **({"vocab_size": self.vocab} if self.vocab else {}))

    def row_mix(self, batches: int = 4) -> RowMix | None:
        """Packed rows (``packed_docs``): the keys a token's attention sees, as ``TokenDataset.row_mix`` counts
        them, over the first ``batches`` batches ``pack_rows`` cuts (its seeds 0, 1, ...), every token in the loss;
        None: whole rows."""
        if not self.packed_docs:
            return None
        zeros = np.zeros((self.rows, self.seq_len), np.int32)
        pairs = 0.0
        for seed in range(batches):
            seg = pack_rows(Batch(zeros, zeros, zeros.astype(np.float32)), self.packed_docs, seed).segment_ids
            pairs += sum(float(np.bincount(row) @ np.bincount(row)) for row in seg)
        return RowMix(pairs / (batches * self.rows * self.seq_len))


def pack_rows(batch: Batch, docs: int, seed: int) -> Batch:
    """``batch`` with each row cut into ``docs`` documents of random lengths (seeded): segment ids 1..docs
    and positions restarting at 0 in each, as the packed data mode makes them."""
    B, T = batch.shape
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for r in range(B):
        bounds = np.concatenate([[0], np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False)), [T]])
        for d in range(docs):
            seg[r, bounds[d]:bounds[d + 1]] = d + 1
            pos[r, bounds[d]:bounds[d + 1]] = np.arange(bounds[d + 1] - bounds[d])
    return dataclasses.replace(batch, positions=pos, segment_ids=seg)


CONFIGS: dict[str, BenchConfig] = {
    "tiny_cpu": BenchConfig("tiny", None, 128, 8, EngineConfig(micro_batches=2)),
    # A quick GPU smoke test (4 blocks of 7B's width, ~1.2B parameters): scaling.py's first check on a machine.
    "7b_w4_8k": BenchConfig("7b", 4, 2048, 4, EngineConfig(micro_batches=2, resident_layers=1, resident_io=True)),
    # Everything streamed (nothing resident): the issue-3 configuration, GPU memory well under 25 GiB.
    "3p5b_32k_streamed": BenchConfig("7b", 16, 2048, 16, EngineConfig(micro_batches=2)),
    # The 3.5B and 7B layouts of the side-by-side comparison (issue 33, experiments/studies/NOTES.md). 3.5B at 32K
    # runs one micro-batch and keeps the attention residuals (no attention forward in the backward: 21,482 ->
    # 22,057 tokens/s with all 16 blocks resident); since 2026-11-26 (commit ede48b8), 8 blocks resident and the
    # last 12 keeping their matrix products (kept_layers: no recompute of them in the backward): 22,212 -> 25,659
    # tokens/s (results/h100_kept_layers_32k.json). 7B fetches the streamed blocks two ahead (with one, each streamed
    # forward waited ~9 ms for its weights while the host's second-half updates shared the memory bus with the
    # copies: 456 -> 472 model TFLOP/s); since 2026-11-26 (commit 5585a65) it runs one micro-batch, 8 resident
    # blocks and the last 10 keeping their matrix products: 472.0 -> 500.1 and 495.5 model TFLOP/s against "auto" (17 resident) on one
    # box (results/h100_kept_layers_7b_a.json, _b.json).
    # the layout the plan picks for speed (issue 51: no hand layout); until 2026-11-29 a hand layout from the H100
    # (8 resident, the last 12 keeping their products), 0.94x plain GPU on the H200 (h200_fits_3p5b_32k_torch_a3e3c5f)
    "3p5b_32k": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers="auto", resident_io=True, keep_residuals=True, kept_layers="auto",
        prefetch_depth=2)),
    "3p5b_32k_all_resident": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers="auto", resident_io=True, keep_residuals=True)),
    "7b_32k": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=8, resident_io=True, kept_layers=10, prefetch_depth=2)),
    "7b_32k_auto_p2": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers="auto", resident_io=True, prefetch_depth=2)),
    # 8,192 tokens per step (issue 33): one micro-batch of 4 rows; the GPU holds every block resident.
    # Since 2026-11-26 (commit 2753e0a) every block also keeps its matrix products for the backward
    # (kept_layers=16; the plan fits them beside the resident state at 8K): 19,976 -> 24,017 tokens/s
    # (results/h100_kept_layers_8k.json).
    "3p5b_8k": BenchConfig("7b", 16, 2048, 4, EngineConfig(micro_batches=1, resident_layers="auto", resident_io=True,
                                                           kept_layers=16)),
    # Where the model does not fit on the GPU (issue 51): Llama-2-13B's shape on one H200 (251 GiB host), the
    # layout the plan picks for speed (resident blocks and blocks keeping their products, both "auto"). The streamed
    # blocks' gradients come home in bfloat16, as SlideFormer's do and as in the 3.5B streamed rows below (since
    # 2026-11-29; the plan's prediction on one H200 of a 32-core host: +1% at 32K, +2% at 8K); since 2026-11-30 those
    # updated on the GPU wait there in bfloat16 too (device_grad_dtype: every gradient rounded once, as
    # SlideFormer's; at 8K the GPU memory it frees holds 2-3 more resident blocks, predicted -7%).
    "13b_32k": BenchConfig("llama2-13b", None, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers="auto", kept_layers="auto", resident_io=True, keep_residuals=True,
        prefetch_depth=2, host_grad_dtype="bfloat16", device_grad_dtype="bfloat16", gpu_updated_layers="auto")),
    "13b_8k": BenchConfig("llama2-13b", None, 2048, 4, EngineConfig(
        micro_batches=1, resident_layers="auto", kept_layers="auto", resident_io=True, keep_residuals=True,
        prefetch_depth=2, host_grad_dtype="bfloat16", device_grad_dtype="bfloat16", gpu_updated_layers="auto")),
    # 3.5B with nothing resident (issue 51's streamed rows, against SlideFormer, which keeps no parameter on the GPU
    # between steps): every block and the embedding/head streamed each step, the kept blocks picked for speed.
    # Gradients come home in bfloat16, as SlideFormer's do: at one micro-batch on one device a block's is a
    # bfloat16 cotangent (bitwise the float32 run on the CPU: tests/test_engine.py); on the H200 XLA's excess
    # precision leaves 8% of the blocks' float32 gradient elements wider, which are rounded
    # (results/h200_bf16_gradients_exact_252be46.json).
    "3p5b_8k_nothing_resident": BenchConfig("7b", 16, 2048, 4, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True,
        host_grad_dtype="bfloat16", gpu_updated_layers="auto", gpu_updated_io="auto")),
    "3p5b_32k_nothing_resident": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True,
        host_grad_dtype="bfloat16", gpu_updated_layers="auto", gpu_updated_io="auto")),
    # Since 2026-11-29 (issue 51) the rows above let the plan update some streamed blocks on the GPU
    # (gpu_updated_layers "auto": their state crosses PCIe, no host update); the rows as they ran before:
    "3p5b_8k_nothing_resident_host_updated": BenchConfig("7b", 16, 2048, 4, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True,
        host_grad_dtype="bfloat16")),
    "3p5b_32k_nothing_resident_host_updated": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True,
        host_grad_dtype="bfloat16")),
    "13b_8k_host_updated": BenchConfig("llama2-13b", None, 2048, 4, EngineConfig(
        micro_batches=1, resident_layers="auto", kept_layers="auto", resident_io=True, keep_residuals=True,
        prefetch_depth=2, host_grad_dtype="bfloat16")),
    # A/B of the gradients' dtype home: the two rows above with float32 gradients (full precision's default).
    "3p5b_8k_nothing_resident_f32_grads": BenchConfig("7b", 16, 2048, 4, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True)),
    "3p5b_32k_nothing_resident_f32_grads": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=0, resident_io=False, kept_layers="auto", keep_residuals=True)),
    "3p5b_8k_recompute": BenchConfig("7b", 16, 2048, 4, EngineConfig(micro_batches=1, resident_layers="auto",
                                                                     resident_io=True)),
    # A/B variants (NOTES, issue 33): the earlier fixed layouts (8 of 16 and 14 of 32 blocks resident; 8 at 8K,
    # where the host update bounded the step), and the 32K levers one at a time.
    "3p5b_32k_r8": BenchConfig("7b", 16, 2048, 16, EngineConfig(micro_batches=2, resident_layers=8, resident_io=True)),
    "3p5b_8k_r8": BenchConfig("7b", 16, 2048, 4, EngineConfig(micro_batches=1, resident_layers=8, resident_io=True)),
    "7b_32k_r14": BenchConfig("7b", 32, 2048, 16, EngineConfig(micro_batches=2, resident_layers=14, resident_io=True)),
    # Blocks that keep their matrix products for the backward (kept_layers, commit 4b47605): fewer resident blocks
    # buy room for more of them; the largest kept_layers the plan fits at each resident count (H100, 90%).
    "3p5b_32k_r16_k2": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=16, resident_io=True, keep_residuals=True, kept_layers=2)),
    "3p5b_32k_r12_k7": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=12, resident_io=True, keep_residuals=True, kept_layers=7, prefetch_depth=2)),
    "3p5b_32k_r4_k16": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=4, resident_io=True, keep_residuals=True, kept_layers=16, prefetch_depth=2)),
    # 7B at 32K with blocks keeping their matrix products (commit 49ac821): the largest kept_layers the plan fits at
    # each resident count (H100, 90%; below 8 resident the host state no longer fits a 125 GiB host).
    "7b_32k_r8_k11": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers=8, resident_io=True, kept_layers=11, prefetch_depth=2)),
    "7b_32k_mb1_r10_k8": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=10, resident_io=True, kept_layers=8, prefetch_depth=2)),
    "7b_32k_mb1_r12_k6": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers=12, resident_io=True, kept_layers=6, prefetch_depth=2)),
    "7b_32k_r10_k9": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers=10, resident_io=True, kept_layers=9, prefetch_depth=2)),
    "7b_32k_r12_k7": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers=12, resident_io=True, kept_layers=7, prefetch_depth=2)),
    "3p5b_32k_auto": BenchConfig("7b", 16, 2048, 16, EngineConfig(micro_batches=2, resident_layers="auto",
                                                                   resident_io=True)),
    "3p5b_32k_auto_kr": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers="auto", resident_io=True, keep_residuals=True)),
    "3p5b_32k_auto_mb1": BenchConfig("7b", 16, 2048, 16, EngineConfig(
        micro_batches=1, resident_layers="auto", resident_io=True)),
    "7b_32k_auto": BenchConfig("7b", 32, 2048, 16, EngineConfig(micro_batches=2, resident_layers="auto",
                                                                 resident_io=True)),
    "7b_32k_auto_kr": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers="auto", resident_io=True, keep_residuals=True)),
    "7b_32k_auto_p4": BenchConfig("7b", 32, 2048, 16, EngineConfig(
        micro_batches=2, resident_layers="auto", resident_io=True, prefetch_depth=4)),
    "3p5b_98k": BenchConfig("7b", 16, 2048, 48, EngineConfig(micro_batches=6, resident_layers=8, resident_io=True)),
    # Issue 18: a few layers of the MoE presets at 32 x 2,048 tokens (every expert gets tokens), model FLOPs over
    # active parameters. Mixtral's 1.41 B-parameter blocks all stream (a resident one would take ~23 GB).
    "mixtral_l4_64k": BenchConfig("mixtral-8x7b", 4, 2048, 32, EngineConfig(micro_batches=4, resident_io=True)),
    "qwen3moe_l8_64k": BenchConfig("qwen3-30b-a3b", 8, 2048, 32, EngineConfig(micro_batches=4, resident_io=True)),
    # Issue 16: packed documents against plain causal rows, 3B at 32K tokens in one row.
    "3b_32k": BenchConfig("llama3.2-3b", None, 32768, 1, EngineConfig(resident_layers=8, resident_io=True)),
    "3b_32k_packed8": BenchConfig("llama3.2-3b", None, 32768, 1, EngineConfig(resident_layers=8, resident_io=True),
                                  packed_docs=8),
    # Issue 35's 1B comparison (studies/convergence.py --preset llama3.2-1b on a 32K-vocabulary corpus, 4 x 2,048
    # tokens a step): its host layouts with every part streamed, to see where the 8-bit mode's step goes.
    "1b_8k_q8": BenchConfig("llama3.2-1b", None, 2048, 4, EngineConfig(
        micro_batches=1, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16"), vocab=32000),
    "1b_8k_capacity": BenchConfig("llama3.2-1b", None, 2048, 4, EngineConfig(micro_batches=1, master_dtype="bfloat16"),
                                  vocab=32000),
    "1b_8k_f32": BenchConfig("llama3.2-1b", None, 2048, 4, EngineConfig(micro_batches=1), vocab=32000),
    # The shipped rtx4090_sft_8b's layout as `train` planned it under a 24 GB card's cap
    # (XLA_PYTHON_CLIENT_MEM_FRACTION=0.163 on an H200): capacity mode, nothing resident, 17 blocks' inputs sent
    # home, 8 x 2,048 tokens of packed documents, 32 a row (the most a row may hold: the model's max_segments).
    "8b_sft_capacity_capped": BenchConfig("llama3.1-8b", None, 2048, 8, EngineConfig(
        micro_batches=2, prefetch_depth=1, master_dtype="bfloat16", stream_dtype="bfloat16", resident_layers=0,
        resident_io=False, offload_activations=17), packed_docs=32),
}
# 3p5b_98k with the Adam moments of its last N host-updated blocks (of 8) in the disk tier (issue 15), in
# $MEGATRAIN_DISK_DIR (default /tmp/megatrain_disk_tier): N x 1.62 GB read and written per step.
for _n, _suffix in ((8, ""), (4, "4"), (2, "2")):
    CONFIGS[f"3p5b_98k_disk{_suffix}"] = BenchConfig("7b", 16, 2048, 48, EngineConfig(
        micro_batches=6, resident_layers=8, resident_io=True, disk_parts=_n,
        disk_dir=os.environ.get("MEGATRAIN_DISK_DIR", "/tmp/megatrain_disk_tier")))


def _variant(name: str, **engine) -> BenchConfig:
    """The config ``name`` with the engine fields ``engine`` changed (an A/B's other arm)."""
    return dataclasses.replace(CONFIGS[name], engine=dataclasses.replace(CONFIGS[name].engine, **engine))


# The 3.5B rows with nothing resident, one engine field changed each (NOTES, 2026-11-30): two blocks fetched ahead
# (a copy to the GPU lands only after the compute queued before it was issued: XLA's allocator on the GPU is
# synchronized with the compute stream, so one block ahead each block's copy waits for the forward before it);
# and the 8K row with more blocks updated on the GPU than the plan picks (5 with the link at 60 GB/s both ways, 7
# with the 81.7 measured by measure_speeds.py, h200x2_measure_speeds_e637172.json).
for _k in (8, 32):
    CONFIGS[f"3p5b_{_k}k_nothing_resident_depth2"] = _variant(f"3p5b_{_k}k_nothing_resident", prefetch_depth=2)
for _g in (6, 7):
    CONFIGS[f"3p5b_8k_nothing_resident_gpu_updated_{_g}"] = _variant("3p5b_8k_nothing_resident",
                                                                      gpu_updated_layers=_g)
# The 32K row with its first blocks updated on the GPU (the plan picks none): at the step's start the forward waits
# for the host's first passes of io and block 0 (~90 ms in h200x2_side_by_side_streamed_9f24487.json's timeline),
# then runs at the first passes' pace (~25 ms a block against ~20 of compute); a block updated on the GPU needs no
# first pass.
for _g in (1, 2, 3):
    CONFIGS[f"3p5b_32k_nothing_resident_gpu_updated_{_g}"] = _variant("3p5b_32k_nothing_resident",
                                                                       gpu_updated_layers=_g)
# The rows with the io part updated on the host, as the plan picked them before it could update it on the GPU
# (gpu_updated_io, 2026-11-30): the A/B's other arm.
for _k in (8, 32):
    CONFIGS[f"3p5b_{_k}k_nothing_resident_io_on_host"] = _variant(f"3p5b_{_k}k_nothing_resident", gpu_updated_io=False)
# The 13B rows with the gradients of the parts updated on the GPU in float32 there, as before 2026-11-30 (the A/B's
# other arm of device_grad_dtype).
for _k in (8, 32):
    CONFIGS[f"13b_{_k}k_float32_device_grads"] = _variant(f"13b_{_k}k", device_grad_dtype="float32")
# The 8K row as the layout search picked it with its own split count at e9ffee6 (3 blocks updated on the GPU, 1
# update split; 0.894 s against 0.764 predicted, h200x2_side_by_side_streamed_8k_e9ffee6.json), to be run with
# --timeline-steps beside the plan's row: where the step-time model misprices the split count.
CONFIGS["3p5b_8k_nothing_resident_gpu_updated_3_split_1"] = _variant("3p5b_8k_nothing_resident",
                                                                     gpu_updated_layers=3, split_parts=1)


def device_info() -> dict:
    dev = jax.devices()[0]
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"name": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "host_ram_gib": round(pages / 2**30, 1), "cpu_cores": os.cpu_count()}
# The names results/h100_kept_layers_32k.json and _8k.json give the layouts 3p5b_32k and 3p5b_8k took from them.
CONFIGS["3p5b_32k_r8_k12"] = CONFIGS["3p5b_32k"]
CONFIGS["3p5b_8k_k16"] = CONFIGS["3p5b_8k"]
CONFIGS["7b_32k_mb1_r8_k10"] = CONFIGS["7b_32k"]  # results/h100_kept_layers_7b_a.json's name for 7b_32k's layout


def gpu_peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None


def host_peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def record_timeline(engine: Engine, data, steps: int) -> dict:
    """Events of the last of ``steps`` steps run with a Timeline (see megatrain_jax/engine/timeline.py), times in
    seconds from that step's start, plus the whole step's span until its last device op was ready."""
    from megatrain_jax.engine.timeline import Timeline
    timeline = Timeline()
    engine.observe(timeline)
    outs = []
    for k in range(steps):
        timeline.mark(f"step {k}")
        outs.append(engine.step(next(data)))
    engine.sync()
    for o in outs:
        o.resolve()
    engine.stop_observing(timeline)
    events = timeline.close()
    start = max(e["at"] for e in events if e["ev"] == "mark")
    last = [dict(e) for e in events if e.get("start", e.get("at", 0.0)) >= start and e["ev"] != "mark"]
    for e in last:
        for key in ("start", "end", "at"):
            if key in e:
                e[key] = round(e[key] - start, 4)
    span = max(e.get("end", e.get("at", 0.0)) for e in last)
    return {"step_span_s": round(span, 4), "events": last,
            "note": "host: main-thread time in each op; ready: device output ready (watcher threads); "
                    "task: host-optimizer task on the update thread"}


def breakdown(engine: Engine, data, step_time: float) -> dict:
    profile = Profile()
    engine.observe(profile)
    t = time.perf_counter()
    engine.step(next(data)).resolve()
    engine.sync()
    serial = time.perf_counter() - t
    engine.stop_observing(profile)
    prof = {k: round(v, 4) for k, v in profile.seconds.items()}
    compute = prof.get("compute", 0.0)
    # the GPU-resident parts' updates run on the GPU (AdamW over their masters and moments in its memory)
    lanes = profile.lanes(engine.resident_parts)
    device_update, host_s = lanes["device_update"], lanes["host_update"]
    moved = host_update_bytes(engine)
    return {"serialized_step_s": round(serial, 4), **{f"{k}_s": v for k, v in prof.items()},
            "device_update_s": round(device_update, 4),
            "host_update": {"seconds": round(host_s, 4), "bytes": moved,
                            "gb_per_s": round(moved / host_s / 1e9, 2) if host_s > 0 else None,
                            "note": "bytes the host update reads and writes in one step (host_update_bytes), over "
                                    "the host-updated parts' update and commit time in the serialized step"},
            "gpu_busy_fraction_est": round(min(compute / step_time, 1.0), 3),
            "gpu_idle_fraction_est": round(max(1 - compute / step_time, 0.0), 3),
            "gpu_idle_beyond_device_update_est": round(max(1 - (compute + device_update) / step_time, 0.0), 3),
            "note": "per-category times from a step synchronized after every op; idle = "
                    "1 - compute / overlapped median step time (the GPU-resident parts' update, device work, "
                    "counts as idle there; gpu_idle_beyond_device_update_est counts it as busy)"}


def host_update_bytes(engine: Engine) -> int:
    """Bytes of host memory the host-updated parts' AdamW reads and writes in one optimizer step: in one pass
    masters, moments and gradient read, masters, moments and the 16-bit stream copy written; a split update
    (``EngineConfig.split_parts``) reads masters, moments and gradient once more (its first pass writes only
    the copy, its second the rest)."""
    from megatrain_jax.engine.parts import HostRoles
    e = engine.cfg
    per = engine.policy.opt.precision.bytes_per_param(e.host_grad_dtype)  # the mode the engine runs
    read = per["masters"] + per["moments"] + per["host_grads"]
    whole = read + per["masters"] + per["moments"] + per["stream_copy"]
    roles = HostRoles.of_config(engine.lm.n_blocks, e)
    split = engine.policy.split if engine.policy.opt.splits else set()  # the engine's own choice
    total = 0.0
    for part in roles.host_updated:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.state[part].params))
        total += n * (whole + (read if part in split else 0))
    return int(total)


def pcie_bytes_per_gpu(engine) -> dict:
    """Bytes one GPU (the mesh's first) moves over PCIe in one optimizer step, every pass of it
    (``schedule.step_passes``: a ``norm_first`` step fetches the weights for its second backward too, and sends
    its gradients home only from that one): the weights fetched and the gradients sent home, in
    ``host_grad_dtype`` (float32 for those that wait on the GPU; not offloaded activations, which no
    configuration here uses, nor an accumulating pass's earlier sum brought back); blocks updated on the GPU
    (``gpu_updated_layers``) bring their masters and moments over and send them home with their compute copy
    instead of a gradient."""
    from megatrain_jax.engine.parts import HostRoles
    from megatrain_jax.engine.precision import DTYPE_BYTES
    from megatrain_jax.engine.schedule import step_passes

    e = engine.cfg
    roles = HostRoles.of_config(engine.lm.n_blocks, e)
    ops = [op for ops in step_passes(engine.lm.n_blocks, e, roles) for op in ops]
    resident = set(engine.resident_parts)
    placement = engine.placement

    def shard_bytes(tree, itemsize=None) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            shape = list(x.shape)
            if placement.spec(x) != jax.sharding.PartitionSpec():
                shape[0] //= placement.size
            total += int(np.prod(shape)) * (itemsize or np.dtype(x.dtype).itemsize)
        return total

    waiting = set(roles.grads_on_gpu)  # float32, copied home by their update
    state = lambda part: shard_bytes((engine.state[part].params, engine.state[part].opt))  # noqa: E731
    h2d = sum(shard_bytes(engine.state[op.part].streamed()) for op in ops
              if op.kind == "fetch" and op.part not in resident)
    h2d += sum(state(op.part) for op in ops if op.kind == "bring")
    d2h = sum(shard_bytes(engine.state[op.part].params, 4 if op.part in waiting else DTYPE_BYTES[e.host_grad_dtype])
              for op in ops if op.kind == "send_grads" and op.part not in resident
              and op.part not in engine.gpu_updated_parts)
    d2h += sum(state(op.part) + shard_bytes(engine.state[op.part].stream or ()) for op in ops if op.kind == "visit")
    return {"h2d_bytes": h2d, "d2h_bytes": d2h, "total_bytes": h2d + d2h}


def predicted_step(bc: BenchConfig, cfg, gpus: int):
    """The step-time model's prediction for this layout on this machine's GPU kind (None: no rates for it)."""
    from megatrain_jax.plan import Machine, for_machine
    machine = dataclasses.replace(Machine.here(), gpus=gpus)
    return for_machine(cfg, bc.engine, bc.rows, bc.seq_len, machine, mix=bc.row_mix())


def resolve_layout(bc: BenchConfig) -> tuple[BenchConfig, str | None]:
    """The engine config ``megatrain-jax train`` would run on this machine (``plan.resolve``, read before JAX
    starts: MemAvailable, the GPU's allocator limit from nvidia-smi and the memory fraction, the visible GPUs):
    ``resident_layers="auto"`` made a number, and where memory is short what train would change; with the
    sentence saying what was changed (None: as named)."""
    from megatrain_jax.plan import Machine, resolve
    resolved = resolve(bc.model(), bc.engine, bc.rows, bc.seq_len, Machine.here(), packed=bc.packed_docs > 0,
                       mix=bc.row_mix())
    return dataclasses.replace(bc, engine=resolved.engine_cfg), resolved.said


def run_config(name: str, bc: BenchConfig, warmup: int, timed: int, lr_warmup: int = 0,
               timeline_steps: int = 0, profile: bool = True, trace_dir: str | None = None) -> dict:
    """One configuration's record. ``profile=False`` skips the synchronized breakdown step; ``trace_dir`` adds one
    step under ``jax.profiler.trace`` (not timed) and its per-GPU summary (``trace_summary.py``)."""
    cfg = bc.model()
    tokens_per_step = bc.rows * bc.seq_len
    bc, picked = resolve_layout(bc)
    run = {"system": "megatrain_jax", "config": name,
           "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                     "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count(),
                     **({"active_params": cfg.active_param_count()} if cfg.moe is not None else {})},
           "seq_len": bc.seq_len, "tokens_per_step": tokens_per_step, "steps_timed": timed,
           "engine": dataclasses.asdict(bc.engine), "optimizer": f"adamw(lr 3e-4{f' after {lr_warmup} warm-up steps' if lr_warmup else ''}, wd 0.1, b2 0.95), clip 1.0",
           "compute_dtype": cfg.dtype, "master_dtype": bc.engine.master_dtype,
           **({"resolved": picked} if picked else {})}
    try:
        t0 = time.perf_counter()
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        lr = optax.linear_schedule(3e-5, 3e-4, lr_warmup) if lr_warmup else 3e-4
        engine = Engine(abstract, default_optimizer(lr), bc.engine, seed=0)
        jax.block_until_ready(engine.state)
        run["init_s"] = round(time.perf_counter() - t0, 2)
        run["num_gpus"] = engine.placement.size
        run["pcie_per_gpu_per_step"] = pcie_bytes_per_gpu(engine)
        predicted = predicted_step(bc, cfg, engine.placement.size)
        run["predicted_step"] = None if predicted is None else predicted.as_dict()
        run["host_optimizer"] = {"fused": "fused C++ AdamW kernel", "host": "JAX host computation",
                                 "device": "JAX on the GPU (state sent there and back)"}.get(engine.update_route,
                                                                                             engine.update_route)
        n_steps = warmup + timed + int(profile) + timeline_steps + int(trace_dir is not None)
        toks, starts = demo_tokens(cfg.vocab_size, n_steps * tokens_per_step * 2 + bc.seq_len + 1, seed=0)
        data = iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), bc.seq_len).batches(bc.rows))
        if bc.packed_docs:
            data = (pack_rows(b, bc.packed_docs, seed=i) for i, b in enumerate(data))
            run["packed_docs_per_row"] = bc.packed_docs
        records = []
        for m in engine.steps(next(data) for _ in range(warmup + timed)):
            records.append(m)
            print(f"[{name}] step {m['step']} loss {m['loss']:.4f} gnorm {m['grad_norm']:.3f} "
                  f"{m['step_time_s']:.3f}s dispatch {m['dispatch_s']:.3f}s", flush=True)
        # The peaks of the training steps as users run them, read before the instrumented steps below: the
        # Timeline's watcher threads and the profiler hold buffers longer (tests/test_memory_plan.py,
        # _training_peak).
        run.update(gpu_peak_gib=gpu_peak_gib(), host_peak_gib=host_peak_gib())
        timed_recs = records[warmup:]
        step_time = statistics.median(r["step_time_s"] for r in timed_recs)
        fpt = model_flops_per_token(cfg.active_param_count(), cfg.layers, cfg.hidden, bc.seq_len)
        run.update(step_time_s=round(step_time, 4), tokens_per_s=round(tokens_per_step / step_time, 1),
                   model_tflops=round(tokens_per_step / step_time * fpt / 1e12, 1),
                   loss_first=timed_recs[0]["loss"], loss_last=timed_recs[-1]["loss"],
                   losses=[round(r["loss"], 4) for r in records], grad_norms=[round(r["grad_norm"], 4) for r in records],
                   step_times=[round(r["step_time_s"], 4) for r in records],
                   # a skipped step (non-finite loss or norm) runs no update: a faster step that trains nothing,
                   # so a comparison counts a run only without them (side_by_side.targets)
                   skipped_steps=sum(1 for r in timed_recs if r.get("skipped")),
                   dispatch_s=round(statistics.median(r["dispatch_s"] for r in timed_recs), 4))
        if predicted is not None:  # the step-time model (plan.step_time) against the median measured step
            run["step_time_error"] = round((predicted.seconds - step_time) / step_time, 4)
        tier = engine.disk_tier
        if tier is not None:  # what the disk did: per step over the whole run, and while it was busy
            n = len(records)
            from megatrain_jax.engine.update.disk_tier import IO_CONTEXT
            run["disk_tier"] = {"dir": tier.root.as_posix(), "parts": [p.name for p in tier.parts],
                                "tensorstore_context": IO_CONTEXT,
                                "read_bytes_per_step": tier.bytes_read // n,
                                "written_bytes_per_step": tier.bytes_written // n,
                                "read_gb_s_while_reading": round(tier.bytes_read / max(tier.read_s, 1e-9) / 1e9, 4),
                                "write_gb_s_while_writing": round(tier.bytes_written / max(tier.write_s, 1e-9) / 1e9, 4),
                                "read_gb_s_needed": round(tier.bytes_read / n / 1e9 / step_time, 4),
                                "note": "bytes over all steps run (warm-up included) divided by the steps; "
                                        "'while' rates are bytes over the I/O thread's busy seconds"}
        if trace_dir is not None:
            from trace_summary import summarize
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                engine.step(next(data)).resolve()
            run["trace"] = summarize(trace_dir)
        if profile:  # one step with a sync after every op, so each category's time is its own
            run["breakdown"] = breakdown(engine, data, step_time)
        if timeline_steps:
            run["timeline"] = record_timeline(engine, data, timeline_steps)
        if trace_dir is not None or profile or timeline_steps:
            run.update(gpu_peak_gib_with_instrumented_steps=gpu_peak_gib(),
                       host_peak_gib_with_instrumented_steps=host_peak_gib())
        run["status"] = "ok"
        finite = all(np.isfinite(r["loss"]) for r in records)
        run["loss_finite_and_decreasing"] = bool(finite and records[-1]["loss"] < records[0]["loss"])
    except Exception as e:  # recorded, not hidden: the JSON says what failed
        import traceback
        traceback.print_exc()
        run.update(status=f"error: {type(e).__name__}: {str(e)[:500]}", gpu_peak_gib=gpu_peak_gib(),
                   host_peak_gib=host_peak_gib())
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="3p5b_32k", help=f"comma-separated names from {sorted(CONFIGS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--timeline-steps", type=int, default=0,
                    help="after the breakdown, run this many steps with a Timeline and keep the last one's events")
    ap.add_argument("--trace-dir", default=None,
                    help="after the timed steps, one step under jax.profiler.trace into this folder (each config in "
                         "its own subfolder) and its per-GPU summary in the record (trace_summary.py: the span, "
                         "compute and idle time, compute by kernel kind, the top kernels): whether the engine's GPU "
                         "idles or its kernels run slower than a block's alone")
    ap.add_argument("--lr-warmup", type=int, default=0, help="linear LR warm-up steps (0: constant 3e-4)")
    ap.add_argument("--name", default=None, help="results name (default: device + configs)")
    ap.add_argument("--out", required=True, help="path of the results JSON")
    ap.add_argument("--append", action="store_true",
                    help="add the runs to the results file at --out when it exists (one file per script run)")
    args = ap.parse_args(argv)
    from child import pick_configs
    names = pick_configs(ap, args.configs, CONFIGS)
    if len(names) == 1:  # cap XLA's pinned pool at what the run pins, as megatrain-jax train does
        bc = resolve_layout(CONFIGS[names[0]])[0]
        fit_host_pool(bc.model(), bc.engine, bc.rows, bc.seq_len,
                      packed=bc.packed_docs > 0)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    result = {"name": args.name or f"{jax.devices()[0].platform}_{'_'.join(names)}",
              "command": "PYTHONPATH=. python " + " ".join(["experiments/bench.py"] + (argv or sys.argv[1:])),
              "git_commit": commit, "device": device_info(), "date": datetime.date.today().isoformat(),
              "jax_version": jax.__version__, "runs": []}
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    for n in names:
        result["runs"].append(run_config(n, CONFIGS[n], args.warmup, args.steps, args.lr_warmup,
                                         args.timeline_steps,
                                         trace_dir=args.trace_dir and os.path.join(args.trace_dir, n)))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for r in result["runs"][-len(names):]:  # this invocation's runs (--append keeps earlier ones)
        print(f"{r['config']}: {r['status']} tokens/s {r.get('tokens_per_s')} TFLOP/s {r.get('model_tflops')} "
              f"step {r.get('step_time_s')} s gpu {r.get('gpu_peak_gib')} GiB host {r.get('host_peak_gib')} GiB "
              f"breakdown {r.get('breakdown')}")


if __name__ == "__main__":
    main()
