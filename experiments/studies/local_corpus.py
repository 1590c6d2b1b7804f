"""A real text corpus made on the machine itself (issue 35's 1B comparison): the Python sources and documents
installed with this Python (standard library and site-packages: code, docstrings, READMEs, licences), a
byte-level BPE tokenizer trained on it, and the token file ``megatrain_jax.data`` reads. Nothing is
downloaded; a GPU machine without internet makes it from its own image.

    PYTHONPATH=. python experiments/studies/local_corpus.py --out data/local/corpus.bin --max-mb 400

Files are taken in sorted path order (``*.py``, ``*.md``, ``*.rst``, ``*.txt``; each file one document,
exact duplicates dropped) until ``--max-mb``; the tokenizer (``--vocab`` tokens, the end-of-document token
``<|endoftext|>`` first) is trained on the first ``--train-mb`` of them and saved beside the token file as
``tokenizer.json``. ``<out>.corpus.json`` records what went in: the roots, file count, bytes, a hash of the
file list, the tokens written. The same image gives the same corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: megatrain_jax

from megatrain_jax.data.tokens import TokenWriter  # noqa: E402

SUFFIXES = (".py", ".md", ".rst", ".txt")
EOS = "<|endoftext|>"


def default_roots() -> list[Path]:
    """This Python's standard library and its site-packages (what is installed here)."""
    paths = sysconfig.get_paths()
    roots = {Path(paths["stdlib"]), Path(paths["purelib"]), Path(paths["platlib"])}
    return sorted(r for r in roots if r.is_dir())


def documents(roots: list[Path], max_bytes: int) -> Iterator[tuple[Path, str]]:
    """(path, text) of each file under ``roots`` with one of ``SUFFIXES``, in sorted path order, decoded as
    UTF-8 (files that are not are skipped), exact duplicates dropped, until ``max_bytes`` of text."""
    seen: set[bytes] = set()
    total = 0
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
            try:
                raw = path.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha1(raw).digest()
            if not text.strip() or digest in seen:
                continue
            seen.add(digest)
            yield path, text
            total += len(raw)
            if total >= max_bytes:
                return


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab`` tokens trained on ``texts``; EOS is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the token file to write (.bin); tokenizer.json goes beside it")
    ap.add_argument("--roots", default=None, help="os.pathsep-separated folders (default: this Python's "
                                                  "standard library and site-packages)")
    ap.add_argument("--max-mb", type=float, default=400.0, help="MB of text to take")
    ap.add_argument("--train-mb", type=float, default=64.0, help="MB of that text the tokenizer is trained on")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=256, help="documents encoded per call")
    args = ap.parse_args(argv)
    roots = [Path(r) for r in args.roots.split(os.pathsep)] if args.roots else default_roots()
    t0 = time.perf_counter()
    docs = list(documents(roots, int(args.max_mb * 1e6)))
    if not docs:
        raise SystemExit(f"no text files ({', '.join(SUFFIXES)}) under {', '.join(map(str, roots))}")
    listing = hashlib.sha256("\n".join(str(p) for p, _ in docs).encode()).hexdigest()
    train, size = [], 0
    for _, text in docs:
        if size >= args.train_mb * 1e6:
            break
        train.append(text)
        size += len(text.encode())
    tok = train_tokenizer(train, args.vocab)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out.parent / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    writer = TokenWriter(out, tok.get_vocab_size(), eos_id=eos, tokenizer=str(out.parent / "tokenizer.json"))
    tokens = 0
    for i in range(0, len(docs), args.batch):
        for enc in tok.encode_batch([text for _, text in docs[i:i + args.batch]]):
            writer.append(enc.ids + [eos])
            tokens += len(enc.ids) + 1
    writer.close()
    record = {"roots": [str(r) for r in roots], "files": len(docs), "bytes": sum(len(t.encode()) for _, t in docs),
              "file_list_sha256": listing, "tokenizer_trained_on_bytes": size, "vocab_size": tok.get_vocab_size(),
              "eos_id": eos, "tokens": tokens, "wall_s": round(time.perf_counter() - t0, 1),
              "first_files": [str(p) for p, _ in docs[:3]], "last_files": [str(p) for p, _ in docs[-3:]]}
    Path(str(out) + ".corpus.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k not in ("first_files", "last_files")}))


if __name__ == "__main__":
    main()
