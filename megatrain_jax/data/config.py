"""``DataConfig``: the data section of a run (file, format, mode, batch size, held-out split), and how it
builds the training and evaluation streams (``TokenDataset`` batches, prefetched)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatrain_jax.batch import RowMix
from megatrain_jax.data.batches import MODES, TokenBatches, TokenDataset, check_choice
from megatrain_jax.data.demo import demo_dataset
from megatrain_jax.data.prefetch import Prefetcher, prefetch
from megatrain_jax.data.tokens import TokenFile
from megatrain_jax.train_config import check_path

# what ``DataConfig.path`` holds: token ids, instruction data (JSONL), or preference pairs for DPO (JSONL)
FORMATS = ("tokens", "chat", "preference")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training and evaluation batches come from. ``path=None`` uses the synthetic demo corpus.

    ``format="chat"``: ``path`` is instruction data (JSONL conversations or prompt/completion pairs,
    ``megatrain_jax.data.instruct``), tokenized with the tokenizer and chat template in the folder
    ``tokenizer`` (``megatrain-jax train`` uses the model's ``hf_checkpoint``), the loss on the assistant's
    tokens; examples longer than ``seq_len`` are truncated or skipped (``too_long``). It is tokenized once
    into ``cache_dir`` (default ``~/.cache/megatrain_jax/instruct``) and batched in ``mode`` ``packed``
    (several examples per row, attention within each) or ``padded`` (one per row).

    ``format="preference"``: ``path`` is preference pairs for DPO (``megatrain_jax.data.preference``), tokenized
    likewise (once, into ``cache_dir``) and batched ``padded``, each pair's two sides in adjacent rows."""

    path: str | None = None
    seq_len: int = 128
    batch_size: int = 8
    mode: str = "windows"
    seed: int = 0
    eval_fraction: float = 0.0
    prefetch: int = 2
    demo_tokens: int = 1 << 20
    format: str = "tokens"
    tokenizer: str | None = None
    too_long: str = "truncate"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name, least in (("seq_len", 1), ("batch_size", 1), ("demo_tokens", 1), ("seed", 0), ("prefetch", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"[data] {name} must be an integer >= {least}, got {value!r}")
        if isinstance(self.eval_fraction, bool) or not 0.0 <= self.eval_fraction < 1.0:  # nan too
            raise ValueError(f"[data] eval_fraction must lie in [0, 1) (the share of the data held out), got "
                             f"{self.eval_fraction!r}")
        for name, what in (("path", "the token file (with format = 'chat' or 'preference', the JSONL file), or leave "
                                    "it unset for the demo corpus"),
                           ("tokenizer", "the tokenizer's folder, or leave it unset for the model's hf_checkpoint"),
                           ("cache_dir", "a folder, or leave it unset for ~/.cache/megatrain_jax/instruct")):
            check_path(f"[data] {name}", getattr(self, name), what)
        check_choice("mode", self.mode, MODES)
        check_choice("format", self.format, FORMATS)
        check_choice("too_long", self.too_long, ("truncate", "skip"))
        if self.format == "chat":
            if self.path is None:
                raise ValueError("format='chat' reads instruction data: set path to a JSONL file")
            if self.mode == "windows":
                raise ValueError("format='chat' batches whole examples: set mode to 'packed' or 'padded'")
        if self.format == "preference":
            if self.path is None:
                raise ValueError("format='preference' reads preference pairs: set path to a JSONL file "
                                 "(prompt/chosen/rejected lines)")
            if self.mode != "padded":
                raise ValueError("format='preference' puts each response in a row of its own: set mode = 'padded'")
            if self.batch_size % 2:
                raise ValueError(f"format='preference' takes rows in (chosen, rejected) pairs: batch_size must be "
                                 f"even, got {self.batch_size}")

    def preference_pairs(self, model_vocab: int | None = None):
        """``format='preference'``: the file's pairs tokenized with ``tokenizer`` (``data.preference``), as
        ``(PreferenceData, Stats)``, checked against the model's vocabulary when given. Tokenized once into
        ``cache_dir`` (``preference.cached_pairs``): ``plan``, then ``train``, then a resumed run read the same
        pairs."""
        from megatrain_jax.data.preference import PreferenceData, cached_pairs
        if self.format != "preference":
            raise ValueError(f"preference_pairs reads format='preference' data, not {self.format!r}")
        if self.tokenizer is None:
            raise ValueError("format='preference' needs the tokenizer folder (tokenizer.json, tokenizer_config.json): "
                             "set [data] tokenizer, or [model] hf_checkpoint")
        pairs, stats = cached_pairs(self.path, self.tokenizer, self.seq_len, self.too_long, self.cache_dir,
                                    model_vocab)
        return PreferenceData(pairs, self.seq_len), stats

    def open(self, model_vocab: int | None = None) -> TokenFile:
        """The token stream, checked against the model's vocabulary when given."""
        if self.path is None:
            # corpus fixed; seed shuffles
            return demo_dataset(vocab_size=model_vocab or 256, num_tokens=self.demo_tokens)
        if self.format == "chat":
            path, _ = self._prepared()
            file = TokenFile.open(path)
            if model_vocab is not None:
                try:
                    file.check_vocab(model_vocab)
                except ValueError as e:  # name the tokenizer, not only the cache file it wrote
                    raise ValueError(f"the tokenizer {Path(self.tokenizer) / 'tokenizer.json'} does not fit the "
                                     f"model: {e}") from None
            return file
        file = TokenFile.open(self.path)
        if model_vocab is not None:
            file.check_vocab(model_vocab)
        return file

    def _prepared(self):
        from megatrain_jax.data.instruct import prepare
        if self.tokenizer is None:
            raise ValueError("format='chat' needs the tokenizer folder (tokenizer.json, tokenizer_config.json): "
                             "set [data] tokenizer, or [model] hf_checkpoint")
        return prepare(self.path, self.tokenizer, self.seq_len, self.too_long, self.cache_dir)

    def chat_summary(self) -> dict | None:
        """For instruction data (``format = 'chat'``): the examples kept, truncated and skipped, and the
        tokens of the tokenized file (tokenized once, then read from the cache); None for other data."""
        if self.format != "chat" or self.path is None:
            return None
        path, stats = self._prepared()
        return {"file": str(self.path), "tokenizer": str(self.tokenizer), "seq_len": self.seq_len,
                "too_long": self.too_long, **dataclasses.asdict(stats), "tokens": len(TokenFile.open(path))}

    def dataset(self, split: str = "train", model_vocab: int | None = None,
                max_pieces: int | None = None) -> TokenDataset:
        """``max_pieces``: at most this many documents per packed row (``TokenDataset``)."""
        return TokenDataset(self.open(model_vocab), self.seq_len, mode=self.mode, split=split,
                            eval_fraction=self.eval_fraction, max_pieces=max_pieces,
                            name=self.path if self.format == "chat" else None)  # the user's file, not the cache's

    def check(self, model_vocab: int | None = None, max_pieces: int | None = None, max_positions: int | None = None,
              evaluate: bool = False) -> int | None:
        """Raise ValueError for data that ``build`` (and ``build_eval``, when ``evaluate``) would refuse, or whose rows
        the model would refuse at a batch: a split without a unit, a training split without one whole batch, a
        packed piece with more positions than ``max_positions``. ``plan`` and ``train`` ask it before any model
        loads. Returns the batches an epoch of the training split holds (``TokenBatches.epoch_batches``; None where
        not counted). Preference pairs are read (``preference_pairs``, tokenized once into the cache) and split as
        ``train`` reads them, so a bad line, a tokenizer too large for the model or a split without a pair to train
        on is refused here too: None."""
        if self.format == "preference":
            self.preference_pairs(model_vocab)[0].split(self.eval_fraction)
            return None
        epoch = None
        for split in ("train", "eval") if evaluate else ("train",):
            data = self.dataset(split, model_vocab, max_pieces)
            if split == "train":  # one whole batch an epoch, or the stream refuses
                epoch = data.batches(self.batch_size, seed=self.seed).epoch_batches()
            if max_positions is not None and data.longest_positions() > max_positions:
                raise ValueError(f"the {split} split of {data.name} holds a document piece of "
                                 f"{data.longest_positions()} positions, more than the model's max_positions="
                                 f"{max_positions} (the batch holding it would be refused); use a data.seq_len of at "
                                 f"most {max_positions} (longer documents are cut into pieces of seq_len + 1 tokens), "
                                 f"or raise model.max_positions")
        return epoch

    def row_mix(self, model_vocab: int | None = None, max_pieces: int | None = None) -> RowMix | None:
        """What the training split's rows hold as ``train`` makes them, with at most ``max_pieces`` documents a
        packed row (``TokenDataset.row_mix``: packed rows' span, the share of tokens no loss reaches), what the
        step-time model counts. None, without reading the data, for windows (whole rows, every token in the loss:
        a token file's loss flags are not counted there) and preference data (its pairs' rows are not counted).
        Reads (and, for instruction data, tokenizes once into the cache) the data."""
        if self.format == "preference" or self.mode == "windows":
            return None
        return self.dataset("train", model_vocab, max_pieces).row_mix(self.seed)

    def build(self, model_vocab: int | None = None, state: dict | None = None,
              max_pieces: int | None = None) -> Prefetcher | TokenBatches:
        """The endless, shuffled training stream (prefetched when ``prefetch > 0``), resumed from ``state``."""
        it = self.dataset("train", model_vocab, max_pieces).batches(self.batch_size, seed=self.seed, state=state,
                                                        process=_this_process())
        return prefetch(it, self.prefetch) if self.prefetch > 0 else it

    def build_eval(self, model_vocab: int | None = None, max_pieces: int | None = None) -> TokenBatches:
        """One ordered pass over the held-out split (needs ``eval_fraction > 0``)."""
        if self.eval_fraction <= 0:
            raise ValueError("evaluation needs a held-out split: set eval_fraction > 0 in the data config")
        return self.dataset("eval", model_vocab, max_pieces).batches(self.batch_size, seed=self.seed,
                                                                    process=_this_process())


def _this_process() -> tuple[int, int]:
    """``(index, count)`` of this process among JAX's (``jax.distributed``); ``(0, 1)`` alone."""
    import jax
    return jax.process_index(), jax.process_count()
