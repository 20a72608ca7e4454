"""GPT layer specs with the head-wise gated attention, for every attention backend.

Each spec is megatron-core's own (``get_gpt_layer_local_spec`` or
``get_gpt_layer_with_transformer_engine_spec``) with only the slots that change swapped:
``self_attention.module`` when the gate is on, ``core_attention`` for the SDPA backend.
"""

import dataclasses
import enum
import importlib.util
import logging

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mcore_ext import _mcore_compat
from mcore_ext.attention.gated import HeadWiseGatedSelfAttention
from mcore_ext.attention.sdpa import SDPAttention
from mcore_ext.grouped_experts import GroupedGemmSequentialMLP
from mcore_ext.layer_kinds import kind_layer_spec
from mcore_ext.moe import is_moe_layer
from mcore_ext.mtp_layers import get_mtp_block_spec
from mcore_ext.norm import TorchNorm

logger = logging.getLogger(__name__)


class AttentionBackend(str, enum.Enum):
    """Where core attention and the linear layers come from."""

    AUTO = "auto"  # Transformer Engine on a GPU when installed, otherwise SDPA
    SDPA = "sdpa"  # torch scaled_dot_product_attention + megatron's local linears (CPU and GPU)
    LOCAL = "local"  # megatron's own DotProductAttention + local linears (GPU)
    TE = "te"  # Transformer Engine


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_backend(backend: str | AttentionBackend = "auto") -> AttentionBackend:
    """Turn a user's backend choice into a concrete backend, with a clear error for a bad one."""
    try:
        backend = AttentionBackend(backend)
    except ValueError:
        choices = ", ".join(repr(b.value) for b in AttentionBackend)
        raise ValueError(f"backend={backend!r} is not one of {choices}") from None
    if backend is AttentionBackend.AUTO:
        on_gpu_with_te = torch.cuda.is_available() and transformer_engine_available()
        backend = AttentionBackend.TE if on_gpu_with_te else AttentionBackend.SDPA
        logger.info("attention backend 'auto' resolved to %r", backend.value)
        return backend
    if backend is AttentionBackend.TE and not transformer_engine_available():
        raise ImportError(
            "backend='te' needs Transformer Engine: pip install 'mcore_ext[te]', "
            "or use backend='sdpa'"
        )
    return backend


def get_gpt_layer_spec(
    config: TransformerConfig, backend: str = "auto", moe: bool | None = None
) -> ModuleSpec:
    """The transformer layer spec for ``config`` on ``backend`` ("auto", "sdpa", "local", "te").

    With ``config.head_wise_attn_gate`` on, self-attention is ``HeadWiseGatedSelfAttention``.
    "sdpa" swaps in SDPA core attention; "sdpa", and "local" without Apex, swap in norms that
    work with sequence parallelism. Otherwise the spec is megatron-core's unchanged. ``moe``:
    a MoE layer (megatron's MoELayer) or a dense one; None = MoE when ``num_moe_experts`` is set.
    """
    backend = resolve_backend(backend)
    if backend is AttentionBackend.LOCAL and config.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size} needs backend 'sdpa' or 'te': "
            "megatron's local DotProductAttention has no context parallelism"
        )
    options = dict(
        num_experts=config.num_moe_experts if moe is not False else None,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=config.qk_l2_norm,
    )
    if backend is AttentionBackend.TE:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization, **options)

    layer = spec.submodules
    if backend is not AttentionBackend.TE and options["num_experts"] and config.moe_grouped_gemm:
        # megatron's local backend ignores moe_grouped_gemm (SequentialMLP): the same experts,
        # run as one grouped GEMM per linear layer (mcore_ext.grouped_experts)
        layer = dataclasses.replace(layer, mlp=_mcore_compat.replace_experts_module(
            layer.mlp, SequentialMLP, GroupedGemmSequentialMLP))
    attention = layer.self_attention
    if getattr(config, "head_wise_attn_gate", False):
        attention = dataclasses.replace(attention, module=HeadWiseGatedSelfAttention)
    if backend is AttentionBackend.SDPA:
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention),
        )
    if backend is not AttentionBackend.TE:
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(
                attention.submodules, **_portable_norms(attention.submodules, backend)
            ),
        )
        layer = dataclasses.replace(layer, **_portable_norms(layer, backend))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention))


def get_gpt_block_spec(
    config: TransformerConfig, backend: str = "auto", vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder block spec for ``GPTModel(transformer_layer_spec=...)``.

    Same layers as ``get_gpt_layer_spec`` on this pipeline stage, plus the final norm of the
    backend (megatron's default final norm, without Apex, refuses sequence parallelism). With
    ``layer_types`` or ``swiglu_limits`` in the config, each layer is a ``KindTransformerLayer``
    with its global layer's config (kinds count global layer numbers, so every pipeline stage
    builds its own layers' kinds). With ``num_moe_experts``, the layers ``moe_layer_freq`` marks
    are megatron's MoELayer and the others dense (mcore_ext.moe).
    """
    backend = resolve_backend(backend)
    final_norm = _final_norm(backend)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    per_layer = ("layer_types", "swiglu_limits", "moe_expert_swiglu_limits", "num_moe_experts")
    if all(getattr(config, field, None) is None for field in per_layer):
        layer_specs = [get_gpt_layer_spec(config, backend)] * num_layers
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        kind_specs = {}  # one layer spec per (kind config, MoE or dense)
        layer_specs = []
        for number in range(offset + 1, offset + num_layers + 1):
            layer_config = config.get_config_for_layer(number)
            key = (id(layer_config), is_moe_layer(config, number))
            if key not in kind_specs:
                kind_specs[key] = get_gpt_layer_spec(layer_config, backend, moe=key[1])
            layer_specs.append(kind_layer_spec(kind_specs[key], config, number))
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm)


def get_gpt_mtp_block_spec(config: TransformerConfig, backend: str = "auto",
                           vocab_size: int | None = None):
    """The MTP block spec for ``GPTModel(mtp_block_spec=...)`` (None without mtp_num_layers).

    Depth k is megatron's MTP layer (Step-3.5's with ``mtp_step35_heads``, whose own output head
    needs ``vocab_size``, the model's padded vocabulary) around a layer of global layer
    ``num_layers + k + 1``'s kind; its norms are the final norm's class of the backend (TorchNorm
    without Apex / TE: zero-centered gamma and sequence parallelism work).
    """
    backend = resolve_backend(backend)
    if getattr(config, "mtp_step35_heads", False) and config.mtp_num_layers and not vocab_size:
        raise ValueError("mtp_step35_heads=True builds an output head per depth: give vocab_size")
    if backend is AttentionBackend.TE:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as eh_proj
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear as eh_proj
    return get_mtp_block_spec(
        # Step-3.5's MTP layers are dense, also in a MoE model.
        config, lambda layer_config: get_gpt_layer_spec(layer_config, backend, moe=False),
        _final_norm(backend), eh_proj, vocab_size,
    )


def _final_norm(backend: AttentionBackend):
    """The backend's norm outside layers (megatron's default, without Apex, refuses sequence
    parallelism and zero-centered gamma: TorchNorm instead)."""
    return {
        AttentionBackend.SDPA: TorchNorm,
        AttentionBackend.LOCAL: (
            TorchNorm if gpt_layer_specs.LNImpl is WrappedTorchNorm else gpt_layer_specs.LNImpl
        ),
        AttentionBackend.TE: _mcore_compat.TENorm,
    }[backend]


_NORM_SLOTS = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm")


def _portable_norms(submodules, backend: AttentionBackend) -> dict:
    """Norm slots that get TorchNorm (which works with sequence parallelism).

    sdpa: every norm class (it runs without fused kernels). local: megatron's WrappedTorchNorm,
    its fallback when Apex is missing, which refuses sequence parallelism; Apex's FusedLayerNorm
    stays. IdentityOp and L2Norm slots stay.
    """
    replaced = (WrappedTorchNorm, FusedLayerNorm) if backend is AttentionBackend.SDPA else (
        WrappedTorchNorm,)
    return {
        slot: TorchNorm
        for slot in _NORM_SLOTS
        if hasattr(submodules, slot) and getattr(submodules, slot) in replaced
    }
