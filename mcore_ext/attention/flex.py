"""The flex kernel: torch ``flex_attention`` with block masks for causal + window + packed
documents, so fully masked blocks are skipped (a window keeps long sequences fast).

Block masks are made from the batch's layout once per batch and layer kind, on the device:
the packed batch's document ids are a device tensor (``AttentionLayout.document_ids``) and, on
a GPU, ``create_block_mask`` is compiled, so no dense ``[t, t]`` mask is built. flex itself is
compiled on a GPU with dynamic shapes (one compilation for every sequence length); its eager
form, which materializes the scores, runs on a CPU for tests: forward only (torch has no CPU
backward for flex).

Shapes: [b, n, s, hn] (SDPA's layout); THD: query [t, np, hn], key / value [t, ng, hn].
"""

import torch

from mcore_ext.attention.masks import allowed


def attend(q, k, v, attention_mask, attention_bias, causal, window, scale, layout):
    """[b, n, sq, hn] x [b, g, sk, hn] -> [b, n, sq, hn], megatron's bottom-right-aligned
    masks (query i is at key position i + sk - sq) plus an optional dense user mask."""
    if attention_bias is not None:
        raise NotImplementedError("attention_kernel='flex' does not take an attention_bias")
    sq, sk = q.size(-2), k.size(-2)
    positions = _position_mod(sk - sq, causal, window)
    if attention_mask is not None:
        # A dense user mask [b or 1, 1, sq, sk] (True = masked out): one block mask per call.
        keep = ~attention_mask.bool().expand(q.size(0), 1, sq, sk)
        block_mask = _block_mask(
            lambda b, h, qi, ki: positions(b, h, qi, ki) & keep[b, 0, qi, ki],
            q.size(0), sq, sk, q.device,
        )
    else:
        block_mask = layout.cached(
            ("flex", sq, sk, causal, window, q.device),
            lambda: _block_mask(positions, None, sq, sk, q.device),
        )
    return _flex_attention(q, k, v, block_mask, scale)


def _position_mod(offset, causal, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(q_idx + offset, kv_idx, causal, window)

    return mask_mod


def packed(query, key, value, layout, causal, window, scale):
    """THD in one flex call: a key is visible within its own document only; padding slots
    between documents belong to none and stay zero."""
    if not layout.self_attention:
        raise NotImplementedError("attention_kernel='flex' packs self-attention only")
    t = query.size(0)
    doc = layout.document_ids(t, query.device)

    def build():
        def mask_mod(b, h, q_idx, kv_idx):
            # Within one document, global index differences are position differences.
            same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
            return same & allowed(q_idx, kv_idx, causal, window)

        return _block_mask(mask_mod, None, t, t, query.device)

    block_mask = layout.cached(("flex_thd", t, causal, window, query.device), build)
    # [t, n, hn] -> [1, n, t, hn]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = _flex_attention(q, k, v, block_mask, scale)[0].transpose(0, 1)
    out = out.masked_fill((doc < 0).view(-1, 1, 1), 0.0)
    return out.reshape(t, -1)


def position_block_mask(q_pos, k_pos, q_doc, k_doc, k_valid, causal, window):
    """The block mask of queries and keys placed anywhere (CP chunks of packed documents): from
    each token's position in its document, its document and whether it is a real token."""
    def mask_mod(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == k_doc[kv_idx]) & k_valid[kv_idx]
        return same & allowed(q_pos[q_idx], k_pos[kv_idx], causal, window)

    return _block_mask(mask_mod, None, q_pos.size(0), k_pos.size(0), q_pos.device)


def attend_with_block_mask(q, k, v, block_mask, scale):
    """[b, n, sq, hn] x [b, g, sk, hn] -> [b, n, sq, hn] under a ready block mask (rows with no
    visible key give 0)."""
    return _flex_attention(q, k, v, block_mask, scale)


def _block_mask(mask_mod, batch, sq, sk, device):
    from torch.nn.attention.flex_attention import create_block_mask

    # Compiled on a GPU: evaluated block by block, never as a dense [sq, sk] mask.
    return create_block_mask(mask_mod, batch, None, sq, sk, device=device,
                             _compile=torch.device(device).type == "cuda")


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale):
    """torch flex_attention, compiled on a GPU (dynamic shapes: no recompilation per length)."""
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
        if min(q.size(-1), v.size(-1)) < 16:  # else an InductorError deep inside torch.compile
            raise NotImplementedError(
                f"attention_kernel='flex' on CUDA needs a head dim (kv_channels) of at least 16 "
                f"(torch's flex kernel); this layer's is {q.size(-1)}: use attention_kernel='sdpa'"
            )
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(-3) != k.size(-3))


def check_supported(dropout_p) -> None:
    """Clear errors for what the flex kernel cannot do."""
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
