"""What a run is made of, in units the plan counts: bytes, parameters per part, and which parts update
where (the bottom of ``megatrain_jax.plan``: it imports nothing else of the plan)."""

from __future__ import annotations

from typing import Iterable

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import HostRoles, PartId
from megatrain_jax.engine.precision import DTYPE_BYTES, Precision
from megatrain_jax.models.config import DecoderConfig

GiB = 1024**3
MiB = 1024**2
BATCH_BYTES_PER_TOKEN = 16  # a filled Batch: int32 inputs, targets, positions and float32 loss mask


def io_param_count(cfg: DecoderConfig) -> int:
    """Embedding, final norm and (untied) head."""
    return cfg.vocab_size * cfg.hidden + cfg.hidden + (0 if cfg.tie_embeddings else cfg.hidden * cfg.vocab_size)


def layer_param_count(cfg: DecoderConfig) -> int:
    """The largest block's parameters: what one block's buffers must hold (every block, where the blocks are
    all alike; an MoE block where the first ones are dense)."""
    return max(cfg.block_param_count(0), cfg.block_param_count(cfg.layers - 1))


def part_param_count(cfg: DecoderConfig, part: PartId) -> int:
    return io_param_count(cfg) if part.is_io else cfg.block_param_count(part.layer)


def blocks_param_count(cfg: DecoderConfig, blocks: Iterable[int]) -> int:
    """The parameters of the blocks of these indices together."""
    return sum(cfg.block_param_count(i) for i in blocks)


def host_roles(cfg: DecoderConfig, e: EngineConfig) -> HostRoles:
    """Which parts update on the host, wait on the GPU, keep moments on disk (``parts.HostRoles``)."""
    return HostRoles.of_config(cfg.layers, e)


def activation_bytes(cfg: DecoderConfig) -> int:
    """Bytes per element of the activations: the model's compute dtype."""
    return 2 if cfg.dtype in ("bfloat16", "float16") else 4


def stream_bytes(stream_dtype: str) -> int:
    """Bytes per streamed weight for the dtype the weights cross PCIe in."""
    return 2 if stream_dtype in ("bfloat16", "float16") else 4


# ---------------------------------------------------------------------- leaf shapes and moment bytes
def leaf_shapes(cfg: DecoderConfig, part: PartId) -> list[tuple[int, ...]]:
    """The shapes of a part's parameter leaves, as ``megatrain_jax.models.Decoder`` creates them (kernels
    (in, out), experts (experts, in, out)); they add up to ``part_param_count`` (tests/test_memory_plan.py
    checks both against the model's own leaves)."""
    d = cfg.hidden
    if part.is_io:
        return [(cfg.vocab_size, d), (d,)] + ([] if cfg.tie_embeddings else [(d, cfg.vocab_size)])
    hd = cfg.dim_per_head
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    shapes = [(d, q), (d, kv), (d, kv), (q, d)] + [(d,)] * cfg.norms_per_block
    if cfg.qkv_bias:
        shapes += [(q,), (kv,), (kv,)]
    shapes += ([(d,)] if cfg.o_bias else []) + ([(cfg.heads,)] if cfg.attention_sinks else [])
    if cfg.mla is not None:  # DeepSeek-V3's multi-head latent attention
        shapes = cfg.mla.leaf_shapes(d, cfg.heads, cfg.qkv_bias) + [(d,)] * cfg.norms_per_block
    if cfg.qk_norm:
        shapes += [(hd,), (hd,)] if cfg.qk_norm_width == "head" else [(q,), (kv,)]
    mlp = lambda f: [(d, f), (d, f), (f, d)]  # noqa: E731  (gate, up, down)
    m = cfg.moe
    if not cfg.is_moe_layer(part.layer):
        return shapes + mlp(cfg.ffn)
    shapes += [(m.experts, d, m.expert_ffn), (m.experts, d, m.expert_ffn), (m.experts, m.expert_ffn, d),
               (d, m.experts)] + ([(m.experts,)] if m.scoring == "sigmoid" or m.router_bias else [])
    if m.expert_bias:  # GPT-OSS: gate, up and down biases of every expert
        shapes += [(m.experts, m.expert_ffn), (m.experts, m.expert_ffn), (m.experts, d)]
    if m.shared_expert_ffn is not None:
        shapes += mlp(m.shared_expert_ffn) + ([(d, 1)] if m.shared_expert_gate else [])
    return shapes


def moment_bytes(cfg: DecoderConfig, e: EngineConfig, part: PartId) -> int:
    """Host bytes of a part's Adam moments m and v in ``e``'s mode (``mode_moment_bytes``)."""
    return mode_moment_bytes(cfg, e.precision, part)


def mode_moment_bytes(cfg: DecoderConfig, mode: Precision, part: PartId) -> int:
    """Host bytes of a part's Adam moments m and v in ``mode`` (``Precision.moments_of``): leaf by leaf where
    the mode's depend on the shape (8-bit matrices), else so many bytes per parameter."""
    if mode.quantized:
        return sum(mode.moments_of(shape) for shape in leaf_shapes(cfg, part))
    return mode.moment_bytes * part_param_count(cfg, part)


def host_grad_bytes(e: EngineConfig) -> int:
    """Bytes per parameter of a gradient that comes home to host memory for its update
    (``host_grad_dtype``; those that wait on the GPU come home in float32)."""
    return DTYPE_BYTES[e.host_grad_dtype]


def device_grad_bytes(e: EngineConfig) -> int:
    """Bytes per parameter of a gradient that waits on the GPU for an update there, once summed: a GPU-resident
    part's, or a GPU-updated part's until its visit (``device_grad_dtype``)."""
    return DTYPE_BYTES[e.device_grad_dtype]
