"""Core attention on torch's kernels: ``scaled_dot_product_attention``, ``flex_attention`` or
``varlen_attn``.

A drop-in for megatron's ``core_attention`` slot (same constructor and call signature as
``megatron.core.transformer.dot_product_attention.DotProductAttention``) that runs on CPU and GPU.
It only dispatches; what it dispatches on is split by concern:
- ``layout.py``: the per-batch layout (document boundaries, CP key orders, every layer kind's
  masks), made once per forward at the model level and shared by every layer;
- the kernels, picked by ``config.attention_kernel`` (as torchtitan does): "sdpa" (torch SDPA,
  here: plain, KV-cache and packed THD), "flex" (``flex.py``, block masks for causal + window
  + packed documents), "varlen" (``varlen.py``, torch's flash varlen kernel for packed batches,
  GPU);
- ``sliding.py``: a causal window in blocks of about the window, so it costs ``s x w``;
- ``context_parallel.py``: CP (all-gathered K/V, chunks against their key ranges; a causal
  window exchanges only its halo, ``halo.py``).
All masks come from one position rule, ``masks.allowed(q_pos, k_pos, ...)``.

On the sdpa kernel causal attention needs no dense mask, bottom-right aligned (KV-cache
decoding, CP chunks) included (``layout.key_prefix_causal``), so SDPA keeps flash (GQA too) on a
GPU; a causal window is banded (one ``[B, 2B]`` mask per batch and layer kind), other windows an
additive mask made once per batch per layer kind.

Shapes (megatron notation): sq / sk query / key length, b batch, np query heads and ng key-value
groups on this rank, hn head dim, t tokens of a packed (THD) batch.
    query [sq, b, np, hn], key / value [sk, b, ng, hn]  ->  output [sq, b, np * hn]
    THD:  query [t, np, hn], key / value [t, ng, hn]    ->  output [t, np * hn]
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

from mcore_ext.attention import context_parallel, flex, sliding, varlen
from mcore_ext.attention.layout import additive_mask, key_prefix_causal, layout_for
from mcore_ext.attention.masks import allowed

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
        self.window = tuple(config.window_size) if config.window_size is not None else None
        self.kernel = getattr(config, "attention_kernel", "sdpa")
        if self.kernel == "flex":
            flex.check_supported(self.dropout_p)
        elif self.kernel == "varlen":
            varlen.check_supported(self.dropout_p)

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
        if mask_type is AttnMaskType.no_mask:  # megatron's no_mask ignores a given mask
            attention_mask = None
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout inside a TP region draws from the TP rank's stream, as megatron's own does.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        if query.is_cuda:
            query, key, value = (kernel_aligned(x) for x in (query, key, value))
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        layout = layout_for(packed_seq_params if packed else None)
        causal = mask_type in _CAUSAL
        with rng:
            if self.cp_group is not None:
                return self._context_parallel(
                    query, key, value, attention_mask, attention_bias, causal, dropout_p,
                    packed_seq_params, layout,
                )
            if packed:
                if self.kernel == "flex":
                    return flex.packed(query, key, value, layout, causal, self.window,
                                       self.softmax_scale)
                if self.kernel == "varlen":
                    return varlen.packed(query, key, value, layout, causal, self.window,
                                         self.softmax_scale)
                return self._packed(query, key, value, causal, dropout_p, layout)
            if (self.kernel == "varlen" and attention_mask is None and attention_bias is None
                    and query.size(0) == key.size(0)):
                return varlen.batched(query, key, value, layout, causal, self.window,
                                      self.softmax_scale)
            # [s, b, n, hn] -> [b, n, s, hn]; SDPA accepts the strided view, no copy here.
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            if self.kernel == "flex":
                out = flex.attend(q, k, v, attention_mask, attention_bias, causal, self.window,
                                  self.softmax_scale, layout)
            else:
                out = self._attend(q, k, v, attention_mask, attention_bias, causal, dropout_p,
                                   layout)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _attend(self, q, k, v, attention_mask, attention_bias, causal, dropout_p, layout):
        """sdpa kernel: [b, n, sq, hn] x [b, g, sk, hn] -> [b, n, sq, hn]."""
        sq, sk = q.size(-2), k.size(-2)
        left = sliding.window_left(causal, self.window)
        if attention_mask is None and attention_bias is None and left is not None:
            # A causal window: banded (2B keys per query) where that is cheaper than a mask.
            return sliding.window_attention(q, k, v, left, self.softmax_scale, dropout_p, layout)
        if attention_mask is None and attention_bias is None:
            # From positions only: no mask, a causal bias, or the kind's mask made once per batch.
            mask = position_mask(layout, sq, sk, causal, self.window, q.dtype, q.device)
        else:
            mask = _sdpa_mask(attention_mask, attention_bias, causal, self.window, sq, sk, q)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=mask is None and causal,
            scale=self.softmax_scale,
            enable_gqa=q.size(-3) != k.size(-3),
        )

    def _context_parallel(self, query, key, value, attention_mask, attention_bias, causal,
                          dropout_p, packed_seq_params, layout):
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPAttention with context parallelism builds its masks from token positions: "
                f"an explicit attention_mask ({attention_mask is not None}) or attention_bias "
                f"({attention_bias is not None}) is not supported"
            )
        kwargs = dict(group=self.cp_group, causal=causal, scale=self.softmax_scale,
                      dropout_p=dropout_p, window=self.window, layout=layout, kernel=self.kernel)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return context_parallel.packed_attention(query, key, value, packed_seq_params, **kwargs)
        return context_parallel.attention(query, key, value, **kwargs)

    def _packed(self, query, key, value, causal, dropout_p, layout):
        """THD on the sdpa kernel: one SDPA call per document (boundaries from the layout's host
        lists, no device read); padding slots between documents stay zero."""
        out = query.new_zeros(query.shape)
        for start_q, len_q, start_kv, len_kv in zip(layout.starts_q, layout.lengths_q,
                                                    layout.starts_kv, layout.lengths_kv):
            rows_q, rows_kv = slice(start_q, start_q + len_q), slice(start_kv, start_kv + len_kv)
            # [t_i, n, hn] -> [1, n, t_i, hn]: SDPA's fused kernels take 4-D inputs only (3-D
            # ones ran its math kernel, a [n, t_i, t_i] score matrix, on a GPU too).
            q, k, v = (x.transpose(0, 1).unsqueeze(0)
                       for x in (query[rows_q], key[rows_kv], value[rows_kv]))
            out[rows_q] = self._attend(q, k, v, None, None, causal, dropout_p,
                                       layout)[0].transpose(0, 1)
        return out.reshape(out.size(0), -1)


# CUDA's fused attention kernels read rows 16 bytes at a time.
KERNEL_ALIGNMENT_BYTES = 16


def kernel_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy of it where its start or a stride is not a multiple of 16 bytes.

    The gated layer hands q, k and v over as views of linear_qkv's output, whose row stride is
    ``qkv_r + np_r`` elements: not 16-byte aligned when a rank's head count is not a multiple of 8
    (bf16). On an H200 (torch 2.11), the Step-3.5 test model in bf16 gave logits off by up to
    3.8 (RMS 0.8) under SDPA's default kernels with such a view (row stride 132), and the right ones
    under the math kernel; contiguous q, k, v were right under every kernel (issue 34).
    """
    size = x.element_size()
    if x.data_ptr() % KERNEL_ALIGNMENT_BYTES == 0 and all(
        stride * size % KERNEL_ALIGNMENT_BYTES == 0 or dim == 1
        for stride, dim in zip(x.stride()[:-1], x.shape[:-1])
    ):
        return x
    return x.contiguous()


def position_mask(layout, sq, sk, causal, window, dtype, device):
    """SDPA's ``attn_mask`` for megatron's position rule (aligned bottom-right: query i is at
    key position i + sk - sq), or None where ``is_causal`` / no mask is exact.

    Causal without a window is ``key_prefix_causal`` (no dense mask on a GPU); a window is an
    additive mask, made once per batch for every layer of the kind.
    """
    if window is None and (not causal or sq == sk):
        return None

    def build():
        q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
        k_pos = torch.arange(sk, device=device).unsqueeze(0)
        return additive_mask(allowed(q_pos, k_pos, causal, window), dtype)

    key = ("dense", sq, sk, causal, window, dtype, device)
    if window is None:
        return key_prefix_causal(sq, sk, lambda _device: layout.cached(key, build))
    return layout.cached(key, build)


def _sdpa_mask(attention_mask, attention_bias, causal, window, sq, sk, like):
    """One SDPA mask from megatron's boolean mask (True = masked out), causality, window and bias
    (per call: a user's mask or bias may differ between layers).

    Returns None when SDPA's own ``is_causal`` (aligned top-left) or no mask is exact. Megatron's
    causal and window masks, KV-cache decoding included, are aligned bottom-right (query i is at
    key position i + sk - sq), which differs from is_causal when sq != sk.
    """
    keep = None  # True = attend
    if attention_mask is not None:
        keep = ~attention_mask.bool()
    if window is not None or (
        causal and (keep is not None or attention_bias is not None or sq != sk)
    ):
        q_pos = torch.arange(sk - sq, sk, device=like.device).unsqueeze(1)
        k_pos = torch.arange(sk, device=like.device).unsqueeze(0)
        by_position = allowed(q_pos, k_pos, causal, window)  # [sq, sk]
        keep = by_position if keep is None else keep & by_position
    if attention_bias is None:
        return keep
    bias = attention_bias.to(like.dtype)
    return bias if keep is None else bias.masked_fill(~keep, float("-inf"))


def _reject_unsupported(config: TransformerConfig, cp_comm_type) -> None:
    if config.context_parallel_size > 1:
        context_parallel.check_supported(config, cp_comm_type)
    if config.window_size is not None and (
        len(config.window_size) != 2 or config.window_attn_skip_freq is not None
    ):
        raise NotImplementedError(
            f"SDPAttention takes window_size=(left, right) on every layer, got "
            f"window_size={config.window_size}, window_attn_skip_freq="
            f"{config.window_attn_skip_freq} (use layer_types / sliding_window for per-layer "
            "windows)"
        )
    if config.softmax_type != "vanilla":
        raise NotImplementedError(
            f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
        )
