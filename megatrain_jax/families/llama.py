"""Llama (Llama 2, Llama 3, 3.1, 3.2): pre-norm blocks, grouped-query attention, SwiGLU; the test model "tiny"
and the dense shapes the benchmarks use."""

from __future__ import annotations

from typing import Any

from megatrain_jax.families import hf_json
from megatrain_jax.families.family import Family

LLAMA3_SCALING = dict(factor=8.0, original_max_position=8192)
LLAMA32_SCALING = dict(factor=32.0, original_max_position=8192)

TINY = dict(vocab_size=256, hidden=64, ffn=160, layers=2, heads=4, kv_heads=2, max_positions=512, dtype="float32",
            loss_chunk_tokens=256)  # seconds on a CPU: the test and demo model
LLAMA2_7B = dict(vocab_size=32000, hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32)
LLAMA2_13B = dict(vocab_size=32000, hidden=5120, ffn=13824, layers=40, heads=40, kv_heads=40)
LLAMA32_1B = dict(vocab_size=128256, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, head_dim=64,
                  rope_theta=500000.0, rope_scaling=LLAMA32_SCALING, tie_embeddings=True, max_positions=131072)
LLAMA32_3B = dict(vocab_size=128256, hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8, rope_theta=500000.0,
                  rope_scaling=LLAMA32_SCALING, tie_embeddings=True, max_positions=131072)
LLAMA3_8B = dict(vocab_size=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, rope_theta=500000.0,
                 max_positions=8192)
LLAMA3_70B = dict(vocab_size=128256, hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, rope_theta=500000.0,
                  max_positions=8192)
# A dense 120B Llama-style shape (no published checkpoint; sized like MegaTrain's 120B claim).
DENSE_120B = dict(vocab_size=128256, hidden=12288, ffn=32768, layers=78, heads=96, kv_heads=8, rope_theta=500000.0,
                  max_positions=8192)
# The same block at GPT-3's scale (175B; no published checkpoint), for the capacity projection.
DENSE_175B = dict(DENSE_120B, layers=112)
LLAMA31_405B = dict(vocab_size=128256, hidden=16384, ffn=53248, layers=126, heads=128, kv_heads=8, rope_theta=500000.0,
                    rope_scaling=LLAMA3_SCALING, max_positions=131072)

PRESETS = {
    "tiny": TINY,
    "llama3.2-1b": LLAMA32_1B, "1b": LLAMA32_1B,
    "llama3.2-3b": LLAMA32_3B, "3b": LLAMA32_3B,
    # The 7B layer shape every benchmark in docs/design.md uses; "3.5b" is its first 16 layers.
    "llama2-7b": LLAMA2_7B, "7b": LLAMA2_7B, "3.5b": dict(LLAMA2_7B, layers=16),
    # The shape of the speed comparison where the model does not fit on one GPU (docs/performance.md).
    "llama2-13b": LLAMA2_13B, "13b": LLAMA2_13B,
    "llama3-8b": LLAMA3_8B, "8b": LLAMA3_8B,
    "llama3.1-8b": dict(LLAMA3_8B, rope_scaling=LLAMA3_SCALING, max_positions=131072),
    "llama3-70b": LLAMA3_70B, "70b": LLAMA3_70B,
    "dense-120b": DENSE_120B, "120b": DENSE_120B,
    "dense-175b": DENSE_175B, "175b": DENSE_175B,
    "llama3.1-405b": LLAMA31_405B, "405b": LLAMA31_405B,
}


def refuse(c: dict[str, Any]) -> None:
    hf_json.refuse_silu(c)
    hf_json.refuse_attention_bias(c)


def write(cfg: Any, out: dict[str, Any]) -> None:
    out.update(attention_bias=False, mlp_bias=False)


def problems(cfg: Any) -> list[str]:
    if cfg.sliding_window is not None:
        return [f"sliding_window={cfg.sliding_window} (Llama has none; use family='mistral')"]
    return []


FAMILY = Family(name="llama", title="Llama", model_type="llama", hf_class="LlamaForCausalLM", presets=PRESETS,
                hf_defaults=dict(max_position_embeddings=2048), refuse=refuse, write=write, problems=problems)
