"""Preference data for DPO (``megatrain_jax.loss.DPO``): JSONL pairs of a chosen and a rejected response to one
prompt, tokenized with a checkpoint's own tokenizer and chat template (``instruct.ChatTokenizer``), and batched
as the engine's pair objective takes them: row ``2i`` the prompt with the chosen response, row ``2i + 1`` with
the rejected one, the loss mask on the response's tokens only.

Line formats, one JSON object per line (TRL's preference formats):

- ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: plain text, no template; each response is
  followed by the end-of-sequence token, which carries loss with it;
- ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``: a conversation and each
  response's turns (ending with an assistant turn), rendered with the chat template as one conversation;
- ``{"chosen": [messages], "rejected": [messages]}``: two whole conversations; their common first messages
  are the prompt (the implicit prompt), the rest each response, each keeping at least its last message (as TRL's
  ``extract_prompt``: two conversations the same are a pair whose sides are the same).

Every problem names the file and line. A pair longer than ``seq_len + 1`` tokens on either side is cut to that
length on both (``truncate``) or left out (``skip``), and counted; a pair left without a response token on
either side, or with both sides the same, is left out and counted. A pair with an empty response is kept (the side
still learns the end of the answer) and said in the stats' notes, as most likely a gap in the data.

The reference pass's values are kept with a digest of the pairs they belong to (``write_reference``), so that a
resumed run whose data changed is refused rather than trained against other pairs' values (``read_reference``).

A file is tokenized once (``cached_pairs``): ``megatrain-jax plan`` and then ``train`` (and a resumed run) read the
same pairs back from the cache, as instruction data's token file is (``instruct.prepare``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from megatrain_jax.batch import Batch
from megatrain_jax.data.chat_lines import (InstructDataError, check_messages, json_kind, json_object,
                                          refuse_token_file)
from megatrain_jax.data.instruct import ChatTokenizer, Stats, TooLong, cache_key, default_cache_dir, read_tokenized

SIDES = ("chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One tokenized pair: each side's ``ids`` [n] and ``loss_mask`` [n - 1] (as ``instruct.Example``)."""

    chosen: tuple[np.ndarray, np.ndarray]
    rejected: tuple[np.ndarray, np.ndarray]
    line: int


def parse_preference_line(text: str, where: str) -> dict[str, Any]:
    """One JSONL line checked and put in one form: ``prompt``, ``chosen`` and ``rejected``, all strings or all
    message lists (an implicit prompt split off). ``where`` is ``file:line`` for errors."""
    obj = json_object(text, where)
    missing = [k for k in SIDES if k not in obj]
    if missing:
        raise InstructDataError(f"{where}: a preference line needs 'chosen' and 'rejected' (and a 'prompt', unless "
                                f"both are whole conversations); missing {missing}, found keys {sorted(obj)}")
    if all(isinstance(obj.get(k), str) for k in ("prompt", *SIDES)):
        return {"prompt": obj["prompt"], "chosen": obj["chosen"], "rejected": obj["rejected"]}
    if "prompt" not in obj and all(isinstance(obj.get(k), str) for k in SIDES):
        raise InstructDataError(f"{where}: plain-text 'chosen' and 'rejected' need a 'prompt' string (only message "
                                f"lists may leave the prompt implicit, as their common first messages)")
    if any(isinstance(obj.get(k), str) for k in ("prompt", *SIDES)) or any(
            not isinstance(obj[k], list) for k in obj.keys() & {"prompt", *SIDES}):
        kinds = ", ".join(f"{k!r} is {json_kind(obj[k])}" for k in ("prompt", *SIDES) if k in obj)
        raise InstructDataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings (plain text) or all "
                                f"message lists (a conversation), not a mix: here {kinds}")
    chosen, rejected = (check_messages(obj[k], where, k) for k in SIDES)
    if "prompt" in obj:
        prompt = check_messages(obj["prompt"], where, "prompt")
    else:  # the implicit prompt: the messages both conversations begin with, each keeping at least its last (TRL's)
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise InstructDataError(f"{where}: 'chosen' and 'rejected' share no first message, so the prompt cannot "
                                    f"be told apart: give a 'prompt' of its own")
    for key, side in (("chosen", chosen), ("rejected", rejected)):
        if not side or side[-1]["role"] != "assistant":
            raise InstructDataError(f"{where}: the {key} response must end with an assistant message (after the "
                                    f"prompt); it has {[m['role'] for m in side] or 'no message'}")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def read_pairs(path: str | os.PathLike, tokenizer: ChatTokenizer, seq_len: int,
               too_long: TooLong = "truncate") -> tuple[list[Pair], Stats]:
    """Every line of ``path`` checked and tokenized (see the module's docstring); raises InstructDataError naming
    the line, and when no pair is left."""
    empty: dict[str, list[str]] = {k: [] for k in SIDES}  # side -> the 'file:line' of its empty responses

    def encode(text: str, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        example = parse_preference_line(text, where)
        for k in SIDES:
            if _is_empty(example[k]):
                empty[k].append(where)
        return [tokenizer.encode_completion(example["prompt"], example[k]) for k in SIDES]
    lines, stats = read_tokenized(path, encode, seq_len, too_long, "pair", "response token")
    kept = {f"{Path(path)}:{line}" for line, _ in lines}
    note = _empty_note({k: [w for w in empty[k] if w in kept] for k in SIDES}, stats.kept)
    if note:
        stats.notes.append(note)
    return [Pair(chosen, rejected, line) for line, (chosen, rejected) in lines], stats


def _is_empty(response: str | list[dict[str, str]]) -> bool:
    """Whether a response (plain text, or messages) says nothing: blank text, or assistant turns all blank."""
    if isinstance(response, str):
        return not response.strip()
    return all(not m["content"].strip() and not m.get("tool_calls") for m in response if m["role"] == "assistant")


def _empty_note(empty: dict[str, list[str]], kept: int) -> str | None:
    """What to say of kept pairs with an empty response (``empty``: side -> their ``file:line``), or None."""
    said = [f"{len(where):,} of {kept:,} pairs {'has' if len(where) == 1 else 'have'} an empty {side} response (the "
            f"first: {where[0]})" for side, where in empty.items() if where]
    if not said:
        return None
    return (f"{'; '.join(said)}: such a side's row learns only the end of the answer (the end-of-sequence token, or "
            f"the chat template's end of turn), so DPO teaches the model to prefer saying nothing (an empty chosen "
            f"response) or merely saying something (an empty rejected one). Where a tool left the field blank, fill "
            f"it in or remove those lines")


# ---------------------------------------------------------------------------------------------- cache
PAIRS_VERSION = 2  # bump when what cached_pairs writes changes (2: the implicit prompt as TRL's, notes)


def cached_pairs(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, seq_len: int,
                 too_long: TooLong = "truncate", cache_dir: str | os.PathLike | None = None,
                 model_vocab: int | None = None) -> tuple[list[Pair], Stats]:
    """``read_pairs`` of ``path`` with the tokenizer in ``tokenizer_dir``, done once: the pairs, their stats and the
    tokenizer's vocabulary size are kept in ``cache_dir`` (default ``instruct.default_cache_dir()``, beside
    instruction data's) under a key of everything they depend on (``instruct.cache_key``: the file's bytes, the
    tokenizer's files, ``seq_len`` and ``too_long``). A later call with the same inputs reads them back; a damaged
    entry is tokenized again. Refuses a tokenizer with more tokens than ``model_vocab`` (when given), before it
    tokenizes anything."""
    refuse_token_file(path)  # before its bytes are hashed for the key: a token file may be many GB
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = cache / f"{cache_key(path, tokenizer_dir, seq_len, too_long)}.pairs{PAIRS_VERSION}.npz"
    if entry.exists():
        try:  # the cache is derived data: a damaged entry is made again, never trusted or left to the user
            pairs, stats, vocab = _read_entry(entry)
        except (ValueError, KeyError, TypeError, OSError, zipfile.BadZipFile) as e:
            print(f"the cached tokenization {entry} of {path} is damaged ({e}); tokenizing again", file=sys.stderr)
            entry.unlink(missing_ok=True)
        else:
            _check_vocab(vocab, model_vocab, tokenizer_dir)
            return pairs, stats
    tokenizer = ChatTokenizer.from_folder(tokenizer_dir)
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    _check_vocab(vocab, model_vocab, tokenizer_dir)
    pairs, stats = read_pairs(path, tokenizer, seq_len, too_long)
    try:
        _write_entry(entry, pairs, stats, vocab)
    except OSError as e:  # the pairs are read: a cache that cannot be written costs the next read its time, no more
        print(f"note: the tokenized pairs of {path} cannot be kept in {cache} ({e}), so the next read tokenizes them "
              f"again: set data.cache_dir to a writable folder", file=sys.stderr)
    return pairs, stats


def _check_vocab(vocab: int, model_vocab: int | None, tokenizer_dir: str | os.PathLike) -> None:
    if model_vocab is not None and vocab > model_vocab:
        raise ValueError(f"the tokenizer {Path(tokenizer_dir) / 'tokenizer.json'} has {vocab} tokens, more "
                         f"than the model's vocab_size = {model_vocab}: use the model's own tokenizer")


def _write_entry(entry: Path, pairs: list[Pair], stats: Stats, vocab: int) -> None:
    """The pairs as flat arrays in one ``.npz``: every side's ids one after another (chosen then rejected, pair by
    pair), their lengths [pairs, 2], their loss masks likewise (0/1), the pairs' lines, the stats and the
    vocabulary size. Written under a temporary name and renamed: a reader never sees half an entry."""
    sides = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
    lengths = np.asarray([len(ids) for ids, _ in sides], np.int64).reshape(-1, 2)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, ids=np.concatenate([ids for ids, _ in sides]).astype(np.int32), lengths=lengths,
                     masks=np.concatenate([mask for _, mask in sides]).astype(np.uint8),
                     lines=np.asarray([pair.line for pair in pairs], np.int64),
                     stats=np.asarray(json.dumps(dataclasses.asdict(stats))), vocab=np.asarray(vocab, np.int64))
        os.replace(tmp, entry)
    finally:
        tmp.unlink(missing_ok=True)


def _read_entry(entry: Path) -> tuple[list[Pair], Stats, int]:
    """What ``_write_entry`` wrote; ValueError where its arrays do not agree with each other."""
    with np.load(entry) as z:
        ids, lengths, masks, lines = z["ids"], z["lengths"], z["masks"], z["lines"]
        stats, vocab = Stats(**json.loads(str(z["stats"]))), int(z["vocab"])
    n = lengths.reshape(-1)
    if (lengths.shape != (len(lines), 2) or len(lines) != stats.kept or (n < 2).any() or n.sum() != len(ids)
            or (n - 1).sum() != len(masks)):
        raise ValueError(f"its arrays do not agree: {len(lines)} pairs, {stats.kept} kept, lengths of shape "
                         f"{lengths.shape}, {len(ids)} ids, {len(masks)} loss flags")
    id_ends, mask_ends = np.cumsum(n), np.cumsum(n - 1)
    sides = [(ids[end - k:end], masks[m_end - k + 1:m_end].astype(np.float32))
             for k, end, m_end in zip(n.tolist(), id_ends.tolist(), mask_ends.tolist())]
    return [Pair(sides[2 * i], sides[2 * i + 1], int(line)) for i, line in enumerate(lines)], stats, vocab


class PreferenceData:
    """Tokenized pairs as the engine's batches: ``batch_rows`` rows (``batch_rows / 2`` pairs) of ``seq_len``
    tokens, each side padded after its end with token ``pad_id`` and loss 0.

    ``ordered(batch_rows)``: one pass over every pair in order (the reference pass, ``Engine.row_logps``; the
    last batch is filled with the first pairs again, whose rows the caller drops: ``pair_logps``).
    ``batches(batch_rows, seed, ref_logps)``: the training stream, shuffled by ``seed`` and repeated, each batch
    with its rows' reference log-probabilities from ``ref_logps`` [pairs, 2]."""

    def __init__(self, pairs: list[Pair], seq_len: int, pad_id: int = 0):
        if not pairs:
            raise ValueError("PreferenceData needs at least one pair")
        self.pairs, self.seq_len, self.pad_id = list(pairs), seq_len, pad_id

    def __len__(self) -> int:
        return len(self.pairs)

    def split(self, eval_fraction: float) -> tuple["PreferenceData", "PreferenceData | None"]:
        """The first pairs for training and the last ``eval_fraction`` of them held out (None where 0)."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in [0, 1), got {eval_fraction}")
        if eval_fraction == 0.0:
            return self, None
        held = max(1, int(round(eval_fraction * len(self.pairs))))
        if held >= len(self.pairs):
            raise ValueError(f"data.eval_fraction={eval_fraction} holds out {held} of the {len(self.pairs)} pairs "
                             f"read, leaving none to train on: use a smaller data.eval_fraction (0 holds none out) or "
                             f"more pairs")
        cut = len(self.pairs) - held
        return (PreferenceData(self.pairs[:cut], self.seq_len, self.pad_id),
                PreferenceData(self.pairs[cut:], self.seq_len, self.pad_id))

    def first(self, n: int) -> "PreferenceData":
        """The first ``n`` pairs (all of them where there are fewer)."""
        return PreferenceData(self.pairs[:max(1, n)], self.seq_len, self.pad_id)

    def batch(self, indices: np.ndarray, ref_logps: np.ndarray | None = None) -> Batch:
        """The pairs ``indices`` as one batch (chosen, rejected, chosen, ...)."""
        T = self.seq_len
        inputs = np.full((2 * len(indices), T), self.pad_id, np.int32)
        targets = np.full((2 * len(indices), T), self.pad_id, np.int32)
        mask = np.zeros((2 * len(indices), T), np.float32)
        for r, (i, side) in enumerate((int(i), side) for i in indices for side in SIDES):
            ids, loss = getattr(self.pairs[i], side)
            n = len(ids) - 1
            inputs[r, :n], targets[r, :n], mask[r, :n] = ids[:-1], ids[1:], loss
        ref = None if ref_logps is None else np.asarray(ref_logps, np.float32)[np.asarray(indices)].reshape(-1)
        return Batch(inputs, targets, loss_mask=mask, ref_logps=ref)

    def ordered(self, batch_rows: int) -> Iterator[Batch]:
        per = _pairs_per_batch(batch_rows)
        order = np.arange(len(self.pairs))
        for start in range(0, len(order), per):
            chunk = order[start:start + per]
            if len(chunk) < per:  # the last batch filled with the first pairs again (their rows are dropped)
                chunk = np.concatenate([chunk, np.resize(order, per - len(chunk))])
            yield self.batch(chunk)

    def batches(self, batch_rows: int, seed: int, ref_logps: np.ndarray) -> "PairStream":
        ref_logps = np.asarray(ref_logps, np.float32)
        if ref_logps.shape != (len(self.pairs), 2):
            raise ValueError(f"ref_logps must hold [pairs, 2] = [{len(self.pairs)}, 2] reference log-probabilities "
                             f"(pair_logps of these pairs), got shape {ref_logps.shape}")
        return PairStream(self, _pairs_per_batch(batch_rows), seed, ref_logps)


class PairStream:
    """``PreferenceData.batches``: shuffled passes over the pairs, one after another, never ending (``endless``:
    ``fit`` then needs ``TrainConfig.steps``). Deterministic for a seed, so a resumed run skips what it read."""

    endless = True

    def __init__(self, data: PreferenceData, per: int, seed: int, ref_logps: np.ndarray):
        self.data, self.per, self.ref = data, per, ref_logps
        self.rng = np.random.default_rng(seed)
        self.pool: list[int] = []

    def __iter__(self) -> "PairStream":
        return self

    def __next__(self) -> Batch:
        while len(self.pool) < self.per:
            self.pool += self.rng.permutation(len(self.data)).tolist()
        chunk, self.pool = np.asarray(self.pool[:self.per]), self.pool[self.per:]
        return self.data.batch(chunk, self.ref)


def _pairs_per_batch(batch_rows: int) -> int:
    if batch_rows < 2 or batch_rows % 2:
        raise ValueError(f"a preference batch holds (chosen, rejected) pairs: batch_size must be even, got "
                         f"{batch_rows}")
    return batch_rows // 2


def pair_logps(engine, data: PreferenceData, batch_rows: int) -> np.ndarray:
    """Every pair's chosen and rejected summed log-probability under ``engine``'s current parameters, [pairs, 2],
    in one streamed pass (``Engine.row_logps``): with the untrained weights, the reference model's (DPO's
    reference pass, ``Batch.ref_logps``)."""
    rows = engine.row_logps(data.ordered(batch_rows))
    return rows[:2 * len(data)].reshape(len(data), 2)


def pairs_digest(sets: list[PreferenceData]) -> str:
    """A digest of the pairs of ``sets``, in order: each side's token ids and loss mask. Reference values taken on
    pairs of one digest belong to no others (another file, tokenizer, ``seq_len``, ``too_long`` or split)."""
    h = hashlib.sha256()
    for data in sets:
        h.update(np.int64(len(data)).tobytes())
        for pair in data.pairs:
            for ids, mask in (pair.chosen, pair.rejected):
                h.update(np.int64(len(ids)).tobytes() + np.asarray(ids, np.int64).tobytes()
                         + (np.asarray(mask) > 0).tobytes())
    return h.hexdigest()


def write_reference(path: str | os.PathLike, values: np.ndarray, sets: list[PreferenceData]) -> None:
    """The reference log-probabilities ``values`` [pairs, 2] of the pairs of ``sets`` (``pair_logps`` of each, one
    after another) to ``path`` (``.npy``), and the pairs' digest beside it (``<path>.json``: ``read_reference``)."""
    path = Path(path)
    side = Path(f"{path}.json")
    side.unlink(missing_ok=True)  # a file without its digest is read by shape only, never with another run's digest
    np.save(path, np.asarray(values, np.float32))
    side.write_text(json.dumps({"pairs": int(sum(len(x) for x in sets)), "digest": pairs_digest(sets)}))


def read_reference(path: str | os.PathLike, sets: list[PreferenceData]) -> np.ndarray:
    """What ``write_reference`` wrote to ``path``, refused (ValueError, saying what to do) where it is not of the
    pairs of ``sets``: another count, another digest (where the file has one), or values that are not finite."""
    path = Path(path)
    side, n = Path(f"{path}.json"), sum(len(x) for x in sets)
    retake = (f"delete {path} and resume: the run takes the reference pass again with its initial weights before "
              f"the checkpoint is restored")
    try:
        values = np.load(path)
        recorded = json.loads(side.read_text()) if side.exists() else None
        if recorded is not None and not isinstance(recorded, dict):
            raise ValueError(f"{side} holds {json_kind(recorded)}, not the pairs' digest")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} cannot be read ({e}): {retake}") from None
    if values.shape != (n, 2) or (recorded is not None and recorded.get("digest") != pairs_digest(sets)):
        got = f"of shape {values.shape}" if values.shape != (n, 2) else f"of other pairs ({side} records them)"
        raise ValueError(f"{path} holds reference log-probabilities {got}, not of this run's {n:,} pairs: the data "
                         f"(its file, the tokenizer, data.seq_len, data.too_long, data.eval_fraction or "
                         f"train.eval_batches) changed since the run started. Resume with the settings it started "
                         f"with; or, to go on with the data as it is now, {retake}")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{path} holds {int(np.sum(~np.isfinite(values)))} reference log-probabilities that are not "
                         f"finite: {retake}")
    return values


def evaluate_pairs(engine, data: PreferenceData, ref_logps: np.ndarray, batch_rows: int) -> dict[str, float]:
    """The engine's objective (``DPO``) on held-out pairs with their reference log-probabilities ``ref_logps``
    [pairs, 2], the current parameters streamed forward only: ``eval_loss`` (the mean over the pairs),
    ``eval_rewards_accuracy``, ``eval_rewards_margin`` and ``eval_pairs``."""
    import jax.numpy as jnp
    if not engine.objective.pairs:
        raise ValueError(f"evaluate_pairs scores a pair objective (DPO); this engine trains {engine.objective!r}")
    ref_logps = np.asarray(ref_logps, np.float32)
    if ref_logps.shape != (len(data), 2):
        raise ValueError(f"ref_logps must hold [pairs, 2] = [{len(data)}, 2] reference log-probabilities, got shape "
                         f"{ref_logps.shape}")
    logps = pair_logps(engine, data, batch_rows)
    losses, chosen, rejected = engine.objective.pair_terms(jnp.asarray(logps.reshape(-1)),
                                                           jnp.asarray(ref_logps.reshape(-1)))
    losses, chosen, rejected = (np.asarray(x, np.float64) for x in (losses, chosen, rejected))
    return {"eval_loss": float(losses.mean()), "eval_rewards_accuracy": float((chosen > rejected).mean()),
            "eval_rewards_margin": float((chosen - rejected).mean()), "eval_pairs": len(data)}
