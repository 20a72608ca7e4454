"""A launcher run's config: what its YAML file and every checkpoint's ``config.yaml`` hold.

    schema.py            the sections and keys, each documented (what a YAML file may say)
    overrides.py         YAML file + ``section.key=value`` overrides -> typed dataclasses
    megatron_configs.py  where those fields become megatron-core's config objects

Read by the YAML launcher (``mcore_ext.training``, which adds what a runnable combination is:
``training.config.validate`` / ``load_config``), by ``mcore_ext.hf`` (a checkpoint's model, for
import and export) and by ``mcore_ext.plan`` (a launcher config's memory), none of which needs the
others.
"""

from mcore_ext.run_config.overrides import apply_overrides, build, read_yaml
from mcore_ext.run_config.schema import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PretrainConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PretrainConfig",
    "TrainingConfig",
    "apply_overrides",
    "build",
    "read_yaml",
]
