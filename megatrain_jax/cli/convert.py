"""``convert``: between Hugging Face folders and our formats.

- ``hf`` -> ``hf``: rewrite a checkpoint in another dtype / shard size (bfloat16 <-> float32);
- ``hf`` <-> ``npz``: our per-part float32 parameter trees in one ``.npz`` (keys ``io/embedding``,
  ``blocks/3/attn/q/kernel``, ...; the DecoderConfig as JSON under ``__config__``);
- ``hf``/``npz`` -> ``orbax``: a parameters-only Orbax checkpoint (``megatrain_jax.checkpoint.save_params``);
- ``orbax`` -> ``hf``/``npz``: from such a checkpoint, or the parameters of a training checkpoint
  (``fit(checkpoint_dir=...)``: its newest step, refused when that step fails its check, or the step directory
  given: the way to convert an older step).

The whole model passes through host RAM once as float32 (4 bytes per parameter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.cli.toml_dataclass import build_dataclass
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.checkpoint.failures import format_size, free_space
from megatrain_jax.checkpoint.parts import nest
from megatrain_jax.checkpoint.params import check_params

FORMATS = ("hf", "npz", "orbax")
CONFIG_KEY = "__config__"


def detect_format(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.suffix == ".npz":
        return "npz"
    if (p / "config.json").exists():
        return "hf"
    if p.is_dir() and any(p.iterdir()):
        return "orbax"
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist: give a Hugging Face folder (with config.json), a .npz file "
                                f"or an Orbax checkpoint directory")
    raise ValueError(f"cannot tell the format of {path}: expected a Hugging Face folder (with config.json), "
                     f"a .npz file or an Orbax checkpoint directory")


def _flatten(tree: dict, prefix: str, out: dict[str, np.ndarray]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _flatten(v, f"{prefix}{k}/", out)
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32)


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    return nest(flat, sep="/")


def _pure_dict(tree: Any) -> dict:
    if isinstance(tree, dict):
        return tree
    from flax import nnx
    return nnx.to_pure_dict(tree)


def save_npz(path: str | os.PathLike, cfg: DecoderConfig, io: Any, blocks: list[Any]) -> Path:
    """Our parameters (pure dicts or nnx.State) as one float32 .npz with the config inside."""
    flat: dict[str, np.ndarray] = {}
    _flatten(_pure_dict(io), "io/", flat)
    for i, b in enumerate(blocks):
        _flatten(_pure_dict(b), f"blocks/{i}/", flat)
    flat[CONFIG_KEY] = np.array(json.dumps(dataclasses.asdict(cfg)))
    path = npz_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}.npz"
    try:  # written whole beside the target, then put in place in one step: a kill leaves the old file or the new
        np.savez(partial, **flat)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def npz_path(path: str | os.PathLike) -> Path:
    """Where an .npz output goes: ``path``, with ``.npz`` added as numpy adds it."""
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def load_npz(path: str | os.PathLike) -> tuple[DecoderConfig, dict, list[dict]]:
    """``(cfg, io_params, [block_params])`` from ``save_npz``'s file, as float32 numpy trees."""
    if Path(path).is_file() and not zipfile.is_zipfile(path):  # numpy would offer to unpickle it
        raise ValueError(f"{path} is not a .npz archive (a zip of named arrays, as np.savez writes): it may be cut "
                         f"short or another kind of file. convert reads the .npz that megatrain-jax convert writes "
                         f"(megatrain-jax convert HF_DIR {Path(path).name}); make it again that way")
    again = f"make it again (megatrain-jax convert HF_DIR {Path(path).name})"
    with np.load(path) as z:
        if CONFIG_KEY not in z:
            raise ValueError(f"{path} has no {CONFIG_KEY}: not written by megatrain-jax convert")
        cfg = build_dataclass(DecoderConfig, json.loads(str(z[CONFIG_KEY])), f"{path} {CONFIG_KEY}")
        try:  # each array's bytes are checked against the zip's CRC as they are read
            tree = _unflatten({k: z[k] for k in z.files if k != CONFIG_KEY})
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise ValueError(f"{path} is damaged ({e}): changed after it was written (a bad copy, a failing "
                             f"disk); {again}") from None
    missing = [] if "io" in tree else ["io (embedding, final norm, head)"]
    missing += [f"block {i}" for i in range(cfg.layers) if str(i) not in tree.get("blocks", {})]
    if missing:
        raise ValueError(f"{path} has no parameters of {', '.join(missing)} (its config has {cfg.layers} layers): "
                         f"not a whole model; {again}")
    check_params(cfg, tree["io"], tree["blocks"], path)  # every leaf against the config, and finite
    return cfg, tree["io"], [tree["blocks"][str(i)] for i in range(cfg.layers)]


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None,
            dtype: str = "bfloat16", force: bool = False, tokenizer: str | os.PathLike | None = None) -> Path:
    """Convert ``src`` to ``dst`` (format ``to``, else from ``dst``'s suffix: ``.npz`` or an HF folder).
    ``dtype`` is the tensor dtype of an HF output. An HF folder that holds a model, or an existing .npz file, is
    replaced only with ``force`` (as a whole: ``save_hf``; the .npz by one rename); an Orbax output goes to a new
    folder, written beside it and put in place whole. An output its disk has no room for is refused before anything
    is written. An HF output takes the tokenizer and generation files of ``tokenizer`` (a folder), else of an HF
    ``src``."""
    src_fmt = detect_format(src)
    if to is None and str(dst).rstrip("/" + os.sep) != str(dst) and Path(dst).suffix == ".npz":
        raise ValueError(f"{dst} names a .npz file with a folder's trailing slash: give {str(dst).rstrip('/' + os.sep)} "
                         f"for a .npz file, or add --to hf to write a Hugging Face folder there")
    to = to or ("npz" if str(dst).endswith(".npz") else "hf")
    if to not in FORMATS:
        raise ValueError(f"unknown output format {to!r}; choose from {FORMATS}")
    if tokenizer is not None and to != "hf":
        raise ValueError(f"--tokenizer goes with a Hugging Face output (--to hf), not {to}")
    if to == "hf":  # before reading the source: a refusal costs nothing
        from megatrain_jax.hf.export_folder import check_target, tokenizer_files
        check_target(dst, force, "add --force")
        extra = tokenizer_files(tokenizer, given=True) if tokenizer is not None else (
            tokenizer_files(src) if src_fmt == "hf" else [])
    if to == "npz":
        _check_npz_target(npz_path(dst), force)
    if to == "orbax":
        _check_new_folder(Path(dst))
    if src_fmt == "orbax":
        cfg, io, blocks = _load_checkpoint(Path(src), dst)
    elif src_fmt == "hf":
        from megatrain_jax.hf import load_hf
        cfg, io, blocks = load_hf(src, dtype=dtype)
    else:
        cfg, io, blocks = load_npz(src)
    if to in ("hf", "npz") and not isinstance(cfg, DecoderConfig):
        raise ValueError(f"{src} holds the parameters of a model that is not megatrain_jax's Decoder (its config: "
                         f"{cfg!r:.200}); Hugging Face and npz output need the Decoder's config. Read them in "
                         f"Python with megatrain_jax.checkpoint.load_model(path, model) instead")
    _check_room(npz_path(dst) if to == "npz" else Path(dst), dtype if to == "hf" else "float32", cfg.param_count())
    if to == "hf":  # from an HF folder its tokenizer and generation settings come along
        from megatrain_jax.hf import save_hf
        save_hf(dst, cfg, io, blocks, dtype=dtype, overwrite=force, extra_files=extra)
        return Path(dst)
    if to == "npz":
        return save_npz(dst, cfg, io, blocks)
    from megatrain_jax.checkpoint import save_params
    from megatrain_jax.hf.export_folder import publish, staging
    out = staging(dst)
    try:  # written whole beside dst, then put in place in one step: a failed write leaves nothing to clear away
        save_params(out, cfg, io, blocks)
        publish(out, dst)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return Path(dst)


def _check_npz_target(path: Path, force: bool) -> None:
    """Refuse, before the source is read, a .npz output that is a folder, or an existing file without ``force``."""
    from megatrain_jax.hf.export_folder import ExportExistsError
    if path.is_dir():  # --force would not help: a file never replaces a folder
        raise ExportExistsError(f"{path} is a folder, not a .npz file; nothing was written. Give the path of a file "
                                f"to write, or --to hf to write a Hugging Face folder")
    if path.exists() and not force:
        raise ExportExistsError(f"{path} already exists; nothing was written. To replace it, add --force; "
                                f"or write to another file")


def _check_new_folder(folder: Path) -> None:
    """Refuse, before the source is read, an Orbax output that is a file or a folder with something in it:
    ``save_params`` writes only into a new (or empty) folder, and never replaces one."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder; nothing was written. Give a new folder for the "
                              f"Orbax checkpoint")
    if folder.is_dir() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty; nothing was written. Give a new folder for the Orbax "
                              f"checkpoint (it never replaces one)")


def _load_checkpoint(src: Path, dst: str | os.PathLike) -> tuple[Any, dict, list[dict]]:
    """``load_params(src)``; a folder that holds no checkpoint (a run folder, Hugging Face weights without their
    config.json, saves cut short) or none that is whole is refused saying what it holds and what to give."""
    from megatrain_jax.checkpoint import check_step, committed_steps, load_params
    from megatrain_jax.checkpoint.params import MARKER
    if (src / MARKER).exists() or (src / "state").is_dir():
        return load_params(src)
    steps = committed_steps(src)
    if not steps:
        raise FileNotFoundError(_no_checkpoint(src, dst))
    try:
        return load_params(src)
    except FileNotFoundError:  # every step failed its check
        problems = "; ".join(f"step {n}: {check_step(src / str(n))}" for n in steps)
        raise FileNotFoundError(f"{src} holds no whole checkpoint, and nothing was read from it ({problems}). "
                                f"Give a checkpoint folder with a whole step") from None


def _no_checkpoint(src: Path, dst: str | os.PathLike) -> str:
    """What ``src``, a folder with no checkpoint in it, holds instead, and what to give."""
    from megatrain_jax.checkpoint.manager import unfinished_saves
    from megatrain_jax.cli.run_folder import run_files
    from megatrain_jax.hf.safetensors_io import stale_files
    run_checkpoints = src / "checkpoints"
    if run_checkpoints.is_dir():
        return (f"{src} is a run folder, not a checkpoint: its checkpoints are in {run_checkpoints}: "
                f"megatrain-jax convert {run_checkpoints} {dst}")
    if run_files(src):  # its metrics or config: a run whose train.checkpoint_dir was elsewhere
        return (f"{src} is a run folder, not a checkpoint, and its checkpoints are not in it: give the folder its "
                f"train.checkpoint_dir names (see its config.toml)")
    weights = sorted(p.name for p in stale_files(src))
    if weights:
        return (f"{src} holds Hugging Face weights ({', '.join(weights[:3])}) but no config.json, which says what "
                f"model they are: put the model's config.json beside them (from where the weights came from, e.g. "
                f"the Hugging Face Hub)")
    cut = unfinished_saves(src)
    if cut:
        return (f"{src} holds only saves that never finished ({', '.join(p.name for p in cut[:3])}): the run "
                f"stopped while saving, and there is nothing whole to convert. Give a checkpoint folder with a "
                f"committed step (a folder named by its step number)")
    return (f"{src} holds no checkpoint that convert reads (it holds {sorted(p.name for p in src.iterdir())[:8]}): "
            f"give a Hugging Face folder (config.json + safetensors), a .npz file, or a checkpoint folder of "
            f"megatrain-jax (a training run's, or one convert --to orbax wrote)")


def _check_room(dst: Path, dtype: str, params: int) -> None:
    """Refuse, before anything is written, an output that the free space of ``dst``'s disk cannot hold: ``params``
    parameters in ``dtype`` (a model replaced in ``dst`` is removed only once the new one is whole)."""
    per = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    room = free_space(dst)
    if room is not None and params * per > room[0]:
        raise ValueError(f"{dst} needs about {format_size(params * per)} ({params:,} parameters in {dtype}, {per} "
                         f"bytes each) but its disk has {format_size(room[0])} free; nothing was written. Free space "
                         f"there, or write to another disk")

