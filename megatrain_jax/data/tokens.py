"""Token files on disk: a flat stream of token ids, memory-mapped, plus optional document boundaries.

Two formats are read, neither ever loaded whole into RAM:

- ``name.bin``: raw little-endian ``uint16`` or ``uint32`` tokens, described by a JSON sidecar
  ``name.bin.json``::

      {"dtype": "uint16", "vocab_size": 32000, "num_tokens": 123456,
       "num_docs": 512,          # optional: document boundaries are in name.bin.idx.npy
       "eos_id": 2,              # optional: the id appended after each document, if any
       "tokenizer": "...",       # optional: free-form provenance
       "loss": true}             # optional: per-token loss flags are in name.bin.loss

  Unknown keys are an error, so a typo cannot silently drop a setting.
- ``name.npy``: a 1-D integer array (``np.load(mmap_mode='r')``); no sidecar needed.

Per-token loss flags, when present (instruction data: 1 where a token is one the model learns to
predict), live in ``<path>.loss``: raw ``uint8``, one byte per token.

Document boundaries, when present, live in a companion ``<path>.idx.npy``: the int64 start offset of
every document (first 0, strictly increasing). A separate memory-mapped file scales to billions of
documents, which a JSON list would not. ``TokenWriter`` / ``write_tokens`` produce all of this.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian on disk
REQUIRED_KEYS = {"dtype", "vocab_size", "num_tokens"}
OPTIONAL_KEYS = {"num_docs", "eos_id", "tokenizer", "loss"}
NPY_MAGIC = b"\x93NUMPY"
_INT32_LIMIT = 1 << 31  # batches hold int32 token ids
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a memory-mapped file
HOW_TO_CREATE = ("create it with `python scripts/prepare_data.py --tokenizer tokenizer.json --out {path} "
                 "corpus.jsonl` (or `--demo` for the synthetic demo corpus), or "
                 "megatrain_jax.data.write_tokens(path, tokens, vocab_size)")


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def index_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.idx.npy")


def loss_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.loss")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest on-disk dtype whose range holds every id in [0, vocab_size)."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A validated, read-only token stream: ``tokens`` is 1-D (a memmap for files on disk).

    ``vocab_size`` is the tokenizer's vocabulary (``None`` for a bare ``.npy`` until scanned by
    ``check_vocab``). ``doc_starts`` holds document start offsets or is ``None``. ``loss``, when given, has
    one flag per token: whether predicting that token counts in the loss (instruction data).
    """

    path: Path | None
    tokens: np.ndarray
    vocab_size: int | None = None
    doc_starts: np.ndarray | None = None
    eos_id: int | None = None
    loss: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TokenFile":
        """Memory-map ``path`` (``.bin`` with sidecar, or ``.npy``); raise with what to fix if it is bad."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"token file {path} does not exist; " + HOW_TO_CREATE.format(path=path))
        if path.is_dir():  # a folder of prepared data: which of its files is meant cannot be told
            inside = sorted(str(p) for p in path.iterdir() if p.is_file() and (
                sidecar_path(p).exists() or (p.suffix == ".npy" and not p.name.endswith(".idx.npy"))))
            raise ValueError(f"{path} is a folder, not a token file: give the token file itself (a .bin with its "
                             f".bin.json sidecar, or a .npy)" + (f"; the folder holds {', '.join(inside[:5])}"
                                                                 + (", ..." if len(inside) > 5 else "") if inside else
                                                                 "; the folder holds none: " +
                                                                 HOW_TO_CREATE.format(path=path / "train.bin")))
        if path.suffix == ".npz":  # a zip of arrays: which one holds the tokens cannot be told
            raise ValueError(f"{path} is a .npz archive, not a token file: token files are a .npy holding one 1-D "
                             f"integer array (np.save(path, tokens)) or a .bin with its JSON sidecar; "
                             + HOW_TO_CREATE.format(path=path.with_suffix(".bin")))
        if path.suffix == ".npy":
            tokens = _load_npy(path, "re-create it with np.save(path, tokens) from a 1-D integer array, or "
                               + HOW_TO_CREATE.format(path=path))
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ValueError(f"{path} must hold a 1-D integer array of token ids, got shape "
                                 f"{tokens.shape} dtype {tokens.dtype}")
            meta: dict = {}
        else:
            meta = _read_sidecar(path)
            itemsize = DTYPES[meta["dtype"]].itemsize
            expected, actual = meta["num_tokens"] * itemsize, path.stat().st_size
            if actual != expected:
                raise ValueError(f"{path} is {actual} bytes but its sidecar says {meta['num_tokens']} "
                                 f"{meta['dtype']} tokens = {expected} bytes; the file is truncated or the "
                                 f"sidecar is stale: re-run scripts/prepare_data.py")
            tokens = (np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r") if expected
                      else np.zeros(0, DTYPES[meta["dtype"]]))
        doc_starts = _read_index(path, len(tokens), meta.get("num_docs"))
        loss = None
        if meta.get("loss"):
            lp = loss_path(path)
            if not lp.exists() or lp.stat().st_size != len(tokens):
                raise ValueError(f"sidecar of {path} says it has loss flags, but {lp} is "
                                 f"{'missing' if not lp.exists() else f'{lp.stat().st_size} bytes, not {len(tokens)}'}"
                                 f"; re-create the file")
            loss = np.memmap(lp, dtype=np.uint8, mode="r") if len(tokens) else np.zeros(0, np.uint8)
        return cls(path, tokens, meta.get("vocab_size"), doc_starts, meta.get("eos_id"), loss)

    @classmethod
    def from_array(cls, tokens: np.ndarray, vocab_size: int | None = None,
                   doc_starts: Iterable[int] | None = None, eos_id: int | None = None) -> "TokenFile":
        """An in-memory token stream (demo data, tests) with the same checks as a file."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        starts = None if doc_starts is None else np.asarray(list(doc_starts) if not isinstance(
            doc_starts, np.ndarray) else doc_starts, np.int64)
        if starts is not None:
            _check_starts(starts, len(tokens), "doc_starts")
        return cls(None, tokens, vocab_size, starts, eos_id)

    def first_bad_id(self, vocab_size: int | None, lo: int = 0, hi: int | None = None) -> tuple[int, int] | None:
        """``(position, id)`` of the first token in ``[lo, hi)`` outside ``[0, vocab_size)`` (outside the
        int32 range of a batch when ``vocab_size`` is None), or None. Scans in chunks, each one min and one max
        (the chunk is searched only when they fall outside): a memory-mapped file is never loaded whole."""
        limit = _INT32_LIMIT if vocab_size is None else min(vocab_size, _INT32_LIMIT)
        hi = len(self) if hi is None else hi
        signed = not np.issubdtype(self.tokens.dtype, np.unsignedinteger)
        for start in range(lo, hi, _SCAN_CHUNK):
            chunk = self.tokens[start:min(hi, start + _SCAN_CHUNK)]
            if chunk.max() < limit and not (signed and chunk.min() < 0):
                continue
            at = int(np.argmax((chunk < 0) | (chunk >= limit)))
            return start + at, int(chunk[at])
        return None

    def bad_id_error(self, position: int, token: int, vocab_size: int | None, why: str) -> ValueError:
        """The error for ``token`` at ``position``, outside ``[0, vocab_size)`` for the reason ``why``."""
        where = f"{self.path or 'in-memory tokens'}: token id {token} at position {position} (counted from 0)"
        if token < 0:
            return ValueError(f"{where} is negative; the file is corrupt or was written from the wrong array: "
                              f"re-create it")
        if vocab_size is None:
            vocab_size, why = _INT32_LIMIT, "a batch holds int32 token ids"
        if self.path is not None and vocab_size == self.vocab_size:  # the file disagrees with its own sidecar
            fix = (f"the file is corrupt or its sidecar {sidecar_path(self.path)} is stale: re-create both with "
                   f"scripts/prepare_data.py (or write_tokens) and the tokenizer that made the ids")
        else:
            fix = ("tokenize with the model's own tokenizer, pick a model with a larger vocab_size, or re-create "
                   "the file if it is corrupt")
        return ValueError(f"{where} is outside [0, {vocab_size}) ({why}); {fix}")

    def check_vocab(self, model_vocab: int) -> None:
        """Raise if any token id falls outside a model with ``model_vocab`` embeddings, before training starts
        (not hours in, at the batch that reads it). A ``.bin``'s sidecar vocab_size is compared with it, then
        every id is scanned, ``.bin`` and ``.npy`` alike, against the sidecar's vocab_size (the model's for a
        file without one), in chunks: a corpus of many GB is never loaded whole."""
        where = self.path or "in-memory tokens"
        if self.vocab_size is not None and self.vocab_size > model_vocab:
            raise ValueError(f"{where} was tokenized with a vocabulary of {self.vocab_size} but the model's "
                             f"vocab_size is {model_vocab}; tokenize with the model's own tokenizer or pick "
                             f"a model whose vocab_size is at least {self.vocab_size}")
        vocab = model_vocab if self.vocab_size is None else self.vocab_size
        seen = _file_key(self.path, vocab)
        if seen is not None and seen in _SCANNED:  # this process scanned the file as it is: train opens it up to 3 times
            return
        bad = self.first_bad_id(vocab)
        if bad is None and seen is not None:
            _SCANNED.add(seen)
        if bad is not None:
            top = max(int(self.tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, len(self), _SCAN_CHUNK))
            why = (f"the model's vocab_size is {model_vocab}" if self.vocab_size is None else
                   f"the vocab_size in its sidecar is {vocab}" if self.path is not None else f"vocab_size is {vocab}")
            raise self.bad_id_error(*bad, vocab, f"{why}; the largest id in the file is {top}")


# Token files found clean in this process, by (path, inode, size, modification time, vocab_size): a file changed or
# replaced since is scanned again
_SCANNED: set[tuple] = set()


def _file_key(path: str | os.PathLike | None, vocab: int) -> tuple | None:
    seen = file_identity(path)
    return None if seen is None else (*seen, vocab)


def file_identity(path: str | os.PathLike | None) -> tuple | None:
    """A file as it is now: (real path, inode, size, modification time); another once it is changed or replaced.
    None where there is no such file."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns


def _read_sidecar(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.exists() and Path(path).suffix in (".jsonl", ".json"):
        raise FileNotFoundError(f"{path} looks like JSON lines, not a token file: for instruction data set "
                                f"data.format='chat' and data.tokenizer (docs/fine_tuning.md)")
    if not side.exists() and Path(path).suffix != ".bin" and b"\0" not in _head(path):
        raise FileNotFoundError(f"{path} looks like text, not a token file (it has no sidecar {side} and holds no "
                                f"binary data): tokenize it into a token file of its own and give that one: `python "
                                f"scripts/prepare_data.py --tokenizer tokenizer.json --out "
                                f"{Path(path).with_suffix('.bin')} {path}`")
    if not side.exists():
        raise FileNotFoundError(f"token file {path} has no sidecar {side} (it says the dtype, vocab_size "
                                f"and num_tokens); " + HOW_TO_CREATE.format(path=path))
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"sidecar {side} is not valid JSON ({e}); re-run scripts/prepare_data.py") from e
    if not isinstance(meta, dict):
        raise ValueError(f"sidecar {side} must hold a JSON object, got {type(meta).__name__}")
    missing, unknown = REQUIRED_KEYS - meta.keys(), meta.keys() - REQUIRED_KEYS - OPTIONAL_KEYS
    if missing or unknown:
        raise ValueError(f"sidecar {side}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                         f"allowed: {sorted(REQUIRED_KEYS | OPTIONAL_KEYS)}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"sidecar {side}: dtype must be one of {sorted(DTYPES)}, got {meta['dtype']!r}")
    for key in ("vocab_size", "num_tokens", "num_docs", "eos_id"):
        if key in meta and (not isinstance(meta[key], int) or meta[key] < 0):
            raise ValueError(f"sidecar {side}: {key} must be a non-negative integer, got {meta[key]!r}")
    limit = np.iinfo(DTYPES[meta["dtype"]]).max + 1
    if meta["vocab_size"] > limit:
        raise ValueError(f"sidecar {side}: dtype {meta['dtype']} holds ids below {limit} but vocab_size is "
                         f"{meta['vocab_size']}; write the tokens as {dtype_for_vocab(meta['vocab_size'])}")
    _check_eos(meta.get("eos_id"), meta["vocab_size"], f"sidecar {side}",
               "the sidecar is stale or was edited by hand: re-run scripts/prepare_data.py")
    return meta


def _head(path: Path, size: int = 1 << 16) -> bytes:
    """The first ``size`` bytes of ``path``."""
    with open(path, "rb") as f:
        return f.read(size)


def _check_eos(eos_id: int | None, vocab_size: int, where: str, fix: str) -> None:
    """Raise unless ``eos_id`` (None: none) is an id of the vocabulary ``[0, vocab_size)``."""
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"{where}: eos_id {eos_id} is outside the vocabulary [0, {vocab_size}) that vocab_size "
                         f"says; {fix}")


def _read_index(path: Path, num_tokens: int, num_docs: int | None) -> np.ndarray | None:
    idx = index_path(path)
    if num_docs is None and not idx.exists():
        return None
    if not idx.exists():
        raise FileNotFoundError(f"sidecar of {path} says num_docs={num_docs} but the document index {idx} "
                                f"is missing; re-run scripts/prepare_data.py")
    starts = _load_npy(idx, "re-run scripts/prepare_data.py (it writes the tokens, the sidecar and this index)")
    if num_docs is not None and len(starts) != num_docs:
        raise ValueError(f"{idx} holds {len(starts)} document starts but the sidecar says num_docs={num_docs}")
    _check_starts(starts, num_tokens, str(idx))
    return starts


def _load_npy(path: Path, fix: str) -> np.ndarray:
    """``np.load(path, mmap_mode='r')``, or a ValueError naming the file, what is wrong with it and ``fix``
    (numpy's own errors for an empty or cut-off file are a bare EOFError or an advice to unpickle)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if size == 0:
        problem = "is empty (0 bytes), not a .npy file: it was probably not written to the end"
    elif magic != NPY_MAGIC:
        problem = f"is not a .npy file (it does not start with the .npy magic bytes {NPY_MAGIC!r})"
    else:
        try:
            return np.load(path, mmap_mode="r")
        except (EOFError, ValueError, OSError) as e:
            problem = f"is a truncated or corrupt .npy file ({size} bytes; numpy says: {e})"
    raise ValueError(f"{path} {problem}; {fix}")


def _check_starts(starts: np.ndarray, num_tokens: int, where: str) -> None:
    if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
        raise ValueError(f"{where} must be a 1-D integer array of document start offsets")
    if len(starts) and (starts[0] != 0 or starts[-1] >= num_tokens or np.any(np.diff(starts) <= 0)):
        raise ValueError(f"{where}: document starts must begin at 0, strictly increase and stay below "
                         f"num_tokens={num_tokens}")


class TokenWriter:
    """Streams documents into ``path`` (+ sidecar, + index, + loss flags). They are written under temporary names
    beside ``path`` and moved into place on ``close``, the sidecar last: until then a token file already at ``path``
    stays whole (a run reading it keeps its data; a re-run that fails on a bad input line loses nothing), and an
    interrupted or failed write leaves no file that ``TokenFile.open`` would take for a whole one."""

    def __init__(self, path: str | os.PathLike, vocab_size: int, *, dtype: str | None = None,
                 eos_id: int | None = None, tokenizer: str | None = None, track_docs: bool = True,
                 track_loss: bool = False):
        self.path, self.vocab_size = Path(path), int(vocab_size)
        self.dtype = dtype or dtype_for_vocab(self.vocab_size)
        if self.dtype not in DTYPES or self.vocab_size > np.iinfo(DTYPES[self.dtype]).max + 1:
            raise ValueError(f"dtype {self.dtype!r} cannot hold vocab_size {self.vocab_size}; "
                             f"use {dtype_for_vocab(self.vocab_size)}")
        _check_eos(eos_id, self.vocab_size, f"token file {self.path}",
                   "give the end-of-document id of the tokenizer that made the ids")
        self.eos_id, self.tokenizer, self.track_docs = eos_id, tokenizer, track_docs
        self.num_tokens, self.doc_starts = 0, []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._f = open(self._tmp, "wb")
        self._loss = open(loss_path(self._tmp), "wb") if track_loss else None

    def append(self, tokens: np.ndarray | Iterable[int], loss: np.ndarray | None = None) -> None:
        """Append one document (empty documents are skipped); with ``track_loss``, its per-token loss
        flags (1: predicting this token counts), as many as tokens."""
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), np.int64)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got [{arr.min()}, {arr.max()}]")
        if (self._loss is None) != (loss is None) or (loss is not None and len(loss) != arr.size):
            raise ValueError("loss flags go with track_loss=True, one per token" if loss is None or self._loss is None
                             else f"{len(loss)} loss flags for {arr.size} tokens")
        self.doc_starts.append(self.num_tokens)
        self._f.write(arr.astype(DTYPES[self.dtype]).tobytes())
        if self._loss is not None:
            self._loss.write(np.asarray(loss, np.uint8).tobytes())
        self.num_tokens += int(arr.size)

    def close(self) -> Path:
        """Finish the file and move it into place over any file at ``path``: the old sidecar goes first, the new
        one comes last, so a reader never pairs one file's tokens with another's sidecar."""
        try:
            self._f.close()
            if self._loss is not None:
                self._loss.close()
            meta = {"dtype": self.dtype, "vocab_size": self.vocab_size, "num_tokens": self.num_tokens}
            if self.track_docs:
                np.save(index_path(self._tmp), np.asarray(self.doc_starts, np.int64))
                meta["num_docs"] = len(self.doc_starts)
            if self.eos_id is not None:
                meta["eos_id"] = int(self.eos_id)
            if self.tokenizer is not None:
                meta["tokenizer"] = self.tokenizer
            if self._loss is not None:
                meta["loss"] = True
            sidecar_path(self._tmp).write_text(json.dumps(meta, indent=1) + "\n")
            sidecar_path(self.path).unlink(missing_ok=True)
            for name in (index_path, loss_path, Path):  # an old file's index or loss flags this one lacks go too
                if name(self._tmp).exists():
                    os.replace(name(self._tmp), name(self.path))
                elif name is not Path:
                    name(self.path).unlink(missing_ok=True)
            os.replace(sidecar_path(self._tmp), sidecar_path(self.path))
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Abandon the write: the temporary files go, and any file already at ``path`` is left as it was."""
        self._f.close()
        if self._loss is not None:
            self._loss.close()
        for name in (sidecar_path, index_path, loss_path, Path):
            name(self._tmp).unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int,
                 doc_starts: Iterable[int] | None = None, *, dtype: str | None = None,
                 eos_id: int | None = None) -> Path:
    """Write a flat token array (and optional document starts) as ``path`` + sidecar (+ index)."""
    tokens = np.asarray(tokens)
    if doc_starts is not None:
        starts = np.asarray(list(doc_starts) if not isinstance(doc_starts, np.ndarray) else doc_starts, np.int64)
        _check_starts(starts, len(tokens), "doc_starts")
        bounds = np.append(starts, len(tokens))
    else:
        bounds = np.array([0, len(tokens)])
    with TokenWriter(path, vocab_size, dtype=dtype, eos_id=eos_id, track_docs=doc_starts is not None) as w:
        for a, b in zip(bounds[:-1], bounds[1:]):
            w.append(tokens[a:b])
    return Path(path)
