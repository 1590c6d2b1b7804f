"""Named presets: each family's named shapes (``megatrain_jax.families``) as DecoderConfigs.

Published sizes are checked by the tests (tests/test_moe.py, tests/test_models.py): Mixtral-8x7B 46.7B (12.9B
active), Qwen3-30B-A3B 30.5B (3.3B active), Qwen2-57B-A14B 57.4B (14.2B active), and the dense ones."""

from __future__ import annotations

import difflib

from megatrain_jax.families import FAMILIES
from megatrain_jax.models.config import DecoderConfig

PRESETS: dict[str, DecoderConfig] = {name: DecoderConfig.from_dict(fields) for family in FAMILIES.values()
                                     for name, fields in family.presets.items()}


def preset(name: str, **overrides) -> DecoderConfig:
    """A named preset, optionally with fields replaced (e.g. ``preset('7b', layers=16)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}.{_meant(name)} Available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def _meant(name: str) -> str:
    """The presets ``name`` may have meant, as a sentence: spelt in another case (``7B``, ``Llama3-8B``) or close to
    one; a Hugging Face model (``meta-llama/Meta-Llama-3-8B``, a folder) is read from its folder, not named."""
    if "/" in str(name):
        return (" A Hugging Face model is read from its downloaded folder: set model.hf_checkpoint to it (in Python: "
                "megatrain_jax.from_hf); a preset is one of the named shapes below.")
    lower = {p.lower(): p for p in PRESETS}
    close = [lower[p] for p in difflib.get_close_matches(str(name).lower(), lower, n=3)]
    return f" Did you mean {close}?" if close else ""
