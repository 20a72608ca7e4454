"""``GatedGPTModelConfig`` / ``GatedGPTModelBuilder``: Megatron-LM's model config and builder
(megatron.training.models.gpt, megatron-core >= 0.19) building mcore_ext's GPT.

megatron.training finds a model's builder through the config's ``builder`` class path, and
serialises configs with ``as_dict`` / ``from_dict``, which drop callables. So the layer spec is
not stored in the config (``transformer_layer_spec`` stays None): the builder class named here
makes it, from the ``GatedTransformerConfig`` and the ``mcore_ext_backend`` string, both of which
survive serialisation.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from mcore_ext import _mcore_compat

_mcore_compat.check_megatron_training()

from megatron.core.pipeline_parallel.utils import (  # noqa: E402
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig  # noqa: E402
from megatron.training.vocab_utils import calculate_padded_vocab_size  # noqa: E402

from mcore_ext.config import GatedTransformerConfig  # noqa: E402
from mcore_ext.models import build_gpt_model  # noqa: E402
from mcore_ext.models.gpt import refuse_unbuilt_settings  # noqa: E402

# Fields both GPTModelConfig and GatedTransformerConfig declare. GPTModelConfig forwards writes to
# its transformer but reads its own class default (10000, 1.0) back, and as_dict would save that
# default: here the transformer's value is the only one.
_TRANSFORMER_OWNED = frozenset({"rotary_base", "rotary_percent"})


@dataclass(kw_only=True)
class GatedGPTModelConfig(GPTModelConfig):
    """megatron.training's ``GPTModelConfig`` for a ``GatedTransformerConfig`` and mcore_ext's
    layer specs. ``mcore_ext_backend``: "auto", "sdpa", "local" or "te" (see get_gpt_block_spec).
    """

    builder: ClassVar[str] = "mcore_ext.megatron_lm.model.GatedGPTModelBuilder"
    transformer: GatedTransformerConfig
    mcore_ext_backend: str = "auto"

    def __getattribute__(self, name: str) -> Any:
        if name in _TRANSFORMER_OWNED:
            try:
                return getattr(object.__getattribute__(self, "transformer"), name)
            except AttributeError:  # during __init__, before transformer is set
                pass
        return object.__getattribute__(self, name)

    def finalize(self) -> None:
        """megatron's checks, plus the ones that need the classes (called before building)."""
        super().finalize()
        _check(self)


def _check(config: GatedGPTModelConfig) -> None:
    if not isinstance(config.transformer, GatedTransformerConfig):
        raise TypeError(
            f"GatedGPTModelConfig.transformer is a {type(config.transformer).__name__}: it must "
            "be a mcore_ext GatedTransformerConfig"
        )
    if config.transformer_layer_spec is not None:
        raise ValueError(
            f"transformer_layer_spec={config.transformer_layer_spec!r} (--spec) would replace "
            "mcore_ext's layer spec: leave it unset and pick the backend with --mcore-ext-backend"
        )
    refuse_unbuilt_settings(config)


class GatedGPTModelBuilder(GPTModelBuilder):
    """Builds ``mcore_ext.build_gpt_model``: megatron's GPTModel with mcore_ext's block spec."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        """One model stage, as ``GPTModelBuilder.build_model`` (same vocab padding and stages)."""
        config = self._model_config
        _check(config)
        if config.vocab_size is None:
            raise ValueError("GatedGPTModelConfig.vocab_size must be set before building")
        vocab_size = config.vocab_size
        if config.should_pad_vocab:
            vocab_size = calculate_padded_vocab_size(
                vocab_size, config.make_vocab_size_divisible_by,
                config.transformer.tensor_model_parallel_size,
            )
        vp_size = config.transformer.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = (is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size)
                           and is_pp_first_stage(pg_collection.pp))
        if post_process is None:
            post_process = (is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size)
                            and is_pp_last_stage(pg_collection.pp))
        return build_gpt_model(
            config.transformer,
            vocab_size=vocab_size,
            max_sequence_length=config.seq_length,
            backend=config.mcore_ext_backend,
            share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
        )


def gated_gpt_config_from_args(args) -> GatedGPTModelConfig:
    """megatron's ``gpt_config_from_args`` with a ``GatedTransformerConfig`` built by
    ``core_transformer_config_from_args`` (every mcore_ext field from its flag)."""
    from megatron.training.argument_utils import gpt_config_from_args

    from mcore_ext.megatron_lm.arguments import transformer_config_from_args

    if getattr(args, "spec", None):  # megatron would import it, or fall back silently if it can't
        raise ValueError(
            f"--spec {' '.join(args.spec)} would replace mcore_ext's layer spec "
            "(transformer_layer_spec): leave it out and pick the backend with --mcore-ext-backend"
        )
    config = gpt_config_from_args(
        args, config=transformer_config_from_args(args), model_config_cls=GatedGPTModelConfig
    )
    config.mcore_ext_backend = getattr(args, "mcore_ext_backend", "auto")
    _check(config)
    return config
