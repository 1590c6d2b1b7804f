"""megatrain_jax: train language models larger than GPU memory on one GPU.

All persistent state lives in pinned host memory; a scan-free scheduler streams each layer's parameters
to the GPU ahead of use and the optimizer runs on the host. See README.md.
"""

from megatrain_jax import _environment  # noqa: F401  (first: sets XLA's pinned-host pool size)
from megatrain_jax.batch import Batch
from megatrain_jax.check import ModelCheck, check_model
from megatrain_jax.engine.engine import DeviceOutOfMemoryError, Engine, StepOutput
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.evaluate import eval_hook, evaluate
from megatrain_jax.fit import History, Hook, StepInfo, default_optimizer, fit
from megatrain_jax.hf.decoder_io import from_hf, to_hf
from megatrain_jax.loss import DPO, NextToken
from megatrain_jax.optim import UnsupportedOptimizerError, adamw, decay_mask
from megatrain_jax.contract.layered import ContractError, LayeredModel, layered
from megatrain_jax.models import Decoder, DecoderConfig, preset
from megatrain_jax.reference import ReferenceTrainer
from megatrain_jax.train_config import TrainConfig
from megatrain_jax.engine.update.policy import NonFiniteError

__all__ = ["Batch", "ContractError", "DPO", "Decoder", "DecoderConfig", "DeviceOutOfMemoryError", "Engine",
           "EngineConfig", "History", "Hook", "LayeredModel", "ModelCheck", "NextToken", "NonFiniteError",
           "ReferenceTrainer", "StepInfo",
           "StepOutput", "TrainConfig", "UnsupportedOptimizerError", "adamw", "check_model", "decay_mask",
           "default_optimizer", "eval_hook", "evaluate", "fit", "from_hf", "layered", "preset", "to_hf"]
__version__ = "0.1.0"
