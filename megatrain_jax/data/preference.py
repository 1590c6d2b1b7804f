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
  are the prompt (the implicit prompt), the rest each response.

Every problem names the file and line. A pair longer than ``seq_len + 1`` tokens on either side is cut to that
length on both (``truncate``) or left out (``skip``), and counted; a pair left without a response token on
either side is left out and counted.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import numpy as np

from megatrain_jax.batch import Batch
from megatrain_jax.data.instruct import (ChatTokenizer, InstructDataError, Stats, TooLong, check_messages, json_object,
                                        read_tokenized)

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
    if any(isinstance(obj.get(k), str) for k in ("prompt", *SIDES)):
        raise InstructDataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings (plain text) or all "
                                f"message lists (a conversation), not a mix")
    chosen, rejected = (check_messages(obj[k], where, k) for k in SIDES)
    if "prompt" in obj:
        prompt = check_messages(obj["prompt"], where, "prompt")
    else:  # the implicit prompt: the messages both conversations begin with
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
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
    def encode(text: str, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        example = parse_preference_line(text, where)
        return [tokenizer.encode_completion(example["prompt"], example[k]) for k in SIDES]
    lines, stats = read_tokenized(path, encode, seq_len, too_long, "pair", "response token")
    return [Pair(chosen, rejected, line) for line, (chosen, rejected) in lines], stats


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
            raise ValueError(f"eval_fraction={eval_fraction} of {len(self.pairs)} pairs leaves none to train on: use a "
                             f"smaller eval_fraction or more data")
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
