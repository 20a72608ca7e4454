"""The attention probe: attention sinks and massive activations, measured on one batch.

What the head-wise gate is adopted for (Qiu et al., 2025, "Gated Attention for Large Language
Models") shows in attention itself: without a gate, heads put a large share of their attention on
the first token (an *attention sink*) and a few activations of the residual stream grow huge
("massive activations"); with the gate both shrink. This module measures both on one batch, per
layer, from the layer's own q and k:

- ``first_token_share``: the mean attention probability of the sequence's first token, over every
  query (its row of the softmax over the keys it may see) and head;
- ``doc_first_token_share`` (packed batches): the same for the first token of each query's own
  document;
- ``sink_rate``: the share of heads whose mean attention to the first token exceeds
  ``SINK_THRESHOLD`` = 0.3 (Gu et al., ICLR 2025, "When Attention Sink Emerges in Language
  Models", their epsilon);
- ``gate_mean_per_head`` (gated layers): each head's mean gate (sigmoid) over the batch's tokens;
- ``head_output_max``: each head's largest |value| of its (gated) attention output, what
  linear_proj reads: a head whose gate is 0 contributes 0;
- ``residual_max`` / ``attn_output_max``: the largest |value| of the residual stream after the
  layer (a hybrid model: after its attention and after its MLP layer) and of the attention
  block's output (linear_proj's, its bias added).

The probabilities are recomputed in fp32 from the q and k core attention receives (after q / k
norms and RoPE), so every backend (sdpa, flex, varlen, local, te) is measured alike, with the
layer's own mask: causal, its window (sliding layers), packed documents (padding slots are no
query and no key). Under context parallelism k is gathered over the CP group and every token put
at its global position (megatron's load-balanced split), so the figures are CP 1's. Each rank
measures its heads (TP), tokens (CP), layers (PP); ``gather`` combines every rank's part. Only
the first data-parallel replica measures (every replica runs the same batch).

``AttentionProbe.recording()`` hooks the model for one forward pass and unhooks it after: the
probe costs nothing between probe batches.

Shapes (megatron notation): sq / sk queries / keys, b batch, np / ng query heads / key-value groups
on this rank, hn head dim, t tokens of a packed (THD) batch; S = CP x s gathered tokens.
"""

import contextlib
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_pg_rank, get_pg_size, unwrap_model

from mcore_ext.attention.context_parallel import _packed_layout, allowed_mask, zigzag_positions
from mcore_ext.attention.layout import layout_for

SINK_THRESHOLD = 0.3  # Gu et al.'s epsilon: a head is a sink head above it
# Elements of one block of fp32 scores ([b, np, queries, sk]): bounds the probe's memory.
BLOCK_ELEMENTS = 1 << 24
_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def attention_layers(model) -> dict:
    """{key: (self-attention module, [layer modules])} of this rank's model: the key is the GPT
    layer number (a hybrid model's attention layer counted as the GPT layer it stands for), or
    ``mtpN`` for the N-th MTP depth's; the layer modules are the one holding the attention and, in
    a hybrid model, its MLP layer (the next with the same GPT layer number)."""
    modules = dict(unwrap_model(model).named_modules())
    found = {}
    for name, module in modules.items():
        if not isinstance(module, SelfAttention):
            continue
        parent = name.rpartition(".")[0]
        layer = modules.get(parent)
        key = str(getattr(layer, "gpt_layer_number", module.layer_number))
        if ".mtp." in f".{name}.":  # mtp.layers.<depth>. ... (a hybrid depth's has layers inside)
            key = f"mtp{name.split('mtp.layers.', 1)[1].split('.')[0]}"
        layers = [layer] if layer is not None else []
        number = getattr(layer, "gpt_layer_number", None)
        if number is not None:  # a hybrid attention layer: its MLP layer is a sibling
            container = parent.rpartition(".")[0]
            layers += [m for n, m in modules.items() if m is not layer
                       and n.rpartition(".")[0] == container
                       and getattr(m, "gpt_layer_number", None) == number]
        found[key] = (module, layers)
    return found


def layer_order(key: str):
    """Sort key of ``attention_layers``' keys: decoder layers by number, then MTP depths."""
    return key.startswith("mtp"), int(key.lstrip("mtp"))


# ------------------------------------------------------------------------------------ figures


def first_token_shares(q, k, q_pos, k_pos, *, causal=True, window=None, scale=None, q_doc=None,
                       k_doc=None, q_valid=None, k_valid=None, keep=None) -> dict:
    """Attention probabilities of the first tokens, summed over the queries.

    q [b, np, sq, hn], k [b, ng, sk, hn] (any dtype; computed in fp32), q_pos [sq] / k_pos [sk]
    each token's position in its document, q_doc / k_doc its document (default: all one),
    q_valid / k_valid real tokens (default: all), keep an optional [b or 1, 1, sq, sk] boolean
    (True = may attend). A query attends the keys ``allowed_mask`` allows (causal, megatron's
    window (left, right), same document, a real key). Returns, per head (float64 [np]):
    ``share``, the sum over the batch's counted queries of P(key at position 0 of document 0);
    ``doc_share``, of P(key at position 0 of the query's document); and ``queries``, how many
    were counted (real queries that see at least one key, times b).
    """
    b, heads, sq, hn = q.shape
    groups, sk = k.size(1), k.size(2)
    scale = scale if scale is not None else 1.0 / math.sqrt(hn)
    device = q.device
    q_doc = torch.zeros(sq, dtype=torch.long, device=device) if q_doc is None else q_doc
    k_doc = torch.zeros(sk, dtype=torch.long, device=device) if k_doc is None else k_doc
    q_valid = torch.ones(sq, dtype=torch.bool, device=device) if q_valid is None else q_valid
    allowed = allowed_mask(q_pos, k_pos, causal, window, q_doc, k_doc, k_valid)  # [sq, sk]
    allowed = allowed.unsqueeze(0).expand(b, sq, sk)
    if keep is not None:
        allowed = allowed & keep.bool()[:, 0].expand(b, sq, sk)
    counted = allowed.any(-1) & q_valid  # [b, sq]
    first = (k_pos == 0) & (k_doc == 0)  # [sk]
    own_first = (k_pos == 0).unsqueeze(0) & (q_doc.unsqueeze(1) == k_doc.unsqueeze(0))  # [sq, sk]
    # [b, ng, np/ng, sq, hn]: each group's query heads against its own keys, no repeated k
    q = q.float().unflatten(1, (groups, heads // groups))
    k = k.float()
    share = torch.zeros(heads, dtype=torch.float64, device=device)
    doc_share = torch.zeros(heads, dtype=torch.float64, device=device)
    rows = max(1, BLOCK_ELEMENTS // max(1, b * heads * sk))
    for start in range(0, sq, rows):
        part = slice(start, start + rows)
        scores = torch.einsum("bgrqd,bgkd->bgrqk", q[:, :, :, part], k) * scale
        mask = allowed[:, part].unsqueeze(1).unsqueeze(1)  # [b, 1, 1, rows, sk]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        probs = probs.nan_to_num(0.0).flatten(1, 2)  # [b, np, rows, sk]; rows of no key: 0
        weight = counted[:, part].unsqueeze(1).double()  # [b, 1, rows]
        share += (probs[..., first].sum(-1).double() * weight).sum((0, 2))
        doc_share += ((probs * own_first[part]).sum(-1).double() * weight).sum((0, 2))
    return dict(share=share, doc_share=doc_share, queries=int(counted.sum()))


def _local_geometry(query, key, packed_seq_params, cp_group):
    """The probe's view of one core-attention call: q [b, np, sq, hn] and k [b, ng, sk, hn]
    (k gathered over the CP group), every token's position in its document, document and
    whether it is real, for queries and keys; and ``packed``."""
    packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    cp = cp_group.size() if cp_group is not None else 1
    device = query.device
    if packed:  # [t, n, hn] -> [1, n, t, hn]
        layout = layout_for(packed_seq_params)
        if not layout.self_attention:
            raise NotImplementedError("the attention probe measures packed self-attention only")
        if cp > 1:
            parts = [_packed_layout(layout, cp, r, device) for r in range(cp)]
            q_pos, q_doc, q_valid = parts[cp_group.rank()]
            k_pos, k_doc, k_valid = (torch.cat(p) for p in zip(*parts))
            key = _gather(key, cp_group)
        else:
            doc = layout.document_ids(query.size(0), device).long()
            starts = torch.tensor(layout.starts_q, device=device)
            q_valid = doc >= 0
            q_doc = doc
            q_pos = torch.arange(query.size(0), device=device) - starts[doc.clamp(min=0)]
            k_pos, k_doc, k_valid = q_pos, q_doc, q_valid
        q, k = query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0)
        return q, k, (q_pos, q_doc, q_valid), (k_pos, k_doc, k_valid), True
    # [s, b, n, hn] -> [b, n, s, hn]
    sq, sk = query.size(0), key.size(0)
    if cp > 1:
        q_pos = zigzag_positions(sq, cp, cp_group.rank(), device)
        k_pos = torch.cat([zigzag_positions(sk, cp, r, device) for r in range(cp)])
        key = _gather(key, cp_group)
    else:  # megatron's alignment: query i at key position i + sk - sq
        q_pos = torch.arange(sk - sq, sk, device=device)
        k_pos = torch.arange(sk, device=device)
    q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
    return q, k, (q_pos, None, None), (k_pos, None, None), False


def _gather(x, group):
    """[s, ...] of each CP rank -> [CP x s, ...] in rank order (no autograd: the probe's own)."""
    x = x.contiguous()
    out = x.new_empty(group.size() * x.size(0), *x.shape[1:])
    dist.all_gather_into_tensor(out, x, group=group)
    return out


# ------------------------------------------------------------------------------------- probe


class _LayerTally:
    """One attention layer's sums on this rank since the last ``take``."""

    def __init__(self, tp_rank: int, tp_size: int):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.first_head = self.heads = None  # this rank's first query head, the layer's total
        self.share = self.doc_share = self.gate = self.head_out = None
        self.queries = self.gate_tokens = 0
        self.residual = self.attn_out = 0.0
        self.packed = False
        self.pending_gate = None  # [sq, b, np] / [t, 1, np] sigmoids, until core attention runs

    def part(self) -> dict:
        listed = lambda x: None if x is None else x.tolist()  # noqa: E731
        return dict(first_head=self.first_head, heads=self.heads, share=listed(self.share),
                    doc_share=listed(self.doc_share), queries=self.queries,
                    gate=listed(self.gate), gate_tokens=self.gate_tokens,
                    head_out=listed(self.head_out), residual=self.residual,
                    attn_out=self.attn_out, packed=self.packed)


class AttentionProbe:
    """Hooks on every self-attention layer of ``model`` (this rank's) that measure the module
    docstring's figures while ``recording()`` is active."""

    def __init__(self, model):
        self.layers = attention_layers(model)
        self.tallies: dict[str, _LayerTally] = {}
        # Every data-parallel replica runs the same probe batch: the first one measures.
        self.contributes = parallel_state.get_data_parallel_rank() == 0
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None

    @contextlib.contextmanager
    def recording(self):
        """Hook the model for the forward passes inside; unhooked after."""
        handles = []
        if self.contributes:
            for key, (attention, layers) in self.layers.items():
                handles += self._hook(key, attention, layers)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, key, attention, layers):
        tp = attention.pg_collection.tp
        tally = self.tallies.setdefault(key, _LayerTally(get_pg_rank(tp), get_pg_size(tp)))
        handles = [attention.core_attention.register_forward_pre_hook(
            lambda module, args, kwargs: self._core_attention(tally, module, args, kwargs),
            with_kwargs=True)]
        if getattr(attention, "head_wise_attn_gate", False):
            rows = attention.gate_rows_per_partition
            handles.append(attention.linear_qkv.register_forward_hook(
                lambda module, args, output: setattr(
                    tally, "pending_gate", torch.sigmoid(_first(output)[..., -rows:].float()))))
        handles.append(attention.linear_proj.register_forward_pre_hook(
            lambda module, args: _head_output(tally, args[0])))
        handles.append(attention.register_forward_hook(
            lambda module, args, output: _attention_output(tally, output)))
        for layer in layers:
            handles.append(layer.register_forward_hook(
                lambda module, args, output: _residual(tally, output)))
        return handles

    @torch.no_grad()
    def _core_attention(self, tally, core, args, kwargs):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        mask_type = kwargs.get("attn_mask_type") or core.attn_mask_type
        params = kwargs.get("packed_seq_params")
        config = core.config
        q, k, (q_pos, q_doc, q_valid), (k_pos, k_doc, k_valid), packed = _local_geometry(
            query, key, params, self.cp_group)
        # This rank's query heads: TP rank r computes heads [r np, (r + 1) np) (with fewer query
        # groups than ranks too: the gated layer keeps the heads of its gate rows).
        local = q.size(1)
        tally.first_head, tally.heads = tally.tp_rank * local, tally.tp_size * local
        keep = None
        if mask is not None and not packed:
            if self.cp_group is not None:
                raise NotImplementedError("the attention probe under context parallelism builds "
                                          "its masks from positions: no attention_mask")
            keep = ~mask.bool()
        window = tuple(config.window_size) if config.window_size is not None else None
        sums = first_token_shares(
            q, k, q_pos, k_pos, causal=mask_type in _CAUSAL, window=window,
            scale=config.softmax_scale, q_doc=q_doc, k_doc=k_doc, q_valid=q_valid,
            k_valid=k_valid, keep=keep)
        tally.share = _add(tally.share, sums["share"])
        tally.doc_share = _add(tally.doc_share, sums["doc_share"])
        tally.queries += sums["queries"]
        tally.packed |= packed
        gate, tally.pending_gate = tally.pending_gate, None
        if gate is not None:  # [sq, b, np] or [t, 1, np]; padding slots left out
            weight = (q_valid if q_valid is not None
                      else torch.ones(gate.size(0), dtype=torch.bool, device=gate.device))
            weight = weight.view(-1, *([1] * (gate.dim() - 1))).double()
            tally.gate = _add(tally.gate, (gate.double() * weight).flatten(0, -2).sum(0))
            tally.gate_tokens += int(weight.sum()) * gate[0].numel() // gate.size(-1)

    def take(self) -> dict:
        """{layer key: this rank's sums} since the last take (nothing on replicas that do not
        measure)."""
        parts = {key: tally.part() for key, tally in self.tallies.items() if tally.share is not None}
        self.tallies = {}
        return parts

    def gather(self) -> dict:
        """Every rank's sums combined into the figures (``combine``), on every rank. Collective
        over every rank: each calls it after the probe batch."""
        mine = self.take()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return combine(every)


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _add(total, value):
    return value.detach().clone() if total is None else total + value


@torch.no_grad()
def _head_output(tally, x):
    """linear_proj's input [sq, b, np * hn] (THD: [t, 1, np * hn]): each head's largest |x|."""
    heads = tally.heads // tally.tp_size  # core attention ran first: its query heads
    largest = x.detach().unflatten(-1, (heads, -1)).abs().float().amax(dim=(0, 1, 3)).double()
    tally.head_out = largest if tally.head_out is None else torch.maximum(tally.head_out, largest)


@torch.no_grad()
def _attention_output(tally, output):
    out, bias = (output if isinstance(output, (tuple, list)) else (output, None))[:2]
    if bias is not None:
        out = out + bias
    tally.attn_out = max(tally.attn_out, float(out.detach().abs().max()))


@torch.no_grad()
def _residual(tally, output):
    tally.residual = max(tally.residual, float(_first(output).detach().abs().max()))


# ----------------------------------------------------------------------------------- combine


def combine(parts: list) -> dict:
    """Every rank's ``take()`` -> the figures: per layer (``layers``, by key) and over the decoder's
    layers (MTP depths left out): ``first_token_share`` (mean over every head of every layer),
    ``sink_rate`` (share of those heads above ``SINK_THRESHOLD``), ``max_activation`` (the
    residual stream's largest |value|), ``max_attn_output``, and with packed documents
    ``doc_first_token_share``, with gates ``gate_mean``. Empty when nothing was measured."""
    sums = {}
    for rank_parts in parts:
        for key, part in (rank_parts or {}).items():
            heads = part["heads"]
            total = sums.setdefault(key, dict(
                share=[0.0] * heads, doc_share=[0.0] * heads, queries=[0] * heads,
                gate=[0.0] * heads, gate_tokens=[0] * heads, head_out=[0.0] * heads,
                residual=0.0, attn_out=0.0, packed=False, gated=False))
            for i, head in enumerate(range(part["first_head"],
                                           part["first_head"] + len(part["share"]))):
                total["share"][head] += part["share"][i]
                total["doc_share"][head] += part["doc_share"][i]
                total["queries"][head] += part["queries"]
                if part["gate"] is not None:
                    total["gate"][head] += part["gate"][i]
                    total["gate_tokens"][head] += part["gate_tokens"]
                if part["head_out"] is not None:
                    total["head_out"][head] = max(total["head_out"][head], part["head_out"][i])
            total["residual"] = max(total["residual"], part["residual"])
            total["attn_out"] = max(total["attn_out"], part["attn_out"])
            total["packed"] |= part["packed"]
            total["gated"] |= part["gate"] is not None
    layers = {}
    for key in sorted(sums, key=layer_order):
        total = sums[key]
        per_head = [s / max(n, 1) for s, n in zip(total["share"], total["queries"])]
        figures = dict(
            first_token_share=sum(per_head) / len(per_head),
            sink_rate=sum(s > SINK_THRESHOLD for s in per_head) / len(per_head),
            residual_max=total["residual"], attn_output_max=total["attn_out"],
            first_token_share_per_head=per_head, head_output_max=total["head_out"])
        if total["packed"]:
            figures["doc_first_token_share"] = sum(
                s / max(n, 1) for s, n in zip(total["doc_share"], total["queries"])) / len(per_head)
        if total["gated"]:
            gates = [g / max(n, 1) for g, n in zip(total["gate"], total["gate_tokens"])]
            figures["gate_mean"] = sum(gates) / len(gates)
            figures["gate_mean_per_head"] = gates
        layers[key] = figures
    main = [f for key, f in layers.items() if not key.startswith("mtp")]
    if not main:
        return {"layers": layers} if layers else {}
    heads = [s for f in main for s in f["first_token_share_per_head"]]
    out = dict(first_token_share=sum(heads) / len(heads),
               sink_rate=sum(s > SINK_THRESHOLD for s in heads) / len(heads),
               max_activation=max(f["residual_max"] for f in main),
               max_attn_output=max(f["attn_output_max"] for f in main))
    if all("doc_first_token_share" in f for f in main):
        out["doc_first_token_share"] = _head_weighted(main, "doc_first_token_share")
    if all("gate_mean" in f for f in main):
        out["gate_mean"] = _head_weighted(main, "gate_mean")
    out["layers"] = layers
    return out


def _head_weighted(layers, name):
    """A per-layer mean over heads, as a mean over every head of the layers."""
    heads = [len(f["first_token_share_per_head"]) for f in layers]
    return sum(f[name] * n for f, n in zip(layers, heads)) / sum(heads)
