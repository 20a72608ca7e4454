"""Causal sliding-window attention on SDPA that costs ``s x w``, not ``s^2``.

SDPA has no window argument: a window given as a dense ``[sq, sk]`` mask makes every kernel
compute every masked-out score. Here the queries are cut into blocks of ``B >= left`` tokens (``left``
= megatron's window ``(left, 0)``, HF's ``sliding_window - 1``): block j's window lies inside key
blocks j-1 and j, so each block attends ``2B`` keys under one ``[B, 2B]`` band mask shared by every
block, and all blocks go to SDPA in one call with the blocks folded into the batch. Work and memory
are ``2B`` per query; the K/V pairs of neighbouring blocks are one copy of K and V, twice over.

Queries are aligned bottom-right, as megatron's masks are: query i sits at key position
``i + sk - sq`` (KV-cache decoding, a CP chunk behind its halo of earlier keys). When fewer than
``B`` keys precede the first query, block 0 goes to a second call with the left part of the band
mask cut off. The query tail is padded to a whole block with zeros; the padded keys sit after every
real query (never seen, causal), and the padded queries' outputs are dropped.

The blocks are attended in the activation dtype, so a GPU keeps its bf16 flash kernel. A key row
is in two block pairs (and in block 0's call of its own), so its dK / dV are the sum of parts from
several SDPA calls, each rounded by its kernel and added by autograd in that dtype: in bf16 about
12-14 % further from the exact gradient than one dense SDPA call (issue 32 item 7; the test bounds it
at 1.25 x). Attending the blocks in fp32 would round once, but costs a GPU its flash kernel and the
saved blocks twice their bytes (2.5 x the peak measured on a CPU).

Shapes (SDPA's): q [b, np, sq, hn], k / v [b, ng, sk, hn]; nb query blocks of B tokens.
"""

import torch
import torch.nn.functional as F

from mcore_ext.attention.layout import additive_mask
from mcore_ext.attention.masks import allowed

# Blocks are whole multiples of this: rows of the shared band mask stay aligned (SDPA's efficient
# kernel copies a mask whose rows are not) and GEMM tiles stay full.
BLOCK_MULTIPLE = 8


def block_size(left: int) -> int:
    """The query block of a window reaching ``left`` keys back: the smallest multiple of 8 >= left."""
    return -(-max(left, 1) // BLOCK_MULTIPLE) * BLOCK_MULTIPLE


def window_left(causal: bool, window):
    """The ``left`` of a causal window with a bounded left edge, else None (no band to cut)."""
    if not causal or window is None or window[0] < 0:
        return None
    return window[0]


def applies(sk: int, causal: bool, window) -> bool:
    """Whether the banded path attends fewer keys per query than a dense mask over ``sk`` keys."""
    left = window_left(causal, window)
    return left is not None and sk > 2 * block_size(left)


def band_mask(layout, left: int, dtype, device) -> torch.Tensor:
    """[B, 2B] additive: queries of a block (positions B..2B-1) against its previous block and
    itself (positions 0..2B-1); made once per batch for every layer of the kind."""
    b = block_size(left)

    def build():
        q_pos = torch.arange(b, 2 * b, device=device).unsqueeze(1)
        k_pos = torch.arange(2 * b, device=device).unsqueeze(0)
        return additive_mask(allowed(q_pos, k_pos, True, (left, 0)), dtype)

    return layout.cached(("band", b, left, dtype, device), build)


def attend(q, k, v, left: int, scale, dropout_p: float, layout) -> torch.Tensor:
    """Causal attention with keys in ``[p - left, p]`` of each query's position p, bottom-right
    aligned: [b, np, sq, hn] x [b, ng, sk, hn] -> [b, np, sq, hn] (a strided view)."""
    b, np_, sq, hn = q.shape
    sk = k.size(2)
    block = block_size(left)
    blocks = -(-sq // block)
    pad = blocks * block - sq
    mask = band_mask(layout, left, q.dtype, q.device)
    before = min(sk - sq, block)  # real keys before the first query, up to one block
    # Key rows from one block before the first query block to the end of the padded queries.
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    k, v = (x[:, :, sk - sq - before:] for x in (k, v))

    outs = []
    if before < block:  # block 0 sees fewer than B earlier keys: the band's right columns
        # Copies of one block: a view would keep all of q, k and v alive until backward (SDPA
        # saves its inputs). ``contiguous()`` would not do: at one batch row and one group the
        # slice is already contiguous, and a CP chunk's whole [halo; chunk] K/V stayed saved.
        q0, k0, v0 = (x[:, :, :n].clone(memory_format=torch.contiguous_format)
                      for x, n in ((q, block), (k, before + block), (v, before + block)))
        outs.append(_sdpa(q0, k0, v0, mask[:, block - before:], scale, dropout_p))
        q, k, v = q[:, :, block:], k[:, :, before:], v[:, :, before:]
        blocks -= 1
    if blocks:
        # [b, n, nb B, hn] -> [b nb, n, B, hn]
        q_blocks = q.unflatten(2, (blocks, block)).transpose(1, 2).flatten(0, 1)
        k_pairs, v_pairs = (_pairs(x, blocks, block) for x in (k, v))
        out = _sdpa(q_blocks, k_pairs, v_pairs, mask, scale, dropout_p)
        # [b nb, n, B, hn] -> [b, n, nb B, hn]
        outs.append(out.unflatten(0, (b, blocks)).transpose(1, 2).flatten(2, 3))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[:, :, :sq]


def window_attention(q, k, v, left: int, scale, dropout_p: float, layout) -> torch.Tensor:
    """Causal attention within ``left`` keys back, bottom-right aligned, on SDPA: banded where
    that attends fewer keys (``applies``), else under one dense ``[sq, sk]`` mask shared by every
    layer of the kind. [b, np, sq, hn] x [b, ng, sk, hn] -> [b, np, sq, hn]; a packed
    document's [np, sq, hn] x [ng, sk, hn] -> [np, sq, hn]."""
    if q.dim() == 3:
        return window_attention(q[None], k[None], v[None], left, scale, dropout_p, layout)[0]
    sq, sk = q.size(2), k.size(2)
    if applies(sk, True, (left, 0)):
        return attend(q, k, v, left, scale, dropout_p, layout)

    def build():
        q_pos = torch.arange(sk - sq, sk, device=q.device).unsqueeze(1)
        k_pos = torch.arange(sk, device=q.device).unsqueeze(0)
        return additive_mask(allowed(q_pos, k_pos, True, (left, 0)), q.dtype)

    mask = layout.cached(("dense", sq, sk, True, (left, 0), q.dtype, q.device), build)
    return _sdpa(q, k, v, mask, scale, dropout_p)


def _pairs(x, blocks: int, block: int) -> torch.Tensor:
    """[b, g, (nb + 1) B, hn] -> [b nb, g, 2B, hn]: each block's previous block and itself."""
    x = x.unflatten(2, (blocks + 1, block)).transpose(1, 2)  # [b, nb + 1, g, B, hn]
    return torch.cat([x[:, :-1], x[:, 1:]], dim=3).flatten(0, 1)


def _sdpa(q, k, v, mask, scale, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=q.size(-3) != k.size(-3))
