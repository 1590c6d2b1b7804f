"""Hugging Face checkpoints <-> our per-part parameter trees: reading them (``load_hf``, ``HFParts``); writing is
``hf/export.py``'s.

Our parameters are pure nested dicts of float32 numpy arrays, one tree for ``model.io`` and one per
block (the layout of ``nnx.to_pure_dict(nnx.state(part, nnx.Param))``). Each family's file names its tensors
(``Family.blocks``, from ``families/tensors.py``'s pieces); a leaf may be a piece of a fused tensor (Phi-3's
``qkv_proj``) or every other column of one (GPT-OSS's ``gate_up_proj``). HF Llama checkpoints are
already in rotate-half RoPE layout, which our attention uses, so q/k need no permutation. GPT-OSS's released
checkpoints hold the experts as MXFP4, dequantized as they are read (``hf/mxfp4.py``).
Loading goes tensor by tensor from memory-mapped files, so peak extra memory is about one tensor.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.families import FAMILIES, Spec
from megatrain_jax.families.tensors import io_specs
from megatrain_jax.hf.config import UnsupportedConfig, config_from_hf, token_ids
from megatrain_jax.hf.export_folder import GENERATION_CONFIG
from megatrain_jax.hf.json_files import read_json_object
from megatrain_jax.hf.mxfp4 import DequantizedCheckpoint, packed_names
from megatrain_jax.hf.safetensors_io import WEIGHT_DTYPES, Checkpoint
from megatrain_jax.models.config import DecoderConfig

PureTree = dict[str, Any]  # nested dict of arrays, as nnx.to_pure_dict gives


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


def block_specs(cfg: DecoderConfig, i: int) -> list[Spec]:
    """Block ``i``'s tensors, as its family's file names them (``Family.blocks``)."""
    return FAMILIES[cfg.family].blocks(cfg, i)


def _place(tree: PureTree, s: Spec, value: Any, experts: int | None) -> None:
    """Put one HF tensor's value at its place in our tree: the leaf itself, or (an expert's) the
    ``s.expert``-th entry of a list of ``experts`` that becomes the stacked leaf."""
    node = tree
    for key in s.path[:-1]:
        node = node.setdefault(key, {})
    if s.expert is None:
        node[s.path[-1]] = value
    else:
        node.setdefault(s.path[-1], [None] * experts)[s.expert] = value


def check_checkpoint(ckpt: Checkpoint, cfg: DecoderConfig) -> None:
    """Raise CheckpointMismatch listing every missing, unexpected, wrongly shaped or non-floating (an integer dtype)
    tensor, from the headers alone (before any tensor data is read)."""
    expected = {s.hf_name: s.hf_shape for s in io_specs(cfg)}
    for i in range(cfg.layers):
        expected.update((s.hf_name, s.hf_shape) for s in block_specs(cfg, i))
    found = ckpt.shapes()
    allowed_extra = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied saves keep a copy
    mtp = sorted(n for n in found if n not in expected and _mtp_layer(cfg, n))
    if mtp:
        allowed_extra |= set(mtp)
        warnings.warn(f"{ckpt.dir}: ignoring the {len(mtp)} tensors of the multi-token-prediction layer(s) past the "
                      f"last of {cfg.layers} (num_nextn_predict_layers; transformers' {cfg.family} causal LM ignores "
                      f"them too): they are not trained, and an export does not write them", stacklevel=2)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - allowed_extra
                        - {n for n in found if n.endswith("rotary_emb.inv_freq")})
    wrong = sorted(n for n in set(expected) & set(found) if tuple(found[n]) != tuple(expected[n]))
    dtypes = ckpt.dtypes()
    not_float = sorted(n for n in set(expected) & set(found) if dtypes[n] not in WEIGHT_DTYPES)
    if cfg.tie_embeddings and "lm_head.weight" in found and tuple(found["lm_head.weight"]) != (
            cfg.vocab_size, cfg.hidden):
        wrong.append("lm_head.weight")
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden)
    if not (missing or unexpected or wrong or not_float):
        return
    lines = [f"checkpoint {ckpt.dir} does not match its config ({cfg.family}, {cfg.layers} layers, hidden "
             f"{cfg.hidden}, vocab {cfg.vocab_size}, tied={cfg.tie_embeddings}):"]
    lines += _listed("missing", missing, lambda n: f"{n} (expected shape {list(expected[n])})")
    lines += _listed("unexpected", unexpected, lambda n: f"{n} (shape {list(found[n])})")
    lines += _listed("shape mismatch", wrong, lambda n: f"{n}: expected {list(expected[n])}, found {list(found[n])}")
    lines += _listed("dtype", not_float, lambda n: f"{n} in {ckpt.file_of(n)} is {dtypes[n]}; a weight is floating "
                     f"point ({', '.join(WEIGHT_DTYPES)}): convert the checkpoint's weights, or take them again")
    raise CheckpointMismatch("\n".join(lines))


MOST_LISTED = 12  # tensors named per kind of mismatch; the rest are counted by where they sit


def _listed(kind: str, names: list[str], say: Callable[[str], str]) -> list[str]:
    """A mismatch's lines: the first ``MOST_LISTED`` tensors of ``names``, then how many more under each prefix (a
    multimodal checkpoint's vision tower is hundreds of tensors under one)."""
    lines = [f"  {kind}: {say(n)}" for n in names[:MOST_LISTED]]
    rest = names[MOST_LISTED:]
    if rest:
        under = collections.Counter(".".join(n.split(".")[:2]) for n in rest)
        lines.append(f"  {kind}: {len(rest)} more (" + ", ".join(f"{k}.*: {v}" for k, v in under.most_common(6))
                     + (", ..." if len(under) > 6 else "") + ")")
    return lines


def _mtp_layer(cfg: DecoderConfig, name: str) -> bool:
    """Whether ``name`` is a tensor of a GLM-4.5 / DeepSeek-V3 multi-token-prediction layer: ``model.layers.{j}.*``
    with j at or past ``cfg.layers`` (transformers' ``_keys_to_ignore_on_load_unexpected`` for Glm4MoeForCausalLM
    and DeepseekV3ForCausalLM)."""
    parts = name.split(".")
    return (FAMILIES[cfg.family].mtp_layers and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= cfg.layers)


def _read_part(ckpt: Checkpoint, specs: Sequence[Spec]) -> PureTree:
    tree: PureTree = {}
    experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
    for s in specs:
        src = s.of(ckpt.get(s.hf_name))  # a memory-mapped view: only this tensor (or piece) is materialized, once
        _place(tree, s, np.array(src.T if s.transpose else src, dtype=np.float32, order="C"), experts)
    return _stacked(tree)


def _stacked(tree: Any, stack=np.stack) -> Any:
    """The lists ``_place`` made (one entry per expert) as stacked arrays."""
    if isinstance(tree, dict):
        return {k: _stacked(v, stack) for k, v in tree.items()}
    return stack(tree) if isinstance(tree, list) else tree


def read_config(model_dir: str | os.PathLike, **overrides) -> DecoderConfig:
    """The DecoderConfig of an HF folder's ``config.json``; special token ids it lacks are taken from its
    ``generation_config.json``, where there is one."""
    folder = Path(model_dir)
    path = folder / "config.json"
    if folder.is_file():
        raise FileNotFoundError(f"{model_dir} is a file: give the folder that holds the model's config.json and "
                                f"weights ({folder.parent}, if it is that folder's)")
    if not path.exists() and (folder / "snapshots").is_dir():  # the Hugging Face hub cache's folder of a repository
        revisions = sorted(p.name for p in (folder / "snapshots").iterdir())
        raise FileNotFoundError(f"{model_dir} is a Hugging Face cache folder, not a model folder: give one of its "
                                f"revisions, {folder / 'snapshots'}/<revision> (here: {revisions[:4]})")
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config_json = read_json_object(path)
    generation = Path(model_dir) / GENERATION_CONFIG
    if generation.exists():
        try:
            ids = token_ids(read_json_object(generation))
        except UnsupportedConfig as e:
            raise UnsupportedConfig(_in_file(generation, e)) from None
        overrides = {**{k: v for k, v in ids.items() if k not in config_json}, **overrides}
    try:
        return config_from_hf(config_json, **overrides)
    except UnsupportedConfig as e:
        raise UnsupportedConfig(_in_file(path, e)) from None


def _in_file(path: Path, e: Exception) -> str:
    """``e``'s message, beginning with the file it is about (once)."""
    return str(e) if str(e).startswith(str(path)) else f"{path}: {e}"


def open_checkpoint(model_dir: str | os.PathLike, cfg: DecoderConfig) -> Checkpoint | DequantizedCheckpoint:
    """Open and check the checkpoint's headers against ``cfg``; no tensor data is read yet, but a few rows of a tied
    model's spare ``lm_head.weight`` and of its embedding (``_warn_if_head_differs``). A GPT-OSS checkpoint
    with MXFP4 experts (the released ones) reads them dequantized, each as it is read (``hf/mxfp4.py``)."""
    ckpt = Checkpoint(model_dir)
    if FAMILIES[cfg.family].mxfp4_experts and packed_names(ckpt):
        ckpt = DequantizedCheckpoint(ckpt)
        warnings.warn(f"{model_dir}: the experts are MXFP4 ({len(ckpt.packed)} *_blocks / *_scales pairs): each is "
                      f"dequantized to bfloat16 as transformers does when its layer is read (exact; float32 masters "
                      f"from there)", stacklevel=2)
    check_checkpoint(ckpt, cfg)
    if cfg.tie_embeddings and "lm_head.weight" in ckpt:
        _warn_if_head_differs(ckpt, cfg, model_dir)
    return ckpt


HEAD_ROWS_COMPARED = 64  # rows spread over the vocabulary: a head trained apart differs in every row


def _warn_if_head_differs(ckpt: Checkpoint | DequantizedCheckpoint, cfg: DecoderConfig,
                          model_dir: str | os.PathLike) -> None:
    """A tied model whose checkpoint also holds an ``lm_head.weight``: transformers ties the head to the embedding
    and drops that tensor, and so do we; a copy of the embedding (some tied saves keep one) is dropped silently, a
    head of its own is said. A few rows spread over the vocabulary are compared, not the whole head (gigabytes,
    read for nothing else)."""
    embed = next(s.hf_name for s in io_specs(cfg) if s.path == ("embedding",))
    head_VD, embed_VD = ckpt.get("lm_head.weight"), ckpt.get(embed)
    rows = np.unique(np.linspace(0, len(embed_VD) - 1, HEAD_ROWS_COMPARED).astype(np.int64))
    if np.array_equal(np.asarray(head_VD[rows], np.float32), np.asarray(embed_VD[rows], np.float32), equal_nan=True):
        return
    warnings.warn(f"{model_dir}: config.json sets tie_word_embeddings = true, but the checkpoint also holds "
                  f"lm_head.weight (in {ckpt.file_of('lm_head.weight')}), which differs from {embed}: the model is "
                  f"loaded tied, as transformers loads it (its output head is {embed}; lm_head.weight is ignored, "
                  f"neither trained nor exported). If the checkpoint's own head was meant, set "
                  f"\"tie_word_embeddings\": false in {Path(model_dir) / 'config.json'}", stacklevel=3)


def read_io(ckpt: Checkpoint, cfg: DecoderConfig) -> PureTree:
    return _read_part(ckpt, io_specs(cfg))


def iter_blocks(ckpt: Checkpoint, cfg: DecoderConfig) -> Iterator[PureTree]:
    """Block parameter trees one layer at a time (for streaming straight into host or device memory)."""
    for i in range(cfg.layers):
        yield _read_part(ckpt, block_specs(cfg, i))


class HFParts:
    """An HF checkpoint as a source of the engine's initial parameters, one part at a time
    (``Engine(..., init_from=HFParts(dir, cfg))``): the weights go from the safetensors files straight into
    the host state, and no model object holds a second copy.

    ``io()`` and ``block(i)`` give one part's tensors as stored: memory-mapped views of the files, in the
    checkpoint's dtype and HF layout, arranged in the tree of the part's ``nnx.to_pure_dict``. The engine's
    state builder sends them to the device as they are and calls ``to_params`` inside its program, which
    transposes the projections and casts to float32 there. So the host neither transposes nor widens a
    bf16 checkpoint (a strided copy that took most of a 7B load), and half the bytes cross PCIe."""

    def __init__(self, model_dir: str | os.PathLike, cfg: DecoderConfig):
        ckpt_cfg = read_config(model_dir)
        check_same_model(cfg, ckpt_cfg, f"{model_dir}/config.json")
        self.model_dir, self.cfg = Path(model_dir), ckpt_cfg
        self._ckpt = open_checkpoint(model_dir, ckpt_cfg)
        # blocks of one kind of MLP (dense, or leading dense layers then MoE) have the same key paths, and
        # none of them is an io part's
        firsts = {0, min(ckpt_cfg.first_k_dense_replace, ckpt_cfg.layers - 1)}
        self._transposed = {s.path for s in io_specs(ckpt_cfg) + [s for i in firsts for s in block_specs(ckpt_cfg, i)]
                            if s.transpose}

    READ_AHEAD = 8  # blocks whose bytes the disk reads ahead of the one asked for

    def io(self) -> PureTree:
        self._read_ahead(io_specs(self.cfg), *(block_specs(self.cfg, i) for i in range(min(self.READ_AHEAD, self.cfg.layers))))
        return _stored_part(self._ckpt, io_specs(self.cfg))

    def block(self, i: int) -> PureTree:
        if i + self.READ_AHEAD < self.cfg.layers:  # io() asked for the first ones
            self._read_ahead(block_specs(self.cfg, i + self.READ_AHEAD))
        return _stored_part(self._ckpt, block_specs(self.cfg, i))

    def _read_ahead(self, *parts: Sequence[Spec]) -> None:
        """The state builder takes parts in order, a few at once: keep the disk reading the next ones in
        the meantime (the page faults of memory-mapped reads alone fetch a little at a time)."""
        self._ckpt.will_need([s.hf_name for specs in parts for s in specs])

    def release(self) -> None:
        """Every part has been read (the engine's state builder calls this once it is done): the files are
        unmapped, so that a run's resident set does not carry the checkpoint's pages while it trains."""
        self._ckpt.release()

    def to_params(self, tree: PureTree) -> PureTree:
        """A part's tensors as ``io()``/``block(i)`` give them -> its float32 parameters in our layout.
        Traceable (jnp), so it runs inside the state builder's program."""
        import jax.numpy as jnp

        def arrange(node: Any, path: tuple[str, ...]) -> Any:
            if isinstance(node, dict):
                return {k: arrange(v, path + (k,)) for k, v in node.items()}
            one = lambda x: jnp.asarray(x, jnp.float32).T if path in self._transposed else jnp.asarray(x, jnp.float32)  # noqa: E731
            return jnp.stack([one(x) for x in node]) if isinstance(node, list) else one(node)

        return arrange(tree, ())


def _stored_part(ckpt: Checkpoint, specs: Sequence[Spec]) -> PureTree:
    """The part's tensors as the files hold them (memory-mapped, not copied), in our tree; a leaf stacked
    over experts is a list of its experts' tensors (``to_params`` stacks them)."""
    tree: PureTree = {}
    experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
    for s in specs:
        _place(tree, s, s.of(ckpt.get(s.hf_name)), experts)
    return tree


def load_hf(model_dir: str | os.PathLike, dtype: str = "bfloat16",
            **overrides) -> tuple[DecoderConfig, PureTree, list[PureTree]]:
    """``(cfg, io_params, [block_params])`` from an HF folder (config.json + safetensors). Parameters
    are float32 numpy; ``dtype`` is the compute dtype put in ``cfg``; ``overrides`` set other fields."""
    cfg = read_config(model_dir, dtype=dtype, **overrides)
    ckpt = open_checkpoint(model_dir, cfg)
    return cfg, read_io(ckpt, cfg), list(iter_blocks(ckpt, cfg))


# what decides the parameter shapes and the function computed (not the export family or compute dtype)
_MATCHING_FIELDS = ("vocab_size", "hidden", "ffn", "layers", "heads", "kv_heads", "dim_per_head",
                    "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm",
                    "qk_norm_width", "norm_placement", "sliding_window", "layer_types", "moe", "first_k_dense_replace",
                    "norm_unit_offset", "scale_embeddings", "mlp_activation", "attention_scale",
                    "sliding_rope_theta", "final_logit_softcap", "mla", "o_bias", "attention_sinks",
                    "partial_rotary_factor")


def check_same_model(ours: DecoderConfig, theirs: DecoderConfig, where: str) -> None:
    def value(cfg: DecoderConfig, f: str) -> Any:
        if f == "moe" and cfg.moe is not None:  # training choices (loss weight, token dropping), not the model
            return dataclasses.replace(cfg.moe, aux_loss_coef=0.0, capacity_factor=None)
        return cfg.effective(f)

    diffs = [f"{f}: model has {getattr(ours, f)!r}, {where} has {getattr(theirs, f)!r}"
             for f in _MATCHING_FIELDS if value(ours, f) != value(theirs, f)]
    if diffs:
        raise CheckpointMismatch(f"model config differs from {where}:\n  " + "\n  ".join(diffs))


def load_hf_into(model: Any, model_dir: str | os.PathLike) -> None:
    """Fill a Decoder (concrete or from ``nnx.eval_shape``) with an HF checkpoint, part by part.

    A concrete model's arrays keep their placement (sharding / memory kind); an abstract model's
    parameters become host numpy arrays, so nothing is put on a GPU here."""
    import jax
    from flax import nnx

    ckpt_cfg = read_config(model_dir)
    check_same_model(model.cfg, ckpt_cfg, f"{model_dir}/config.json")
    ckpt = open_checkpoint(model_dir, ckpt_cfg)

    def fill(part: Any, tree: PureTree) -> None:
        state = nnx.state(part, nnx.Param)
        old = nnx.to_pure_dict(state)
        if jax.tree.structure(old) != jax.tree.structure(tree):
            raise CheckpointMismatch(f"parameter tree {jax.tree.structure(tree)} from {model_dir} does not "
                                     f"fit the model's {jax.tree.structure(old)}")
        placed = jax.tree.map(lambda o, n: n if isinstance(o, jax.ShapeDtypeStruct)
                              else jax.device_put(n.astype(o.dtype), o.sharding), old, tree)
        nnx.replace_by_pure_dict(state, placed)
        nnx.update(part, state)

    fill(model.io, read_io(ckpt, ckpt_cfg))
    for block, tree in zip(model.blocks, iter_blocks(ckpt, ckpt_cfg)):
        fill(block, tree)
