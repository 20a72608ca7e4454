"""mcore_ext inside Megatron-LM's own training (megatron.training, megatron-core >= 0.19).

    torchrun ... -m mcore_ext.megatron_lm.pretrain_gpt <Megatron-LM flags> --head-wise-attn-gate

- ``add_mcore_ext_args``: megatron's ``extra_args_provider`` with a flag per field that
  ``GatedTransformerConfig`` adds, plus ``--mcore-ext-backend``.
- ``GatedGPTModelConfig`` / ``GatedGPTModelBuilder``: megatron.training's model config and builder
  for mcore_ext's GPT; ``gated_gpt_config_from_args`` builds the config from parsed flags.
- ``GatedHybridModelConfig`` / ``GatedHybridModelBuilder``: the same for mcore_ext's HybridModel,
  chosen by Megatron-LM's ``--hybrid-layer-pattern`` (``gated_hybrid_config_from_args``).
- ``pretrain_gpt``: the entry point (forward step, dataset provider, main).

The checkpoint content both this entry and the YAML launcher write is megatron.training's own;
the launcher's reading and writing of it is ``mcore_ext.checkpoint.content``.
"""

import importlib

# The names below load lazily, each refusing a megatron-core < 0.19 on first use (it has no
# GPTModelConfig).
_EXPORTS = {
    "add_mcore_ext_args": "arguments",
    "mcore_ext_fields": "arguments",
    "transformer_config_from_args": "arguments",
    "GatedGPTModelBuilder": "model",
    "GatedGPTModelConfig": "model",
    "gated_gpt_config_from_args": "model",
    "GatedHybridModelBuilder": "model",
    "GatedHybridModelConfig": "model",
    "gated_hybrid_config_from_args": "model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
