"""The varlen kernel: torch's ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
variable-length documents, CUDA only) for packed THD batches, with sliding windows
(``window_size``) and GQA natively: no mask, no per-document loop.

Document boundaries come from the batch's layout (``cu_seqlens`` as int32 device tensors, made
once per batch). Padding slots between documents (``cu_seqlens_*_padded``) are left out: the
real tokens are gathered into one run, attended, and scattered back (padding outputs are 0).
An unpacked batch [s, b] is b documents of length s.

Shapes: query [t, np, hn], key / value [t, ng, hn] -> [t, np * hn]; [s, b, n, hn] unpacked.
"""

import functools
import inspect

import torch


def packed(query, key, value, layout, causal, window, scale):
    """THD attention within each document."""
    _check_device(query)
    t = query.size(0)
    cu_q, cu_kv, rows_q, rows_kv = layout.cached(
        ("varlen_cu", t, key.size(0), query.device), lambda: _boundaries(layout, query.device))
    q = query if rows_q is None else query.index_select(0, rows_q)
    k, v = (x if rows_kv is None else x.index_select(0, rows_kv) for x in (key, value))
    out = _varlen(q, k, v, cu_q, cu_kv, layout.max_q, layout.max_kv, causal, window, scale)
    if rows_q is not None:
        out = query.new_zeros(query.shape).index_copy(0, rows_q, out)
    return out.reshape(t, -1)


def batched(query, key, value, layout, causal, window, scale):
    """[s, b, n, hn] self-attention as b documents of length s -> [s, b, n * hn]."""
    _check_device(query)
    s, b = query.size(0), query.size(1)
    cu = layout.cached(("varlen_batched_cu", s, b, query.device), lambda: torch.arange(
        0, (b + 1) * s, s, dtype=torch.int32, device=query.device))
    # [s, b, n, hn] -> [b * s, n, hn]
    q, k, v = (x.transpose(0, 1).reshape(b * s, x.size(2), x.size(3))
               for x in (query, key, value))
    out = _varlen(q, k, v, cu, cu, s, s, causal, window, scale)
    # [b * s, n, hn] -> [s, b, n * hn]
    return out.view(b, s, -1).transpose(0, 1).contiguous()


def _varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, window, scale):
    from torch.nn.attention.varlen import varlen_attn

    # flash's (left, right) key window, megatron's convention: -1 = unbounded; causal = right 0.
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    gqa = {}
    if q.size(1) != k.size(1):
        if _takes_enable_gqa(varlen_attn):
            gqa = dict(enable_gqa=True)
        else:  # torch 2.10 / 2.11: no GQA argument; each query head gets its group's K / V
            k, v = (x.repeat_interleave(q.size(1) // k.size(1), dim=1) for x in (k, v))
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_kv, max_q,
                       max_kv, scale=scale, window_size=(left, right), **gqa)


@functools.cache
def _takes_enable_gqa(fn) -> bool:
    return "enable_gqa" in inspect.signature(fn).parameters


def _boundaries(layout, device):
    """(cu_q, cu_kv) of the real tokens as int32, and the rows of the real tokens in the padded
    batch (None when there is no padding)."""
    def side(cu, starts, lengths, padded):
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        if cu == padded:
            return cu_t, None
        rows = torch.cat([torch.arange(a, a + n, device=device) for a, n in zip(starts, lengths)])
        return cu_t, rows

    cu_q, rows_q = side(layout.cu_q, layout.starts_q, layout.lengths_q, layout.cu_q_padded)
    cu_kv, rows_kv = side(layout.cu_kv, layout.starts_kv, layout.lengths_kv,
                          layout.cu_kv_padded)
    return cu_q, cu_kv, rows_q, rows_kv


def _check_device(query):
    if not query.is_cuda:
        raise NotImplementedError(
            f"attention_kernel='varlen' runs torch's flash varlen kernel, which needs CUDA; this "
            f"batch is on {query.device.type}: use attention_kernel='sdpa' (or 'flex') there"
        )


def check_supported(dropout_p) -> None:
    """Clear errors for what the varlen kernel cannot do."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        raise ImportError(
            f"attention_kernel='varlen' needs torch.nn.attention.varlen.varlen_attn (torch >= "
            f"2.10); this torch is {torch.__version__}"
        ) from None
    if dropout_p:
        raise NotImplementedError(
            f"attention_kernel='varlen' has no attention dropout: attention_dropout={dropout_p} "
            "needs attention_kernel='sdpa'"
        )
