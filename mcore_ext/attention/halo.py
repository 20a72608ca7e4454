"""Context parallelism for sliding-window layers: each chunk gets only the keys its window reaches.

Under megatron's load-balanced split CP rank r holds chunks r and 2CP-1-r of 2CP chunks (per document
of a packed batch). A causal window of ``left`` keys makes chunk i's queries need the ``left`` keys
before the chunk (a halo): the tail of chunk i-1 (and of earlier chunks when the window is longer
than a chunk), held by other ranks. Instead of all-gathering the whole sequence's K/V, as full layers
do, each rank receives exactly its chunks' halos point to point, attends each chunk to [halo; chunk]
(``sliding.attend``: ``2B`` keys per query), and in backward sends the halos' dK / dV back to their
owners, where they are summed with the owner's own dK / dV in fp32 and rounded once. Each part
comes rounded from its chunk's banded kernel (whose block-pair parts autograd adds in the activation
dtype, ``sliding``), as each rank's part of a full layer's reduce-scatter comes rounded from its
kernel.

K and V travel in their ng groups (never repeated per query head), stacked into one message per
peer. Who sends which rows to whom (``HaloPlan``) is host arithmetic on the split, the same on every
rank, made once per batch and window for every layer of the kind.

Shapes (megatron notation): s local tokens (2 chunks, per document when packed), c chunk length,
b batch, np / ng heads / groups on this TP rank, hn head dim; "ext" rows are the local chunks'
[halo; chunk] keys, one segment after the other.
"""

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Segment:
    """One local chunk: its query rows ``[q_start, q_start + length)`` of the local tokens, its
    keys ``[ext_start, ext_start + halo + length)`` of the ext rows (the halo first), and its first
    token's position in its document (``position``)."""

    q_start: int
    length: int
    ext_start: int
    halo: int
    position: int


@dataclasses.dataclass
class HaloPlan:
    """Every rank's halos, from the split alone.

    ``pieces``: the ext rows, in order, as (source, start, end): source -1 is this rank's local
    K/V, source p the rows received from CP rank p. ``sends``: per peer, the ranges of local rows it
    receives, in the order it expects them; ``recv_counts``: rows received per peer.
    """

    segments: list
    pieces: list
    sends: dict
    recv_counts: dict

    @property
    def ext_rows(self) -> int:
        return sum(end - start for _, start, end in self.pieces)


def owner(chunk: int, cp_size: int) -> int:
    """The CP rank holding chunk ``chunk`` of 2 x CP (megatron's load-balanced split)."""
    return chunk if chunk < cp_size else 2 * cp_size - 1 - chunk


def plan(chunk_lengths, cp_size: int, cp_rank: int, left: int) -> HaloPlan:
    """The halo plan of rank ``cp_rank`` for documents whose chunks are ``chunk_lengths`` long
    (one document of ``2 CP c`` tokens when unpacked), under a causal window of ``left`` keys.

    Every rank holds, per document in order, its chunks r and 2CP-1-r back to back. Every rank
    computes every rank's transfers in one fixed order, so sender and receiver agree.
    """
    doc_offsets, offset = [], 0
    for c in chunk_lengths:
        doc_offsets.append(offset)
        offset += 2 * c

    def local_row(doc, chunk):  # first row of a chunk on its owner
        c = chunk_lengths[doc]
        return doc_offsets[doc] + (0 if chunk < cp_size else c)

    segments, pieces, sends, recv_counts = [], [], {}, {}
    ext = 0
    for dst in range(cp_size):
        for doc, c in enumerate(chunk_lengths):
            if c == 0:
                continue
            for chunk in (dst, 2 * cp_size - 1 - dst):
                first = chunk * c
                start = max(0, first - left)
                halo = []  # (src, src rows) of this chunk's halo, in position order
                for prev in range(start // c, chunk):
                    lo = max(start, prev * c) - prev * c
                    row = local_row(doc, prev)
                    halo.append((owner(prev, cp_size), row + lo, row + c))
                if dst != cp_rank:
                    for src, lo, hi in halo:
                        if src == cp_rank:
                            sends.setdefault(dst, []).append((lo, hi))
                    continue
                segments.append(Segment(local_row(doc, chunk), c, ext, first - start, first))
                for src, lo, hi in halo:
                    if src == cp_rank:
                        pieces.append((-1, lo, hi))
                    else:
                        received = recv_counts.get(src, 0)
                        pieces.append((src, received, received + hi - lo))
                        recv_counts[src] = received + hi - lo
                row = local_row(doc, chunk)
                pieces.append((-1, row, row + c))
                ext += first - start + c
    return HaloPlan(segments, pieces, sends, recv_counts)


def _exchange(messages: dict, recv_counts: dict, like: torch.Tensor, group, dtype=None):
    """Send ``messages[p]`` to CP rank p and receive ``recv_counts[p]`` rows from each p, all
    at once; rows shaped like ``like``'s [2, rows, ...]."""
    dtype = dtype or like.dtype
    received = {p: like.new_empty((2, n, *like.shape[2:]), dtype=dtype)
                for p, n in recv_counts.items()}
    ops = [dist.P2POp(dist.isend, m.contiguous(), dist.get_global_rank(group, p), group)
           for p, m in messages.items()]
    ops += [dist.P2POp(dist.irecv, r, dist.get_global_rank(group, p), group)
            for p, r in received.items()]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


class _HaloKV(torch.autograd.Function):
    """local K, V [s, ...] -> ext K, V [ext rows, ...]: the local chunks with their halos in front.

    Backward: the ext rows' gradients go back where the rows came from (halo rows to the rank that
    sent them), and every local row's gradient (its uses in its own chunk and in each halo that
    held it, each rounded once by the banded kernel) is summed in fp32 and rounded once, as the
    all-gather's reduce-scatter does for full layers.
    """

    @staticmethod
    def forward(ctx, k, v, halo_plan, group):
        ctx.plan, ctx.group, ctx.shape, ctx.dtype = halo_plan, group, k.shape, k.dtype
        kv = (k, v)
        messages = {p: torch.stack([torch.cat([x[lo:hi] for lo, hi in ranges]) for x in kv])
                    for p, ranges in halo_plan.sends.items()}
        received = _exchange(messages, halo_plan.recv_counts, k.unsqueeze(0), group)
        outs = []
        for i, x in enumerate(kv):
            parts = [x[lo:hi] if src < 0 else received[src][i, lo:hi]
                     for src, lo, hi in halo_plan.pieces]
            outs.append(torch.cat(parts))
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        halo_plan = ctx.plan
        grads = torch.stack([grad_k, grad_v]).float()  # [2, ext rows, ...]
        local = grads.new_zeros((2, *ctx.shape))
        returned = {p: grads.new_empty((2, n, *grads.shape[2:]))
                    for p, n in halo_plan.recv_counts.items()}
        row = 0
        for src, lo, hi in halo_plan.pieces:
            part = grads[:, row:row + hi - lo]
            if src < 0:
                local[:, lo:hi] += part
            else:
                returned[src][:, lo:hi] = part
            row += hi - lo
        # What others received from here comes back as their fp32 gradients.
        sent_counts = {p: sum(hi - lo for lo, hi in ranges)
                       for p, ranges in halo_plan.sends.items()}
        back = _exchange(returned, sent_counts, local, ctx.group)
        for p, ranges in halo_plan.sends.items():
            row = 0
            for lo, hi in ranges:
                local[:, lo:hi] += back[p][:, row:row + hi - lo]
                row += hi - lo
        local = local.to(ctx.dtype)
        return local[0], local[1], None, None


def halo_kv(k, v, halo_plan: HaloPlan, group):
    """[s, ...] local K and V -> [ext rows, ...] each (see ``HaloPlan``)."""
    return _HaloKV.apply(k, v, halo_plan, group)


def elements_moved(halo_plan: HaloPlan, row_numel: int) -> int:
    """K and V elements this rank receives in a forward (sent back as gradients in backward)."""
    return 2 * row_numel * sum(halo_plan.recv_counts.values())
