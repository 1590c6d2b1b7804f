"""Token data: memory-mapped token files, deterministic resumable batches, prefetch, the data config, demo corpus."""

from megatrain_jax.data.batches import TokenBatches, TokenDataset
from megatrain_jax.data.config import DataConfig
from megatrain_jax.data.demo import demo_dataset, demo_tokens
from megatrain_jax.data.prefetch import Prefetcher, prefetch
from megatrain_jax.data.tokens import TokenFile, TokenWriter, write_tokens

__all__ = ["DataConfig", "Prefetcher", "TokenBatches", "TokenDataset", "TokenFile", "TokenWriter",
           "demo_dataset", "demo_tokens", "prefetch", "write_tokens"]
