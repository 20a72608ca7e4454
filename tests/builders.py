"""Builders shared by tests: configs, modules, and megatron's fused QKV row layout.

Functions here run inside worker ranks, after ``mcore_ext.init_parallel``.
"""

import torch


def gated_config(**overrides):
    from mcore_ext import GatedTransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        head_wise_attn_gate=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    fields.update(overrides)
    return GatedTransformerConfig(**fields)


def build_self_attention(config, backend="sdpa"):
    """The self-attention module that ``get_gpt_layer_spec`` puts in layer 1."""
    from megatron.core.transformer.spec_utils import build_module

    import mcore_ext

    spec = mcore_ext.get_gpt_layer_spec(config, backend).submodules.self_attention
    return build_module(spec, config=config, layer_number=1)


def build_gpt(config, vocab_size=64, seq_length=16, backend="sdpa", **kwargs):
    from megatron.core.models.gpt import GPTModel

    import mcore_ext

    return GPTModel(
        config,
        mcore_ext.get_gpt_block_spec(config, backend),
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="rope",
        **kwargs,
    )


def gated_attention_weights(heads, groups, head_dim, hidden, generator):
    """Global weights of a gated attention layer, HF-style names: q, k, v, gate, o."""

    def rand(*shape, std):
        return torch.randn(*shape, generator=generator) * std

    return dict(q=rand(heads * head_dim, hidden, std=0.2),
                k=rand(groups * head_dim, hidden, std=0.2),
                v=rand(groups * head_dim, hidden, std=0.2),
                gate=rand(heads, hidden, std=0.3),
                o=rand(hidden, heads * head_dim, std=0.2))


def interleave_qkv(w_q, w_k, w_v, heads, groups):
    """Megatron's fused QKV rows: per query group, its query heads, then its key, then its value."""
    per_group = heads // groups
    q = w_q.view(groups, per_group * (w_q.size(0) // heads), *w_q.shape[1:])
    k = w_k.view(groups, -1, *w_k.shape[1:])
    v = w_v.view(groups, -1, *w_v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *w_q.shape[1:])


def rank_rows(tensor, rank, world_size):
    """Rank ``rank``'s contiguous block of rows, as ColumnParallelLinear splits them."""
    return tensor.chunk(world_size, dim=0)[rank]


def rank_rows_of_this_rank(tensor):
    """This TP rank's contiguous block of rows of a global tensor (ColumnParallelLinear's split)."""
    rank, size = tp_rank_and_size()
    return rank_rows(tensor, rank, size)


def tp_rank_and_size():
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def shared_dir(path: str) -> str:
    """Create ``path`` on rank 0 and wait for every rank (they share the file system)."""
    import os

    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def ddp_and_optimizer(config, gpt, distributed_optimizer: bool):
    """``gpt`` in megatron's DDP and megatron's Adam (lr 3e-3, clip 1.0) over it, with
    finalize_model_grads installed as the launcher does."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=distributed_optimizer,
                        clip_grad=1.0),
        [model])
    return model, optimizer


def train_step(model, optimizer, tokens, before_step=None) -> float:
    """One optimizer step of a DDP GPTModel on a global batch ``tokens`` [B, S + 1] (inputs and
    next-token labels), this data-parallel rank's share of it as one micro-batch through
    megatron's schedule; returns the mean loss over DP (the last pipeline stage's, on every
    rank). ``before_step()`` runs between the reduced gradients and the optimizer step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = tokens.chunk(dp)[dp_rank]
    seq = local.size(1) - 1

    def forward_step(data, model_chunk):
        batch = next(data)
        positions = torch.arange(seq).expand(batch.size(0), -1)
        output = model_chunk(batch[:, :-1], positions, None, labels=batch[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([local]), model=[model],
        num_microbatches=1, seq_length=seq, micro_batch_size=local.size(0), forward_only=False)
    if before_step is not None:
        before_step()
    optimizer.step()
    loss = torch.zeros(())
    if ps.is_pipeline_last_stage():
        loss = out[0]["loss"].clone()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        loss /= dp
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # every rank reports the last stage's
    return loss.item()


def training_state(model, optimizer, is_loading: bool, with_optimizer: bool = True) -> dict:
    """The sharded state dict of a DDP model and (optionally) its optimizer, as mcore_ext saves."""
    from mcore_ext import checkpoint

    model_sd = model.module.sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = checkpoint.optimizer_sharded_state_dict(optimizer, model_sd,
                                                                     is_loading)
    return state


def load_training_state(model, optimizer, directory: str, with_optimizer: bool = True) -> None:
    from mcore_ext import checkpoint

    state = checkpoint.load(training_state(model, optimizer, True, with_optimizer), directory)
    model.module.load_state_dict(state["model"])
    if with_optimizer:
        checkpoint.load_optimizer_state_dict(optimizer, state["optimizer"])


def reference_layers(config):
    """Each layer's kind as tests.reference.step35_logits takes it: heads, groups, window, RoPE,
    clamp, and for a MoE layer top-k, scaling and the routed clamp."""
    from mcore_ext.moe import is_moe_layer

    layers = []
    for number in range(1, config.num_layers + 1):
        kind = config.get_config_for_layer(number)
        sliding = config.layer_type(number) == "sliding_attention"
        layer = dict(heads=kind.num_attention_heads, groups=kind.num_query_groups,
                     window=config.sliding_window if sliding else None,
                     rope_base=kind.rotary_base, rope_fraction=kind.rotary_percent,
                     swiglu_limit=config.swiglu_limit(number))
        if is_moe_layer(config, number):
            layer["moe"] = dict(topk=config.moe_router_topk,
                                scaling=config.moe_router_topk_scaling_factor,
                                routed_limit=config.moe_expert_swiglu_limit(number))
        layers.append(layer)
    return layers
