"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` or ``flex_attention``.

A drop-in for megatron's ``core_attention`` slot (same constructor and call signature as
``megatron.core.transformer.dot_product_attention.DotProductAttention``) that runs on CPU and GPU.
``config.attention_kernel`` picks the inner kernel, as torchtitan does:
- "sdpa": torch SDPA; torch picks the flash / memory-efficient kernel on a GPU when no dense
  mask is needed (plain causal), the math kernel on a CPU. A window (``config.window_size``) or a
  bottom-right causal mask is a dense [sq, sk] mask, which sends SDPA to its slower paths.
- "flex": torch ``flex_attention`` with a block mask for causal + window + packed documents:
  blocks that are fully masked are skipped, so a window keeps long sequences fast (compiled on a
  GPU; eager, for tests, on a CPU).
Both build their masks from one position rule, ``masks.allowed(q_pos, k_pos, ...)``, as the
context-parallel attention does.

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
            _check_flex(config, self.dropout_p)
        self._block_masks = {}  # flex: (sq, sk, causal, device) -> BlockMask, for unpacked batches

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
                if self.kernel == "flex":
                    return self._packed_flex(query, key, value, mask_type, packed_seq_params)
                return self._packed(query, key, value, mask_type, dropout_p, packed_seq_params)
            # [s, b, n, hn] -> [b, n, s, hn]; SDPA accepts the strided view, no copy here.
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._attend(q, k, v, attention_mask, attention_bias, mask_type, dropout_p)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _attend(self, q, k, v, attention_mask, attention_bias, mask_type, dropout_p):
        """[b, n, sq, hn] x [b, g, sk, hn] -> [b, n, sq, hn]."""
        if self.kernel == "flex":
            return self._flex(q, k, v, attention_mask, attention_bias, mask_type)
        mask = _sdpa_mask(
            attention_mask, attention_bias, mask_type, self.window, q.size(-2), k.size(-2), q
        )
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
                      dropout_p=dropout_p, window=self.window)
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

    # ------------------------------------------------------------------------------- flex

    def _flex(self, q, k, v, attention_mask, attention_bias, mask_type):
        if attention_bias is not None:
            raise NotImplementedError("attention_kernel='flex' does not take an attention_bias")
        sq, sk = q.size(-2), k.size(-2)
        causal = mask_type in _CAUSAL
        if attention_mask is not None and mask_type is not AttnMaskType.no_mask:
            # A dense user mask [b or 1, 1, sq, sk] (True = masked out): one block mask per call.
            keep = ~attention_mask.bool().expand(q.size(0), 1, sq, sk)
            positions = self._mask_mod(sq, sk, causal)
            block_mask = _create_block_mask(
                lambda b, h, qi, ki: positions(b, h, qi, ki) & keep[b, 0, qi, ki],
                q.size(0), sq, sk, q.device,
            )
        else:
            cache_key = (sq, sk, causal, q.device)
            block_mask = self._block_masks.get(cache_key)
            if block_mask is None:
                block_mask = _create_block_mask(self._mask_mod(sq, sk, causal), None, sq, sk,
                                                q.device)
                if len(self._block_masks) >= 8:  # decoding grows sk every step: keep few
                    self._block_masks.clear()
                self._block_masks[cache_key] = block_mask
        return _flex_attention(q, k, v, block_mask, self.softmax_scale)

    def _mask_mod(self, sq, sk, causal):
        """flex's mask_mod for megatron's bottom-right aligned masks: query i is at key position
        i + sk - sq."""
        offset, window = sk - sq, self.window

        def mask_mod(b, h, q_idx, kv_idx):
            return allowed(q_idx + offset, kv_idx, causal, window)

        return mask_mod

    def _packed_flex(self, query, key, value, mask_type, params):
        """THD in one flex call: a key is visible within its own document only; padding slots
        between documents belong to none and stay zero."""
        if params.cu_seqlens_q is not params.cu_seqlens_kv and not torch.equal(
            params.cu_seqlens_q, params.cu_seqlens_kv
        ):
            raise NotImplementedError("attention_kernel='flex' packs self-attention only")
        t = query.size(0)
        doc = _document_ids(params.cu_seqlens_q, params.cu_seqlens_q_padded, t, query.device)
        causal, window = mask_type in _CAUSAL, self.window

        def mask_mod(b, h, q_idx, kv_idx):
            # Within one document, global index differences are position differences.
            same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
            return same & allowed(q_idx, kv_idx, causal, window)

        block_mask = _create_block_mask(mask_mod, None, t, t, query.device)
        # [t, n, hn] -> [1, n, t, hn]
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        out = _flex_attention(q, k, v, block_mask, self.softmax_scale)[0].transpose(0, 1)
        out = out.masked_fill((doc < 0).view(-1, 1, 1), 0.0)
        return out.reshape(t, -1)


def _document_ids(cu_seqlens, cu_seqlens_padded, t, device):
    """[t]: the document of each packed token, -1 for padding slots between documents."""
    starts = _starts(cu_seqlens_padded, cu_seqlens)
    lengths = cu_seqlens.diff().tolist()
    doc = torch.full((t,), -1, dtype=torch.int32, device=device)
    for i, (start, length) in enumerate(zip(starts, lengths)):
        doc[start : start + length] = i
    return doc


def _create_block_mask(mask_mod, batch, sq, sk, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, sq, sk, device=device)


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale):
    """torch flex_attention, compiled on a GPU (its eager form materializes the scores, which
    is what it runs on a CPU, for tests: forward only, torch has no flex backward on a CPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if not q.is_cuda and torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v)
    ):
        raise NotImplementedError(
            "attention_kernel='flex' runs forward only on a CPU (torch's flex_attention has no "
            "CPU backward): train with attention_kernel='sdpa' on a CPU, or on a GPU"
        )
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(-3) != k.size(-3))


def _check_flex(config, dropout_p):
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        raise ImportError(
            f"attention_kernel='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); "
            f"this torch is {torch.__version__}"
        ) from None
    if dropout_p:
        raise NotImplementedError(
            f"attention_kernel='flex' has no attention dropout: attention_dropout={dropout_p} "
            "needs attention_kernel='sdpa'"
        )


def _starts(cu_seqlens_padded, cu_seqlens):
    return (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist()


def _sdpa_mask(attention_mask, attention_bias, mask_type, window, sq, sk, like):
    """One SDPA mask from megatron's boolean mask (True = masked out), mask type, window and bias.

    Returns None when SDPA's own ``is_causal`` (aligned top-left) or no mask is exact. Megatron's
    causal and window masks, KV-cache decoding included, are aligned bottom-right (query i is at
    key position i + sk - sq), which differs from is_causal when sq != sk.
    """
    keep = None  # True = attend
    if attention_mask is not None and mask_type is not AttnMaskType.no_mask:
        keep = ~attention_mask.bool()
    causal = mask_type in _CAUSAL
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
