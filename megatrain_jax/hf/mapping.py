"""Hugging Face tensor names <-> our per-part parameter trees; ``load_hf`` / ``save_hf``.

Our parameters are pure nested dicts of float32 numpy arrays, one tree for ``model.io`` and one per
block (the layout of ``nnx.to_pure_dict(nnx.state(part, nnx.Param))``). HF ``nn.Linear`` weights are
[out, in] and our kernels [in, out], so every projection is transposed. HF Llama checkpoints are
already in rotate-half RoPE layout, which our attention uses, so q/k need no permutation. Phi-3 fuses
q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``: each of our leaves reads its rows of
the fused tensor, and an export writes the pieces back as one tensor. GPT-OSS stores its experts stacked
and [in, out] (no transpose), gate and up interleaved in the last axis of one ``gate_up_proj`` (gate the even
columns, up the odd ones); its released checkpoints hold them as MXFP4, dequantized as they are read
(``hf/mxfp4.py``).
Loading goes tensor by tensor from memory-mapped files, so peak extra memory is about one tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.hf.config import UnsupportedConfig, config_from_hf, config_to_hf, generation_config, token_ids
from megatrain_jax.hf.export_folder import GENERATION_CONFIG, check_target, publish, staging
from megatrain_jax.hf.mxfp4 import DequantizedCheckpoint, packed_names
from megatrain_jax.hf.safetensors_io import (INDEX_FILE, Checkpoint, plan_shards, shard_names,
                                             write_entries)
from megatrain_jax.models.config import DecoderConfig

PureTree = dict[str, Any]  # nested dict of arrays, as nnx.to_pure_dict gives
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One HF tensor: where it goes in our tree, and its shape on each side."""

    hf_name: str
    path: tuple[str, ...]  # key path in our part's pure dict
    hf_shape: tuple[int, ...]
    transpose: bool
    expert: int | None = None  # one expert's slice [expert] of a leaf stacked over experts
    rows: tuple[int, int] | None = None  # our leaf is rows [start, stop) of a fused HF tensor (Phi-3's)
    # our leaf is every ``step``-th entry of the HF tensor's last axis from ``start`` (GPT-OSS's gate_up_proj)
    interleave: tuple[int, int] | None = None

    @property
    def our_shape(self) -> tuple[int, ...]:
        shape = self.hf_shape if self.rows is None else (self.rows[1] - self.rows[0], *self.hf_shape[1:])
        if self.interleave is not None:
            shape = (*shape[:-1], shape[-1] // self.interleave[1])
        return tuple(reversed(shape)) if self.transpose else shape

    def of(self, tensor: Any) -> Any:
        """Our leaf's part of the HF tensor as stored (a view of it), not yet transposed."""
        if self.interleave is not None:
            return tensor[..., self.interleave[0]::self.interleave[1]]
        return tensor if self.rows is None else tensor[self.rows[0]:self.rows[1]]


def io_specs(cfg: DecoderConfig) -> list[Spec]:
    V, D = cfg.vocab_size, cfg.hidden
    specs = [Spec("model.embed_tokens.weight", ("embedding",), (V, D), False),
             Spec("model.norm.weight", ("final_norm", "scale"), (D,), False)]
    if not cfg.tie_embeddings:
        specs.append(Spec("lm_head.weight", ("lm_head",), (V, D), True))
    return specs


def block_specs(cfg: DecoderConfig, i: int) -> list[Spec]:
    D, hd = cfg.hidden, cfg.dim_per_head
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    p = f"model.layers.{i}."
    # the attention's norm and the MLP's: pre-norm blocks name them by position in the block
    # (Llama: the input's and the one after attention), post-norm ones by the sublayer they follow (OLMo 2);
    # sandwich blocks (Gemma 3) have all four
    norms = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
             "post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"},
             "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
             }[cfg.norm_placement]
    specs = [Spec(p + f"{hf}.weight", (ours, "scale"), (D,), False) for ours, hf in norms.items()]
    if cfg.family == "phi3":
        return specs + _phi3_specs(cfg, p)
    if cfg.mla is not None:
        specs += _mla_specs(cfg, p)
        return specs + (_moe_specs(cfg, p) if cfg.is_moe_layer(i) else _dense_mlp_specs(cfg, p))
    for ours, out_dim in (("q", q), ("k", kv), ("v", kv)):
        specs.append(Spec(p + f"self_attn.{ours}_proj.weight", ("attn", ours, "kernel"), (out_dim, D), True))
        if cfg.qkv_bias:
            specs.append(Spec(p + f"self_attn.{ours}_proj.bias", ("attn", ours, "bias"), (out_dim,), False))
    specs.append(Spec(p + "self_attn.o_proj.weight", ("attn", "o", "kernel"), (D, q), True))
    if cfg.o_bias:
        specs.append(Spec(p + "self_attn.o_proj.bias", ("attn", "o", "bias"), (D,), False))
    if cfg.attention_sinks:
        specs.append(Spec(p + "self_attn.sinks", ("attn", "sinks"), (cfg.heads,), False))
    if cfg.qk_norm:
        q_width, k_width = (hd, hd) if cfg.qk_norm_width == "head" else (q, kv)
        specs += [Spec(p + "self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (q_width,), False),
                  Spec(p + "self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (k_width,), False)]
    if cfg.is_moe_layer(i):
        return specs + (_gpt_oss_moe_specs(cfg, p) if cfg.family == "gpt_oss" else _moe_specs(cfg, p))
    return specs + _dense_mlp_specs(cfg, p)


def _gpt_oss_moe_specs(cfg: DecoderConfig, p: str) -> list[Spec]:
    """GPT-OSS's mixture of experts (``GptOssMLP``): ``router`` (weight [E, D], bias), and the experts stacked
    and stored [in, out]: ``gate_up_proj`` [E, D, 2F] with gate in the even columns and up in the odd ones
    (``GptOssExperts._apply_gate``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), its bias [E, 2F] likewise,
    ``down_proj`` [E, F, D] and its bias [E, D]."""
    m, D = cfg.moe, cfg.hidden
    E, F = m.experts, m.expert_ffn
    x = p + "mlp.experts."
    specs = [Spec(p + "mlp.router.weight", ("mlp", "router", "kernel"), (E, D), True),
             Spec(p + "mlp.router.bias", ("mlp", "router", "bias"), (E,), False)]
    for ours, start in (("gate", 0), ("up", 1)):
        specs += [Spec(x + "gate_up_proj", ("mlp", "experts", ours), (E, D, 2 * F), False, interleave=(start, 2)),
                  Spec(x + "gate_up_proj_bias", ("mlp", "experts", f"{ours}_bias"), (E, 2 * F), False,
                       interleave=(start, 2))]
    return specs + [Spec(x + "down_proj", ("mlp", "experts", "down"), (E, F, D), False),
                    Spec(x + "down_proj_bias", ("mlp", "experts", "down_bias"), (E, D), False)]


def _dense_mlp_specs(cfg: DecoderConfig, p: str) -> list[Spec]:
    D, F = cfg.hidden, cfg.ffn
    return [Spec(p + f"mlp.{name}_proj.weight", ("mlp", name, "kernel"), shape, True)
            for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))]


def _mla_specs(cfg: DecoderConfig, p: str) -> list[Spec]:
    """DeepSeek-V3's multi-head latent attention (``DeepseekV3Attention``): ``q_proj``, or ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``; ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``; ``o_proj``.
    ``attention_bias`` puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj (not on q_proj or the b's). The
    rotated dimensions stay in the checkpoint's (interleaved) order: the attention reads them as they are."""
    m, D, N = cfg.mla, cfg.hidden, cfg.heads
    a, bias = p + "self_attn.", cfg.qkv_bias
    specs = []
    if m.q_lora_rank is None:
        specs.append(Spec(a + "q_proj.weight", ("attn", "q", "kernel"), (N * m.qk_dim, D), True))
    else:
        r = m.q_lora_rank
        specs += [Spec(a + "q_a_proj.weight", ("attn", "q_a", "kernel"), (r, D), True),
                  Spec(a + "q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), (r,), False),
                  Spec(a + "q_b_proj.weight", ("attn", "q_b", "kernel"), (N * m.qk_dim, r), True)]
        if bias:
            specs.append(Spec(a + "q_a_proj.bias", ("attn", "q_a", "bias"), (r,), False))
    kv_a = m.kv_lora_rank + m.qk_rope_dim
    specs += [Spec(a + "kv_a_proj_with_mqa.weight", ("attn", "kv_a", "kernel"), (kv_a, D), True),
              Spec(a + "kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), (m.kv_lora_rank,), False),
              Spec(a + "kv_b_proj.weight", ("attn", "kv_b", "kernel"), (N * (m.qk_nope_dim + m.v_dim), m.kv_lora_rank),
                   True),
              Spec(a + "o_proj.weight", ("attn", "o", "kernel"), (D, N * m.v_dim), True)]
    if bias:
        specs += [Spec(a + "kv_a_proj_with_mqa.bias", ("attn", "kv_a", "bias"), (kv_a,), False),
                  Spec(a + "o_proj.bias", ("attn", "o", "bias"), (D,), False)]
    return specs


def _phi3_specs(cfg: DecoderConfig, p: str) -> list[Spec]:
    """Phi-3's fused projections: ``qkv_proj`` [q + k + v rows, D] (Phi3Attention slices q, k, v in that
    order) and ``gate_up_proj`` [2F, D] (Phi3MLP's ``chunk(2)``: gate, then up)."""
    D, F, hd = cfg.hidden, cfg.ffn, cfg.dim_per_head
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    qkv, gate_up = (q + 2 * kv, D), (2 * F, D)
    return [Spec(p + "self_attn.qkv_proj.weight", ("attn", "q", "kernel"), qkv, True, rows=(0, q)),
            Spec(p + "self_attn.qkv_proj.weight", ("attn", "k", "kernel"), qkv, True, rows=(q, q + kv)),
            Spec(p + "self_attn.qkv_proj.weight", ("attn", "v", "kernel"), qkv, True, rows=(q + kv, q + 2 * kv)),
            Spec(p + "self_attn.o_proj.weight", ("attn", "o", "kernel"), (D, q), True),
            Spec(p + "mlp.gate_up_proj.weight", ("mlp", "gate", "kernel"), gate_up, True, rows=(0, F)),
            Spec(p + "mlp.gate_up_proj.weight", ("mlp", "up", "kernel"), gate_up, True, rows=(F, 2 * F)),
            Spec(p + "mlp.down_proj.weight", ("mlp", "down", "kernel"), (D, F), True)]


def _moe_specs(cfg: DecoderConfig, p: str) -> list[Spec]:
    """A mixture of experts' tensors as released checkpoints store them: one [out, in] matrix per expert
    (Mixtral's ``block_sparse_moe.experts.j.w1/w3/w2``, Qwen-MoE's ``mlp.experts.j.gate/up/down_proj``), our
    leaves stacked over the experts. GLM-4.5's router also holds ``gate.e_score_correction_bias`` and its
    shared experts are ``shared_experts`` (one MLP of n_shared_experts x moe_intermediate_size), ungated."""
    m, D = cfg.moe, cfg.hidden
    F, E = m.expert_ffn, m.experts
    mixtral = cfg.family == "mixtral"
    moe = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {n: f"{n}_proj" for n in ("gate", "up", "down")}
    specs = [Spec(moe + "gate.weight", ("mlp", "router", "kernel"), (E, D), True)]
    if m.scoring == "sigmoid":
        specs.append(Spec(moe + "gate.e_score_correction_bias", ("mlp", "correction_bias"), (E,), False))
    for j in range(E):
        for ours, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            specs.append(Spec(f"{moe}experts.{j}.{names[ours]}.weight", ("mlp", "experts", ours), shape, True, j))
    if m.shared_expert_ffn is not None:
        S = m.shared_expert_ffn
        shared = "shared_expert" if m.shared_expert_gate else "shared_experts"  # Qwen2-MoE's; DeepSeek / GLM's
        for ours, shape in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
            specs.append(Spec(f"{moe}{shared}.{ours}_proj.weight", ("mlp", "shared", ours, "kernel"), shape, True))
        if m.shared_expert_gate:
            specs.append(Spec(f"{moe}shared_expert_gate.weight", ("mlp", "shared_gate", "kernel"), (1, D), True))
    return specs


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
    """Raise CheckpointMismatch listing every missing, unexpected or wrongly shaped tensor, from the
    headers alone (before any tensor data is read)."""
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
    if cfg.tie_embeddings and "lm_head.weight" in found and tuple(found["lm_head.weight"]) != (
            cfg.vocab_size, cfg.hidden):
        wrong.append("lm_head.weight")
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden)
    if not (missing or unexpected or wrong):
        return
    lines = [f"checkpoint {ckpt.dir} does not match its config ({cfg.family}, {cfg.layers} layers, hidden "
             f"{cfg.hidden}, vocab {cfg.vocab_size}, tied={cfg.tie_embeddings}):"]
    lines += [f"  missing: {n} (expected shape {list(expected[n])})" for n in missing]
    lines += [f"  unexpected: {n} (shape {list(found[n])})" for n in unexpected]
    lines += [f"  shape mismatch: {n}: expected {list(expected[n])}, found {list(found[n])}" for n in wrong]
    raise CheckpointMismatch("\n".join(lines))


def _mtp_layer(cfg: DecoderConfig, name: str) -> bool:
    """Whether ``name`` is a tensor of a GLM-4.5 / DeepSeek-V3 multi-token-prediction layer: ``model.layers.{j}.*``
    with j at or past ``cfg.layers`` (transformers' ``_keys_to_ignore_on_load_unexpected`` for Glm4MoeForCausalLM
    and DeepseekV3ForCausalLM)."""
    parts = name.split(".")
    return (cfg.family in ("glm4_moe", "deepseek_v3") and len(parts) > 2 and parts[:2] == ["model", "layers"]
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
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    generation = Path(model_dir) / GENERATION_CONFIG
    if generation.exists():
        try:
            ids = token_ids(json.loads(generation.read_text()))
        except (ValueError, UnsupportedConfig) as e:
            raise UnsupportedConfig(f"{generation}: {e}") from None
        overrides = {**{k: v for k, v in ids.items() if k not in json.loads(path.read_text())}, **overrides}
    return config_from_hf(json.loads(path.read_text()), **overrides)


def open_checkpoint(model_dir: str | os.PathLike, cfg: DecoderConfig) -> Checkpoint | DequantizedCheckpoint:
    """Open and check the checkpoint's headers against ``cfg``; no tensor data is read yet. A GPT-OSS checkpoint
    with MXFP4 experts (the released ones) reads them dequantized, each as it is read (``hf/mxfp4.py``)."""
    ckpt = Checkpoint(model_dir)
    if cfg.family == "gpt_oss" and packed_names(ckpt):
        ckpt = DequantizedCheckpoint(ckpt)
        warnings.warn(f"{model_dir}: the experts are MXFP4 ({len(ckpt.packed)} *_blocks / *_scales pairs): each is "
                      f"dequantized to bfloat16 as transformers does when its layer is read (exact; float32 masters "
                      f"from there)", stacklevel=2)
    check_checkpoint(ckpt, cfg)
    return ckpt


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
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r} not supported for export; use 'bfloat16' or 'float32'")
    if len(block_params) != cfg.layers:
        raise CheckpointMismatch(f"{len(block_params)} block parameter trees for a {cfg.layers}-layer config")
    hf_config = config_to_hf(cfg, dtype)
    if cfg.family == "gpt_oss":
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

    out = staging(model_dir)
    try:
        itemsize = np.dtype(np.float32).itemsize if dtype == "float32" else 2
        shards = plan_shards(((n, math.prod(e[1]) * itemsize) for n, e in entries.items()), max_shard_bytes)
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
        publish(out, model_dir)
    except BaseException:  # a failed export leaves nothing beside the folder (a killed one: the .partial folder)
        shutil.rmtree(out, ignore_errors=True)
        raise
    return [Path(model_dir) / name for name in names]


def _producer(value: Any, transpose: bool, expert: int | None = None):
    """Deferred host conversion of one parameter, or of one expert's slice of it (a JAX array is fetched
    only when written)."""
    def produce() -> np.ndarray:
        x = np.asarray(value) if expert is None else np.asarray(value)[expert]
        return np.asarray(x, np.float32).T if transpose else x
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


