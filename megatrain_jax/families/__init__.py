"""The model families, a file each, and the registry that finds them (``FAMILIES``: name -> ``Family``).

A family file holds what is particular to one family: its named shapes (presets), and its Hugging Face format
(config.json's keys, transformers' config defaults, what an export refuses, its tensor names). ``models`` asks the
registry for the names and presets, ``hf`` for the format; this package imports neither. To add a family, write
its file and list it below (docs/models.md, "Add a family").
"""

from __future__ import annotations

from megatrain_jax.families import (deepseek_v3, gemma3, glm4_moe, gpt_oss, llama, mistral, mixtral, olmo2, phi3,
                                    qwen2, qwen2_moe, qwen3, qwen3_moe)
from megatrain_jax.families.family import EITHER, FEATURES, Family, UnsupportedConfig
from megatrain_jax.families.tensors import Spec

# In the order the docs list them: the dense families, then the mixtures of experts.
FAMILIES: dict[str, Family] = {f.FAMILY.name: f.FAMILY for f in (
    llama, mistral, qwen2, qwen3, phi3, olmo2, gemma3, mixtral, qwen2_moe, qwen3_moe, glm4_moe, deepseek_v3, gpt_oss)}


def by_model_type() -> dict[str, Family]:
    """config.json's ``model_type`` -> its family (the family's own, and the others it reads or refuses)."""
    out = {f.model_type: f for f in FAMILIES.values()}
    out.update({t: f for f in FAMILIES.values() for t in f.other_model_types})
    return out


__all__ = ["EITHER", "FAMILIES", "FEATURES", "Family", "Spec", "UnsupportedConfig", "by_model_type"]
