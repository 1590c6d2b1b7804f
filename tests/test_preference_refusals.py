"""Preference data a user gets wrong, and what they are told: an empty response (a note), a mistyped field (named,
with what it holds), two whole conversations that are the same or one the start of the other (TRL's implicit
prompt), a DPO setting that would make every loss NaN, a stale reference file, and a bad file refused by
``DataConfig.check`` (before ``train`` writes or loads anything)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from megatrain_jax.data import DataConfig  # noqa: E402
from megatrain_jax.data.instruct import ChatTokenizer, InstructDataError  # noqa: E402
from megatrain_jax.data.preference import PreferenceData, read_pairs, read_reference, write_reference  # noqa: E402
from megatrain_jax.loss import DPO  # noqa: E402

from test_instruct import make_tokenizer_folder, write_jsonl  # noqa: E402

PLAIN = {"prompt": "what is two plus two? ", "chosen": "four.", "rejected": "the lazy dog."}
USER = {"role": "user", "content": "what is two plus two?"}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return make_tokenizer_folder(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chatml(tokenizer_folder):
    return ChatTokenizer.from_folder(tokenizer_folder)


def learned(tok, ids, mask) -> str:
    return tok.tokenizer.decode([int(t) for t, m in zip(ids[1:], mask) if m], skip_special_tokens=False)


def test_an_empty_response_is_kept_with_a_note_naming_its_line(chatml, tmp_path):
    """An empty (or blank) chosen or rejected response still has a token to learn (the end-of-sequence token, the
    template's end of turn), so the pair is kept; but it is most likely a gap in the data, and said."""
    chat_blank = {"prompt": [USER], "chosen": [assistant("four.")], "rejected": [assistant("  ")]}
    lines = [PLAIN, dict(PLAIN, chosen=""), chat_blank, dict(PLAIN, chosen=" \n")]
    pairs, stats = read_pairs(write_jsonl(tmp_path / "p.jsonl", lines), chatml, seq_len=64)
    assert stats.kept == 4 and len(stats.notes) == 1
    note = stats.notes[0]
    assert f"2 of 4 pairs have an empty chosen response (the first: {tmp_path / 'p.jsonl'}:2)" in note
    assert f"1 of 4 pairs has an empty rejected response (the first: {tmp_path / 'p.jsonl'}:3)" in note
    assert "fill it in or remove those lines" in note
    _, stats = read_pairs(write_jsonl(tmp_path / "q.jsonl", [PLAIN]), chatml, seq_len=64)
    assert stats.notes == []


@pytest.mark.parametrize("line,said", [
    (dict(PLAIN, chosen=None), "'chosen' is null"),
    (dict(PLAIN, rejected=3), "'rejected' is a number"),
    (dict(PLAIN, prompt=True), "'prompt' is a boolean"),
    ({"prompt": [USER], "chosen": assistant("four."), "rejected": [assistant("five.")]}, "'chosen' is an object"),
], ids=["null", "number", "boolean", "object"])
def test_a_mistyped_field_is_named_with_what_it_holds(chatml, tmp_path, line, said):
    with pytest.raises(InstructDataError, match=f"p.jsonl:2: .*here .*{said}"):
        read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, line]), chatml, seq_len=64)


def test_the_implicit_prompt_keeps_each_side_its_last_message(chatml, tmp_path):
    """Two whole conversations that are the same are a pair whose sides are the same (skipped and counted, as
    written in docs/fine_tuning.md), not a response 'without an assistant message'; where one is the start of the
    other, the shorter keeps its last message as its response (TRL's implicit prompt)."""
    same = {"chosen": [USER, assistant("four.")], "rejected": [USER, assistant("four.")]}
    longer = {"chosen": [USER, assistant("four.")],
              "rejected": [USER, assistant("four."), {"role": "user", "content": "sure?"}, assistant("five.")]}
    pairs, stats = read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, same, longer]), chatml, seq_len=96)
    assert [p.line for p in pairs] == [1, 3] and stats.skipped_identical == 1
    (ci, cm), (ri, rm) = pairs[1].chosen, pairs[1].rejected
    assert learned(chatml, ci, cm) == "four.<|im_end|>\n"
    assert learned(chatml, ri, rm) == "four.<|im_end|>\nfive.<|im_end|>\n"


def test_dpo_refuses_an_infinite_beta():
    """beta = inf passed the check (inf > 0) and made the first step's loss NaN (inf times a zero margin)."""
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        DPO(beta=math.inf)


def test_dpo_takes_a_numpy_number():
    """beta read from a NumPy array (a sweep's grid) is a number too."""
    assert DPO(beta=np.float32(0.25), label_smoothing=np.float64(0.1)).beta == np.float32(0.25)
    with pytest.raises(ValueError, match="beta must be"):
        DPO(beta=np.bool_(True))


def test_a_reference_file_of_other_pairs_is_refused(chatml, tmp_path):
    """``write_reference`` keeps the digest of the pairs the reference values were taken on beside them, and
    ``read_reference`` refuses them for other pairs (a resumed run whose data changed: the same number of pairs,
    other tokens), saying what to do, where a check of the shape alone let the run train against the old pairs'
    values."""
    before, _ = read_pairs(write_jsonl(tmp_path / "a.jsonl", [PLAIN, dict(PLAIN, chosen="four!")]), chatml, 64)
    after, _ = read_pairs(write_jsonl(tmp_path / "b.jsonl", [PLAIN, dict(PLAIN, chosen="five!")]), chatml, 64)
    train, held = PreferenceData(before, 64).split(0.5)
    values = -np.arange(4, dtype=np.float32).reshape(2, 2) - 1
    saved = tmp_path / "dpo_reference.npy"
    write_reference(saved, values, [train, held])
    np.testing.assert_array_equal(read_reference(saved, [train, held]), values)
    changed = PreferenceData(after, 64).split(0.5)
    with pytest.raises(ValueError, match="of other pairs .* changed since the run started.* delete .*dpo_reference"):
        read_reference(saved, list(changed))
    with pytest.raises(ValueError, match="of other pairs"):  # the same pairs, split otherwise
        read_reference(saved, [PreferenceData(before, 64)])
    with pytest.raises(ValueError, match=r"of shape \(2, 2\), not of this run's 1 pairs"):
        read_reference(saved, [train])
    np.save(saved, np.array([[-1.0, np.nan], [-2.0, -3.0]], np.float32))
    with pytest.raises(ValueError, match="1 reference log-probabilities that are not finite"):
        read_reference(saved, [train, held])
    write_reference(saved, values, [train, held])
    (tmp_path / "dpo_reference.npy.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="cannot be read"):
        read_reference(saved, [train, held])
    (tmp_path / "dpo_reference.npy.json").unlink()  # a run folder from before the digest: read by its shape
    np.testing.assert_array_equal(read_reference(saved, [train, held]), values)


def test_check_reads_preference_data_as_train_does(tokenizer_folder, tmp_path):
    """``DataConfig.check`` (what ``train`` asks before it writes or loads anything) refused nothing for preference
    data: a bad line, or a split without a pair to train on, was found only after the run folder was made."""
    common = dict(format="preference", mode="padded", batch_size=2, seq_len=64, tokenizer=str(tokenizer_folder),
                  cache_dir=str(tmp_path / "cache"))
    bad = DataConfig(path=str(write_jsonl(tmp_path / "bad.jsonl", [PLAIN, '{"prompt": "a"'])), **common)
    with pytest.raises(InstructDataError, match="bad.jsonl:2: not valid JSON"):
        bad.check(512)
    one = DataConfig(path=str(write_jsonl(tmp_path / "one.jsonl", [PLAIN])), eval_fraction=0.1, **common)
    with pytest.raises(ValueError, match="data.eval_fraction=0.1 holds out 1 of the 1 pairs read, leaving none"):
        one.check(512)
    with pytest.raises(ValueError, match="more than the model's vocab_size = 100"):
        DataConfig(path=str(write_jsonl(tmp_path / "ok.jsonl", [PLAIN])), **common).check(100)
    assert DataConfig(path=str(tmp_path / "ok.jsonl"), **common).check(512) is None


def test_micro_batches_that_split_a_pair_are_refused_as_the_config_is_read():
    """Each micro-batch holds whole (chosen, rejected) pairs: a config whose micro-batches would split one is refused
    before any weights load, with the batch size to use (the engine's own rule, ``EngineConfig.check_rows``)."""
    from megatrain_jax.cli import ConfigError, parse_config
    with pytest.raises(ConfigError, match=r"whole pairs: 2 rows give 1 per micro-batch; use a batch size divisible "
                                          r"by 4"):
        parse_config({"data": {"format": "preference", "path": "p.jsonl", "mode": "padded", "batch_size": 2},
                      "engine": {"micro_batches": 2}})
    parse_config({"data": {"format": "preference", "path": "p.jsonl", "mode": "padded", "batch_size": 4},
                  "engine": {"micro_batches": 2}})
