"""Write a tiny random Llama-family Hugging Face folder, a chat JSONL and an SFT config for a first fine-tune
on a CPU (docs/fine_tuning.md, "A first fine-tune on a tiny model"). Nothing is downloaded.

    python scripts/make_tiny_hf.py runs/tiny_hf
    megatrain-jax train --config runs/tiny_hf/sft.toml

``OUT/model`` is what a downloaded checkpoint would be: ``config.json`` and ``model.safetensors`` (random
weights of the ``tiny`` preset's shape, written by the package's own export, ``megatrain_jax.hf.save_hf``),
``tokenizer.json`` (a byte-level BPE trained here on the chat data with the ``tokenizers`` library) and
``tokenizer_config.json`` (its special tokens and a ChatML chat template). ``OUT/chat.jsonl`` holds short
conversations with checkable answers (sums, reversed words), and ``OUT/sft.toml`` the run: packed chat rows,
a few dozen steps, the fine-tuned model exported to ``OUT/run/hf``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# ChatML, as Qwen's checkpoints carry it: each turn between <|im_start|>role and <|im_end|>.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "paper", "music", "silver", "forest"]


def conversations(n: int) -> list[dict]:
    """``n`` short conversations whose answers follow from the question, so the loss can fall."""
    out = []
    for i in range(n):
        a, b, w = (7 * i) % 50, (3 * i + 5) % 50, WORDS[i % len(WORDS)]
        question, answer = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
                            (f"Spell {w} backwards.", f"Backwards, {w} is {w[::-1]}."),
                            (f"How many letters are in {w}?", f"{w} has {len(w)} letters.")][i % 3]
        messages = [{"role": "system", "content": "You answer briefly."}] if i % 4 == 0 else []
        out.append({"messages": messages + [{"role": "user", "content": question},
                                            {"role": "assistant", "content": answer}]})
    return out


def write_tokenizer(folder: Path, texts: list[str], vocab: int) -> int:
    """``tokenizer.json`` (a byte-level BPE trained on ``texts``, at most ``vocab`` ids) and
    ``tokenizer_config.json`` (special tokens, the chat template) in ``folder``; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()


def sft_config(out: Path, steps: int) -> str:
    """The run config of a first fine-tune on the folder ``out`` holds."""
    return f"""# A first fine-tune on a CPU: the tiny random model and chat data of scripts/make_tiny_hf.py.
#   megatrain-jax train --config {out / 'sft.toml'}

[model]
hf_checkpoint = "{out / 'model'}"
dtype = "float32"

[data]
format = "chat"
path = "{out / 'chat.jsonl'}"
mode = "packed"           # several conversations per row, each attending to itself
seq_len = 128
batch_size = 4
eval_fraction = 0.05

[engine]
micro_batches = 1
clip_norm = 1.0

[optimizer]
lr = 3e-3
warmup_steps = 5
decay = "cosine"
weight_decay = 0.0

[train]
steps = {steps}
log_every = 10
eval_every = 20
run_dir = "{out / 'run'}"
export_hf = "{out / 'run' / 'hf'}"
"""


def make_tiny_hf(out: str | Path, examples: int = 300, vocab: int = 512, steps: int = 60, seed: int = 0) -> Path:
    """Write ``out/model`` (the HF folder), ``out/chat.jsonl`` and ``out/sft.toml``; returns ``out``."""
    from flax import nnx

    from megatrain_jax import Decoder, preset
    from megatrain_jax.hf import save_hf
    out = Path(out).resolve()
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    chats = conversations(examples)
    with open(out / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in chats)
    texts = [f"{m['role']} {m['content']}" for c in chats for m in c["messages"]]
    n_vocab = write_tokenizer(model_dir, texts, vocab)  # the export keeps the folder's files that are no model's
    cfg = preset("tiny", vocab_size=-(-n_vocab // 64) * 64, bos_token_id=None,
                 eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"))
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    save_hf(model_dir, cfg, nnx.state(model.io, nnx.Param), [nnx.state(b, nnx.Param) for b in model.blocks],
            dtype="float32", overwrite=True)
    (out / "sft.toml").write_text(sft_config(out, steps))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder to write: OUT/model, OUT/chat.jsonl, OUT/sft.toml")
    ap.add_argument("--examples", type=int, default=300, help="conversations in chat.jsonl (default 300)")
    ap.add_argument("--vocab", type=int, default=512, help="the tokenizer's largest vocabulary (default 512)")
    ap.add_argument("--steps", type=int, default=60, help="train.steps of sft.toml (default 60)")
    args = ap.parse_args(argv)
    out = make_tiny_hf(args.out, args.examples, args.vocab, args.steps)
    print(f"wrote {out / 'model'} (a tiny random Llama with a tokenizer and a chat template), "
          f"{out / 'chat.jsonl'} and {out / 'sft.toml'}\nnext: megatrain-jax train --config {out / 'sft.toml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
