"""Data pipeline: token file checks, deterministic resumable batches, packing masks, prefetch, prepare_data."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.batch import RowMix, check_batch
from megatrain_jax.data import (DataConfig, Prefetcher, TokenDataset, TokenFile, demo_dataset, demo_tokens,
                                prefetch, write_tokens)

REPO = Path(__file__).resolve().parents[1]


def docs_file(lengths=(5, 1, 9, 30, 3, 12, 17, 2, 8, 26, 4, 11), vocab=50, seed=0) -> TokenFile:
    """Documents of the given lengths with random tokens, in memory."""
    tokens = np.random.default_rng(seed).integers(0, vocab, sum(lengths)).astype(np.uint16)
    return TokenFile.from_array(tokens, vocab, np.concatenate([[0], np.cumsum(lengths)[:-1]]))


def take(it, k):
    return [next(it) for _ in range(k)]


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in
               ("inputs", "targets", "loss_mask", "positions", "segment_ids"))


# --- token files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,dtype", [(300, np.uint16), (70000, np.uint32)])
def test_write_open_roundtrip(tmp_path, vocab, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab, 1000)
    path = write_tokens(tmp_path / "t.bin", tokens, vocab, doc_starts=[0, 10, 500])
    f = TokenFile.open(path)
    assert isinstance(f.tokens, np.memmap) and f.tokens.dtype == dtype
    np.testing.assert_array_equal(f.tokens, tokens)
    np.testing.assert_array_equal(f.doc_starts, [0, 10, 500])
    assert f.vocab_size == vocab and json.loads((tmp_path / "t.bin.json").read_text())["num_docs"] == 3
    f.check_vocab(vocab)


def test_npy_and_no_docs(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    f = TokenFile.open(tmp_path / "t.npy")
    assert f.vocab_size is None and f.doc_starts is None and len(f) == 100
    f.check_vocab(100)
    with pytest.raises(ValueError, match=r"token id 50 at position 50 .*vocab_size is 50; the largest id in the "
                                         r"file is 99"):
        f.check_vocab(50)
    np.save(tmp_path / "f.npy", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="integer"):
        TokenFile.open(tmp_path / "f.npy")
    assert TokenFile.open(write_tokens(tmp_path / "n.bin", np.arange(9), 9)).doc_starts is None


def test_missing_file_says_how_to_create(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.bin.*prepare_data\.py"):
        TokenFile.open(tmp_path / "nope.bin")


def test_truncated_file(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(100), 100)
    path.write_bytes(path.read_bytes()[:150])
    with pytest.raises(ValueError, match="150 bytes.*100 uint16 tokens = 200 bytes.*truncated"):
        TokenFile.open(path)


def test_dtype_too_small_for_vocab(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(10), 10)
    (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 70000, "num_tokens": 10}))
    with pytest.raises(ValueError, match="uint16.*70000.*uint32"):
        TokenFile.open(path)
    with pytest.raises(ValueError, match="cannot hold"):
        write_tokens(tmp_path / "u.bin", np.arange(10), 70000, dtype="uint16")


def test_vocab_exceeds_model(tmp_path):
    f = TokenFile.open(write_tokens(tmp_path / "t.bin", np.arange(10), 32000))
    with pytest.raises(ValueError, match="32000.*vocab_size is 256.*tokenizer"):
        f.check_vocab(256)


@pytest.mark.parametrize("sidecar,match", [
    (None, "no sidecar"),
    ("{not json", "not valid JSON"),
    ({"dtype": "uint16", "vocab_size": 10, "num_tokens": 10, "vocab": 3}, r"unknown keys \['vocab'\]"),
    ({"dtype": "uint16", "num_tokens": 10}, r"missing keys \['vocab_size'\]"),
    ({"dtype": "int8", "vocab_size": 10, "num_tokens": 10}, "dtype must be one of"),
    ({"dtype": "uint16", "vocab_size": 10, "num_tokens": 10, "num_docs": 2}, "index .* is missing"),
])
def test_bad_sidecar(tmp_path, sidecar, match):
    path = write_tokens(tmp_path / "t.bin", np.arange(10), 10)
    side = tmp_path / "t.bin.json"
    if sidecar is None:
        side.unlink()
    else:
        side.write_text(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        TokenFile.open(path)


def test_bad_doc_starts():
    with pytest.raises(ValueError, match="strictly increase"):
        TokenFile.from_array(np.arange(10), 10, [0, 5, 5])


# --- windows ------------------------------------------------------------------------------------------

def test_windows_are_shifted_contiguous_and_cover_an_epoch():
    f = TokenFile.from_array(np.arange(1001), 1001)  # token value = its offset
    ds = TokenDataset(f, seq_len=10)
    assert len(ds) == 100
    it = ds.batches(4, seed=3)
    starts = []
    for b in take(it, 25):
        check_batch(b, 1001)
        assert b.segment_ids is None and b.loss_mask.min() == 1
        np.testing.assert_array_equal(b.targets, b.inputs + 1)
        np.testing.assert_array_equal(b.inputs - b.inputs[:, :1], np.broadcast_to(np.arange(10), (4, 10)))
        starts += list(b.inputs[:, 0])
    assert sorted(starts) == list(range(0, 1000, 10)) and it.state()["epoch"] == 0
    second = [s for b in take(it, 25) for s in b.inputs[:, 0]]
    assert sorted(second) == sorted(starts) and second != starts  # reshuffled per epoch


def test_order_is_seeded():
    ds = TokenDataset(demo_dataset(num_tokens=20000), seq_len=16)
    a, b, c = (take(ds.batches(4, seed=s), 5) for s in (0, 0, 1))
    assert all(same(x, y) for x, y in zip(a, b))
    assert not all(same(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("mode", ["windows", "packed"])
def test_exact_resume_across_epochs(mode):
    ds = TokenDataset(docs_file(), seq_len=8, mode=mode)
    full = take(ds.batches(3, seed=7), 30)
    it = ds.batches(3, seed=7)
    take(it, 11)
    state = json.loads(json.dumps(it.state()))
    resumed = ds.batches(3, seed=7, state=state)
    assert resumed.state() == state
    assert all(same(x, y) for x, y in zip(full[11:], take(resumed, 19)))
    assert state["epoch"] < resumed.state()["epoch"]  # the comparison crossed an epoch boundary
    with pytest.raises(ValueError, match="data.seed: 7 saved, 8 now"):
        ds.batches(3, seed=8, state=state)


# --- packing ------------------------------------------------------------------------------------------

def test_packing_masks_and_segments():
    lengths = (5, 1, 9, 30, 3, 12, 17, 2, 8, 26, 4, 11)
    n, T = sum(lengths), 8
    f = TokenFile.from_array(np.arange(n), n, np.concatenate([[0], np.cumsum(lengths)[:-1]]))  # token = offset
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    ds = TokenDataset(f, seq_len=T, mode="packed")
    assert len(ds) == sum((L - 2) // T + 1 for L in lengths if L >= 2)  # long documents split into pieces
    seen = []
    for b in ds.batches(2, seed=1, shuffle=True, loop=False):
        check_batch(b, n)
        for r in range(2):
            seg, pos, mask = b.segment_ids[r], b.positions[r], b.loss_mask[r]
            real = seg > 0
            assert np.all(mask == real) and np.all(real[:real.sum()])  # loss 0 on padding, padding at the end
            assert np.all(pos[~real] == 0) and np.all(b.inputs[r, ~real] == 0)
            assert np.array_equal(np.unique(seg[real]), np.arange(1, seg.max() + 1))
            assert np.all(np.diff(seg[real]) >= 0)
            for k in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == k)
                np.testing.assert_array_equal(pos[at], np.arange(len(at)))  # positions restart per piece
                first = b.inputs[r, at[0]]
                np.testing.assert_array_equal(b.inputs[r, at], first + np.arange(len(at)))
                np.testing.assert_array_equal(b.targets[r, at], b.inputs[r, at] + 1)
                assert doc_of[first] == doc_of[b.targets[r, at[-1]]]  # no target from another document
                seen += list(b.inputs[r, at])
    # one pass trains on every (input, target) pair of every document exactly once
    want = [i for i in range(n - 1) if doc_of[i] == doc_of[i + 1]]
    assert sorted(seen) == want


def _no_gradient_tokens(b) -> int:
    """A batch row's tokens no loss reaches, read from the batch alone: in each causal run (a packed row's segments,
    its padding one of them; else the whole row), the tokens after the run's last one whose loss counts."""
    runs = b.segment_ids[0] if b.segment_ids is not None else np.zeros(b.shape[1], np.int32)
    dead = 0
    for k in np.unique(runs):
        mask = b.loss_mask[0][runs == k]
        live = np.flatnonzero(mask)
        dead += len(mask) - (int(live[-1]) + 1 if live.size else 0)
    return dead


def test_row_mix_counts_packed_rows_runs_and_the_tokens_no_loss_reaches_as_the_batches_make_them():
    """``row_mix`` over the rows as the batches make them (epoch 0's order, at most ``max_pieces`` a packed row):
    ``attention_span``, the sum of each packed row's runs' lengths squared (pieces, and the padding as one run:
    cuDNN's packed layout runs it) over rows x seq_len, read back from the batches' segment ids (None where each row
    is one document); ``no_gradient``, the share of the rows' tokens no loss reaches (the padding, each piece's
    tokens after its last one in the loss), read back from the batches' masks and runs. Windows and preference
    data are not read (None)."""
    flags = np.random.default_rng(1).integers(0, 2, sum((5, 1, 9, 30, 3, 12, 17, 2, 8, 26, 4, 11))).astype(np.uint8)
    for file in (docs_file(), dataclasses.replace(docs_file(), loss=flags)):
        for mode, pieces in (("packed", None), ("packed", 2), ("padded", None), ("windows", None)):
            ds = TokenDataset(file, seq_len=8, mode=mode, max_pieces=pieces)
            pairs = rows = dead = 0
            for b in ds.batches(1, seed=3, shuffle=True, loop=False):
                dead += _no_gradient_tokens(b)
                if b.segment_ids is not None:
                    seg = b.segment_ids[0]
                    runs = [int((seg == k).sum()) for k in range(seg.max() + 1)]  # 0: the padding
                    pairs += sum(n * n for n in runs)
                rows += 1
            mix = ds.row_mix(seed=3)
            assert mix.no_gradient == pytest.approx(dead / (rows * 8)), (mode, pieces, file.loss is not None)
            if mode == "packed":
                assert mix.attention_span == pytest.approx(pairs / (rows * 8))
                assert ds.row_mix(seed=3, rows=2) != mix  # the first rows only
            else:
                assert mix.attention_span is None
    # a prompt before its answer is out of the loss but the answer's loss reaches it; a tail after it is not
    prompt_first = dataclasses.replace(docs_file((9,)), loss=np.array([0, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8))
    assert TokenDataset(prompt_first, seq_len=8, mode="packed").row_mix() == RowMix(8.0, 0.0)
    tail_after = dataclasses.replace(docs_file((9,)), loss=np.array([0, 1, 1, 1, 0, 0, 0, 0, 0], np.uint8))
    assert TokenDataset(tail_after, seq_len=8, mode="packed").row_mix() == RowMix(8.0, 5 / 8)
    full = TokenDataset(docs_file((9,) * 6), seq_len=8, mode="packed")  # one piece fills each row
    assert full.row_mix() == RowMix(8.0, 0.0)
    assert TokenDataset(docs_file((5,)), seq_len=8, mode="padded").row_mix() == RowMix(None, 4 / 8)  # its padding
    with pytest.raises(ValueError, match="between 0 and 1"):
        RowMix(None, 1.5)


def test_segment_mask_keeps_attention_inside_documents():
    ds = TokenDataset(docs_file(), seq_len=16, mode="packed")
    b = next(ds.batches(4, seed=0))
    seg = b.segment_ids
    T = seg.shape[1]
    # the model's mask: same segment AND causal (see models/layers.py Attention)
    allowed = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((T, T), bool))
    for r in range(seg.shape[0]):
        for q in np.flatnonzero(seg[r]):
            keys = np.flatnonzero(allowed[r, q])
            assert np.all(seg[r, keys] == seg[r, q]) and keys.min() == q - b.positions[r, q]
            assert np.all(keys <= q)
        assert allowed[r].any(axis=1).all()  # every query (padding too) sees at least itself: no NaN rows


def test_a_reshuffled_epoch_that_packs_short_of_a_batch_is_passed_over():
    """Packing depends on the order: these 13 documents pack into 9 rows of 16 tokens in epoch 0 (one batch of 9,
    so the run starts) but into 8 in epoch 4. That epoch is passed over, as an epoch's incomplete tail is, rather
    than stopping the run there; the stream's state still resumes it exactly."""
    ds = TokenDataset(docs_file(), seq_len=16, mode="packed")
    it = ds.batches(9, seed=0)
    got = take(it, 5)  # epochs 0-3, then 5
    assert it.state()["epoch"] == 5 and all(b.shape == (9, 16) for b in got)
    assert not same(got[3], got[4])
    again = ds.batches(9, seed=0)
    take(again, 3)
    resumed = ds.batches(9, seed=0, state=again.state())
    assert all(same(a, b) for a, b in zip(take(resumed, 2), got[3:]))


def test_packed_needs_documents():
    with pytest.raises(ValueError, match="document boundaries"):
        TokenDataset(TokenFile.from_array(np.arange(100), 100), 8, mode="packed")


# --- held-out split ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["windows", "packed"])
def test_eval_split_disjoint_and_complete(mode):
    f = TokenFile.from_array(np.arange(5000) % 60000, 60000, np.arange(0, 5000, 37))  # token = offset
    train = TokenDataset(f, 16, mode=mode, split="train", eval_fraction=0.1)
    evals = TokenDataset(f, 16, mode=mode, split="eval", eval_fraction=0.1)

    def used(ds):
        return {int(t) for s, L in zip(ds.starts, ds.lengths) for t in range(s, s + L)}

    assert not used(train) & used(evals) and max(used(train)) < min(used(evals))
    batches = list(evals.batches(3))  # one ordered pass, last batch padded with loss_mask 0
    got = {int(t) for b in batches for t in b.inputs[b.loss_mask > 0]}
    want = {int(s + i) for s, L in zip(evals.starts, evals.lengths) for i in range(L - 1)}
    assert got == want and all(b.shape == (3, 16) for b in batches)
    assert [b.inputs.tolist() for b in batches] == [b.inputs.tolist() for b in evals.batches(3)]


def test_a_split_too_short_for_a_window_says_which_way_eval_fraction_goes():
    """The held-out share shrinks the train split and grows the eval split: the advice follows."""
    f = TokenFile.from_array(np.arange(1000) % 50, 50)
    with pytest.raises(ValueError) as err:
        TokenDataset(f, 32, split="train", eval_fraction=0.99)
    assert "the train split of the tokens (1000 tokens, eval_fraction=0.99) holds no window" in str(err.value)
    assert "a smaller eval_fraction" in str(err.value) and "larger" not in str(err.value)
    with pytest.raises(ValueError, match=r"the eval split .*\(a window takes 33 tokens\); use an eval_fraction of at "
                                         r"least 0\.033, more data or a shorter seq_len"):
        TokenDataset(f, 32, split="eval", eval_fraction=0.01)


# --- prefetch ------------------------------------------------------------------------------------------

def test_prefetch_same_sequence_and_state():
    ds = TokenDataset(docs_file(), seq_len=8, mode="packed")
    plain = take(ds.batches(2, seed=4), 12)
    with prefetch(ds.batches(2, seed=4), 3) as it:
        got = take(it, 5)
        state = it.state()  # the consumer's position, not the producer's read-ahead
        got += take(it, 7)
    assert all(same(x, y) for x, y in zip(plain, got))
    assert state["batches"] == 5
    assert all(same(x, y) for x, y in zip(plain[5:], take(ds.batches(2, seed=4, state=state), 7)))
    assert list(prefetch(iter(range(5)), 2)) == list(range(5))


class _Gated:
    """0, 1, 2, ... with a ``state``/``restore`` position; reading an item past ``hold`` waits for ``gate`` after
    taking its position (as a batch read from a slow disk does)."""

    def __init__(self, hold: int, gate):
        self.pos, self.hold, self.gate = 0, hold, gate

    def __iter__(self):
        return self

    def __next__(self) -> int:
        at = self.pos
        if at >= self.hold:
            self.gate.wait()
        self.pos = at + 1
        return at

    def state(self) -> dict:
        return {"pos": self.pos}

    def restore(self, state: dict) -> None:
        self.pos = state["pos"]


def test_a_restore_while_a_slow_batch_is_read_hands_out_the_restored_stream_only(monkeypatch):
    """The read-ahead thread inside a batch that outlasts ``close``'s wait: before, ``restore`` went on beside it, the
    stream was restored under it, and its item landed in the new queue (a batch from before the restore, twice)."""
    import threading
    monkeypatch.setattr(Prefetcher, "JOIN_S", 0.1, raising=False)
    gate = threading.Event()
    source = _Gated(hold=2, gate=gate)
    it = prefetch(source, 1)
    assert next(it) == 0
    state = it.state()  # after item 0; the thread holds item 1 in its queue and waits inside item 2
    threading.Timer(0.5, gate.set).start()
    it.restore(state)
    assert [next(it) for _ in range(4)] == [1, 2, 3, 4]
    it.close()


def test_prefetch_propagates_exception_and_closes():
    def gen():
        yield 1
        yield 2
        raise RuntimeError("bad shard")

    it = prefetch(gen(), 4)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(RuntimeError, match="bad shard"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    endless = prefetch(iter(lambda: 0, 1), 2)
    next(endless)
    endless.close()
    endless.close()
    assert not endless.producing


# --- demo data and config ------------------------------------------------------------------------------

def test_demo_corpus_is_deterministic_and_learnable():
    a, starts = demo_tokens(256, 50000, seed=0)
    b, _ = demo_tokens(256, 50000, seed=0)
    assert len(a) == 50000 and a.dtype == np.uint16 and a.max() < 256 and np.array_equal(a, b)
    assert not np.array_equal(a, demo_tokens(256, 50000, seed=1)[0])
    assert np.all(a[starts[1:] - 1] == 0)  # every document ends with id 0
    counts = np.bincount(a[:-1].astype(np.int64) * 256 + a[1:], minlength=256 * 256).reshape(256, 256)
    top4 = np.sort(counts, axis=1)[:, -4:].sum()
    assert top4 > 0.95 * counts.sum()  # 4 successors per token: a bigram model already does well
    pickle.dumps(demo_dataset(num_tokens=1000))


def test_data_config_build_and_resume(tmp_path):
    tokens, starts = demo_tokens(256, 20000)
    path = write_tokens(tmp_path / "d.bin", tokens, 256, starts)
    cfg = DataConfig(path=str(path), seq_len=32, batch_size=4, mode="packed", eval_fraction=0.05, prefetch=2)
    it = cfg.build(model_vocab=256)
    first = take(it, 6)
    state = it.state()
    it.close()
    resumed = cfg.build(model_vocab=256, state=state)
    assert same(next(resumed), take(cfg.build(model_vocab=256), 7)[6])
    assert sum(1 for _ in cfg.build_eval(256)) > 0 and first[0].shape == (4, 32)
    with pytest.raises(ValueError, match="vocab"):
        cfg.build(model_vocab=100)
    assert next(DataConfig(batch_size=2, seq_len=8, demo_tokens=5000).build(256)).shape == (2, 8)
    mix = cfg.row_mix(256, 3)  # the demo's documents, at most 3 a row of 32: padding at the rows' ends
    assert 0 < mix.no_gradient < 1 and 0 < mix.attention_span <= 32
    assert dataclasses.replace(cfg, mode="windows", path="/no/such/file").row_mix(256) is None  # not read


# --- prepare_data ------------------------------------------------------------------------------------

def _prepare_data_module():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_roundtrip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = "the cat sat on a mat dog ran far".split()
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>"] + words)},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = ["the cat sat", "on a mat", "dog ran far far"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs[:2]) + "\n\n")
    (tmp_path / "b.txt").write_text(f"{docs[2]}\n\n\n")
    out = _prepare_data_module().main(["--tokenizer", str(tmp_path / "tokenizer.json"), "--text-field", "body",
                                       "--out", str(tmp_path / "out" / "c.bin"),
                                       str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    f = TokenFile.open(out)
    assert f.vocab_size == 11 and f.eos_id == 1 and len(f.doc_starts) == 3
    expected = [tok.encode(d).ids + [1] for d in docs]
    np.testing.assert_array_equal(f.tokens, np.concatenate(expected))
    np.testing.assert_array_equal(f.doc_starts, [0, 4, 8])
    assert next(TokenDataset(f, 4, mode="packed").batches(2, seed=0)).shape == (2, 4)


def test_prepare_data_demo_and_cli_errors(tmp_path):
    module = _prepare_data_module()
    f = TokenFile.open(module.main(["--demo", "--demo-tokens", "3000", "--out", str(tmp_path / "demo.bin")]))
    assert np.array_equal(f.tokens, demo_tokens(256, 3000)[0]) and f.eos_id == 0
    with pytest.raises(SystemExit):
        module.main(["--out", str(tmp_path / "x.bin")])  # neither inputs nor --demo


# --- issue 13: broken token files and out-of-range ids say which file, what is wrong, what to do ----

def _truncated_npy(path: Path) -> None:
    np.save(path, np.arange(1000, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:300])


def _header_cut_npy(path: Path) -> None:
    np.save(path, np.arange(10, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize("make, problem", [
    (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
    (lambda p: p.write_bytes(b"this is not numpy" * 10), r"is not a \.npy file"),
    (_truncated_npy, r"is a truncated or corrupt \.npy file"),
    (_header_cut_npy, r"is a truncated or corrupt \.npy file"),
], ids=["empty", "garbage", "truncated-data", "truncated-header"])
def test_broken_npy_token_file_is_a_clear_error(tmp_path, make, problem):
    path = tmp_path / "train.npy"
    make(path)
    with pytest.raises(ValueError) as err:  # never numpy's bare EOFError, nor its advice to unpickle
        DataConfig(path=str(path)).open(256)
    msg = str(err.value)
    assert re.search(rf"^{re.escape(str(path))} {problem}", msg), msg
    assert "np.save" in msg and "prepare_data.py" in msg and "allow_pickle" not in msg, msg


def test_an_npz_token_file_says_what_a_token_file_is(tmp_path):
    path = tmp_path / "train.npz"
    np.savez(path, tokens=np.arange(100))
    with pytest.raises(ValueError, match=r"train\.npz is a \.npz archive, not a token file: token files are a \.npy "
                                         r"holding one 1-D integer array \(np\.save\(path, tokens\)\) or a \.bin"):
        DataConfig(path=str(path)).open(256)


def test_broken_document_index_is_a_clear_error(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(100), 100, doc_starts=[0, 10, 50])
    Path(f"{path}.idx.npy").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}\.idx\.npy is empty.*prepare_data\.py"):
        TokenFile.open(path)


def test_bin_of_the_wrong_size_names_the_file_and_the_fix(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(100), 100)
    for size in (0, 151, 400):
        path.write_bytes(b"\0" * size)
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is {size} bytes but its sidecar says 100 "
                                             r"uint16 tokens = 200 bytes.*re-run scripts/prepare_data\.py"):
            TokenFile.open(path)


@pytest.mark.parametrize("bad_id, match", [
    (-3, r"token id -3 at position 1234 .* is negative"),
    (300, r"token id 300 at position 1234 .* outside \[0, 256\) \(the model's vocab_size is 256; the largest id "
          r"in the file is 300\)"),
])
def test_npy_ids_out_of_range_name_the_file_and_the_first_position(tmp_path, bad_id, match):
    tokens = np.arange(5000, dtype=np.int64) % 256
    tokens[[1234, 4000]] = bad_id
    path = tmp_path / "t.npy"
    np.save(path, tokens)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {match}"):
        DataConfig(path=str(path), seq_len=16, batch_size=2).build(256)


def test_bin_ids_beyond_its_sidecar_vocab_are_found_at_open(tmp_path, monkeypatch):
    """A .bin is scanned in full when opened for a model, as a .npy is (chunk by chunk: the bad id here is in
    the third chunk), so a corrupt id stops the run before it starts, not hours in; opened without a model, the
    batch that reads it still catches it."""
    monkeypatch.setattr("megatrain_jax.data.tokens._SCAN_CHUNK", 64)
    tokens = np.arange(200) % 100
    path = write_tokens(tmp_path / "t.bin", tokens, 100)
    raw = np.fromfile(path, np.uint16)
    raw[150] = 4000
    raw.tofile(path)
    message = (rf"^{re.escape(str(path))}: token id 4000 at position 150 .*outside \[0, 100\) \(the vocab_size in its "
               rf"sidecar is 100; the largest id in the file is 4000\); the file is corrupt or its sidecar "
               rf"{re.escape(str(path))}\.json is stale: re-create both")
    with pytest.raises(ValueError, match=message):
        DataConfig(path=str(path), seq_len=10, batch_size=2, prefetch=0).dataset("train", 256)
    batches = TokenDataset(path, 10).batches(2, shuffle=False)
    with pytest.raises(ValueError, match=rf"token id 4000 at position 150 .*outside \[0, 100\) \(the vocab_size in "
                                         r"its sidecar is 100\)"):
        take(batches, 10)


def test_a_token_file_is_scanned_once_a_process_until_it_changes(tmp_path, monkeypatch):
    """train opens its corpus up to three times at start (what the rows hold, training, evaluation): a file found
    clean is not scanned again while its size and modification time stay; rewritten, it is, and a bad id refused."""
    path = write_tokens(tmp_path / "t.bin", np.arange(200) % 100, 100)
    scans = []
    scan = TokenFile.first_bad_id
    monkeypatch.setattr(TokenFile, "first_bad_id", lambda self, *a, **k: scans.append(1) or scan(self, *a, **k))
    for _ in range(3):
        DataConfig(path=str(path), seq_len=10, batch_size=2, prefetch=0).dataset("train", 256)
    assert len(scans) == 1
    raw = np.fromfile(path, np.uint16)
    raw[150] = 4000
    raw.tofile(path)
    os.utime(path, ns=(1, 1))  # another modification time, whatever the clock's resolution
    with pytest.raises(ValueError, match="token id 4000 at position 150"):
        DataConfig(path=str(path), seq_len=10, batch_size=2, prefetch=0).dataset("train", 256)


def test_an_eos_id_outside_the_vocabulary_is_refused(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(10), 10, eos_id=9)
    sidecar = tmp_path / "t.bin.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "eos_id": 10}))
    with pytest.raises(ValueError, match=rf"sidecar {re.escape(str(sidecar))}: eos_id 10 is outside the vocabulary "
                                         r"\[0, 10\).*re-run scripts/prepare_data\.py"):
        TokenFile.open(path)
    with pytest.raises(ValueError, match=r"eos_id 12 is outside the vocabulary \[0, 10\)"):
        write_tokens(tmp_path / "u.bin", np.arange(10), 10, eos_id=12)


def test_in_memory_negative_ids_are_caught_when_read():
    tokens = np.arange(100, dtype=np.int32)
    tokens[42] = -1
    batches = TokenDataset(TokenFile.from_array(tokens), 10).batches(2, shuffle=False)
    with pytest.raises(ValueError, match=r"^in-memory tokens: token id -1 at position 42 .* is negative"):
        take(batches, 5)


@pytest.mark.parametrize("make", [lambda: DataConfig(mode="pakced"),
                                  lambda: TokenDataset(docs_file(), 8, mode="pakced")])
def test_mode_typo_says_did_you_mean(make):
    with pytest.raises(ValueError, match=r"mode must be one of 'windows', 'packed', 'padded', got 'pakced'; "
                                         r"did you mean 'packed'\?"):
        make()


def test_each_process_gets_its_own_rows_and_they_make_the_global_batch():
    from megatrain_jax.data import TokenDataset, TokenFile
    toks = np.arange(4000, dtype=np.int32) % 97
    ds = TokenDataset(TokenFile.from_array(toks, 97), 16)
    whole = ds.batches(8, seed=3)
    parts = [ds.batches(8, seed=3, process=(i, 2)) for i in range(2)]
    for _ in range(3):
        b = next(whole)
        mine = [next(p) for p in parts]
        np.testing.assert_array_equal(np.concatenate([m.inputs for m in mine]), b.inputs)
    assert parts[0].state() == parts[1].state() == whole.state()  # a global position: resumable under any layout
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        ds.batches(6, process=(0, 4))


def test_the_demo_corpus_is_made_once_a_process_and_read_only():
    """A start reads the demo corpus several times (the data check, the row mix, both splits): it is made once, and
    no reader can change what the others read."""
    from megatrain_jax.data.demo import _corpus, demo_dataset
    _corpus.cache_clear()
    a, b = demo_dataset(256, 4096), demo_dataset(256, 4096)
    assert _corpus.cache_info().misses == 1 and _corpus.cache_info().hits == 1
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    with pytest.raises(ValueError, match="read-only"):
        np.asarray(a.tokens)[0] = 1
