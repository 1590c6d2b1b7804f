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
        return tuple(self.inputs.shape)

    @property
    def tokens(self) -> int:
        return int(np.prod(self.inputs.shape))

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
    for name in ("targets", "loss_mask", "positions", "segment_ids"):
        arr = getattr(batch, name)
        if arr is not None and np.shape(arr) != inputs.shape:
            raise ValueError(f"batch {name} has shape {np.shape(arr)} but inputs have {inputs.shape}")
    for name, arr in (("inputs", inputs), ("targets", targets)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"batch {name} must hold integer token ids, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            bad = int(arr.max()) if arr.max() >= vocab_size else int(arr.min())
            raise ValueError(f"token id {bad} in batch {name} is outside the model's vocabulary "
                             f"[0, {vocab_size}); check the tokenizer matches the model's vocab_size")
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
