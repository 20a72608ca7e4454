"""``GatedGPTModelProvider``: Megatron-Bridge's GPT provider building mcore_ext's GPT.

Bridge's provider *is* the TransformerConfig, with megatron's ``__post_init__`` deferred to
``finalize()``; mixing in ``GatedTransformerConfig`` puts the gate and Step-3.5 fields on it.
Bridge's ``finalize()`` calls megatron's ``__post_init__`` by name, so
``GatedTransformerConfig.__post_init__`` never runs in this MRO: ``finalize()`` here runs
mcore_ext's checks and derived fields itself (``_mcore_ext_post_init``).
"""

from dataclasses import dataclass
from typing import Literal, Optional

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.training.vocab_utils import calculate_padded_vocab_size

from mcore_ext.config import GatedTransformerConfig
from mcore_ext.models import build_gpt_model
from mcore_ext.models.gpt import BUILT_GPT_SETTINGS, refuse_unbuilt_settings
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
        """The sliding layers' config, finalized: ``dataclasses.replace`` makes a provider,
        whose ``__init__`` defers every check to ``finalize()``."""
        fresh = "_sliding_config" not in self.__dict__
        config = super().sliding_config()
        if fresh:
            config.finalize()
        return config

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """One model stage, built by ``mcore_ext.build_gpt_model`` (vocabulary padded as
        Bridge's ``provide`` pads it)."""
        _check(self)
        if self.vocab_size is None:
            raise ValueError("GatedGPTModelProvider.vocab_size must be set before provide()")
        vocab_size = self.vocab_size
        if self.should_pad_vocab:
            vocab_size = calculate_padded_vocab_size(
                vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size
            )
        pg = self._pg_collection
        vp_size = self.virtual_pipeline_model_parallel_size
        if pre_process is None and pg is not None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and \
                is_pp_first_stage(pg.pp)
        if post_process is None and pg is not None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and \
                is_pp_last_stage(pg.pp)
        self._vp_stage = vp_stage
        return build_gpt_model(
            self,
            vocab_size=vocab_size,
            max_sequence_length=self.seq_length,
            backend=self.mcore_ext_backend,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
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

