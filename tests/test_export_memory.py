"""The end of a run may not need the model twice in host memory: a Hugging Face export reads each tensor of the
host state where it lies and holds one tensor's cast copy at a time (experiments/studies/NOTES.md, 2026-11-28:
the shipped h200_sft_8b was killed by the kernel at its end). Measured with tracemalloc, which sees numpy's
buffers."""

from __future__ import annotations

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import preset
from megatrain_jax.hf import load_hf, save_hf
from test_export_folder import params

# untied: the head is the largest tensor and is written transposed ([hidden, vocab] here, [vocab, hidden] in HF)
CFG = preset("tiny", vocab_size=4096, hidden=256, ffn=1024, layers=8, heads=4, kv_heads=2, max_positions=64,
             tie_embeddings=False)


def test_an_export_holds_about_one_tensor_beyond_the_state(tmp_path):
    io, blocks = params(CFG, 0)
    largest = max(a.size for a in jax.tree.leaves((io, blocks)))
    model_bf16 = 2 * sum(a.size for a in jax.tree.leaves((io, blocks)))
    save_hf(tmp_path / "warm", CFG, io, blocks)  # imports and first-call caches outside the measure
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        save_hf(tmp_path / "hf", CFG, io, blocks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    extra = peak - before
    # one bfloat16 copy of the largest tensor (the head's, transposed on the way), and small change; before this
    # was streamed, three (the cast, its contiguous copy, the bytes object)
    assert extra < 1.3 * 2 * largest + 512 * 1024, (extra, 2 * largest, model_bf16)
    assert extra < model_bf16 / 4
    got = load_hf(tmp_path / "hf", dtype="float32")[1:]
    want = jax.tree.map(lambda a: np.asarray(a.astype(jnp.bfloat16), np.float32), (io, blocks))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_an_export_reads_jax_arrays_through_their_buffers(tmp_path, monkeypatch):
    """``np.asarray`` on a GPU client's array (pinned host memory included) keeps the host copy it makes inside
    the array, for the array's life: read from the engine's state, that was every master weight a second time.
    The export reads each array through ``transfer.host_view`` (a view of a host buffer; a temporary copy of a
    device one). On CPU ``np.asarray`` takes the buffer protocol and copies nothing, so the route is what is
    checked here."""
    import megatrain_jax.hf.export as export
    io, blocks = jax.tree.map(jnp.asarray, params(CFG, 1))
    read = []
    monkeypatch.setattr(export, "host_view", lambda x: read.append(x) or np.asarray(x))
    save_hf(tmp_path / "hf", CFG, io, blocks)
    leaves = jax.tree.leaves((io, blocks))
    assert len(read) == len(leaves) and {id(x) for x in read} == {id(x) for x in leaves}
