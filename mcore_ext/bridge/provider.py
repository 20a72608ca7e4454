"""``GatedGPTModelProvider`` and ``GatedHybridModelProvider``: Megatron-Bridge's GPT and hybrid
providers building mcore_ext's GPTModel and HybridModel.

Bridge's provider *is* the TransformerConfig, with megatron's ``__post_init__`` deferred to
``finalize()``; mixing in ``GatedTransformerConfig`` puts the gate and Step-3.5 fields on it.
Bridge's ``finalize()`` calls megatron's ``__post_init__`` by name, so
``GatedTransformerConfig.__post_init__`` never runs in this MRO: ``finalize()`` here runs
mcore_ext's checks and derived fields itself (``_mcore_ext_post_init``).

The architecture is the provider's class, as in Bridge (``GPTModelProvider`` /
``HybridModelProvider``, the parent of its ``MambaModelProvider``), the choice the launcher's
``model.architecture: gpt | hybrid`` makes: the same fields build either model, the same weights
compute the same logits. ``GatedHybridModelProvider.from_gpt`` makes the hybrid provider of a
configured GPT one.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.hybrid import HybridModelProvider
from megatron.bridge.models.transformer_config import TransformerConfig as BridgeTransformerConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.training.vocab_utils import calculate_padded_vocab_size

from mcore_ext.config import GatedTransformerConfig
from mcore_ext.models import build_gpt_model, build_hybrid_model
from mcore_ext.models.gpt import BUILT_GPT_SETTINGS, refuse_unbuilt_settings
from mcore_ext.models.hybrid import BUILT_HYBRID_SETTINGS, check_hybrid_pattern
from mcore_ext.specs import get_gpt_block_spec


def gated_block_spec(provider: "GatedGPTModelProvider", vp_stage: Optional[int] = None):
    """mcore_ext's block spec for ``provider`` on its ``mcore_ext_backend`` (the provider's
    ``transformer_layer_spec``; a module-level function, so configs that hold it pickle)."""
    return get_gpt_block_spec(provider, provider.mcore_ext_backend, vp_stage=vp_stage)


# GPTModelProvider values that build_gpt_model (RoPE from the config, megatron's defaults
# otherwise) does not implement, with the value it implements.
_IMPLEMENTED = {
    **BUILT_GPT_SETTINGS,
    "use_transformer_engine_full_layer_spec": False,
    "init_model_with_meta_device": False,
}


@dataclass
class GatedGPTModelProvider(GPTModelProvider, GatedTransformerConfig):
    """Bridge's ``GPTModelProvider`` that is also a ``GatedTransformerConfig`` and builds
    ``mcore_ext.build_gpt_model`` (mcore_ext's block spec, per-kind layers, Step-3.5 MTP).

    ``mcore_ext_backend``: "auto", "sdpa", "local" or "te" (see ``get_gpt_block_spec``; "sdpa"
    on a CPU). Call ``finalize()`` before ``provide()`` (Bridge's ConfigContainer.validate does):
    it runs megatron's checks, then mcore_ext's (gate, layer kinds, MTP), raising on a bad config.
    """

    mcore_ext_backend: str = "auto"
    transformer_layer_spec: object = gated_block_spec
    position_embedding_type: Literal["learned_absolute", "rope", "yarn"] = "rope"
    # GPTModelProvider declares these as int / its own default; GatedTransformerConfig's meaning.
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0

    def finalize(self) -> None:
        """Bridge's deferred megatron post-init, then mcore_ext's checks and derived fields."""
        super().finalize()
        self.__dict__.pop("_sliding_config", None)  # fields may have changed since the last one
        self._mcore_ext_post_init()
        _check(self)

    def sliding_config(self) -> GatedTransformerConfig:
        """The sliding layers' config, finalized (``_finalized_sliding_config``)."""
        return _finalized_sliding_config(self, super().sliding_config)

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """One model stage, built by ``mcore_ext.build_gpt_model`` (vocabulary padded as
        Bridge's ``provide`` pads it)."""
        _check(self)
        return build_gpt_model(self, **_stage(self, pre_process, post_process, vp_stage))


# HybridModelProvider values that build_hybrid_model does not implement, with the value it
# implements: megatron's layer allocation from ratios (mcore_ext derives the GPT layers' pattern),
# ModelOpt's stack, MTP.
_IMPLEMENTED_HYBRID = {
    **BUILT_HYBRID_SETTINGS,
    "hybrid_attention_ratio": 0.0,
    "hybrid_mlp_ratio": 0.0,
    "mtp_hybrid_override_pattern": None,
    "restore_modelopt_state": False,
}


@dataclass
class GatedHybridModelProvider(HybridModelProvider, GatedTransformerConfig):
    """Bridge's ``HybridModelProvider`` that is also a ``GatedTransformerConfig`` and builds
    ``mcore_ext.build_hybrid_model`` (megatron's HybridModel with mcore_ext's layers).

    ``num_layers`` counts the GPT layers (the pattern's attention symbols), as the launcher's
    ``model.architecture: hybrid`` and the Megatron-LM entry count them: every per-layer field
    (``layer_types``, ``swiglu_limits``, MoE layers) lists one value per GPT layer.
    ``hybrid_layer_pattern``: None builds the GPT layers' (``*-``, ``*E`` for a MoE layer);
    else megatron's ``* - E |`` with one ``*`` per GPT layer (Bridge's own ``finalize`` would
    set ``num_layers`` to every symbol: this one does not). ``mcore_ext_backend`` as
    ``GatedGPTModelProvider``'s. Call ``finalize()`` before ``provide()``.
    """

    mcore_ext_backend: str = "auto"
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "rope"
    # HybridModelProvider declares these as int / None; GatedTransformerConfig's meaning.
    rotary_base: float = 10000.0
    num_layers: int = 0

    @classmethod
    def from_gpt(cls, provider: GatedGPTModelProvider,
                 hybrid_layer_pattern: Optional[str] = None) -> "GatedHybridModelProvider":
        """The hybrid provider of ``provider``'s config: every field both declare, the GPT
        layers' pattern unless ``hybrid_layer_pattern`` is given. Not finalized. A provider with
        Bridge's pre-wrap hooks (``to_megatron_provider(load_weights=True)`` loads HF weights
        by GPTModel's parameter names there) is refused: its hooks would not load the hybrid
        model's weights."""
        if getattr(provider, "_pre_wrap_hooks", None):
            raise ValueError(
                f"{type(provider).__name__} has pre-wrap hooks (to_megatron_provider("
                "load_weights=True)): they load GPTModel's parameters; make the hybrid provider "
                "of a to_megatron_provider(load_weights=False) one (docs/bridge.md)")
        _check(provider)
        ours = {field.name for field in dataclasses.fields(cls) if field.init}
        fields = {field.name: getattr(provider, field.name)
                  for field in dataclasses.fields(provider)
                  if field.init and field.name in ours and field.name != "transformer_layer_spec"}
        return cls(**fields, hybrid_layer_pattern=hybrid_layer_pattern)

    def finalize(self) -> None:
        """Bridge's deferred megatron post-init (its ``TransformerConfig.finalize``, not
        ``HybridModelProvider.finalize``, which counts every symbol as a layer), then mcore_ext's
        checks and derived fields, and the pattern's."""
        if self.hybrid_override_pattern is not None:
            raise ValueError(
                f"hybrid_override_pattern={self.hybrid_override_pattern!r} is deprecated in "
                "Megatron-Bridge: set hybrid_layer_pattern")
        BridgeTransformerConfig.finalize(self)
        self.__dict__.pop("_sliding_config", None)  # fields may have changed since the last one
        self._mcore_ext_post_init()
        _check_hybrid(self)

    def sliding_config(self) -> GatedTransformerConfig:
        """The sliding layers' config, finalized (``_finalized_sliding_config``)."""
        return _finalized_sliding_config(self, super().sliding_config)

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> HybridModel:
        """One model stage, built by ``mcore_ext.build_hybrid_model`` (vocabulary padded and
        stages as ``GatedGPTModelProvider.provide``)."""
        _check_hybrid(self)
        return build_hybrid_model(self, **_stage(self, pre_process, post_process, vp_stage),
                                  hybrid_layer_pattern=self.hybrid_layer_pattern)


def _finalized_sliding_config(provider, sliding_config) -> GatedTransformerConfig:
    """``GatedTransformerConfig.sliding_config`` (``sliding_config``) of ``provider``, finalized
    when first made: ``dataclasses.replace`` makes a provider, whose ``__init__`` defers every
    check to ``finalize()``."""
    fresh = "_sliding_config" not in provider.__dict__
    config = sliding_config()
    if fresh:
        config.finalize()
    return config


def _stage(provider, pre_process, post_process, vp_stage) -> dict:
    """The build arguments of one model stage: the vocabulary padded as Bridge's ``provide``
    pads it, the stage ends from the provider's process groups (megatron's otherwise)."""
    if provider.vocab_size is None:
        raise ValueError(f"{type(provider).__name__}.vocab_size must be set before provide()")
    vocab_size = provider.vocab_size
    if provider.should_pad_vocab:
        vocab_size = calculate_padded_vocab_size(
            vocab_size, provider.make_vocab_size_divisible_by,
            provider.tensor_model_parallel_size
        )
    pg = provider._pg_collection
    vp_size = provider.virtual_pipeline_model_parallel_size
    if pre_process is None and pg is not None:
        pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and \
            is_pp_first_stage(pg.pp)
    if post_process is None and pg is not None:
        post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and \
            is_pp_last_stage(pg.pp)
    provider._vp_stage = vp_stage
    return dict(
        vocab_size=vocab_size,
        max_sequence_length=provider.seq_length,
        backend=provider.mcore_ext_backend,
        share_embeddings_and_output_weights=provider.share_embeddings_and_output_weights,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def _check(provider: GatedGPTModelProvider) -> None:
    if provider.transformer_layer_spec is not gated_block_spec:
        raise ValueError(
            f"transformer_layer_spec={provider.transformer_layer_spec!r} would replace mcore_ext's "
            "layer spec: leave it at its default and pick the backend with mcore_ext_backend"
        )
    refuse_unbuilt_settings(provider, _IMPLEMENTED)


def _check_hybrid(provider: GatedHybridModelProvider) -> None:
    """No stack spec of its own (mcore_ext's is built from the backend), the settings
    build_hybrid_model builds one way, a pattern it builds for the GPT layers (no MTP)."""
    if provider.hybrid_stack_spec is not None:
        raise ValueError(
            f"hybrid_stack_spec={provider.hybrid_stack_spec!r} would replace mcore_ext's hybrid "
            "stack spec: leave it None and pick the backend with mcore_ext_backend")
    refuse_unbuilt_settings(provider, _IMPLEMENTED_HYBRID)
    if provider.mtp_num_layers:
        raise ValueError(f"mtp_num_layers={provider.mtp_num_layers}: MTP is not built on "
                         "HybridModel yet (docs/known-gaps.md); use GatedGPTModelProvider")
    if provider.hybrid_layer_pattern is not None:
        check_hybrid_pattern(provider.hybrid_layer_pattern, provider)

