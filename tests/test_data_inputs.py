"""The data a user brings, as a demanding user brings it: ``scripts/prepare_data.py`` on JSON lines with a bad line,
bytes that are not UTF-8, a byte-order mark, ``.json`` files, an empty corpus, an output that would overwrite an
input or a token file already made; token files given as a folder or as raw text; instruction and preference data
with a byte-order mark, a folder for ``data.path`` and a file for ``data.tokenizer``. Bad input is refused with the
file and line and what to do, before anything is written; nothing already saved is lost; valid input is read."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli import main
from megatrain_jax.data import TokenFile, TokenWriter, write_tokens

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from test_instruct import make_tokenizer_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "prepare_data.py"
WORDS = "the cat sat on a mat dog ran far".split()
TINY = ["model.preset=tiny", "data.prefetch=0", "log.tensorboard=false", "log.progress=lines", "train.steps=2",
        "data.seq_len=16", "data.batch_size=2"]


def _prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tok(tmp_path) -> Path:
    """A word-level tokenizer.json with ``</s>`` as the end of document: ids 0..10."""
    from tokenizers import models, pre_tokenizers
    t = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>"] + WORDS)},
                                              unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    t.save(str(tmp_path / "tok" / "tokenizer.json"))
    return tmp_path / "tok" / "tokenizer.json"


def _run(tok: Path, out: Path, *inputs: Path, extra: tuple[str, ...] = ()) -> Path:
    return _prepare_data().main(["--tokenizer", str(tok), "--out", str(out), *extra, *map(str, inputs)])


def _refusal(tok: Path, out: Path, *inputs: Path, extra: tuple[str, ...] = ()) -> str:
    """What prepare_data.py says refusing the inputs (a SystemExit carrying its one-line message)."""
    with pytest.raises(SystemExit) as err:
        _run(tok, out, *inputs, extra=extra)
    assert isinstance(err.value.code, str), err.value.code
    assert "\n" not in err.value.code
    return err.value.code


def _ids(text: str) -> list[int]:
    return [WORDS.index(w) + 2 for w in text.split()] + [1]


# --- prepare_data.py: every bad line is named -------------------------------------------------------------------

@pytest.mark.parametrize("second,match", [
    (b'{"text": the cat}', r"b\.jsonl:2: not valid JSON \(Expecting value at column 10\)"),
    (b'{"text": "the \xff cat"}', r"b\.jsonl:2 is not UTF-8 text \(byte 0xff at column 15\); save the file as UTF-8"),
    (b'["the cat"]', r"b\.jsonl:2: each line must be a JSON object, got list"),
    (b'{"body": "the cat"}', r"b\.jsonl:2: expected a JSON object with a string field 'text' \(found keys "
                             r"\['body'\]\); set --text-field"),
], ids=["not_json", "not_utf8", "not_an_object", "misnamed_field"])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, tok, second, match):
    """Before, a line that was not JSON or not UTF-8 ended the script in json's or the codec's traceback, which named
    neither the file nor the line."""
    data = tmp_path / "b.jsonl"
    data.write_bytes(b'{"text": "the cat sat"}\n' + second + b"\n")
    msg = _refusal(tok, tmp_path / "out.bin", data)
    assert re.search(match, msg), msg


def test_the_script_refuses_bad_input_in_one_line_with_exit_status_2(tmp_path, tok):
    """Before: a traceback, exit status 1."""
    data = tmp_path / "b.jsonl"
    data.write_text('{"text": "the cat sat"}\nnot json\n')
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer", str(tok), "--out", str(tmp_path / "o.bin"),
                           str(data)], capture_output=True, text=True)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"prepare_data.py: error: {data}:2: not valid JSON"), done.stderr


@pytest.mark.parametrize("name,text", [("a.jsonl", '{"text": "the cat sat"}\r\n\r\n{"text": "dog ran"}\r\n'),
                                       ("a.txt", "the cat sat\r\n\r\ndog ran\r\n")])
def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_plain_utf8(tmp_path, tok, name, text):
    """Before, a byte-order mark (Windows editors write one) was refused by json (a traceback) or, in plain text,
    tokenized as the first document's first characters."""
    plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
    plain.write_text(text.replace("\r\n", "\n"))
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    want = _ids("the cat sat") + _ids("dog ran")
    for path in (plain, marked):
        f = TokenFile.open(_run(tok, tmp_path / f"{path.name}.bin", path))
        assert f.tokens.tolist() == want and f.doc_starts.tolist() == [0, 4], path


@pytest.mark.parametrize("name", ["a.json", "a.JSONL"])
def test_json_and_upper_case_jsonl_files_are_read_as_json_lines(tmp_path, tok, name):
    """Before, only a lower-case ``.jsonl`` was JSON lines: a ``.json`` (what ``datasets``' ``to_json`` writes) or a
    ``.JSONL`` was tokenized as plain text, braces, keys and all, without a word."""
    path = tmp_path / name
    path.write_text('{"text": "the cat sat"}\n{"text": "dog ran"}\n')
    assert TokenFile.open(_run(tok, tmp_path / "o.bin", path)).tokens.tolist() == _ids("the cat sat") + _ids("dog ran")


# --- prepare_data.py: nothing already saved is lost -------------------------------------------------------------

@pytest.mark.parametrize("content,said", [(b'{"text": "dog ran"}\n{"text": oops}\n', "bad.jsonl:2: not valid JSON"),
                                          (b"", "no document"), (b"\n\n  \n", "no document"),
                                          (b'{"text": ""}\n', "no document")],
                         ids=["bad_line", "empty", "blank", "empty_texts"])
def test_a_refused_run_keeps_the_token_file_already_at_out(tmp_path, tok, content, said):
    """Before, the output was opened (emptied) and its sidecar deleted at once: a bad line on the second run lost the
    first run's token file, and an empty input silently replaced it by a file of 0 tokens."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "the cat sat on a mat"}\n')
    out = _run(tok, tmp_path / "data" / "train.bin", good)
    before = sorted(os.listdir(out.parent))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    msg = _refusal(tok, out, bad)
    assert said in msg, msg
    assert TokenFile.open(out).tokens.tolist() == _ids("the cat sat on a mat")
    assert sorted(os.listdir(out.parent)) == before  # no temporary file left behind


def test_inputs_are_checked_before_the_output_is_touched(tmp_path, tok):
    """Before, a missing input was found only when reached, after the output had been emptied (and a folder was
    'not found'); an input given as ``--out`` was emptied before it was read: the corpus itself was lost."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat\n")
    out = _run(tok, tmp_path / "train.bin", corpus)
    kept = out.read_bytes()
    assert "input file" in _refusal(tok, out, corpus, tmp_path / "missing.jsonl")
    assert f"input {tmp_path} is a folder, not a file" in _refusal(tok, out, corpus, tmp_path)
    msg = _refusal(tok, corpus, corpus)
    assert f"input {corpus} is what --out {corpus} would write over" in msg and "corpus.tokens.bin" in msg, msg
    assert corpus.read_text() == "the cat sat\n" and not Path(f"{corpus}.json").exists()
    assert "would write over" in _refusal(tok, out, Path(f"{out}.json"))
    assert f"--out {tmp_path} is a folder" in _refusal(tok, tmp_path, corpus)
    assert out.read_bytes() == kept


def test_a_vocab_size_smaller_than_the_tokenizer_is_refused_before_reading(tmp_path, tok):
    """Before, the first id past it failed the writer deep in the loop: a traceback, the output lost."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "far far"}\n')
    msg = _refusal(tok, tmp_path / "o.bin", path, extra=("--vocab-size", "5"))
    assert msg.startswith("--vocab-size 5 is smaller than the 11 tokens of"), msg
    assert TokenFile.open(_run(tok, tmp_path / "o.bin", path, extra=("--vocab-size", "64"))).vocab_size == 64


def test_the_tokenizer_may_be_its_folder_and_a_file_it_cannot_read_is_named(tmp_path, tok):
    """Before, the model's folder was 'not found' and a file that is no tokenizer ended in the library's traceback,
    which names no file."""
    path = tmp_path / "a.txt"
    path.write_text("the cat\n")
    assert TokenFile.open(_run(tok.parent, tmp_path / "o.bin", path)).tokens.tolist() == _ids("the cat")
    (tok.parent / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    msg = _refusal(tok.parent / "tokenizer_config.json", tmp_path / "o.bin", path)
    assert msg.startswith(f"{tok.parent / 'tokenizer_config.json'} is not a tokenizer file"), msg


# --- TokenWriter: a rewrite replaces the file whole, or not at all ----------------------------------------------

def test_a_failed_rewrite_keeps_the_file_and_a_finished_one_replaces_it_whole(tmp_path):
    """Before, ``TokenWriter`` emptied the file and deleted its sidecar as it opened: a write that failed half way
    lost the old file, and a run memory-mapping it saw it cut short under it."""
    path = write_tokens(tmp_path / "t.bin", np.arange(100) % 50, 50, doc_starts=[0, 40])
    reading = TokenFile.open(path)
    with pytest.raises(RuntimeError):
        with TokenWriter(path, 50) as w:
            w.append(np.arange(10))
            raise RuntimeError("the tokenizer failed")
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.bin.idx.npy", "t.bin.json"]
    assert TokenFile.open(path).tokens.tolist() == (np.arange(100) % 50).tolist()
    with TokenWriter(path, 50, track_docs=False) as w:  # no index this time: the old one must not stay
        w.append(np.arange(7))
    again = TokenFile.open(path)
    assert again.tokens.tolist() == list(range(7)) and again.doc_starts is None
    assert reading.tokens[:100].tolist() == (np.arange(100) % 50).tolist()  # the old mapping reads the old file
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.bin.json"]


# --- token data given as something else -------------------------------------------------------------------------

def test_a_folder_or_raw_text_as_token_data_says_which_file_to_give(tmp_path, capsys):
    """Before, a folder was 'a token file with no sidecar' and raw text was told to be re-created with ``--out`` set
    to itself: the advice, followed, wrote over the user's corpus."""
    folder = tmp_path / "data"
    write_tokens(folder / "train.bin", np.arange(400) % 256, 256)
    assert main(["train", *TINY, f"data.path={folder}", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"{folder} is a folder, not a token file" in err and f"holds {folder / 'train.bin'}" in err, err
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat\n")
    assert main(["train", *TINY, f"data.path={text}", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"{text} looks like text, not a token file" in err and f"--out {tmp_path / 'corpus.bin'} {text}" in err
    assert not (tmp_path / "run").exists()


# --- instruction and preference data ----------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "what is two plus two?"},
                     {"role": "assistant", "content": "four."}]}
PAIR = {"prompt": "what is two plus two?", "chosen": "four.", "rejected": "five."}


@pytest.mark.parametrize("fmt,record", [("chat", CHAT), ("preference", PAIR)])
def test_instruction_and_preference_data_with_a_byte_order_mark_are_read(tmp_path, fmt, record):
    """Before: '1: not valid JSON (Unexpected UTF-8 BOM ...)' for a file Notepad saved."""
    from megatrain_jax.data.instruct import ChatTokenizer, read_examples
    from megatrain_jax.data.preference import read_pairs
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok"))
    plain, marked = tmp_path / "a.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(json.dumps(record) + "\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    read = read_examples if fmt == "chat" else read_pairs
    (a, _), (b, _) = read(plain, tok, 64), read(marked, tok, 64)
    assert len(a) == len(b) == 1 and repr(a[0]) == repr(b[0])


@pytest.mark.parametrize("fmt,mode", [("chat", "packed"), ("preference", "padded")])
def test_a_folder_as_jsonl_path_and_a_file_as_tokenizer_are_named(tmp_path, capsys, fmt, mode):
    """Before: '[Errno 21] Is a directory' for the folder, and 'tok/tokenizer.json/tokenizer.json does not exist'
    for the tokenizer's file."""
    folder = make_tokenizer_folder(tmp_path / "tok")
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps(CHAT if fmt == "chat" else PAIR) + "\n")
    common = [*TINY, f"data.format={fmt}", f"data.mode={mode}", f"data.cache_dir={tmp_path / 'cache'}",
              "model.vocab_size=512"]
    for command in ("plan", "train"):
        assert main([command, *common, f"data.path={tmp_path}", f"data.tokenizer={folder}",
                     f"train.run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path} is a folder, not a file of JSON lines: set data.path to the .jsonl file" in err, err
    assert main(["train", *common, f"data.path={data}", f"data.tokenizer={folder / 'tokenizer.json'}",
                 f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'tokenizer.json'} is a file" in err and f"give the folder, e.g. {folder}" in err, err
    assert not (tmp_path / "run").exists()


def test_a_control_character_in_a_chat_line_is_said_once():
    """json's message for a raw control character ends in "at", before the column this adds: said once."""
    from megatrain_jax.data.chat_lines import InstructDataError, json_object
    with pytest.raises(InstructDataError, match=r"^f\.jsonl:3: not valid JSON \(Invalid control character at column "
                                                r"\d+\)$"):
        json_object('{"a": "x\ty"}', "f.jsonl:3")


@pytest.mark.parametrize("n", [0, -5])
def test_batch_docs_below_one_is_refused(tmp_path, n, capsys):
    """``--batch-docs 0`` would hand the whole corpus to the tokenizer in one call: refused, saying the range."""
    with pytest.raises(SystemExit):
        _prepare_data().parse_args(["--tokenizer", "t.json", "--out", str(tmp_path / "o.bin"), "--batch-docs", str(n),
                                    "a.txt"])
    assert f"--batch-docs must be at least 1 (documents encoded per tokenizer call), got {n}" in capsys.readouterr().err
