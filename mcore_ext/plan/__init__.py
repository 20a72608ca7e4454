"""Memory plans: what a rank holds at a parallel layout, and which layouts fit a GPU.

    shape.py        the layer shapes, from a megatron config (launcher YAML or Hugging Face)
    params.py       weights, gradients and optimizer state per rank
    activations.py  activations per rank and micro-batch (by layer kind, TP/SP, CP, PP/VPP, EP,
                    recompute)
    measure.py      torch's allocation peak, the measure the activation model is checked with

``plan_memory`` combines them per pipeline stage; ``search`` lists the layouts that fit.
``python -m mcore_ext.plan --config X.yaml`` and ``python -m mcore_ext.hf plan`` print them.
"""

import itertools
from dataclasses import dataclass, replace

from mcore_ext.plan.activations import Layout, StageActivations, Workload, stage_activations
from mcore_ext.plan.params import PlanError, StageCount, stage_counts, state_bytes
from mcore_ext.plan.shape import ModelShape

GIB = 1024**3

__all__ = ["GIB", "Layout", "ModelShape", "PlanError", "StagePlan", "Workload", "format_plan",
           "plan_memory", "search"]


@dataclass
class StagePlan:
    """One pipeline stage's rank: its parameters, their state, its activations."""

    count: StageCount
    state: dict  # bytes: weights, grads, main weights, Adam state
    activations: StageActivations

    @property
    def total(self) -> float:
        return sum(self.state.values()) + self.activations.peak


def check_layout(shape: ModelShape, layout: Layout) -> None:
    """Raise PlanError naming the value of a layout megatron cannot build for ``shape``."""
    etp, ep = layout.expert_tp, layout.ep
    for layer in shape.layers:
        if layer.heads % layout.tp:
            raise PlanError(f"TP={layout.tp} does not divide layer {layer.index}'s "
                            f"{layer.heads} attention heads")
        if layer.groups % layout.tp and layout.tp % layer.groups:
            raise PlanError(f"TP={layout.tp} must divide or be a multiple of layer "
                            f"{layer.index}'s {layer.groups} query groups")
    if shape.is_moe and (layout.tp * layout.cp * layout.dp) % (ep * etp):
        raise PlanError(f"EP={ep} x ETP={etp} must divide TP x CP x DP = "
                        f"{layout.tp * layout.cp * layout.dp} (the ranks of a pipeline stage)")


def plan_memory(shape: ModelShape, layout: Layout, work: Workload) -> list:
    """[StagePlan] per pipeline stage for ``layout`` and one micro-batch shape ``work``."""
    check_layout(shape, layout)
    counts = stage_counts(shape, layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.vpp)
    acts = stage_activations(shape, layout, work)
    # megatron's distributed optimizer shards dense state over DP x CP, experts' over expert-DP.
    dense_dp = layout.dp * layout.cp
    edp = layout.world // (layout.ep * layout.expert_tp * layout.pp)
    return [StagePlan(count, state_bytes(count, dp=dense_dp, edp=edp,
                                         distributed_optimizer=layout.distributed_optimizer), act)
            for count, act in zip(counts, acts)]


def _divisors(n: int, limit: int) -> list:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def search(shape: ModelShape, work: Workload, *, usable_gib: float, max_gpus: int = 1024,
           recomputes=("none", "selective", "full"), tps=(1, 2, 4, 8), cps=None,
           expert_tp_one: bool = True, limit: int = 10) -> list:
    """Layouts whose largest rank fits ``usable_gib``: [(gpus, layout, recompute, worst GiB)],
    fewest GPUs first, then less recompute, then the least memory. ``work.recompute`` is
    replaced by each of ``recomputes``. EP ranges over the divisors of the expert count that
    fit the stage's ranks, ETP is 1 (``expert_tp_one``) or TP, VPP over the divisors that split
    the layers evenly, DP over powers of two; sequence parallelism is on with TP > 1."""
    experts = max((layer.experts for layer in shape.layers if layer.moe), default=1)
    cps = cps or [c for c in (1, 2, 4, 8, 16, 32, 64) if work.seq % (2 * c) == 0 or c == 1]
    pps = _divisors(shape.num_layers, 64)
    found = []
    for tp, cp, pp, recompute in itertools.product(tps, cps, pps, recomputes):
        if tp * cp * pp > max_gpus:
            continue
        rw = replace(work, recompute=recompute)
        for vpp in _divisors(shape.num_layers // pp, 8) if pp > 1 else [1]:
            for etp in sorted({1} if expert_tp_one else {1, tp}):
                cache = {}
                dp = 1
                while tp * cp * pp * dp <= max_gpus:
                    for ep in _divisors(experts, tp * cp * dp) if shape.is_moe else [1]:
                        if (tp * cp * dp) % (ep * etp):
                            continue
                        layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp)
                        try:
                            check_layout(shape, layout)
                            if ep not in cache:
                                cache[ep] = stage_activations(shape, layout, rw)
                            counts = stage_counts(shape, tp, pp, ep, etp, vpp)
                        except (PlanError, ValueError):
                            continue
                        edp = layout.world // (ep * etp * pp)
                        worst = max(sum(state_bytes(c, dp=dp * cp, edp=edp).values()) + a.peak
                                    for c, a in zip(counts, cache[ep])) / GIB
                        if worst <= usable_gib:
                            found.append((layout.world, layout, recompute, worst))
                    dp *= 2
    order = {name: i for i, name in enumerate(("none", "selective", "full"))}
    found.sort(key=lambda f: (f[0], order[f[2]], f[3]))
    return found[:limit]


def format_plan(shape: ModelShape, rows: list, layout: Layout, work: Workload,
                gpu_gib: float) -> str:
    """The per-stage table of ``plan_memory``'s rows."""
    from mcore_ext.plan.params import describe_totals

    lines = [
        describe_totals(shape),
        *([f"LoRA: r {shape.lora_rank} on {' '.join(shape.lora_targets)}; the base frozen "
           f"(bf16 weights only), the adapters trained: "
           f"{rows[0].count.adapter + rows[0].count.expert_adapter:,} on a rank of the first "
           "stage"] if shape.lora_rank else []),
        f"layout: {layout.describe()} = {layout.world} ranks; sequence parallel "
        f"{'on' if layout.sp else 'off'}; distributed optimizer "
        f"{'on' if layout.distributed_optimizer else 'off'}",
        f"micro-batch: {work.micro_batch} x {work.seq} tokens, recompute {work.recompute}, "
        f"expert load {work.expert_load} x balanced, sliding layers {work.sliding_kernel}"
        + (", packed documents (per-document attention: the same per-token terms, no scores "
           "stored)" if work.packed else "")
        + (", images " + " + ".join(f"{count} x {side} px" for side, count in work.images)
           + " (every view on every CP rank)" if shape.vision is not None else ""),
        f"{'stage':>5} {'layers':>11} {'params/rank':>15} {'weights':>8} {'grads':>8} "
        f"{'main':>8} {'adam':>8} {'act/mb':>8} {'in fl.':>6} {'act peak':>9} {'total GiB':>10}",
    ]
    worst = 0.0
    for row in rows:
        c, a = row.count, row.activations
        span = f"{min(c.layers)}-{max(c.layers)}" if c.layers else "-"
        g = {k: v / GIB for k, v in row.state.items()}
        worst = max(worst, row.total / GIB)
        params = c.dense + c.expert + c.adapter + c.expert_adapter + c.frozen_vision
        lines.append(
            f"{c.stage:>5} {span:>11} {params:>15,} {g['bf16 weights']:>8.1f} "
            f"{g['fp32 grads']:>8.1f} {g['fp32 main weights']:>8.1f} {g['Adam state']:>8.1f} "
            f"{a.per_microbatch / GIB:>8.1f} {a.microbatches:>6.2f} {a.peak / GIB:>9.1f} "
            f"{row.total / GIB:>10.1f}")
    verdict = "fits" if worst <= gpu_gib else "does NOT fit"
    lines.append(f"largest rank: {worst:.1f} GiB of weights, gradients, optimizer state and "
                 f"activations: {verdict} in {gpu_gib:g} GiB (no allocator / NCCL / CUDA "
                 "context overhead included: leave headroom)")
    return "\n".join(lines)


def format_breakdown(row: StagePlan) -> str:
    """The activation terms of one stage's micro-batch, largest first."""
    a = row.activations
    terms = dict(a.saved.terms)
    for name, value in a.head.terms.items():
        terms[name] = terms.get(name, 0) + value
    lines = [f"stage {a.stage} activations per micro-batch, by term (GiB):"]
    for name, value in sorted(terms.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<32} {value / GIB:8.2f}")
    for name, value in a.batch.terms.items():
        lines.append(f"  {name + ' (per batch)':<32} {value / GIB:8.2f}")
    lines.append(f"  {'transient, forward end':<32} {a.forward_transient / GIB:8.2f}")
    lines.append(f"  {'transient, a layer':<32} {a.backward_transient / GIB:8.2f}")
    return "\n".join(lines)
