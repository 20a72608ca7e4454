"""``python -m mcore_ext.hf plan``: parameters and memory per rank of a Step-3.5 model at a
parallel layout, from its config.json alone (nothing is built or read).

Counts follow megatron's sharding of each HF tensor (``layout``): attention, dense MLP, shared
expert, eh_proj, embedding and output heads split over TP (the vocabulary padded to a multiple
of lcm(make_vocab_size_divisible_by, TP)); norms and the router replicated; the routed experts
split E / EP per EP rank and their width over ETP. Layers split evenly over PP stages; the
embedding is on the first stage, the final norm, lm_head and the MTP layers on the last (with
MTP layers, a copy of the embedding too, as megatron builds it).

Memory (bytes per parameter, the launcher's mixed precision: bf16 weights, fp32 gradients with
``grad_reduce_in_fp32``, fp32 main weights and Adam's two moments): 2 + 4 + 12 without the
distributed optimizer; with it the 12 bytes of optimizer state are sharded over the data-parallel
ranks that hold the same parameter (DP for dense parameters, expert-DP = world / (EP x ETP x PP)
for experts). The router's fp32 expert bias adds 4 bytes per element. Activations, buffers and
allocator overhead are not included: leave headroom for them.
"""

from dataclasses import dataclass

from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.models.gpt import padded_vocab_size

GIB = 1024**3


@dataclass
class StageCount:
    """Parameters one rank of a pipeline stage holds."""

    stage: int
    layers: list  # global layer indices (MTP layers: num_layers + k)
    dense: int  # non-expert parameters on the rank
    expert: int  # routed-expert parameters on the rank
    expert_bias: int  # fp32 router-bias elements (a buffer in megatron)


def _layer_counts(spec: Step35Config, layer: int, tp: int, ep: int, etp: int):
    """(dense, expert, bias) elements of global layer ``layer`` on one rank."""
    h, hn = spec.hidden_size, spec.head_dim
    heads, groups = spec.heads(layer), spec.kv_heads(layer)
    # linear_qkv: the q, k, v rows and the g_proj rows, each split over TP; o_proj split.
    dense = ((heads + 2 * groups) * hn // tp + heads // tp) * h + h * heads * hn // tp
    dense += 2 * hn + 2 * h  # q/k norms, input and pre-MLP norms
    expert = bias = 0
    if spec.is_sparse(layer):
        e, fe, fs = spec.num_experts, spec.moe_intermediate_size, spec.share_expert_dim
        dense += e * h + 3 * h * fs // tp  # router (replicated), shared expert
        expert = (e // ep) * 3 * h * fe // etp
        bias = e
    else:
        dense += 3 * h * spec.intermediate_size // tp
    if layer >= spec.num_layers:  # MTP: enorm, hnorm, eh_proj, its norm (its head: below)
        dense += 3 * h + 2 * h * h // tp
    return dense, expert, bias


def stage_counts(spec: Step35Config, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: int | None = None, make_vocab_size_divisible_by: int = 128) -> list:
    """One ``StageCount`` per pipeline stage (every rank of a stage holds the same count)."""
    etp = tp if etp is None else etp
    n = spec.num_layers
    if n % pp:
        raise HFConfigError(f"num_hidden_layers={n} is not divisible by pipeline size {pp}")
    if spec.is_moe and spec.num_experts % ep:
        raise HFConfigError(f"moe_num_experts={spec.num_experts} is not divisible by EP={ep}")
    vocab_rows = padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp) // tp
    per_stage = n // pp
    out = []
    for stage in range(pp):
        layers = list(range(stage * per_stage, (stage + 1) * per_stage))
        if stage == pp - 1:
            layers += [n + k for k in range(spec.num_mtp_layers)]
        dense = expert = bias = 0
        for layer in layers:
            d, e, b = _layer_counts(spec, layer, tp, ep, etp)
            dense, expert, bias = dense + d, expert + e, bias + b
        # megatron builds the embedding on the first stage and, for the MTP layers' inputs, on
        # the last one too (GPTModel: pre_process or mtp_process).
        if stage == 0 or (stage == pp - 1 and spec.num_mtp_layers):
            dense += vocab_rows * spec.hidden_size
        if stage == pp - 1:
            heads = 1 + spec.num_mtp_layers  # lm_head and each MTP depth's own head
            dense += spec.hidden_size + heads * vocab_rows * spec.hidden_size
            if spec.tie_word_embeddings and pp == 1:
                dense -= vocab_rows * spec.hidden_size
        out.append(StageCount(stage, layers, dense, expert, bias))
    return out


def memory_bytes(count: StageCount, *, dp: int, edp: int, distributed_optimizer: bool = True
                 ) -> dict:
    """{what: bytes} on one rank of the stage (see the module docstring)."""
    params = count.dense + count.expert
    dense_share = 1 / dp if distributed_optimizer else 1
    expert_share = 1 / edp if distributed_optimizer else 1
    sharded = count.dense * dense_share + count.expert * expert_share
    out = {
        "bf16 weights": 2 * params + 4 * count.expert_bias,
        "fp32 grads": 4 * params,
        "fp32 main weights": 4 * sharded,
        "Adam state": 8 * sharded,
    }
    out["total"] = sum(out.values())
    return out


def plan(spec: Step35Config, *, tp: int, pp: int, ep: int, dp: int, etp: int | None = None,
         distributed_optimizer: bool = True, make_vocab_size_divisible_by: int = 128) -> list:
    """[(StageCount, memory dict)] per stage for world size tp * pp * dp."""
    etp = tp if etp is None else etp
    world = tp * pp * dp
    if (tp * dp) % (ep * etp):
        raise HFConfigError(f"EP={ep} x ETP={etp} must divide TP x DP = {tp * dp} (the ranks of a "
                            "pipeline stage)")
    edp = world // (ep * etp * pp)
    return [(count, memory_bytes(count, dp=dp, edp=edp,
                                 distributed_optimizer=distributed_optimizer))
            for count in stage_counts(spec, tp, pp, ep, etp, make_vocab_size_divisible_by)]


def model_totals(spec: Step35Config) -> dict:
    """Whole-model element counts at TP = PP = EP = 1 without vocabulary padding: main model,
    MTP layers (their heads included) and the fp32 router bias."""
    (count,) = stage_counts(spec, make_vocab_size_divisible_by=1)
    mtp = sum(sum(_layer_counts(spec, spec.num_layers + k, 1, 1, 1)[:2])
              + spec.vocab_size * spec.hidden_size for k in range(spec.num_mtp_layers))
    params = count.dense + count.expert
    return {"parameters": params, "mtp": mtp, "main": params - mtp,
            "router_bias": count.expert_bias}


def format_plan(spec: Step35Config, rows: list, *, tp, pp, ep, dp, etp, gpu_gib: float) -> str:
    totals = model_totals(spec)
    lines = [
        f"model: {totals['main'] + totals['router_bias']:,} main (incl. {totals['router_bias']:,}"
        f" fp32 router-bias elements) + {totals['mtp']:,} MTP = "
        f"{totals['parameters'] + totals['router_bias']:,} elements",
        f"layout: TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp} ranks; EP {ep}, ETP "
        f"{etp if etp is not None else tp}",
        f"{'stage':>5} {'layers':>11} {'params/rank':>15} {'experts':>15} {'weights':>8} "
        f"{'grads':>8} {'main':>8} {'adam':>8} {'total GiB':>10}",
    ]
    worst = 0.0
    for count, mem in rows:
        span = f"{count.layers[0]}-{count.layers[-1]}" if count.layers else "-"
        g = {k: v / GIB for k, v in mem.items()}
        worst = max(worst, g["total"])
        lines.append(
            f"{count.stage:>5} {span:>11} {count.dense + count.expert:>15,} {count.expert:>15,} "
            f"{g['bf16 weights']:>8.1f} {g['fp32 grads']:>8.1f} {g['fp32 main weights']:>8.1f} "
            f"{g['Adam state']:>8.1f} {g['total']:>10.1f}")
    verdict = "fits" if worst <= gpu_gib else "does NOT fit"
    lines.append(f"largest rank: {worst:.1f} GiB of weights, gradients and optimizer state: "
                 f"{verdict} in {gpu_gib:g} GiB (activations not included)")
    return "\n".join(lines)
