"""Instruction data as users write it: what it keeps and counts, the chat templates and message forms met in the
wild (a generation prompt the turn does not repeat, tool and developer roles, OpenAI's lists of content parts,
TRL's conversational prompt/completion lines), and what is refused, saying where and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from megatrain_jax.data.instruct import ChatTokenizer, InstructDataError, read_examples  # noqa: E402
from test_instruct import CONVERSATION, _learned_text, make_tokenizer_folder, write_jsonl  # noqa: E402

USER_ASKS = [{"role": "user", "content": "what is two plus two?"}]
ANSWER = {"role": "assistant", "content": "four."}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def _one(tok: ChatTokenizer, tmp_path: Path, line, seq_len: int = 512) -> str:
    """The learned text of a file of one line."""
    (ex,), _ = read_examples(write_jsonl(tmp_path / "d.jsonl", [line]), tok, seq_len)
    return _learned_text(tok, ex.ids, ex.loss_mask)


# ---------------------------------------------------------------------------------------------- counts
def test_an_example_cut_then_skipped_is_counted_as_skipped_only(chatml, tmp_path):
    """A prompt longer than seq_len is cut, leaves no answer token, and is skipped: counted once, as skipped, so
    'truncated' counts only kept examples that were cut (what the run's start line says)."""
    prompt_heavy = {"prompt": "the lazy dog " * 40, "completion": "fromage"}
    path = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, prompt_heavy])
    _, stats = read_examples(path, chatml, seq_len=64)
    assert (stats.kept, stats.truncated, stats.skipped_no_loss) == (1, 0, 1)
    long = {"prompt": "hi ", "completion": "the quick brown fox " * 40}
    _, stats = read_examples(write_jsonl(tmp_path / "e.jsonl", [long, prompt_heavy]), chatml, seq_len=64)
    assert (stats.kept, stats.truncated, stats.skipped_no_loss) == (1, 1, 1)


def test_the_cached_counts_are_not_those_an_older_version_wrote(chatml, tmp_path):
    """The counts changed meaning: a cache entry written before is another key, never read back."""
    from megatrain_jax.data import instruct
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    key = instruct.cache_key(data, chatml.where, 64, "truncate")
    assert instruct.FORMAT_VERSION >= 3 and key != _key_of_version(2, data, chatml.where)


def _key_of_version(version: int, data: Path, folder: str) -> str:
    from megatrain_jax.data import instruct
    old, instruct.FORMAT_VERSION = instruct.FORMAT_VERSION, version
    try:
        return instruct.cache_key(data, folder, 64, "truncate")
    finally:
        instruct.FORMAT_VERSION = old


@pytest.mark.parametrize("text,said", [("", "it is empty"), ("\n  \n\t\n", "it holds only blank lines")])
def test_an_empty_file_says_what_a_line_should_hold(chatml, tmp_path, text, said):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(InstructDataError, match=rf"d.jsonl has no examples: {said}; write one example a line, "
                                                rf"\{{\"messages\": .*\"prompt\": .*docs/fine_tuning.md"):
        read_examples(path, chatml, seq_len=64)


# ---------------------------------------------------------------------------------------------- templates
# DeepSeek-R1's distilled models: the generation prompt opens a <think> block the rendered turn does not hold
R1 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
      "{% elif m['role'] == 'assistant' %}{{ '<|Assistant|>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}")


def test_a_generation_prompt_the_turn_does_not_repeat_learns_the_answer_only(tmp_path):
    """R1's generation prompt ends with '<think>\\n', its rendered turn does not: the answer and the end of
    sequence are learned, no prompt token, and multi-turn conversations learn every answer."""
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", R1))
    assert _one(tok, tmp_path, {"messages": USER_ASKS + [ANSWER]}) == "four.</s>"
    two = {"messages": USER_ASKS + [ANSWER, {"role": "user", "content": "and the fox?"},
                                    {"role": "assistant", "content": "it jumps."}]}
    assert _one(tok, tmp_path, two) == "four.</s>it jumps.</s>"


def test_a_template_that_reorders_earlier_turns_says_how_to_train_the_last(tmp_path):
    """Mistral's templates put the system message in the last user turn: a conversation's beginning is not the
    beginning of the whole, so its turns cannot be told apart; the error says to give it as a prompt and a
    completion, which trains the last answer, and that works."""
    last_user = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' }}"
                 "{% if loop.index0 == (messages | selectattr('role', 'equalto', 'user') | list | length) * 2 - 2 %}"
                 "{{ 'be brief. ' }}{% endif %}{{ m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
                 "{% endif %}{% endfor %}")
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", last_user))
    turns = USER_ASKS + [ANSWER, {"role": "user", "content": "and the fox?"}]
    with pytest.raises(InstructDataError, match=r"d.jsonl:1: .* to train the last answer only, give the line as "
                                                r"\{\"prompt\": \[the messages before it\], \"completion\": "
                                                r"\[the last assistant message\]\}"):
        _one(tok, tmp_path, {"messages": turns + [{"role": "assistant", "content": "it jumps."}]})
    assert _one(tok, tmp_path, {"prompt": turns, "completion": [{"role": "assistant", "content": "it jumps."}]}) \
        == "it jumps.</s>"


# ---------------------------------------------------------------------------------------------- message forms
def test_conversational_prompt_completion_lines_learn_the_completion_only(chatml, tmp_path):
    """TRL's conversational prompt/completion: the prompt's assistant turns are context, not learned."""
    line = {"prompt": USER_ASKS + [ANSWER, {"role": "user", "content": "and the fox?"}],
            "completion": [{"role": "assistant", "content": "it jumps."}]}
    assert _one(chatml, tmp_path, line) == "it jumps.<|im_end|>\n"


@pytest.mark.parametrize("line,match", [
    ({"prompt": "hi", "completion": [ANSWER]}, r"d.jsonl:1: 'prompt' and 'completion' must both be strings .* or "
                                               r"both message lists .*: here 'prompt' is a string, 'completion' is a "
                                               r"list"),
    ({"prompt": USER_ASKS, "completion": [{"role": "user", "content": "x"}]},
     r"d.jsonl:1: the completion holds no assistant message, so nothing to learn"),
])
def test_a_prompt_completion_line_of_mixed_forms_is_refused(chatml, tmp_path, line, match):
    with pytest.raises(InstructDataError, match=match):
        _one(chatml, tmp_path, line)


@pytest.mark.parametrize("role", ["tool", "developer", "function", "ipython"])
def test_tool_and_developer_turns_are_rendered_and_not_learned(chatml, tmp_path, role):
    line = {"messages": [{"role": role, "content": "the sum is 4"}] + USER_ASKS + [ANSWER]}
    assert _one(chatml, tmp_path, line) == "four.<|im_end|>\n"


def test_a_message_keeps_its_tool_calls_name_and_tool_call_id_for_the_template(tmp_path):
    """An assistant turn that calls a tool (content null) and the tool's answer: the template sees the fields it
    renders, and the call is learned."""
    tools = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['tool_calls'] %}"
             "{% for c in m['tool_calls'] %}{{ c['function']['name'] + '(' + c['function']['arguments'] + ')' }}"
             "{% endfor %}{% elif m['role'] == 'tool' %}{{ m['tool_call_id'] + '=' + m['content'] }}"
             "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", tools))
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "2, 2"}}]}
    line = {"messages": USER_ASKS + [call, {"role": "tool", "tool_call_id": "c1", "content": "4"}, ANSWER]}
    assert _one(tok, tmp_path, line) == "add(2, 2)<|im_end|>\nfour.<|im_end|>\n"


def test_openai_lists_of_text_parts_are_read_as_their_text(chatml, tmp_path):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is two"},
                                                        {"type": "text", "text": "plus two?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "four."}]}]}
    (ex,), _ = read_examples(write_jsonl(tmp_path / "d.jsonl", [parts]), chatml, 512)
    text = chatml.tokenizer.decode(ex.ids.tolist(), skip_special_tokens=False)
    assert "user\nwhat is two\nplus two?<|im_end|>" in text
    assert _learned_text(chatml, ex.ids, ex.loss_mask) == "four.<|im_end|>\n"


@pytest.mark.parametrize("content,match", [
    ([{"type": "image_url", "image_url": {"url": "x.png"}}],
     r"d.jsonl:1: messages\[0\].content\[0\] is a part of type 'image_url': only text parts "
     r"\(\{\"type\": \"text\", \"text\": \.\.\.\}\) can be trained on; remove the part"),
    (42, r"d.jsonl:1: messages\[0\].content must be a string or a list of text parts, got a number"),
    (None, r"d.jsonl:1: messages\[0\].content must be a string or a list of text parts, got null"),
])
def test_content_that_is_not_text_says_what_it_is(chatml, tmp_path, content, match):
    with pytest.raises(InstructDataError, match=match):
        _one(chatml, tmp_path, {"messages": [{"role": "user", "content": content}, ANSWER]})


def test_an_unknown_role_names_the_roles_read(chatml, tmp_path):
    with pytest.raises(InstructDataError, match=r"d.jsonl:1: messages\[1\] has the unknown role 'Assistant'; roles "
                                                r"are \['system', 'user', 'assistant', 'developer', 'tool', "
                                                r"'function', 'ipython'\]"):
        _one(chatml, tmp_path, {"messages": USER_ASKS + [{"role": "Assistant", "content": "four."}]})


# ---------------------------------------------------------------------------------------------- the cache
def test_a_cache_folder_that_cannot_be_written_names_data_cache_dir(chatml, tmp_path):
    """Instruction data is trained from its tokenized file in the cache: a cache folder that cannot be written (here
    a file stands at its path) is refused naming it and the setting, not with a bare OS error that the command line
    would pin on the run's folders."""
    from megatrain_jax.data.instruct import prepare
    (tmp_path / "cache").write_text("not a folder")
    data = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    with pytest.raises(InstructDataError, match=rf"the tokenized data of {data} cannot be written to the cache folder "
                                                rf"{tmp_path / 'cache'} \(.*\); training reads it from there: set "
                                                r"data.cache_dir to a writable folder with room for it"):
        prepare(data, chatml.where, 64, cache_dir=tmp_path / "cache")
    assert list(tmp_path.glob(".*tmp*")) == [] and (tmp_path / "cache").read_text() == "not a folder"


def test_a_template_that_leaves_the_answers_out_says_so(tmp_path):
    """A template that renders only the user's turns has no generation prompt in its turns and nothing to learn:
    refused naming the template, not counted as examples cut before their answer."""
    users_only = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>user\\n' + m['content'] + "
                  "'<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                  "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path / "tok", users_only))
    with pytest.raises(InstructDataError, match=r"d.jsonl:1: the chat template \(.*tokenizer_config.json "
                                                r"'chat_template'\) renders nothing of message 1 \(an assistant "
                                                r"turn\), so there is nothing to learn from it"):
        _one(tok, tmp_path, {"messages": USER_ASKS + [ANSWER]})


def test_the_data_file_is_read_once_for_its_key_and_again_when_it_changes(tmp_path, monkeypatch):
    """A start asks for the data's cache key several times; a data file of gigabytes was read whole each time."""
    import time

    from megatrain_jax.data import instruct
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    reads = []
    real_open = open
    monkeypatch.setattr(instruct, "open", lambda f, *a, **k: reads.append(Path(f).name) or real_open(f, *a, **k),
                        raising=False)
    first = instruct.cache_key(data, tmp_path, 64, "truncate")
    assert instruct.cache_key(data, tmp_path, 64, "truncate") == first and reads.count("chat.jsonl") == 1
    time.sleep(0.01)
    data.write_text('{"prompt": "a", "completion": "c"}\n')  # the same size, other bytes
    assert instruct.cache_key(data, tmp_path, 64, "truncate") != first and reads.count("chat.jsonl") == 2
