"""Parameters only, in Orbax: what ``megatrain-jax convert`` writes and reads.

- ``save_params(dir, cfg, io, blocks)`` writes one Orbax PyTree (``params/``) of float32 numpy trees
  (``{"io": ..., "blocks": {"0": ..., ...}}``) and ``megatrain_params.json`` with the model config.
- ``load_params(dir)`` reads such a directory, or the parameters of a *training* checkpoint (a
  ``Checkpointer`` root, whose newest complete step is used, or one step directory), part by part.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from megatrain_jax.checkpoint.manager import CorruptCheckpointError, check_step, committed_steps
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.parts import IO, PartId

MARKER = "megatrain_params.json"


def _numpy(tree: Any) -> Any:
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def _restore_numpy(path: Path) -> Any:
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(path))
    tree = getattr(meta, "tree", meta)
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(m.dtype)), tree)
    return handler.restore(epath.Path(path), args=ocp.args.PyTreeRestore(restore_args=args))


def _pure(tree: Any) -> Any:
    """Drop the ``{"value": array}`` level that NNX Variables leave in a training checkpoint's trees."""
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: _pure(v) for k, v in tree.items()}
    return tree


def save_params(path: str | Path, cfg: DecoderConfig, io: Any, blocks: list[Any]) -> Path:
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; choose a new directory (nothing was written)")
    tree = {"io": _numpy(io), "blocks": {str(i): _numpy(b) for i, b in enumerate(blocks)}}
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(path / "params", tree)
    (path / MARKER).write_text(json.dumps({"format": 1, "model": dataclasses.asdict(cfg)}, indent=1))
    return path


def _training_step_dir(path: Path) -> Path:
    if (path / "state").is_dir():
        problem = check_step(path)
        if problem:
            raise CorruptCheckpointError(f"{path}: {problem}")
        return path
    for step in committed_steps(path):  # newest first
        if check_step(path / str(step)) is None:
            return path / str(step)
    raise FileNotFoundError(f"{path} holds no complete megatrain_jax checkpoint (neither {MARKER} nor a "
                            f"training checkpoint with a state/ item)")


def load_params(path: str | Path) -> tuple[DecoderConfig, dict, list[dict]]:
    """``(cfg, io_params, [block_params])`` as float32 numpy pure dicts."""
    path = Path(path).absolute()
    if (path / MARKER).exists():
        cfg = DecoderConfig.from_dict(json.loads((path / MARKER).read_text())["model"])
        tree = _restore_numpy(path / "params")
        return cfg, tree["io"], [tree["blocks"][str(i)] for i in range(cfg.layers)]
    step_dir = _training_step_dir(path)
    config = json.loads((step_dir / "config" / "config.json").read_text())
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{step_dir} records no model config; it cannot be converted")
    cfg = DecoderConfig.from_dict(config["model"])
    io = _pure(_restore_numpy(step_dir / "state" / IO.name)["params"])
    blocks = [_pure(_restore_numpy(step_dir / "state" / PartId.block(i).name)["params"]) for i in range(cfg.layers)]
    return cfg, io, blocks
