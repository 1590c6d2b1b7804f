"""Instruction data for fine-tuning: JSONL conversations or prompt/completion pairs, rendered with a
checkpoint's own chat template and tokenized with its own ``tokenizer.json``, with the loss on the
assistant's (or completion's) tokens only.

Two line formats, one JSON object per line:

- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``: rendered with the
  chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``), as transformers'
  ``apply_chat_template`` renders it (jinja2, sandboxed, ``trim_blocks`` and ``lstrip_blocks``, the
  special tokens as variables, ``raise_exception``, ``tojson`` and ``strftime_now``). The roles ``developer``,
  ``tool``, ``function`` and ``ipython`` are rendered too, never learned; a message's ``name``, ``tool_calls`` and
  ``tool_call_id`` go to the template with it; a content may be OpenAI's list of text parts (joined by newlines,
  as vLLM joins them), or null beside ``tool_calls``;
- ``{"prompt": "...", "completion": "..."}``: the prompt then the completion and the end-of-sequence
  token, without a template; or both message lists (TRL's conversational form), rendered as one conversation
  whose completion's assistant turns alone are learned (a way to train only a conversation's last answer).

A line holds one form: one with ``messages`` and ``prompt`` or ``completion`` is refused.

Which tokens carry loss is found from text offsets. For each assistant turn, the template renders the
conversation up to the turn with the generation prompt (where the turn's text starts) and up to the end
of the turn (where it ends). Tokens whose characters fall inside such a span carry loss: the assistant's
words and the template's end-of-turn marker, so the model learns to stop. Where the generation prompt holds
more than the rendered turn repeats (DeepSeek-R1's ``<think>``), the turn starts where the two part. A template
that does not render a conversation's prefixes as prefixes of the whole cannot be split this way and is refused.

The model learns to stop only where the learned tokens hold an end-of-sequence token: ``eos_token`` of
``tokenizer_config.json``, or an ``eos_token_id`` of the folder's ``generation_config.json`` or ``config.json``
(where generation stops). Examples whose learned tokens hold none (a template that ends the assistant's turn
with another marker, a tokenizer without an ``eos_token``) are counted and said in the stats' notes.

Every problem names the file and line: malformed JSON, a missing or mistyped field, an unknown role, a
template error, an example longer than ``seq_len`` (truncated or skipped, as configured, and counted), an
example left without a token to learn, and a file with no examples.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from megatrain_jax.data.chat_lines import InstructDataError, nothing_in, parse_line, read_lines, refuse_token_file
from megatrain_jax.data.tokens import file_identity
from megatrain_jax.hf.json_files import read_json_object

TooLong = Literal["truncate", "skip"]


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids`` [n] and ``loss_mask`` [n - 1], where ``loss_mask[j]`` says whether
    predicting ``ids[j + 1]`` from ``ids[:j + 1]`` counts in the loss."""

    ids: np.ndarray
    loss_mask: np.ndarray
    line: int  # where it came from


@dataclasses.dataclass
class Stats:
    """What tokenizing a file did: examples kept, of them those truncated to ``seq_len + 1`` tokens, skipped as too
    long, skipped for having no token to learn after truncation (not counted as truncated too), and (preference
    pairs) skipped for having two sides the same after truncation (a pair that teaches nothing: its DPO loss is
    log 2 whatever the weights). ``notes``: what the data does that is allowed but likely unmeant, each a sentence
    saying what to do (instruction data: answers without an end-of-sequence token, ``read_examples``)."""

    kept: int = 0
    truncated: int = 0
    skipped_too_long: int = 0
    skipped_no_loss: int = 0
    skipped_identical: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def _special(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids_of(folder: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of the folder's ``generation_config.json`` and ``config.json``, where
    they are: generation stops there too (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``)."""
    ids = []
    for name in ("generation_config.json", "config.json"):
        if (folder / name).exists():
            value = read_json_object(folder / name, InstructDataError).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            ids += [i for i in values if isinstance(i, int) and not isinstance(i, bool)]
    return tuple(ids)


class ChatTokenizer:
    """A checkpoint's tokenizer (``tokenizers``) and chat template (jinja2), from its folder."""

    def __init__(self, tokenizer, template: str | None, special: dict[str, str | None], where: str = "tokenizer",
                 template_file: str | None = None, stop_ids: tuple[int, ...] = ()):
        """``stop_ids``: end-of-sequence ids besides ``special['eos_token']``'s (``generation_config.json``'s)."""
        self.tokenizer = tokenizer
        self.template_source = template
        self.special = special
        self.where = where
        eos_id = None if special.get("eos_token") is None else tokenizer.token_to_id(special["eos_token"])
        # the ids where generation stops: what an answer must hold for the model to learn to stop
        self.stop_ids = tuple(dict.fromkeys(([] if eos_id is None else [eos_id]) + list(stop_ids)))
        # where the template came from, for errors: tokenizer_config.json's 'chat_template' or chat_template.jinja
        self.template_file = template_file or f"the chat template of {where}"
        self._template = None if template is None else _compile(template, self.template_file)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ChatTokenizer":
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - the sft extra installs it
            raise InstructDataError("instruction data needs the tokenizers package: pip install "
                                    "'megatrain-jax[sft]'") from e
        folder = Path(folder)
        if folder.is_file():  # the tokenizer.json (or another file) itself: the folder holds what is read besides
            raise InstructDataError(f"{folder} is a file: the tokenizer is read from a checkpoint's folder (its "
                                    f"tokenizer.json, tokenizer_config.json with the chat template): give the folder, "
                                    f"e.g. {folder.parent}")
        path = folder / "tokenizer.json"
        if not path.exists():
            raise InstructDataError(f"{path} does not exist: the checkpoint folder needs its tokenizer.json "
                                    f"(the fast tokenizer file transformers saves)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library's own error names no file
            raise InstructDataError(f"{path}: not a tokenizer file the tokenizers library can read ({e}); it should "
                                    f"be the tokenizer.json transformers saves with the checkpoint") from None
        config_path = folder / "tokenizer_config.json"
        config = read_json_object(config_path, InstructDataError) if config_path.exists() else {}
        template = config.get("chat_template")
        template_file = f"{config_path} 'chat_template'"
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            template_file = f"{config_path} 'chat_template' (the one named 'default')"
        if template is not None and not isinstance(template, str):
            raise InstructDataError(f"{template_file} is {template!r}: a chat template is a string "
                                    f"(or a list of {{name, template}} objects)")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template, template_file = jinja_file.read_text(), str(jinja_file)
        special = {k: _special(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(tokenizer, template, special, where=str(folder), template_file=template_file,
                   stop_ids=_eos_ids_of(folder))

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if self._template is None:
            raise InstructDataError(f"{self.where} has no chat template (tokenizer_config.json 'chat_template' "
                                    f"or chat_template.jinja): use prompt/completion lines, or add a template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                         documents=None, **self.special)
        except Exception as e:  # a template is a program: any error of its own (raise_exception) or Python's
            raise InstructDataError(f"the chat template failed on this example: {_template_error(e)} (the template: "
                                    f"{self.template_file}); fix the line, or the template") from None

    # ------------------------------------------------------------------ one example
    def encode(self, example: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the per-target loss mask of a validated example (see ``parse_line``)."""
        if "messages" in example:
            return self.encode_completion([], example["messages"])
        return self.encode_completion(example["prompt"], example["completion"])

    def encode_completion(self, prompt: str | list[dict[str, str]], completion: str | list[dict[str, str]]
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the per-target loss mask of ``prompt`` followed by ``completion``, the loss on the
        completion only: messages rendered with the chat template as one conversation (the completion's
        assistant turns with their end-of-turn markers carry loss, the prompt's do not), or strings (the
        completion and the end-of-sequence token carry loss, no template)."""
        if isinstance(completion, list):
            text, spans = self._conversation(list(prompt) + completion, learn_from=len(prompt))
        else:
            eos = self.special.get("eos_token") or ""
            text = prompt + completion + eos
            spans = [(len(prompt), len(text))]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)  # each token's characters [start, end)
        learn = np.zeros(len(ids), bool)
        for start, end in spans:  # a token is learned if any of its characters is in a learned span
            learn |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ids, learn[1:].astype(np.float32)

    def _conversation(self, messages: list[dict[str, str]], learn_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns from message
        ``learn_from`` on."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < learn_from:
                continue
            start = self.render(messages[:i], add_generation_prompt=True)
            end = self.render(messages[:i + 1])
            begins = len(start)
            if not end.startswith(start):  # a generation prompt the turn does not repeat (R1's '<think>\n'): the
                before = self.render(messages[:i])  # turn begins where the two part, after what came before it
                begins = max(len(os.path.commonprefix([start, end])), len(before)) if end.startswith(before) else -1
            if begins < 0 or not full.startswith(end):
                raise InstructDataError(
                    f"the chat template ({self.template_file}) does not render a conversation's beginning as the "
                    f"beginning of the whole, so the assistant's turns cannot be found; to train the last answer "
                    f'only, give the line as {{"prompt": [the messages before it], "completion": [the last assistant '
                    f'message]}}, or use another template')
            if begins >= len(end) and message["content"].strip():  # an answer the template leaves out
                raise InstructDataError(f"the chat template ({self.template_file}) renders nothing of message {i} (an "
                                        f"assistant turn), so there is nothing to learn from it; use the model's own "
                                        f"template, one that renders the assistant's turns")
            spans.append((begins, len(end)))
        return full, spans


def _template_error(e: BaseException) -> str:
    """What a template's error says: its own message (``raise_exception``), or a Python error with its type."""
    import jinja2
    if isinstance(e, jinja2.exceptions.TemplateError) and not isinstance(e, jinja2.exceptions.UndefinedError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _compile(source: str, template_file: str):
    """The template compiled as transformers compiles chat templates."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - the sft extra installs it
        raise InstructDataError("chat templates need the jinja2 package: pip install 'megatrain-jax[sft]'") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:  # a syntax error, or one of Python's (a template nested too deep: RecursionError)
        raise InstructDataError(f"the chat template ({template_file}) does not parse: {_template_error(e)}") from None


# ---------------------------------------------------------------------------------------------- files
def read_examples(path: str | os.PathLike, tokenizer: ChatTokenizer, seq_len: int,
                  too_long: TooLong = "truncate") -> tuple[list[Example], Stats]:
    """Every line of ``path`` checked and tokenized. Examples longer than ``seq_len + 1`` tokens are cut to
    that length (``truncate``) or left out (``skip``); either way they are counted in the stats, as are
    examples left without a token to learn. Raises InstructDataError naming the line for anything else,
    and when no example is left."""
    # 'file:line' -> the last learned ids (what the note shows), where they hold no stop id (before any cut): a
    # few ids an example, not its whole answer, however large the file
    unstopped: dict[str, np.ndarray] = {}

    def encode(text: str, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        ids, mask = tokenizer.encode(parse_line(text, where))
        learned = ids[1:][mask > 0]
        if not np.isin(learned, tokenizer.stop_ids).any():
            unstopped[where] = learned[-3:].copy()
        return [(ids, mask)]

    lines, stats = read_tokenized(path, encode, seq_len, too_long, "example", "assistant token")
    kept_unstopped = [w for w in (f"{Path(path)}:{line}" for line, _ in lines) if w in unstopped]
    if kept_unstopped:
        stats.notes.append(_no_stop_note(tokenizer, kept_unstopped[0], unstopped[kept_unstopped[0]],
                                         len(kept_unstopped), stats.kept))
    return [Example(ids, mask, line) for line, [(ids, mask)] in lines], stats


def _no_stop_note(tokenizer: ChatTokenizer, first: str, learned: np.ndarray, count: int, kept: int) -> str:
    """What to say of ``count`` of ``kept`` examples whose learned tokens hold no end-of-sequence token, ``first``
    (``file:line``) the first of them, ``learned`` its learned ids."""
    ending = tokenizer.tokenizer.decode([int(i) for i in learned[-3:]], skip_special_tokens=False)
    said = (f"{count:,} of {kept:,} examples have answers without an end-of-sequence token (the first: {first}, "
            f"whose answer ends {ending!r}), so the fine-tuned model does not learn to stop and generation runs on "
            f"past its answer")
    config = Path(tokenizer.where) / "tokenizer_config.json"
    eos = tokenizer.special.get("eos_token")
    if eos is None or tokenizer.tokenizer.token_to_id(eos) is None:  # prompt/completion lines end with it too
        has = "no eos_token" if eos is None else f"the eos_token {eos!r}, which is not a token of tokenizer.json"
        return (f"{said}: {config} has {has}. Set eos_token there to the model's end-of-sequence token (for chat "
                f"lines, the token the chat template ends the assistant's turn with)")
    names = ", ".join(repr(tokenizer.tokenizer.id_to_token(i) or i) for i in tokenizer.stop_ids)
    return (f"{said}: generation stops at {names}, which the chat template ({tokenizer.template_file}) does not put "
            f"in the assistant's turn. Use a template that ends the assistant's turn with it ({{{{ eos_token }}}} "
            f"after the content), or set eos_token in {config} to the token the template ends the turn with")


def read_tokenized(path: str | os.PathLike, encode: Callable[[str, str], list[tuple[np.ndarray, np.ndarray]]],
                   seq_len: int, too_long: TooLong, what: str, learned: str) -> tuple[list[tuple[int, list]], Stats]:
    """Every non-blank line of ``path`` as ``(line number, its token sequences)``: ``encode(text, 'file:line')``
    gives a line's sequences (ids and loss mask each: one example, or a pair's two sides). A line with a sequence
    over ``seq_len + 1`` tokens has them all cut to that length (``truncate``) or is left out (``skip``); a line
    with a sequence left without a ``learned`` token is left out; both counted. InstructDataError names the line
    of any error, and says when no ``what`` is left."""
    if too_long not in ("truncate", "skip"):
        raise ValueError(f"too_long must be 'truncate' or 'skip', got {too_long!r}")
    path = Path(path)
    if not path.exists():
        raise InstructDataError(f"{path} does not exist")
    out, stats = [], Stats()
    least: list[int] = []  # the seq_len that would have kept each line left out as too long, or for want of loss
    for line_no, text in read_lines(path):
        where = f"{path}:{line_no}"
        try:
            sequences = encode(text, where)
        except InstructDataError as e:
            raise InstructDataError(e.args[0] if e.args[0].startswith(where) else f"{where}: {e}") from None
        whole, cut = sequences, max(len(ids) for ids, _ in sequences) > seq_len + 1
        if cut:
            if too_long == "skip":
                stats.skipped_too_long += 1
                least.append(max(len(ids) for ids, _ in sequences) - 1)
                continue
            sequences = [(ids[:seq_len + 1], mask[:seq_len]) for ids, mask in sequences]
        if not all(mask.any() for _, mask in sequences):
            stats.skipped_no_loss += 1
            if all(mask.any() for _, mask in whole):  # each sequence's first learned token, kept
                least.append(max(int(np.argmax(mask > 0)) + 1 for _, mask in whole))
            continue
        if len(sequences) == 2 and all(np.array_equal(a, b) for a, b in zip(*sequences)):
            stats.skipped_identical += 1  # a pair's sides the same (as written, or once cut to seq_len + 1)
            continue
        out.append((line_no, sequences))
        stats.kept += 1
        stats.truncated += cut  # kept and cut: one left out after its cut is counted as left out only
    if not out:
        ways = ([f"a data.seq_len of at least {min(least)} keeps one"] if least else []) + (
            ["data.too_long = 'truncate' cuts them to seq_len + 1 tokens"] if stats.skipped_too_long else [])
        raise InstructDataError(f"{path}: no usable {what} (lines read: {stats.skipped_too_long} too long and "
                                f"skipped, {stats.skipped_no_loss} with no {learned} left after truncation"
                                + (f", {stats.skipped_identical} with both sides the same" if stats.skipped_identical
                                   else "") + ")" + (f"; {', or '.join(ways)}" if ways else "")
                                if stats.skipped_too_long or stats.skipped_no_loss or stats.skipped_identical
                                else nothing_in(path, what))
    return out, stats


# ---------------------------------------------------------------------------------------------- cache
FORMAT_VERSION = 3  # bump when what prepare() writes changes (2: the stats' notes; 3: truncated counts kept ones)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatrain_jax" / "instruct"


def cache_key(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, seq_len: int, too_long: str) -> str:
    """A digest of everything the tokenized data depends on: the data file's bytes, the tokenizer's files (with
    the end-of-sequence ids of ``generation_config.json`` and ``config.json``, which the stats' notes read),
    ``seq_len``, ``too_long`` and this module's format version."""
    import hashlib
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{seq_len}|{too_long}|".encode())
    files = [Path(path)] + [Path(tokenizer_dir) / n for n in ("tokenizer.json", "tokenizer_config.json",
                                                              "chat_template.jinja", "generation_config.json",
                                                              "config.json")]
    for f in files:
        h.update(f.name.encode() + b"|" + (_file_digest(f) or b"") + b"|")
    return h.hexdigest()[:32]


# Digests of files read in this process, by (path, inode, size, modification time): a start asks for the data's key
# several times (the config check, the row mix, the batches, the stats, the held-out split), and a data file of
# gigabytes is read once; a file changed or replaced since is read again
_DIGESTS: dict[tuple, bytes] = {}


def _file_digest(f: Path) -> bytes | None:
    """The sha256 of ``f``'s bytes, None where it does not exist."""
    key = file_identity(f)
    if key is None:
        return None
    if key not in _DIGESTS:
        import hashlib
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        _DIGESTS[key] = h.digest()
    return _DIGESTS[key]


def prepare(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, seq_len: int, too_long: TooLong = "truncate",
            cache_dir: str | os.PathLike | None = None) -> tuple[Path, Stats]:
    """Tokenize ``path`` once: its examples as a token file (``data.tokens``) with per-token loss flags and
    one document per example, in ``cache_dir`` under a key of everything it depends on (``cache_key``).
    A later call with the same inputs reads the cached file. Returns the token file and the stats."""
    from megatrain_jax.data.tokens import TokenFile, index_path, loss_path, sidecar_path
    refuse_token_file(path)  # before its bytes are hashed for the cache key: a token file may be many GB
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / f"{cache_key(path, tokenizer_dir, seq_len, too_long)}.bin"
    stats_file = Path(f"{out}.stats.json")
    if sidecar_path(out).exists() and stats_file.exists():
        try:  # the cache is derived data: a damaged entry is made again, never trusted or left to the user
            TokenFile.open(out)
            return out, Stats(**json.loads(stats_file.read_text()))
        except (ValueError, TypeError, OSError) as e:
            print(f"the cached tokenization {out} of {path} is damaged ({e}); tokenizing again", file=sys.stderr)
            for name in (sidecar_path, index_path, loss_path, lambda p: Path(f"{p}.stats.json"), lambda p: Path(p)):
                Path(name(out)).unlink(missing_ok=True)
    tokenizer = ChatTokenizer.from_folder(tokenizer_dir)
    examples, stats = read_examples(path, tokenizer, seq_len, too_long)
    try:
        _write_entry(out, examples, stats, tokenizer)
    except OSError as e:  # the token file is what training reads: without it there is no run
        raise InstructDataError(f"the tokenized data of {path} cannot be written to the cache folder {cache} "
                                f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); training reads it "
                                f"from there: set data.cache_dir to a writable folder with room for it") from None
    return out, stats


def _write_entry(out: Path, examples: list[Example], stats: Stats, tokenizer: ChatTokenizer) -> None:
    """``examples`` as the token file ``out`` (one document each, per-token loss flags), with ``stats`` beside it."""
    from megatrain_jax.data.tokens import TokenWriter, index_path, loss_path, sidecar_path
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    with TokenWriter(tmp, vocab, track_loss=True, tokenizer=tokenizer.where) as w:
        for ex in examples:  # the first token is never a target
            w.append(ex.ids, loss=np.concatenate([[0], ex.loss_mask]).astype(np.uint8))
    for name in (index_path, loss_path, lambda p: Path(p)):  # the sidecar last: until then the file is refused
        os.replace(name(tmp), name(out))
    Path(f"{out}.stats.json").write_text(json.dumps(dataclasses.asdict(stats)))
    os.replace(sidecar_path(tmp), sidecar_path(out))
