"""One decoder block's forward and backward on the GPU, ours against SlideFormer's (issue 51's per-layer compute
item): seconds per block and hardware TFLOP/s, each in its own process (JAX takes most of the GPU's memory).

    PYTHONPATH=. python experiments/studies/layer_compute.py --out $OUT/layer_compute.json \
        [--preset llama2-13b --rows 16 --seq 2048] [--trace-dir $OUT/traces]

- **ours**: the engine's own per-block programs. A model of ``--layers`` blocks of the preset's shape, every
  part GPU-resident (nothing crosses PCIe), attention's residuals kept (``keep_residuals``, as the 13B bench
  configs); each op waited for before the next is dispatched, so each block's forward and backward is timed
  alone. Two layouts: every block recomputing its forward in the backward (``kept_layers`` 0), and every block
  keeping its matrix products (``kept_layers`` = ``--layers``).
- **slideformer**: the Hugging Face Llama decoder layer with Liger's kernels as SlideFormer runs it
  (``AutoLigerKernelForCausalLM``, sdpa attention, bfloat16), its forward under
  ``torch.utils.checkpoint(use_reentrant=False)`` as its ``transformer_layer.py`` does (the backward recomputes
  the forward), timed with CUDA events. Needs torch with CUDA and liger-kernel: ``.whl/slideformer`` installed
  into ``--site`` (as experiments/peers/slideformer_bench.py takes them).

Hardware FLOPs count what each runs: the forward's matrix products (2 per weight per token) and attention
(2 x query width x keys seen per token, causal); the backward twice the products and 2.5 times attention's
forward (flash attention's backward), plus the recomputed forward where there is one (its attention too,
unless the residuals are kept). ``--trace-dir``: one profiled step of each (jax.profiler, torch.profiler); ours
is summarized into the results file too (``trace_summary.py``: compute time by kernel kind, the top kernels), since
the profiler's folders are too deep to come back from the device.
Without a GPU the ``ours`` half still runs (small shapes: ``--preset tiny``), for the tests.

``--xla-flags="V1;V2;..."`` (with ``=``: a value starting ``--`` is otherwise taken for an option) runs our half
once per variant of ``XLA_FLAGS`` (added to any set already; an empty
variant is the baseline), each in its own process since XLA reads its flags once: which code-generation flags make
the block faster (e.g. ``--xla_gpu_enable_triton_gemm=false``, ``--xla_gpu_enable_command_buffer=``). A flag this
XLA does not know ends its child with an error, recorded as that variant's status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from child import results_header, run_child  # noqa: E402


def packed_row(packed: str, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``--packed DOCSxLEN``: one row's segment ids, positions and loss mask shaped as ``train`` packs short chats:
    DOCS documents of LEN tokens, then the row's padding as one run more, out of the loss, which cuDNN's packed
    layout computes like a document (``train`` gives the padding id 0 and position 0; here its own id and positions
    from 0: the same runs, the same work)."""
    try:
        docs, n = (int(x) for x in packed.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--packed takes DOCSxLEN, e.g. 15x30, got {packed!r}") from None
    if docs < 1 or n < 1 or docs * n > seq:
        raise SystemExit(f"--packed {packed}: {docs} documents of {n} tokens do not fit a row of {seq}")
    seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), n)
    pos = np.tile(np.arange(n, dtype=np.int32), docs)
    pad = seq - docs * n
    seg = np.concatenate([seg, np.full(pad, docs + 1, np.int32)])
    pos = np.concatenate([pos, np.arange(pad, dtype=np.int32)])
    return seg, pos, (np.arange(seq) < docs * n).astype(np.float32)


def attention_span(packed: str | None, seq: int) -> float:
    """Keys a token's causal attention sees, doubled (sum of each run's length squared over the row's tokens):
    ``seq`` for whole rows."""
    if not packed:
        return float(seq)
    seg, _, _ = packed_row(packed, seq)
    runs = np.bincount(seg)
    return float(runs @ runs) / seq


def block_flops(preset_name: str, rows: int, seq: int, packed: str | None = None) -> dict:
    """A block's forward matrix-product and attention FLOPs over ``rows`` x ``seq`` tokens (attention within each
    run of a ``--packed`` row)."""
    from megatrain_jax.models import preset
    cfg = preset(preset_name)
    tokens = rows * seq
    return {"matmul": 2.0 * cfg.block_active_param_count(0) * tokens,
            "attention": 2.0 * cfg.heads * cfg.dim_per_head * attention_span(packed, seq) * tokens}


def hardware_flops(f: dict, recompute: bool, keep_residuals: bool) -> tuple[float, float]:
    """(forward, backward) hardware FLOPs of one block."""
    forward = f["matmul"] + f["attention"]
    backward = 2 * f["matmul"] + 2.5 * f["attention"]
    if recompute:
        backward += f["matmul"] + (0.0 if keep_residuals else f["attention"])
    return forward, backward


def summary(name: str, fwd: list[float], bwd: list[float], flops: tuple[float, float], extra: dict) -> dict:
    f, b = statistics.median(fwd), statistics.median(bwd)
    model = 3 * flops[0]  # a block's model FLOPs: forward and twice it backward, no recompute
    return {"system": name, **extra, "forward_s": round(f, 5), "backward_s": round(b, 5),
            "forward_hw_tflops": round(flops[0] / f / 1e12, 1), "backward_hw_tflops": round(flops[1] / b / 1e12, 1),
            "block_hw_tflops": round(sum(flops) / (f + b) / 1e12, 1),
            "block_model_tflops": round(model / (f + b) / 1e12, 1),
            "samples": {"forward": [round(x, 5) for x in fwd], "backward": [round(x, 5) for x in bwd]}}


def ours(args) -> list[dict]:
    import jax
    from flax import nnx

    from megatrain_jax import Batch, Decoder, Engine, EngineConfig, adamw, preset
    from megatrain_jax.engine.passes import block_until_done
    cfg = preset(args.preset, layers=args.layers)
    rng = np.random.default_rng(0)
    f = block_flops(args.preset, args.rows, args.seq, args.packed)
    runs = []
    for kept in (0, args.layers):
        e = EngineConfig(micro_batches=1, resident_layers=args.layers, resident_io=True, keep_residuals=True,
                         kept_layers=kept)
        engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), adamw(3e-4), e, seed=0)
        times: dict[str, list[float]] = {"forward": [], "backward": []}

        class EachOp:  # waits for every op, records each block's forward and backward
            def on_op(self, op, start, end, out):
                block_until_done(out)
                if op.kind in times and op.part is not None and not op.part.is_io:
                    times[op.kind].append(time.perf_counter() - start)

            def on_task(self, key, start, end):
                pass

        def batch() -> Batch:
            b = Batch.from_windows(rng.integers(0, cfg.vocab_size, (args.rows, args.seq + 1)))
            if args.loss_tokens is not None:  # the rest of each row out of the loss: its gradients are zeros
                b = dataclasses.replace(b, loss_mask=np.tile((np.arange(args.seq) < args.loss_tokens).astype(
                    np.float32), (args.rows, 1)))
            if not args.packed:
                return b
            seg, pos, mask = packed_row(args.packed, args.seq)
            return dataclasses.replace(b, segment_ids=np.tile(seg, (args.rows, 1)),
                                       positions=np.tile(pos, (args.rows, 1)), loss_mask=np.tile(mask, (args.rows, 1)))
        for _ in range(2):  # compile and warm up
            engine.step(batch()).resolve()
        engine.sync()
        observer = EachOp()
        engine.observe(observer)
        for _ in range(args.steps):
            engine.step(batch()).resolve()
        engine.sync()
        engine.stop_observing(observer)
        trace = {}
        if args.trace_dir:
            where = os.path.join(args.trace_dir, f"ours_kept{kept}")
            with jax.profiler.trace(where, create_perfetto_trace=True):
                engine.step(batch()).resolve()
                engine.sync()
            from trace_summary import summarize  # the kernels by kind and the top ones, into the results file
            trace = {"trace": summarize(where)}
        runs.append(summary("megatrain_jax", times["forward"], times["backward"],
                            hardware_flops(f, recompute=kept == 0, keep_residuals=True),
                            {"kept_layers": kept, "keep_residuals": True, "device": jax.devices()[0].device_kind,
                             **trace}))
        engine.close()
        del engine
    return runs


def slideformer(args) -> list[dict]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process reads a preset only: JAX must not take the GPU
    if os.path.isdir(args.site):  # SlideFormer's pinned wheels (transformers, liger-kernel), first on the path
        sys.path.insert(0, args.site)
    try:
        import torch
        from torch.utils.checkpoint import checkpoint
    except ImportError as e:
        return [{"system": "slideformer_layer", "status": f"not run: no torch here ({e})"}]
    if not torch.cuda.is_available():
        return [{"system": "slideformer_layer", "status": "not run: torch has no CUDA GPU here"}]
    from liger_kernel.transformers import AutoLigerKernelForCausalLM
    from transformers import LlamaConfig

    from megatrain_jax.models import preset
    c = preset(args.preset)
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden, intermediate_size=c.ffn, num_hidden_layers=1,
                     num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                     max_position_embeddings=max(4096, args.seq), rms_norm_eps=1e-5, tie_word_embeddings=False,
                     use_cache=False)
    model = AutoLigerKernelForCausalLM.from_config(hf, attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    x = torch.randn(args.rows, args.seq, c.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.rows, -1)
    cos_sin = rotary(x, position_ids)
    grad = torch.randn_like(x)

    def run_layer(h):
        out = layer(h, position_embeddings=cos_sin, attention_mask=None, position_ids=position_ids)
        return out[0] if isinstance(out, tuple) else out

    def once(profile: bool = False) -> tuple[float, float]:
        a, b, c_ = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        y = checkpoint(run_layer, x, use_reentrant=False)
        b.record()
        y.backward(grad)
        c_.record()
        torch.cuda.synchronize()
        x.grad = None
        return a.elapsed_time(b) / 1e3, b.elapsed_time(c_) / 1e3

    for _ in range(3):
        once()
    samples = [once() for _ in range(args.steps * args.layers)]
    if args.trace_dir:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, "slideformer_layer.json"))
    f = block_flops(args.preset, args.rows, args.seq)
    import liger_kernel
    return [summary("slideformer_layer", [s[0] for s in samples], [s[1] for s in samples],
                    hardware_flops(f, recompute=True, keep_residuals=False),
                    {"recompute": "torch.utils.checkpoint(use_reentrant=False), as SlideFormer's transformer_layer.py",
                     "attention": "sdpa", "liger": getattr(liger_kernel, "__version__", "installed"),
                     "torch": torch.__version__, "device": torch.cuda.get_device_name(0)})]


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less each of ``options`` and its value (``--opt VALUE`` or ``--opt=VALUE``), by position."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama2-13b")
    ap.add_argument("--layers", type=int, default=2, help="blocks in our model (each timed)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (ours: each times every block once)")
    ap.add_argument("--packed", default=None, metavar="DOCSxLEN",
                    help="our half only: rows packed as train packs short chats, DOCS documents of LEN tokens then "
                         "the padding as one run (e.g. 15x30: h200_sft_8b's generated chats)")
    ap.add_argument("--halves", default="ours,slideformer")
    ap.add_argument("--loss-tokens", type=int, default=None, metavar="N",
                    help="our half, whole rows: only each row's first N tokens count in the loss (the backward's "
                         "gradients are zeros on the rest, as on a packed row's padding), the attention unchanged")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--site", default="/tmp/site_slideformer",
                    help="SlideFormer's wheels (scripts/build_peer_wheels.sh), put first on the peer's sys.path")
    ap.add_argument("--half", default=None, help=argparse.SUPPRESS)  # the child process's half
    ap.add_argument("--out", default=None)
    ap.add_argument("--xla-flags", default=None,
                    help="';'-separated XLA_FLAGS variants, given with '=': our half runs once per variant, each in its "
                         "own process (an empty variant is the baseline), e.g. "
                         "--xla-flags=';--xla_gpu_enable_triton_gemm=false'")
    args = ap.parse_args()
    if args.half:
        print(json.dumps({"runs": {"ours": ours, "slideformer": slideformer}[args.half](args)}))
        return
    if not args.out:
        ap.error("--out is required")
    if (args.packed or args.loss_tokens is not None) and "slideformer" in args.halves.split(","):
        ap.error("--packed and --loss-tokens run our half only (SlideFormer's layer takes whole rows, all in its "
                 "loss): add --halves ours")
    if args.packed and args.loss_tokens is not None:
        ap.error("--loss-tokens is for whole rows (a --packed row's padding is out of the loss already)")
    if args.loss_tokens is not None and not 1 <= args.loss_tokens <= args.seq:
        ap.error(f"--loss-tokens must be between 1 and --seq ({args.seq}), got {args.loss_tokens}")
    runs = []
    variants = [v.strip() for v in args.xla_flags.split(";")] if args.xla_flags is not None else [None]
    base = os.environ.get("XLA_FLAGS", "")
    for half in args.halves.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--half", half] + _without(sys.argv[1:], "--out", "--xla-flags")
        for flags in (variants if half == "ours" else [None]):  # XLA's flags are read once, at its start
            if flags is not None:
                os.environ["XLA_FLAGS"] = f"{base} {flags}".strip()
            got = run_child(cmd, timeout=600, system=half, **({"xla_flags": flags} if flags is not None else {}))
            os.environ["XLA_FLAGS"] = base
            if not base:
                del os.environ["XLA_FLAGS"]
            got_runs = got.get("runs", [got])
            if flags is not None:
                for r in got_runs:
                    r["xla_flags"] = flags
            runs += got_runs
    f = block_flops(args.preset, args.rows, args.seq, args.packed)
    record = {**results_header(args.out, __file__), "preset": args.preset, "rows": args.rows, "seq_len": args.seq,
              "packed": args.packed, "loss_tokens": args.loss_tokens, "attention_span": attention_span(args.packed, args.seq), "block_flops": f,
              "runs": runs}
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")
    for r in runs:
        print(r.get("system"), r.get("kept_layers", ""), r.get("status", ""), r.get("forward_s"), r.get("backward_s"),
              r.get("block_hw_tflops"))


if __name__ == "__main__":
    main()
