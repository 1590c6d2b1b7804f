"""Supervised fine-tuning of a Hugging Face checkpoint on generated instruction data, timed (issue 17).

    PYTHONPATH=. python experiments/studies/sft_run.py --work /tmp/sft --out $OUT/h100_sft_7b.json

1. Makes a 7B-shaped Llama checkpoint (``--preset``, random weights, bfloat16 safetensors) and a tokenizer
   (a BPE trained on the generated data, with a ChatML chat template), in ``--work``; and ``--examples``
   generated conversations (arithmetic and word questions with their answers) as JSONL. Each in a child
   process, so that their memory is gone before training.
2. Loads: the engine's state is read from the safetensors part by part (``HFParts``), the page cache
   dropped first where allowed (root), in a process of its own with the compilation cache cold
   (``load.hf_load_s``), then again in the training process, warm (``hf_load_s``): the time to the state
   in host memory.
3. Trains: ``--steps`` steps on the conversations (packed, loss on the
   answers), timed as bench.py times steps.
4. Exports the trained weights with the tokenizer (``export_s``), then compares logits on a few prompts:
   the exported folder loaded in transformers on the GPU against our model loaded from the same folder,
   both in float32 (max abs difference). ``--no-compare`` skips it (no transformers or torch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # child.py, bench.py
sys.path.insert(0, EXPERIMENTS)
sys.path.insert(0, os.path.dirname(EXPERIMENTS))  # the repository root: megatrain_jax

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "engine", "paper"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` short conversations with checkable answers: sums, products, reversed and counted words."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = int(rng.integers(0, 1000)), int(rng.integers(0, 1000))
        w = WORDS[int(rng.integers(len(WORDS)))]
        kind = i % 4
        q, ans = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
                  (f"What is {a % 50} times {b % 50}?", f"{a % 50} times {b % 50} is {(a % 50) * (b % 50)}."),
                  (f"Spell the word {w} backwards.", f"Backwards, {w} is {w[::-1]}."),
                  (f"How many letters are in {w}?", f"The word {w} has {len(w)} letters.")][kind]
        messages = [{"role": "system", "content": "You answer briefly."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        out.append({"messages": messages})
    return out


def make_data(work: Path, examples: int, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    data = conversations(examples)
    with open(work / "chat.jsonl", "w") as f:
        for ex in data:
            f.write(json.dumps(ex) + "\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 4096),
                                  special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "</s>"])
    tok.train_from_iterator((m["content"] for ex in data for m in ex["messages"]), trainer)
    ckpt = work / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": CHATML}))


def make_checkpoint(work: Path, preset_name: str) -> dict:
    """Random bfloat16 weights of ``preset_name``'s shape, as an HF folder."""
    import ml_dtypes

    from megatrain_jax import preset
    from megatrain_jax.hf import save_hf
    from megatrain_jax.hf.mapping import block_specs, io_specs
    cfg = preset(preset_name)
    rng = np.random.default_rng(0)

    def tree(specs):
        out: dict = {}
        for s in specs:
            node = out
            for k in s.path[:-1]:
                node = node.setdefault(k, {})
            if len(s.our_shape) > 1:  # random sign and mantissa, magnitudes in [1/64, 1/32): fast to make
                bits = rng.integers(0, 2**16, s.our_shape, dtype=np.uint16) & np.uint16(0x807F) | np.uint16(0x3C80)
                node[s.path[-1]] = bits.view(ml_dtypes.bfloat16)
            else:
                node[s.path[-1]] = np.ones(s.our_shape, ml_dtypes.bfloat16)  # norm scales at 1
        return out

    t = time.perf_counter()
    ckpt = work / "checkpoint"  # the data stage put the tokenizer there: save_hf keeps only what it is given
    tokenizer = [ckpt / n for n in ("tokenizer.json", "tokenizer_config.json") if (ckpt / n).exists()]
    save_hf(ckpt, cfg, tree(io_specs(cfg)), [tree(block_specs(cfg, i)) for i in range(cfg.layers)],
            overwrite=True, extra_files=tokenizer)
    return {"make_checkpoint_s": round(time.perf_counter() - t, 1), "params": cfg.param_count()}


def load(work: Path, args):
    """The engine with its state read from the checkpoint (``HFParts``), and the seconds that took."""
    import jax
    from flax import nnx

    from megatrain_jax import Decoder, Engine, EngineConfig
    from megatrain_jax.cli.run_config import OptimizerConfig
    from megatrain_jax.hf import HFParts, read_config
    from megatrain_jax.plan import fit_host_pool
    from child import drop_page_cache

    ckpt = work / "checkpoint"
    cfg = read_config(ckpt, dtype="bfloat16")
    engine_cfg = EngineConfig(micro_batches=args.micro, resident_layers=args.resident, resident_io=args.resident > 0)
    fit_host_pool(cfg, engine_cfg, args.rows, args.seq_len)
    optimizer, _ = OptimizerConfig(lr=args.lr, warmup_steps=2, decay="constant").build(args.steps)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    cache_dropped = drop_page_cache()
    t = time.perf_counter()
    engine = Engine(abstract, optimizer, engine_cfg, init_from=HFParts(ckpt, cfg))
    jax.block_until_ready(engine.state)
    return engine, cfg, engine_cfg, {"hf_load_s": round(time.perf_counter() - t, 2),
                                     "page_cache_dropped_before_load": cache_dropped}


def first_load(work: Path, args) -> dict:
    """A load in a process of its own, before the training run's: the compilation cache is cold here (the
    programs that build the state are compiled), warm in the training run."""
    _, _, _, timing = load(work, args)
    return {**timing, "note": "the first load on this machine: the state builder's programs compiled, not cached"}


def train(work: Path, args) -> dict:
    from bench import device_info, gpu_peak_gib, host_peak_gib
    from megatrain_jax.data import DataConfig
    from megatrain_jax.flops import model_flops_per_token
    from megatrain_jax.hf import save_hf

    ckpt = work / "checkpoint"
    engine, cfg, engine_cfg, timing = load(work, args)
    load_s = timing["hf_load_s"]
    data = DataConfig(path=str(work / "chat.jsonl"), format="chat", tokenizer=str(ckpt), seq_len=args.seq_len,
                      batch_size=args.rows, mode="packed", prefetch=2, cache_dir=str(work / "cache"),
                      eval_fraction=0.02)
    t = time.perf_counter()
    stream = data.build(cfg.vocab_size, max_pieces=cfg.segments_per_row(args.seq_len) - 1)
    tokenize_s = time.perf_counter() - t
    records = [m for m in engine.steps(next(stream) for _ in range(args.steps))]
    timed = records[2:]
    step = float(np.median([r["step_time_s"] for r in timed]))
    tokens = args.rows * args.seq_len
    fpt = model_flops_per_token(cfg.active_param_count(), cfg.layers, cfg.hidden, args.seq_len)
    engine.sync()
    export = work / "export"
    t = time.perf_counter()
    save_hf(export, cfg, *engine.parameters(), overwrite=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (export / name).write_bytes((ckpt / name).read_bytes())
    export_s = time.perf_counter() - t
    losses = [round(r["loss"], 4) for r in records]
    return {"device": device_info(), "params": cfg.param_count(), "engine": engine_cfg.__dict__,
            "seq_len": args.seq_len, "tokens_per_step": tokens, "steps": args.steps, "tokenize_s": round(tokenize_s, 2),
            "hf_load_s": load_s, "hf_load_note": "compilation cache warm (the 'load' stage ran first)",
            "page_cache_dropped_before_load": timing["page_cache_dropped_before_load"], "export_s": round(export_s, 2), "step_time_s": round(step, 4),
            "tokens_per_s": round(tokens / step, 1), "model_tflops": round(tokens / step * fpt / 1e12, 1),
            "steps_timed": len(timed), "loss_first": losses[0], "loss_last": losses[-1],
            "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                      "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count()},
            "losses": losses, "loss_finite_and_falling": bool(np.all(np.isfinite(losses)) and
                                                               np.mean(losses[-3:]) < np.mean(losses[:3])),
            "gpu_peak_gib": gpu_peak_gib(), "host_peak_gib": host_peak_gib(),
            "loss_tokens_fraction": "loss on assistant tokens only (megatrain_jax.data.instruct)"}


def compare(work: Path) -> dict:
    """Logits of the exported folder in transformers (GPU, float32) against ours loaded from it."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from megatrain_jax import Decoder
    from megatrain_jax.data.instruct import ChatTokenizer
    from megatrain_jax.hf import HFParts, read_config
    export = work / "export"
    tok = ChatTokenizer.from_folder(export)
    prompts = [tok.render(ex["messages"][:-1], add_generation_prompt=True) for ex in conversations(4, seed=1)]
    ids = [tok.tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    # transformers first, then its GPU memory handed back: JAX takes most of the GPU when it starts
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        theirs = [hf(torch.tensor([x]).cuda()).logits[0].float().cpu().numpy() for x in ids]
    del hf
    torch.cuda.empty_cache()
    cfg = read_config(export, dtype="float32")
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    # the weights on the GPU once (not constants of the program), transposed and widened there
    parts = HFParts(export, cfg)
    arrange = jax.jit(parts.to_params)
    for module, stored in [(model.io, parts.io())] + [(b, parts.block(i)) for i, b in enumerate(model.blocks)]:
        state = nnx.state(module, nnx.Param)
        nnx.replace_by_pure_dict(state, arrange(stored))
        nnx.update(module, state)
    graphdef, params = nnx.split(model, nnx.Param)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, jnp.arange(x.shape[1])[None], None))
    ours = [np.asarray(forward(params, jnp.asarray([x])))[0] for x in ids]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs)]
    return {"prompts": len(ids), "max_abs_logit_diff": max(diffs), "per_prompt": diffs,
            "logit_scale": float(max(np.max(np.abs(b)) for b in theirs)), "transformers": transformers.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="folder for the checkpoint, data, cache and export")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--examples", type=int, default=2400)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--resident", type=int, default=14,
                    help="GPU-resident blocks (and io when > 0); 14 at 7B as bench.py's 7b_32k, which needs "
                         "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--stage", choices=["data", "checkpoint", "load", "train", "compare"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.stage:  # one stage in this process; its result on the last line
        from megatrain_jax import preset
        result = {"data": lambda: make_data(work, args.examples, preset(args.preset).vocab_size) or {},
                  "checkpoint": lambda: make_checkpoint(work, args.preset), "load": lambda: first_load(work, args),
                  "train": lambda: train(work, args),
                  "compare": lambda: compare(work)}[args.stage]()
        print(json.dumps(result))
        return
    if not args.out:
        ap.error("--out is required")
    from child import git_commit, run_child
    result = {"name": Path(args.out).stem, "command": "PYTHONPATH=. python experiments/studies/sft_run.py " + " ".join(sys.argv[1:]),
              "git_commit": git_commit(), "date": datetime.date.today().isoformat(), "device": None, "runs": []}
    run = {"system": "megatrain_jax", "task": "SFT of an HF checkpoint on chat JSONL", "preset": args.preset,
           "examples": args.examples, "master_dtype": "float32", "status": "ok"}
    stages = ["data", "checkpoint", "load", "train"] + ([] if args.no_compare else ["compare"])
    for stage in stages:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--stage", stage]
        out = run_child(cmd)
        print(f"{stage}: {out}", flush=True)
        if stage == "train" and "device" in out:
            result["device"] = out.pop("device")
        if stage == "train":  # the timed steps' fields at the run's top level, as in every results file
            run.update(out)
        else:
            run[stage] = out
        failed = str(out.get("status", "")).startswith("error")
        if failed:
            run["status"] = f"error in stage {stage}: {out['status']}"
        result["runs"] = [run]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if failed:
            break

if __name__ == "__main__":
    main()
