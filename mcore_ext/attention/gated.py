"""Self-attention with a head-wise sigmoid output gate fused into ``linear_qkv``.

    out_h = sigmoid(x @ w_gate_h + b_gate_h) * attention_h(x)        (before linear_proj)

``linear_qkv`` is one column-parallel GEMM with ``num_attention_heads`` extra output rows.
ColumnParallelLinear splits its rows contiguously, so each TP rank holds ``[QKV_r ; Gate_r]``: its
usual QKV rows followed by the gate rows of the query heads it computes. The checkpoint layout is
global ``[QKV ; Gate]``, kept exact across TP sizes by ``mcore_ext.checkpoint.sharding``.

Shapes (megatron notation): sq sequence, b batch, h hidden, np query heads / ng query groups on
this rank, hn head dim; ``qkv_r`` / ``np_r`` are this rank's QKV / gate columns of linear_qkv.
"""

import contextvars
import copy
import dataclasses
import functools
import warnings

import torch
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_pg_rank
from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region

from mcore_ext._mcore_compat import self_attention_init_kwargs
from mcore_ext.checkpoint.sharding import qkv_gate_factory
from mcore_ext.config import GatedTransformerConfig


class HeadWiseGatedSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` with one learned sigmoid gate per attention head.

    With ``config.head_wise_attn_gate`` off it is exactly ``SelfAttention``: same parameters,
    forward and checkpoint keys.
    """

    def __init__(
        self,
        config: GatedTransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ):
        self.head_wise_attn_gate = getattr(config, "head_wise_attn_gate", False)
        if self.head_wise_attn_gate:
            submodules = dataclasses.replace(
                submodules,
                linear_qkv=_with_extra_output_rows(submodules.linear_qkv, config.num_attention_heads),
            )
        super().__init__(**self_attention_init_kwargs(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        ))
        if not self.head_wise_attn_gate:
            return

        self.qkv_rows_per_partition = self.linear_qkv_out_dim // self.world_size
        self.gate_rows_per_partition = config.num_attention_heads // self.world_size
        self.linear_qkv_out_dim += config.num_attention_heads

        # megatron's forward already carries an output gate as a return value, from
        # get_query_key_value_tensors to _apply_output_gate, whenever the module's config has
        # attention_output_gate set. This module reads a private copy of the config with that
        # flag on, so the head-wise gate travels the same path; both hooks are overridden below.
        # The model's config, and every other module, still sees attention_output_gate=False.
        self.config = copy.copy(config)
        self.config.attention_output_gate = True

        self._init_gate_rows()

    # ---------------------------------------------------------------------------------- forward

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """[sq, b, h] -> query [sq, b, np, hn], key / value [sq, b, ng, hn], gate logits [sq, b, np]."""
        if not self.head_wise_attn_gate:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
            )
        if not split_qkv:
            raise NotImplementedError("head_wise_attn_gate needs split_qkv=True")

        # [sq, b, qkv_r + np_r]: one GEMM for Q, K, V and the gates.
        mixed, _ = self.linear_qkv(hidden_states)
        # Split this rank's gate columns off before any all-gather or reshape of the QKV part.
        # The QKV part stays a strided view (its last dim is contiguous, so the per-group view
        # below needs no copy); only the all-gather for fewer groups than ranks copies it.
        mixed_qkv, gate = mixed.split(
            [self.qkv_rows_per_partition, self.gate_rows_per_partition], dim=-1
        )
        query, key, value = self._split_query_key_value(mixed_qkv)

        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.config.test_mode:
            self.run_realtime_tests()
        return query, key, value, gate

    def _split_query_key_value(self, mixed_qkv):
        """Megatron's interleaved [q.. k v] per query group -> query, key, value."""
        groups, tp = self.config.num_query_groups, self.world_size
        if groups < tp:
            # A rank's QKV rows cut through a query group: gather all groups, keep this rank's
            # group. Rank r then computes query heads [r * H/tp, (r+1) * H/tp), the same heads
            # as its local gate rows.
            mixed_qkv = all_gather_last_dim_from_tensor_parallel_region(
                mixed_qkv.contiguous(), group=self.pg_collection.tp
            )
            group = get_pg_rank(self.pg_collection.tp) // (tp // groups)
            width = mixed_qkv.size(-1) // groups
            mixed_qkv = mixed_qkv[..., group * width : (group + 1) * width]

        hn = self.hidden_size_per_attention_head
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # [sq, b, ng * (np/ng + 2) * hn] -> [sq, b, ng, (np/ng + 2) * hn]
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], self.num_query_groups_per_partition, -1)
        query, key, value = mixed_qkv.split([heads_per_group * hn, hn, hn], dim=-1)
        # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
        query = query.reshape(*query.shape[:2], -1, hn)

        if groups < tp:
            heads = self.config.num_attention_heads // tp
            first = (get_pg_rank(self.pg_collection.tp) % (tp // groups)) * heads
            query = query[:, :, first : first + heads]
        return query, key, value

    def forward(self, *args, **kwargs):
        """``SelfAttention.forward``, with the gated output recomputed in backward.

        linear_proj saves its input, the gated output, for its weight gradient. Without a gate
        that input is the core-attention output, which core attention usually keeps alive anyway;
        the gated output would be one more [sq, b, np * hn] activation per layer. So while this
        forward runs, tensors saved for backward with the gated output's storage are packed as
        (attn, gate logits) and recomputed (one elementwise product) when backward needs them.
        Saved-tensor hooks do not nest, so this steps aside when megatron's activation offloading
        (itself built on such hooks) is on.
        """
        offloading = self.config.cpu_offloading or self.config.fine_grained_activation_offloading
        if not (self.head_wise_attn_gate and torch.is_grad_enabled()) or offloading:
            return super().forward(*args, **kwargs)
        recipes = {}  # storage of a gated output -> (attn, gate logits); this call's only
        token = _gated_outputs.set(recipes)
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(_pack_gated, recipes), _unpack_gated
            ):
                return super().forward(*args, **kwargs)
        finally:
            _gated_outputs.reset(token)

    def _apply_output_gate(self, core_attn_out, gate):
        """core_attn_out [sq, b, np * hn] scaled per head by sigmoid(gate [sq, b, np]), in fp32."""
        if not self.head_wise_attn_gate:
            return super()._apply_output_gate(core_attn_out, gate)
        attn = core_attn_out.unflatten(-1, (gate.size(-1), -1))  # [sq, b, np, hn]
        gated = _gate(attn, gate)
        recipes = _gated_outputs.get()
        if recipes is not None:
            recipes[gated.untyped_storage().data_ptr()] = (attn.detach(), gate.detach())
        return gated.flatten(-2)

    # ------------------------------------------------------------------------------ checkpoint

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Save linear_qkv's QKV and gate rows as separate global tensors (TP-reshardable)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.head_wise_attn_gate:
            for name in ("weight", "bias"):
                key = f"{prefix}linear_qkv.{name}"
                if key in sharded:
                    sharded[key] = qkv_gate_factory(
                        sharded[key], self.qkv_rows_per_partition, sharded_offsets
                    )
        return sharded

    # ------------------------------------------------------------------------------------ init

    def _init_gate_rows(self):
        """Scale this rank's gate weight rows and set its gate bias rows (upstream PR #4848)."""
        weight = self.linear_qkv.weight
        if weight.device.type == "meta":
            return
        gate_rows = slice(self.qkv_rows_per_partition, None)
        bias = getattr(self.linear_qkv, "bias", None)
        with torch.no_grad():
            weight[gate_rows].mul_(self.config.head_wise_attn_gate_init_weight_scale)
            if bias is not None and bias.numel():
                bias[gate_rows].fill_(self.config.head_wise_attn_gate_init_bias)
            elif self.config.head_wise_attn_gate_init_bias != 0:
                _warn_once(
                    f"head_wise_attn_gate_init_bias={self.config.head_wise_attn_gate_init_bias} "
                    "has no effect without a linear_qkv bias (add_qkv_bias or add_bias_linear): "
                    "gates start near sigmoid(0) = 0.5"
                )


def _gate(attn, logits):
    """attn [sq, b, np, hn] * sigmoid(logits [sq, b, np]), computed in fp32 at least."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    return (attn * torch.sigmoid(logits.to(compute_dtype)).unsqueeze(-1)).to(attn.dtype)


# The gated outputs of the HeadWiseGatedSelfAttention.forward in flight, by storage. A context
# variable, not module state: it lives for one forward call and is read only by that call.
_gated_outputs: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "gated_outputs", default=None
)


def _pack_gated(recipes, saved):
    recipe = recipes.get(saved.untyped_storage().data_ptr())
    if recipe is None:
        return saved
    attn, logits = recipe
    return attn, logits, saved.shape


def _unpack_gated(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    attn, logits, shape = packed
    return _gate(attn, logits).reshape(shape)


def _with_extra_output_rows(build_linear, extra_rows: int):
    """A linear_qkv builder that appends ``extra_rows`` outputs to what it is asked for."""

    def build(input_size, output_size, **kwargs):
        return build_linear(input_size, output_size + extra_rows, **kwargs)

    return build


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
