"""``GatedGPTModelConfig`` / ``GatedGPTModelBuilder`` and ``GatedHybridModelConfig`` /
``GatedHybridModelBuilder``: Megatron-LM's model configs and builders (megatron.training.models.gpt
and .hybrid, megatron-core >= 0.19) building mcore_ext's GPTModel and HybridModel.

megatron.training finds a model's builder through the config's ``builder`` class path, and
serialises configs with ``as_dict`` / ``from_dict``, which drop callables. So the layer spec is
not stored in the config (``transformer_layer_spec`` stays None): the builder class named here
makes it, from the ``GatedTransformerConfig`` and the ``mcore_ext_backend`` string, both of which
survive serialisation.
"""

import copy
import types
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from mcore_ext import _mcore_compat

_mcore_compat.check_megatron_training()

from megatron.core.pipeline_parallel.utils import (  # noqa: E402
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig  # noqa: E402
from megatron.training.models.hybrid import HybridModelBuilder, HybridModelConfig  # noqa: E402
from megatron.training.vocab_utils import calculate_padded_vocab_size  # noqa: E402

from mcore_ext.config import GatedTransformerConfig  # noqa: E402
from mcore_ext.models import build_gpt_model, build_hybrid_model  # noqa: E402
from mcore_ext.models.gpt import BUILT_GPT_SETTINGS, refuse_unbuilt_settings  # noqa: E402
from mcore_ext.models.hybrid import (  # noqa: E402
    ATTENTION,
    BUILT_HYBRID_SETTINGS,
    MTP,
    MTP_DEPTH,
    check_hybrid_pattern,
)

# Fields both GPTModelConfig (HybridModelConfig) and GatedTransformerConfig declare. The model
# config forwards writes to its transformer but reads its own class default (10000, 1.0) back, and
# as_dict would save that default: here the transformer's value is the only one.
_TRANSFORMER_OWNED = frozenset({"rotary_base", "rotary_percent"})


def _read_transformer_owned(self, name: str) -> Any:
    """``__getattribute__`` of both gated model configs: ``_TRANSFORMER_OWNED`` from the
    transformer."""
    if name in _TRANSFORMER_OWNED:
        try:
            return getattr(object.__getattribute__(self, "transformer"), name)
        except AttributeError:  # during __init__, before transformer is set
            pass
    return object.__getattribute__(self, name)


@dataclass(kw_only=True)
class GatedGPTModelConfig(GPTModelConfig):
    """megatron.training's ``GPTModelConfig`` for a ``GatedTransformerConfig`` and mcore_ext's
    layer specs. ``mcore_ext_backend``: "auto", "sdpa", "local" or "te" (see get_gpt_block_spec).
    """

    builder: ClassVar[str] = "mcore_ext.megatron_lm.model.GatedGPTModelBuilder"
    transformer: GatedTransformerConfig
    mcore_ext_backend: str = "auto"

    __getattribute__ = _read_transformer_owned

    def finalize(self) -> None:
        """megatron's checks, plus the ones that need the classes (called before building)."""
        super().finalize()
        _check(self)


@dataclass(kw_only=True)
class GatedHybridModelConfig(HybridModelConfig):
    """megatron.training's ``HybridModelConfig`` for a ``GatedTransformerConfig`` and mcore_ext's
    hybrid stack (``mcore_ext.build_hybrid_model``). ``transformer.num_layers`` counts the GPT
    layers the pattern stands for (its attention symbols), as the launcher's hybrid config does;
    ``hybrid_layer_pattern`` is megatron's (``* - E |``). ``mcore_ext_backend`` as
    ``GatedGPTModelConfig``'s.
    """

    builder: ClassVar[str] = "mcore_ext.megatron_lm.model.GatedHybridModelBuilder"
    transformer: GatedTransformerConfig
    mcore_ext_backend: str = "auto"

    __getattribute__ = _read_transformer_owned

    def finalize(self) -> None:
        """megatron's checks, plus the ones that need the classes (called before building)."""
        super().finalize()
        _check(self)


def _check(config) -> None:
    """What a gated model config must hold: a GatedTransformerConfig, no layer spec of its own
    (mcore_ext's is built from the backend), the settings mcore_ext's models build one way; for
    HybridModel a pattern mcore_ext builds for its layers (``check_hybrid_pattern``)."""
    if not isinstance(config.transformer, GatedTransformerConfig):
        raise TypeError(
            f"{type(config).__name__}.transformer is a {type(config.transformer).__name__}: it "
            "must be a mcore_ext GatedTransformerConfig"
        )
    if isinstance(config, GatedHybridModelConfig):
        spec_field, built = "hybrid_stack_spec", BUILT_HYBRID_SETTINGS
        if not config.hybrid_layer_pattern:  # megatron would derive one from deprecated ratios
            raise ValueError("GatedHybridModelConfig.hybrid_layer_pattern "
                             "(--hybrid-layer-pattern) must be set, e.g. '*-*-' for 2 layers")
        check_hybrid_pattern(config.hybrid_layer_pattern, config.transformer)
    else:
        spec_field, built = "transformer_layer_spec", BUILT_GPT_SETTINGS
    if getattr(config, spec_field) is not None:
        raise ValueError(
            f"{spec_field}={getattr(config, spec_field)!r} (--spec) would replace mcore_ext's "
            "layer spec: leave it unset and pick the backend with --mcore-ext-backend"
        )
    refuse_unbuilt_settings(config, built)


def _stage(config, pg_collection, pre_process, post_process, vp_stage) -> dict:
    """The vocabulary rows and pipeline-stage ends of one model stage, as megatron's
    ``GPTModelBuilder.build_model`` computes them (the same padding and stages)."""
    if config.vocab_size is None:
        raise ValueError(f"{type(config).__name__}.vocab_size must be set before building")
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
    return dict(vocab_size=vocab_size, max_sequence_length=config.seq_length,
                backend=config.mcore_ext_backend,
                share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
                pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


class GatedGPTModelBuilder(GPTModelBuilder):
    """Builds ``mcore_ext.build_gpt_model``: megatron's GPTModel with mcore_ext's block spec."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        """One model stage, as ``GPTModelBuilder.build_model`` (same vocab padding and stages)."""
        config = self._model_config
        _check(config)
        return build_gpt_model(
            config.transformer, **_stage(config, pg_collection, pre_process, post_process, vp_stage)
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


class GatedHybridModelBuilder(HybridModelBuilder):
    """Builds ``mcore_ext.build_hybrid_model``: megatron's HybridModel with mcore_ext's layers."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        """One model stage, with ``GatedGPTModelBuilder``'s vocab padding and stages."""
        config = self._model_config
        _check(config)
        return build_hybrid_model(
            config.transformer, **_stage(config, pg_collection, pre_process, post_process, vp_stage),
            hybrid_layer_pattern=config.hybrid_layer_pattern,
        )


def gated_hybrid_config_from_args(args, num_layers: Optional[int] = None,
                                  mtp_num_layers: Optional[int] = None) -> GatedHybridModelConfig:
    """megatron's ``hybrid_config_from_args`` (``--hybrid-layer-pattern``) with a
    ``GatedTransformerConfig`` of the GPT layers the pattern stands for: ``num_layers`` = its
    attention symbols, so each layer kind / clamp flag lists one value per GPT layer, and the
    model is ``build_hybrid_model``'s for the launcher's config of those flags (the same weights
    as the GPT entry's, layer for layer).

    MTP has megatron's two spellings, one model: the pattern's ``/`` depths (``'*-*-/*-'``,
    megatron's validation sets ``--mtp-num-layers`` from them), or ``--mtp-num-layers N`` with a
    pattern without ``/``, to which the config's pattern adds N depths ``/*-`` (megatron's own
    HybridModel would build none) as the launcher's derived pattern has them: each depth one
    dense GPT layer, Step-3.5's with ``mtp_step35_heads``.

    ``num_layers`` / ``mtp_num_layers``: the ``--num-layers`` / ``--mtp-num-layers`` the user
    gave, if any (megatron's validation replaces them with the pattern's counts, warning);
    ``num_layers`` must be the pattern's layer count (megatron's meaning) or its attention count
    (the GPT entry's), ``mtp_num_layers`` the pattern's depths where it has some. Raises
    ValueError naming the flag for what is not built: a symbol other than ``* - E |``, a depth
    other than ``/*-``, an ``E`` / ``-`` other than its GPT layer's (``--num-experts``,
    ``--moe-layer-freq``), another ``--num-layers`` or ``--mtp-num-layers``, ``--spec``.
    """
    from megatron.training.argument_utils import hybrid_config_from_args

    from mcore_ext.megatron_lm.arguments import transformer_config_from_args

    pattern = args.hybrid_layer_pattern
    main, *depths = pattern.split(MTP)
    attention = main.count(ATTENTION)
    if depths and mtp_num_layers is not None and mtp_num_layers != len(depths):
        raise ValueError(  # megatron warns, and builds the pattern's depths
            f"--mtp-num-layers {mtp_num_layers} disagrees with --hybrid-layer-pattern "
            f"{pattern!r}: {len(depths)} MTP depth{'s' * (len(depths) > 1)} ('{MTP}'); give "
            f"--mtp-num-layers {len(depths)} or leave it out, or give the pattern without its "
            f"depths ({main!r}) with --mtp-num-layers {mtp_num_layers}")
    if not depths and args.mtp_num_layers:
        pattern = main + (MTP + MTP_DEPTH) * args.mtp_num_layers
    flags = types.SimpleNamespace(num_layers=attention, num_moe_experts=args.num_experts,
                                  moe_layer_freq=args.moe_layer_freq,
                                  mtp_num_layers=args.mtp_num_layers)
    try:  # the symbols first: megatron reads MLA from the pattern
        check_hybrid_pattern(pattern, flags)
    except ValueError as err:  # in the flags' words
        message = str(err).replace(
            f"hybrid_layer_pattern={pattern!r}", f"--hybrid-layer-pattern {pattern!r}")
        for field, flag in (("use architecture gpt", "leave out --hybrid-layer-pattern"),
                            ("the config makes", "the flags make"),
                            ("num_moe_experts ", "--num-experts "),
                            ("moe_layer_freq ", "--moe-layer-freq "),
                            ("mtp_num_layers is", "--mtp-num-layers is")):
            message = message.replace(field, flag)
        raise ValueError(message) from None
    if num_layers is not None and num_layers not in (args.num_layers, attention):
        raise ValueError(
            f"--num-layers {num_layers} disagrees with --hybrid-layer-pattern {pattern!r}: "
            f"{args.num_layers} layers, {attention} of them attention ('*', the GPT layers); "
            f"give --num-layers {args.num_layers} or {attention}, or leave it out")
    if getattr(args, "spec", None):
        raise ValueError(
            f"--spec {' '.join(args.spec)} would replace mcore_ext's hybrid stack spec: leave it "
            "out and pick the backend with --mcore-ext-backend")
    # The transformer of the GPT layers, built as the GPT entry builds it: not megatron's
    # is_hybrid_model (set for a pattern), whose output-layer init scales by the layer count
    # without GPT's factor 2 -- with num_layers counting GPT layers it would differ from GPT's.
    gpt_args = copy.copy(args)
    gpt_args.num_layers, gpt_args.hybrid_layer_pattern = attention, None
    hybrid_args = copy.copy(args)
    hybrid_args.hybrid_layer_pattern = pattern  # with the MTP depths
    config = hybrid_config_from_args(
        hybrid_args, config=transformer_config_from_args(gpt_args),
        model_config_cls=GatedHybridModelConfig,
    )
    config.mcore_ext_backend = getattr(args, "mcore_ext_backend", "auto")
    _check(config)
    return config
