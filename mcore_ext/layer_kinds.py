"""Layers of several kinds in one megatron block (Step-3.5: full and sliding-window attention).

megatron's TransformerBlock hands one config to every layer (or, for heterogeneous blocks, asks
``config.get_config_for_layer``). ``KindTransformerLayer`` is megatron's TransformerLayer built
with its own layer's config, whatever the block passes, plus the two things a per-layer config
cannot express:

- RoPE of its kind: GPTModel computes one rotary embedding (the full layers' base and fraction)
  for all layers; a layer whose kind has another base or fraction uses its kind's (one
  embedding per kind, shared by its layers).
- HF's SwiGLU clamp (mcore_ext.swiglu_clamp): on a dense layer its MLP's, on a MoE layer its
  routed experts' and its shared expert's (mcore_ext.moe).

Neither adds parameters, so checkpoint keys are megatron's.
"""

import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from mcore_ext import moe
from mcore_ext.swiglu_clamp import clamp_swiglu_mlp


class KindTransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer`` built with ``layer_config`` (its kind's config).

    ``model_rotary`` is the (base, fraction) of the rotary embedding GPTModel passes in; when
    ``layer_config`` has another, this layer computes its own. ``swiglu_limit`` clamps its dense
    MLP, or on a MoE layer its shared expert; ``moe_expert_swiglu_limit`` its routed experts.
    """

    def __init__(self, config, submodules, *args, layer_config=None,
                 model_rotary: Optional[tuple] = None, swiglu_limit: Optional[float] = None,
                 moe_expert_swiglu_limit: Optional[float] = None, **kwargs):
        layer_config = layer_config if layer_config is not None else config
        super().__init__(layer_config, submodules, *args, **kwargs)
        self.kind_rotary_pos_emb = None
        own_rotary = (float(layer_config.rotary_base), float(layer_config.rotary_percent))
        if model_rotary is not None and own_rotary != tuple(map(float, model_rotary)):
            self.kind_rotary_pos_emb = kind_rotary_embedding(layer_config)
        self.swiglu_limit = swiglu_limit
        self.moe_expert_swiglu_limit = moe_expert_swiglu_limit
        if isinstance(self.mlp, MoELayer):
            moe.clamp_moe_layer(self.mlp, moe_expert_swiglu_limit, swiglu_limit,
                                self.layer_number)
            moe.mark_expert_parameters(self.mlp)
        elif swiglu_limit:
            clamp_swiglu_mlp(self.mlp, swiglu_limit)

    def forward(self, *args, **kwargs):
        if self.config.window_size is not None and isinstance(
            getattr(self.self_attention, "core_attention", None), DotProductAttention
        ):
            _check_local_window_mask(kwargs.get("attention_mask"), self.config.window_size)
        if self.kind_rotary_pos_emb is not None:
            _refuse_model_cos_sin(kwargs, self.layer_number, self.config)
            emb = kwargs.get("rotary_pos_emb")
            if emb is not None:
                kwargs["rotary_pos_emb"] = self._kind_rotary_pos_emb(emb, kwargs)
        return super().forward(*args, **kwargs)

    def _kind_rotary_pos_emb(self, model_emb, kwargs):
        """This kind's embedding for the positions ``model_emb`` [s, 1, 1, dim] covers."""
        if isinstance(model_emb, tuple):  # (q, k) embeddings: megatron passes them for cross-attn
            raise NotImplementedError("per-kind RoPE does not support separate q / k embeddings")
        params = kwargs.get("packed_seq_params")
        packed = params is not None and params.qkv_format == "thd"
        seq_len = model_emb.size(0)
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1 and not packed:  # the model's embedding is this CP rank's slice of seq_len
            seq_len *= cp
        return self.kind_rotary_pos_emb(seq_len, packed_seq=packed)


# Precomputed RoPE tables GPTModel hands every layer instead of rotary_pos_emb on its fused-RoPE
# inference paths (flash_decode; flashinfer's fused RoPE of dynamic batching): the model's kind's.
_MODEL_COS_SIN_KWARGS = ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")


def _refuse_model_cos_sin(kwargs, layer_number, config) -> None:
    """A layer with its own RoPE given the model's cos / sin tables would rotate with the other
    kind's base and fraction, silently: refuse, naming what was passed."""
    given = [name for name in _MODEL_COS_SIN_KWARGS if kwargs.get(name) is not None]
    if given:
        raise NotImplementedError(
            f"layer {layer_number} has its own RoPE (rotary_base={config.rotary_base}, "
            f"rotary_percent={config.rotary_percent}) but was given the model's precomputed "
            f"{' / '.join(given)} (megatron's fused-RoPE inference: flash_decode or flashinfer's "
            "fused RoPE), which hold the other kind's: run inference without flash_decode and "
            "use_flashinfer_fused_rope"
        )


# One RotaryEmbedding per kind, shared by its layers: megatron caches RotaryEmbedding.forward in
# one class-level lru_cache(32) keyed by the instance, which one instance per layer thrashes once
# a model has more than 32 such layers (Step-3.5-Flash has 34 sliding ones). It holds no
# parameters or buffers, so sharing it changes no checkpoint key.
_KIND_ROTARY: dict = {}
_KIND_ROTARY_CP_GROUP: list = [None]  # the CP group the cached embeddings were made with


def kind_rotary_embedding(layer_config) -> RotaryEmbedding:
    """The rotary embedding of a layer kind (its base, fraction, head dim), shared by every layer
    of the kind while the parallel state lasts (an embedding keeps the CP group it was made in:
    a new group, after ``init_parallel`` again, starts a new set)."""
    cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    if _KIND_ROTARY_CP_GROUP[0] is not cp_group:
        _KIND_ROTARY.clear()
        _KIND_ROTARY_CP_GROUP[0] = cp_group
    key = (layer_config.kv_channels, float(layer_config.rotary_percent),
           bool(layer_config.rotary_interleaved), float(layer_config.rotary_base),
           bool(layer_config.use_cpu_initialization),
           torch.cuda.current_device() if torch.cuda.is_available() else None)
    if key not in _KIND_ROTARY:
        _KIND_ROTARY[key] = RotaryEmbedding(
            kv_channels=layer_config.kv_channels,
            rotary_percent=layer_config.rotary_percent,
            rotary_interleaved=layer_config.rotary_interleaved,
            rotary_base=layer_config.rotary_base,
            use_cpu_initialization=layer_config.use_cpu_initialization,
        )
    return _KIND_ROTARY[key]


def _check_local_window_mask(attention_mask, window_size):
    """megatron's DotProductAttention replaces any attention mask by its window mask: refuse a
    mask that hides a key the window shows (padding), rather than ignore it."""
    if attention_mask is None:
        return
    sq, sk = attention_mask.shape[-2:]
    q_pos = torch.arange(sk - sq, sk, device=attention_mask.device).unsqueeze(1)
    k_pos = torch.arange(sk, device=attention_mask.device).unsqueeze(0)
    in_window = (k_pos <= q_pos + window_size[1]) & (k_pos >= q_pos - window_size[0])
    if (attention_mask.bool() & in_window).any():
        raise NotImplementedError(
            "the 'local' backend applies a sliding window by replacing the attention mask, so "
            "a padding mask inside the window would be ignored: use the 'sdpa' backend"
        )


def kind_layer_spec(layer_spec: ModuleSpec, model_config, layer_number: int) -> ModuleSpec:
    """``layer_spec`` (a TransformerLayer spec) as a ``KindTransformerLayer`` of global layer
    ``layer_number`` (1-based) of ``model_config``."""
    if layer_spec.module is not TransformerLayer:
        raise NotImplementedError(
            f"layer_types / swiglu_limits need megatron's TransformerLayer, got {layer_spec.module}"
        )
    params = dict(layer_spec.params or {})
    params.update(
        layer_config=model_config.get_config_for_layer(layer_number),
        model_rotary=(model_config.rotary_base, model_config.rotary_percent),
        swiglu_limit=model_config.swiglu_limit(layer_number),
        moe_expert_swiglu_limit=model_config.moe_expert_swiglu_limit(layer_number),
    )
    return dataclasses.replace(layer_spec, module=KindTransformerLayer, params=params)
