"""Every registered family (``megatrain_jax.families.FAMILIES``) passes the same checks: what a new family must pass.

Parametrized over the registry, so a family is checked as soon as it is listed there:
- here: it has a Hugging Face fixture made by transformers (``tests/fixtures/hf/<model_type>``, written by
  ``scripts/make_hf_fixtures.py``) that reads as this family, and each of its presets is valid, exportable, and
  reads back from its config.json as itself;
- tests/test_hf.py: the fixture's logits equal transformers' (``test_logits_match_transformers``), the fixture
  round-trips through ``save_hf`` / ``load_hf`` bit for bit (``test_hf_round_trip``), and, where torch and
  transformers are installed, our export loads in transformers with the same logits;
- tests/test_family_modes.py: the streamed engine equals the in-memory ``jax.grad`` + optax reference on the
  fixture (SFT batches, packed rows, kept residuals, offloaded activations, two devices).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from megatrain_jax.families import FAMILIES, by_model_type
from megatrain_jax.hf import config_from_hf, config_to_hf, read_config
from megatrain_jax.models import DecoderConfig
from megatrain_jax.models.config import Family

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "hf"
PRESETS = [(family.name, preset) for family in FAMILIES.values() for preset in family.presets]


def test_the_registry_names_each_family_and_model_type_once():
    assert typing.get_args(Family) == tuple(FAMILIES)  # the TOML check reads the registry's names
    assert all(name == family.name for name, family in FAMILIES.items())
    types = [family.model_type for family in FAMILIES.values()] + [t for f in FAMILIES.values()
                                                                   for t in f.other_model_types]
    assert len(types) == len(set(types)) and set(types) == set(by_model_type())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_has_a_fixture_made_by_transformers(name):
    folder = FIXTURE_DIR / FAMILIES[name].model_type
    missing = [f for f in ("config.json", "model.safetensors", "tokens.npy", "logits.npy") if not (folder / f).exists()]
    assert not missing, f"{folder} lacks {missing}: add the family to scripts/make_hf_fixtures.py's FIXTURES and run it"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[name].hf_class]
    assert read_config(folder).family == name


@pytest.mark.parametrize("name, preset", PRESETS)
def test_each_preset_reads_back_from_its_config_json(name, preset):
    cfg = DecoderConfig.from_dict(dict(FAMILIES[name].presets[preset]))
    assert cfg.family == name
    back = config_from_hf(json.loads(json.dumps(config_to_hf(cfg))), dtype=cfg.dtype,
                          loss_chunk_tokens=cfg.loss_chunk_tokens)
    for field in dataclasses.fields(cfg):  # as the computation reads them (an unused ffn, an implied head_dim)
        assert back.effective(field.name) == cfg.effective(field.name), field.name
