"""mcore_ext inside Megatron-LM's own training (megatron.training, megatron-core >= 0.19).

    torchrun ... -m mcore_ext.megatron_lm.pretrain_gpt <Megatron-LM flags> --head-wise-attn-gate

- ``add_mcore_ext_args``: megatron's ``extra_args_provider`` with a flag per field that
  ``GatedTransformerConfig`` adds, plus ``--mcore-ext-backend``.
- ``GatedGPTModelConfig`` / ``GatedGPTModelBuilder``: megatron.training's model config and builder
  for mcore_ext's GPT; ``gated_gpt_config_from_args`` builds the config from parsed flags.
- ``pretrain_gpt``: the entry point (forward step, dataset provider, main).
"""

from mcore_ext import _mcore_compat

_mcore_compat.check_megatron_training()

from mcore_ext.megatron_lm.arguments import (  # noqa: E402
    add_mcore_ext_args,
    mcore_ext_fields,
    transformer_config_from_args,
)
from mcore_ext.megatron_lm.model import (  # noqa: E402
    GatedGPTModelBuilder,
    GatedGPTModelConfig,
    gated_gpt_config_from_args,
)

__all__ = [
    "GatedGPTModelBuilder",
    "GatedGPTModelConfig",
    "add_mcore_ext_args",
    "gated_gpt_config_from_args",
    "mcore_ext_fields",
    "transformer_config_from_args",
]
