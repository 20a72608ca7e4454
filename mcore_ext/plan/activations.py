"""Activation memory per rank and micro-batch, from the layer shapes.

What each module of this project's megatron model saves for backward (bf16 / fp16 activations,
the ``sdpa`` backend, flash-style kernels that keep no ``s x s`` scores), per token of the rank:

    norm (input, pre-MLP, q / k, final, MTP)   its input as fp32 and the fp32 normalized value
                                               (8 bytes per element) + an fp32 1/rms per token
    linear layers                              their input (with sequence parallelism the local
                                               shard: megatron gathers it again in backward)
    linear_qkv's output                        kept whole (q / k / v are views of it), but not
                                               by a banded sliding layer (block copies)
    core attention (SDPA)                      q and k after RoPE, the output, fp32 log-sum-exp
    head-wise gate                             the fp32 sigmoid per head (the gated output is
                                               recomputed in backward)
    SwiGLU MLP / expert                        fc1's output, SiLU's output, the product, fc2's
                                               input (HF's clamp: two clamped copies more)
    router                                     fp32 scores [T, E], top-k probabilities, indices,
                                               and the dispatcher's sort indices [T, E], [T k]
    routed experts                             per routed copy: the token (h) and its expert's
                                               SwiGLU activations, plus its fp32 probability
    loss                                       the fp32 softmax [s, b, V / TP] per output head

Attention cost by kind:

    full layer      the above; under CP the all-gathered K/V of one layer live only while it
                    runs (they are gathered again in backward, not saved)
    sliding layer   ``banded`` (blocks of B ~ window: each block attends to itself and the one
                    before): q cut into blocks, K / V as [previous; own] block pairs
                    (2x), the blocks' output; under CP a halo of ``window - 1`` keys
                    per chunk, not the gathered sequence (only the blocks are saved, never the
                    [halo; chunk] K/V). ``masked`` (one dense [s, s] additive mask per batch,
                    shared by the layers of the kind; under CP one per local chunk).
    causal masks    on a CPU, under CP, the two local chunks' causal masks against their key
                    prefixes are materialized once per batch (a GPU's flash kernel needs none)

Recompute: ``selective`` (megatron's default module, core attention) keeps the core attention's
inputs, which other modules save anyway, and drops what SDPA saves beyond them; ``full`` keeps
each layer's input and recomputes one layer at a time in backward.

Packed documents (``Workload.packed``: chat SFT, ``data.document_masking``): a micro-batch of b
rows of s tokens is one THD sequence of b x s tokens, each document attending only to itself
(cu_seqlens). Every term above is per token, so a packed row holds what one s-token sequence
holds: on a GPU the plan assumes kernels that store no scores (``flex``, ``varlen``, Transformer
Engine's fused attention), for which per-document attention changes the compute (the sum of
t_i^2 over documents instead of s^2 per row), not what is saved. On a CPU (``Workload.cpu``)
the ``sdpa`` kernel's per-document calls take torch's math path, which saves each document's
scores: with ``Workload.documents`` (one row's document lengths t_i) the plan counts
``heads x sum(t_i^2)`` per row at fp32 + the activation dtype on full layers, and on sliding
layers for the documents too short to be banded (t_i <= 2 B). The ``masked`` sliding kernel is
counted at one [s, s] mask (a document as long as the row), and under CP megatron pads every
document to a multiple of 2 x CP inside the row's s tokens (no more tokens per rank).

A Step-3.7 model's vision tower and projector (``ModelShape.vision``, the first stage) add
what ``vision_bytes`` lists for the micro-batch's images (``Workload.images``): nothing but the
projector's input when the tower is frozen (it runs without a graph), its layers' activations
per patch when trained, for every view on every CP rank (the tower is not split over CP), the
patches split over TP under sequence parallelism. The tower's peak while it runs (before the
text layers' forward, after their backward) sits beside its own saved tensors alone.

Tokens: a rank holds ``s x b / CP`` tokens; norms (and linear inputs after them) hold
``1 / TP`` of them under sequence parallelism; a MoE layer's router sees the rank's sequence
shard, and its experts receive ``T x k x ETP x load`` routed copies (``load`` 1 = balanced,
``"worst"`` = the dropless worst case, every token of the EP group routed to this rank's
experts, at most ``min(k, E / EP)`` copies each).
"""

from dataclasses import dataclass, field
from typing import Optional, Union

from mcore_ext.plan.shape import LayerShape, ModelShape

FP32, INT64 = 4, 8
RECOMPUTE = ("none", "selective", "full")
SLIDING_KERNELS = ("banded", "masked")


@dataclass(frozen=True)
class Layout:
    """A parallel layout (world = TP x CP x PP x DP; EP x ETP divides TP x CP x DP)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None = TP
    dp: int = 1
    sequence_parallel: Optional[bool] = None  # None = on when TP > 1
    distributed_optimizer: bool = True

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP {self.vpp}")
        parts += [f"CP {self.cp}", f"EP {self.ep}"]
        if self.expert_tp != self.tp:
            parts.append(f"ETP {self.expert_tp}")
        parts.append(f"DP {self.dp}")
        return " x ".join(parts[:2]) + " " + ", ".join(parts[2:])


@dataclass(frozen=True)
class Workload:
    """What one micro-batch asks of the activations."""

    seq: int
    micro_batch: int = 1
    recompute: str = "none"
    expert_load: Union[float, str] = 1.0  # busiest rank's routed copies / balanced, or "worst"
    dtype_bytes: int = 2  # bf16 / fp16 activations
    sliding_kernel: str = "banded"
    cpu: bool = False  # on a CPU (gloo): CP's causal chunk masks are materialized, and the
    # MoE dispatcher's uneven collectives at TP > 1 pad and copy (mcore_ext._cpu_compat)
    num_microbatches: Optional[int] = None  # caps the micro-batches a pipeline stage holds
    packed: bool = False  # rows of packed documents (THD, per-document attention): see the module
    documents: Optional[tuple] = None  # one packed row's document lengths (the CPU scores term)
    images: tuple = ()  # a vision model's views per micro-batch: ((side in pixels, count), ...)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.sliding_kernel not in SLIDING_KERNELS:
            raise ValueError(f"sliding_kernel={self.sliding_kernel!r} is not one of "
                             f"{SLIDING_KERNELS}")
        if self.expert_load != "worst" and not (isinstance(self.expert_load, (int, float))
                                                and self.expert_load >= 1):
            raise ValueError(f"expert_load={self.expert_load!r}: a factor >= 1 or 'worst'")


@dataclass
class Breakdown:
    """Bytes by named term (saved for backward), plus the transient the term's backward adds."""

    terms: dict = field(default_factory=dict)

    def add(self, name: str, nbytes: float) -> None:
        if nbytes:
            self.terms[name] = self.terms.get(name, 0) + nbytes

    def merge(self, other: "Breakdown", scale: float = 1.0) -> None:
        for name, nbytes in other.terms.items():
            self.add(name, nbytes * scale)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _tokens(shape: ModelShape, layout: Layout, work: Workload):
    """(tokens of the CP rank, tokens of its sequence-parallel shard)."""
    if work.seq % (2 * layout.cp if layout.cp > 1 else 1):
        raise ValueError(f"seq={work.seq} is not divisible by 2 x CP = {2 * layout.cp}")
    n = work.seq * work.micro_batch // layout.cp
    return n, (n // layout.tp if layout.sp else n)


def _norm(out: Breakdown, name: str, tokens: float, width: float, frozen: bool = False
          ) -> None:
    """A zero-centered (or plain) norm computed in fp32: input as fp32, normalized, 1/rms; a
    frozen norm weight (LoRA) needs no gradient, so its product keeps no normalized value."""
    out.add(name, tokens * ((1 if frozen else 2) * FP32 * width + FP32))


def _swiglu(out: Breakdown, name: str, tokens: float, width: float, clamp: bool, b: int,
            probs: bool = False, frozen_fc2: bool = False) -> None:
    """fc1's output [2f], SiLU's output, the product and fc2's input; a routed expert scales the
    activation by its probability (one more [f]); HF's clamp keeps two clamped copies. A frozen
    fc2 without an adapter (LoRA) does not save its input."""
    copies = 2 + 3 + (1 if probs else 0) + (2 if clamp else 0) - (1 if frozen_fc2 else 0)
    out.add(name, tokens * b * copies * width)


QKV_TARGETS = ("q_proj", "k_proj", "v_proj", "g_proj")


def _adapted(shape: ModelShape, *targets) -> bool:
    """Whether a LoRA run adapts one of ``targets`` (without LoRA every linear is trained)."""
    return not shape.lora_rank or any(t in shape.lora_targets for t in targets)


def lora_bytes(shape: ModelShape, layer: LayerShape, layout: Layout, work: Workload
               ) -> Breakdown:
    """What a layer's adapters save: the rank-r intermediates for B's gradient, r wide per
    target (a column-parallel linear's ``A x`` over the whole sequence, gathered under SP; a
    row-parallel one's reduced and, under SP, scattered ``A x``; a routed expert's per routed
    token copy), and each column-parallel target's update (``index_add`` keeps its source; a
    routed expert's adapter covers its whole fc1, no index_add). A's gradient needs the linear's
    input, which the adapter saves in place of its frozen base (counted as the linear's input).
    On a MoE layer gate / up / down_proj adapt the shared expert."""
    n, n_sp = _tokens(shape, layout, work)
    out = Breakdown()
    if not shape.lora_rank:
        return out
    targets = [t for t in shape.lora_targets if t != "g_proj" or layer.gate]
    column = [t for t in targets if t in QKV_TARGETS + ("gate_proj", "up_proj")]
    row = [t for t in targets if t in ("o_proj", "down_proj")]
    ffn = layer.shared_ffn if layer.moe else layer.ffn
    if not ffn:  # a MoE layer without a shared expert
        column = [t for t in column if t in QKV_TARGETS]
        row = [t for t in row if t == "o_proj"]
    if not shape.gated_mlp:  # fc1 is up_proj alone
        column = [t for t in column if t != "gate_proj"]
    out.add("LoRA A x", work.dtype_bytes * shape.lora_rank * (len(column) * n + len(row) * n_sp))
    # A column-parallel target's update B A x lands at its columns through index_add, whose
    # autograd saves the update (its source) whole: [tokens, the target's rows on the rank].
    rows = dict(q_proj=layer.heads * layer.head_dim, k_proj=layer.groups * layer.head_dim,
                v_proj=layer.groups * layer.head_dim, g_proj=layer.heads, gate_proj=ffn,
                up_proj=ffn)
    out.add("LoRA updates (index_add)",
            n * work.dtype_bytes * sum(rows[t] for t in column) / layout.tp)
    experts = [t for t in targets if t.startswith("experts.")] if layer.moe else []
    if experts:  # fc1's and fc2's A x, r wide per routed copy (expert TP 1)
        copies = routed_copies(layer, layout, n_sp, work.expert_load)
        out.add("LoRA experts' A x", copies * work.dtype_bytes * shape.lora_rank * len(experts))
    return out


def attention_bytes(shape: ModelShape, layer: LayerShape, layout: Layout, work: Workload
                    ) -> Breakdown:
    """What one attention sub-layer (input norm to linear_proj) saves on a rank."""
    n, n_sp = _tokens(shape, layout, work)
    b, h, d, tp = work.dtype_bytes, shape.hidden, layer.head_dim, layout.tp
    heads = layer.heads / tp
    groups = layer.groups / tp if layer.groups >= tp else 1  # fewer groups: its own, gathered
    out = Breakdown()
    frozen = bool(shape.lora_rank)
    first = frozen and layer.index == 0
    if not first:  # LoRA: the frozen embedding's output needs no gradient, nor its norm's
        _norm(out, "input norm", n_sp, h, frozen)
    if _adapted(shape, *QKV_TARGETS):  # a frozen linear saves no input (megatron)
        out.add("linear_qkv input", n_sp * b * h)
    elif first:  # nothing before linear_proj needs a gradient: its adapter's input alone
        out.add("core attention output", n * b * heads * d)
        return out
    qkv_cols = (layer.heads + 2 * layer.groups) * d / (tp if layer.groups >= tp else 1)
    gate_cols = heads if layer.gate else 0
    banded = layer.sliding and work.sliding_kernel == "banded" and layer.window is not None
    if layer.qk_norm:
        _norm(out, "q / k norms", n * (heads + groups), d, frozen)  # 1/rms per head
    if banded and work.recompute != "selective":
        # The banded kernel saves its blocks: q cut into blocks, K / V as block pairs (2x), the
        # output; neither linear_qkv's output nor q / k after RoPE stay saved (nor, under CP,
        # the [halo; chunk] K/V).
        out.add("sliding blocks", n * b * (heads + 4 * groups) * d + n * b * heads * d)
    else:
        # SDPA (or selective recompute's checkpoint) saves q and k after RoPE and v, a view of
        # linear_qkv's output, which stays saved through it.
        out.add("linear_qkv output", n * b * (qkv_cols + gate_cols))
        out.add("q, k after RoPE", n * b * (heads + groups) * d)
    out.add("core attention output", n * b * heads * d)
    if work.recompute != "selective":
        out.add("log-sum-exp", n * FP32 * heads)
    if layer.gate:
        out.add("gate sigmoid", n * FP32 * heads)
    if work.packed and work.cpu and work.documents:
        out.add("packed scores (CPU sdpa)", _packed_scores(layer, layout, work) * (FP32 + b))
    return out


def _packed_scores(layer: LayerShape, layout: Layout, work: Workload) -> float:
    """Score elements the CPU sdpa kernel saves for one micro-batch of packed rows: heads x t^2
    per document it attends whole (every document of a full layer; a sliding layer's documents
    too short for the banded kernel)."""
    from mcore_ext.attention.sliding import block_size

    if layer.sliding and layer.window is not None:
        short = 2 * block_size(layer.window - 1)
        lengths = [t for t in work.documents if t <= short]
    else:
        lengths = list(work.documents)
    rows = work.micro_batch / layout.cp
    return layer.heads / layout.tp * rows * sum(t * t for t in lengths)


def mlp_bytes(shape: ModelShape, layer: LayerShape, layout: Layout, work: Workload
              ) -> Breakdown:
    """What one MLP / MoE sub-layer (pre-MLP norm to fc2) saves on a rank."""
    n, n_sp = _tokens(shape, layout, work)
    b, h, tp = work.dtype_bytes, shape.hidden, layout.tp
    out = Breakdown()
    lora = bool(shape.lora_rank)
    _norm(out, "pre-MLP norm", n_sp, h, lora)
    if not layer.moe:
        if _adapted(shape, "gate_proj", "up_proj"):
            out.add("MLP input", n_sp * b * h)
        _swiglu(out, "MLP", n, layer.ffn / tp, layer.clamp, b,
                frozen_fc2=not _adapted(shape, "down_proj"))
        return out
    # LoRA: the router, shared expert and experts are frozen; an adapted linear's adapter saves
    # its input (the shared expert's gate / up / down_proj, the routed experts' gate_up_proj /
    # down_proj)
    if _adapted(shape, "gate_proj", "up_proj") and (not lora or layer.shared_ffn):
        out.add("MLP input", n_sp * b * h)
    e, k, etp = layer.experts, layer.topk, layout.expert_tp
    if layer.shared_ffn:
        _swiglu(out, "shared expert", n, layer.shared_ffn / tp, layer.clamp, b,
                frozen_fc2=not _adapted(shape, "down_proj"))
    tokens = n_sp  # the router sees the rank's sequence shard
    out.add("router", tokens * (FP32 * e + FP32 + FP32 * k + INT64 * k))
    out.add("dispatcher indices", tokens * INT64 * (e + k))
    copies = routed_copies(layer, layout, tokens, work.expert_load)
    out.add("routed tokens",
            copies * ((b * h if _adapted(shape, "experts.gate_up_proj") else 0) + FP32))
    _swiglu(out, "experts", copies, layer.expert_ffn / etp, layer.expert_clamp, b, probs=True,
            frozen_fc2=not _adapted(shape, "experts.down_proj"))
    return out


def routed_copies(layer: LayerShape, layout: Layout, tokens: float, load) -> float:
    """Routed token copies a rank's experts process: ``tokens x k`` per sending rank, gathered
    over expert TP; ``load`` x balanced, or the dropless worst case."""
    k, etp = layer.topk, layout.expert_tp
    if load == "worst":
        return tokens * layout.ep * etp * min(k, layer.experts // layout.ep)
    return tokens * k * etp * load


def layer_bytes(shape: ModelShape, layer: LayerShape, layout: Layout, work: Workload
                ) -> Breakdown:
    out = attention_bytes(shape, layer, layout, work)
    out.merge(mlp_bytes(shape, layer, layout, work))
    out.merge(lora_bytes(shape, layer, layout, work))
    if layer.mtp:  # enorm, hnorm, eh_proj's input [2h] and output
        n, n_sp = _tokens(shape, layout, work)
        b, h = work.dtype_bytes, shape.hidden
        if shape.lora_rank:  # frozen: enorm's input (the embedding's) needs no gradient, hnorm
            # keeps no normalized value, eh_proj no input
            _norm(out, "MTP norms", n_sp, h, frozen=True)
            out.add("MTP eh_proj", n * b * h / layout.tp)
        else:
            _norm(out, "MTP norms", n_sp, 2 * h)
            out.add("MTP eh_proj", n_sp * b * 2 * h + n * b * h / layout.tp)
    return out


def _views(shape: ModelShape, layout: Layout, work: Workload):
    """(side, views, tokens, tokens of the rank's sequence-parallel shard) per view size of the
    micro-batch's images: the tower runs each size's views in one call, every image whole on
    every CP rank, its patches split over TP under sequence parallelism."""
    v = shape.vision
    for side, count in work.images:
        if count:
            tokens = count * v.patches(side)
            yield side, count, tokens, tokens // layout.tp if layout.sp else tokens


def vision_bytes(shape: ModelShape, layout: Layout, work: Workload) -> Breakdown:
    """What the vision tower and projector save for one micro-batch's images (the first stage).

    Trained (``model.vision.freeze: false``), per view size of T patches (T_sp of them on the
    rank under SP), b bytes per element: conv1's input pixels and ln_pre's input (whole: before
    the scatter); per layer its two LayerNorms' inputs (+ fp32 mean and 1/std per token),
    linear_qkv's and fc1's inputs and the two layer scales' inputs (x + bias, for the scale's
    gradient), T_sp x C each; linear_qkv's output (3 C / TP, q / k / v views of it), q and k after
    RoPE, SDPA's output and its reshaped copy (linear_proj's input), SDPA's fp32 log-sum-exp, T
    each; quick-GELU's x, sigmoid(1.702 x) and product (fc2's input), 3 x T x F / TP; after the
    layers the two convolutions' inputs (C x g^2, 2C x (g/2)^2 per view). Frozen (the default;
    and under LoRA), the tower runs without a graph and saves nothing. The projector, trained
    unless LoRA freezes it, saves its input (4 C per feature)."""
    v = shape.vision
    out = Breakdown()
    if v is None:
        return out
    b, c, f, tp = work.dtype_bytes, v.hidden, v.ffn, layout.tp
    trained = not (v.frozen or shape.lora_rank)
    for side, count, tokens, tokens_sp in _views(shape, layout, work):
        if not shape.lora_rank:
            out.add("vision projector input", count * v.features(side) * 4 * c * b)
        if not trained:
            continue
        grid = side // v.patch
        out.add("vision conv1 input", count * v.channels * side * side * b)
        out.add("vision ln_pre input", tokens * (c * b + 2 * FP32))
        layers = v.layers
        out.add("vision norms", layers * 2 * tokens_sp * (c * b + 2 * FP32))
        out.add("vision linear inputs", layers * 2 * tokens_sp * c * b)
        out.add("vision layer scale inputs", layers * 2 * tokens_sp * c * b)
        out.add("vision linear_qkv output", layers * tokens * b * 3 * c / tp)
        out.add("vision q, k after RoPE", layers * tokens * b * 2 * c / tp)
        out.add("vision attention output", layers * 2 * tokens * b * c / tp)
        out.add("vision log-sum-exp", layers * tokens * FP32 * v.heads / tp)
        out.add("vision MLP", layers * 3 * tokens * b * f / tp)
        half = (grid + 1) // 2
        out.add("vision downsampler inputs", count * (c * grid * grid + 2 * c * half * half) * b)
    return out


def vision_transient(shape: ModelShape, layout: Layout, work: Workload) -> float:
    """The most the tower allocates beyond what it saves while it runs (its largest view size's
    call, one layer at a time): in the forward the layer's input and quick-GELU's three
    [T, F / TP] tensors (the MLP's peak; a frozen tower frees each as it goes), in the backward
    of a trained tower as much again for their gradients."""
    v = shape.vision
    if v is None:
        return 0.0
    trained = not (v.frozen or shape.lora_rank)
    most = 0.0
    for _, _, tokens, tokens_sp in _views(shape, layout, work):
        one = tokens * work.dtype_bytes * (3 * v.ffn / layout.tp) + tokens_sp * work.dtype_bytes \
            * v.hidden
        most = max(most, one * (2 if trained else 1))
    return most


def head_bytes(shape: ModelShape, layout: Layout, work: Workload) -> Breakdown:
    """One output head: its final norm, its input, the fp32 softmax of the loss."""
    from mcore_ext.plan.params import padded_vocab

    n, n_sp = _tokens(shape, layout, work)
    out = Breakdown()
    _norm(out, "final norm", n_sp, shape.hidden, bool(shape.lora_rank))
    out.add("output layer input", n_sp * work.dtype_bytes * shape.hidden)
    out.add("loss softmax", n * FP32 * padded_vocab(shape, layout.tp) / layout.tp)
    return out


def layer_transient(shape: ModelShape, layer: LayerShape, layout: Layout, work: Workload) -> float:
    """The most a layer allocates beyond what it saves, while it runs: the largest of the MLP's
    backward (the gradients of fc1's output and of the input), a MoE layer's forward (the
    router's fp32 copy of its input; the routed tokens before the experts and the experts'
    outputs, and where tokens move between ranks, their exchanged and re-sorted copies each
    way) and, under CP, a full layer's all-gathered K / V and their sorted copy."""
    n, n_sp = _tokens(shape, layout, work)
    b, h, tp = work.dtype_bytes, shape.hidden, layout.tp
    width = layer.shared_ffn if layer.moe else layer.ffn
    out = n * b * (2 * (2 if shape.gated_mlp else 1) * width / tp + h)
    if layer.moe:
        copies = routed_copies(layer, layout, n_sp, work.expert_load)
        exchanged = layout.ep > 1 or layout.expert_tp > 1
        copied = 4 if exchanged else 2
        if work.cpu and layout.tp > 1:  # gloo's uneven gather / reduce-scatter: two copies more
            copied += 2
        out = max(out, copied * copies * b * h + n_sp * (b + FP32) * h)
    if layout.cp > 1 and not (layer.sliding and work.sliding_kernel == "banded"):
        groups = layer.groups / tp if layer.groups >= tp else 1
        out = max(out, 2 * 2 * n * layout.cp * groups * layer.head_dim * b)
    return out


def batch_bytes(shape: ModelShape, layers, layout: Layout, work: Workload) -> Breakdown:
    """What a batch's attention layout holds once for every layer of a kind: window masks (the
    ``masked`` kernel), and on a CPU under CP the causal chunk masks."""
    out = Breakdown()
    b, cp = work.dtype_bytes, layout.cp
    chunk = work.seq // (2 * cp)
    kinds = {layer.sliding: layer for layer in (shape.layers[i] for i in layers)}
    sliding = kinds.get(True)
    if sliding is not None and sliding.window and work.sliding_kernel == "masked":
        if cp == 1:
            out.add("window mask", work.seq * work.seq * b)
        else:  # per local chunk: its queries against the keys its window reaches
            out.add("window mask", 2 * chunk * min(chunk + sliding.window, work.seq) * b)
    if False in kinds and cp > 1 and work.cpu:
        out.add("causal chunk masks", chunk * chunk * (2 * cp + 1) * b)
    return out


def in_flight(layout: Layout, stage: int, work: Workload) -> float:
    """Micro-batches of a pipeline stage's activations held at once under megatron's 1F1B
    schedule (interleaved with VPP > 1: counted in whole-stage micro-batches)."""
    p, v = layout.pp, layout.vpp
    if p == 1:
        return 1
    cap = work.num_microbatches or float("inf")
    if v == 1:
        return min(p - stage, cap)
    warmup = (p - stage - 1) * 2 + (v - 1) * p
    return min(warmup + 1, cap * v) / v


@dataclass
class StageActivations:
    """One pipeline stage's activation memory per rank.

    The peak is the larger of two moments of the last micro-batch, on top of the others held:
    the end of its forward (everything saved, the output heads' bf16 logits beside their fp32
    softmax) and the backward of its last layer (the heads' tensors freed, the layer's backward
    transient, or under full recompute the layer recomputed)."""

    stage: int
    layers: list
    saved: Breakdown  # the layers' saved tensors, one micro-batch
    head: Breakdown  # the output heads' (last stage), one micro-batch
    microbatches: float  # held at once (1F1B)
    batch: Breakdown  # per batch, shared by layers and micro-batches (masks)
    forward_transient: float  # at the end of the forward (the logits)
    backward_transient: float  # in a layer's backward (or its recompute)
    vision: Breakdown = field(default_factory=Breakdown)  # the tower's and projector's (in saved)
    vision_transient: float = 0.0  # while the tower runs (before the text layers' forward and
    # after their backward: beside the vision's saved tensors alone)

    @property
    def per_microbatch(self) -> float:
        return self.saved.total + self.head.total

    @property
    def peak(self) -> float:
        last = max(self.per_microbatch + self.forward_transient,
                   self.saved.total + self.backward_transient,
                   self.vision.total + self.vision_transient)
        return (self.microbatches - 1) * self.per_microbatch + last + self.batch.total


def stage_activations(shape: ModelShape, layout: Layout, work: Workload) -> list:
    """``StageActivations`` per pipeline stage."""
    from mcore_ext.plan.params import padded_vocab, split_layers

    n, n_sp = _tokens(shape, layout, work)
    out = []
    stages = split_layers(shape, layout.pp, layout.vpp)
    for stage, layers in enumerate(stages):
        last = stage == len(stages) - 1
        saved, head = Breakdown(), Breakdown()
        layer_saved = [layer_bytes(shape, shape.layers[i], layout, work) for i in layers]
        transients = [layer_transient(shape, shape.layers[i], layout, work) for i in layers]
        if work.recompute == "full":
            # each layer keeps its input; backward recomputes one layer at a time
            saved.add("layer inputs (full recompute)", len(layers) * n_sp * work.dtype_bytes
                      * shape.hidden)
            backward = max(t.total + x for t, x in zip(layer_saved, transients))
        else:
            for one in layer_saved:
                saved.merge(one)
            backward = max(transients, default=0.0)
        vision, vision_moment = Breakdown(), 0.0
        if stage == 0 and shape.vision is not None:
            vision = vision_bytes(shape, layout, work)
            saved.merge(vision)
            vision_moment = vision_transient(shape, layout, work)
        forward = 0.0
        if last:
            heads = 1 + (shape.mtp_layers if shape.mtp_own_heads else 0)
            head.merge(head_bytes(shape, layout, work), heads)
            # the bf16 logits beside their fp32 copy, and the output layer's input gradient
            forward = n * work.dtype_bytes * (padded_vocab(shape, layout.tp) / layout.tp
                                              + shape.hidden)
        out.append(StageActivations(stage, layers, saved, head, in_flight(layout, stage, work),
                                    batch_bytes(shape, layers, layout, work), forward, backward,
                                    vision, vision_moment))
    return out


def installed_sliding_kernel() -> str:
    """How this tree's sdpa backend runs a sliding layer: ``banded`` once
    ``mcore_ext.attention.sliding`` exists, else one dense window mask per batch (``masked``)."""
    import importlib.util

    return "banded" if importlib.util.find_spec("mcore_ext.attention.sliding") else "masked"
