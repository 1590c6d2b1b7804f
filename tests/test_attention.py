"""Packed-document attention (cuDNN's packed layout from segment ids) and the MoE grouped matmul.

On CPU: the layout cuDNN is given describes exactly the documents the XLA path masks, the bound on
documents per row is checked before a batch runs, and the implementation choice. On a Hopper GPU (the
GPU tests, skipped elsewhere): the kernels against XLA's float32 results.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import Batch, DecoderConfig, EngineConfig
from megatrain_jax.batch import check_batch, check_segments
from megatrain_jax.data import TokenDataset
from megatrain_jax.models import layers
from megatrain_jax.models.config import SEGMENT_TOKENS
from megatrain_jax.models.layers import attention_implementation, packed_attention, segment_layout
from megatrain_jax.plan import plan
from tests.test_data import docs_file

on_hopper = pytest.mark.skipif(layers.gpu_compute_capability() != (9, 0),
                               reason="cuDNN's packed layout and the Mosaic-GPU kernels need a Hopper GPU")


def random_segments(rng, B, T, max_docs, pad_max=0):
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        pad = int(rng.integers(0, pad_max + 1))
        docs = int(rng.integers(1, max_docs + 1))
        cuts = np.sort(rng.choice(np.arange(1, T - pad), min(docs - 1, T - pad - 1), replace=False))
        bounds = np.concatenate([[0], cuts, [T - pad]])
        for d in range(len(bounds) - 1):
            seg[b, bounds[d]:bounds[d + 1]] = d + 1
    return seg


@pytest.mark.parametrize("seed", range(4))
def test_layout_describes_exactly_the_masked_documents(seed):
    rng = np.random.default_rng(seed)
    B, T, M = 3, 64, 12
    seg = random_segments(rng, B, T, max_docs=8, pad_max=10)
    lay = jax.tree.map(np.asarray, segment_layout(jnp.asarray(seg), M))
    assert lay["lengths"].shape == (B, M) and lay["offsets"].shape == (B, M + 1)
    for b in range(B):
        real = lay["lengths"][b] >= 0
        n = int(real.sum())
        assert np.all(real[:n]) and np.all(lay["lengths"][b, n:] == -1) and np.all(lay["offsets"][b, n:] == -1)
        assert lay["lengths"][b, :n].sum() == T  # every token (padding too) is in one document
        doc = np.full(T, -1)
        for d in range(n):
            o, L = lay["offsets"][b, d], lay["lengths"][b, d]
            assert np.all(doc[o:o + L] == -1)
            doc[o:o + L] = d
        np.testing.assert_array_equal(doc[:, None] == doc[None, :], seg[b][:, None] == seg[b][None, :])


def test_layout_of_one_document_is_the_whole_row():
    lay = segment_layout(jnp.ones((2, 16), jnp.int32), 4)
    np.testing.assert_array_equal(lay["lengths"], [[16, -1, -1, -1]] * 2)
    np.testing.assert_array_equal(lay["offsets"], [[0, -1, -1, -1, -1]] * 2)


def test_a_segment_id_in_two_places_is_refused():
    seg = np.array([[1, 1, 2, 2, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"row 0 .* more than one place .* contiguous run"):
        check_segments(seg, None)


def test_more_documents_than_the_bound_are_refused_with_the_number_to_set():
    seg = np.repeat(np.arange(1, 11), 4)[None]  # 10 documents of 4 tokens
    check_segments(seg, 10)
    with pytest.raises(ValueError, match=r"packs 10 segments .* more than the 9 a row of 40 tokens may hold .* "
                                         r"model.max_segments to at least 10"):
        check_segments(seg, 9)


def test_check_batch_applies_the_models_bound_for_the_rows_length():
    cfg = DecoderConfig(vocab_size=64, hidden=16, ffn=32, layers=1, heads=2, kv_heads=2, max_segments=3)
    tokens = np.zeros((1, 8), np.int32)
    ok = Batch(tokens, tokens, segment_ids=np.array([[1, 1, 2, 2, 3, 3, 3, 3]]))
    check_batch(ok, 64, None, cfg.segments_per_row)
    bad = Batch(tokens, tokens, segment_ids=np.array([[1, 1, 2, 2, 3, 3, 0, 0]]))
    with pytest.raises(ValueError, match="packs 4 segments"):
        check_batch(bad, 64, None, cfg.segments_per_row)


def test_default_bound_shrinks_with_the_row_and_is_validated():
    cfg = DecoderConfig(vocab_size=64, hidden=16, ffn=32, layers=1, heads=2, kv_heads=2)
    assert cfg.segments_per_row(2048) == SEGMENT_TOKENS // 2048 == 32
    assert cfg.segments_per_row(8192) == 8 and cfg.segments_per_row(524288) == 8
    assert cfg.replace(max_segments=100).segments_per_row(32768) == 100
    with pytest.raises(ValueError, match="max_segments must be a positive integer or None"):
        cfg.replace(max_segments=0)


def test_packed_rows_close_at_the_bound_and_resume_under_another_bound():
    ds = TokenDataset(docs_file(lengths=(3,) * 40), seq_len=32, mode="packed", max_pieces=4)
    it = ds.batches(2, seed=0)
    b = next(it)
    assert (b.segment_ids.max(axis=1) == 4).all()  # 15 documents would fit 32 tokens; 4 are taken
    check_segments(b.segment_ids, 5)  # 4 documents and the padding
    state = it.state()
    assert state["max_pieces"] == 4 and state["cursor"] == 8
    # a state from before the bound, or under another one (a new model.max_segments), resumes at its cursor
    old = {k: v for k, v in state.items() if k != "max_pieces"}
    for cap, saved in ((None, old), (6, state)):
        again = TokenDataset(docs_file(lengths=(3,) * 40), seq_len=32, mode="packed", max_pieces=cap)
        resumed = again.batches(2, seed=0, state=saved)
        fresh = again.batches(2, seed=0)
        assert resumed.state()["cursor"] == 8 and fresh.state()["cursor"] == 0
        np.testing.assert_array_equal(next(resumed).inputs[0, :3], next(ds.batches(2, seed=0, state=state)).inputs[0, :3])


@pytest.mark.parametrize("cc,packed_impl", [("9.0", "cudnn"), ("10.0", "cudnn"), ("8.0", "xla")])
def test_implementation_choice(monkeypatch, cc, packed_impl):
    cfg = DecoderConfig(vocab_size=64, hidden=16, ffn=32, layers=1, heads=2, kv_heads=2)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "cpu")
    assert attention_implementation(cfg, jnp.bfloat16) == "xla"  # off the GPU
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(layers.jax, "devices", lambda: [type("GPU", (), {"compute_capability": cc})()])
    assert attention_implementation(cfg, jnp.bfloat16) == "cudnn"
    assert attention_implementation(cfg, jnp.bfloat16, packed=True) == packed_impl  # packed layout: Hopper on
    assert attention_implementation(cfg, jnp.float32) == "xla"
    assert attention_implementation(cfg.replace(attention_impl="xla"), jnp.bfloat16, packed=True) == "xla"


def test_plan_counts_the_packed_workspace_by_the_bound():
    cfg = DecoderConfig(vocab_size=1024, hidden=512, ffn=1024, layers=4, heads=8, kv_heads=8, attention_impl="cudnn")
    e = EngineConfig()
    gpu = lambda c, packed: plan(c, e, 2, 4096, host_ram_bytes=2**40, gpu_bytes=2**40, packed=packed,  # noqa: E731
                                 detect=False).gpu_total
    base = gpu(cfg, False)
    grows = [gpu(cfg.replace(max_segments=m), True) - base for m in (8, 16)]
    q = cfg.heads * cfg.dim_per_head
    assert grows[1] - grows[0] == 8 * 2 * 4096 * q * 4  # 8 more documents: their float32 dQ workspace


@on_hopper
@pytest.mark.parametrize("B,T,docs,pad", [(2, 2048, 5, 100), (1, 4096, 8, 0), (2, 1024, 1, 0)])
def test_packed_attention_equals_masked_reference_on_gpu(B, T, docs, pad):
    rng = np.random.default_rng(T)
    seg = jnp.asarray(random_segments(rng, B, T, docs, pad))
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, T, 2, 128), jnp.bfloat16) for kk in ks[1:3])
    dy = jax.random.normal(ks[3], q.shape, jnp.bfloat16)

    def masked(q, k, v):
        mask = seg[:, None, :, None] == seg[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")

    y, pb = jax.vjp(lambda *a: packed_attention(*a, seg, 16), q, k, v)
    y_ref, pb_ref = jax.vjp(lambda *a: masked(*(x.astype(jnp.float32) for x in a)), q, k, v)
    for got, want in zip((y, *pb(dy)), (y_ref, *pb_ref(dy.astype(jnp.float32)))):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
        assert err < 1e-2, err  # bf16 inputs (XLA in bf16 is 4.6e-3 off the same reference)


@on_hopper
@pytest.mark.parametrize("experts,hidden,ffn", [(8, 512, 1024), (32, 256, 384), (4, 2880, 2880), (4, 200, 320)])
def test_grouped_matmul_equals_ragged_dot_on_gpu(experts, hidden, ffn):
    from megatrain_jax.models.moe import grouped_matmul
    A = 2048
    x = jax.random.normal(jax.random.key(0), (A, hidden), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (experts, hidden, ffn), jnp.bfloat16) * 0.05
    dy = jax.random.normal(jax.random.key(2), (A, ffn), jnp.bfloat16)
    choice = np.random.default_rng(0).integers(1, experts, A)  # expert 0 gets nothing
    sizes = jnp.asarray(np.bincount(choice, minlength=experts).astype(np.int32))
    y, pb = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes), x, w)
    y_ref, pb_ref = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x.astype(jnp.float32), w.astype(jnp.float32))
    dx, dw = pb(dy)
    for got, want in zip((y, dx, dw), (y_ref, *pb_ref(dy.astype(jnp.float32)))):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
        assert err < 1e-2, err
    assert float(jnp.max(jnp.abs(dw[0]))) == 0.0  # an expert without tokens gets no gradient


def _sinks_on_cudnn_equal_xla(form, T: int, window: int | None) -> None:
    """``form(q, k, v, sinks)`` on GPT-OSS's shapes: values and the gradients of q, k, v and the sinks against XLA's
    sink attention in float32 on the same bf16 inputs."""
    ks = jax.random.split(jax.random.key(0), 5)
    B, N, K, H = 2, 64, 8, 64
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, T, K, H), jnp.bfloat16) for kk in ks[1:3])
    sinks = 2 * jax.random.normal(ks[3], (N,))
    dy = jax.random.normal(ks[4], q.shape, jnp.bfloat16)
    y, pb = jax.vjp(form, q, k, v, sinks)
    y_ref, pb_ref = jax.vjp(lambda q, k, v, s: layers.sink_attention(q, k, v, s, 0.125, window, None),
                            *(x.astype(jnp.float32) for x in (q, k, v)), sinks)
    for got, want in zip((y, *pb(dy)), (y_ref, *pb_ref(dy.astype(jnp.float32)))):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
        assert err < 1e-2, err


@on_hopper
@pytest.mark.parametrize("T", [2048, 1000])
def test_sinks_as_one_more_key_on_cudnn_equal_xla_sink_attention(T):
    """GPT-OSS's full layers on cuDNN's flash kernel (the sink as one more key, ``layers.sink_as_key``)."""
    _sinks_on_cudnn_equal_xla(lambda q, k, v, s: layers.sink_as_key(q, k, v, s, 0.125, "cudnn"), T, None)


@on_hopper
@pytest.mark.parametrize("T,window", [(2048, 128), (1000, 128), (2048, None)])
def test_sinks_rescaled_by_cudnn_log_sum_exp_equal_xla_sink_attention(T, window):
    """GPT-OSS's sinks by cuDNN's flash kernel with its log-sum-exp (``layers.sink_rescaled``; a sliding layer's
    window too, where the sink cannot be one more key). The engine takes this path for sliding layers only once
    this passes: its softmax statistics must be the natural log-sum-exp of the scaled scores."""
    _sinks_on_cudnn_equal_xla(lambda q, k, v, s: layers.sink_rescaled(q, k, v, s, 0.125, window, "cudnn"), T, window)


@pytest.mark.parametrize("hidden,ffn", [(200, 320), (256, 100), (130, 129)])
def test_padded_grouped_matmul_equals_the_unpadded_one_with_gradients(hidden, ffn):
    """Widths that are not multiples of the kernels' 128 (GPT-OSS's 2880) are zero-padded and cut back: the same
    product and gradients as without padding (checked here around XLA's ragged_dot, which runs on a CPU)."""
    from megatrain_jax.models.moe import padded_grouped
    A, E = 96, 4
    x = jax.random.normal(jax.random.key(0), (A, hidden), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (E, hidden, ffn), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (A, ffn), jnp.float32)
    sizes = jnp.asarray([30, 0, 50, 16], jnp.int32)
    padded_widths = []

    def inner(x, w, sizes):
        padded_widths.append(w.shape[1:])
        return jax.lax.ragged_dot(x, w, sizes)

    y, pb = jax.vjp(lambda x, w: padded_grouped(x, w, sizes, inner), x, w)
    y_ref, pb_ref = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
    assert padded_widths == [(-(-hidden // 128) * 128, -(-ffn // 128) * 128)]
    assert y.shape == (A, ffn)
    for got, want in zip((y, *pb(dy)), (y_ref, *pb_ref(dy))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_kernel_results_file_shows_the_kernels_matched_on_the_gpu():
    """The committed H100 run (experiments/studies/kernel_bench.py): both kernels equal their references."""
    import pathlib
    path = pathlib.Path(__file__).parent / "assets" / "measured" / "h100_kernels.json"
    r = json.loads(path.read_text())
    checks = [run for run in r["runs"] if run.get("kind") == "check"]
    assert {run["system"] for run in checks} == {"cudnn_packed_attention", "mosaic_grouped_matmul"}
    for rec in checks:
        errs = [v for k, v in rec.items() if k.endswith("rel_err") and not k.startswith("xla")]
        assert errs and max(errs) < 1e-2, rec
