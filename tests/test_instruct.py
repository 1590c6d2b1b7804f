"""Instruction data: conversations and prompt/completion pairs through a checkpoint's own tokenizer and
chat template, the loss on the assistant's tokens only, and an error naming the line for each bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from megatrain_jax.data.instruct import ChatTokenizer, InstructDataError, read_examples  # noqa: E402

# A ChatML template, as Qwen's checkpoints carry it.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# A Llama-2-style template that raises on a misplaced system message.
STRICT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('a system message must come first') }}{% endif %}"
          "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
          "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}{% endfor %}")


def make_tokenizer_folder(folder: Path, template: str | None = CHATML) -> Path:
    """A tiny byte-level BPE trained here, with ChatML's special tokens, saved as a checkpoint would."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "what is two plus two? four.",
              "user assistant system hello world", "translate to french: cheese -> fromage"] * 20
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


CONVERSATION = {"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "what is two plus two?"},
                             {"role": "assistant", "content": "four."},
                             {"role": "user", "content": "and the fox?"},
                             {"role": "assistant", "content": "it jumps."}]}


def _learned_text(tok: ChatTokenizer, ids, mask) -> str:
    return tok.tokenizer.decode([int(t) for t, m in zip(ids[1:], mask) if m], skip_special_tokens=False)


def test_only_the_assistant_turns_and_their_end_markers_carry_loss(chatml, tmp_path):
    examples, stats = read_examples(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION]), chatml, seq_len=512)
    ex = examples[0]
    assert stats.kept == 1 and ex.line == 1 and len(ex.loss_mask) == len(ex.ids) - 1
    rendered = chatml.render(CONVERSATION["messages"])
    assert chatml.tokenizer.decode(ex.ids.tolist(), skip_special_tokens=False) == rendered
    learned = _learned_text(chatml, ex.ids, ex.loss_mask)
    assert learned == "four.<|im_end|>\nit jumps.<|im_end|>\n"
    for prompt_word in ("be brief", "two plus", "fox", "user", "system"):
        assert prompt_word not in learned


def test_prompt_completion_lines_learn_the_completion_and_the_end_of_sequence(chatml, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "translate to french: cheese -> ",
                                               "completion": "fromage"}])
    (ex,), _ = read_examples(path, chatml, seq_len=512)
    assert _learned_text(chatml, ex.ids, ex.loss_mask).endswith("fromage</s>")
    assert "translate" not in _learned_text(chatml, ex.ids, ex.loss_mask)


def test_the_template_renders_as_transformers_renders_it(tmp_path, transformers):
    """transformers' apply_chat_template gives the same text, for two templates."""
    for name, template in (("chatml", CHATML), ("strict", STRICT)):
        folder = make_tokenizer_folder(tmp_path / name, template)
        ours = ChatTokenizer.from_folder(folder)
        theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                      bos_token="<s>", eos_token="</s>", chat_template=template)
        messages = CONVERSATION["messages"][1:]
        for gen in (False, True):
            assert ours.render(messages, gen) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=gen)


def test_strict_template_renders_special_tokens_and_its_errors_name_the_line(tmp_path):
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", STRICT))
    ok = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
    assert tok.render(ok["messages"]) == "<s>[INST] hello [/INST]world</s>"
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"},
                        {"role": "assistant", "content": "y"}]}
    with pytest.raises(InstructDataError, match=r"d.jsonl:2: the chat template failed .*system message must"):
        read_examples(write_jsonl(tmp_path / "d.jsonl", [ok, bad]), tok, seq_len=64)


@pytest.mark.parametrize("line,match", [
    ('{"messages": [', r"d.jsonl:2: not valid JSON"),
    ('[1, 2]', r"d.jsonl:2: each line must be a JSON object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"d.jsonl:2: messages\[0\] has the unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, r"d.jsonl:2: messages\[0\] needs a 'role' and a 'content'"),
    ({"messages": [{"role": "user", "content": "x"}]}, r"d.jsonl:2: the conversation has no assistant turn"),
    ({"prompt": "x"}, r"d.jsonl:2: a prompt/completion line needs a string 'completion'"),
    ({"text": "x"}, r"d.jsonl:2: a line needs 'messages' .* found keys \['text'\]"),
    ({**CONVERSATION, "prompt": "x", "completion": "y"}, r"d.jsonl:2: the line has both 'messages' and 'completion' "
                                                         r"and 'prompt'; keep one form"),
])
def test_bad_lines_name_the_line(chatml, tmp_path, line, match):
    with pytest.raises(InstructDataError, match=match):
        read_examples(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, line]), chatml, seq_len=512)


def test_a_line_that_is_not_utf8_is_named(chatml, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    path.write_bytes(path.read_bytes() + '{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1"))
    with pytest.raises(InstructDataError, match=r"d.jsonl:2 is not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_examples(path, chatml, seq_len=512)


@pytest.mark.parametrize("name", ["tokens.bin", "tokens.npy", "bare.bin"])
def test_a_token_file_given_as_instruction_data_says_to_set_the_tokens_format(chatml, tmp_path, name):
    """A .bin with its sidecar, a .npy, or a .bin without a sidecar: not 'not UTF-8 text', but what it is."""
    from megatrain_jax.data import write_tokens
    from megatrain_jax.data.instruct import prepare
    path = tmp_path / name
    tokens = np.arange(300) % 256
    if name == "tokens.bin":
        write_tokens(path, tokens, 256)
    elif name == "tokens.npy":
        np.save(path, tokens)
    else:
        tokens.astype(np.uint16).tofile(path)
    match = rf"{name} looks like a token file \(.*\), not JSON lines: .*set data.format = 'tokens'"
    with pytest.raises(InstructDataError, match=match):
        read_examples(path, chatml, seq_len=512)
    with pytest.raises(InstructDataError, match=match):  # before the tokenizer or the file's hash
        prepare(path, tmp_path / "no_tokenizer", 64, cache_dir=tmp_path / "cache")


def test_jsonl_given_as_token_data_says_to_set_the_chat_format(tmp_path):
    from megatrain_jax.data import TokenFile
    path = write_jsonl(tmp_path / "chat.jsonl", [CONVERSATION])
    with pytest.raises(FileNotFoundError, match="looks like JSON lines, not a token file: .* data.format='chat'"):
        TokenFile.open(path)


def test_too_long_examples_are_truncated_or_skipped_and_counted(chatml, tmp_path):
    short = {"prompt": "hi ", "completion": "four."}
    long = {"prompt": "hi ", "completion": "the quick brown fox " * 40}
    path = write_jsonl(tmp_path / "d.jsonl", [short, CONVERSATION, long])
    examples, stats = read_examples(path, chatml, seq_len=32, too_long="truncate")
    assert (stats.truncated, stats.kept) == (2, 3) and [len(e.ids) for e in examples[1:]] == [33, 33]
    examples, stats = read_examples(path, chatml, seq_len=32, too_long="skip")
    assert (stats.skipped_too_long, stats.kept) == (2, 1) and examples[0].line == 1
    # a prompt longer than seq_len leaves no token to learn: skipped and counted
    prompt_heavy = {"prompt": "the lazy dog " * 40, "completion": "fromage"}
    path = write_jsonl(tmp_path / "e.jsonl", [CONVERSATION, prompt_heavy])
    examples, stats = read_examples(path, chatml, seq_len=64)
    assert stats.skipped_no_loss == 1 and stats.kept == 1


def test_empty_data_and_missing_template_are_clear(chatml, tmp_path):
    with pytest.raises(InstructDataError, match="has no examples"):
        read_examples(write_jsonl(tmp_path / "d.jsonl", [""]), chatml, seq_len=64)
    with pytest.raises(InstructDataError, match="no usable example .* 1 too long and skipped"):
        read_examples(write_jsonl(tmp_path / "e.jsonl", [CONVERSATION]), chatml, seq_len=4, too_long="skip")
    plain = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "plain", template=None))
    with pytest.raises(InstructDataError, match="f.jsonl:1: .* has no chat template"):
        read_examples(write_jsonl(tmp_path / "f.jsonl", [CONVERSATION]), plain, seq_len=64)
    with pytest.raises(InstructDataError, match="tokenizer.json does not exist"):
        ChatTokenizer.from_folder(tmp_path / "nothing")
    broken = make_tokenizer_folder(tmp_path / "broken")
    (broken / "tokenizer.json").write_text("not json")  # the error names the file (issue 32)
    with pytest.raises(InstructDataError, match=f"{broken / 'tokenizer.json'}: not a tokenizer file"):
        ChatTokenizer.from_folder(broken)


# ---------------------------------------------------------------------------------------------- batches
def test_prepared_once_then_read_from_the_cache(chatml, tmp_path, monkeypatch):
    from megatrain_jax.data import instruct
    from megatrain_jax.data.tokens import TokenFile
    folder = Path(chatml.where)
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, {"prompt": "hi ", "completion": "four."}])
    out, stats = instruct.prepare(data, folder, seq_len=64, cache_dir=tmp_path / "cache")
    assert stats.kept == 2
    file = TokenFile.open(out)
    assert len(file.doc_starts) == 2 and file.loss is not None and file.loss[0] == 0
    examples, _ = read_examples(data, chatml, seq_len=64)
    np.testing.assert_array_equal(file.tokens[:len(examples[0].ids)], examples[0].ids)
    np.testing.assert_array_equal(file.loss[1:len(examples[0].ids)], examples[0].loss_mask)
    monkeypatch.setattr(instruct, "read_examples", lambda *a, **k: pytest.fail("tokenized again"))
    assert instruct.prepare(data, folder, seq_len=64, cache_dir=tmp_path / "cache") == (out, stats)
    # another seq_len, or changed data, is another cache entry
    monkeypatch.undo()
    assert instruct.prepare(data, folder, seq_len=32, cache_dir=tmp_path / "cache")[0] != out
    write_jsonl(data, [CONVERSATION])
    assert instruct.prepare(data, folder, seq_len=64, cache_dir=tmp_path / "cache")[0] != out


def test_a_damaged_cache_entry_is_tokenized_again(chatml, tmp_path, capsys):
    """The cache is derived data: an entry whose token file disagrees with its sidecar is made again, with a note,
    rather than refused with advice about a script the user never ran."""
    from megatrain_jax.data import instruct
    from megatrain_jax.data.tokens import TokenFile
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, {"prompt": "hi ", "completion": "four."}])
    out, stats = instruct.prepare(data, Path(chatml.where), seq_len=64, cache_dir=tmp_path / "cache")
    tokens = np.array(TokenFile.open(out).tokens)
    with open(out, "r+b") as f:
        f.truncate(10)
    again, stats2 = instruct.prepare(data, Path(chatml.where), seq_len=64, cache_dir=tmp_path / "cache")
    assert again == out and stats2 == stats and "is damaged" in capsys.readouterr().err
    np.testing.assert_array_equal(TokenFile.open(out).tokens, tokens)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_batches_carry_the_loss_flags_and_resume_exactly(chatml, tmp_path, mode):
    """Packed rows hold several examples (segment ids, positions restarting); padded rows one each. The
    loss mask is the examples' own; the stream resumes exactly from its state, across epochs."""
    from megatrain_jax.data import DataConfig
    lines = [CONVERSATION] + [{"prompt": f"what is {i}? ", "completion": "four."} for i in range(9)]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    cfg = DataConfig(path=str(data), format="chat", tokenizer=chatml.where, seq_len=64, batch_size=2, mode=mode,
                     prefetch=0, cache_dir=str(tmp_path / "cache"))
    stream = cfg.build()
    first = [next(stream) for _ in range(7)]  # more than an epoch
    for b in first:
        assert b.loss_mask.sum() > 0 and b.loss_mask.sum() < (b.positions > 0).sum() + b.shape[0]
        if mode == "packed":
            assert b.segment_ids is not None and b.segment_ids.max() > 1
        else:
            assert b.segment_ids is None and (b.positions == np.arange(64)).all()
    state = cfg.build()
    for _ in range(3):
        next(state)
    resumed = cfg.build(state=state.state())
    for want in first[3:]:
        got = next(resumed)
        np.testing.assert_array_equal(got.inputs, want.inputs)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)


def test_chat_format_needs_a_jsonl_path_whole_examples_and_a_tokenizer(tmp_path):
    from megatrain_jax.data import DataConfig
    with pytest.raises(ValueError, match="set path to a JSONL file"):
        DataConfig(format="chat")
    with pytest.raises(ValueError, match="set mode to 'packed' or 'padded'"):
        DataConfig(path="x.jsonl", format="chat")
    with pytest.raises(ValueError, match="needs the tokenizer folder"):
        DataConfig(path="x.jsonl", format="chat", mode="packed").build()


def test_a_vocabulary_mismatch_names_the_tokenizer(chatml, tmp_path):
    from megatrain_jax.data import DataConfig
    data = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])), format="chat", mode="packed",
                      tokenizer=chatml.where, seq_len=64, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=f"the tokenizer {Path(chatml.where) / 'tokenizer.json'} does not fit"):
        data.build(model_vocab=8)


def small_vocab_tokenizer(folder: Path, vocab: int) -> None:
    """A word-piece BPE over the corpus's own characters, at most ``vocab`` ids (a tiny model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "</s>"])
    tok.train_from_iterator(["what is two plus two four the fox jumps user assistant system be brief and it"] * 10,
                            trainer)
    assert tok.get_vocab_size() <= vocab
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": CHATML}))


def test_sft_end_to_end_from_an_hf_folder_to_an_hf_folder_and_resumes_bit_exactly(tmp_path, capsys):
    """megatrain-jax train with [model] hf_checkpoint and [data] format = "chat": the checkpoint's own
    tokenizer and template, the loss on the answers, 20 steps over several epochs, an exported folder with
    weights and tokenizer that reloads. A run stopped mid-epoch at step 9 and resumed gives the same losses
    and the same exported weights, bit for bit (a constant rate: a cosine schedule depends on the total
    steps, which the first part's run does not share)."""
    import shutil

    from megatrain_jax.cli import main
    from megatrain_jax.hf import load_hf
    fixture = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture, ckpt)
    small_vocab_tokenizer(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"])
    lines = [CONVERSATION] + [{"messages": [{"role": "user", "content": "what is two plus two"},
                                           {"role": "assistant", "content": "four " * (1 + i % 3)}]}
                              for i in range(10)]
    data = write_jsonl(tmp_path / "chat.jsonl", lines)

    def train(name: str, steps: int, *extra: str, status: int = 0) -> Path:
        run = tmp_path / name
        assert main(["train", f"model.hf_checkpoint={ckpt}", "model.dtype=float32", f"data.path={data}",
                     "data.format=chat", "data.mode=packed", "data.seq_len=48", "data.batch_size=2",
                     "data.prefetch=0", f"data.cache_dir={tmp_path / 'cache'}", f"train.steps={steps}",
                     "optimizer.lr=1e-3", "optimizer.decay=constant", "log.tensorboard=false", f"train.run_dir={run}",
                     f"train.export_hf={run / 'hf'}", *extra]) == status
        return run

    def losses(run: Path) -> dict[int, float]:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    whole = train("whole", 20)
    said = capsys.readouterr().out
    stats = json.loads((whole / "data_stats.json").read_text())  # what tokenizing kept and dropped, said too
    assert stats["kept"] == len(lines) - stats["skipped_too_long"] - stats["skipped_no_loss"] and stats["tokens"] > 0
    assert f"data: {stats['kept']:,} examples, {stats['tokens']:,} tokens from {data}" in said
    cfg, io, blocks = load_hf(whole / "hf", dtype="float32")
    assert len(blocks) == cfg.layers and (whole / "hf" / "tokenizer.json").exists()
    assert json.loads((whole / "hf" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    first = losses(whole)
    assert sorted(first) == list(range(1, 21)) and all(np.isfinite(list(first.values())))
    assert np.mean([first[s] for s in range(16, 21)]) < np.mean([first[s] for s in range(1, 6)])

    parted = train("parted", 9, "train.checkpoint_every=9")
    # the first part exported its model: the resumed run replaces it only when told to
    capsys.readouterr()
    train("parted", 20, "train.checkpoint_every=9", "train.resume=true", status=2)
    assert f"{parted / 'hf'} already holds a model" in capsys.readouterr().err
    train("parted", 20, "train.checkpoint_every=9", "train.resume=true", "train.export_overwrite=true")
    assert losses(parted) == first
    for a, b in zip(sorted((whole / "hf").glob("*.safetensors")), sorted((parted / "hf").glob("*.safetensors"))):
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("body, error", [
    ("{{ 1 + messages }}", "TypeError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ messages[0]['role'] | int + 1 }}{{ messages.nope.nope }}", "UndefinedError"),
])
@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_template_that_raises_names_its_file_and_the_line(tmp_path, body, error, where):
    """A chat template is a program: any error it raises (Python's own too) names the template's file and the
    data line, never a traceback."""
    folder = make_tokenizer_folder(tmp_path / "tok", template=body if where == "tokenizer_config.json" else None)
    if where == "chat_template.jinja":
        (folder / where).write_text(body)
    tok = ChatTokenizer.from_folder(folder)
    with pytest.raises(InstructDataError, match=rf"d.jsonl:2: the chat template failed on this example: {error}.*"
                                                rf"{where}"):
        read_examples(write_jsonl(tmp_path / "d.jsonl", ["{\"prompt\": \"a\", \"completion\": \"b\"}",
                                                          CONVERSATION]), tok, seq_len=512)


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", r"tokenizer_config.json: holds a JSON array, where a JSON object"),
    ("{\"chat_template\": ", r"tokenizer_config.json: not valid JSON \(.* at line 1"),
    (json.dumps({"chat_template": 3}), r"tokenizer_config.json 'chat_template' is 3: a chat template is a string"),
])
def test_a_tokenizer_config_that_is_not_an_object_names_the_file(tmp_path, text, match):
    folder = make_tokenizer_folder(tmp_path / "tok")
    (folder / "tokenizer_config.json").write_text(text)
    with pytest.raises(InstructDataError, match=match):
        ChatTokenizer.from_folder(folder)


def test_a_template_that_does_not_render_prefixes_names_its_file(tmp_path):
    """A template that renders a conversation's beginning otherwise than the whole's (here: it numbers the turns
    from the end) cannot be split into turns: the error names the template's file."""
    backwards = "{% for m in messages %}{{ (messages | length) - loop.index0 }}{{ m['content'] }}{% endfor %}"
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", backwards))
    with pytest.raises(InstructDataError, match=r"d.jsonl:1: the chat template \(.*tokenizer_config.json "
                                                r"'chat_template'\) does not render a conversation's beginning"):
        read_examples(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION]), tok, seq_len=512)


# ---------------------------------------------------------------------------------------------- learning to stop
def test_answers_without_the_end_of_sequence_token_are_noted(tmp_path):
    """ChatML ends the assistant's turn with <|im_end|>; a tokenizer whose eos_token is </s> then teaches a model
    that never emits the token generation stops at: a note says so, names the first line and says what to do. A
    template that puts the eos_token after the answer (STRICT) has no note, and an example that loses its
    eos_token to truncation is not counted (the template is not at fault)."""
    chatml = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "chatml"))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi ", "completion": "four."}, CONVERSATION, CONVERSATION])
    _, stats = read_examples(data, chatml, seq_len=512)
    (note,) = stats.notes
    assert note.startswith(f"2 of 3 examples have answers without an end-of-sequence token (the first: {data}:2, "
                           f"whose answer ends")
    assert "<|im_end|>" in note and "generation stops at '</s>'" in note
    assert "Use a template that ends the assistant's turn with it ({{ eos_token }} after the content)" in note
    assert f"or set eos_token in {tmp_path / 'chatml' / 'tokenizer_config.json'} to the token" in note
    strict = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "strict", STRICT))
    assert read_examples(data, strict, seq_len=512)[1].notes == []
    long = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "the quick brown fox " * 20}]}
    cut, stats = read_examples(write_jsonl(tmp_path / "e.jsonl", [long]), strict, seq_len=32)
    assert stats.truncated == 1 and not np.isin(cut[0].ids, strict.stop_ids).any() and stats.notes == []


def test_the_end_of_sequence_ids_of_generation_config_count(tmp_path):
    """generation_config.json's eos_token_id (an id or a list: Gemma's <end_of_turn>, Llama 3's <|eot_id|>) is
    where generation stops too: ChatML answers ending in <|im_end|> then need no note."""
    folder = make_tokenizer_folder(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    im_end = ChatTokenizer.from_folder(folder).tokenizer.token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, im_end]}))
    tok = ChatTokenizer.from_folder(folder)
    assert im_end in tok.stop_ids and read_examples(data, tok, seq_len=512)[1].notes == []


def test_a_tokenizer_without_an_eos_token_is_noted(tmp_path):
    """No eos_token: prompt/completion lines end with nothing, chat lines with the template's marker; the note
    says to set eos_token."""
    folder = make_tokenizer_folder(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi ", "completion": "four."}])
    (note,) = read_examples(data, ChatTokenizer.from_folder(folder), seq_len=512)[1].notes
    assert note.startswith(f"1 of 1 examples have answers without an end-of-sequence token (the first: {data}:1")
    assert f"{folder / 'tokenizer_config.json'} has no eos_token. Set eos_token there" in note


def test_the_note_is_kept_with_the_cached_tokenization_and_in_the_data_summary(tmp_path, monkeypatch):
    """The note is said on every run (the summary a run prints and writes to data_stats.json), not only the one
    that tokenized the data; a generation_config.json added later is another cache entry."""
    from megatrain_jax.data import DataConfig, instruct
    folder = make_tokenizer_folder(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    _, stats = instruct.prepare(data, folder, seq_len=64, cache_dir=tmp_path / "cache")
    assert len(stats.notes) == 1
    monkeypatch.setattr(instruct, "read_examples", lambda *a, **k: pytest.fail("tokenized again"))
    cfg = DataConfig(path=str(data), format="chat", mode="packed", tokenizer=str(folder), seq_len=64,
                     cache_dir=str(tmp_path / "cache"))
    assert cfg.chat_summary()["notes"] == stats.notes
    monkeypatch.undo()
    im_end = ChatTokenizer.from_folder(folder).tokenizer.token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert cfg.chat_summary()["notes"] == []
