"""DeepSpeed ZeRO-3 with parameter and optimizer CPU offload, on the workload of experiments/bench.py.

    PYTHONPATH=/tmp/site:. python experiments/compare_zero3.py --layers 16 --rows 16 --micro 4 \
        --warmup 2 --steps 4 --out $OUT/bench.json

The peer that docs/design.md ("Peers measured") compares against: an HF ``LlamaForCausalLM`` of the
preset's 7B layer shape (hidden 4096, ffn 11008, 32 heads, vocab 32000, untied embeddings, sdpa attention),
random-initialized under ``deepspeed.zero.Init`` (through ``HfDeepSpeedConfig``, as the HF Trainer does,
so the whole model never sits on the GPU), bf16, DeepSpeedCPUAdam in AdamW mode (lr 3e-4, betas
(0.9, 0.95), eps 1e-8, weight decay 0.1), clipping 1.0, activation checkpointing, sequence 2048.
The DeepSpeed config is experiments/ds_config_zero3.json plus the batch sizes; ``--ds-set`` overrides keys.

Data are bench.py's exactly: the demo Markov corpus at vocab 32000, non-overlapping windows of 2049 tokens,
shuffled with ``default_rng([0, 0])``, ``rows`` windows per step, split in order into micro-batches of
``micro`` rows (gradient accumulation ``rows / micro``).

One process, one GPU, no launcher: the script sets MASTER_ADDR/MASTER_PORT/RANK/LOCAL_RANK/WORLD_SIZE when
unset and calls ``deepspeed.init_distributed()``. The run is one entry of ``runs`` (docs/results.md);
when ``--out`` already holds a results file, the entry is appended to its ``runs``, so one file can hold
megatrain_jax's and DeepSpeed's runs of the same comparison. An entry saying the process ended early is
written before training starts, so a host OOM kill still leaves a record.

``--dry-run`` prints the resolved DeepSpeed config and the model shape without importing torch.
Without a CUDA GPU the script falls back to DeepSpeed's CPU accelerator: only a smoke test of this file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import types
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DS_CONFIG = os.path.join(REPO, "experiments", "ds_config_zero3.json")
SYSTEM = "deepspeed_zero3"
# bench.py's names for the same workloads, so runs of both systems line up by "config".
BENCH_NAMES = {(16, 4): "3p5b_8k", (16, 16): "3p5b_32k", (16, 48): "3p5b_98k", (32, 16): "7b_32k"}
EXITED_EARLY = "error: the process ended before the run finished (killed, e.g. by the host OOM killer)"


# ---------------------------------------------------------------------------------------------------------
# Pure parts (no torch): shapes, FLOPs, the DeepSpeed config, the data, the results file.

def model_shape(args) -> dict:
    L, h, f, V = args.layers, args.hidden, args.ffn, args.vocab
    kv_dim = h // args.heads * args.kv_heads
    per_layer = h * h * 2 + h * kv_dim * 2 + 3 * h * f + 2 * h  # q, o, k, v; gate, up, down; 2 RMSNorms
    params = L * per_layer + 2 * V * h + h  # + embeddings, untied lm_head, final norm
    return {"layers": L, "hidden": h, "ffn": f, "heads": args.heads, "kv_heads": args.kv_heads, "vocab": V,
            "params": params}


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """docs/results.md's count, as megatrain_jax/flops.py: 6 N + 6 L h s (recomputation not counted)."""
    return 6.0 * params + 6.0 * layers * hidden * seq_len


def _set_dotted(cfg: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    node = cfg
    for k in path:
        node = node.setdefault(k, {})
    node[last] = value


def build_ds_config(args) -> dict:
    with open(args.ds_config) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    accum = args.rows // args.micro
    cfg.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=accum,
               train_batch_size=args.micro * accum)  # world size 1
    h = args.hidden
    auto = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}
    zero = cfg.setdefault("zero_optimization", {})
    for k, v in auto.items():
        if zero.get(k) == "auto":
            zero[k] = v
    for item in args.ds_set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--ds-set wants dotted.key=JSON, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string such as cpu
        _set_dotted(cfg, key, value)
    return cfg


def window_batches(num_steps: int, rows: int, seq_len: int, vocab: int):
    """bench.py's batches: [rows, seq_len + 1] token windows per step, as numpy int64."""
    import numpy as np

    demo_tokens = load_demo_tokens()
    # bench.py draws (warmup + timed + 1) * tokens_per_step * 2 + seq_len + 1 tokens; with --warmup/--steps
    # equal to bench.py's, num_steps here is warmup + timed + 1 and the corpus (so every batch) is the same.
    tokens, _ = demo_tokens(vocab, num_steps * rows * seq_len * 2 + seq_len + 1, seed=0)
    count = (len(tokens) - 1) // seq_len  # TokenDataset(mode="windows"): stride seq_len, seq_len + 1 long
    order = np.random.default_rng([0, 0]).permutation(count)  # TokenBatches(seed=0), epoch 0
    for step in range(num_steps):
        idx = order[step * rows:(step + 1) * rows]
        yield np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in idx]).astype(np.int64)


def load_demo_tokens():
    """``megatrain_jax.data.demo.demo_tokens`` without running megatrain_jax/__init__.py, which imports JAX
    and flax: they would add to this process's host memory and have no business in a PyTorch run. The two
    files it needs (data/demo.py, data/tokens.py) import only numpy."""
    if "megatrain_jax" not in sys.modules:
        for name, sub in (("megatrain_jax", ("megatrain_jax",)), ("megatrain_jax.data", ("megatrain_jax", "data"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(REPO, *sub)]
            sys.modules[name] = pkg
    from megatrain_jax.data.demo import demo_tokens
    return demo_tokens


def config_name(args) -> str:
    default = BENCH_NAMES.get((args.layers, args.rows)) if (args.hidden, args.seq) == (4096, 2048) else None
    return args.config or default or f"{args.layers}l_{args.rows * args.seq}tok"


def host_info() -> dict:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"host_ram_gib": round(pages / 2**30, 1), "cpu_cores": os.cpu_count()}


def host_peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # ru_maxrss is KiB on Linux


def write_run(path: str, header: dict, run: dict, slot: list) -> None:
    """Put ``run`` into the results file at ``path``: appended to an existing results file's ``runs`` on the
    first call (``slot`` then remembers its index), replaced in place on later calls."""
    result = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                result = json.load(f)
            if not (isinstance(result, dict) and isinstance(result.get("runs"), list)):
                print(f"[compare_zero3] {path} is no results file (no 'runs'): writing a fresh one", flush=True)
                result = None
        except (OSError, json.JSONDecodeError) as e:
            print(f"[compare_zero3] cannot read {path} ({e}): writing a fresh one", flush=True)
    if result is None:
        result = {**header, "runs": []}
        slot.clear()
    dev = header.get("device")
    if isinstance(dev, dict) and dev.get("name") and isinstance(result.get("device"), dict) \
            and not result["device"].get("name"):  # a file begun before the GPU was named (the first write)
        result["device"] = dev
    if slot and slot[0] < len(result["runs"]) and result["runs"][slot[0]].get("run_id") == run["run_id"]:
        result["runs"][slot[0]] = run
    else:
        result["runs"].append(run)
        slot[:] = [len(result["runs"]) - 1]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# The GPU part.

def prepare_environment() -> None:
    """Single-process 'distributed' setup without the deepspeed launcher, and what the cpu_adam JIT needs."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    nvcc = shutil.which("nvcc")
    if "CUDA_HOME" not in os.environ:
        for cand in ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []) + ["/usr/local/cuda"]:
            if os.path.exists(os.path.join(cand, "bin", "nvcc")):
                os.environ["CUDA_HOME"] = cand
                break
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    # nvcc 13.x vs torch's cu130: DeepSpeed's version table stops at CUDA 12, so it would refuse a minor
    # mismatch of CUDA 13 for ops that use nvcc (cpu_adam itself is plain C++ built with g++).
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
    if shutil.which("ninja") is None:  # torch's JIT runs `ninja`; the pip package may be off PATH
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_zero3(args, ds_cfg: dict, run: dict, checkpoint) -> None:
    """Train and fill ``run``; ``checkpoint(run)`` rewrites the results file."""
    import numpy as np
    import torch

    # newer torch deprecates the collective that DeepSpeed 0.19 calls once per bucket: keep the log readable
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*", category=FutureWarning)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        print("[compare_zero3] no CUDA GPU: DeepSpeed's CPU accelerator, a smoke test only", flush=True)
        run["smoke_test_cpu"] = True
    import deepspeed
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    run["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                       "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    t0 = time.perf_counter()

    # cpu_adam JIT-compiles on first use (~1-2 min); build it here so init_s below is DeepSpeed's own.
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()
    run["op_build_s"] = round(time.perf_counter() - t0, 2)
    print(f"[compare_zero3] cpu_adam ready in {run['op_build_s']} s", flush=True)

    t0 = time.perf_counter()
    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, use_cache=False)
    # Keep a reference alive: while it lives, from_config builds under deepspeed.zero.Init (partitioned as
    # each module is made, offloaded to pinned host memory) and initializes weights gathered module by module.
    dschf = HfDeepSpeedConfig(ds_cfg)  # noqa: F841
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()  # transformers 5: use_reentrant=False by default
    model.config.use_cache = False
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    run["model"]["params_counted"] = int(n_params)
    if n_params != run["model"]["params"]:
        print(f"[compare_zero3] WARNING: model has {n_params} parameters, expected {run['model']['params']}",
              flush=True)
        run["model"]["params"] = int(n_params)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    run["optimizer_class"] = type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer") \
        else type(engine.optimizer).__name__
    run["init_s"] = round(time.perf_counter() - t0, 2)
    print(f"[compare_zero3] model + deepspeed.initialize in {run['init_s']} s; {n_params / 1e9:.3f} B params; "
          f"optimizer {run['optimizer_class']}", flush=True)
    engine.train()

    device = engine.device
    accum = args.rows // args.micro
    n_steps = args.warmup + args.steps
    batches = window_batches(n_steps + 1, args.rows, args.seq, args.vocab)
    losses, grad_norms, step_times = [], [], []
    for step in range(n_steps):
        windows = torch.from_numpy(next(batches))
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        micro_losses = []
        for a in range(accum):
            w = windows[a * args.micro:(a + 1) * args.micro].to(device, non_blocking=True)
            logits = engine(input_ids=w[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     w[:, 1:].reshape(-1))
            engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # the optimizer runs (on the host) only at the accumulation boundary
            micro_losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        loss_v = float(torch.stack(micro_losses).mean())
        gn = engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else None
        losses.append(loss_v)
        grad_norms.append(gn)
        step_times.append(dt)
        print(f"[compare_zero3] step {step} loss {loss_v:.4f} gnorm {gn} {dt:.3f}s "
              f"gpu_peak {torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.2f} GiB "
              f"host_peak {host_peak_gib()} GiB", flush=True)
        if step == 0:
            run["first_step_s"] = round(dt, 3)
            checkpoint(run)

    record_timed(run, step_times, losses, args.warmup, args.rows, args.seq)
    run["grad_norms"] = [None if g is None else round(g, 4) for g in grad_norms]


def _offloads(ds_cfg: dict, key: str) -> bool:
    return (ds_cfg.get("zero_optimization", {}).get(key) or {}).get("device", "none") not in ("none", None)


def offload_words(ds_cfg: dict) -> str:
    """Where this DeepSpeed config keeps parameters and optimizer state, in words."""
    opt = ds_cfg.get("zero_optimization", {}).get("offload_optimizer") or {}
    params = "parameters in pinned CPU memory" if _offloads(ds_cfg, "offload_param") else "parameters on the GPU"
    if not _offloads(ds_cfg, "offload_optimizer"):
        return f"ZeRO-3: {params}, optimizer state on the GPU"
    ratio = opt.get("ratio", 1.0)
    share = "all of the optimizer state" if ratio >= 1 else f"{ratio:.0%} of the optimizer state (offload_optimizer.ratio)"
    return f"ZeRO-3: {params}, {share} in pinned CPU memory"


def record_failure(run: dict, err: Exception, chars: int) -> None:
    """A peer's failed run, recorded (the traceback printed): ``status`` oom, or error with the message."""
    traceback.print_exc()
    msg = f"{type(err).__name__}: {str(err)[:chars]}"
    oom = type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower()
    run["status"] = "oom" if oom else f"error: {msg}"
    if oom:
        run["error"] = msg


def record_timed(run: dict, step_times: list[float], losses: list[float], warmup: int, rows: int, seq: int) -> float:
    """Into a peer's ``run``: the median step after ``warmup`` steps, tokens/s and model TFLOP/s (docs/results.md's
    count), the losses and step times, status ok; returns the median step's seconds."""
    step_time = statistics.median(step_times[warmup:])
    m = run["model"]
    tps = rows * seq / step_time
    run.update(step_time_s=round(step_time, 4), tokens_per_s=round(tps, 1),
               model_tflops=round(tps * flops_per_token(m["params"], m["layers"], m["hidden"], seq) / 1e12, 1),
               loss_first=losses[warmup], loss_last=losses[-1], losses=[round(x, 4) for x in losses],
               step_times=[round(x, 4) for x in step_times], status="ok",
               loss_finite_and_decreasing=bool(all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]))
    return step_time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="16: the 3.5B model; 32: 6.7B")
    ap.add_argument("--rows", type=int, default=16, help="sequences per step: tokens/step = rows * seq")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch rows per GPU; accumulation = rows / micro")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random init")
    ap.add_argument("--no-checkpointing", action="store_true", help="turn activation checkpointing off")
    ap.add_argument("--ds-config", default=DEFAULT_DS_CONFIG, help="base DeepSpeed config (JSON)")
    ap.add_argument("--ds-set", action="append", default=[], metavar="KEY=JSON",
                    help="override a config key, e.g. zero_optimization.stage3_prefetch_bucket_size=5e8")
    ap.add_argument("--config", default=None, help="the run's 'config' label (default: bench.py's name)")
    ap.add_argument("--name", default=None, help="results 'name' when a fresh file is written")
    ap.add_argument("--out", default=None, help="results JSON; appended to when it already holds 'runs'")
    ap.add_argument("--dry-run", action="store_true", help="print the config and shape; import no torch")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.rows % args.micro:
        ap.error(f"--rows {args.rows} is not a multiple of --micro {args.micro}")
    if not args.dry_run and not args.out:
        ap.error("--out is required (except with --dry-run)")

    ds_cfg = build_ds_config(args)
    shape = model_shape(args)
    tokens_per_step = args.rows * args.seq
    run = {"system": SYSTEM, "config": config_name(args), "model": shape, "seq_len": args.seq,
           "tokens_per_step": tokens_per_step, "steps_timed": args.steps, "warmup_steps": args.warmup,
           "micro_batch": args.micro, "gradient_accumulation": args.rows // args.micro,
           "optimizer": "DeepSpeedCPUAdam adamw_mode (lr 3e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1)",
           "clip_norm": ds_cfg.get("gradient_clipping"), "compute_dtype": "bfloat16",
           "activation_checkpointing": not args.no_checkpointing, "attention": "sdpa",
           "offload": offload_words(ds_cfg), "ds_overrides": list(args.ds_set),
           "gpu_resident_param_share": 0.0 if _offloads(ds_cfg, "offload_param") else 1.0,
           "run_id": f"{os.getpid()}-{time.time():.0f}",
           "command": " ".join(["PYTHONPATH=/tmp/site:. python experiments/compare_zero3.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "ds_config": ds_cfg}
    if args.dry_run:
        fpt = flops_per_token(shape["params"], shape["layers"], shape["hidden"], args.seq)
        print(json.dumps({"ds_config": ds_cfg, "model": shape, "config": run["config"],
                          "tokens_per_step": tokens_per_step, "gradient_accumulation": args.rows // args.micro,
                          "model_flops_per_token": fpt}, indent=1))
        return 0

    prepare_environment()
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = {"name": args.name or f"deepspeed_zero3_{run['config']}", "command": run["command"],
              "git_commit": commit or None, "device": host_info(), "date": datetime.date.today().isoformat()}
    slot: list = []
    run["status"] = EXITED_EARLY
    write_run(args.out, header, run, slot)
    checkpoint = lambda r: write_run(args.out, header, r, slot)  # noqa: E731

    torch_mod = None
    try:
        import torch as torch_mod
        if torch_mod.cuda.is_available():
            header["device"] = {"name": torch_mod.cuda.get_device_name(0), "platform": "gpu", **host_info()}
            run["device"] = header["device"]["name"]
        run_zero3(args, ds_cfg, run, checkpoint)
    except Exception as e:  # recorded, not hidden: the JSON says what failed
        record_failure(run, e, 500)
    finally:
        cuda = torch_mod is not None and torch_mod.cuda.is_available()
        run["gpu_peak_gib"] = round(torch_mod.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
        run["gpu_reserved_peak_gib"] = round(torch_mod.cuda.max_memory_reserved() / 2**30, 2) if cuda else None
        run["host_peak_gib"] = host_peak_gib()
        write_run(args.out, header, run, slot)
    print(f"{run['config']}: {run['status']} tokens/s {run.get('tokens_per_s')} TFLOP/s {run.get('model_tflops')} "
          f"step {run.get('step_time_s')} s gpu {run.get('gpu_peak_gib')} GiB host {run.get('host_peak_gib')} GiB",
          flush=True)
    try:  # leave NCCL/gloo cleanly so the process exits
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0  # the status is in the results file; a failed peer should not stop a chained command


if __name__ == "__main__":
    sys.exit(main())
