"""Llama-family Flax NNX models. They follow the layered contract and never mention offload."""

from megatrain_jax.models.config import FAMILIES, PRESETS, DecoderConfig, RopeScaling, preset
from megatrain_jax.models.decoder import Block, Decoder, InputOutput

__all__ = ["Block", "Decoder", "DecoderConfig", "FAMILIES", "InputOutput", "PRESETS", "RopeScaling", "preset"]
