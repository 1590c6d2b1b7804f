"""What a run is made of, in units the plan counts: bytes, parameters per part, and which parts update
where (the bottom of ``megatrain_jax.plan``: it imports nothing else of the plan)."""

from __future__ import annotations

from typing import Iterable

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.parts import HostRoles, PartId
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
    return HostRoles.of(cfg.layers, e.resident_layers, e.resident_io, e.grads_on_gpu, e.disk_parts)


def activation_bytes(cfg: DecoderConfig) -> int:
    """Bytes per element of the activations: the model's compute dtype."""
    return 2 if cfg.dtype in ("bfloat16", "float16") else 4


def stream_bytes(stream_dtype: str) -> int:
    """Bytes per streamed weight for the dtype the weights cross PCIe in."""
    return 2 if stream_dtype in ("bfloat16", "float16") else 4
