"""Plain-PyTorch references written from the formulas, independent of megatron and mcore_ext.

Shapes: s sequence, b batch, n query heads, g key-value groups, d head dim, h hidden.
"""

import torch


def attention(q_SBND, k_SBGD, v_SBGD, allowed_BNQK=None, scale=None):
    """softmax(Q K^T * scale, masked where not allowed) V, GQA by repeating K/V per group.

    Returns [s, b, n * d].
    """
    n, g = q_SBND.size(2), k_SBGD.size(2)
    k_SBND = k_SBGD.repeat_interleave(n // g, dim=2)
    v_SBND = v_SBGD.repeat_interleave(n // g, dim=2)
    scale = scale if scale is not None else q_SBND.size(-1) ** -0.5
    scores_BNQK = torch.einsum("qbnd,kbnd->bnqk", q_SBND, k_SBND) * scale
    if allowed_BNQK is not None:
        scores_BNQK = scores_BNQK.masked_fill(~allowed_BNQK, float("-inf"))
    probs_BNQK = torch.softmax(scores_BNQK, dim=-1)
    out_SBND = torch.einsum("bnqk,kbnd->qbnd", probs_BNQK, v_SBND)
    return out_SBND.reshape(out_SBND.size(0), out_SBND.size(1), -1)


def causal(sq, sk):
    """[sq, sk]: query i sees key j iff j <= i + (sk - sq) (aligned bottom-right)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    return j <= i + (sk - sq)


def gated_attention(x_SBH, w_q, w_k, w_v, w_gate, w_o, num_heads, num_groups,
                    b_q=None, b_k=None, b_v=None, b_gate=None, q_norm=None, k_norm=None,
                    allowed=None):
    """Self-attention with a head-wise sigmoid output gate, no positional embedding.

    ``allowed`` [s, s] defaults to causal; a packed batch passes its block-diagonal causal mask.

    out = W_o [ sigmoid(x w_gate_h + b_gate_h) * attention_h(x) ]_h   (w_o has no bias here)
    w_q [n*d, h], w_k / w_v [g*d, h], w_gate [n, h], w_o [h, n*d].
    """
    s, b, _ = x_SBH.shape

    def project(w, bias, heads):
        y = x_SBH @ w.T + (bias if bias is not None else 0)
        return y.view(s, b, heads, -1)

    q = project(w_q, b_q, num_heads)
    k = project(w_k, b_k, num_groups)
    v = project(w_v, b_v, num_groups)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    attn_SBND = attention(q, k, v, causal(s, s) if allowed is None else allowed).view(s, b, num_heads, -1)
    gate_SBN = x_SBH @ w_gate.T + (b_gate if b_gate is not None else 0)
    gated = attn_SBND * torch.sigmoid(gate_SBN).unsqueeze(-1)
    return gated.reshape(s, b, -1) @ w_o.T
