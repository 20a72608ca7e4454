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
    raw = apply_overrides(read_yaml(path) if path else {}, overrides)
    cfg = build(PretrainConfig, raw)
    if "architecture" not in (raw.get("model") or {}):
        cfg.model.architecture = _loaded_architecture(cfg) or cfg.model.architecture
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg


def _loaded_architecture(cfg: PretrainConfig) -> str | None:
    """The model (gpt / hybrid) of the checkpoint the run starts from, for a config that does
    not name ``model.architecture``: a run resumes, and a fine-tune continues, as its checkpoint
    was saved (megatron translates GPT -> hybrid, and a run that switched on its own would save
    hybrid checkpoints beside its GPT ones). None from scratch: the schema's default, the model
    the installed megatron-core recommends, also where no checkpoint can be read (the launcher
    refuses a missing or unreadable one when it starts)."""
    from mcore_ext.checkpoint import manifest
    from mcore_ext.checkpoint.architecture import checkpoint_architecture
    from mcore_ext.checkpoint.directory import find_start, replaced_dir
    from mcore_ext.checkpoint.errors import PickleRefused

    try:
        start = find_start(cfg.checkpoint.save, cfg.checkpoint.load)
        if start.checkpoint is None:
            return None
        directory = start.checkpoint.directory
        if not os.path.isdir(directory):  # a killed save's, put back before loading
            directory = replaced_dir(directory)
        with manifest.deferred():  # every rank, no process group yet: the load verifies it
            return checkpoint_architecture(directory)
    except (Exception, PickleRefused):  # noqa: BLE001  (no, an unreadable or an unsafe
        return None  # checkpoint: the launcher's load refuses it in its own words)
