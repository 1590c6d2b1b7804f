"""Deterministic, resumable batches of [batch_size, seq_len] from a token stream.

A ``TokenDataset`` cuts one split of a ``TokenFile`` into *units*, each a run of tokens that becomes
(part of) a row:

- ``mode="windows"``: non-overlapping windows of ``seq_len + 1`` tokens, stride ``seq_len`` (inputs and
  the shifted targets); each window is one row. No segment ids, so attention stays plain causal.
- ``mode="packed"``: whole documents, each contributing its ``L - 1`` (input, target) pairs, so no target
  ever comes from another document. Documents with more than ``seq_len + 1`` tokens are cut into pieces
  of at most ``seq_len + 1`` tokens sharing one boundary token (every pair is trained on exactly once).
  Pieces are packed next-fit into rows: ``segment_ids`` 1..k per row (0 = padding), ``positions``
  restarting at 0 for each piece, ``loss_mask`` 1 on real pairs and 0 on padding. ``max_pieces`` caps k
  (the model's attention bounds the documents per row: ``DecoderConfig.segments_per_row``);
- ``mode="padded"``: documents (or pieces) as in ``packed``, one per row, the rest of the row padding with
  ``loss_mask`` 0. No segment ids: attention stays plain causal (and flash), at the price of padding.

A file with per-token loss flags (``TokenFile.loss``: instruction data) sets ``loss_mask`` from them
instead of 1, so only the tokens meant to be learned count.

Splits: the last ``eval_fraction`` of the *tokens* (windows) or of the *documents* (packed) is held out
as ``split="eval"``; the two never share a token.

``TokenBatches`` walks a permutation of the units per epoch (seeded by ``(seed, epoch)``). Its state is
just ``(epoch, cursor)`` plus the settings that must not change across a resume, so ``state()`` is a
tiny JSON dict and a restored iterator yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, Iterator

import numpy as np

from megatrain_jax.batch import Batch, RowMix
from megatrain_jax.data.tokens import TokenFile

MODES = ("windows", "packed", "padded")  # padded: one document per row, the rest masked out
SPLITS = ("train", "eval")


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raise ValueError when ``value`` is not one of ``allowed``, suggesting the closest."""
    if value in allowed:
        return
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")


def split_point(n: int, eval_fraction: float) -> int:
    """Index where the held-out tail of ``n`` items begins (at least one item once the fraction is > 0)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in [0, 1), got {eval_fraction}")
    return n if eval_fraction == 0.0 else n - max(1, int(round(eval_fraction * n)))


class TokenDataset:
    """One split of a token stream, as units: token offsets ``starts`` and lengths ``lengths`` (>= 2)."""

    def __init__(self, source: TokenFile | str | os.PathLike, seq_len: int, *, mode: str = "windows",
                 split: str = "train", eval_fraction: float = 0.0, max_pieces: int | None = None,
                 name: str | None = None):
        """``name``: what messages call the data (default: the file's path; instruction data: its JSONL file)."""
        check_choice("mode", mode, MODES)
        if max_pieces is not None and max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1 or None, got {max_pieces}")
        self.max_pieces = None if max_pieces is None else int(max_pieces)
        check_choice("split", split, SPLITS)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.file = source if isinstance(source, TokenFile) else TokenFile.open(source)
        self.seq_len, self.mode, self.split, self.eval_fraction = int(seq_len), mode, split, eval_fraction
        self.name = name or str(self.file.path or "the tokens")
        n, T = len(self.file), self.seq_len
        if mode == "windows":
            cut = split_point(n, eval_fraction)
            lo, hi = (0, cut) if split == "train" else (cut, n)
            count = max(0, (hi - lo - 1) // T)
            self.starts = lo + np.arange(count, dtype=np.int64) * T
            self.lengths = np.full(count, T + 1, np.int64)
        else:
            if self.file.doc_starts is None:
                raise ValueError(f"mode={mode!r} needs document boundaries but {self.file.path or 'the tokens'} "
                                 f"has none; write them with doc_starts (prepare_data.py does) or use "
                                 f"mode='windows'")
            bounds = np.append(np.asarray(self.file.doc_starts, np.int64), n)
            cut = split_point(len(bounds) - 1, eval_fraction)
            docs = slice(0, cut) if split == "train" else slice(cut, len(bounds) - 1)
            a, L = bounds[:-1][docs], np.diff(bounds)[docs]
            a, L = a[L >= 2], L[L >= 2]  # a one-token document has no (input, target) pair
            pieces = (L - 2) // T + 1  # ceil((L - 1) / T)
            doc = np.repeat(np.arange(len(L)), pieces)
            k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            self.starts = a[doc] + k * T
            self.lengths = np.minimum(T + 1, L[doc] - k * T)
        if len(self.starts) == 0:
            raise ValueError(self._empty_split(n, eval_fraction))

    def _empty_split(self, n: int, eval_fraction: float) -> str:
        """Why this split holds no unit, and what to change: the held-out share grows the eval split and
        shrinks the train split."""
        T, windows = self.seq_len, self.mode == "windows"
        what = (f"the {self.split} split of {self.name} ({n} tokens, eval_fraction="
                f"{eval_fraction:g}) holds no " + (f"window of seq_len={T} (a window takes {T + 1} tokens)"
                                                  if windows else "document of 2 tokens or more"))
        if self.split == "train":
            ways = ["more data"] + ["a shorter seq_len"] * windows + ["a smaller eval_fraction"] * (eval_fraction > 0)
        else:
            least = math.ceil((T + 1) / n * 1000) / 1000 if windows and n else None  # held-out share for one window
            ways = [f"an eval_fraction of at least {least:g}" if least is not None and least < 0.5
                    else "a larger eval_fraction", "more data"] + ["a shorter seq_len"] * windows
        return f"{what}; use {', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else f"{what}; use {ways[0]}"

    def too_few_rows(self, rows: int, batch_size: int) -> str:
        """Why this split cannot fill one batch of ``batch_size`` rows (it makes ``rows``), and what to change."""
        T = self.seq_len
        if self.mode == "windows":
            what = (f"holds {rows} window(s) of seq_len={T}, fewer than data.batch_size={batch_size} (a batch of "
                    f"{batch_size} windows takes {batch_size * T + 1} tokens)")
        elif self.mode == "packed":
            what = (f"holds {len(self)} document(s), {int((self.lengths - 1).sum())} (input, target) pairs, which pack "
                    f"into {rows} row(s) of seq_len={T}, fewer than data.batch_size={batch_size}")
        else:
            what = f"holds {rows} document(s), one a row, fewer than data.batch_size={batch_size}"
        ways = ["more data", "a smaller data.batch_size"] + ["a shorter data.seq_len"] * (self.mode == "windows")
        ways += ["a smaller data.eval_fraction"] * (self.split == "train" and self.eval_fraction > 0)
        held = f", eval_fraction={self.eval_fraction:g}" if self.eval_fraction > 0 else ""
        return (f"the {self.split} split of {self.name} ({len(self.file)} tokens{held}) {what}; use "
                f"{', '.join(ways[:-1])} or {ways[-1]}")

    def longest_positions(self) -> int:
        """The most positions a row of this split takes: ``seq_len`` for windows and padded rows (a 0..seq_len-1
        ramp), the longest piece's (input, target) pairs for packed rows (positions restart at each piece)."""
        return int(self.lengths.max()) - 1 if self.mode == "packed" and len(self) else self.seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def row_mix(self, seed: int = 0, rows: int = 4096) -> RowMix:
        """What the rows hold as ``TokenBatches`` makes them (in epoch 0's order for ``seed``; the first ``rows``
        rows), for the step-time model (``plan.step_time.predict``):

        - ``attention_span`` (packed rows; None in the other modes, where each row is one causal sequence): the keys
          a token's causal attention sees, doubled: the sum over each row's runs of their length squared, over rows
          x seq_len. The runs are its pieces and its padding, which cuDNN's packed layout runs as one run more
          (``models.layers.segment_layout``): a row of short documents with a long padding tail costs that tail's
          own attention. A row of one piece of seq_len gives seq_len.
        - ``no_gradient``: the share of the rows' tokens no loss reaches: the padding, and each piece's tokens after
          its last target in the loss (a file's loss flags: instruction data's prompts are out of the loss, but an
          answer after them attends to them, so their gradients are not zeros)."""
        pairs, dead, seen, T = 0.0, 0.0, 0, self.seq_len
        loss = self.file.loss
        for units in TokenBatches(self, 1, seed=seed, shuffle=True, loop=False).packed_rows(rows):
            n = np.minimum(self.lengths[units].astype(np.float64) - 1, T)  # a window's pairs: seq_len
            pairs, dead, seen = pairs + (n * n).sum() + (T - n.sum()) ** 2, dead + T - n.sum(), seen + 1
            if loss is not None:  # each piece's targets after its last one in the loss
                for u, k in zip(units, n.astype(np.int64)):
                    flags = np.flatnonzero(loss[int(self.starts[u]) + 1:int(self.starts[u]) + 1 + int(k)])
                    dead += int(k) - (int(flags[-1]) + 1 if flags.size else 0)
        if not seen:
            return RowMix(float(T) if self.mode == "packed" else None)
        return RowMix(float(pairs / (seen * T)) if self.mode == "packed" else None, float(dead / (seen * T)))

    def batches(self, batch_size: int, *, seed: int = 0, shuffle: bool | None = None, loop: bool | None = None,
                state: dict | None = None, process: tuple[int, int] = (0, 1)) -> "TokenBatches":
        """Batches of this split; by default the train split shuffles and loops, eval runs once in order.
        ``process=(index, count)``: this process's rows of each batch (see ``TokenBatches``)."""
        train = self.split == "train"
        return TokenBatches(self, batch_size, seed=seed, shuffle=train if shuffle is None else shuffle,
                            loop=train if loop is None else loop, state=state, process=process)


# What each of the stream's settings is, said to someone who set it in a run's [data] table
_SETTING = {"mode": "data.mode", "split": "the split (data.eval_fraction held out)", "seq_len": "data.seq_len",
            "batch_size": "data.batch_size", "seed": "data.seed", "shuffle": "shuffling", "loop": "looping",
            "num_units": "the number of units in the split (another data.path, data.eval_fraction, seq_len or "
                         "tokenizer)"}


SHORT_EPOCHS_PASSED = 8  # reshuffled epochs in a row that may pack short of a batch before the stream gives up


class TokenBatches:
    """Iterator of numpy ``Batch``es (int32 tokens, explicit float32 ``loss_mask`` and int32 ``positions``).

    Looping iterators drop an epoch's last incomplete batch (and a reshuffled epoch of packed rows that holds
    fewer than a batch, ``SHORT_EPOCHS_PASSED`` in a row at most); a one-pass iterator pads it with rows whose
    ``loss_mask`` is 0, so evaluation sees every unit with a fixed batch shape.

    ``process=(index, count)``: with several processes (``jax.distributed``) each yields only its own
    ``batch_size / count`` rows of every global batch (process ``index``'s contiguous share). The state is
    the global position, the same in every process, so a run resumes under any number of processes.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 loop: bool = True, state: dict | None = None, process: tuple[int, int] = (0, 1)):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        index, count = process
        if not 0 <= index < count or batch_size % count:
            raise ValueError(f"batch_size={batch_size} must split evenly over {count} processes (process "
                             f"{index}): use a batch size divisible by the number of processes")
        self.process = (int(index), int(count))
        self.dataset, self.batch_size, self.seed = dataset, int(batch_size), int(seed)
        self.shuffle, self.loop = bool(shuffle), bool(loop)
        self.epoch = self.cursor = self.batches_done = 0
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)
        if loop:  # at least one whole batch an epoch: said now, not at the first batch, after the model has loaded
            rows = sum(1 for _ in self.packed_rows(batch_size)) if dataset.mode == "packed" else len(dataset)
            if rows < batch_size:
                raise ValueError(dataset.too_few_rows(rows, batch_size))
        if state is not None:
            self.restore(state)

    @property
    def endless(self) -> bool:
        """A looping iterator never ends (``fit`` then needs ``TrainConfig.steps``)."""
        return self.loop

    def _settings(self) -> dict[str, Any]:
        d = self.dataset
        return {"mode": d.mode, "split": d.split, "seq_len": d.seq_len, "num_units": len(d),
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle, "loop": self.loop}

    def state(self) -> dict[str, Any]:
        """Where the stream stands after the last batch returned: small and JSON-serializable."""
        # max_pieces is recorded, not checked on restore: the cursor walks the same unit order whatever the
        # cap, which only changes how the rows to come are packed (a new model.max_segments may resume)
        return {**self._settings(), "max_pieces": self.dataset.max_pieces, "epoch": self.epoch,
                "cursor": self.cursor, "batches": self.batches_done}

    def resume_problem(self, state: dict[str, Any]) -> str | None:
        """What keeps this stream from going on from ``state`` (the ``state()`` of the stream a checkpoint saved),
        each setting as saved and as now; None where ``restore`` can take it."""
        changed = {k: (state.get(k), v) for k, v in self._settings().items() if state.get(k) != v}
        return "; ".join(f"{_SETTING.get(k, k)}: {a} saved, {b} now" for k, (a, b) in changed.items()) or None

    def restore(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        problem = self.resume_problem(state)
        if problem:
            raise ValueError(f"the data differs from the stream this position was saved from: {problem}. Resume "
                             f"with the same data (file, mode, seq_len, batch_size, seed and eval_fraction)")
        self.epoch, self.cursor, self.batches_done = int(state["epoch"]), int(state["cursor"]), int(state["batches"])

    def order(self, epoch: int) -> np.ndarray:
        """The unit order of ``epoch``: a permutation seeded by ``(seed, epoch)``, or identity."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> Batch:
        # the epoch's incomplete tail is dropped; so is a reshuffled epoch that packs into fewer rows than a batch
        # (packing depends on the order: epoch 0's count, checked at start, can differ by a row or two)
        for attempt in range(1 + SHORT_EPOCHS_PASSED):
            rows, cursor = self._take(self.order(self.epoch), self.cursor)
            if len(rows) == self.batch_size or (not self.loop and rows):
                self.cursor = cursor
                self.batches_done += 1
                index, count = self.process
                share = self.batch_size // count
                return self._assemble(rows[index * share:(index + 1) * share])
            if not self.loop:
                raise StopIteration
            self.epoch, self.cursor = self.epoch + 1, 0  # drop the incomplete tail, reshuffle
        raise ValueError(f"{SHORT_EPOCHS_PASSED} epochs in a row of the {self.dataset.split} split (from epoch "
                         f"{self.epoch - SHORT_EPOCHS_PASSED}, shuffled by data.seed) each pack into fewer than "
                         f"data.batch_size={self.batch_size} rows; use more data or a smaller data.batch_size")

    def epoch_batches(self, most_rows: int = 1 << 15) -> int | None:
        """The whole batches of epoch 0: what a looping stream takes before it reshuffles and starts over (another
        epoch's packed rows may number a few more or fewer). None where packed rows, counted one by one, number
        more than ``most_rows``."""
        if self.dataset.mode != "packed":
            return len(self.dataset) // self.batch_size
        rows = sum(1 for _ in self.packed_rows(most_rows + 1))
        return None if rows > most_rows else rows // self.batch_size

    def packed_rows(self, rows: int) -> Iterator[list[int]]:
        """The unit indices of each of the first ``rows`` rows of epoch 0, as ``__next__`` packs them (the state is
        left as it was)."""
        order, cursor, done = self.order(0), 0, 0
        while done < rows and cursor < len(order):
            batch, cursor = self._take(order, cursor)
            yield from batch
            done += len(batch)

    def _take(self, order: np.ndarray, cursor: int) -> tuple[list[list[int]], int]:
        """Unit indices for each row of the next batch (fewer rows when the epoch runs out)."""
        d, rows = self.dataset, []
        while len(rows) < self.batch_size and cursor < len(order):
            if d.mode in ("windows", "padded"):
                rows.append([int(order[cursor])])
                cursor += 1
                continue
            row, used = [], 0  # next-fit: pieces in order while their pairs fit the row
            while (cursor < len(order) and used + d.lengths[order[cursor]] - 1 <= d.seq_len
                   and (d.max_pieces is None or len(row) < d.max_pieces)):
                row.append(int(order[cursor]))
                used += int(d.lengths[order[cursor]]) - 1
                cursor += 1
            rows.append(row)
        return rows, cursor

    def _assemble(self, rows: list[list[int]]) -> Batch:
        d, B, T = self.dataset, self.batch_size // self.process[1], self.dataset.seq_len
        tokens, loss = d.file.tokens, d.file.loss
        inputs, targets = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
        mask, positions, seg = np.zeros((B, T), np.float32), np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
        for r, units in enumerate(rows):
            at = 0
            for k, u in enumerate(units, start=1):
                s, L = int(d.starts[u]), int(d.lengths[u])
                piece = np.asarray(tokens[s:s + L], np.int32)
                inputs[r, at:at + L - 1], targets[r, at:at + L - 1] = piece[:-1], piece[1:]
                mask[r, at:at + L - 1] = 1.0 if loss is None else loss[s + 1:s + L]  # flags of the targets
                seg[r, at:at + L - 1] = k
                positions[r, at:at + L - 1] = np.arange(L - 1)
                at += L - 1
        self._check_ids(rows, inputs, targets)
        if d.mode in ("windows", "padded"):
            positions[:] = np.arange(T)  # one piece from position 0: a plain 0..T-1 ramp, padding included
        return Batch(inputs, targets, mask, positions, seg if d.mode == "packed" else None)


    def _check_ids(self, rows: list[list[int]], inputs: np.ndarray, targets: np.ndarray) -> None:
        """Token ids outside the file's vocabulary (its sidecar's vocab_size; only negative ids when it has
        none) raise an error naming the file and the first bad position. One cheap check per batch; the
        file is searched only when it fails."""
        file = self.dataset.file
        vocab = file.vocab_size
        low = min(int(inputs.min()), int(targets.min()))
        high = max(int(inputs.max()), int(targets.max()))
        if low >= 0 and (vocab is None or high < vocab):
            return
        why = f"the vocab_size in its sidecar is {vocab}" if file.path is not None else f"vocab_size is {vocab}"
        for u in (u for units in rows for u in units):
            s, L = int(self.dataset.starts[u]), int(self.dataset.lengths[u])
            bad = file.first_bad_id(vocab, s, s + L)
            if bad is not None:
                raise file.bad_id_error(*bad, vocab, why)
