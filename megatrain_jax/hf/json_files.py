"""The JSON files of a Hugging Face folder (``config.json``, ``generation_config.json``, ``tokenizer_config.json``,
``model.safetensors.index.json``), each read as one JSON object: anything else is an error naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatrain_jax.families import UnsupportedConfig


def read_json_object(path: str | os.PathLike, error: type[ValueError] = UnsupportedConfig) -> dict[str, Any]:
    """The JSON object in the file at ``path``. A file that is not UTF-8, not JSON (Python's ``NaN`` and
    ``Infinity`` included, which JSON does not have), or holds a list or a value instead of an object raises
    ``error`` naming the file, where in it, and what to do."""
    path = Path(path)
    advice = "fix the file, or take it again from the model's source (e.g. the Hugging Face Hub)"
    try:
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}); {advice}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {advice}") from None
    except ValueError as e:  # a NaN or Infinity
        raise error(f"{path}: {e}; {advice}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: holds a JSON {_json_kind(value)}, where a JSON object ({{\"key\": value, ...}}) "
                    f"belongs; {advice}")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (a number must be finite)")


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)
