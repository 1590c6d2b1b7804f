"""Tokenize a local text corpus into a megatrain_jax token file (``.bin`` + ``.bin.json`` + ``.bin.idx.npy``).

Inputs, by extension:
- ``.jsonl`` or ``.json`` (JSON lines, as ``datasets``' ``to_json`` writes them): one JSON object per line; the
  document is the string under ``--text-field`` (default "text"); blank lines are skipped;
- anything else is plain text: documents are separated by one or more blank lines (a file with no blank
  line is a single document). Lines inside a document keep their newlines.

Inputs are UTF-8 (a leading byte-order mark is dropped). A bad input (a line that is not JSON or not UTF-8, a
record without the text field, inputs that hold no document) stops the run with the file and line, and the
output is only replaced once every input is read: a token file already at ``--out`` is kept until then.

Each document is encoded with a local Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; nothing
is ever fetched from a hub) and followed by the end-of-document token when there is one: ``--eos`` names it,
otherwise it comes from ``tokenizer_config.json`` next to the tokenizer, otherwise from common names such
as ``</s>`` or ``<|endoftext|>``; ``--no-eos`` turns it off.

Examples:
    python scripts/prepare_data.py --tokenizer llama/tokenizer.json --out data/train.bin corpus.jsonl
    python scripts/prepare_data.py --demo --out data/demo.bin            # synthetic corpus, no tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatrain_jax.data import chat_lines, demo_tokens, write_tokens  # noqa: E402
from megatrain_jax.data.demo import EOS_ID  # noqa: E402
from megatrain_jax.data.tokens import TokenWriter, index_path, sidecar_path  # noqa: E402

COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def load_tokenizer(path: Path):
    """A ``tokenizers.Tokenizer`` from a local file, with a clear error if the library is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise SystemExit("prepare_data.py needs the `tokenizers` package: pip install 'megatrain-jax[tokenizers]' "
                         "(or pip install tokenizers)") from e
    if not path.is_file():
        raise SystemExit(f"tokenizer file {path} not found; pass the tokenizer.json of the model you will train")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library's own error names no file
        raise SystemExit(f"{path} is not a tokenizer file the tokenizers library can read ({e}); pass the "
                         f"tokenizer.json of the model you will train") from None


def find_eos(tokenizer, tokenizer_path: Path, name: str | None) -> int | None:
    """The id of the end-of-document token: ``name``, else tokenizer_config.json's eos_token, else a common one."""
    if name is not None:
        eos = tokenizer.token_to_id(name)
        if eos is None:
            raise SystemExit(f"--eos {name!r} is not a token of {tokenizer_path}")
        return eos
    config = tokenizer_path.with_name("tokenizer_config.json")
    if config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return next((tokenizer.token_to_id(t) for t in COMMON_EOS if tokenizer.token_to_id(t) is not None), None)


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a UTF-8 plain-text file with their numbers (from 1), blank ones too (they part documents),
    newlines as ``\\n`` whatever the file's, a leading byte-order mark dropped; SystemExit naming the line for bytes
    that are not UTF-8 (read as lone surrogates, so that the error can say where they are)."""
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                raise SystemExit(f"{path}:{n} is not UTF-8 text (byte {ord(line[e.start]) - 0xDC00:#04x} at "
                                 f"column {e.start + 1}); save the file as UTF-8") from None
            yield n, line


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents of one input file (JSON lines records, or blank-line-separated plain-text paragraphs)."""
    if path.suffix.lower() in (".jsonl", ".json"):  # read as chat data's lines are (chat_lines: UTF-8, BOM, objects)
        try:
            for n, line in chat_lines.read_lines(path):
                record = chat_lines.json_object(line, f"{path}:{n}")
                if not isinstance(record.get(text_field), str):
                    raise SystemExit(f"{path}:{n}: expected a JSON object with a string field {text_field!r} (found "
                                     f"keys {sorted(record)}); set --text-field")
                yield record[text_field]
        except chat_lines.InstructDataError as e:
            raise SystemExit(str(e)) from None
        return
    lines: list[str] = []
    for _, line in text_lines(path):
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).rstrip("\n")
            lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def check_paths(inputs: list[Path], out: Path) -> None:
    """SystemExit, before anything is read or written, for an input that is missing or a folder, or that the output
    (the token file, its sidecar or its index) would overwrite."""
    if out.is_dir():
        raise SystemExit(f"--out {out} is a folder: give the token file to write, e.g. {out / 'train.bin'}")
    written = {p.resolve() for p in (out, sidecar_path(out), index_path(out))}
    for path in inputs:
        if not path.exists():
            raise SystemExit(f"input file {path} not found")
        if not path.is_file():
            raise SystemExit(f"input {path} is a folder, not a file: give the .jsonl or text files in it")
        if path.resolve() in written:
            raise SystemExit(f"input {path} is what --out {out} would write over: give the token file a name of "
                             f"its own, e.g. --out {path.with_suffix('.tokens.bin')}")


def chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", type=Path, help=".jsonl (.json) or plain-text files to tokenize, in order")
    p.add_argument("--out", type=Path, required=True, help="output token file, e.g. data/train.bin")
    p.add_argument("--tokenizer", type=Path,
                   help="local tokenizer.json (Hugging Face tokenizers format), or the model's folder holding it")
    p.add_argument("--text-field", default="text", help="jsonl field holding the document text (default: text)")
    p.add_argument("--eos", help="token appended after every document (default: detected from the tokenizer)")
    p.add_argument("--no-eos", action="store_true", help="append no end-of-document token")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="skip the tokenizer's post-processor specials (e.g. a BOS token) when encoding")
    p.add_argument("--vocab-size", type=int,
                   help="vocab_size recorded in the sidecar (default: the tokenizer's, added tokens included); "
                        "set the model's when its embedding table is padded larger")
    p.add_argument("--batch-docs", type=int, default=1000, help="documents encoded per tokenizer call")
    p.add_argument("--demo", action="store_true", help="write the synthetic demo corpus instead (no inputs)")
    p.add_argument("--demo-tokens", type=int, default=1 << 20, help="tokens in the demo corpus")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo corpus")
    args = p.parse_args(argv)
    if args.demo == bool(args.inputs) or (not args.demo and args.tokenizer is None):
        p.error("give input files and --tokenizer, or --demo")
    if args.batch_docs < 1:
        p.error(f"--batch-docs must be at least 1 (documents encoded per tokenizer call), got {args.batch_docs}")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.demo:
        vocab = args.vocab_size or 256
        tokens, starts = demo_tokens(vocab, args.demo_tokens, args.seed)
        out = write_tokens(args.out, tokens, vocab, starts, eos_id=EOS_ID)
        print(f"wrote {len(tokens)} demo tokens in {len(starts)} documents to {out}")
        return out
    check_paths(args.inputs, args.out)
    if args.tokenizer.is_dir():  # the model's folder: the tokenizer.json in it
        args.tokenizer = args.tokenizer / "tokenizer.json"
    tokenizer = load_tokenizer(args.tokenizer)
    eos = None if args.no_eos else find_eos(tokenizer, args.tokenizer, args.eos)
    own = tokenizer.get_vocab_size(with_added_tokens=True)
    if args.vocab_size is not None and args.vocab_size < own:
        raise SystemExit(f"--vocab-size {args.vocab_size} is smaller than the {own} tokens of {args.tokenizer} "
                         f"(added tokens included), so its ids would not fit: --vocab-size is for a model whose "
                         f"embedding table is padded larger; leave it out, or tokenize with the model's own tokenizer")
    vocab = args.vocab_size or own
    with TokenWriter(args.out, vocab, eos_id=eos, tokenizer=str(args.tokenizer)) as writer:
        for path in args.inputs:
            for batch in chunks(read_documents(path, args.text_field), args.batch_docs):
                for enc in tokenizer.encode_batch(batch, add_special_tokens=not args.no_special_tokens):
                    ids = list(enc.ids)
                    if ids:
                        writer.append(ids + ([eos] if eos is not None else []))
        if not writer.num_tokens:  # nothing to train on: the writer is abandoned, a file already at --out kept
            raise SystemExit(f"{', '.join(map(str, args.inputs))}: no document (the input is empty, or blank, or its "
                             f"texts are empty); {args.out} was not written")
    print(f"wrote {writer.num_tokens} tokens in {len(writer.doc_starts)} documents to {args.out} "
          f"(vocab_size {vocab}, eos {'none' if eos is None else eos})")
    return Path(args.out)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # a refusal of the input: said in one line, with argparse's exit status for bad input
        if not isinstance(e.code, str):
            raise
        print(f"prepare_data.py: error: {e.code}", file=sys.stderr)
        raise SystemExit(2) from None
