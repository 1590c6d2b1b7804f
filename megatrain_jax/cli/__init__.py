"""The ``megatrain-jax`` command line: TOML run configs, ``train``, ``plan``, ``convert``, ``bench``, ``plot``."""

from megatrain_jax.cli.commands import main
from megatrain_jax.cli.run_config import (LogConfig, ModelSection, OptimizerConfig, RunConfig, TrainSection,
                                          load_config, parse_config, to_toml)
from megatrain_jax.cli.toml_dataclass import ConfigError

__all__ = ["ConfigError", "LogConfig", "ModelSection", "OptimizerConfig", "RunConfig", "TrainSection",
           "load_config", "main", "parse_config", "to_toml"]
