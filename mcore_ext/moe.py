"""Mixture-of-experts layers on megatron-core's own MoE (Step-3.5-Flash).

Layers that ``moe_layer_freq`` marks are megatron's ``MoELayer`` (``TopKRouter``, the allgather /
alltoall token dispatchers, ``SequentialMLP`` experts on the local / sdpa backends, the shared
expert); the others are dense. This module adds only what megatron cannot express:

- which global layers are MoE, for the per-layer block spec (``is_moe_layer``);
- HF's SwiGLU clamp ``silu(gate).clamp(max=L) * up.clamp(-L, L)`` per layer, separately for the
  routed experts (``moe_expert_swiglu_limits``) and the shared expert (``swiglu_limits``), set
  on each expert module's own copy of its config so that no layer or expert kind sees another's
  (``clamp_moe_layer``, for sequential and grouped experts alike; megatron's
  ``activation_func_clamp_value`` is another function, and TEGroupedMLP shares one config
  between all layers);
- the experts' parameters marked expert-parallel at EP 1 too, so the optimizer (and its
  checkpoint) has the same structure at every EP size (``mark_expert_parameters``);
- validation naming fields and values (``validate_moe_fields`` / ``validate_moe_clamps``).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from mcore_ext.swiglu_clamp import clamp_swiglu_mlp

TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
ROUTER_DTYPES = (None, "fp32", "fp64")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def moe_layer_pattern(config) -> Optional[list[int]]:
    """One 0 (dense) / 1 (MoE) per main layer, as megatron reads ``moe_layer_freq``; None without
    experts."""
    if not getattr(config, "num_moe_experts", None):
        return None
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return [int(v) for v in freq]


def is_moe_layer(config, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) is MoE. Layers past ``num_layers`` (MTP)
    are dense."""
    pattern = moe_layer_pattern(config)
    return pattern is not None and layer_number <= len(pattern) and bool(pattern[layer_number - 1])


def validate_moe_fields(config) -> None:
    """Check megatron's MoE fields before megatron's own asserts, naming field and value."""
    experts = config.num_moe_experts
    ep = config.expert_model_parallel_size
    if experts is None:
        if config.moe_expert_swiglu_limits is not None and any(config.moe_expert_swiglu_limits):
            raise ValueError(
                f"moe_expert_swiglu_limits={config.moe_expert_swiglu_limits} clamps routed experts: "
                "it needs num_moe_experts"
            )
        if ep > 1:
            raise ValueError(f"expert_model_parallel_size={ep} needs num_moe_experts")
        return
    if experts < 1:
        raise ValueError(f"num_moe_experts={experts} must be at least 1")
    if ep < 1 or experts % ep:
        raise ValueError(
            f"expert_model_parallel_size={ep} must divide num_moe_experts={experts}"
        )
    topk = config.moe_router_topk
    if not 1 <= topk <= experts:
        raise ValueError(f"moe_router_topk={topk} must be in [1, num_moe_experts={experts}]")
    freq = config.moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise ValueError(f"moe_layer_freq={freq!r} must be an int or a list of 0 / 1 per layer")
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"moe_layer_freq={freq} must be at least 1")
    if isinstance(freq, list):
        if len(freq) != config.num_layers:
            raise ValueError(
                f"moe_layer_freq has {len(freq)} entries, num_layers is {config.num_layers}: give "
                "one 0 (dense) / 1 (MoE) per main layer (MTP layers are always dense)"
            )
        bad = [v for v in freq if v not in (0, 1)]
        if bad:
            raise ValueError(f"moe_layer_freq={freq}: entry {bad[0]!r} is not 0 or 1")
    if config.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_router_score_function={config.moe_router_score_function!r} is not one of "
            f"{SCORE_FUNCTIONS}"
        )
    if config.moe_router_enable_expert_bias and config.moe_router_score_function == "softmax":
        raise ValueError(
            "moe_router_enable_expert_bias=True needs moe_router_score_function 'sigmoid' or "
            f"'sqrtsoftplus', got {config.moe_router_score_function!r}"
        )
    if config.moe_router_dtype not in ROUTER_DTYPES:
        raise ValueError(
            f"moe_router_dtype={config.moe_router_dtype!r} is not one of {ROUTER_DTYPES}"
        )
    if config.moe_router_bias_update_rate < 0:
        raise ValueError(
            f"moe_router_bias_update_rate={config.moe_router_bias_update_rate} must be >= 0"
        )
    if config.moe_router_topk_scaling_factor is not None and config.moe_router_topk_scaling_factor <= 0:
        raise ValueError(
            f"moe_router_topk_scaling_factor={config.moe_router_topk_scaling_factor} must be > 0"
        )
    dispatcher = config.moe_token_dispatcher_type
    if dispatcher not in TOKEN_DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type={dispatcher!r} is not one of {TOKEN_DISPATCHERS}"
        )
    if dispatcher == "flex" and not torch.cuda.is_available():
        raise ValueError(
            "moe_token_dispatcher_type='flex' needs DeepEP / HybridEP on GPUs: use 'allgather' or "
            "'alltoall' on a CPU"
        )
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:
        raise ValueError(f"moe_shared_expert_intermediate_size={shared} must be at least 1 (None = "
                         "no shared expert)")
    if shared is not None and config.add_bias_linear:
        raise ValueError(
            f"moe_shared_expert_intermediate_size={shared} with add_bias_linear=True: megatron's "
            "shared expert has no bias; set add_bias_linear=False"
        )


def validate_moe_clamps(config) -> None:
    """Check ``moe_expert_swiglu_limits`` and refuse megatron's clamp where it would be dropped or
    mixed with HF's (after megatron's __post_init__: gated_linear_unit etc. are final)."""
    limits = config.moe_expert_swiglu_limits
    has_hf_clamp = bool(limits and any(limits)) or bool(
        config.swiglu_limits and any(config.swiglu_limits)
    )
    if limits is not None:
        allowed = {config.num_layers, config.num_layers + (config.mtp_num_layers or 0)}
        if len(limits) not in allowed:
            raise ValueError(
                f"moe_expert_swiglu_limits has {len(limits)} entries, num_layers is "
                f"{config.num_layers} (mtp_num_layers {config.mtp_num_layers}): give one per "
                "layer (None or 0 = no clamp)"
            )
        bad = [v for v in limits if v is not None and v < 0]
        if bad:
            raise ValueError(f"moe_expert_swiglu_limits={limits}: {bad[0]} is negative")
        if any(limits) and (not config.gated_linear_unit or config.activation_func is not F.silu):
            raise ValueError(
                "moe_expert_swiglu_limits clamps SwiGLU experts: it needs gated_linear_unit=True "
                "and activation_func=silu"
            )
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        if has_hf_clamp:
            raise ValueError(
                f"activation_func_clamp_value={clamp} (megatron's clamp before the SiLU) together "
                "with swiglu_limits / moe_expert_swiglu_limits (HF's clamp after it): give the "
                "clamps as swiglu_limits / moe_expert_swiglu_limits only"
            )
        if config.bias_activation_fusion and config.activation_func is F.silu:
            raise ValueError(
                f"activation_func_clamp_value={clamp} with bias_activation_fusion=True: megatron's "
                "fused SwiGLU ignores the clamp; use swiglu_limits (HF's clamp), or "
                "bias_activation_fusion=False"
            )


def clamp_moe_layer(moe_layer, routed_limit: Optional[float], shared_limit: Optional[float],
                    layer_number: Optional[int] = None):
    """Give ``moe_layer``'s routed experts and shared expert HF's SwiGLU clamp, each on a private
    copy of its config, or refuse, naming the layer, an expert implementation that would drop
    it.

    Routed experts: ``SequentialMLP`` (and mcore_ext's grouped-GEMM form of it) clamp in each
    expert's MLP; megatron's grouped ``TEGroupedMLP`` applies ``self.activation_func`` to the
    whole fc1 output when its config has ``use_te_activation_func`` (before any fused kernel),
    so it gets the clamped SwiGLU there, on its own config copy (megatron hands one config to the
    grouped experts of every layer). Only Transformer Engine's op-fused grouped MLP
    (``use_transformer_engine_op_fuser``), whose SwiGLU has no clamp, is refused.
    """
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    where = f" (layer {layer_number})" if layer_number is not None else ""
    if routed_limit:
        experts = moe_layer.experts
        field = f"moe_expert_swiglu_limits{where}"
        if isinstance(experts, TEGroupedMLP):
            if getattr(experts, "_with_fused_impl", False):
                raise NotImplementedError(
                    f"{field}: Transformer Engine's op-fused grouped MLP "
                    "(use_transformer_engine_op_fuser=True) has no SwiGLU clamp; turn it off, "
                    "grouped experts then clamp exactly")
            clamp_swiglu_mlp(experts, routed_limit, field=field)
        elif isinstance(experts, SequentialMLP) and all(
            type(e) is MLP for e in experts.local_experts
        ):
            for expert in experts.local_experts:
                clamp_swiglu_mlp(expert, routed_limit, field=field)
        else:
            raise NotImplementedError(
                f"{field}: the routed experts are {type(experts).__name__}, whose activation "
                "cannot take HF's clamp; use SequentialMLP or TEGroupedMLP experts"
            )
    if shared_limit and moe_layer.shared_experts is not None:
        shared = moe_layer.shared_experts
        if type(shared) is not SharedExpertMLP:
            raise NotImplementedError(
                f"swiglu_limits{where} on a MoE layer clamps its shared expert, which is "
                f"{type(shared).__name__} here (a fused path would drop the clamp); use "
                "megatron's SharedExpertMLP"
            )
        if shared.config.moe_shared_expert_overlap:
            raise NotImplementedError(
                f"swiglu_limits{where} with moe_shared_expert_overlap=True is not supported"
            )
        clamp_swiglu_mlp(shared, shared_limit, field=f"swiglu_limits{where}")


def mark_expert_parameters(moe_layer) -> None:
    """Mark the routed experts' parameters as expert-parallel (``allreduce=False``) at every EP
    size, as megatron marks them only when expert_model_parallel_size > 1.

    megatron's DDP and optimizer group parameters by this mark: at EP > 1 the experts get their
    own gradient buffer (reduced over the expert-data-parallel group) and their own optimizer in
    a chain of two; at EP 1 they would join the dense ones, and the optimizer's checkpoint would
    have another structure, so an EP > 1 checkpoint could not resume at EP 1 with its optimizer
    state. At EP 1 (expert TP = TP) the expert-data-parallel group holds the same ranks as the
    data-parallel group, so gradients and updates are unchanged.
    """
    for param in moe_layer.experts.parameters():
        param.allreduce = False
