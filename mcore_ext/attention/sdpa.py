"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in for megatron's ``core_attention`` slot (same constructor and call signature as
``megatron.core.transformer.dot_product_attention.DotProductAttention``) that runs on CPU and GPU:
torch picks the flash / memory-efficient kernel on a GPU and the math kernel on a CPU.

Shapes (megatron notation): sq / sk query / key length, b batch, np query heads and ng key-value
groups on this rank, hn head dim, t tokens of a packed (THD) batch.
    query [sq, b, np, hn], key / value [sk, b, ng, hn]  ->  output [sq, b, np * hn]
    THD:  query [t, np, hn], key / value [t, ng, hn]    ->  output [t, np * hn]

With context_parallel_size > 1 the inputs are this CP rank's tokens and ``context_parallel``
does the attention (all-gathered K/V, masks from token positions).
"""

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from mcore_ext.attention import context_parallel

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class SDPAttention(MegatronModule):
    """softmax(Q K^T * scale + mask) V with megatron's masks, GQA, dropout and softmax scale."""

    # q, k, v may be strided views (only their last dim contiguous): they are only permuted and
    # sliced here, never .view-ed. The gated attention then skips copying them out.
    accepts_strided_qkv = True

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        _reject_unsupported(config, cp_comm_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        cp_group = getattr(pg_collection, "cp", None) or (
            parallel_state.get_context_parallel_group(check_initialized=False))
        cp_size = cp_group.size() if cp_group is not None else 1
        if cp_size != config.context_parallel_size:
            # RoPE and the batch split follow the group: attending as if unsplit would be wrong.
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} but the context-parallel "
                f"group has {cp_size} ranks (init_parallel(context_parallel_size=...))"
            )
        self.cp_group = cp_group if cp_size > 1 else None
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_groups_per_partition = divide(config.num_query_groups, tp_size)
        # Megatron's scale: 1/sqrt(hn) unless given. apply_query_key_layer_scaling divides the
        # scores by layer_number and multiplies them back inside the fp32 softmax: a no-op in exact
        # arithmetic, which is what SDPA computes in, so it is not repeated here.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout inside a TP region draws from the TP rank's stream, as megatron's own does.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            if self.cp_group is not None:
                return self._context_parallel(
                    query, key, value, attention_mask, attention_bias, mask_type, dropout_p,
                    packed_seq_params,
                )
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, mask_type, dropout_p, packed_seq_params)
            # [s, b, n, hn] -> [b, n, s, hn]; SDPA accepts the strided view, no copy here.
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._attend(q, k, v, attention_mask, attention_bias, mask_type, dropout_p)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _attend(self, q, k, v, attention_mask, attention_bias, mask_type, dropout_p):
        mask = _sdpa_mask(attention_mask, attention_bias, mask_type, q.size(-2), k.size(-2), q)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=mask is None and mask_type in _CAUSAL,
            scale=self.softmax_scale,
            enable_gqa=q.size(-3) != k.size(-3),
        )

    def _context_parallel(self, query, key, value, attention_mask, attention_bias, mask_type,
                          dropout_p, packed_seq_params):
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPAttention with context parallelism builds its masks from token positions: "
                f"an explicit attention_mask ({attention_mask is not None}) or attention_bias "
                f"({attention_bias is not None}) is not supported"
            )
        kwargs = dict(group=self.cp_group, causal=mask_type in _CAUSAL, scale=self.softmax_scale,
                      dropout_p=dropout_p)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return context_parallel.packed_attention(query, key, value, packed_seq_params, **kwargs)
        return context_parallel.attention(query, key, value, **kwargs)

    def _packed(self, query, key, value, mask_type, dropout_p, params):
        """THD: attend within each packed sequence; padding slots between sequences stay zero."""
        lengths_q = params.cu_seqlens_q.diff().tolist()
        lengths_kv = params.cu_seqlens_kv.diff().tolist()
        starts_q = _starts(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        starts_kv = _starts(params.cu_seqlens_kv_padded, params.cu_seqlens_kv)
        out = query.new_zeros(query.shape)
        for start_q, len_q, start_kv, len_kv in zip(starts_q, lengths_q, starts_kv, lengths_kv):
            rows_q, rows_kv = slice(start_q, start_q + len_q), slice(start_kv, start_kv + len_kv)
            # [t_i, n, hn] -> [n, t_i, hn]
            q, k, v = (x.transpose(0, 1) for x in (query[rows_q], key[rows_kv], value[rows_kv]))
            out[rows_q] = self._attend(q, k, v, None, None, mask_type, dropout_p).transpose(0, 1)
        return out.reshape(out.size(0), -1)


def _starts(cu_seqlens_padded, cu_seqlens):
    return (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist()


def _sdpa_mask(attention_mask, attention_bias, mask_type, sq, sk, like):
    """One SDPA mask from megatron's boolean mask (True = masked out), mask type and bias.

    Returns None when SDPA's own ``is_causal`` (aligned top-left) or no mask is exact. Megatron's
    causal masks, KV-cache decoding included, are aligned bottom-right, which differs when sq != sk.
    """
    allowed = None  # True = attend
    if attention_mask is not None and mask_type is not AttnMaskType.no_mask:
        allowed = ~attention_mask.bool()
    if mask_type in _CAUSAL and (allowed is not None or attention_bias is not None or sq != sk):
        causal = torch.ones(sq, sk, dtype=torch.bool, device=like.device).tril(diagonal=sk - sq)
        allowed = causal if allowed is None else allowed & causal
    if attention_bias is None:
        return allowed
    bias = attention_bias.to(like.dtype)
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


def _reject_unsupported(config: TransformerConfig, cp_comm_type) -> None:
    if config.context_parallel_size > 1:
        context_parallel.check_supported(config, cp_comm_type)
    if config.window_size is not None:
        raise NotImplementedError(
            f"SDPAttention does not support window_size={config.window_size}; use the 'te' backend"
        )
    if config.softmax_type != "vanilla":
        raise NotImplementedError(
            f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
        )
