#!/usr/bin/env python
"""Sliding-window attention at long context: what one layer's core attention costs per token.

One process measures, side by side (each round runs every length and variant once, so drift in
the machine's load hits all alike), forward + backward of:

    sliding     this tree's ``SDPAttention`` with a causal window (banded: 2B keys per query)
    full        this tree's ``SDPAttention``, causal, no window (SDPA's is_causal)
    dense mask  the control: SDPA under a dense [s, s] window mask made for the batch, which is
                what a sliding layer computed before the banded path (every masked-out score
                too)

with the same heads, so ratios are per head. Time: the median step over ``--rounds``; peak: the
activation high-water mark of one step (GPU: max_memory_allocated minus what was allocated
before; CPU: VmHWM minus VmRSS before, glibc's mmap threshold fixed, as in bench_gate.py).
Targets (issue 25, CPU fp32, window 128): a doubling of the sequence costs a sliding layer at
most 2.3 x, and at 8K tokens at most 1/8 of a full layer.

    python benchmarks/bench_long_context.py                       # CPU: 2K..16K, window 128
    python benchmarks/bench_long_context.py --seqs 32768 65536 131072 --window 512   # a GPU

Under context parallelism see ``bench_cp.py --window``.
"""

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gate import fix_malloc_threshold, step_time_and_peak  # noqa: E402

DOUBLING_TARGET = 2.3
SLIDING_VS_FULL_TARGET = 1 / 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--window", type=int, default=128, help="HF sliding_window (keys per query)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--controls-up-to", type=int, default=8192,
                   help="measure full and dense mask up to this length (they cost s^2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import warnings

    import mcore_ext

    warnings.simplefilter("ignore")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        fix_malloc_threshold()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    mcore_ext.init_parallel()
    # Every (length, variant) once per round, so the ratios across lengths are side by side too.
    cells = [(seq, name) for seq in args.seqs
             for name in ["sliding"] + (["full", "dense mask"] if seq <= args.controls_up_to
                                        else [])]
    steps = {cell: _step(args, cell[1], cell[0], dtype) for cell in cells}
    runs = {cell: [] for cell in cells}
    for _ in range(args.rounds):
        for cell in cells:
            runs[cell].append(step_time_and_peak(steps[cell], on_gpu))
    figures = {}
    for (seq, name), rs in runs.items():
        figures.setdefault(seq, {})[name] = dict(seconds=statistics.median(r[0] for r in rs),
                                                  peak=statistics.median(r[1] for r in rs))
    _report(args, figures, dtype, on_gpu)


def _step(args, variant, seq, dtype):
    """A closure running forward + backward of one variant on fixed random inputs."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    import mcore_ext
    from mcore_ext.attention import layout
    from mcore_ext.attention.sdpa import SDPAttention

    dev = mcore_ext.device()
    g = torch.Generator().manual_seed(0)
    shape = (seq, args.batch)
    q = torch.randn(*shape, args.heads, args.head_dim, generator=g)
    k, v = (torch.randn(*shape, args.groups, args.head_dim, generator=g) for _ in range(2))
    q, k, v = (x.to(dev, dtype).requires_grad_(True) for x in (q, k, v))
    upstream = torch.randn(seq, args.batch, args.heads * args.head_dim, generator=g).to(dev, dtype)
    if variant == "dense mask":
        def attend():  # the mask is made per batch, as it was, so its memory is in the step
            i = torch.arange(seq, device=dev)
            offset = i.unsqueeze(1) - i.unsqueeze(0)
            mask = torch.zeros(seq, seq, dtype=dtype, device=dev).masked_fill(
                (offset < 0) | (offset >= args.window), float("-inf"))
            out = F.scaled_dot_product_attention(
                *(x.permute(1, 2, 0, 3) for x in (q, k, v)), attn_mask=mask,
                enable_gqa=args.heads != args.groups)
            return out.permute(2, 0, 1, 3).reshape(seq, args.batch, -1)
    else:
        config = mcore_ext.GatedTransformerConfig(
            num_layers=1, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
            num_query_groups=args.groups, kv_channels=args.head_dim, attention_dropout=0.0,
            window_size=(args.window - 1, 0) if variant == "sliding" else None,
            params_dtype=dtype, bf16=dtype is torch.bfloat16)
        attention = SDPAttention(config, 1, AttnMaskType.causal, "self")

        def attend():
            layout.begin_batch()
            return attention(q, k, v, None)

    def step():
        for x in (q, k, v):
            x.grad = None
        attend().backward(upstream)

    step()  # warm-up
    return step


def _report(args, figures, dtype, on_gpu):
    mib = 2**20
    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"[bench_long_context] core attention, window {args.window}, heads {args.heads}/"
          f"{args.groups}, head dim {args.head_dim}, batch {args.batch}, "
          f"{str(dtype).split('.')[-1]}, {device}; forward + backward, median of {args.rounds}")
    print(f"{'tokens':>8}{'variant':>12}{'step s':>10}{'peak MiB':>10}"
          f"{'sliding / this':>16}{'x prev length':>15}")
    previous = None
    checks = []
    for seq, row in figures.items():
        sliding = row["sliding"]
        for name, fig in row.items():
            vs = f"{sliding['seconds'] / fig['seconds']:.3f}" if name != "sliding" else ""
            growth = ""
            if name == "sliding" and previous is not None:
                ratio = fig["seconds"] / previous["seconds"]
                growth = f"{ratio:.2f}"
                checks.append((f"{seq} vs {seq // 2} tokens: x {ratio:.2f}",
                               ratio <= DOUBLING_TARGET))
            print(f"{seq:>8}{name:>12}{fig['seconds']:>10.3f}{fig['peak'] / mib:>10.1f}"
                  f"{vs:>16}{growth:>15}")
        if seq == 8192 and "full" in row:
            ratio = sliding["seconds"] / row["full"]["seconds"]
            checks.append((f"sliding / full at 8K: {ratio:.3f}", ratio <= SLIDING_VS_FULL_TARGET))
        previous = sliding
    for text, met in checks:
        print(f"  {text} ({'met' if met else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(options=vars(args), dtype=str(dtype), device=device,
                           figures={str(k): v for k, v in figures.items()}), f, indent=1)


if __name__ == "__main__":
    main()
