"""Llama-family Flax NNX models. They follow the layered contract and never mention offload."""

from megatrain_jax.models.config import FAMILIES, DecoderConfig, MLAConfig, MoEConfig, RopeScaling
from megatrain_jax.models.presets import PRESETS, preset
from megatrain_jax.models.decoder import Block, Decoder, InputOutput
from megatrain_jax.models.moe import MoE, RouterStats, load_balancing_loss

__all__ = ["Block", "Decoder", "DecoderConfig", "FAMILIES", "InputOutput", "MLAConfig", "MoE", "MoEConfig", "PRESETS", "RopeScaling",
           "RouterStats", "load_balancing_loss", "preset"]
