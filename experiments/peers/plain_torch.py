"""Plain GPU training in PyTorch, the second bar where the model fits (issue 51: "an all-GPU JAX/optax step, and
torch with fused AdamW: goal >= 0.95x of the better"): the whole model, its float32 masters, gradients and AdamW
moments in GPU memory, on the workload of experiments/bench.py; one run per setting, each in a process of its own,
appended to the results file that bench.py and plain_gpu.py write.

    PYTHONPATH=. python experiments/peers/plain_torch.py --layers 16 --rows 4 --out $OUT/fits.json
    # with Liger's kernels (its wheel from .whl/slideformer, installed alone: the image's transformers stays):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site_liger .whl/slideformer/liger_kernel-*.whl
    PYTHONPATH=. python experiments/peers/plain_torch.py --layers 16 --rows 4 --liger-site /tmp/site_liger \
        --out $OUT/fits.json

The model is compare_zero3.py's: an HF ``LlamaForCausalLM`` of the 7B layer shape (hidden 4096, ffn 11008, 32
heads, vocab 32000, untied embeddings), ``--layers`` of them, ``sdpa`` attention (flash-attn is not on the GPU
image), random weights built on the GPU in float32: the masters. Each step runs under ``torch.autocast`` in
bfloat16, clips the global norm to 1.0 (``clip_grad_norm_``, exact) and steps ``torch.optim.AdamW(fused=True)``
(lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1): the optimizer of bench.py. The data are bench.py's
windows (``compare_zero3.window_batches``); the loss is HF's causal loss with ``labels = input_ids`` (2,047
targets a row where bench.py has 2,048; speeds count 2,048 tokens a row, as for every system here).

Settings (``--settings``, each tried, the fastest is the peer "at its best settings"):
- ``eager``: no activation checkpointing (the model fits with its activations at 8K tokens);
- ``checkpointed``: every decoder layer checkpointed (``gradient_checkpointing_enable``, non-reentrant);
- ``compiled``: ``torch.compile`` of the model, no checkpointing;
- ``liger``: Liger's fused kernels patched into the model (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy),
  no checkpointing; where liger-kernel does not import (or does not patch this transformers), the run says so.
Each run records where the model lives (every parameter on the GPU, no PCIe traffic a step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import compare_zero3 as cz  # noqa: E402  (stdlib-only at import: shapes, FLOPs, data, results file)
from child import run_child  # noqa: E402  (stdlib-only at import)

SYSTEM = "plain_torch_gpu"
SETTINGS = ("eager", "checkpointed", "compiled", "liger")
SHAPE = dict(hidden=4096, ffn=11008, heads=32, vocab=32000, seq=2048)  # compare_zero3's 7B layer (kv heads = heads)


def run_setting(args, setting: str) -> dict:
    """One setting's run (``warmup`` + ``steps`` steps), as a results entry."""
    shape = cz.model_shape(args)
    tokens_per_step = args.rows * args.seq
    run = {"system": SYSTEM, "config": cz.config_name(args), "settings": setting, "model": shape,
           "seq_len": args.seq, "tokens_per_step": tokens_per_step,
           "optimizer": "torch.optim.AdamW(fused=True, lr 3e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1), "
                        "clip_grad_norm_ 1.0, on the GPU",
           "compute_dtype": "bfloat16 (torch.autocast)", "master_dtype": "float32",
           "where_the_model_lives": {"gpu_resident_param_share": 1.0, "pcie_bytes_per_step": 0,
                                     "note": "masters, gradients and AdamW moments all in GPU memory"},
           "host": cz.host_info()}
    try:
        import torch
        import transformers
        run["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda}
        run["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        if setting == "liger":
            if args.liger_site:
                sys.path.insert(0, args.liger_site)
            from importlib import metadata

            from liger_kernel.transformers import apply_liger_kernel_to_llama
            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
            run["versions"]["liger_kernel"] = metadata.version("liger-kernel")
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq, tie_word_embeddings=False, rms_norm_eps=1e-5,
            attn_implementation="sdpa", use_cache=False)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with device:
            model = transformers.LlamaForCausalLM(config)  # float32: the masters
        model.train()
        if setting == "checkpointed":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forward = torch.compile(model) if setting == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                fused=device.type == "cuda")
        run["init_s"] = round(time.perf_counter() - t0, 2)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        losses, norms, times = [], [], []
        # bench.py's corpus and batches: window_batches draws its corpus from the step count it is given, which
        # for the same batches as bench.py's is one more than the steps run (compare_zero3.py's docstring)
        windows = cz.window_batches(args.warmup + args.steps + 1, args.rows, args.seq, args.vocab)
        for window in itertools.islice(windows, args.warmup + args.steps):
            ids = torch.from_numpy(window[:, :args.seq]).to(device, non_blocking=True)
            sync()
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
            norms.append(float(norm))
        step = statistics.median(times[args.warmup:])
        fpt = cz.flops_per_token(shape["params"], args.layers, args.hidden, args.seq)
        run.update(step_time_s=round(step, 4), tokens_per_s=round(tokens_per_step / step, 1),
                   model_tflops=round(tokens_per_step / step * fpt / 1e12, 1), steps_timed=args.steps,
                   step_times=[round(x, 4) for x in times], losses=[round(x, 4) for x in losses],
                   grad_norms=[round(x, 4) for x in norms], host_peak_gib=cz.host_peak_gib(), status="ok",
                   gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
                   loss_finite_and_decreasing=all(map(math.isfinite, losses)) and losses[-1] < losses[0])
    except Exception as e:  # recorded, not hidden (a setting out of GPU memory, or Liger absent, is a result)
        run.update(status=f"error: {type(e).__name__}: {str(e)[:400]}",
                   traceback=traceback.format_exc().strip().splitlines()[-6:])
    return run


def run_in_child(args, setting: str) -> dict:
    """``run_setting`` in a process of its own (its GPU peak its own; a setting that kills its process, or outlives
    ``--timeout``, is recorded as such: ``child.run_child``)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", setting, "--layers", str(args.layers), "--rows",
           str(args.rows), "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", "-",
           *(f"--{k}={getattr(args, k)}" for k in SHAPE)]
    if args.liger_site:
        cmd += ["--liger-site", args.liger_site]
    if args.config:
        cmd += ["--config", args.config]
    return run_child(cmd, args.timeout, system=SYSTEM, config=cz.config_name(args), settings=setting)

def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    for k, v in SHAPE.items():  # the 7B layer's shape unless given (smaller ones: a smoke test of this file)
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--rows", type=int, default=4, help="sequences a step (4: bench.py's 3p5b_8k)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {SETTINGS}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--liger-site", default=None, help="a folder holding liger-kernel (pip --target), for 'liger'")
    ap.add_argument("--config", default=None, help="the config label (default: bench.py's name of the shape)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per setting")
    ap.add_argument("--out", required=True, help="results file (runs appended where it exists); '-': print only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.kv_heads = args.heads
    if args.child is not None:
        run = run_setting(args, args.child)
        print(json.dumps(run), flush=True)
        return [run]
    unknown = sorted(set(args.settings.split(",")) - set(SETTINGS))
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    header = {"name": os.path.splitext(os.path.basename(args.out))[0], "command": "PYTHONPATH=. python "
              "experiments/peers/plain_torch.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "git_commit": os.environ.get("MEGATRAIN_GIT_COMMIT"), "date": time.strftime("%Y-%m-%d")}
    runs = []
    for setting in args.settings.split(","):
        run = run_in_child(args, setting)
        run["command"] = header["command"]
        if run.get("device") and "device" not in header:  # from the first run that reached its device
            header["device"] = {"name": run["device"], "platform": "cpu" if run["device"] == "cpu" else "gpu",
                                **cz.host_info()}
        runs.append(run)
        print(json.dumps({k: run.get(k) for k in ("settings", "status", "tokens_per_s", "model_tflops",
                                                  "gpu_peak_gib")}), flush=True)
        if args.out != "-":
            cz.write_run(args.out, header, run, [])
    return runs


if __name__ == "__main__":
    main()
