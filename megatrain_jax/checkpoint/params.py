"""Parameters only, in Orbax: what ``megatrain-jax convert`` writes and reads, for any model that
follows the layered contract (docs/model_contract.md), not only the built-in ``Decoder``.

- ``save_params(dir, cfg, io, blocks)`` writes one Orbax PyTree (``params/``) of float32 numpy trees
  (``{"io": ..., "blocks": {"0": ..., ...}}``) and ``megatrain_params.json`` with the model config (any
  dataclass, or None) and the number of blocks.
- ``load_params(dir)`` reads such a directory, or the parameters of a *training* checkpoint (a
  ``Checkpointer`` root, whose newest complete step is used, or one step directory), part by part.
- ``save_model(dir, model)`` and ``load_model(dir, model)`` do the same from and into a model object,
  checking every shape.
- ``check_params(cfg, io, blocks, where)``: what ``load_params`` (and ``convert``'s .npz reader) refuses before
  anything is written from the parameters: a leaf missing, extra, of another shape or not floating point
  against what a ``DecoderConfig`` describes, and a NaN or an infinity.
"""

from __future__ import annotations

import json
import os
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
from megatrain_jax.checkpoint.store import non_finite
from megatrain_jax.contract.layered import block_params, io_params
from megatrain_jax.engine.parts import IO
from megatrain_jax.engine.transfer import host_view
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.models.decoder import Decoder

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
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a folder; choose a new directory (nothing was written)")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; choose a new directory (nothing was written)")
    tree = {"io": _numpy(io), "blocks": {str(i): _numpy(b) for i, b in enumerate(blocks)}}
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(path / "params", tree)
    record = {"format": 1, "model": jsonable(cfg), "model_class": type(cfg).__name__ if cfg is not None else None,
              "blocks": len(blocks)}
    _write_marker(path, json.dumps(record, indent=1))
    return path


def _write_marker(path: Path, text: str) -> None:
    """The marker, last: written whole under a temporary name, flushed to the disk and renamed, so that a kill or a
    full disk never leaves a marker cut short (a folder without one holds no parameters, and says so)."""
    tmp = path / f".{MARKER}.tmp"
    try:
        tmp.write_text(text)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path / MARKER)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    the built-in decoder, else the stored config as a dict (None when none was stored). Parameters that do not
    fit their config, or hold a NaN or an infinity, are refused (``check_params``)."""
    path = Path(path).absolute()
    if (path / MARKER).exists():
        cfg, io, blocks = _load_saved_params(path)
    else:
        step_dir = _training_step_dir(path)
        config = json.loads((step_dir / "config" / "config.json").read_text())
        meta = json.loads((step_dir / "meta" / "meta.json").read_text())
        names = [n for n in meta.get("parts", []) if n != IO.name] or sorted(
            p.name for p in (step_dir / "state").iterdir() if p.is_dir() and p.name.startswith("block_"))
        io = _pure(_restore_numpy(step_dir / "state" / IO.name)["params"])
        blocks = [_pure(_restore_numpy(step_dir / "state" / name)["params"]) for name in names]
        cfg, path = _config(config.get("model")), step_dir
    check_params(cfg, io, blocks, path)
    return cfg, io, blocks


def _load_saved_params(path: Path) -> tuple[Any, dict, list[dict]]:
    """``save_params``'s folder, its marker and its blocks checked against each other."""
    again = ("write it again from the model or checkpoint it came from (save_model, or megatrain-jax convert SRC DIR "
             "--to orbax)")
    try:
        record = json.loads((path / MARKER).read_text())
        if not isinstance(record, dict):
            raise TypeError(f"a JSON {type(record).__name__}, not an object")
        if type(record.get("blocks", 0)) is not int:
            raise TypeError(f"its block count is {record['blocks']!r}, not a number")
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path / MARKER} cannot be read as what save_params writes ({type(e).__name__}: {e}): cut "
                         f"short or changed after it was written; nothing was read. To use these parameters, "
                         f"{again}") from None
    tree = _restore_numpy(path / "params")
    held = sorted(tree.get("blocks", {}), key=lambda k: (len(k), k))
    n = record.get("blocks", len(held))
    if "io" not in tree or held != [str(i) for i in range(n)]:
        raise ValueError(f"{path} holds the parameters of {'io and ' if 'io' in tree else ''}blocks {held}, and "
                         f"{MARKER} says {n} blocks (0 to {n - 1}) and the io part: not a whole model. To use "
                         f"these parameters, {again}")
    return _config(record.get("model")), tree["io"], [tree["blocks"][str(i)] for i in range(n)]


def _leaves(tree: Any, prefix: str) -> dict[str, Any]:
    """``{"blocks/1/attn/q/kernel": leaf}``: a pure dict's leaves named as convert's .npz names them."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    out = {}
    for key, value in (tree.items() if isinstance(tree, dict) else ()):
        out.update(_leaves(value, f"{prefix}/{key}") if isinstance(value, dict) else {f"{prefix}/{key}": value})
    return out


def expected_params(cfg: DecoderConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter ``cfg``'s ``Decoder`` has, by its name in a .npz (``io/embedding``, ``blocks/0/...``), with
    its shape (from the abstract model: no array is made)."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    out = _leaves(nnx.to_pure_dict(io_params(model)), "io")
    for i, block in enumerate(block_params(model)):
        out.update(_leaves(nnx.to_pure_dict(block), f"blocks/{i}"))
    return out


def check_params(cfg: Any, io: Any, blocks: list[Any] | dict[str, Any], where: str | Path) -> None:
    """Refuse parameters read from ``where`` before anything is made of them: with a ``DecoderConfig``, every leaf
    missing, extra, of another shape or not floating point (``ShapeMismatchError``, naming each); with any config,
    a NaN or an infinity (``ValueError`` naming the leaves: a diverged run's weights, which no export may write).
    ``blocks``: a list, or every block a file holds by its key (``{"0": ..., "7": ...}``: a block past the
    config's last is named too)."""
    got = _leaves(io, "io")
    for i, block in (blocks.items() if isinstance(blocks, dict) else enumerate(blocks)):
        got.update(_leaves(block, f"blocks/{i}"))
    if isinstance(cfg, DecoderConfig):
        problems = _differences(expected_params(cfg), got)
        if problems:
            raise ShapeMismatchError(
                f"{where} does not hold the parameters its config describes ({cfg.family}, {cfg.layers} layers, "
                f"hidden {cfg.hidden}, vocab {cfg.vocab_size}): {len(problems)} difference(s), and nothing was "
                f"written from it:\n" + "\n".join(f"  {p}" for p in problems[:MOST_LISTED])
                + (f"\n  ... and {len(problems) - MOST_LISTED} more" if len(problems) > MOST_LISTED else "")
                + "\nIt was changed after it was written, or written for another config: write it again from the "
                  "model or checkpoint it came from")
    bad = non_finite({name: host_view(leaf) for name, leaf in got.items()})
    if bad:
        raise ValueError(f"{where} holds NaN or infinite weights in {len(bad)} parameter(s) ({', '.join(bad[:5])}"
                         f"{', ...' if len(bad) > 5 else ''}): the weights of a run that diverged, and nothing was "
                         f"written from them. Use an earlier checkpoint of the run (its step folder, "
                         f"RUN/checkpoints/<step>)")


MOST_LISTED = 20  # differences named in a refusal; the rest are counted


def _floating(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Each leaf of ``got`` that is not what ``want`` describes, as ``name: what is wrong``."""
    out = [f"{k}: missing (expected shape {tuple(want[k].shape)})" for k in want if k not in got]
    out += [f"{k}: not a parameter of this model (shape {tuple(np.shape(got[k]))})" for k in got if k not in want]
    for k in want.keys() & got.keys():
        if tuple(np.shape(got[k])) != tuple(want[k].shape):
            out.append(f"{k}: expected shape {tuple(want[k].shape)}, found {tuple(np.shape(got[k]))}")
        elif not _floating(got[k]):
            out.append(f"{k}: {getattr(got[k], 'dtype', type(got[k]).__name__)}, not floating point "
                       f"(a weight is float32, bfloat16 or float16)")
    return sorted(out, key=_in_model_order)


def _in_model_order(line: str) -> tuple:
    """io first, then blocks by number (``blocks/10`` after ``blocks/9``)."""
    name = line.split(":", 1)[0].split("/")
    return (name[0] != "io", int(name[1]) if len(name) > 1 and name[1].isdigit() else -1, line)


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
