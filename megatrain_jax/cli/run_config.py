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
field's few allowed ones, is an error naming the closest valid one, and a key of another section is named as that
section's (``train.seq_len=64``: "'seq_len' is a [data] key: data.seq_len=64"). A ``data.seq_len`` whose windows
(or padded rows) reach past the model's ``max_positions`` is refused here too (``check_positions``), before anything
loads, and so are engine counts past the model's blocks (``check_blocks``). An error names the file for a value the
file set, and the command-line override for a value an override set. TOML has no null: write ``"none"`` for a field
that may be None (``clip_norm = "none"``). Those rules are the schema-free ``megatrain_jax.cli.toml_dataclass``'s;
this module holds the schema.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import optax

from megatrain_jax.cli.toml_dataclass import (CHOICES, RETIRED, ConfigError, Where, _check_keys, _closest, _fields,
                                              _override_paths, _paths, _table_type, _toml_value, apply_overrides,
                                              build_dataclass, coerce, key_home, keys_named)
from megatrain_jax.data import DataConfig
from megatrain_jax.data.batches import MODES
from megatrain_jax.data.config import FORMATS
from megatrain_jax.engine import precision
from megatrain_jax.engine.config import AUTO, EngineConfig
from megatrain_jax.loss import DPO
from megatrain_jax.models.config import ATTENTION_IMPLS, DTYPES, DecoderConfig, RopeScaling
from megatrain_jax.models.presets import preset
from megatrain_jax.models.sublayers import ROPE_KINDS
from megatrain_jax.optim import adamw
from megatrain_jax.train_config import TrainConfig, check_path


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model: a named ``preset`` with ``overrides`` of DecoderConfig fields, or a Hugging Face
    checkpoint (its config.json decides the shape and ``preset`` is ignored; overrides may still set
    fields such as ``dtype`` or ``loss_chunk_tokens``)."""

    preset: str = "tiny"
    hf_checkpoint: str | None = None  # a folder with config.json + safetensors; weights are loaded from it
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_path("hf_checkpoint", self.hf_checkpoint,
                   "the Hugging Face folder (with config.json), or leave it unset for a preset")

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
        if not 0 < self.lr < math.inf or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got lr={self.lr}, "
                             f"warmup_steps={self.warmup_steps}, min_lr_ratio={self.min_lr_ratio}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and 0 < self.eps < math.inf and 0 <= self.weight_decay < math.inf):
            raise ValueError(f"need 0 <= b1, b2 < 1, eps > 0 and weight_decay >= 0, finite; got b1={self.b1}, "
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
    settings. ``eval_every = 0`` turns evaluation off; unset, a run with held-out data (``[data]
    eval_fraction > 0``) evaluates every tenth of its steps (``eval_interval``).

    Checkpoints go to ``checkpoint_dir`` (default ``run_dir/checkpoints``) every ``checkpoint_every`` steps
    and at the end, when ``checkpoint_every > 0``, ``resume`` or ``checkpoint_dir`` is set. ``resume =
    true`` continues from the newest complete checkpoint there (or starts fresh when there is none); a
    string names a checkpoint folder to start from."""

    steps: int = 100
    eval_every: int | None = None
    eval_batches: int = 8
    run_dir: str = "runs/default"
    export_hf: str | None = None  # write the trained model here as a Hugging Face folder at the end
    export_overwrite: bool = False  # replace a model already in export_hf (else the run refuses at start)
    memory_check: bool = True  # refuse to start when the memory plan does not fit

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_batches"):
            if getattr(self, name) is None or getattr(self, name) < 1:
                off = " (steps between progress lines; log.progress = 'off' prints none)" if name == "log_every" else ""
                raise ValueError(f"{name} must be >= 1{off}, got {getattr(self, name)}")
        check_path("run_dir", self.run_dir, "a folder (e.g. runs/my-run)")
        check_path("export_hf", self.export_hf, "a folder (e.g. runs/my-run/hf), or leave it unset")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0 = off), got {self.eval_every}")
        if self.profile_step and self.profile_step > self.steps:
            raise ValueError(f"profile_step={self.profile_step} is past the run's last step (steps={self.steps}): "
                             f"give a step from 1 to {self.steps}, or 0 for none")
        self.for_fit()  # every TrainConfig check, with the run folder's checkpoint default

    def eval_interval(self, eval_fraction: float) -> int:
        """Steps between evaluations (0: none): ``eval_every``, or where it is unset and data is held out,
        a tenth of the run."""
        if self.eval_every is not None:
            return self.eval_every
        return max(1, self.steps // 10) if eval_fraction > 0 else 0

    def checkpoint_folder(self) -> Path:
        """Where this run's checkpoints are, or would be: ``checkpoint_dir``, else ``run_dir/checkpoints``."""
        return Path(self.checkpoint_dir or Path(self.run_dir) / "checkpoints")

    def for_fit(self) -> TrainConfig:
        """The ``TrainConfig`` ``fit`` gets: checkpoints under the run folder unless placed elsewhere."""
        checkpoint_dir = self.checkpoint_dir
        if checkpoint_dir is None and (self.checkpoint_every or self.resume):
            checkpoint_dir = str(self.checkpoint_folder())
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
    dpo: DPO = dataclasses.field(default_factory=DPO)  # read with [data] format = "preference"

    def with_tokenizer(self) -> "RunConfig":
        """Instruction and preference data tokenized by the model's own Hugging Face folder where ``[data]
        tokenizer`` is unset, as ``train`` reads them (and ``plan``, which reads the data for the step time)."""
        d = self.data
        if d.format in ("chat", "preference") and d.tokenizer is None and self.model.hf_checkpoint is not None:
            return dataclasses.replace(self, data=dataclasses.replace(d, tokenizer=self.model.hf_checkpoint))
        return self


SECTIONS: dict[str, type] = typing.get_type_hints(RunConfig)  # section name -> its dataclass
_MODEL_KEYS = ("preset", "hf_checkpoint")

# Plain-string fields that take one of a few values (their classes check them too). A config file reads
# them as Literal fields, so a typo gets the same "did you mean" as any Literal.
CHOICES.update({
    (DataConfig, "mode"): MODES,
    (DataConfig, "format"): FORMATS,
    (DataConfig, "too_long"): ("truncate", "skip"),
    (EngineConfig, "stream_dtype"): DTYPES,
    (EngineConfig, "master_dtype"): precision.MASTER_DTYPES,  # the precision modes' (engine/precision.py)
    (EngineConfig, "moment_dtype"): precision.MOMENT_DTYPES,
    (EngineConfig, "host_grad_dtype"): precision.HOST_GRAD_DTYPES,
    (EngineConfig, "device_grad_dtype"): ("float32", "bfloat16"),
    (DecoderConfig, "dtype"): DTYPES,
    (DecoderConfig, "attention_impl"): ATTENTION_IMPLS,
    (RopeScaling, "kind"): ROPE_KINDS,
})
RETIRED.update({(EngineConfig, "moment_dtype"): {name: precision.removed_moments(name)
                                                 for name in precision.REMOVED_MOMENT_DTYPES}})

# Each section's keys, so that a key written in the wrong section is named as its own section's
# (``train.seq_len=64``: "'seq_len' is a [data] key: data.seq_len=64"), not as a near miss in the wrong one.
SECTION_KEYS: dict[str, tuple[str, ...]] = {
    name: _MODEL_KEYS + tuple(_fields(DecoderConfig)) if cls is ModelSection else tuple(_fields(cls))
    for name, cls in SECTIONS.items()}


# ---------------------------------------------------------------------------------------------- parsing
def _model(table: dict, where: Where, hf_folder: bool = True) -> ModelSection:
    """The ``[model]`` section, checked by building its DecoderConfig; ``hf_folder=False`` leaves a Hugging Face
    folder's unread (``parse_config``)."""
    fields = _fields(DecoderConfig)
    _check_keys(table, list(_MODEL_KEYS) + list(fields), where, SECTION_KEYS)
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
    try:
        section = ModelSection(preset=name, hf_checkpoint=hf_checkpoint, overrides=overrides)
        if hf_folder or hf_checkpoint is None:
            section.build()  # every DecoderConfig check, now rather than after data is loaded
    except FileNotFoundError as e:  # no checkpoint there (yet): say how to plan the shape before the download
        raise ConfigError(f"{where.in_table(table)}: {e}: download the checkpoint there, or point hf_checkpoint "
                          f"at it; to plan the run before downloading, give a preset of the same shape instead "
                          f"(model.hf_checkpoint=none model.preset=NAME; the presets: docs/models.md)") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where.in_table(table, e)}: {e}") from None
    return section


def parse_config(raw: dict, source: str = "config", overrides: Sequence[str] = (),
                 hf_folder: bool = True) -> RunConfig:
    """A RunConfig from a dict shaped like the TOML file (sections of keys) read from ``source``, with
    the command-line ``overrides`` (``section.key=value``) applied. An error names the file for a value
    from ``raw`` and the override for a value an override set.

    ``hf_folder=False`` does not read a ``model.hf_checkpoint`` folder, whose config.json checks the model's
    overrides and ``data.seq_len`` against the model: for a config saved by a run (``run_folder.last_config``),
    whose folder may have moved since and whose values were checked when it ran."""
    root = Where(source, (), _override_paths(overrides), frozenset(_paths(raw)))
    raw = apply_overrides(raw, overrides)
    for name, table in raw.items():
        if name not in SECTIONS:
            blame = dataclasses.replace(root, path=(name,)).in_table(table) if isinstance(table, dict) else source
            homes = [s for s, keys in SECTION_KEYS.items() if name in keys]
            if homes:  # a key written before any table of the file ([model.rope_scaling] as [rope_scaling])
                items = [item for path, item in root.overrides.items() if path[0] == name]
                raise ConfigError(f"{blame}: {name!r} is outside any section; "
                                  f"{key_home(name, homes, items, table=isinstance(table, dict))}")
            raise ConfigError(f"{blame}: unknown section [{name}]; {_closest(name, list(SECTIONS))}"
                              f"valid sections: {', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys, got {table!r}")
    parts = {}
    for name, cls in SECTIONS.items():
        where = dataclasses.replace(root, text=f"{source} [{name}]", path=(name,))
        table = raw.get(name, {})
        parts[name] = (_model(table, where, hf_folder) if cls is ModelSection else
                       build_dataclass(cls, table, where, SECTION_KEYS))
    cfg = RunConfig(**parts)
    if cfg.data.format != "preference" and cfg.dpo != DPO():
        blame = root.blame([("dpo", "beta"), ("dpo", "label_smoothing"), ("data", "format")])
        raise ConfigError(f"{blame}: [dpo] sets preference training, which reads [data] format = 'preference' "
                          f"(prompt/chosen/rejected pairs), not {cfg.data.format!r}: set the format, or remove [dpo]")
    if cfg.train.eval_every and cfg.data.eval_fraction <= 0:
        blame = root.blame([("train", "eval_every"), ("data", "eval_fraction")])
        raise ConfigError(f"{blame}: [train] eval_every = {cfg.train.eval_every} needs held-out data: set "
                          f"[data] eval_fraction > 0 (e.g. 0.01), or eval_every = 0")
    try:  # the GPUs' share is checked when the engine knows how many it runs on
        cfg.engine.check_rows(cfg.data.batch_size, pairs=cfg.data.format == "preference")
    except ValueError as err:
        blame = root.blame([("data", "batch_size"), ("engine", "micro_batches")])
        raise ConfigError(f"{blame}: [data] batch_size: {err}") from None
    if not (hf_folder or cfg.model.hf_checkpoint is None):
        return cfg
    model_cfg = cfg.model.build()  # the model's shape, a Hugging Face checkpoint's from its config.json
    model_paths = [("model", "layers"), ("model", "preset"), ("model", "hf_checkpoint")]
    try:
        check_positions(cfg.data, model_cfg)
    except ValueError as err:
        blame = root.blame([("data", "seq_len"), ("data", "mode"), ("model", "max_positions"), *model_paths])
        raise ConfigError(f"{blame}: {err}") from None
    try:
        check_blocks(cfg.engine, model_cfg.layers)
    except ValueError as err:
        named = [("engine", k) for k in keys_named(raw.get("engine", {}), err)]
        raise ConfigError(f"{root.blame(named + model_paths)}: {err}") from None
    return cfg


def check_blocks(engine_cfg: EngineConfig, n_blocks: int) -> None:
    """Raise ValueError where the engine's counts ask for more blocks than a model of ``n_blocks`` has
    (``resident_layers``, ``offload_activations``), or for more parts in a role than there are (``parts.HostRoles``:
    blocks updated on the GPU, gradients waiting there, moments on disk), as the plan and the engine would, but
    before the data is read. A ``resident_layers`` still "auto" counts as none, which leaves the most blocks to the
    other roles: what is refused here is refused whatever the plan picks. ``kept_layers`` and its overlap with
    ``offload_activations``: ``EngineConfig.check_layers``."""
    from megatrain_jax.engine.parts import HostRoles
    for name in ("resident_layers", "offload_activations"):
        count = getattr(engine_cfg, name)
        if count != AUTO and count > n_blocks:
            raise ValueError(f"engine.{name} = {count} is more than the model's {n_blocks} blocks: set at most "
                             f"{n_blocks}")
    HostRoles.of_config(n_blocks, engine_cfg, resident_layers=0 if engine_cfg.resident_layers == AUTO else None)
    engine_cfg.check_layers(n_blocks)


def check_positions(data: DataConfig, model_cfg: DecoderConfig) -> str | None:
    """Raise ValueError where every batch would reach past the model's ``max_positions`` (windows and padded rows of
    a ``seq_len`` longer than it: each row's positions run to seq_len), as the engine refuses the first batch that
    does. For packed rows, whose positions restart at each document, the note to print (a document that long is
    refused before the model loads: ``DataConfig.check``); None where seq_len is within max_positions.
    ``parse_config`` refuses, ``plan`` prints the note."""
    if data.seq_len <= model_cfg.max_positions:
        return None
    what = f"data.seq_len={data.seq_len} is longer than the model's max_positions={model_cfg.max_positions}"
    if data.mode != "packed":
        raise ValueError(f"{what}: train would refuse every batch" + (" (a padded row's positions run to seq_len, its "
                         "padding's too)" if data.mode == "padded" else "") + "; shorten data.seq_len or raise "
                         "model.max_positions")
    return f"{what}: train refuses any example longer than max_positions"


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


def to_toml(cfg: RunConfig) -> str:
    """The fully resolved config as TOML (saved in the run folder, so a run can be repeated exactly)."""
    lines = []
    for name, table in to_dict(cfg).items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)
