"""Our per-part parameter trees -> a Hugging Face folder (``save_hf``): config.json, generation_config.json and
safetensors shards that transformers loads, written beside the folder and put in place in one step."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.checkpoint.failures import format_size, free_space
from megatrain_jax.engine.transfer import host_view
from megatrain_jax.families import FAMILIES
from megatrain_jax.families.tensors import io_specs
from megatrain_jax.hf.config import config_to_hf, generation_config
from megatrain_jax.hf.export_folder import GENERATION_CONFIG, check_target, publish, staging
from megatrain_jax.hf.mapping import CheckpointMismatch, PureTree, block_specs
from megatrain_jax.hf.safetensors_io import INDEX_FILE, plan_shards, shard_names, write_entries
from megatrain_jax.models.config import DecoderConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size


def _pure(tree: Any) -> PureTree:
    if isinstance(tree, Mapping) and not hasattr(tree, "flat_state"):
        return dict(tree)
    from flax import nnx
    return nnx.to_pure_dict(tree)


def _lookup(tree: PureTree, path: tuple[str, ...], part: str) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise CheckpointMismatch(f"{part} parameters lack {'.'.join(path)}")
        node = node[key]
    return node


def save_hf(model_dir: str | os.PathLike, cfg: DecoderConfig, io_params: Any, block_params: Sequence[Any],
            dtype: str = "bfloat16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *, overwrite: bool = False,
            extra_files: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Write ``config.json`` + safetensors (sharded with an index past ``max_shard_bytes``) that
    transformers' ``AutoModelForCausalLM.from_pretrained`` loads, and, where ``cfg`` has special token ids
    and ``extra_files`` bring no ``generation_config.json``, one made of them. Parameters may be pure dicts or
    ``nnx.State``, numpy or JAX arrays (any memory kind); each tensor is converted only as it is
    written. ``extra_files`` (a tokenizer's, say) are copied in with them.

    The export is written whole beside ``model_dir`` and then put in place in one step
    (``export_folder.publish``): a kill at any moment leaves the folder's old model or the new one, whole.
    A folder that already holds a model is refused (``ExportExistsError``) unless ``overwrite``; then its
    model files are replaced as a set and its other files kept. Returns the files."""
    check_target(model_dir, overwrite, "pass overwrite=True")
    dtype = export_dtype(dtype)
    if len(block_params) != cfg.layers:
        raise CheckpointMismatch(f"{len(block_params)} block parameter trees for a {cfg.layers}-layer config")
    hf_config = config_to_hf(cfg, dtype)
    if FAMILIES[cfg.family].mxfp4_experts:
        warnings.warn(f"gpt_oss export to {model_dir}: the experts are written unquantized in {dtype}, not in the "
                      f"released checkpoints' MXFP4 format (MXFP4 -> {dtype} for a model read from one; no "
                      f"quantization_config): transformers loads them as they are", stacklevel=2)
    parts = [("io", _pure(io_params), io_specs(cfg))]
    parts += [(f"block {i}", _pure(p), block_specs(cfg, i)) for i, p in enumerate(block_params)]
    pieces, wrong = {}, []  # HF name -> (shape, producers of its pieces in row order)
    for part, tree, specs in parts:
        for s in specs:
            value = _lookup(tree, s.path, part)
            shape = tuple(np.shape(value))
            want = s.our_shape if s.expert is None else (cfg.moe.experts, *s.our_shape)  # stacked over experts
            if shape != want:
                if s.expert is None or s.expert == 0:  # a stacked leaf is reported once
                    wrong.append(f"  {part} {'.'.join(s.path)} ({s.hf_name}): expected {list(want)}, found {list(shape)}")
                continue
            pieces.setdefault(s.hf_name, (s.hf_shape, [], s.interleave is not None))[1].append(
                _producer(value, s.transpose, s.expert))
    entries = {name: (name, shape, one[0] if len(one) == 1 else _fused(one, interleaved))
               for name, (shape, one, interleaved) in pieces.items()}
    if wrong:
        raise CheckpointMismatch("parameters do not match the config:\n" + "\n".join(wrong))

    itemsize = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    sizes = {n: math.prod(e[1]) * itemsize for n, e in entries.items()}
    check_room(model_dir, sum(sizes.values()), dtype)
    out = staging(model_dir)
    try:
        shards = plan_shards(sizes.items(), max_shard_bytes)
        files = [out / name for name in shard_names(len(shards))]
        np_dtype = _np_dtype(dtype)
        total = sum(write_entries(f, [entries[n] for n in names], np_dtype) for f, names in zip(files, shards))
        if len(files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f.name for f, names in zip(files, shards) for n in names}}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            files.append(out / INDEX_FILE)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        names = [f.name for f in files] + ["config.json"]
        generation = generation_config(cfg)
        if generation is not None and not any(Path(e).name == GENERATION_CONFIG for e in extra_files):
            (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
            names.append(GENERATION_CONFIG)
        for extra in extra_files:
            shutil.copy2(extra, out / Path(extra).name)
        names += [Path(e).name for e in extra_files]
        _sync(out)
    except BaseException:  # a failed export leaves nothing beside the folder (a killed one: the .partial folder)
        shutil.rmtree(out, ignore_errors=True)
        raise
    publish(out, model_dir)  # from here the staging folder may hold the replaced folder's files: publish's to clear
    return [Path(model_dir) / name for name in names]


def _sync(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself to the disk before it is put in place: a power cut or a
    crash of the machine after the rename must not leave a folder that looks whole with shards the disk never got."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def export_dtype(dtype: Any) -> str:
    """``'bfloat16'`` or ``'float32'``, the dtype an export writes, from its name or a numpy / JAX dtype
    (``np.float32``, ``jnp.bfloat16``); any other is refused before anything is written."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r} not supported for export; use 'bfloat16' or 'float32'")
    return name


def check_room(model_dir: str | os.PathLike, data_bytes: int, dtype: str) -> None:
    """Refuse, before anything is written, an export of ``data_bytes`` of tensors that the free space of
    ``model_dir``'s disk cannot hold (a model it replaces is removed only once the new one is whole)."""
    room = free_space(Path(model_dir))
    need = data_bytes + 1024**2  # the headers, config.json and the tokenizer's files: a MiB to spare
    if room is not None and need > room[0]:
        raise OSError(errno.ENOSPC, f"{model_dir} needs about {format_size(need)} (its tensors in {dtype}) but its "
                      f"disk has {format_size(room[0])} free; nothing was written. Free space there, or export to "
                      f"another disk")


def peak_bytes(cfg: DecoderConfig, dtype: str = "bfloat16") -> int:
    """The most host memory ``save_hf`` holds beyond the parameters it is given, at any moment: one HF tensor's
    cast copy in ``dtype`` (``write_entries``), and where pieces of ours are fused into one HF tensor (Phi-3's
    qkv_proj, GPT-OSS's gate_up_proj), their float32 concatenation as well. The memory plan counts it at the end
    of a run that exports (``plan(..., export=True)``)."""
    out = 4 if dtype == "float32" else 2
    pieces: dict[str, list] = {}
    for specs in [io_specs(cfg)] + [block_specs(cfg, i) for i in range(cfg.layers)]:
        for s in specs:
            pieces.setdefault(s.hf_name, []).append(s.hf_shape)
    return max((math.prod(shapes[0]) * (out + (4 if len(shapes) > 1 else 0)) for shapes in pieces.values()),
               default=0)


def _producer(value: Any, transpose: bool, expert: int | None = None):
    """Deferred host read of one parameter, or of one expert's slice of it, as a view where it can be: a
    host-memory JAX array is read through its buffer (``transfer.host_view``), never with ``np.asarray``,
    which on a GPU client keeps a host copy inside the array for as long as the array lives (the engine's
    pinned masters: the whole model a second time by the end of an export); a device array is copied to the
    host only when written. The cast to the file's dtype is ``write_entries``'s, one tensor at a time."""
    def produce() -> np.ndarray:
        x = host_view(value)
        x = x if expert is None else x[expert]
        return x.T if transpose else x
    return produce


def _fused(producers, interleaved: bool = False):
    """Deferred fusion of the pieces of one HF tensor: rows in order (Phi-3's qkv_proj, gate_up_proj), or
    interleaved in the last axis (GPT-OSS's gate_up_proj: gate, up, gate, up, ...)."""
    if interleaved:
        def fuse() -> np.ndarray:
            parts = np.stack([produce() for produce in producers], axis=-1)
            return parts.reshape(*parts.shape[:-2], -1)
        return fuse
    return lambda: np.concatenate([produce() for produce in producers], axis=0)


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float32)


