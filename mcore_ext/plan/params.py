"""Parameters per rank and their memory (weights, gradients, optimizer state) at a parallel layout.

Counts follow megatron's sharding: attention, dense MLP, shared expert, eh_proj, embedding and
output heads split over TP (the vocabulary padded to a multiple of
lcm(make_vocab_size_divisible_by, TP)); norms and the router replicated; the routed experts split
E / EP per EP rank and their width over ETP. Layers split evenly over PP x VPP model chunks; the
embedding is on the first stage, the final norm, lm_head and the MTP layers on the last (with MTP
layers, a copy of the embedding too, as megatron builds it).

Memory (bytes per parameter, the launcher's mixed precision: bf16 weights, fp32 gradients with
``grad_reduce_in_fp32``, fp32 main weights and Adam's two moments): 2 + 4 + 12 without the
distributed optimizer; with it the 12 bytes of optimizer state are sharded over the ranks that
hold the same parameter (data-parallel x CP for dense parameters, expert-DP for experts). The
router's fp32 expert bias adds 4 bytes per element.

LoRA (``with_lora``: ``mcore_ext.lora``'s targets and adapters, counted as ``apply_lora`` builds
them): the base weights are frozen, built before DDP and the optimizer, so they hold their bf16
weights only (2 bytes, no gradient buffer, main copy or Adam state); the adapters, bf16 after
Float16Module like the base, hold all of it: 2 + 4 + 12 bytes, the 12 sharded over DP x CP by
the distributed optimizer; a routed expert's adapters are expert parameters, their 12 bytes
sharded over expert-DP. Per adapted linear and target, A [r, in] and B [out, r] on a rank: a
column-parallel linear (linear_qkv's q / k / v / g_proj, fc1's gate / up_proj of a dense MLP or
a shared expert) replicates A and holds B's block of the target's rows, or B whole where a
rank's rows are not one block (fewer query groups than TP); a row-parallel one (linear_proj's
o_proj, fc2's down_proj) splits A's columns over TP and replicates B. Each local routed expert
(``experts.gate_up_proj`` / ``experts.down_proj``, expert TP 1) has its own A and B on its whole
fc1 ([gate ; up]) and fc2. The MTP layers' attention and MLP are adapted as a main layer's.

Step-3.7's vision tower and projector (``ModelShape.vision``) are on the first stage
(``vision_counts``): the projector trained (2 + 4 + 12 bytes, dense), the tower trained likewise
or, frozen (``model.vision.freeze``, the default, and under LoRA), bf16 weights only.
"""

from dataclasses import dataclass

from mcore_ext.plan.shape import LayerShape, ModelShape


class PlanError(ValueError):
    """A layout the plan cannot describe: the message names the value."""


@dataclass
class StageCount:
    """Parameters one rank of a pipeline stage holds."""

    stage: int
    layers: list  # global layer indices (MTP layers: num_layers + k)
    dense: int  # non-expert parameters on the rank
    expert: int  # routed-expert parameters on the rank
    expert_bias: int  # fp32 router-bias elements (a buffer in megatron)
    adapter: int = 0  # LoRA adapter parameters on the rank (trained; the base is then frozen)
    expert_adapter: int = 0  # LoRA adapters of the rank's routed experts (expert parameters)
    frozen: bool = False  # LoRA: dense and expert parameters have no gradients or optimizer state
    frozen_vision: int = 0  # a frozen vision tower's parameters (weights only; trained: in dense)


def layer_counts(shape: ModelShape, layer: LayerShape, tp: int, ep: int, etp: int):
    """(dense, expert, bias) elements of one layer on one rank."""
    h, hn = shape.hidden, layer.head_dim
    heads, groups = layer.heads, layer.groups
    qkv_rows = (heads + 2 * groups) * hn // tp + (heads // tp if layer.gate else 0)
    # linear_qkv: q, k, v rows and the g_proj rows, each split over TP; o_proj split.
    dense = qkv_rows * h + h * heads * hn // tp
    dense += qkv_rows if shape.qkv_bias else 0
    dense += h if shape.linear_bias else 0
    norms = 2 * h + (2 * hn if layer.qk_norm else 0)  # input, pre-MLP (and q / k) norms
    dense += norms * (2 if shape.layer_norm else 1)
    fc1 = 2 if shape.gated_mlp else 1
    expert = bias = 0
    if layer.moe:
        e, fe, fs = layer.experts, layer.expert_ffn, layer.shared_ffn
        dense += e * h + (fc1 + 1) * h * fs // tp  # router (replicated), shared expert
        expert = (e // ep) * (fc1 + 1) * h * fe // etp
        bias = e
    else:
        dense += (fc1 + 1) * h * layer.ffn // tp
        if shape.linear_bias:
            dense += fc1 * layer.ffn // tp + h
    if layer.mtp:  # enorm, hnorm, eh_proj, its final norm (its head: see stage_counts)
        dense += 3 * h * (2 if shape.layer_norm else 1) + 2 * h * h // tp
    return dense, expert, bias


def vision_counts(shape: ModelShape, tp: int) -> tuple:
    """(tower, projector) elements on one rank of the first stage: the layers' linear weights and
    their column-parallel biases split over TP (megatron's ViT layers); norms, layer scales,
    the row-parallel biases, the patch embedding, the position table and the two convolutions
    whole on every rank; the projector's rows split (a column-parallel linear)."""
    v = shape.vision
    if v is None:
        return 0, 0
    c, f = v.hidden, v.ffn
    layer = (4 * c  # input and pre-MLP LayerNorms (weight, bias)
             + (3 * c * c + 3 * c) // tp + c * c // tp + c  # linear_qkv (bias), linear_proj
             + 2 * c  # the two layer scales
             + (f * c + f) // tp + c * f // tp + c)  # fc1 (bias), fc2
    tower = (v.channels * v.patch ** 2 * c  # conv1, no bias
             + (v.image_size // v.patch) ** 2 * c + 2 * c  # position table, ln_pre
             + v.layers * layer
             + 2 * c * c * 9 + 2 * c + 4 * c * 2 * c * 9 + 4 * c)  # downsampler1, downsampler2
    projector = shape.hidden * 4 * c // tp + (shape.hidden // tp if v.projector_bias else 0)
    return tower, projector


def with_lora(shape: ModelShape, cfg) -> ModelShape:
    """``shape`` with ``cfg``'s adapters (an ``mcore_ext.lora.LoraConfig``; rank 0 = none);
    PlanError for routed experts' targets on a model without experts (as ``apply_lora``)."""
    from mcore_ext.lora import EXPERT_TARGETS

    if not cfg.enabled:
        return shape
    experts = [t for t in cfg.targets if t in EXPERT_TARGETS]
    if experts and not shape.is_moe:
        raise PlanError(f"lora.targets: {' '.join(experts)} adapt routed experts, and the model "
                        "has none")
    gated = any(layer.gate for layer in shape.layers)
    targets = tuple(t for t in cfg.targets if t != "g_proj" or gated)
    return ModelShape(**{**shape.__dict__, "lora_rank": cfg.rank, "lora_targets": targets})


def adapter_counts(shape: ModelShape, layer: LayerShape, tp: int, rank: int = 0, ep: int = 1
                   ) -> tuple:
    """(dense, routed-expert) LoRA adapter elements of one layer on TP rank ``rank`` at EP
    ``ep`` (``apply_lora``'s shapes; a MoE layer's gate / up / down_proj adapt its shared
    expert)."""
    from mcore_ext.lora import b_is_sharded, glu_rows, qkv_gate_rows

    r, h, targets = shape.lora_rank, shape.hidden, shape.lora_targets
    if not r:
        return 0, 0
    heads, groups, hn = layer.heads, layer.groups, layer.head_dim
    totals = dict(q_proj=heads * hn, k_proj=groups * hn, v_proj=groups * hn, g_proj=heads)
    placement = qkv_gate_rows(heads, groups, hn, tp, rank)
    ffn = layer.shared_ffn if layer.moe else layer.ffn  # 0: a MoE layer without shared expert
    if ffn:
        totals.update(gate_proj=ffn, up_proj=ffn)
        placement.update(glu_rows(ffn, tp, rank, shape.gated_mlp))
    count = 0
    for name, (rows, _) in placement.items():  # column-parallel: A [r, h], B's rows
        if name in targets:
            total = totals[name]
            count += r * h + r * (total // tp if b_is_sharded(rows, total, tp, rank) else total)
    if "o_proj" in targets:  # row-parallel: A [r, in / tp], B [h, r]
        count += r * heads * hn // tp + h * r
    if "down_proj" in targets and ffn:
        count += r * ffn // tp + h * r
    experts = 0
    if layer.moe:  # each local expert: fc1 A [r, h], B [(2) f, r]; fc2 A [r, f], B [h, r]
        fe, fc1 = layer.expert_ffn, 2 if shape.gated_mlp else 1
        if "experts.gate_up_proj" in targets:
            experts += r * h + fc1 * fe * r
        if "experts.down_proj" in targets:
            experts += r * fe + h * r
        experts *= layer.experts // ep
    return count, experts


def split_layers(shape: ModelShape, pp: int, vpp: int = 1) -> list:
    """[layers of each PP rank], the MTP layers on the last; each rank's list holds its ``vpp``
    model chunks (rank p holds chunks p, p + pp, ...)."""
    n, chunks = shape.num_layers, pp * vpp
    if n % chunks:
        raise PlanError(f"num_layers={n} is not divisible by pipeline size {pp} x virtual "
                        f"stages {vpp} = {chunks}")
    per_chunk = n // chunks
    ranks = [[] for _ in range(pp)]
    for chunk in range(chunks):
        ranks[chunk % pp] += list(range(chunk * per_chunk, (chunk + 1) * per_chunk))
    ranks[-1] += [n + k for k in range(shape.mtp_layers)]
    return ranks


def padded_vocab(shape: ModelShape, tp: int) -> int:
    from mcore_ext.models.gpt import padded_vocab_size

    return padded_vocab_size(shape.vocab, shape.make_vocab_size_divisible_by, tp)


def stage_counts(shape: ModelShape, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: int | None = None, vpp: int = 1) -> list:
    """One ``StageCount`` per pipeline stage (every rank of a stage holds the same count)."""
    etp = tp if etp is None else etp
    experts = {layer.experts for layer in shape.layers if layer.moe}
    for e in experts:
        if e % ep:
            raise PlanError(f"num_moe_experts={e} is not divisible by EP={ep}")
    if etp > 1 and any(t.startswith("experts.") for t in shape.lora_targets):
        raise PlanError(f"lora.targets: routed experts' adapters with expert tensor parallelism "
                        f"{etp}: the launcher trains them at "
                        "parallelism.expert_tensor_parallel_size=1 only")
    vocab_rows = padded_vocab(shape, tp) // tp
    tower, projector = vision_counts(shape, tp)
    frozen_tower = shape.vision is not None and (shape.vision.frozen or bool(shape.lora_rank))
    out = []
    for stage, layers in enumerate(split_layers(shape, pp, vpp)):
        dense = expert = bias = adapter = expert_adapter = frozen_vision = 0
        if stage == 0:  # the vision tower and projector, before the embedding (LoRA: frozen)
            dense += projector + (0 if frozen_tower else tower)
            frozen_vision = tower if frozen_tower else 0
        for index in layers:
            d, e, b = layer_counts(shape, shape.layers[index], tp, ep, etp)
            dense, expert, bias = dense + d, expert + e, bias + b
            a, ea = adapter_counts(shape, shape.layers[index], tp, ep=ep)
            adapter, expert_adapter = adapter + a, expert_adapter + ea
        # megatron builds the embedding on the first stage and, for the MTP layers' inputs, on
        # the last one too (GPTModel: pre_process or mtp_process).
        if stage == 0 or (stage == pp - 1 and shape.mtp_layers):
            dense += vocab_rows * shape.hidden
        if stage == pp - 1:
            heads = 1 + (shape.mtp_layers if shape.mtp_own_heads else 0)
            dense += shape.hidden * (2 if shape.layer_norm else 1)  # final norm
            dense += heads * vocab_rows * shape.hidden
            if shape.tied_embeddings and pp == 1:
                dense -= vocab_rows * shape.hidden
        out.append(StageCount(stage, layers, dense, expert, bias, adapter, expert_adapter,
                              frozen=bool(shape.lora_rank), frozen_vision=frozen_vision))
    return out


def state_bytes(count: StageCount, *, dp: int, edp: int, distributed_optimizer: bool = True
                ) -> dict:
    """{what: bytes} of weights, gradients and optimizer state on one rank of the stage; ``dp``:
    the ranks sharing the dense optimizer state (DP x CP), ``edp``: the experts' (expert-DP)."""
    params = count.dense + count.expert
    dense_share = 1 / dp if distributed_optimizer else 1
    expert_share = 1 / edp if distributed_optimizer else 1
    adapters = count.adapter + count.expert_adapter
    if count.frozen:  # LoRA: the adapters alone are trained (dense: sharded over DP x CP)
        trained = adapters
        sharded = count.adapter * dense_share + count.expert_adapter * expert_share
    else:
        trained = params + adapters
        sharded = (count.dense + count.adapter) * dense_share + count.expert * expert_share
    return {
        "bf16 weights": 2 * (params + adapters + count.frozen_vision) + 4 * count.expert_bias,
        "fp32 grads": 4 * trained,
        "fp32 main weights": 4 * sharded,
        "Adam state": 8 * sharded,
    }


def model_totals(shape: ModelShape) -> dict:
    """Whole-model element counts at TP = PP = EP = 1 without vocabulary padding: main (text)
    model, MTP layers (their heads included), the fp32 router bias, and a Step-3.7 model's
    vision tower and projector; ``parameters``: all of them but the router bias."""
    unpadded = ModelShape(**{**shape.__dict__, "make_vocab_size_divisible_by": 1})
    (count,) = stage_counts(unpadded)
    head = shape.vocab * shape.hidden if shape.mtp_own_heads else 0
    mtp = sum(sum(layer_counts(shape, layer, 1, 1, 1)[:2]) + head
              for layer in shape.layers[shape.num_layers:])
    tower, projector = vision_counts(shape, 1)
    params = count.dense + count.expert + count.frozen_vision
    return {"parameters": params, "mtp": mtp, "main": params - mtp - tower - projector,
            "router_bias": count.expert_bias, "vision": tower, "projector": projector}


def describe_totals(shape: ModelShape) -> str:
    """The plan's first line: the model's element counts (``model_totals``)."""
    t = model_totals(shape)
    vision = ""
    if shape.vision is not None:
        frozen = "frozen" if shape.vision.frozen or shape.lora_rank else "trained"
        vision = (f" + {t['vision']:,} vision tower ({frozen}) + {t['projector']:,} projector")
    return (f"model: {t['main'] + t['router_bias']:,} main (incl. {t['router_bias']:,} fp32 "
            f"router-bias elements) + {t['mtp']:,} MTP{vision} = "
            f"{t['parameters'] + t['router_bias']:,} elements")
