"""A TOML table -> a typed dataclass, and back; knows no schema (the run's is ``megatrain_jax.cli.run_config``).

``build_dataclass`` checks every key against the class's fields (a key of another of the schema's sections, when
it is given them, is named as that section's) and ``coerce``s every value to its type hint (bool, int, float, str,
Literal, unions with None written ``"none"``, a dataclass as a table).
``Where`` keeps where a value came from, the file or a ``section.key=value`` command-line override
(``apply_overrides``), so that an error names it. ``CHOICES`` reads plain-string fields that take one of a
few values as Literals; a schema registers its own there.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import re
import tomllib
import types
import typing
from typing import Any, Iterable, Literal, Mapping, Sequence


class ConfigError(ValueError):
    """A run config is malformed: the message names the file, section and key, and what is allowed."""


# Plain-string fields that take one of a few values, keyed (dataclass, field name). A config file reads
# them as Literal fields, so a typo gets the same "did you mean" as any Literal. Empty here: a schema adds
# its own (``run_config.CHOICES``, on import).
CHOICES: dict[tuple[type, str], tuple[str, ...]] = {}
# Values such a field no longer takes, keyed as CHOICES, each with why and what to set instead: said in place of
# the allowed values' list (``run_config.RETIRED``).
RETIRED: dict[tuple[type, str], Mapping[str, str]] = {}


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a config value came from, for error messages. ``text`` names it in the file (``run.toml
    [model] layers``); a value that a command-line override set is named by that override instead
    (``command-line override model.layers=abc``)."""

    text: str
    path: tuple[str, ...] = ()  # the section, then the keys
    overrides: Mapping[tuple[str, ...], str] = dataclasses.field(default_factory=dict)  # path -> "a.b=c"
    base: frozenset[tuple[str, ...]] = frozenset()  # the paths the file (not an override) set

    def key(self, key: str) -> "Where":
        return dataclasses.replace(self, text=f"{self.text} {key}", path=self.path + (key,))

    def override(self, path: tuple[str, ...] | None = None) -> str | None:
        """The override that set the value at ``path`` (default: this one), or a table holding it."""
        path = self.path if path is None else path
        return next((self.overrides[path[:n]] for n in range(len(path), 0, -1) if path[:n] in self.overrides),
                    None)

    def __str__(self) -> str:
        item = self.override()
        if item is None:
            return self.text
        return f"command-line override {item}: [{self.path[0]}] {' '.join(self.path[1:])}"

    def blame(self, paths: Iterable[tuple[str, ...]]) -> str:
        """Where the values at ``paths`` came from, for an error that none of them causes alone: ``text``,
        the command-line overrides among them, or ``text`` with those overrides."""
        paths = list(paths)
        items = list(dict.fromkeys(o for p in paths if (o := self.override(p)) is not None))
        if not items:
            return self.text
        named = f"command-line override{'s' if len(items) > 1 else ''} {', '.join(items)}"
        from_base = any(p in self.base for p in paths if self.override(p) is None)
        return f"{self.text} with {named}" if from_base else named

    def in_table(self, table: Mapping, error: object = "") -> str:
        """``blame`` for the keys of ``table``, which sits at this place; with ``error`` (what the table's values
        were refused with), for the keys it names where it names any."""
        return self.blame(self.path + (k,) for k in (keys_named(table, error) or table))


def keys_named(keys: Iterable[str], error: object) -> list[str]:
    """The ``keys`` that the message of ``error`` names, each as a whole word."""
    return [k for k in keys if re.search(rf"\b{re.escape(str(k))}\b", str(error))]


# ---------------------------------------------------------------------------------------------- parsing
def _closest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _describe(a) for a in typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return f"a table of {hint.__name__} fields"
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        return f"an array, each entry {_describe(typing.get_args(hint)[0])}"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def coerce(value: Any, hint: Any, where: str | Where) -> Any:
    """``value`` (from TOML) checked against, and converted to, the type ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        for arg in args:
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                return coerce(value, arg, where)  # a table: its own errors name the key that is wrong
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError:
                pass
        literals = [str(a) for arg in args if typing.get_origin(arg) is Literal for a in typing.get_args(arg)]
        hint_text = _closest(str(value), literals) if literals else ""
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}; {hint_text}".rstrip("; "))
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            hint_text = _closest(str(value), [str(a) for a in allowed])
            raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}; {hint_text}".rstrip("; "))
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:  # TOML reads nan and inf, which no field of a run config means
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if origin is tuple and typing.get_args(hint)[1:] == (Ellipsis,):  # a TOML array (LongRoPE's factors, layer_types)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
        return tuple(coerce(v, typing.get_args(hint)[0], where) for v in value)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
        return build_dataclass(hint, value, where if isinstance(where, Where) else Where(where))
    raise ConfigError(f"{where}: fields of type {hint} cannot be set from a config file")


def _fields(cls: type) -> dict[str, Any]:
    """Each init field's type hint; an enumerated plain-string field (``CHOICES``) reads as a Literal."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    for (owner, name), allowed in CHOICES.items():
        if owner is cls:
            optional = type(None) in typing.get_args(fields[name])
            fields[name] = Literal[allowed] | None if optional else Literal[allowed]
    return fields


def _check_keys(table: dict, valid: Sequence[str], where: Where,
                sections: Mapping[str, Sequence[str]] | None = None) -> None:
    """Refuse a key of ``table`` (at ``where``) that is not in ``valid``, naming the command-line overrides that
    set it, else the file. A key of another of the schema's ``sections`` (section name -> its keys) is named as
    that section's, with where to write it; any other gets the closest valid key."""
    for key in table:
        if key in valid:
            continue
        under = where.path + (key,)  # the overrides that set this key, a value in a table under it, or a table over it
        items = [item for path, item in where.overrides.items() if path[:len(under)] == under]
        items = items or [item for item in [where.key(key).override()] if item is not None]
        place = f"command-line override{'s' if len(items) > 1 else ''} {', '.join(items)}" if items else where.text
        homes = [name for name, keys in (sections or {}).items() if key in keys and (name,) != where.path[:1]]
        if not homes:
            raise ConfigError(f"unknown key {key!r} in {place}; {_closest(key, valid)}"
                              f"valid keys: {', '.join(sorted(valid))}")
        rests = [item.split(".", 1)[1] for item in items]  # "train.seq_len=64" -> "seq_len=64"
        raise ConfigError(f"unknown key {key!r} in {place}: "
                          f"{key_home(key, homes, rests, table=isinstance(table[key], dict))}")


def key_home(key: str, homes: Sequence[str], overrides: Sequence[str] = (), table: bool = False) -> str:
    """Where ``key``, written outside its section, belongs: in ``homes`` (its sections). Said as the command-line
    ``overrides`` that set it (``key=value``, ``key.sub=value``: without the wrong section) put in each of them, or,
    for a file, as the table to move it under (``[home.key]`` for a ``table`` of its own)."""
    if len(homes) == 1:
        what = f"{key!r} is {'an' if homes[0][0] in 'aeiou' else 'a'} [{homes[0]}] key"
    else:
        what = f"{key!r} is a key of {' and '.join(f'[{h}]' for h in homes)}"
    if overrides:
        return f"{what}: " + " or ".join(" ".join(f"{h}.{rest.strip()}" for rest in overrides) for h in homes)
    return f"{what}: move it " + " or ".join(f"to [{h}.{key}]" if table else f"under [{h}]" for h in homes)


def build_dataclass(cls: type, table: dict, where: str | Where,
                    sections: Mapping[str, Sequence[str]] | None = None) -> Any:
    """``cls(**table)`` with every key checked and every value coerced to its field's type. ``sections``: the
    schema's sections and their keys, to name the section of a key written in the wrong one (``_check_keys``)."""
    where = where if isinstance(where, Where) else Where(where)
    fields = _fields(cls)
    _check_keys(table, list(fields), where, sections)
    for k, v in table.items():
        why = RETIRED.get((cls, k), {}).get(v) if isinstance(v, str) else None
        if why is not None:
            raise ConfigError(f"{where.key(k)}: {why}")
    kwargs = {k: coerce(v, fields[k], where.key(k)) for k, v in table.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where.in_table(table, e)}: {e}") from None


def _table_type(hint: Any) -> type | None:
    """The dataclass a field holds (``MoEConfig | None`` -> MoEConfig), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _paths(raw: Mapping, prefix: tuple[str, ...] = ()) -> Iterable[tuple[str, ...]]:
    """Every key path of a nested dict: ``("model",)``, ``("model", "layers")``, ..."""
    for key, value in raw.items():
        yield prefix + (key,)
        if isinstance(value, Mapping):
            yield from _paths(value, prefix + (key,))


def _override_paths(overrides: Sequence[str]) -> dict[tuple[str, ...], str]:
    """The key path each ``section.key=value`` override sets (the last one wins, as when applied)."""
    return {tuple(k.strip() for k in item.partition("=")[0].split(".")): item for item in overrides}


def parse_value(text: str) -> Any:
    """A command-line value as TOML reads it (``4``, ``1e-3``, ``true``, ``"x"``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """``raw`` with each ``section.key=value`` (or ``section.table.key=value``) set."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep and item.strip().endswith(".toml"):
            raise ConfigError(f"{item!r} is not an override: to read a config file, pass it as --config {item}")
        if not sep or len(keys) < 2 or not all(keys):
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. model.layers=4 "
                              f"or train.steps=20")
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {key!r} is a value, not a table")
        node[keys[-1]] = parse_value(text.strip())
    return raw


# ---------------------------------------------------------------------------------------------- writing
def _toml_value(v: Any) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (tuple, list)):  # LongRoPE's factors, layer_types
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
