"""Model FLOPs as docs/results.md counts them: ``6 N + 6 L h s`` per token (causal attention counts half the
score matrix; recomputation is not counted)."""

from __future__ import annotations


def model_flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    return 6.0 * params + 6.0 * layers * hidden * seq_len

