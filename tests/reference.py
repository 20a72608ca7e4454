"""Plain-PyTorch references written from the formulas, independent of megatron and mcore_ext.

Shapes: s sequence, b batch, n query heads, g key-value groups, d head dim, h hidden.
"""

import torch

# bf16 keeps 8 significant bits: rounding moves a value by at most this fraction of itself. The
# bf16 tolerances of the tests are multiples of it.
BF16_UNIT_ROUNDOFF = 2.0**-8


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


def attention_probs(q_BNQD, k_BGKD, allowed_QK, scale=None):
    """softmax(Q K^T * scale) over the allowed keys, in fp64: [b, n, sq, sk]; a query row with no
    allowed key is all 0. GQA by repeating K per group."""
    n, g = q_BNQD.size(1), k_BGKD.size(1)
    k_BNKD = k_BGKD.double().repeat_interleave(n // g, dim=1)
    scale = scale if scale is not None else q_BNQD.size(-1) ** -0.5
    scores_BNQK = torch.einsum("bnqd,bnkd->bnqk", q_BNQD.double(), k_BNKD) * scale
    scores_BNQK = scores_BNQK.masked_fill(~allowed_QK, float("-inf"))
    return torch.softmax(scores_BNQK, dim=-1).nan_to_num(0.0)


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


# ------------------------------------------------------------------ Step-3.5 decoder (HF's formulas)
# Written from transformers' Step3p7 text model (modeling_step3p7.py), not calling it. Weights are
# a dict of global tensors with HF's names per layer: q/k/v/o/g_proj, q_norm, k_norm,
# gate/up/down_proj, input_layernorm, post_attention_layernorm; plus embed, norm, lm_head.


def zero_centered_rms_norm(x, weight, eps):
    """Gemma / Step-3.5 RMSNorm: x / rms(x) * (1 + w), in fp32."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def rope(x_BNSD, base, fraction):
    """RoPE on the first int(d * fraction) dims of each head (rotate_half layout), positions 0..s-1."""
    s, d = x_BNSD.size(-2), x_BNSD.size(-1)
    dim = int(d * fraction)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(s, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rot, rest = x_BNSD[..., :dim], x_BNSD[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def sliding_causal(s, window):
    """[s, s]: query i sees key j iff i - window < j <= i (HF's sliding_window)."""
    i = torch.arange(s).unsqueeze(1)
    j = torch.arange(s).unsqueeze(0)
    return (j <= i) & (j > i - window)


def clamped_swiglu_mlp(x, w_gate, w_up, w_down, limit):
    limit = limit or float("inf")
    gate = torch.nn.functional.silu(x @ w_gate.T).clamp(max=limit)
    up = (x @ w_up.T).clamp(min=-limit, max=limit)
    return (gate * up) @ w_down.T


def sigmoid_topk_moe(x, w, topk, scaling, routed_limit=None, shared_limit=None):
    """Step-3.5's MoE MLP on [..., h], from HF's formulas (StepFun's modeling_step3p5).

    Router: logits in fp32, p = sigmoid(logits), topk(p + bias) selects the experts (the bias
    only selects), the weights are the selected p renormalised (sum + 1e-20) times ``scaling``;
    routed out = sum_k w_k * expert_k(x); plus the shared expert, unscaled. Weights (HF's shapes):
    router [E, h], router_bias [E], experts_{gate,up}_proj [E, f, h], experts_down_proj [E, h, f],
    shared_{gate,up,down}_proj (None = no shared expert).
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    p = torch.sigmoid(tokens.float() @ w["router"].float().T)
    chosen = torch.topk(p + w["router_bias"].float(), topk, dim=-1).indices  # [t, k]
    probs = p.gather(-1, chosen)
    probs = probs / (probs.sum(-1, keepdim=True) + 1e-20) * scaling
    out = torch.zeros_like(tokens)
    for e in range(w["router"].size(0)):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel():
            y = clamped_swiglu_mlp(tokens[rows], w["experts_gate_proj"][e], w["experts_up_proj"][e],
                                   w["experts_down_proj"][e], routed_limit)
            out = out.index_add(0, rows, probs[rows, slot].unsqueeze(-1).to(y.dtype) * y)
    if w.get("shared_gate_proj") is not None:
        out = out + clamped_swiglu_mlp(tokens, w["shared_gate_proj"], w["shared_up_proj"],
                                       w["shared_down_proj"], shared_limit)
    return out.view(shape)


def step35_layer(x, w, kind, eps):
    """One Step-3.5 decoder layer on x [b, s, h]: gated attention of its kind, then the clamped
    SwiGLU MLP (or, with ``kind["moe"]``, sigmoid_topk_moe), each with a residual. ``kind``:
    heads, groups, window (None = full), rope_base, rope_fraction, swiglu_limit (None = no
    clamp)."""
    b, s, _ = x.shape
    n, g = kind["heads"], kind["groups"]
    h_in = zero_centered_rms_norm(x, w["input_layernorm"], eps)
    q = (h_in @ w["q_proj"].T).view(b, s, n, -1)
    k = (h_in @ w["k_proj"].T).view(b, s, g, -1)
    v = (h_in @ w["v_proj"].T).view(b, s, g, -1)
    q = zero_centered_rms_norm(q, w["q_norm"], eps).transpose(1, 2)  # [b, n, s, d]
    k = zero_centered_rms_norm(k, w["k_norm"], eps).transpose(1, 2)
    q = rope(q, kind["rope_base"], kind["rope_fraction"])
    k = rope(k, kind["rope_base"], kind["rope_fraction"])
    allowed = causal(s, s) if kind["window"] is None else sliding_causal(s, kind["window"])
    # reuse attention() above, which takes [s, b, heads, d]
    attn = attention(q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3),
                     v.transpose(0, 1), allowed)  # [s, b, n * d]
    attn = attn.transpose(0, 1).reshape(b, s, n, -1)
    gate = torch.sigmoid(h_in @ w["g_proj"].T).unsqueeze(-1)  # [b, s, n, 1]
    x = x + (attn * gate).reshape(b, s, -1) @ w["o_proj"].T
    h_mlp = zero_centered_rms_norm(x, w["post_attention_layernorm"], eps)
    if kind.get("moe"):
        return x + sigmoid_topk_moe(h_mlp, w, shared_limit=kind["swiglu_limit"], **kind["moe"])
    return x + clamped_swiglu_mlp(h_mlp, w["gate_proj"], w["up_proj"], w["down_proj"],
                                  kind["swiglu_limit"])


def step35_hidden(tokens_BS, weights, layers, eps):
    """The decoder's output [b, s, h] before the final norm (``layers`` as in step35_logits)."""
    x = weights["embed"][tokens_BS]  # [b, s, h]
    for w, kind in zip(weights["layers"], layers):
        x = step35_layer(x, w, kind, eps)
    return x


def step35_logits(tokens_BS, weights, layers, eps):
    """Logits [b, s, v] of a Step-3.5 text decoder.

    ``layers``: per layer a dict with heads, groups, window (None = full), rope_base,
    rope_fraction, swiglu_limit (None = no clamp; a MoE layer's shared expert's), and for a MoE
    layer ``moe``: the keyword arguments of ``sigmoid_topk_moe`` (topk, scaling, routed_limit),
    whose weights are in the layer's dict.
    """
    x = step35_hidden(tokens_BS, weights, layers, eps)
    return zero_centered_rms_norm(x, weights["norm"], eps) @ weights["lm_head"].T


def step35_mtp_logits(tokens_BS, weights, layers, mtp_layers, eps, pre_norm_input=True,
                      own_heads=True):
    """Step-3.5's multi-token prediction: per depth k, logits [b, s, v] whose position t predicts
    token t + k + 2.

    Written from the formula as vLLM's ``vllm/model_executor/models/step3p5_mtp.py`` (commit
    375a5cf2) computes it, not from its code. Depth k (weights["mtp"][k]: enorm, hnorm,
    eh_proj [h, 2h], the layer's own tensors, shared_head_norm, shared_head_output [v, h]):

        e_k   = embed(token t + k + 1)            (token 0 past the sequence's end)
        h_k   = layer_k(eh_proj(cat[rms(e_k; enorm), rms(h_{k-1}; hnorm)]))
        out_k = rms(h_k; shared_head_norm) @ shared_head_output^T

    with h_{-1} the decoder's output before its final norm and h_k handed on before its norm.
    RoPE positions are 0 .. s-1 for every depth (vLLM uses the shifted tokens' positions; RoPE
    scores depend only on position differences, so the attention is the same).

    ``pre_norm_input=False, own_heads=False`` is megatron-core's own MTP instead: h_{-1} after
    the final norm, each depth hands on its normed output, and lm_head serves every depth.
    """
    hidden = step35_hidden(tokens_BS, weights, layers, eps)
    previous = hidden if pre_norm_input else zero_centered_rms_norm(hidden, weights["norm"], eps)
    shifted = tokens_BS
    out = []
    for w, kind in zip(weights["mtp"], mtp_layers):
        shifted = torch.cat([shifted[:, 1:], torch.zeros_like(shifted[:, :1])], dim=1)
        embedded = zero_centered_rms_norm(weights["embed"][shifted], w["enorm"], eps)
        combined = torch.cat([embedded, zero_centered_rms_norm(previous, w["hnorm"], eps)], -1)
        h = step35_layer(combined @ w["eh_proj"].T, w, kind, eps)
        normed = zero_centered_rms_norm(h, w["shared_head_norm"], eps)
        out.append(normed @ (w["shared_head_output"] if own_heads else weights["lm_head"]).T)
        previous = h if pre_norm_input else normed
    return out
