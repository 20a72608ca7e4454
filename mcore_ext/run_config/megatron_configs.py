"""Where the launcher's YAML fields become megatron-core's config objects (and nowhere else):
the model's for every reader of a launcher config, DDP's and the optimizer's for the launcher."""

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

from mcore_ext.config import GatedTransformerConfig
from mcore_ext.precision import dtype_of


def compute_dtype(cfg) -> torch.dtype:
    return dtype_of(cfg.training.precision)


def transformer_config(cfg, **runtime_fields) -> GatedTransformerConfig:
    """The model config; ``runtime_fields`` adds the hooks wired in at build time."""
    m, p = cfg.model, cfg.parallelism
    dtype = compute_dtype(cfg)
    # megatron wants a recompute method and layer count for "full" only.
    full = m.recompute_granularity == "full"
    return GatedTransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        head_wise_attn_gate=m.head_wise_attn_gate,
        head_wise_attn_gate_init_weight_scale=m.head_wise_attn_gate_init_weight_scale,
        head_wise_attn_gate_init_bias=m.head_wise_attn_gate_init_bias,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        normalization=m.normalization,
        rotary_base=float(m.rotary_base),
        rotary_percent=m.rotary_percent,
        layer_types=list(m.layer_types) if m.layer_types is not None else None,
        sliding_window=m.sliding_window,
        sliding_num_attention_heads=m.sliding_num_attention_heads,
        sliding_num_query_groups=m.sliding_num_query_groups,
        sliding_rotary_base=m.sliding_rotary_base,
        sliding_rotary_percent=m.sliding_rotary_percent,
        swiglu_limits=list(m.swiglu_limits) if m.swiglu_limits is not None else None,
        **_moe_fields(m, p),
        layernorm_zero_centered_gamma=m.layernorm_zero_centered_gamma,
        qk_layernorm=m.qk_layernorm,
        layernorm_epsilon=m.layernorm_epsilon,
        attention_kernel=m.attention_kernel,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        mtp_step35_heads=m.mtp_step35_heads,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method if full else None,
        recompute_num_layers=m.recompute_num_layers if full else None,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context_parallel_size,
        # Pipeline stages exchange [s, b, h] activations of this dtype.
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        # Packed documents (chat data, document masking): the loss is normalised over the loss
        # tokens of the whole global batch (megatron's num_tokens convention), so packing does
        # not change what a token weighs.
        calculate_per_token_loss=cfg.data.source == "chat" or cfg.data.document_masking,
        **runtime_fields,
    )


def _moe_fields(m, p) -> dict:
    """The model section's MoE keys (megatron's names) and the expert parallel sizes."""
    if m.num_moe_experts is None:
        return dict(expert_model_parallel_size=p.expert_model_parallel_size,
                    expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                    moe_expert_swiglu_limits=_optional_list(m.moe_expert_swiglu_limits))
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=_optional_list(m.moe_layer_freq),
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_dtype=m.moe_router_dtype,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        moe_expert_swiglu_limits=_optional_list(m.moe_expert_swiglu_limits),
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )


def _optional_list(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def byte_wise_distributed_optimizer(cfg) -> bool:
    """Whether megatron's distributed optimizer shards the optimizer state byte-wise (Adam).
    Muon's ``use_distributed_optimizer`` is megatron's layer-wise distributed optimizer
    (``optimizer_config``): whole parameters per DP rank over DDP's all-reduced gradients,
    Megatron-LM's ``--optimizer muon --use-distributed-optimizer
    --no-use-layer-wise-param-layout``."""
    return cfg.optimizer.use_distributed_optimizer and cfg.optimizer.type != "muon"


def ddp_config(cfg) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        # Reduce and accumulate gradients in fp32 even when computing in bf16 / fp16.
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=byte_wise_distributed_optimizer(cfg),
        overlap_grad_reduce=False,
    )


def optimizer_config(cfg) -> MegatronOptimizerConfig:
    o = cfg.optimizer
    dtype = compute_dtype(cfg)
    muon = {}
    if o.type == "muon":
        muon = {name: getattr(o, name) for name in (
            "muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_scale_mode",
            "muon_extra_scale_factor", "muon_num_ns_steps", "muon_coefficient_type",
            "muon_fp32_matmul_prec", "muon_tp_mode")}
        # Muon's distributed optimizer is megatron's layer-wise one (0.19+, as Muon itself; the
        # field does not exist before, so it is only named when Muon is on).
        muon["use_layer_wise_distributed_optimizer"] = o.use_distributed_optimizer
    return MegatronOptimizerConfig(
        optimizer=o.type,
        **muon,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        use_distributed_optimizer=byte_wise_distributed_optimizer(cfg),
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        params_dtype=dtype,
        loss_scale=o.loss_scale,
    )
