"""A small synthetic corpus that a tiny model visibly learns, so the demo needs no download.

Each document is a walk of m tokens (16 <= m <= 128) on a fixed random Markov chain, then the same walk
repeated, then the end-of-document id 0:

- the chain gives every token 4 possible successors with probabilities 8/15, 4/15, 2/15, 1/15, so a
  bigram model reaches about 1.25 nats per token (uniform guessing: ln 256 = 5.55);
- the repeat is predictable only by attending back to the first half (an induction pattern), which
  brings the attainable loss down to roughly 0.65 nats and exercises attention, not just the embeddings.

Everything derives from ``seed`` through numpy's PCG64, so the corpus is identical on every machine.
"""

from __future__ import annotations

import functools

import numpy as np

from megatrain_jax.data.tokens import TokenFile

EOS_ID = 0


def demo_tokens(vocab_size: int = 256, num_tokens: int = 1 << 20, seed: int = 0, *, branching: int = 4,
                min_len: int = 16, max_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Exactly ``num_tokens`` demo tokens (uint16/uint32 by vocab) and the int64 start of every document."""
    if vocab_size < 2 + branching or num_tokens < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"demo corpus needs vocab_size >= {2 + branching}, num_tokens >= 1 and "
                         f"1 <= min_len <= max_len; got {vocab_size}, {num_tokens}, {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    succ_VK = rng.integers(1, vocab_size, (vocab_size, branching))  # id 0 is reserved for end-of-document
    cdf = np.cumsum(2.0 ** -np.arange(branching))
    cdf /= cdf[-1]
    docs: list[np.ndarray] = []
    total = 0
    while total < num_tokens:
        D = num_tokens // (min_len + max_len + 1) + 1  # about enough documents in one vectorized draw
        lens_D = rng.integers(min_len, max_len + 1, D)
        walk_DM = np.empty((D, max_len), np.int64)
        state_D = rng.integers(1, vocab_size, D)
        u_DM = rng.random((D, max_len))
        for t in range(max_len):  # all documents step together: max_len numpy ops, not num_tokens
            walk_DM[:, t] = state_D
            state_D = succ_VK[state_D, np.searchsorted(cdf, u_DM[:, t], side="right").clip(max=branching - 1)]
        for walk, m in zip(walk_DM, lens_D):
            docs.append(np.concatenate([walk[:m], walk[:m], [EOS_ID]]))
            total += 2 * m + 1
            if total >= num_tokens:
                break
    lengths = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    return np.concatenate(docs)[:num_tokens].astype(dtype), starts[starts < num_tokens]


@functools.lru_cache(maxsize=4)
def _corpus(vocab_size: int, num_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``demo_tokens`` made once a process (a start reads the corpus for its check, its row mix, its training and
    held-out splits: ~0.1 s each at 1M tokens), read-only so that no caller changes another's copy."""
    tokens, starts = demo_tokens(vocab_size, num_tokens, seed)
    tokens.flags.writeable = starts.flags.writeable = False
    return tokens, starts


def demo_dataset(vocab_size: int = 256, num_tokens: int = 1 << 20, seed: int = 0) -> TokenFile:
    """The demo corpus as an in-memory ``TokenFile`` (with document boundaries, so packing works too)."""
    tokens, starts = _corpus(int(vocab_size), int(num_tokens), int(seed))
    return TokenFile.from_array(tokens, vocab_size, starts, eos_id=EOS_ID)
