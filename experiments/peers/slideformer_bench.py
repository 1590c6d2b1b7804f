"""SlideFormer (DAC 2026, github.com/RegiaYoung/SlideFormer) on the workload of experiments/bench.py, one run
appended to the results file that experiments/compare_zero3.py writes (issue 51, item 1).

    bash scripts/fetch_slideformer.sh           # its code, into the git-ignored .peers/slideformer (never committed)
    bash scripts/build_peer_wheels.sh           # its pinned wheels -> .whl/slideformer (git-ignored)
    # on the GPU machine:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site_slideformer .whl/slideformer/*.whl
    PYTHONPATH=/tmp/site:. python experiments/peers/slideformer_bench.py --layers 16 --rows 16 --out $OUT/bench.json

What runs is SlideFormer's own single-GPU path, as its scripts/main_bench.py drives it: an HF ``LlamaForCausalLM``
built through liger's ``AutoLigerKernelForCausalLM`` (``from_config``, random weights from HF's init run on the GPU
and moved to host memory, where its script calls ``from_pretrained`` on a checkpoint folder), bf16, handed to ``SlideFormerOffloader`` with its defaults (a
window of two GPU cache units, no double buffer, layer-wise ``LayerAdam`` on the host, its CPU Adam JIT-built by its own
``CPUAdamLoader`` with g++, fp32 masters and moments, no gradient clipping, every decoder layer checkpointed with its
input kept in pinned host memory). One call of the offloader's forward is one optimizer step: the forward, the
backward, the per-layer host update and its drain (``wait_for_completion``). SlideFormer has no gradient accumulation,
so the step's ``rows`` sequences go through as one batch (its benchmark's ``--batch_size``). Nothing in its files is
changed; where its code fails here, the run's status says how.

Shape and data are compare_zero3.py's: the 7B layer shape (hidden 4096, ffn 11008, 32 heads, vocab 32000, untied
embeddings) at 16 layers for the 3.5B model, or ``--preset 13b`` (Llama-2-13B: 40 layers, hidden 5120, ffn 13824,
40 heads); the demo Markov corpus windows of bench.py, ``rows`` per step, sequence 2048. Inputs are the windows'
first 2048 tokens with an all-ones mask and ``labels = input_ids`` (SlideFormer shifts inside its output layer, so
2047 targets a row). Attention is ``sdpa``: flash-attn is not on the GPU image. Speeds count the median timed step;
model TFLOP/s uses this repository's count (6 N + 6 L h s per token), SlideFormer's own formula is kept beside it.
``--dry-run`` prints the shape and the regime estimates without importing torch.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import compare_zero3 as cz  # noqa: E402  (stdlib-only at import: shapes, FLOPs, data, results file)

SYSTEM = "slideformer"
DEFAULT_PEER = os.path.join(REPO, ".peers", "slideformer")
DEFAULT_SITE = "/tmp/site_slideformer"
PRESETS = {"3p5b": dict(layers=16, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
           "13b": dict(layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000)}  # Llama-2-13B
NEEDED = ("offload_transformer.py", "transformer_layer.py", "sliding_checkpoint.py", "utils/model_compat.py",
          "utils/legacy_fused_linear_cross_entropy.py", "optimizer/layer_adam/builder.py",
          "optimizer/layer_adam/csrc/cpu_adam.cpp", "optimizer/layer_adam/csrc/cpu_adam_impl.cpp")
FETCH_HINT = ("run `bash scripts/fetch_slideformer.sh` on a machine that reaches github.com (it clones the pinned "
              "commit into .peers/slideformer, git-ignored), and carry .peers/slideformer to the GPU machine "
              "(run's carry list)")


class Unmet(Exception):
    """A precondition of the run is missing: said plainly, no results entry written."""


# ---------------------------------------------------------------------------------------------------------
# Pure parts (no torch).

def resolve_shape(args) -> None:
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def config_name(args) -> str:
    if args.config:
        return args.config
    if args.preset == "13b":
        return f"13b_{args.rows * args.seq // 1024}k"
    return cz.config_name(args)


def regime(args, shape: dict) -> dict:
    """What SlideFormer keeps on the GPU and moves over PCIe in one step, from its code (offload_transformer.py,
    transformer_layer.py, sliding_checkpoint.py at the pinned commit), in bytes."""
    L, h, V = shape["layers"], shape["hidden"], shape["vocab"]
    per_layer = (shape["params"] - 2 * V * h - h) // L
    embed, out = V * h, V * h + h  # the output unit is the final norm and the untied lm_head
    total = shape["params"]
    slots = 3 if args.double_buffer else 2  # gpu_unit_size = 1 + (2 if double_buffer else 1) cache units
    largest = max(embed, per_layer, out)  # each unit holds a bf16 weight buffer and a bf16 grad buffer this size
    bf16 = 2
    # H2D weights: the embedding and every decoder layer are fetched for the forward and again for the backward
    # (every layer is recomputed: checkpoint(use_reentrant=False)); the output unit is fetched once (is_bwd=True)
    # and kept through its backward. fp32 masters are cast to bf16 on the host (chunks of 32 Mi elements).
    weights_h2d = bf16 * (2 * (embed + L * per_layer) + out)
    # D2H grads: each unit's whole bf16 gradient buffer after its backward (the embedding's is dense, V x h).
    grads_d2h = bf16 * total
    # Activations: SlidingCheckpoint sends each decoder layer's checkpointed input [B, S, h] (bf16) to pinned
    # host memory in the forward, except the last layer's, and prefetches it back for the backward.
    act = bf16 * args.rows * args.seq * h * (L - 1)
    h2d, d2h = weights_h2d + act, grads_d2h + act
    host_est = (4 * total + 8 * total  # fp32 masters + fp32 Adam moments
                + bf16 * largest * (3 if args.double_buffer else 2)  # pinned grad buffer(s) + bf16 staging buffer
                + bf16 * args.rows * args.seq * h * L)  # pinned activation buffers (one per decoder layer)
    return {
        "gpu_resident_param_share": 0.0,
        "gpu_window_param_share": round(min(slots * largest / total, 1.0), 4),
        "gpu_window": f"{slots} cache units of {largest} parameters (bf16 weights + bf16 grads each); no parameter "
                      "stays on the GPU from one step to the next",
        "pcie_per_gpu_per_step": {
            "h2d_bytes": h2d, "d2h_bytes": d2h, "total_bytes": h2d + d2h,
            "weights_h2d_bytes": weights_h2d, "grads_d2h_bytes": grads_d2h,
            "activations_d2h_bytes": act, "activations_h2d_bytes": act,
            "weights_and_grads_total_bytes": weights_h2d + grads_d2h,
            "note": "estimated from SlideFormer's data path: bf16 weights fetched for the forward and again for the "
                    "recomputing backward (output unit once), bf16 gradients sent home, each decoder layer's "
                    "checkpointed input out and back (the last layer's stays); inputs and labels not counted. "
                    "weights_and_grads_total_bytes is the like-for-like figure with bench.py's "
                    "pcie_per_gpu_per_step (which counts weights fetched and gradients sent home only)"},
        "host_estimate_gib": round(host_est / 2**30, 1),
    }


def peer_upstream(peer: str) -> dict:
    path = os.path.join(peer, "MANIFEST.json")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return {"repo": "RegiaYoung/SlideFormer", "manifest": None, "error": f"no readable {path}: {e}"}
    return {"repo": m.get("repo"), "pinned_commit": m.get("pinned_commit"),
            "file_commits": sorted({f["commit"] for f in m.get("files", []) if f.get("commit")}),
            "how_obtained": m.get("how_obtained"), "manifest": os.path.relpath(path, REPO)}


def check_peer(peer: str) -> None:
    missing = [p for p in NEEDED if not os.path.isfile(os.path.join(peer, p))]
    if missing:
        raise Unmet(f"SlideFormer's code is not at {peer} (missing {', '.join(missing[:3])}"
                    f"{'...' if len(missing) > 3 else ''}): {FETCH_HINT}")


# ---------------------------------------------------------------------------------------------------------
# The GPU part.

def import_torch_cuda():
    try:
        import torch
    except ImportError as e:
        raise Unmet(f"SlideFormer needs PyTorch with CUDA ({e})") from e
    if not torch.cuda.is_available():
        raise Unmet("SlideFormer needs a CUDA GPU: its transformer_layer.py and sliding_checkpoint.py create CUDA "
                    "streams when imported, and the offloader keeps its window on cuda:0 (no CPU fallback). Run "
                    "this on the GPU machine")
    return torch


def check_transformers(peer: str) -> None:
    """SlideFormer's utils/model_compat.py calls create_causal_mask(..., cache_position=...): transformers after
    5.5 dropped that keyword, and the image's 5.17 raises TypeError at the first forward. Say so before minutes of
    model building."""
    import transformers
    from transformers import masking_utils
    with open(os.path.join(peer, "utils", "model_compat.py")) as f:
        passes = "cache_position=cache_position" in f.read()
    params = inspect.signature(masking_utils.create_causal_mask).parameters
    takes = "cache_position" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if passes and not takes:
        raise RuntimeError(
            f"transformers {transformers.__version__} ({os.path.dirname(transformers.__file__)}): create_causal_mask() "
            "takes no cache_position, which SlideFormer's utils/model_compat.py build_decoder_attention_mask passes "
            "(TypeError at the first forward); its requirements pin transformers==5.5.4: install .whl/slideformer "
            f"(scripts/build_peer_wheels.sh) into {DEFAULT_SITE}")


def run_slideformer(args, run: dict, checkpoint) -> None:
    torch = import_torch_cuda()
    check_transformers(args.peer)
    import transformers
    from transformers import LlamaConfig
    try:
        from liger_kernel.transformers import AutoLigerKernelForCausalLM
    except ImportError as e:
        raise RuntimeError(
            f"liger-kernel is not importable ({e}): SlideFormer needs it even without its model patches "
            "(transformer_layer.py -> utils/legacy_fused_linear_cross_entropy.py imports liger's Triton cross-entropy "
            f"kernel); install .whl/slideformer (scripts/build_peer_wheels.sh) into {DEFAULT_SITE}") from e
    liger_version = metadata.version("liger-kernel")
    run["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "liger_kernel": liger_version, "cuda": torch.version.cuda}

    # SlideFormer's own modules, from the peer folder (its code imports them as top-level names)
    t0 = time.perf_counter()
    from optimizer.layer_adam.builder import CPUAdamLoader
    run["cpu_adam_compile_args"] = CPUAdamLoader().get_compile_args()  # -D__AVX512__ etc. (lscpu-detected)
    CPUAdamLoader().load()  # its JIT build (torch.utils.cpp_extension, g++ -O3 -fopenmp -march=native)
    run["op_build_s"] = round(time.perf_counter() - t0, 2)
    print(f"[slideformer] CPU Adam built in {run['op_build_s']} s with {' '.join(run['cpu_adam_compile_args'])}",
          flush=True)
    import transformer_layer
    from offload_transformer import SlideFormerOffloader
    from utils.metric import calculate_flops_per_batch
    if args.h2d_chunk:
        transformer_layer.H2D_CHUNK_SIZE = args.h2d_chunk
    if args.d2h_chunk:
        transformer_layer.D2H_CHUNK_SIZE = args.d2h_chunk
    run["chunk_elements"] = {"h2d": transformer_layer.H2D_CHUNK_SIZE, "d2h": transformer_layer.D2H_CHUNK_SIZE}

    t0 = time.perf_counter()
    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)
    if args.no_liger:
        from transformers import AutoModelForCausalLM as model_cls
    else:  # what its load_text_model does for Llama (AutoLigerKernelForCausalLM.from_pretrained), from a config
        model_cls = AutoLigerKernelForCausalLM
    # The random init runs HF's own init code on the GPU, then the model moves to host memory before SlideFormer
    # sees it: torch's CPU random fills are serial, and two of them (nn.Linear's, then HF's _init_weights) took
    # most of the 456 s the 13B model's build took on the CPU. The step is untouched; only the setup is faster.
    init_device = "cuda" if args.init_on_gpu else "cpu"
    try:
        with torch.device(init_device):
            base_model = model_cls.from_config(hf_cfg, attn_implementation=args.attn, dtype=torch.bfloat16)
    except torch.cuda.OutOfMemoryError:  # a model larger than the GPU: built on the CPU, as before
        base_model, init_device = None, "cpu"
        torch.cuda.empty_cache()
        with torch.device("cpu"):
            base_model = model_cls.from_config(hf_cfg, attn_implementation=args.attn, dtype=torch.bfloat16)
    if init_device == "cuda":
        base_model.to("cpu")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run["init_device"] = init_device  # the random weights differ from a CPU build's with the same seed
    base_model.config.use_cache = False
    n_params = sum(p.numel() for p in base_model.parameters())
    run["model"]["params_counted"] = int(n_params)
    if n_params != run["model"]["params"]:
        print(f"[slideformer] WARNING: model has {n_params} parameters, expected {run['model']['params']}", flush=True)
        run["model"]["params"] = int(n_params)
    run["liger_patched"] = {"rms_norm": type(base_model.model.norm).__name__,
                            "mlp": type(base_model.model.layers[0].mlp).__name__}
    optimizer_kwargs = {  # main_bench.py's dict, with this comparison's AdamW settings (speed-neutral)
        "lr": 3e-4, "betas": (0.9, 0.95), "bias_correction": True, "weight_decay": 0.1, "eps": 1e-8,
        "fp32_optimizer_state": True, "num_layer": len(base_model.get_decoder().layers) + 2,
        "nvme_offload_fraction": 0.0, "offload_dir": args.offload_dir, "prefetch": True}
    device = torch.device("cuda:0")
    model = SlideFormerOffloader(model=base_model, device=device, dtype=torch.bfloat16, ac_offload_nvme=False,
                                 offload_dir=args.offload_dir, double_buffer=args.double_buffer,
                                 enable_timing=not args.no_timing, enable_memory_stats=False,
                                 optimizer_kwargs=optimizer_kwargs)
    model.train()
    run["init_s"] = round(time.perf_counter() - t0, 2)
    print(f"[slideformer] model + offloader in {run['init_s']} s; {n_params / 1e9:.3f} B params", flush=True)

    n_steps = args.warmup + args.steps
    batches = cz.window_batches(n_steps + 1, args.rows, args.seq, args.vocab)
    losses, step_times, timing_marks = [], [], None
    for step in range(n_steps):
        windows = torch.from_numpy(next(batches))
        if step == args.warmup:
            timing_marks = layer_timing_marks(model)
        torch.cuda.synchronize()
        t = time.perf_counter()
        input_ids = windows[:, :-1].to(device)
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)  # fwd + bwd + update
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        loss_v = float(out.loss)
        del out
        losses.append(loss_v)
        step_times.append(dt)
        print(f"[slideformer] step {step} loss {loss_v:.4f} {dt:.3f}s "
              f"gpu_peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB host_peak {cz.host_peak_gib()} GiB",
              flush=True)
        if step == 0:
            run["first_step_s"] = round(dt, 3)
            checkpoint(run)

    step_time = cz.record_timed(run, step_times, losses, args.warmup, args.rows, args.seq)
    own = calculate_flops_per_batch(base_model, args.rows, args.seq)
    run["tflops_slideformer_formula"] = round(own / step_time / 1e12, 1)
    if timing_marks is not None:
        run["layer_timing_ms"] = layer_timing_since(model, timing_marks)


def layer_timing_marks(model) -> dict:
    """How many timings each layer's LayerTimer holds per operation (its enable_timing bookkeeping)."""
    marks = {}
    for i, layer in enumerate(model.transformer_layers):
        if layer.timer is not None:
            layer.timer.flush_cuda_spans(force=True)
            marks[i] = {op: len(v) for op, v in layer.timer.timings.items()}
    return marks


def layer_timing_since(model, marks: dict) -> dict:
    """Mean per-layer time of each operation over the timed steps, in ms (SlideFormer's own LayerTimer)."""
    per_op: dict = {}
    for i, layer in enumerate(model.transformer_layers):
        if layer.timer is None:
            continue
        layer.timer.flush_cuda_spans(force=True)
        for op, values in layer.timer.timings.items():
            per_op.setdefault(op, []).extend(values[marks.get(i, {}).get(op, 0):])
    return {op: round(1000 * statistics.fmean(v), 3) for op, v in sorted(per_op.items()) if v}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="3p5b",
                    help="shape defaults: 3p5b (7B layer shape, 16 layers by default) or 13b (Llama-2-13B)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (16: the 3.5B model; 32: 6.7B)")
    ap.add_argument("--rows", type=int, default=16, help="sequences per step, one batch: tokens/step = rows * seq")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random init")
    ap.add_argument("--init-on-gpu", action=argparse.BooleanOptionalAction, default=True,
                    help="run HF's random init on the GPU and move the model to host memory (default; the setup "
                         "only: minutes faster at 13B); --no-init-on-gpu builds it on the CPU as before")
    ap.add_argument("--double-buffer", action="store_true",
                    help="SlideFormerOffloader(double_buffer=True): three cache units and a separate D2H stream "
                         "(off by default, as in its scripts)")
    ap.add_argument("--h2d-chunk", type=int, default=None,
                    help="elements per chunk of its fp32->bf16 cast + H2D copy (its default 32 Mi)")
    ap.add_argument("--d2h-chunk", type=int, default=None,
                    help="elements per chunk of its gradient D2H + chunked Adam (its default 32 Mi)")
    ap.add_argument("--no-timing", action="store_true",
                    help="enable_timing=False (its scripts keep its per-layer timers on, which add stream "
                         "synchronizations)")
    ap.add_argument("--no-liger", action="store_true", help="plain AutoModelForCausalLM (its --no-use_liger)")
    ap.add_argument("--attn", choices=("sdpa", "flash_attention_2"), default="sdpa",
                    help="sdpa: flash-attn is not on the GPU image (its scripts default to flash_attention_2)")
    ap.add_argument("--peer", default=DEFAULT_PEER, help="SlideFormer's code (scripts/fetch_slideformer.sh)")
    ap.add_argument("--site", default=DEFAULT_SITE,
                    help="folder of its pinned wheels (build_peer_wheels.sh), put first on sys.path when present")
    ap.add_argument("--offload-dir", default="/tmp/slideformer_offload", help="its offload_dir (NVMe paths, unused)")
    ap.add_argument("--config", default=None, help="the run's 'config' label (default: bench.py's name)")
    ap.add_argument("--name", default=None, help="results 'name' when a fresh file is written")
    ap.add_argument("--out", default=None, help="results JSON; appended to when it already holds 'runs'")
    ap.add_argument("--dry-run", action="store_true", help="print the shape and regime; import no torch")
    args = ap.parse_args(argv)
    resolve_shape(args)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if not args.dry_run and not args.out:
        ap.error("--out is required (except with --dry-run)")

    shape = cz.model_shape(args)
    tokens_per_step = args.rows * args.seq
    run = {"system": SYSTEM, "config": config_name(args), "model": shape, "seq_len": args.seq,
           "tokens_per_step": tokens_per_step, "steps_timed": args.steps, "warmup_steps": args.warmup,
           "micro_batch": args.rows, "gradient_accumulation": 1,
           "optimizer": "SlideFormer LayerAdam (DeepSpeed-derived CPU Adam, adamw_mode; lr 3e-4, betas (0.9, 0.95), "
                        "eps 1e-8, wd 0.1), layer by layer on the host during the backward",
           "gradient_clipping": False, "clip_norm": None, "compute_dtype": "bfloat16", "master_dtype": "float32",
           "optimizer_state_dtype": "float32", "grad_transfer_dtype": "bfloat16",
           "activation_checkpointing": "every decoder layer (non-reentrant), its input kept in pinned host memory "
                                       "and prefetched for the recomputing backward (SlidingCheckpoint)",
           "attention": args.attn, "liger": not args.no_liger, "double_buffer": args.double_buffer,
           "enable_timing": not args.no_timing,
           "offload": "all parameters, gradients and optimizer state in host memory; a sliding window of layers on "
                      "the GPU",
           **regime(args, shape), "upstream": peer_upstream(args.peer),
           "run_id": f"{os.getpid()}-{time.time():.0f}",
           "command": " ".join(["PYTHONPATH=/tmp/site:. python experiments/peers/slideformer_bench.py"]
                               + (argv if argv is not None else sys.argv[1:]))}
    if args.dry_run:
        fpt = cz.flops_per_token(shape["params"], shape["layers"], shape["hidden"], args.seq)
        print(json.dumps({k: run[k] for k in ("config", "model", "tokens_per_step", "gpu_resident_param_share",
                                              "gpu_window_param_share", "pcie_per_gpu_per_step",
                                              "host_estimate_gib", "upstream")}
                         | {"model_flops_per_token": fpt}, indent=1))
        return 0

    try:
        check_peer(args.peer)
        if os.path.isdir(args.site):
            sys.path.insert(0, args.site)
            run["site"] = args.site
        sys.path.insert(0, args.peer)
        import_torch_cuda()
    except Unmet as e:
        print(f"[slideformer] not run: {e}", file=sys.stderr, flush=True)
        return 2

    cz.prepare_environment()  # CUDA_HOME and ninja on PATH for its JIT build
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = {"name": args.name or f"slideformer_{run['config']}", "command": run["command"],
              "git_commit": commit or None, "device": cz.host_info(), "date": datetime.date.today().isoformat()}
    slot: list = []
    run["status"] = cz.EXITED_EARLY
    cz.write_run(args.out, header, run, slot)
    checkpoint = lambda r: cz.write_run(args.out, header, r, slot)  # noqa: E731

    import torch
    header["device"] = {"name": torch.cuda.get_device_name(0), "platform": "gpu", **cz.host_info()}
    run["device"] = header["device"]["name"]
    try:
        run_slideformer(args, run, checkpoint)
    except Exception as e:  # recorded, not hidden: the JSON says what failed
        cz.record_failure(run, e, 800)
    finally:
        run["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        run["gpu_reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        run["host_peak_gib"] = cz.host_peak_gib()
        cz.write_run(args.out, header, run, slot)
    print(f"{run['config']}: {run['status']} tokens/s {run.get('tokens_per_s')} TFLOP/s {run.get('model_tflops')} "
          f"step {run.get('step_time_s')} s gpu {run.get('gpu_peak_gib')} GiB host {run.get('host_peak_gib')} GiB",
          flush=True)
    return 0  # the status is in the results file; a failed peer should not stop a chained command


if __name__ == "__main__":
    sys.exit(main())
