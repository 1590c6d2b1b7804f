"""Parameters only, in Orbax: what ``megatrain-jax convert`` writes and reads, for any model that
follows the layered contract (docs/model_contract.md), not only the built-in ``Decoder``.

- ``save_params(dir, cfg, io, blocks)`` writes one Orbax PyTree (``params/``) of float32 numpy trees
  (``{"io": ..., "blocks": {"0": ..., ...}}``) and ``megatrain_params.json`` with the model config (any
  dataclass, or None) and the number of blocks.
- ``load_params(dir)`` reads such a directory, or the parameters of a *training* checkpoint (a
  ``Checkpointer`` root, whose newest complete step is used, or one step directory), part by part.
- ``save_model(dir, model)`` and ``load_model(dir, model)`` do the same from and into a model object,
  checking every shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from megatrain_jax.checkpoint.manager import CorruptCheckpointError, check_step, committed_steps
from megatrain_jax.checkpoint.parts import ShapeMismatchError, named_leaves
from megatrain_jax.checkpoint.session import jsonable
from megatrain_jax.contract.layered import block_params, io_params
from megatrain_jax.engine.parts import IO
from megatrain_jax.engine.transfer import host_view
from megatrain_jax.models.config import DecoderConfig

MARKER = "megatrain_params.json"


def _numpy(tree: Any) -> Any:
    """``tree``'s leaves as float32 numpy arrays: views of host arrays that are float32 already (no copy, and
    none cached on the array, which ``np.asarray`` would keep on a GPU client: a model's worth at the end of
    a run), copies of the others."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    return jax.tree.map(lambda a: host_view(a).astype(np.float32, copy=False), tree)


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


def save_params(path: str | Path, cfg: Any, io: Any, blocks: list[Any]) -> Path:
    """Write parameters (``cfg``: the model's config, a dataclass or None) to a new directory ``path``."""
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; choose a new directory (nothing was written)")
    tree = {"io": _numpy(io), "blocks": {str(i): _numpy(b) for i, b in enumerate(blocks)}}
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(path / "params", tree)
    record = {"format": 1, "model": jsonable(cfg), "model_class": type(cfg).__name__ if cfg is not None else None,
              "blocks": len(blocks)}
    (path / MARKER).write_text(json.dumps(record, indent=1))
    return path


def _training_step_dir(path: Path) -> Path:
    if (path / "state").is_dir():
        problem = check_step(path)
        if problem:
            raise CorruptCheckpointError(f"{path}: {problem}")
        return path
    steps = committed_steps(path)  # newest first
    for step in steps:
        problem = check_step(path / str(step))
        if problem is None and step == steps[0]:
            return path / str(step)
        if problem is None:  # never an older step in silence: the caller asked for the run's newest weights
            raise CorruptCheckpointError(
                f"the newest checkpoint of {path}, step {steps[0]}, fails its check, and nothing was read from it: "
                + "; ".join(f"step {n}: {check_step(path / str(n))}" for n in steps[:steps.index(step)])
                + f". The newest complete one is step {step}: to use it, give its folder ({path / str(step)}); "
                f"to use step {steps[0]}, repair or re-save it")
    raise FileNotFoundError(f"{path} holds no complete megatrain_jax checkpoint (neither {MARKER} nor a "
                            f"training checkpoint with a state/ item)")


def _config(record: Any) -> Any:
    """The stored model config: a ``DecoderConfig`` when it is one, else the JSON dict (or None)."""
    if isinstance(record, dict):
        try:
            return DecoderConfig.from_dict(record)
        except (TypeError, ValueError):
            return record
    return None


def load_params(path: str | Path) -> tuple[Any, dict, list[dict]]:
    """``(cfg, io_params, [block_params])`` as float32 numpy pure dicts; ``cfg`` is a ``DecoderConfig`` for
    the built-in decoder, else the stored config as a dict (None when none was stored)."""
    path = Path(path).absolute()
    if (path / MARKER).exists():
        record = json.loads((path / MARKER).read_text())
        cfg = _config(record.get("model"))
        tree = _restore_numpy(path / "params")
        n = record.get("blocks", len(tree["blocks"]))
        return cfg, tree["io"], [tree["blocks"][str(i)] for i in range(n)]
    step_dir = _training_step_dir(path)
    config = json.loads((step_dir / "config" / "config.json").read_text())
    meta = json.loads((step_dir / "meta" / "meta.json").read_text())
    names = [n for n in meta.get("parts", []) if n != IO.name] or sorted(
        p.name for p in (step_dir / "state").iterdir() if p.is_dir() and p.name.startswith("block_"))
    io = _pure(_restore_numpy(step_dir / "state" / IO.name)["params"])
    blocks = [_pure(_restore_numpy(step_dir / "state" / name)["params"]) for name in names]
    return _config(config.get("model")), io, blocks


def save_model(path: str | Path, model: nnx.Module) -> Path:
    """The parameters of ``model`` (any layered-contract model) as float32, with ``model.cfg`` when it has one."""
    return save_params(path, getattr(model, "cfg", None), io_params(model), block_params(model))


def load_model(path: str | Path, model: nnx.Module) -> nnx.Module:
    """Fill ``model`` (concrete) with the parameters stored at ``path`` (``save_model``/``save_params``
    output or a training checkpoint). Raises ``ShapeMismatchError`` listing every parameter that does not
    fit, before anything is changed."""
    _, io, blocks = load_params(path)
    modules = [model.io, *model.blocks]
    targets = [nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in modules]
    problems = [f"blocks: the model has {len(model.blocks)}, {path} holds {len(blocks)}"] \
        if len(blocks) != len(model.blocks) else []
    for where, target, stored in zip(["io"] + [f"blocks/{i}" for i in range(len(blocks))], targets, [io, *blocks]):
        problems += _mismatches(where, named_leaves(target), named_leaves(stored))
    if problems:
        raise ShapeMismatchError(f"{path} does not fit this model ({len(problems)} difference(s)); nothing was "
                                 f"loaded:\n" + "\n".join(f"  {p}" for p in problems))
    for module, target, stored in zip(modules, targets, [io, *blocks]):
        got = named_leaves(stored)  # same names as the target's, in its flattening order
        leaves = [jnp.asarray(got[name], want.dtype) for name, want in named_leaves(target).items()]
        nnx.update(module, jax.tree.unflatten(jax.tree.structure(target), leaves))
    return model


def _mismatches(where: str, want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    out = [f"{where}/{k}: expected shape {tuple(want[k].shape)}, found {tuple(np.shape(got[k]))}"
           for k in want if k in got and tuple(want[k].shape) != tuple(np.shape(got[k]))]
    out += [f"{where}/{k}: missing from the checkpoint" for k in want if k not in got]
    out += [f"{where}/{k}: in the checkpoint but not in the model" for k in got if k not in want]
    return out
