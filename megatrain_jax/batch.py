"""A training batch and the host-side checks every batch passes before it reaches a device."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class RowMix:
    """What a run's rows hold beside their shape, as the step-time model reads it (``plan.step_time.predict``):

    - ``attention_span``: packed rows, the keys a token's causal attention sees, doubled: the sum over each row's
      runs (its documents, and its padding as one run more) of their length squared, over the rows' tokens
      (``data.TokenDataset.row_mix``); None: each row is one causal sequence.
    - ``no_gradient``: the share of the rows' tokens no loss reaches, whose gradients are zeros in every block's
      backward: the padding, and each document's tokens after its last one in the loss. A prompt before its answer
      is not among them: the answer attends to it, so its gradient is not zero below the top block.
    """

    attention_span: float | None = None
    no_gradient: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.no_gradient <= 1.0:
            raise ValueError(f"no_gradient is a share of the rows' tokens, between 0 and 1: got {self.no_gradient}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Token ids and next-token targets, shape [B, T].

    ``loss_mask`` (1 = counts) defaults to all ones. ``positions`` default to 0..T-1 per row.
    ``segment_ids`` (packed documents) restrict attention to tokens of the same segment.
    ``ref_logps`` (preference training, ``megatrain_jax.loss.DPO``): each row's summed log-probability of its
    masked targets under the reference model, float32 [B]; rows come in (chosen, rejected) pairs.
    """

    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray | None = None
    positions: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    ref_logps: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(np.shape(self.inputs))  # np.shape: inputs given as nested lists have a shape too

    @property
    def tokens(self) -> int:
        return int(np.prod(self.shape))

    @classmethod
    def from_windows(cls, windows_BT1: np.ndarray) -> "Batch":
        """Split [B, T+1] token windows into inputs and shifted targets."""
        windows_BT1 = np.asarray(windows_BT1)
        if windows_BT1.ndim != 2 or windows_BT1.shape[1] < 2:
            raise ValueError(f"token windows must be [batch, seq_len + 1] with seq_len >= 1, "
                             f"got shape {windows_BT1.shape}")
        return cls(inputs=windows_BT1[:, :-1], targets=windows_BT1[:, 1:])

    def filled(self) -> "Batch":
        """The same batch with int32 tokens and explicit mask and positions (all arrays numpy)."""
        B, T = self.shape
        mask = np.ones((B, T), np.float32) if self.loss_mask is None else np.asarray(self.loss_mask, np.float32)
        positions = (np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)) if self.positions is None
                     else np.asarray(self.positions, np.int32))
        seg = None if self.segment_ids is None else np.asarray(self.segment_ids, np.int32)
        ref = None if self.ref_logps is None else np.asarray(self.ref_logps, np.float32)
        return Batch(np.asarray(self.inputs, np.int32), np.asarray(self.targets, np.int32), mask,
                     np.ascontiguousarray(positions), seg, ref)

    def split(self, n: int) -> list["Batch"]:
        """``n`` micro-batches of B/n rows each."""
        B = self.shape[0]
        if n < 1 or B % n:
            raise ValueError(f"batch of {B} rows cannot be split into {n} micro-batches; choose a "
                             f"micro-batch count that divides {B}")
        rows = B // n
        return [jax.tree.map(lambda a: a[i * rows:(i + 1) * rows], self) for i in range(n)]


def check_batch(batch: Batch, vocab_size: int, max_positions: int | None = None,
                segments_per_row: Callable[[int], int] | None = None) -> None:
    """Raise ValueError with what to fix if the batch does not fit the model."""
    if not isinstance(batch, Batch):
        raise TypeError(f"expected a megatrain_jax.Batch, got {type(batch).__name__}; build one with "
                        f"Batch(inputs, targets) or Batch.from_windows(tokens[B, T+1])")
    inputs, targets = np.asarray(batch.inputs), np.asarray(batch.targets)
    if inputs.ndim != 2:
        raise ValueError(f"batch inputs must be [batch, seq_len], got shape {inputs.shape}")
    if inputs.size == 0:
        raise ValueError(f"batch inputs of shape {inputs.shape} hold no token: a batch needs at least one row "
                         f"of at least one token")
    for name in ("targets", "loss_mask", "positions", "segment_ids"):
        arr = getattr(batch, name)
        if arr is not None and np.shape(arr) != inputs.shape:
            raise ValueError(f"batch {name} has shape {np.shape(arr)} but inputs have {inputs.shape}")
    for name, arr in (("inputs", inputs), ("targets", targets)):
        check_token_ids(name, arr, vocab_size)
    if batch.loss_mask is not None:
        check_loss_mask(np.asarray(batch.loss_mask))
    if batch.positions is not None:
        check_positions(np.asarray(batch.positions))
    if max_positions is not None:
        top = int(np.max(batch.positions)) + 1 if batch.positions is not None else inputs.shape[1]
        if top > max_positions:
            raise ValueError(f"positions reach {top} but the model allows max_positions={max_positions}; "
                             f"shorten seq_len or raise max_positions in the model config")
    if batch.ref_logps is not None:
        ref = np.asarray(batch.ref_logps)
        if ref.shape != inputs.shape[:1]:
            raise ValueError(f"batch ref_logps (one reference log-probability per row) has shape {ref.shape} but "
                             f"the batch has {inputs.shape[0]} rows")
        if not np.all(np.isfinite(ref)):
            raise ValueError(f"batch ref_logps holds {int(np.sum(~np.isfinite(ref)))} non-finite values: the "
                             f"reference pass must be recomputed (Engine.row_logps)")
    if batch.segment_ids is not None:
        seg = np.asarray(batch.segment_ids)
        check_segments(seg, None if segments_per_row is None else segments_per_row(seg.shape[1]))


def _first(bad_BT: np.ndarray) -> str:
    """Where the first True of ``bad_BT`` is, and how many there are, in words."""
    r, t = (int(i) for i in np.argwhere(bad_BT)[0])
    n = int(np.count_nonzero(bad_BT))
    return f"row {r}, column {t}" + (f"; {n} such values in the batch" if n > 1 else "")


def check_token_ids(name: str, ids_BT: np.ndarray, vocab_size: int) -> None:
    """Token ids are integers in ``[0, vocab_size)``: anything else is refused, naming the first offender and
    where it is (never wrapped or clamped into range)."""
    if not np.issubdtype(ids_BT.dtype, np.integer):
        raise ValueError(f"batch {name} must hold integer token ids, got dtype {ids_BT.dtype}; give the tokenizer's "
                         f"ids as integers (e.g. np.asarray(ids, np.int32))")
    if ids_BT.min() < 0 or ids_BT.max() >= vocab_size:
        bad_BT = (ids_BT < 0) | (ids_BT >= vocab_size)
        first = ids_BT[tuple(np.argwhere(bad_BT)[0])]
        raise ValueError(f"token id {int(first)} in batch {name} is outside the model's vocabulary [0, {vocab_size}) "
                         f"({_first(bad_BT)}); check the tokenizer matches the model's vocab_size")


def check_loss_mask(mask_BT: np.ndarray) -> None:
    """A loss mask weighs each token's loss: 1 counts, 0 does not. A negative weight would climb the loss, and
    a NaN or infinite one poisons it."""
    try:
        mask_BT = np.asarray(mask_BT, np.float32)  # as the engine reads it (bool, integers, bfloat16 are fine)
    except (TypeError, ValueError):
        raise ValueError(f"batch loss_mask must hold numbers (1 = in the loss, 0 = not), got dtype "
                         f"{mask_BT.dtype}") from None
    bad_BT = ~np.isfinite(mask_BT) | (mask_BT < 0)
    if bad_BT.any():
        value = mask_BT[tuple(np.argwhere(bad_BT)[0])]
        raise ValueError(f"batch loss_mask holds {value} ({_first(bad_BT)}): a token's weight in the loss must be a "
                         f"finite number >= 0 (1 = in the loss, 0 = not)")


def check_positions(positions_BT: np.ndarray) -> None:
    """Positions are whole numbers from 0 (each packed document restarts at 0)."""
    if not np.issubdtype(positions_BT.dtype, np.integer):
        raise ValueError(f"batch positions must be integers (0, 1, 2, ... along each row or packed document), got "
                         f"dtype {positions_BT.dtype}")
    if positions_BT.min() < 0:
        bad_BT = positions_BT < 0
        raise ValueError(f"batch positions hold {int(positions_BT[tuple(np.argwhere(bad_BT)[0])])} "
                         f"({_first(bad_BT)}): positions count from 0 (each packed document restarts at 0)")


def check_loss_tokens(batch: Batch) -> None:
    """A training batch has at least one token in its loss: one whose ``loss_mask`` is all zero would train on
    nothing (its loss reads 0) while the optimizer still steps."""
    if batch.loss_mask is not None and not np.any(np.asarray(batch.loss_mask)):
        raise ValueError(f"a batch of shape {batch.shape} has no token in its loss (its loss_mask is all zero), so "
                         f"a step on it would learn nothing: check the data's masking (e.g. a prompt that fills the "
                         f"whole row leaves no answer token), or leave such rows out")


def check_segments(segment_ids_BT: np.ndarray, max_segments: int | None) -> None:
    """Packed documents are contiguous: each segment id covers one run of a row (padding included), and a
    row holds at most ``max_segments`` runs (the flash attention's static bound; None: no bound)."""
    seg = segment_ids_BT
    runs_B = 1 + np.count_nonzero(seg[:, 1:] != seg[:, :-1], axis=1)
    distinct_B = np.array([np.unique(row).size for row in seg])
    split = np.flatnonzero(runs_B != distinct_B)
    if split.size:
        r = int(split[0])
        raise ValueError(f"row {r} of the batch's segment_ids has a segment id in more than one place "
                         f"({int(runs_B[r])} runs of {int(distinct_B[r])} distinct ids): each packed document "
                         f"(and the padding) must be one contiguous run of its id")
    if max_segments is not None and runs_B.size and runs_B.max() > max_segments:
        r = int(runs_B.argmax())
        raise ValueError(f"row {r} of the batch packs {int(runs_B[r])} segments (documents and padding), more "
                         f"than the {max_segments} a row of {seg.shape[1]} tokens may hold (the model's max_segments); set "
                         f"model.max_segments to at least {int(runs_B[r])} (it costs GPU memory in the attention's "
                         f"backward) or pack fewer, longer documents per row")
