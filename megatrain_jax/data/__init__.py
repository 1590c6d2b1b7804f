"""Token data: memory-mapped token files, deterministic resumable batches, prefetch, demo corpus."""

from megatrain_jax.data.demo import demo_dataset, demo_tokens
from megatrain_jax.data.sampler import DataConfig, Prefetcher, TokenBatches, TokenDataset, prefetch
from megatrain_jax.data.tokens import TokenFile, TokenWriter, write_tokens

__all__ = ["DataConfig", "Prefetcher", "TokenBatches", "TokenDataset", "TokenFile", "TokenWriter",
           "demo_dataset", "demo_tokens", "prefetch", "write_tokens"]
