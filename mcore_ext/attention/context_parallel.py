"""Context parallelism (CP) for the sdpa backend: all-gather K/V (a causal window: its halo only),
masks from token positions.

megatron-core shards the sequence over the CP group with a load-balanced split: the sequence is cut
into 2 x CP chunks and CP rank r holds chunks r and 2CP-1-r (so every rank gets as much causal
work as the others). ``get_batch_on_this_cp_rank`` (megatron's) and RoPE's
``get_pos_emb_on_this_cp_rank`` do that for the inputs and positions; this module does it for
core attention:

- a layer with a causal window (Step-3.5's sliding layers) receives only the keys its chunks'
  windows reach before them, point to point (``halo.py``), and attends each chunk to [halo;
  chunk] on the banded kernel (``sliding.py``): it moves and computes ``w`` keys per query, not
  the sequence;
- every other layer all-gathers K and V over the CP group (their gradients are reduce-scattered
  back), ng groups of them, never repeated per query head, and keeps only its own K/V for
  backward, where they are gathered again;
- each local chunk attends to its key range: a causal chunk to its key prefix (bottom-right
  causal, no dense mask), otherwise under a mask built from the tokens' *global* positions
  (``masks.allowed``, the rule of the sdpa and flex kernels: causal, and megatron's
  window (left, right) when the layer has one), plus same document and a real (not padding) key
  for packed THD batches. Key orders and masks come from the batch's ``AttentionLayout``
  (``layout.py``): made once per batch and layer kind, shared by every layer.

Packed THD batches follow megatron's (and Transformer Engine's) convention: ``cu_seqlens_*`` and
``cu_seqlens_*_padded`` describe the *whole* packed sequence; every document's padded length is a
multiple of 2 x CP and each document is split into 2 x CP chunks on its own
(``get_packed_batch_on_this_cp_rank``).

Shapes (megatron notation): s local tokens (2 chunks), S = CP x s gathered tokens, b batch,
np / ng heads / groups on this TP rank, hn head dim, t local tokens of a packed batch.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_ext import _mcore_compat
from mcore_ext.attention import flex, halo, sliding
from mcore_ext.attention.layout import additive_mask, key_prefix_causal, layout_for
from mcore_ext.attention.masks import allowed

# cp_comm_type values that mean "all-gather K/V" (None is megatron's default).
SUPPORTED_CP_COMM_TYPES = (None, "all_gather")


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters (sums, in fp32) the
    gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(group.size() * x.size(0), *x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # dK / dV are sums of CP partial gradients: add them in fp32 (as Transformer Engine
        # does), rounding to the activation dtype once, not once per rank added.
        grad32 = grad.float().contiguous()
        out = grad32.new_empty(grad32.size(0) // ctx.group.size(), *grad32.shape[1:])
        dist.reduce_scatter_tensor(out, grad32, group=ctx.group)
        return out.to(grad.dtype), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[s, ...] on each CP rank -> [CP x s, ...] in rank order (dK / dV summed back in backward)."""
    return _GatherSequence.apply(x, group)


class _GatherAgainInBackward:
    """Saved-tensor hooks that keep SDPA from holding the gathered K/V (CP x the local K/V, per
    layer) until backward: a saved view of a gathered tensor is packed as this rank's part and
    the view's layout, and gathered again in backward (once per tensor, shared by every view).
    Every CP rank runs the same backward, so the collectives match up. Other saved tensors (q,
    the mask, SDPA's output and statistics) are kept as they are.

    References only point from these hooks to their ``_Gathered`` parts (never back), so no
    reference cycle holds the local K/V: they are freed with the autograd graph (after backward,
    or when an evaluation's outputs die), also when the garbage collector is off.
    """

    def __init__(self, group, order=None, regather=True):
        self.group, self.order, self.regather = group, order, regather
        self.sources = {}  # storage pointer of a gathered tensor -> _Gathered

    def saving(self):
        """The context SDPA runs in: these hooks, or nothing when not gathering again."""
        if not self.regather:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def gathered(self, local):
        """all-gather(local) [in sequence order], with autograd, registered for re-gathering."""
        full = gather_sequence(local, self.group)
        if self.order is not None:
            full = full.index_select(0, self.order)
        if self.regather and torch.is_grad_enabled():  # else nothing is packed
            self.sources[full.untyped_storage().data_ptr()] = _Gathered(
                local.detach(), self.group, self.order)
        return full

    def pack(self, tensor):
        source = self.sources.get(tensor.untyped_storage().data_ptr())
        if source is None:
            return tensor
        source.views += 1
        return source, tensor.storage_offset(), tensor.shape, tensor.stride()

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        source, offset, shape, stride = packed
        return source.full().as_strided(shape, stride, offset)


class _Gathered:
    """One rank's part of a gathered tensor and how to gather it again. It holds the group and
    the order itself, not the hooks that hold it (that would be a cycle)."""

    def __init__(self, local, group, order):
        self.local, self.group, self.order, self.views, self._full = local, group, order, 0, None

    def full(self):
        if self._full is None:
            with torch.no_grad():
                full = self.local.new_empty(self.group.size() * self.local.size(0),
                                            *self.local.shape[1:])
                dist.all_gather_into_tensor(full, self.local.contiguous(), group=self.group)
                if self.order is not None:
                    full = full.index_select(0, self.order)
            self._full = full
        full, self.views = self._full, self.views - 1
        if self.views <= 0:  # the last saved view is unpacked: free it with SDPA's backward
            self._full = None
        return full


def zigzag_positions(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions [local_len] of the tokens CP rank ``cp_rank`` holds: chunks r, 2CP-1-r."""
    if local_len % 2:
        raise ValueError(
            f"a context-parallel rank holds 2 equal chunks, but its sequence length is {local_len} "
            f"(the full sequence must be divisible by 2 x context_parallel_size = {2 * cp_size})"
        )
    chunk = local_len // 2
    offsets = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + offsets, (2 * cp_size - 1 - cp_rank) * chunk + offsets])


def allowed_mask(q_pos, k_pos, causal=True, window=None, q_doc=None, k_doc=None, k_valid=None):
    """[sq, sk] boolean, True where query i may attend key j: the shared position rule
    (``masks.allowed``; ``window`` = megatron's (left, right)), plus same document and a real key
    for packed batches."""
    ok = allowed(q_pos.unsqueeze(1), k_pos.unsqueeze(0), causal, window)
    ok = ok.expand(q_pos.size(0), k_pos.size(0)).clone()
    if q_doc is not None:
        ok &= q_doc.unsqueeze(1) == k_doc.unsqueeze(0)
    if k_valid is not None:
        ok &= k_valid.unsqueeze(0)
    return ok


def attention(query, key, value, *, group, causal, scale, dropout_p, window=None, layout=None,
              kernel="sdpa"):
    """Core attention of the local chunks: a causal window's halo only (``halo.py``), else
    against all-gathered keys.

    query [s, b, np, hn], key / value [s, b, ng, hn] (local; strided views are fine)
    -> [s, b, np * hn]. ``layout``: the batch's ``AttentionLayout`` (default: the active one),
    which holds the key order and masks every layer shares. ``kernel``: "sdpa" or "flex".

    Causal: the gathered K/V are put in sequence order, and each of the two local chunks attends
    only to the keys up to its own end (a prefix view), so no work is spent on the keys after it:
    about half of the [s, S] score block. That is bottom-right-aligned causal attention, which
    SDPA runs without a dense mask (flash, GQA included); only a window needs a mask.
    """
    cp_size, cp_rank = group.size(), group.rank()
    s, device = query.size(0), query.device
    layout = layout if layout is not None else layout_for(None)
    left = sliding.window_left(causal, window)
    if left is not None and left < cp_size * s - 1:
        zigzag_positions(s, cp_size, cp_rank)  # checks the split
        return _halo_attention(query, key, value, [s // 2], group, left, scale, dropout_p,
                               layout, kernel)
    if left is not None:  # the window reaches the sequence start from every query
        window = None
    # Gathered rows come rank by rank ([chunk j, chunk 2CP-1-j] each): sort them by position.
    order = layout.cached(("cp_order", s, cp_size, device), lambda: torch.cat(
        [zigzag_positions(s, cp_size, r, device) for r in range(cp_size)]).argsort())
    hooks = _GatherAgainInBackward(group, order, regather=not _recomputing_in_backward())
    # [S, b, ng, hn] in sequence order -> [b, ng, S, hn]
    k, v = (hooks.gathered(x).permute(1, 2, 0, 3) for x in (key, value))
    q = query.permute(1, 2, 0, 3)  # [b, np, s, hn]
    with hooks.saving():
        out = _attend_chunks(q, k, v, cp_size, cp_rank, causal, scale, dropout_p, window, layout,
                             kernel)
    # [b, np, s, hn] -> [s, b, np * hn]
    return out.permute(2, 0, 1, 3).reshape(s, out.size(0), -1)


def chunk_masks(layout, chunk, cp_size, cp_rank, causal, window, dtype, device):
    """Per local chunk (key start, key end, mask): SDPA's ``attn_mask`` for the chunk's queries
    against keys [start, end) in sequence order, made once per batch and layer kind.

    Causal without a window: ``key_prefix_causal`` (no dense mask; a shared one where torch has to
    materialize it). A window: an additive mask, rows padded to a multiple of 8, shared.
    """
    left = window[0] if window is not None and window[0] >= 0 else None
    chunks = []
    for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
        # Keys after the chunk (causal) or left of its window are all masked: not attended at all.
        end = (index + 1) * chunk if causal else chunk * 2 * cp_size
        start = max(0, index * chunk - left) if left is not None else 0

        def build(index=index, start=start, end=end):
            q_pos = index * chunk + torch.arange(chunk, device=device)
            k_pos = torch.arange(start, end, device=device)
            return additive_mask(allowed_mask(q_pos, k_pos, causal, window), dtype)

        key = ("cp_chunk", chunk, index, start, end, causal, window, dtype, device)
        if causal and window is None:
            mask = key_prefix_causal(chunk, end - start,
                                     lambda _device, key=key, build=build: layout.cached(key, build))
        elif window is None:
            mask = None
        else:
            mask = layout.cached(key, build)
        chunks.append((start, end, mask))
    return chunks


def _attend_chunks(q, k, v, cp_size, cp_rank, causal, scale, dropout_p, window, layout,
                   kernel="sdpa"):
    """[b, np, s, hn] local queries x [b, ng, S, hn] gathered keys -> [b, np, s, hn]."""
    chunk = q.size(2) // 2
    gqa = q.size(1) != k.size(1)
    if not causal and window is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    outs = []
    masks = chunk_masks(layout, chunk, cp_size, cp_rank, causal, window, q.dtype, q.device)
    for half, (start, end, mask) in enumerate(masks):
        q_chunk = q[:, :, half * chunk:(half + 1) * chunk]
        k_range, v_range = k[:, :, start:end], v[:, :, start:end]
        if kernel == "flex" and causal:  # keys end with the chunk: bottom-right aligned
            outs.append(flex.attend(q_chunk, k_range, v_range, None, None, causal, window,
                                    scale, layout))
            continue
        outs.append(F.scaled_dot_product_attention(
            q_chunk, k_range, v_range, attn_mask=mask, dropout_p=dropout_p, scale=scale,
            enable_gqa=gqa,
        ))
    return torch.cat(outs, dim=2)


def _halo_attention(query, key, value, chunk_lengths, group, left, scale, dropout_p, layout,
                    kernel):
    """A causal window of ``left`` keys under CP: every local chunk against [its halo; itself].

    query [s, b, np, hn], key / value [s, b, ng, hn], the local chunks of documents whose chunks
    are ``chunk_lengths`` long (``halo.plan``) -> [s, b, np * hn].
    """
    cp_size, cp_rank = group.size(), group.rank()
    halo_plan = layout.cached(
        ("cp_halo", tuple(chunk_lengths), cp_size, cp_rank, left),
        lambda: halo.plan(chunk_lengths, cp_size, cp_rank, left))
    k_ext, v_ext = halo.halo_kv(key, value, halo_plan, group)
    outs = []
    for segment in halo_plan.segments:
        # [c, b, n, hn] -> [b, n, c, hn]; keys [halo + c, b, ng, hn] -> [b, ng, halo + c, hn]
        q = query[segment.q_start:segment.q_start + segment.length].permute(1, 2, 0, 3)
        rows = slice(segment.ext_start, segment.ext_start + segment.halo + segment.length)
        k, v = (x[rows].permute(1, 2, 0, 3) for x in (k_ext, v_ext))
        if kernel == "flex":
            outs.append(flex.attend(q, k, v, None, None, True, (left, 0), scale, layout))
        else:
            outs.append(sliding.window_attention(q, k, v, left, scale, dropout_p, layout))
    out = torch.cat(outs, dim=2)
    # [b, np, s, hn] -> [s, b, np * hn]
    return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


def packed_attention(query, key, value, params, *, group, causal, scale, dropout_p, window=None,
                     layout=None, kernel="sdpa"):
    """THD core attention under CP: query [t, np, hn], key / value [t, ng, hn] -> [t, np * hn].

    ``params`` (megatron's PackedSeqParams) describes the whole packed sequence. Padding tokens
    (past a document's real length) get a zero output, as without CP. ``layout``: the batch's
    ``AttentionLayout`` (default: the one made for ``params``); the mask is made once per batch
    and layer kind. A causal window moves only each document chunk's halo (``halo.py``); other
    layers all-gather K/V.
    """
    cp_size, cp_rank = group.size(), group.rank()
    layout = layout if layout is not None else layout_for(params)
    # Every rank's (position in its document, document, real token?) per token, once per batch.
    parts = layout.cached(("cp_thd_split", cp_size, query.device), lambda: [
        _packed_layout(layout, cp_size, r, query.device) for r in range(cp_size)])
    q_pos, q_doc, q_valid = parts[cp_rank]
    if q_pos.size(0) != query.size(0):
        raise ValueError(
            f"packed batch has {query.size(0)} tokens on this context-parallel rank, but its "
            f"cu_seqlens_q_padded gives {q_pos.size(0)} (global padded total / "
            f"context_parallel_size {cp_size})"
        )
    left = sliding.window_left(causal, window)
    if left is not None:
        padded = [b - a for a, b in zip(layout.cu_q_padded, layout.cu_q_padded[1:])]
        chunks = [length // (2 * cp_size) for length in padded]
        # [t, n, hn] as [t, 1, n, hn]: each document's chunks are segments of one sequence
        out = _halo_attention(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), chunks,
                              group, left, scale, dropout_p, layout, kernel).squeeze(1)
        return out * q_valid.unsqueeze(1).to(out.dtype)

    def build():
        k_pos, k_doc, k_valid = (torch.cat(p) for p in zip(*parts))
        if kernel == "flex":
            return flex.position_block_mask(q_pos, k_pos, q_doc, k_doc, k_valid, causal, window)
        allowed = allowed_mask(q_pos, k_pos, causal, window, q_doc, k_doc, k_valid)
        # A padding query of a document with no real token before it would see no key (NaN
        # rows): let every padding query see everything; its output is zeroed below.
        allowed |= ~q_valid.unsqueeze(1)
        return additive_mask(allowed, query.dtype)

    key_ = ("cp_thd", kernel, query.size(0), cp_size, cp_rank, causal, window, query.dtype,
            query.device)
    mask = layout.cached(key_, build)
    hooks = _GatherAgainInBackward(group, regather=not _recomputing_in_backward())
    # [t, n, hn] -> [n, t, hn]
    k, v = (hooks.gathered(x).transpose(0, 1) for x in (key, value))
    q = query.transpose(0, 1)
    with hooks.saving():
        if kernel == "flex":
            out = flex.attend_with_block_mask(q[None], k[None], v[None], mask, scale)[0]
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                enable_gqa=q.size(0) != k.size(0),
            )
    out = out.transpose(0, 1) * q_valid.view(-1, 1, 1).to(out.dtype)
    return out.reshape(out.size(0), -1)


def _recomputing_in_backward() -> bool:
    """Whether this forward runs inside a backward pass (megatron's selective recompute re-runs
    core attention right before its backward): then the gathered K/V are used at once, and
    gathering them a third time in SDPA's backward would only cost a collective."""
    return torch._C._current_graph_task_id() >= 0


def _packed_layout(layout, cp_size, cp_rank, device):
    """(global position within its document, document index, real token?) per token of a rank,
    from the layout's host lists (no device read)."""
    positions, docs = [], []
    padded = [b - a for a, b in zip(layout.cu_q_padded, layout.cu_q_padded[1:])]
    for doc, length in enumerate(padded):
        if length % (2 * cp_size):
            raise ValueError(
                f"packed document {doc} has padded length {length}, not divisible by 2 x "
                f"context_parallel_size = {2 * cp_size} (pad cu_seqlens_q_padded to it)"
            )
        pos = zigzag_positions(length // cp_size, cp_size, cp_rank, device)
        positions.append(pos)
        docs.append(torch.full_like(pos, doc))
    pos, doc = torch.cat(positions), torch.cat(docs)
    valid = pos < torch.tensor(layout.lengths_q, device=device)[doc]
    return pos, doc, valid


# ------------------------------------------------------------------------------- batches


def get_batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """This CP rank's tokens of a batch of [b, s] tensors and an optional [b, 1, s, s]
    ``attention_mask`` (split along its query rows, as megatron does): megatron's load-balanced
    split; the batch itself at CP 1.

    Checks the sequence length first (megatron's own split fails with a reshape error).
    """
    from megatron.core import parallel_state

    group = cp_group or parallel_state.get_context_parallel_group()
    cp_size = group.size()
    if cp_size == 1:
        return batch
    for key, value in batch.items():
        seq_dim = 2 if key == "attention_mask" else 1  # megatron's sequence dim per key
        if (isinstance(value, torch.Tensor) and value.dim() > seq_dim
                and value.size(seq_dim) % (2 * cp_size)):
            raise ValueError(
                f"batch[{key!r}] has sequence length {value.size(seq_dim)}, not divisible by 2 x "
                f"context_parallel_size = {2 * cp_size}"
            )
    return _mcore_compat.get_batch_on_this_cp_rank(batch, group)


def get_packed_batch_on_this_cp_rank(tensor: torch.Tensor, cu_seqlens_padded, cp_group=None,
                                     dim: int = 0) -> torch.Tensor:
    """This CP rank's tokens of a packed tensor (all documents along ``dim``): every document
    (padded to a multiple of 2 x CP) split into 2 x CP chunks, chunks r and 2CP-1-r kept.

    megatron's per-document split needs Transformer Engine; this one is plain torch.
    """
    from megatron.core import parallel_state

    group = cp_group or parallel_state.get_context_parallel_group()
    cp_size, cp_rank = group.size(), group.rank()
    index = []
    for doc, (start, length) in enumerate(
        zip(cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded.diff().tolist())
    ):
        if length % (2 * cp_size):
            raise ValueError(
                f"packed document {doc} has padded length {length}, not divisible by 2 x "
                f"context_parallel_size = {2 * cp_size}"
            )
        index.append(start + zigzag_positions(length // cp_size, cp_size, cp_rank))
    return tensor.index_select(dim, torch.cat(index).to(tensor.device))


def check_supported(config, cp_comm_type) -> None:
    """Clear errors for CP options the sdpa backend does not implement."""
    if cp_comm_type not in SUPPORTED_CP_COMM_TYPES:
        raise NotImplementedError(
            f"SDPAttention's context parallelism all-gathers K/V: cp_comm_type={cp_comm_type!r} is "
            f"not supported (use None or 'all_gather', or the 'te' backend)"
        )
    if getattr(config, "hybrid_context_parallel", False):
        raise NotImplementedError(
            "SDPAttention does not support hybrid_context_parallel=True; use the 'te' backend"
        )
    kernel = getattr(config, "attention_kernel", "sdpa")
    if kernel == "varlen":
        # Each CP chunk attends a key range that ends with it (bottom-right aligned); the varlen
        # kernel's alignment for queries shorter than their keys has not run here (no GPU).
        raise NotImplementedError(
            f"attention_kernel='varlen' does not support context_parallel_size="
            f"{config.context_parallel_size}: under context parallelism use 'sdpa' or 'flex'"
        )
