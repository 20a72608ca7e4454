"""``Step35Config`` <-> megatron's ``GatedTransformerConfig`` fields.

``transformer_config_fields`` is what ``load_pretrained``, ``hf import`` and the Bridge build a
model from; ``fields_from_transformer_config`` describes a megatron model for ``save_pretrained``
and ``hf export``, refusing (all at once, by field and value) what the Step-3.5 layout cannot
hold, including settings that change the function without a weight to show it.
"""

import math
from typing import Optional

import torch

from mcore_ext.hf.config.base import DENSE, FULL, SLIDING, SPARSE, HFConfigError


def transformer_config_fields(spec) -> dict:
    """``GatedTransformerConfig`` fields of ``spec`` (a ``Step35Config``; parallel sizes and
    dtypes left out)."""
    # Per-layer lists cover the MTP layers too (their entries last), as in config.json.
    all_types = list(spec.layer_types) + list(spec.mtp_layer_types)
    kinds = set(all_types)
    sliding = SLIDING in kinds
    fields = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        head_wise_attn_gate=True,
        head_wise_attn_gate_init_bias=0.0,  # no gate bias rows to start (g_proj has no bias)
        add_bias_linear=False,
        add_qkv_bias=False,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_base=float(spec.rope_theta[FULL]) if FULL in kinds else 10000.0,
        rotary_percent=float(spec.partial_rotary_factor.get(FULL, 1.0)),
    )
    if spec.query_pre_attn_scalar not in (None, spec.head_dim):
        fields["softmax_scale"] = float(spec.query_pre_attn_scalar) ** -0.5
    if sliding:
        fields.update(
            layer_types=all_types,
            sliding_window=int(spec.sliding_window),
            sliding_rotary_base=float(spec.rope_theta.get(SLIDING, fields["rotary_base"])),
            sliding_rotary_percent=float(spec.partial_rotary_factor.get(
                SLIDING, fields["rotary_percent"])),
        )
        if kinds == {SLIDING}:  # no full layer: the full-layer values are unused
            fields["rotary_base"] = fields["sliding_rotary_base"]
            fields["rotary_percent"] = fields["sliding_rotary_percent"]
        if spec.num_sliding_heads not in (None, spec.num_heads):
            fields["sliding_num_attention_heads"] = spec.num_sliding_heads
        if spec.num_sliding_kv_heads not in (None, spec.num_kv_heads):
            fields["sliding_num_query_groups"] = spec.num_sliding_kv_heads
    limits = list(spec.swiglu_limits) + list(spec.mtp_swiglu_limits)
    if any(limits):
        fields["swiglu_limits"] = limits
    if spec.num_mtp_layers:
        fields["mtp_num_layers"] = spec.num_mtp_layers
    if spec.is_moe:
        fields.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_top_k,
            moe_ffn_hidden_size=spec.moe_intermediate_size,
            moe_shared_expert_intermediate_size=spec.share_expert_dim,
            moe_layer_freq=[int(spec.is_sparse(i)) for i in range(spec.num_layers)],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=(None if spec.moe_router_scaling_factor == 1.0
                                            else spec.moe_router_scaling_factor),
            moe_router_dtype="fp32" if spec.router_fp32 else None,
        )
        if any(spec.expert_swiglu_limits):
            fields["moe_expert_swiglu_limits"] = list(spec.expert_swiglu_limits)
    return fields


def fields_from_transformer_config(
    config, *, vocab_size: int, max_position_embeddings: int,
    share_embeddings: bool = False, position_embedding_type: str = "rope", extra=None,
    rope_scaling: bool = False, seq_len_interpolation_factor: Optional[float] = None,
) -> dict:
    """``Step35Config`` fields describing a megatron model, or ``HFConfigError`` naming what the
    layout cannot hold. ``rope_scaling`` / ``seq_len_interpolation_factor``: the GPTModel's
    (they are not config fields)."""
    problems = []

    def need(ok, what):
        if not ok:
            problems.append(what)

    need(getattr(config, "head_wise_attn_gate", False),
         "head_wise_attn_gate=False (Step-3.5 has a g_proj gate on every layer)")
    need(config.normalization == "RMSNorm", f"normalization={config.normalization!r} "
         "(Step-3.5 uses RMSNorm)")
    need(config.layernorm_zero_centered_gamma, "layernorm_zero_centered_gamma=False "
         "(Step-3.5's norms compute x * (1 + w))")
    need(config.qk_layernorm, "qk_layernorm=False (Step-3.5 has per-head q/k norms)")
    need(not config.add_bias_linear, "add_bias_linear=True (Step-3.5 has no linear biases)")
    need(not config.add_qkv_bias, "add_qkv_bias=True (Step-3.5 has no QKV or gate bias)")
    need(config.gated_linear_unit, "gated_linear_unit=False (Step-3.5's MLP is SwiGLU)")
    act = getattr(config.activation_func, "__name__", str(config.activation_func))
    need(act == "silu", f"activation_func={act} (Step-3.5's MLP is SwiGLU: silu)")
    if config.num_moe_experts:
        _check_megatron_moe(config, need)
    need(getattr(config, "mtp_step35_heads", True), "mtp_step35_heads=False (Step-3.5's MTP "
         "layers have their own output head and norm)")
    need(position_embedding_type == "rope", f"position_embedding_type="
         f"{position_embedding_type!r} (Step-3.5 uses RoPE)")
    need(not getattr(config, "multi_latent_attention", False), "multi_latent_attention=True")
    need(not config.attention_output_gate, "attention_output_gate=True (a head_dim-wide "
         "gate; Step-3.5's g_proj has one scalar per head)")
    need(getattr(config, "activation_func_clamp_value", None) is None,
         "activation_func_clamp_value (megatron's pre-activation clamp is not Step-3.5's)")
    # Fields that change the function without a weight to show it (getattr: releases before
    # 0.19 lack some of them, and then they are off).
    need(not getattr(config, "rotary_interleaved", False), "rotary_interleaved=True "
         "(Step-3.5 rotates the two halves of each head, not interleaved pairs)")
    need(getattr(config, "window_size", None) is None,
         f"window_size={getattr(config, 'window_size', None)} (one window on every layer; "
         "the layout's windows belong to layer kinds: layer_types + sliding_window)")
    need(not getattr(config, "qk_l2_norm", False), "qk_l2_norm=True (Step-3.5's q/k norms "
         "are RMSNorms with weights)")
    no_rope = getattr(config, "no_rope_freq", None)
    need(not no_rope or not any(no_rope if isinstance(no_rope, list) else [no_rope]),
         f"no_rope_freq={no_rope!r} (layers without RoPE; every Step-3.5 layer has RoPE)")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    need(softmax_type == "vanilla", f"softmax_type={softmax_type!r} (Step-3.5's softmax "
         "is vanilla: no sink term)")
    need(not getattr(config, "use_mup", False), "use_mup=True (muP's embedding / output "
         "multipliers are not part of the layout)")
    need(getattr(config, "experimental_attention_variant", None) is None,
         f"experimental_attention_variant="
         f"{getattr(config, 'experimental_attention_variant', None)!r}")
    need(not rope_scaling, "rope_scaling=True (llama-3 RoPE scaling; the layout's RoPE is "
         "unscaled)")
    need(seq_len_interpolation_factor is None,
         f"seq_len_interpolation_factor={seq_len_interpolation_factor} (the layout's RoPE is "
         "unscaled)")
    if problems:
        raise HFConfigError(
            "this model cannot be written in the Step-3.5 layout: " + "; ".join(problems)
        )
    del share_embeddings  # an untied lm_head holds a tied model exactly (a copy)

    n = config.num_layers
    m = int(getattr(config, "mtp_num_layers", None) or 0)
    all_types = getattr(config, "layer_types", None)
    if all_types is None:
        all_types = [FULL] * (n + m)
    elif len(all_types) == n:  # the MTP layers follow Step's rule: sliding
        all_types = list(all_types) + [SLIDING] * m
    layer_types = list(all_types[:n])
    sliding_base = getattr(config, "sliding_rotary_base", None)
    sliding_pct = getattr(config, "sliding_rotary_percent", None)
    rotary_base = float(getattr(config, "rotary_base", 10000.0))
    rotary_pct = float(getattr(config, "rotary_percent", 1.0))
    default_scale = config.kv_channels ** -0.5
    scale = config.softmax_scale
    scalar = None
    if scale is not None and not math.isclose(scale, default_scale, rel_tol=1e-12):
        scalar = 1.0 / (scale * scale)
    limits = list(getattr(config, "swiglu_limits", None) or [None] * n)
    limits += [None] * (n + m - len(limits))
    moe = _moe_from_megatron(config) if config.num_moe_experts else {}
    return dict(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_layers=n,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_query_groups,
        head_dim=config.kv_channels,
        layer_types=layer_types,
        num_sliding_heads=getattr(config, "sliding_num_attention_heads", None),
        num_sliding_kv_heads=getattr(config, "sliding_num_query_groups", None),
        sliding_window=getattr(config, "sliding_window", None),
        rope_theta={FULL: rotary_base,
                    SLIDING: float(sliding_base) if sliding_base else rotary_base},
        partial_rotary_factor={FULL: rotary_pct,
                               SLIDING: float(sliding_pct) if sliding_pct else rotary_pct},
        swiglu_limits=[(float(x) if x else None) for x in limits[:n]],
        rms_norm_eps=config.layernorm_epsilon,
        query_pre_attn_scalar=scalar,
        max_position_embeddings=max_position_embeddings,
        extra=dict(extra or {}),
        num_mtp_layers=m,
        mtp_layer_types=list(all_types[n:]),
        mtp_swiglu_limits=[(float(x) if x else None) for x in limits[n:]],
        **moe,
    )


def _check_megatron_moe(config, need) -> None:
    """The megatron MoE settings the Step-3.5 layout cannot hold, appended to ``need``'s list."""
    score = config.moe_router_score_function
    need(score == "sigmoid", f"moe_router_score_function={score!r} (Step-3.5's router is sigmoid)")
    need(config.moe_router_enable_expert_bias, "moe_router_enable_expert_bias=False (Step-3.5's "
         "router has an fp32 expert bias)")
    need(config.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size="
         "None (Step-3.5's MoE layers have a shared expert)")
    need(not getattr(config, "moe_shared_expert_gate", False), "moe_shared_expert_gate=True")
    need(config.moe_router_dtype in (None, "fp32"), f"moe_router_dtype="
         f"{config.moe_router_dtype!r} (need_fp32_gate is fp32 or the weights' dtype)")
    for key in ("moe_router_num_groups", "moe_router_group_topk"):
        need(not getattr(config, key, None), f"{key}={getattr(config, key)} (group-limited "
             "routing)")
    topk = config.moe_router_topk
    need(topk > 1, f"moe_router_topk={topk} (megatron renormalises only when top-k > 1; "
         "Step-3.5 always does)")


def megatron_moe_layers(config) -> list[bool]:
    """Which main layers of a megatron config are MoE (its ``moe_layer_freq``: a list or an
    every-N-layers int)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def _moe_from_megatron(config) -> dict:
    limits = list(getattr(config, "moe_expert_swiglu_limits", None) or [])
    limits = (limits + [None] * config.num_layers)[:config.num_layers]
    scale = config.moe_router_topk_scaling_factor
    return dict(
        mlp_layer_types=[SPARSE if x else DENSE for x in megatron_moe_layers(config)],
        num_experts=config.num_moe_experts,
        moe_top_k=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        share_expert_dim=config.moe_shared_expert_intermediate_size,
        moe_router_scaling_factor=float(scale) if scale is not None else 1.0,
        router_fp32=config.moe_router_dtype == "fp32",
        expert_swiglu_limits=[(float(x) if x else None) for x in limits],
    )
