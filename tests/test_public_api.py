"""The public API is pinned: the names ``megatrain_jax`` and its user-facing subpackages export, and that
each one resolves. Moving a module inside the package must not change them (issue 30's move did not)."""

from __future__ import annotations

import importlib

import pytest

import megatrain_jax

# megatrain_jax.__all__ on main before the package was split into engine/, plan/ and contract/ (24a7976), and
# since issue 31 DeviceOutOfMemoryError (a step that ran out of GPU memory, and whether its update began), since
# issue 34 from_hf and to_hf (a model from a Hugging Face folder and back, one call each), since issue 53 the
# training objectives DPO and NextToken (preference training as the engine's loss).
TOP = ["Batch", "ContractError", "DPO", "Decoder", "DecoderConfig", "DeviceOutOfMemoryError", "Engine", "EngineConfig",
       "History", "Hook", "LayeredModel", "ModelCheck", "NextToken", "NonFiniteError", "ReferenceTrainer", "StepInfo",
       "StepOutput", "TrainConfig", "UnsupportedOptimizerError", "adamw", "check_model", "decay_mask",
       "default_optimizer", "eval_hook", "evaluate", "fit", "from_hf", "layered", "preset", "to_hf"]

SUBPACKAGES = {
    "data": ["DataConfig", "Prefetcher", "TokenBatches", "TokenDataset", "TokenFile", "TokenWriter", "demo_dataset",
             "demo_tokens", "prefetch", "write_tokens"],
    "hf": ["ARCHITECTURES", "Checkpoint", "CheckpointMismatch", "HFParts", "SafetensorsError", "SafetensorsFile",
           "UnsupportedConfig", "block_specs", "check_checkpoint", "config_from_hf", "config_to_hf", "from_hf",
           "io_specs", "iter_blocks", "load_hf", "load_hf_into", "open_checkpoint", "read_config", "read_io",
           "read_safetensors", "save_hf", "to_hf", "write_safetensors"],
    "checkpoint": ["CheckpointFolderBusyError", "CheckpointSession", "CheckpointWarning", "CheckpointWriteError",
                   "CheckpointedExit", "Checkpointer", "CorruptCheckpointError", "NonFiniteCheckpointError",
                   "ShapeMismatchError", "check_step", "committed_steps", "load_model",
                   "load_params", "save_model", "save_params"],
    "models": ["Block", "Decoder", "DecoderConfig", "FAMILIES", "InputOutput", "MLAConfig", "MoE", "MoEConfig", "PRESETS",
               "RopeScaling", "RouterStats", "load_balancing_loss", "preset"],
    "observe": ["JsonlWriter", "Progress", "TensorBoardWriter", "WandbLogger", "memory_hook", "plot_run",
                "read_metrics", "system_stats"],
    "cli": ["ConfigError", "LogConfig", "ModelSection", "OptimizerConfig", "RunConfig", "TrainSection", "load_config",
            "main", "parse_config", "to_toml"],
}


def test_the_package_exports_the_same_names():
    assert sorted(megatrain_jax.__all__) == sorted(TOP)
    for name in TOP:
        assert getattr(megatrain_jax, name) is not None, name
    assert megatrain_jax.__version__


@pytest.mark.parametrize("sub", sorted(SUBPACKAGES))
def test_each_subpackage_exports_the_same_names(sub):
    module = importlib.import_module(f"megatrain_jax.{sub}")
    exported = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")
                                                    and not isinstance(getattr(module, n), type(importlib))]
    assert sorted(set(exported)) == sorted(SUBPACKAGES[sub]), sub
    for name in SUBPACKAGES[sub]:
        assert getattr(module, name) is not None, (sub, name)


def test_the_public_classes_are_one_object_wherever_they_are_named():
    """The top-level names are the engine's own objects, not copies (one representation per concept)."""
    from megatrain_jax.contract.layered import ContractError, LayeredModel, layered
    from megatrain_jax.engine.config import EngineConfig
    from megatrain_jax.engine.engine import Engine
    from megatrain_jax.engine.update.policy import NonFiniteError
    assert megatrain_jax.Engine is Engine and megatrain_jax.EngineConfig is EngineConfig
    assert megatrain_jax.NonFiniteError is NonFiniteError
    assert (megatrain_jax.ContractError, megatrain_jax.LayeredModel, megatrain_jax.layered) == (
        ContractError, LayeredModel, layered)
