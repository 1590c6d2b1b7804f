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
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.cli.toml_dataclass import build_dataclass
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.checkpoint.parts import nest

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
    with np.load(path) as z:
        if CONFIG_KEY not in z:
            raise ValueError(f"{path} has no {CONFIG_KEY}: not written by megatrain-jax convert")
        cfg = build_dataclass(DecoderConfig, json.loads(str(z[CONFIG_KEY])), f"{path} {CONFIG_KEY}")
        tree = _unflatten({k: z[k] for k in z.files if k != CONFIG_KEY})
    blocks = [tree["blocks"][str(i)] for i in range(cfg.layers)]
    return cfg, tree["io"], blocks


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None,
            dtype: str = "bfloat16", force: bool = False, tokenizer: str | os.PathLike | None = None) -> Path:
    """Convert ``src`` to ``dst`` (format ``to``, else from ``dst``'s suffix: ``.npz`` or an HF folder).
    ``dtype`` is the tensor dtype of an HF output. An HF folder that holds a model, or an existing .npz file, is
    replaced only with ``force`` (as a whole: ``save_hf``; the .npz by one rename). An HF output takes the tokenizer
    and generation files of ``tokenizer`` (a folder), else of an HF ``src``."""
    src_fmt = detect_format(src)
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
    if to == "npz" and npz_path(dst).exists() and not force:
        from megatrain_jax.hf.export_folder import ExportExistsError
        raise ExportExistsError(f"{npz_path(dst)} already exists; nothing was written. To replace it, add --force; "
                                f"or write to another file")
    if src_fmt == "orbax":
        from megatrain_jax.checkpoint import load_params
        cfg, io, blocks = load_params(src)
    elif src_fmt == "hf":
        from megatrain_jax.hf import load_hf
        cfg, io, blocks = load_hf(src, dtype=dtype)
    else:
        cfg, io, blocks = load_npz(src)
    if to in ("hf", "npz") and not isinstance(cfg, DecoderConfig):
        raise ValueError(f"{src} holds the parameters of a model that is not megatrain_jax's Decoder (its config: "
                         f"{cfg!r:.200}); Hugging Face and npz output need the Decoder's config. Read them in "
                         f"Python with megatrain_jax.checkpoint.load_model(path, model) instead")
    if to == "hf":  # from an HF folder its tokenizer and generation settings come along
        from megatrain_jax.hf import save_hf
        save_hf(dst, cfg, io, blocks, dtype=dtype, overwrite=force, extra_files=extra)
        return Path(dst)
    if to == "npz":
        return save_npz(dst, cfg, io, blocks)
    from megatrain_jax.checkpoint import save_params
    save_params(dst, cfg, io, blocks)
    return Path(dst)
