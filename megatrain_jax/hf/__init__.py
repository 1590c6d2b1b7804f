"""Hugging Face checkpoints: read and write every family's safetensors (``megatrain_jax.families``) without torch.

``from_hf`` gives a Decoder from a folder in one call (each tensor read once); ``to_hf`` writes one back.
``load_hf`` gives ``(cfg, io_params, [block_params])`` as float32 numpy trees, part by part;
``load_hf_into`` fills a Decoder; ``HFParts`` feeds the engine's initial state part by part, with no model
holding the weights; ``save_hf`` writes a folder transformers can load.
"""

from megatrain_jax.hf.config import ARCHITECTURES, UnsupportedConfig, config_from_hf, config_to_hf
from megatrain_jax.hf.decoder_io import from_hf, to_hf
from megatrain_jax.hf.export import save_hf
from megatrain_jax.hf.mapping import (CheckpointMismatch, HFParts, block_specs, check_checkpoint, io_specs, iter_blocks,
                                      load_hf, load_hf_into, open_checkpoint, read_config, read_io)
from megatrain_jax.hf.safetensors_io import (Checkpoint, SafetensorsError, SafetensorsFile, read_safetensors,
                                             write_safetensors)

__all__ = ["ARCHITECTURES", "Checkpoint", "CheckpointMismatch", "HFParts", "SafetensorsError", "SafetensorsFile",
           "UnsupportedConfig", "block_specs", "check_checkpoint", "config_from_hf", "config_to_hf", "io_specs",
           "from_hf", "iter_blocks", "load_hf", "load_hf_into", "open_checkpoint", "read_config", "read_io",
           "read_safetensors", "save_hf", "to_hf", "write_safetensors"]
