"""A line of chat or preference data, read and checked before any tokenizer sees it: the file's lines as UTF-8
text (a byte-order mark dropped, a token file or a folder refused), each line's JSON object, its messages (known
roles, text contents, the fields templates render beside them) and its form (a conversation, or a prompt and a
completion). Every problem names the file and line (``InstructDataError``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

# the roles a message may have (only the assistant's turns are learned; the chat template renders the others)
ROLES = ("system", "user", "assistant", "developer", "tool", "function", "ipython")
MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id")  # kept for the template beside role and content

class InstructDataError(ValueError):
    """Instruction data or a tokenizer folder that cannot be used; the message names the file and line."""



def json_object(text: str, where: str) -> dict[str, Any]:
    """One JSONL line's object; InstructDataError naming ``where`` (``file:line``) for anything else."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InstructDataError(f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InstructDataError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    return obj


def json_kind(value: Any) -> str:
    """What a JSON value is, in words, for errors: ``null``, ``a number``, ``a string``, ``a list``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a number")


def check_messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    """A line's ``key``: a non-empty list of messages of known roles with text contents, returned as plain dicts of
    their ``role``, ``content`` (a string) and the fields templates render beside (``MESSAGE_FIELDS``);
    InstructDataError naming ``where`` and the message otherwise."""
    if not isinstance(value, list) or not value:
        raise InstructDataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InstructDataError(f"{where}: {key}[{k}] needs a 'role' and a 'content'")
        if m["role"] not in ROLES:
            raise InstructDataError(f"{where}: {key}[{k}] has the unknown role {m['role']!r}; roles are {list(ROLES)}")
        out.append({"role": m["role"], "content": _text(m["content"], m.get("tool_calls"), f"{where}: {key}[{k}]"),
                    **{f: m[f] for f in MESSAGE_FIELDS if m.get(f) is not None}})
    return out


def _text(content: Any, tool_calls: Any, where: str) -> str:
    """A message's content as one string: a string as it is, a list of OpenAI's text parts joined by newlines (as
    vLLM joins them), null beside ``tool_calls`` (a turn that only calls a tool) as empty."""
    if isinstance(content, str):
        return content
    if content is None and tool_calls:
        return ""
    if not isinstance(content, list):
        raise InstructDataError(f"{where}.content must be a string or a list of text parts, got "
                                f"{json_kind(content)}")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else json_kind(part)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InstructDataError(f"{where}.content[{j}] is a part of type {kind!r}: only text parts "
                                    f'({{"type": "text", "text": ...}}) can be trained on; remove the part')
    return "\n".join(part["text"] for part in content)


def parse_line(text: str, where: str) -> dict[str, Any]:
    """One JSONL line checked: a ``messages`` list of known roles with text contents and at least one assistant
    turn, or a ``prompt`` and a ``completion``, both strings or both message lists (the completion with an assistant
    turn). ``where`` is ``file:line`` for errors."""
    obj = json_object(text, where)
    both = sorted({"prompt", "completion"} & obj.keys())
    if "messages" in obj and both:  # which one the author meant cannot be told
        raise InstructDataError(f"{where}: the line has both 'messages' and {' and '.join(map(repr, both))}; keep one "
                                f"form: 'messages' (a conversation, rendered with the chat template) or 'prompt' and "
                                f"'completion' (no template), and remove the other's keys")
    if "messages" in obj:
        messages = check_messages(obj["messages"], where, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise InstructDataError(f"{where}: the conversation has no assistant turn, so nothing to learn")
        return {"messages": messages}
    if isinstance(obj.get("prompt"), list) or isinstance(obj.get("completion"), list):
        return _conversational_pair(obj, where)
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                raise InstructDataError(f"{where}: a prompt/completion line needs a string {key!r}")
        return {"prompt": obj["prompt"], "completion": obj["completion"]}
    raise InstructDataError(f"{where}: a line needs 'messages' (a conversation) or 'prompt' and 'completion'; "
                            f"found keys {sorted(obj)}")


def _conversational_pair(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """A prompt/completion line of message lists (TRL's conversational form): the completion's assistant turns are
    learned, the prompt's are context."""
    if not all(isinstance(obj.get(k), list) for k in ("prompt", "completion")):
        kinds = ", ".join(f"{k!r} is {json_kind(obj[k]) if k in obj else 'missing'}" for k in ("prompt", "completion"))
        raise InstructDataError(f"{where}: 'prompt' and 'completion' must both be strings (plain text) or both message "
                                f"lists (a conversation), not a mix: here {kinds}")
    prompt, completion = (check_messages(obj[k], where, k) for k in ("prompt", "completion"))
    if not any(m["role"] == "assistant" for m in completion):
        raise InstructDataError(f"{where}: the completion holds no assistant message, so nothing to learn")
    return {"prompt": prompt, "completion": completion}


def nothing_in(path: Path, what: str) -> str:
    """What to say of a file without a line: empty, or only blank lines."""
    said = "it is empty" if path.stat().st_size == 0 else "it holds only blank lines"
    forms = (' {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} or {"prompt": ..., "completion": '
             '...}' if what == "example" else ' {"prompt": ..., "chosen": ..., "rejected": ...}')
    return f"{path} has no {what}s: {said}; write one {what} a line,{forms} (docs/fine_tuning.md)"


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a UTF-8 text file with their numbers (from 1), a leading byte-order mark dropped (as
    editors on Windows write one); InstructDataError naming the line for bytes that are not UTF-8, and saying so
    for a token file given as JSON lines."""
    refuse_token_file(path)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise InstructDataError(f"{path}:{line_no} is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                        f"{e.start + 1}); save the file as UTF-8") from None
            if text.strip():
                yield line_no, text


def refuse_token_file(path: str | os.PathLike) -> None:
    """Raise InstructDataError when ``path`` is a folder, or looks like a token file (``data.tokens``: token ids,
    not JSON lines): it has a token file's sidecar, holds a .npy array, or is named .bin or .npy and holds NUL
    bytes (which JSON lines never do)."""
    from megatrain_jax.data.tokens import NPY_MAGIC, sidecar_path
    path = Path(path)
    if path.is_dir():
        raise InstructDataError(f"{path} is a folder, not a file of JSON lines: set data.path to the .jsonl file "
                                f"itself (docs/fine_tuning.md)")
    side = sidecar_path(path)
    if not path.is_file():
        return
    if side.exists():
        sign = f"it has a token file's sidecar {side}"
    else:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if head.startswith(NPY_MAGIC):
            sign = "it holds a .npy array"
        elif path.suffix in (".bin", ".npy") and b"\0" in head:
            sign = "it holds binary data, not text"
        else:
            return
    raise InstructDataError(f"{path} looks like a token file ({sign}), not JSON lines: to train on its token ids "
                            f"set data.format = 'tokens'; format = 'chat' and 'preference' read JSONL "
                            f"(docs/fine_tuning.md)")
