"""Model FLOPs as docs/results.md counts them: ``6 N + 6 L h s`` per token (causal attention counts half the
score matrix; recomputation is not counted)."""

from __future__ import annotations


def model_flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    return 6.0 * params + 6.0 * layers * hidden * seq_len



def format_flops(tflops: float) -> str:
    """A rate in the unit that shows its digits: ``455.1 TFLOP/s``, ``12.3 GFLOP/s`` for a small model on a CPU."""
    if tflops >= 1.0:
        return f"{tflops:.1f} TFLOP/s"
    if tflops >= 1e-3:
        return f"{tflops * 1e3:.1f} GFLOP/s"
    return f"{tflops * 1e6:.1f} MFLOP/s"
