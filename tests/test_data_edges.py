"""Data at its edges, as a user meets them through the command line: a file shorter than a batch, a held-out share
with no whole window, a packed epoch short of a batch, rows past the model's positions, instruction data of which
nothing is left. Each is refused by ``train`` before anything is written or loaded, with the setting to change, and
``plan`` says the same (exit 2); a run that outlasts its data says it goes over it again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli import ConfigError, load_config, main
from megatrain_jax.data import DataConfig, write_tokens

TINY = ["model.preset=tiny", "data.prefetch=0", "log.tensorboard=false", "log.progress=lines",
        "optimizer.warmup_steps=0"]


def _tokens(path: Path, n: int, doc_starts=None) -> Path:
    return write_tokens(path, np.random.default_rng(0).integers(0, 256, n), 256, doc_starts=doc_starts)


def _plan_and_train(tmp_path: Path, capsys, args: list[str]) -> tuple[str, str]:
    """``plan`` then ``train`` with ``args``, both refused (exit 2): their errors; the run folder never made."""
    assert main(["plan", *TINY, *args]) == 2
    planned = capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", *TINY, *args, f"train.run_dir={run}"]) == 2
    trained = capsys.readouterr()
    assert not run.exists() and "params" not in trained.out  # refused before the start line, nothing written
    return planned, trained.err


@pytest.mark.parametrize("tokens,args,match", [
    (40, ["data.seq_len=16", "data.batch_size=4"],
     r"the train split of \S+ \(40 tokens\) holds 2 window\(s\) of seq_len=16, fewer than data\.batch_size=4 \(a "
     r"batch of 4 windows takes 65 tokens\); use more data, a smaller data\.batch_size or a shorter data\.seq_len"),
    (10, ["data.seq_len=16", "data.batch_size=4"], r"holds no window of seq_len=16 \(a window takes 17 tokens\)"),
    (1000, ["data.seq_len=16", "data.batch_size=4", "data.eval_fraction=0.001"],
     r"the eval split of .* holds no window of seq_len=16 .*use an eval_fraction of at least 0\.017"),
    (1000, ["data.seq_len=16", "data.batch_size=4", "data.eval_fraction=0.95"],
     r"holds 3 window\(s\) .* or a smaller data\.eval_fraction"),
    (0, ["data.seq_len=16", "data.batch_size=4"], r"\(0 tokens, eval_fraction=0\) holds no window of seq_len=16"),
], ids=["shorter_than_a_batch", "shorter_than_a_row", "no_held_out_window", "training_share_short_of_a_batch",
        "empty"])
def test_token_data_short_of_a_batch_is_refused_by_plan_as_by_train(tmp_path, capsys, tokens, args, match):
    """Before, ``plan`` passed (exit 0) every one of these, which ``train`` refused."""
    path = _tokens(tmp_path / "t.bin", tokens)
    planned, trained = _plan_and_train(tmp_path, capsys, [f"data.path={path}", "train.steps=2", *args])
    assert "train would refuse this data" in planned
    for err in (planned, trained):
        assert len(re.findall(match, err)) == 1, err


def test_a_packed_epoch_short_of_a_batch_is_refused_when_the_stream_is_made(tmp_path, capsys):
    """20 documents of 30 tokens pack into 10 rows of 64: fewer than a batch of 16. Before, the stream was made and
    refused its first batch inside fit, once the model had loaded; ``plan`` passed it."""
    path = _tokens(tmp_path / "docs.bin", 600, doc_starts=range(0, 600, 30))
    d = DataConfig(path=str(path), seq_len=64, batch_size=16, mode="packed", prefetch=0)
    with pytest.raises(ValueError, match=r"holds 20 document\(s\), 580 \(input, target\) pairs, which pack into 10 "
                                         r"row\(s\) of seq_len=64, fewer than data\.batch_size=16"):
        d.build(256)
    assert DataConfig(path=str(path), seq_len=64, batch_size=10, mode="packed").check(256) == 1  # exactly one batch
    planned, trained = _plan_and_train(tmp_path, capsys, [f"data.path={path}", "data.mode=packed", "data.seq_len=64",
                                                          "data.batch_size=16", "train.steps=2"])
    assert "pack into 10 row(s)" in planned and "pack into 10 row(s)" in trained


def test_padded_rows_past_max_positions_are_refused_as_the_config_is_read():
    """A padded row's positions run 0..seq_len-1 whatever its document, as a window's do: every batch would be
    refused. Before, only windows were; padded rows (and preference pairs, padded) got the packed rows' note, and
    train failed at its first step, after the model had loaded."""
    with pytest.raises(ConfigError, match=r"data\.seq_len=600 is longer than the model's max_positions=512: train "
                                          r"would refuse every batch \(a padded row's positions run to seq_len"):
        load_config(None, ["data.mode=padded", "data.seq_len=600"])
    assert load_config(None, ["data.mode=packed", "data.seq_len=600"]).data.mode == "packed"  # noted, not refused


def test_a_packed_piece_past_max_positions_is_refused_before_the_model_loads(tmp_path, capsys):
    """Packed rows restart their positions at each document, so seq_len may pass max_positions while every document
    is shorter; one of 700 tokens makes a piece of 600 positions. Before, train refused the batch that held it, a
    step in (at any step: hours in, on a large file), and plan passed."""
    lengths = [30] * 40 + [700] + [30] * 40
    path = _tokens(tmp_path / "docs.bin", sum(lengths), doc_starts=np.cumsum([0] + lengths[:-1]))
    planned, trained = _plan_and_train(tmp_path, capsys, [f"data.path={path}", "data.mode=packed",
                                                          "data.seq_len=600", "data.batch_size=2", "train.steps=30"])
    for err in (planned, trained):
        assert ("holds a document piece of 600 positions, more than the model's max_positions=512 (the batch holding "
                "it would be refused); use a data.seq_len of at most 512") in err, err


def test_a_run_longer_than_its_data_says_it_goes_over_it_again(tmp_path, capsys):
    """65 tokens are exactly one batch of 4 windows of 16: three steps go over them three times, said at start."""
    path = _tokens(tmp_path / "one_batch.bin", 65)
    args = ["train", *TINY, f"data.path={path}", "data.seq_len=16", "data.batch_size=4", "train.steps=3"]
    assert main([*args, f"train.run_dir={tmp_path / 'run'}"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: train.steps=3 batches of 4 rows go over the training split's 4 rows 3.0 times" in out, out
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


# ------------------------------------------------------------------------------------------ instruction data
SHORT = {"messages": [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """test_instruct's tiny byte-level BPE with a ChatML template (needs tokenizers and jinja2)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from test_instruct import make_tokenizer_folder
    return make_tokenizer_folder(tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_instruction_data_of_which_nothing_is_left_says_which_seq_len_keeps_some(tokenizer, tmp_path):
    """Every example too long and skipped, or cut before its answer: the error says the seq_len that keeps one (and
    that truncation would keep them all). Before, it only counted them."""
    from megatrain_jax.data.instruct import ChatTokenizer, InstructDataError, read_examples
    tok, path = ChatTokenizer.from_folder(tokenizer), write_jsonl(tmp_path / "d.jsonl", [SHORT] * 3)
    n = len(read_examples(path, tok, 1000)[0][0].ids)
    with pytest.raises(InstructDataError, match=rf"3 too long and skipped.*; a data\.seq_len of at least {n - 1} "
                                                r"keeps one, or data\.too_long = 'truncate' cuts them"):
        read_examples(path, tok, n - 2, "skip")
    assert read_examples(path, tok, n - 1, "skip")[1].kept == 3
    with pytest.raises(InstructDataError, match=r"3 with no assistant token left after truncation\); a data\.seq_len "
                                                r"of at least (\d+) keeps one$") as caught:
        read_examples(path, tok, 4)
    least = int(caught.value.args[0].rsplit("at least ", 1)[1].split()[0])
    assert read_examples(path, tok, least)[1].kept == 3
    with pytest.raises(InstructDataError):
        read_examples(path, tok, least - 1)


def test_instruction_data_short_of_a_batch_or_a_split_names_the_jsonl_file(tokenizer, tmp_path, capsys):
    """One example with a batch of 8, or held out whole: the error names the user's file, not the tokenized cache
    file; plan and train say the same, and train writes nothing."""
    path = write_jsonl(tmp_path / "one.jsonl", [SHORT])
    common = [f"data.path={path}", "data.format=chat", f"data.tokenizer={tokenizer}", "model.vocab_size=512",
              f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "train.steps=2"]
    for mode, more, said in (("padded", ["data.batch_size=8"], "holds 1 document(s), one a row, fewer than "
                                                               "data.batch_size=8"),
                             ("packed", ["data.batch_size=8"], "which pack into 1 row(s) of seq_len=32, fewer than "
                                                               "data.batch_size=8"),
                             ("packed", ["data.batch_size=1", "data.eval_fraction=0.5"],
                              "eval_fraction=0.5) holds no document")):
        planned, trained = _plan_and_train(tmp_path, capsys, [*common, f"data.mode={mode}", *more])
        for err in (planned, trained):
            assert f"the train split of {path} (" in err and said in err and "cache" not in err, err
