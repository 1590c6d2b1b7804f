"""The record of one model family (``Family``): its name, its named shapes, and its Hugging Face format.

A family record knows no model code: presets are DecoderConfig fields as plain values (a TOML ``[model]``
table would write them), and the hooks read configs by attribute, so ``megatrain_jax.models`` can ask the
registry for the family names and ``megatrain_jax.hf`` for each family's config.json keys and tensor names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from megatrain_jax.families.tensors import Spec, block_specs

Fields = dict[str, Any]  # DecoderConfig fields by name (nested configs as dicts of their fields)


class UnsupportedConfig(ValueError):
    """The checkpoint uses a model type or feature our decoder does not implement."""


# The DecoderConfig values an architecture fixes (``Family.features``), as most families have them (Llama's); a
# family's record gives its own where they differ, or ``EITHER`` where its config.json decides. The fixed ones are
# read back from config.json as they are, and an export refuses any other ("moe.*": fields of the MoEConfig).
EITHER = "either"
FEATURES: Mapping[str, Any] = {
    "qkv_bias": False, "o_bias": False, "qk_norm": False, "qk_norm_width": "head", "norm_placement": "pre",
    "norm_unit_offset": False, "scale_embeddings": False, "mlp_activation": "silu", "attention_sinks": False,
    "query_pre_attn_scalar": None, "sliding_rope_theta": None, "final_logit_softcap": None,
    "moe.scoring": "softmax", "moe.router_bias": False, "moe.expert_bias": False, "moe.activation": "silu"}


def _nothing(*_: Any) -> None:
    return None


def _no_problems(cfg: Any) -> list[str]:
    return []


def _no_fields(*_: Any) -> Fields:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: what ``DecoderConfig.family`` names.

    - ``presets``: named shapes, DecoderConfig fields (``megatrain_jax.models.preset(name)``);
    - ``moe`` / ``mla``: its blocks route tokens to experts / use multi-head latent attention (a DecoderConfig of
      this family must set ``moe`` / ``mla``);
    - the Hugging Face side: ``model_type`` and ``hf_class`` (config.json's ``model_type``, the causal LM class
      transformers builds), ``hf_defaults`` (what its config class assumes where config.json omits a key),
      ``rope_kinds`` (the RoPE scalings its config class reads), ``features`` (the architecture's values of
      ``FEATURES`` where they differ from the common ones: an export refuses others), ``mixed_layers`` (layer types
      may mix sliding and full attention), ``dense_layers`` (``first_k_dense_replace`` may be set), and what its
      released checkpoints hold beside the model (``mtp_layers``, ``mxfp4_experts``);
    - hooks: ``read(c, layers)`` gives this family's DecoderConfig fields from config.json ``c`` (beyond the common
      ones ``hf.config`` reads), ``refuse(c)`` raises UnsupportedConfig for what our decoder cannot reproduce,
      ``write(cfg, out)`` puts this family's keys in config.json dict ``out``, ``problems(cfg)`` says what else
      its HF class cannot express, ``blocks(cfg, i)`` gives block ``i``'s tensors (``tensors.Spec``).
    """

    name: str
    title: str  # as messages name it ("Gemma 3")
    model_type: str
    hf_class: str
    presets: Mapping[str, Fields] = dataclasses.field(default_factory=dict)
    # other model_types whose config.json means this family (None: read it as ours) or is refused (why, and what to do)
    other_model_types: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    moe: bool = False
    mla: bool = False
    hf_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rope_kinds: tuple[str, ...] = ("default", "llama3", "linear", "yarn")
    features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mixed_layers: bool = False
    dense_layers: bool = False
    # its released checkpoints hold multi-token-prediction layers past the last, which transformers' causal LM
    # ignores (GLM-4.5, DeepSeek-V3): a load skips them with a warning
    mtp_layers: bool = False
    # its released checkpoints store the experts as MXFP4 (GPT-OSS): a load dequantizes them (hf/mxfp4.py)
    mxfp4_experts: bool = False
    read: Callable[[dict[str, Any], int], Fields] = _no_fields
    refuse: Callable[[dict[str, Any]], None] = _nothing
    write: Callable[[Any, dict[str, Any]], None] = _nothing
    problems: Callable[[Any], list[str]] = _no_problems
    blocks: Callable[[Any, int], list[Spec]] = block_specs

    def feature(self, name: str) -> Any:
        """The architecture's value of ``FEATURES[name]`` (``EITHER``: either, by config)."""
        return self.features.get(name, FEATURES[name])
