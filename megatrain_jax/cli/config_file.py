"""Run configs: a TOML file (plus ``section.key=value`` overrides) -> typed dataclasses.

Sections and the dataclass each fills:

- ``[model]``: ``preset`` (a name from ``megatrain_jax.models.PRESETS``) or ``hf_checkpoint`` (a Hugging
  Face folder whose config.json and weights are loaded), plus any ``DecoderConfig`` field to override;
- ``[data]``: ``DataConfig``; ``[engine]``: ``EngineConfig``;
- ``[optimizer]``: ``OptimizerConfig`` (AdamW and its learning-rate schedule);
- ``[train]``: ``TrainSection`` (the library's ``TrainConfig``: steps, checkpoints; plus evaluation and
  the run folder);
- ``[log]``: ``LogConfig`` (progress display, TensorBoard, Weights & Biases).

Every key is checked against the field's type hint; an unknown key or section, or a value outside a
field's few allowed ones, is an error naming the closest valid one. An error names the file for a value
the file set, and the command-line override for a value an override set. TOML has no null: write
``"none"`` for a field that may be None (``clip_norm = "none"``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import optax

from megatrain_jax.data import DataConfig
from megatrain_jax.data.sampler import FORMATS, MODES
from megatrain_jax.engine_config import EngineConfig
from megatrain_jax.models.config import ATTENTION_IMPLS, DTYPES, ROPE_KINDS, DecoderConfig, RopeScaling, preset
from megatrain_jax.optim import adamw
from megatrain_jax.train_config import TrainConfig


class ConfigError(ValueError):
    """A run config is malformed: the message names the file, section and key, and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model: a named ``preset`` with ``overrides`` of DecoderConfig fields, or a Hugging Face
    checkpoint (its config.json decides the shape and ``preset`` is ignored; overrides may still set
    fields such as ``dtype`` or ``loss_chunk_tokens``)."""

    preset: str = "tiny"
    hf_checkpoint: str | None = None  # a folder with config.json + safetensors; weights are loaded from it
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def build(self) -> DecoderConfig:
        if self.hf_checkpoint is not None:
            from megatrain_jax.hf import read_config
            base = read_config(self.hf_checkpoint)
        else:
            base = preset(self.preset)
        changes = {}
        for k, v in self.overrides.items():
            if isinstance(v, dict):  # a table amends the model's own (moe, rope_scaling), or makes one
                own = getattr(base, k)
                v = dataclasses.replace(own, **v) if own is not None else _table_type(_fields(DecoderConfig)[k])(**v)
            changes[k] = v
        return base.replace(**changes) if changes else base


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (weight decay on matrices only, decoupled) with linear warm-up, then cosine decay to
    ``min_lr_ratio * lr`` over the run, or a constant rate."""

    lr: float = 3e-4
    warmup_steps: int = 0
    decay: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got lr={self.lr}, "
                             f"warmup_steps={self.warmup_steps}, min_lr_ratio={self.min_lr_ratio}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0 and self.weight_decay >= 0):
            raise ValueError(f"need 0 <= b1, b2 < 1, eps > 0 and weight_decay >= 0; got b1={self.b1}, "
                             f"b2={self.b2}, eps={self.eps}, weight_decay={self.weight_decay}")

    def schedule(self, total_steps: int) -> optax.Schedule:
        warm = min(self.warmup_steps, max(total_steps - 1, 0))
        if self.decay == "constant":
            if warm == 0:
                return optax.constant_schedule(self.lr)
            return optax.join_schedules([optax.linear_schedule(0.0, self.lr, warm),
                                         optax.constant_schedule(self.lr)], [warm])
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, warm, max(total_steps, warm + 1),
                                                  self.lr * self.min_lr_ratio)

    def build(self, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """The optimizer (``megatrain_jax.adamw``: the engine runs it as a fused in-place host kernel) and
        its schedule. Clipping is the engine's (``engine.clip_norm``)."""
        sched = self.schedule(total_steps)
        return adamw(sched, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay), sched


@dataclasses.dataclass(frozen=True)
class TrainSection(TrainConfig):
    """The ``[train]`` section: the library's ``TrainConfig`` (what ``fit`` runs) plus the run folder's
    settings. ``eval_every = 0`` turns evaluation off.

    Checkpoints go to ``checkpoint_dir`` (default ``run_dir/checkpoints``) every ``checkpoint_every`` steps
    and at the end, when ``checkpoint_every > 0``, ``resume`` or ``checkpoint_dir`` is set. ``resume =
    true`` continues from the newest complete checkpoint there (or starts fresh when there is none); a
    string names a checkpoint folder to start from."""

    steps: int = 100
    eval_every: int = 0
    eval_batches: int = 8
    run_dir: str = "runs/default"
    export_hf: str | None = None  # write the trained model here as a Hugging Face folder at the end
    memory_check: bool = True  # refuse to start when the memory plan does not fit

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_batches"):
            if getattr(self, name) is None or getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0 = off), got {self.eval_every}")
        self.for_fit()  # every TrainConfig check, with the run folder's checkpoint default

    def for_fit(self) -> TrainConfig:
        """The ``TrainConfig`` ``fit`` gets: checkpoints under the run folder unless placed elsewhere."""
        checkpoint_dir = self.checkpoint_dir
        if checkpoint_dir is None and (self.checkpoint_every or self.resume):
            checkpoint_dir = str(Path(self.run_dir) / "checkpoints")
        return TrainConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}
                           | {"checkpoint_dir": checkpoint_dir, "log_every": 0})


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What reports progress. metrics.jsonl in the run folder is always written."""

    progress: Literal["auto", "bar", "lines", "off"] = "auto"  # auto: a bar on a terminal, lines otherwise
    tensorboard: bool = True  # event files in the run folder, when tensorboardX or tensorboard is installed
    wandb: bool = False  # Weights & Biases, when installed and asked for here
    wandb_project: str = "megatrain-jax"
    wandb_name: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run, a section per component."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(RunConfig)  # section name -> its dataclass
_MODEL_KEYS = ("preset", "hf_checkpoint")

# Plain-string fields that take one of a few values (their classes check them too). A config file reads
# them as Literal fields, so a typo gets the same "did you mean" as any Literal.
CHOICES: dict[tuple[type, str], tuple[str, ...]] = {
    (DataConfig, "mode"): MODES,
    (DataConfig, "format"): FORMATS,
    (DataConfig, "too_long"): ("truncate", "skip"),
    (EngineConfig, "stream_dtype"): DTYPES,
    (EngineConfig, "master_dtype"): ("float32", "bfloat16"),
    (DecoderConfig, "dtype"): DTYPES,
    (DecoderConfig, "attention_impl"): ATTENTION_IMPLS,
    (RopeScaling, "kind"): ROPE_KINDS,
}


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

    def in_table(self, table: Mapping) -> str:
        """``blame`` for the keys of ``table``, which sits at this place."""
        return self.blame(self.path + (k,) for k in table)


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
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
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
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
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


def _check_keys(table: dict, valid: Sequence[str], where: Where) -> None:
    for key in table:
        if key not in valid:
            item = where.key(key).override()
            place = where.text if item is None else f"command-line override {item}"
            raise ConfigError(f"unknown key {key!r} in {place}; {_closest(key, valid)}"
                              f"valid keys: {', '.join(sorted(valid))}")


def build_dataclass(cls: type, table: dict, where: str | Where) -> Any:
    """``cls(**table)`` with every key checked and every value coerced to its field's type."""
    where = where if isinstance(where, Where) else Where(where)
    fields = _fields(cls)
    _check_keys(table, list(fields), where)
    kwargs = {k: coerce(v, fields[k], where.key(k)) for k, v in table.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where.in_table(table)}: {e}") from None


def _table_type(hint: Any) -> type | None:
    """The dataclass a field holds (``MoEConfig | None`` -> MoEConfig), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _model(table: dict, where: Where) -> ModelSection:
    fields = _fields(DecoderConfig)
    _check_keys(table, list(_MODEL_KEYS) + list(fields), where)
    hf_checkpoint = coerce(table.get("hf_checkpoint"), str | None, where.key("hf_checkpoint"))
    name = coerce(table.get("preset", "tiny"), str, where.key("preset"))
    overrides = {}
    for k, v in table.items():
        if k in _MODEL_KEYS:
            continue
        table_of = _table_type(fields[k])
        if isinstance(v, dict) and table_of is not None:  # a table (moe, rope_scaling): amends the model's own
            sub = _fields(table_of)
            _check_keys(v, list(sub), where.key(k))
            overrides[k] = {kk: coerce(vv, sub[kk], where.key(k).key(kk)) for kk, vv in v.items()}
        else:
            overrides[k] = coerce(v, fields[k], where.key(k))
    section = ModelSection(preset=name, hf_checkpoint=hf_checkpoint, overrides=overrides)
    try:
        section.build()  # every DecoderConfig check, now rather than after data is loaded
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"{where.in_table(table)}: {e}") from None
    return section


def _paths(raw: Mapping, prefix: tuple[str, ...] = ()) -> Iterable[tuple[str, ...]]:
    """Every key path of a nested dict: ``("model",)``, ``("model", "layers")``, ..."""
    for key, value in raw.items():
        yield prefix + (key,)
        if isinstance(value, Mapping):
            yield from _paths(value, prefix + (key,))


def _override_paths(overrides: Sequence[str]) -> dict[tuple[str, ...], str]:
    """The key path each ``section.key=value`` override sets (the last one wins, as when applied)."""
    return {tuple(k.strip() for k in item.partition("=")[0].split(".")): item for item in overrides}


def parse_config(raw: dict, source: str = "config", overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from a dict shaped like the TOML file (sections of keys) read from ``source``, with
    the command-line ``overrides`` (``section.key=value``) applied. An error names the file for a value
    from ``raw`` and the override for a value an override set."""
    root = Where(source, (), _override_paths(overrides), frozenset(_paths(raw)))
    raw = apply_overrides(raw, overrides)
    for name, table in raw.items():
        if name not in SECTIONS:
            blame = dataclasses.replace(root, path=(name,)).in_table(table) if isinstance(table, dict) else source
            raise ConfigError(f"{blame}: unknown section [{name}]; {_closest(name, list(SECTIONS))}"
                              f"valid sections: {', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys, got {table!r}")
    parts = {}
    for name, cls in SECTIONS.items():
        where = dataclasses.replace(root, text=f"{source} [{name}]", path=(name,))
        table = raw.get(name, {})
        parts[name] = _model(table, where) if cls is ModelSection else build_dataclass(cls, table, where)
    cfg = RunConfig(**parts)
    if cfg.train.eval_every and cfg.data.eval_fraction <= 0:
        blame = root.blame([("train", "eval_every"), ("data", "eval_fraction")])
        raise ConfigError(f"{blame}: [train] eval_every = {cfg.train.eval_every} needs held-out data: set "
                          f"[data] eval_fraction > 0 (e.g. 0.01), or eval_every = 0")
    if cfg.data.batch_size % cfg.engine.micro_batches:
        blame = root.blame([("data", "batch_size"), ("engine", "micro_batches")])
        raise ConfigError(f"{blame}: [data] batch_size = {cfg.data.batch_size} cannot be split into [engine] "
                          f"micro_batches = {cfg.engine.micro_batches}; use a batch_size divisible by it")
    return cfg


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


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML run config (``None``: all defaults) and apply command-line overrides."""
    raw: dict = {}
    source = "command line"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    return parse_config(raw, source, overrides)


# ---------------------------------------------------------------------------------------------- writing
def to_dict(cfg: RunConfig) -> dict[str, dict]:
    """The sections as a dict that ``parse_config`` reads back to an equal RunConfig."""
    out = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        if isinstance(section, ModelSection):
            table = {"hf_checkpoint": section.hf_checkpoint} if section.hf_checkpoint else {"preset": section.preset}
            table.update({k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                          for k, v in section.overrides.items()})
        else:
            table = dataclasses.asdict(section)
        out[name] = table
    return out


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
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: RunConfig) -> str:
    """The fully resolved config as TOML (saved in the run folder, so a run can be repeated exactly)."""
    lines = []
    for name, table in to_dict(cfg).items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)
