"""The launcher's configuration: schema, YAML + command-line merge, validation.

A run is configured by one YAML file with the sections of ``PretrainConfig``, plus
``section.key=value`` overrides on the command line (values parsed as YAML). Precedence: dataclass
defaults < YAML < overrides. ``load_config`` merges once and validates once; every problem it finds
is a ``ConfigError`` with a message meant for the user, raised before anything is built or written.

    mcore_ext/run_config/   the schema (sections and keys), YAML + overrides -> typed
                            dataclasses, the megatron config objects (shared with hf and plan,
                            which read checkpoints' and users' configs without the launcher)
    validation.py           what a runnable combination is, and the values derived from it
"""

import os

from mcore_ext.run_config import ConfigError, PretrainConfig, apply_overrides, build, read_yaml
from mcore_ext.training.config.validation import validate

# The sections (ModelConfig, ...) are mcore_ext.run_config's.
__all__ = ["ConfigError", "PretrainConfig", "load_config", "validate"]


def load_config(path: str | None, overrides=(), world_size: int | None = None) -> PretrainConfig:
    """Defaults < YAML file < ``section.key=value`` overrides, validated for ``world_size`` ranks.

    ``world_size`` defaults to $WORLD_SIZE (set by torchrun), else 1.
    """
    raw = read_yaml(path) if path else {}
    cfg = build(PretrainConfig, apply_overrides(raw, overrides))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg
