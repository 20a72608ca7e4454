"""The command-line options of a memory plan, shared by ``python -m mcore_ext.plan`` (launcher
configs) and ``python -m mcore_ext.hf plan`` (Hugging Face configs)."""

import argparse

from mcore_ext.plan import GIB, Layout, PlanError, Workload, format_plan, plan_memory, search
from mcore_ext.plan import format_breakdown


def add_activation_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """--seq and the options of the micro-batch, recompute, layout search and GPU size."""
    d = defaults or {}
    p = parser.add_argument_group("activations (per rank and micro-batch)")
    p.add_argument("--seq", type=int, default=d.get("seq"),
                   help="tokens per sample" + (f" (default {d['seq']})" if d.get("seq") else
                                               ": plans activations too"))
    p.add_argument("--micro-batch", type=int, default=d.get("micro_batch", 1))
    p.add_argument("--cp", type=int, default=d.get("cp", 1), help="context-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per rank")
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   default=d.get("recompute", "none"))
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="sequence parallelism off (default: on when TP > 1)")
    p.add_argument("--expert-load", default="1.0",
                   help="routed tokens on the busiest expert rank as a multiple of the balanced "
                        "load (default 1.0), or 'worst' (the dropless worst case)")
    p.add_argument("--sliding-kernel", choices=("banded", "masked"), default="banded",
                   help="sliding layers: banded (blocks of ~window; halo under CP) or masked "
                        "(one dense window mask per batch)")
    p.add_argument("--packed", action="store_true", default=d.get("packed", False),
                   help="rows of packed documents (chat SFT, document masking), each attending "
                        "only to itself")
    p.add_argument("--images", type=int, default=1,
                   help="a vision-language model's images (global views) per micro-batch "
                        "(default 1)")
    p.add_argument("--crops", type=int, default=0,
                   help="a vision-language model's local crops per micro-batch (default 0)")
    p.add_argument("--crop-size", type=int, default=504,
                   help="side of a local crop in pixels (default 504, Step-3.7's processor)")
    p.add_argument("--breakdown", action="store_true", help="also print each stage's terms")
    p.add_argument("--search", action="store_true",
                   help="list the layouts with the fewest GPUs that fit --gpu-gib with "
                        "--headroom (the layout options are ignored)")
    p.add_argument("--headroom", type=float, default=0.15,
                   help="fraction of each GPU kept free for the allocator, NCCL, the CUDA "
                        "context (default 0.15)")
    p.add_argument("--max-gpus", type=int, default=1024)


def workload(args, shape=None) -> Workload:
    """The micro-batch of ``args``; a vision model's (``shape.vision``) images: ``--images``
    global views of the tower's image size and ``--crops`` crops of ``--crop-size``."""
    load = args.expert_load if args.expert_load == "worst" else float(args.expert_load)
    images = ()
    if shape is not None and shape.vision is not None:
        for name in ("images", "crops", "crop_size"):
            if getattr(args, name) < (1 if name == "crop_size" else 0):
                raise PlanError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a "
                                "non-negative count" if name != "crop_size" else
                                f"--crop-size {args.crop_size}: expected a positive size")
        if args.crop_size % shape.vision.patch:
            raise PlanError(f"--crop-size {args.crop_size} is not a multiple of the vision "
                            f"tower's patch size {shape.vision.patch}")
        images = ((shape.vision.image_size, args.images), (args.crop_size, args.crops))
    return Workload(seq=args.seq, micro_batch=args.micro_batch, recompute=args.recompute,
                    expert_load=load, sliding_kernel=args.sliding_kernel,
                    packed=args.packed, images=images)


def print_plan(shape, args, *, tp, pp, ep, etp, dp, sp=None, distributed_optimizer=True) -> None:
    """Print the plan of ``args`` (or, with --search, the layouts that fit). PlanError /
    ValueError for a layout that cannot be planned."""
    work = workload(args, shape)
    if args.search:
        usable = args.gpu_gib * (1 - args.headroom)
        found = search(shape, work, usable_gib=usable, max_gpus=args.max_gpus)
        print(f"layouts of at most {args.max_gpus} GPUs whose largest rank fits {usable:.1f} GiB "
              f"({args.gpu_gib:g} GiB less {args.headroom:.0%}), {work.micro_batch} x "
              f"{work.seq} tokens, expert load {work.expert_load}; fewest GPUs first:")
        for gpus, layout, recompute, worst in found:
            print(f"  {gpus:>5} GPUs  {layout.describe():<48} recompute {recompute:<9} "
                  f"{worst:6.1f} GiB")
        if not found:
            print("  none")
        return
    layout = Layout(tp=tp, pp=pp, vpp=args.vpp, cp=args.cp, ep=ep, etp=etp, dp=dp,
                    sequence_parallel=False if args.no_sequence_parallel else sp,
                    distributed_optimizer=distributed_optimizer)
    rows = plan_memory(shape, layout, work)
    print(format_plan(shape, rows, layout, work, args.gpu_gib))
    if args.breakdown:
        for row in rows:
            print(format_breakdown(row))


__all__ = ["GIB", "PlanError", "add_activation_args", "print_plan", "workload"]
