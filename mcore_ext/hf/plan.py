"""``python -m mcore_ext.hf plan``: parameters and memory per rank of a Step-3.5 model at a
parallel layout, from its config.json alone (nothing is built or read); of a Step-3.7 model
with ``--vision`` its vision tower and projector too (the first stage). The arithmetic is
``mcore_ext.plan``'s (which also plans activations: ``--seq``); this module maps the HF config
onto it and keeps the HF field names in its errors.

Without ``--seq``: weights, gradients and optimizer state only (activations, buffers and
allocator overhead not included: leave headroom for them).
"""

from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.plan import params
from mcore_ext.plan.params import StageCount  # noqa: F401 (the rows' type)
from mcore_ext.plan.shape import ModelShape

GIB = 1024**3


def shape_of(spec: Step35Config, vision=None) -> ModelShape:
    """The plan's layer shapes of a Step-3.5 config (through the megatron config it maps to);
    ``vision``: a Step-3.7 model's ``VisionConfig`` (its tower and projector counted too)."""
    from mcore_ext.config import GatedTransformerConfig

    config = GatedTransformerConfig(**spec.transformer_config_fields())
    return ModelShape.from_transformer_config(config, vocab_size=spec.vocab_size,
                                              tied_embeddings=spec.tie_word_embeddings
                                              ).with_vision(vision)


def stage_counts(spec: Step35Config, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: int | None = None, make_vocab_size_divisible_by: int = 128,
                 vpp: int = 1, vision=None) -> list:
    """One ``StageCount`` per pipeline stage (every rank of a stage holds the same count)."""
    if spec.num_layers % (pp * vpp):
        raise HFConfigError(f"num_hidden_layers={spec.num_layers} is not divisible by pipeline "
                            f"size {pp}" + (f" x virtual stages {vpp}" if vpp > 1 else ""))
    shape = shape_of(spec, vision)
    shape = ModelShape(**{**shape.__dict__,
                          "make_vocab_size_divisible_by": make_vocab_size_divisible_by})
    try:
        return params.stage_counts(shape, tp, pp, ep, etp, vpp)
    except params.PlanError as err:
        raise HFConfigError(str(err).replace("num_moe_experts", "moe_num_experts")) from None


def memory_bytes(count: StageCount, *, dp: int, edp: int, distributed_optimizer: bool = True
                 ) -> dict:
    """{what: bytes} on one rank of the stage (see ``mcore_ext.plan.params``), with a total."""
    out = params.state_bytes(count, dp=dp, edp=edp, distributed_optimizer=distributed_optimizer)
    out["total"] = sum(out.values())
    return out


def plan(spec: Step35Config, *, tp: int, pp: int, ep: int, dp: int, etp: int | None = None,
         distributed_optimizer: bool = True, make_vocab_size_divisible_by: int = 128,
         vision=None) -> list:
    """[(StageCount, memory dict)] per stage for world size tp * pp * dp."""
    etp = tp if etp is None else etp
    world = tp * pp * dp
    if (tp * dp) % (ep * etp):
        raise HFConfigError(f"EP={ep} x ETP={etp} must divide TP x DP = {tp * dp} (the ranks of a "
                            "pipeline stage)")
    edp = world // (ep * etp * pp)
    return [(count, memory_bytes(count, dp=dp, edp=edp,
                                 distributed_optimizer=distributed_optimizer))
            for count in stage_counts(spec, tp, pp, ep, etp, make_vocab_size_divisible_by,
                                      vision=vision)]


def model_totals(spec: Step35Config, vision=None) -> dict:
    """Whole-model element counts at TP = PP = EP = 1 without vocabulary padding: main model,
    MTP layers (their heads included), the fp32 router bias, and with ``vision`` the tower and
    projector (``params.model_totals``)."""
    return params.model_totals(shape_of(spec, vision))


def format_plan(spec: Step35Config, rows: list, *, tp, pp, ep, dp, etp, gpu_gib: float,
                vision=None) -> str:
    shape = shape_of(spec, vision)
    lines = [
        params.describe_totals(shape),
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
            f"{count.stage:>5} {span:>11} {count.dense + count.expert + count.frozen_vision:>15,}"
            f" {count.expert:>15,} "
            f"{g['bf16 weights']:>8.1f} {g['fp32 grads']:>8.1f} {g['fp32 main weights']:>8.1f} "
            f"{g['Adam state']:>8.1f} {g['total']:>10.1f}")
    verdict = "fits" if worst <= gpu_gib else "does NOT fit"
    lines.append(f"largest rank: {worst:.1f} GiB of weights, gradients and optimizer state: "
                 f"{verdict} in {gpu_gib:g} GiB (activations not included)")
    return "\n".join(lines)
