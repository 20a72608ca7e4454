#!/usr/bin/env python
"""A Step-3.5-shaped MoE layer (288 experts, top-8, small hidden) against a dense MLP of the same
active FLOPs: time and memory of forward + backward, side by side in one run.

    dense       megatron's SwiGLU MLP of width k x f: the FLOPs a token's k experts do
    sequential  megatron's MoELayer (sigmoid router with expert bias, x3.0, all-to-all
                dispatcher) with SequentialMLP experts: one fc1 / fc2 GEMM per expert
    grouped     the same layer and weights with mcore_ext's GroupedGemmSequentialMLP: one
                torch._grouped_mm per linear layer over all experts (moe_grouped_gemm on the
                sdpa / local backends)
    experts-*   the experts alone (tokens already sorted by expert, the router's probabilities
                given): the loop against the grouped GEMM without routing and dispatch

Time: interleaved rounds (every variant once per round, the order rotated), median of one
forward + backward; on a CPU one thread, process CPU time (see bench_gate.py). Memory: the peak
of torch's allocations in one step (mcore_ext.plan.measure). No shared expert (it is a dense MLP
either way).

    python benchmarks/bench_moe.py                     # CPU: fp32 and bf16, ~3 min on 2 cores
    python benchmarks/bench_moe.py --dtype bf16        # on a GPU: bf16 (the default there)
"""

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import bench_gate  # noqa: E402
from bench_gate import DTYPES, run_rounds  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-ffn", type=int, default=80, help="expert width (Step: 1280 at h 4096)")
    p.add_argument("--tokens", type=int, default=1024, help="sequence x batch")
    p.add_argument("--dtype", default=None, help="fp32,bf16 (CPU default) or bf16 (GPU default)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    return p.parse_args(argv)


def make_config(args, dtype, grouped=False, dense=False):
    import mcore_ext

    fields = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=4,
                  ffn_hidden_size=args.topk * args.expert_ffn, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                  params_dtype=dtype, bf16=dtype is torch.bfloat16, use_cpu_initialization=True)
    if not dense:
        fields.update(num_moe_experts=args.experts, moe_router_topk=args.topk,
                      moe_ffn_hidden_size=args.expert_ffn, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=3.0,
                      moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
                      moe_grouped_gemm=grouped)
    return mcore_ext.GatedTransformerConfig(**fields)


def build_mlp(config, dense):
    """The MLP of a layer built from the sdpa backend's spec (MoELayer or MLP)."""
    import mcore_ext
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(mcore_ext.get_gpt_layer_spec(config, "sdpa", moe=not dense),
                         config=config, layer_number=1)
    return layer.mlp


class Case(bench_gate.Case):
    """One variant: its module, input and output gradient; ``step`` and ``release`` are
    bench_gate's (its ``__init__``, which builds an attention case, is not called)."""

    def __init__(self, args, variant, dtype, device):
        from mcore_ext.runtime import set_seed

        self.variant = variant
        dense = variant == "dense"
        grouped = variant.endswith("grouped")
        set_seed(0)  # every MoE variant: the same router and expert weights
        self.module = build_mlp(make_config(args, dtype, grouped, dense), dense)
        self.module.to(device=device, dtype=dtype).train()
        gen = torch.Generator().manual_seed(1)
        shape = (args.tokens, 1, args.hidden)
        self.x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        self.dy = torch.randn(shape, generator=gen).to(device, dtype)
        self.experts_only = variant.startswith("experts-")
        if self.experts_only:  # tokens sorted by expert as the dispatcher leaves them
            self.module = self.module.experts
            counts = torch.bincount(torch.randint(0, args.experts, (args.tokens * args.topk,),
                                                  generator=gen), minlength=args.experts)
            self.counts = counts
            self.x = torch.randn(int(counts.sum()), args.hidden, generator=gen).to(
                device, dtype).requires_grad_()
            self.dy = torch.randn(int(counts.sum()), args.hidden, generator=gen).to(device, dtype)
            self.probs = torch.rand(int(counts.sum()), generator=gen).to(device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.times, self.times_wall, self.times_cpu = [], [], []

    def forward(self):
        if self.experts_only:
            return self.module(self.x, self.counts, self.probs)[0]
        return self.module(self.x)[0]



VARIANTS = ("dense", "sequential", "grouped", "experts-sequential", "experts-grouped")


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import mcore_ext
    from mcore_ext.grouped_experts import grouped_mm_runs
    from mcore_ext.plan.measure import allocation_peak

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(args.threads)
    dtypes = (args.dtype or ("bf16" if on_gpu else "fp32,bf16")).split(",")
    mcore_ext.init_parallel()
    device = mcore_ext.device()
    flops = 2 * 3 * args.hidden * args.expert_ffn * args.topk * args.tokens * 3  # fwd + bwd
    print(f"bench_moe: {device}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"{args.experts} experts, top-{args.topk}, hidden {args.hidden}, expert width "
          f"{args.expert_ffn}, {args.tokens} tokens; dense width {args.topk * args.expert_ffn}; "
          f"active GEMM FLOPs per step {flops / 1e9:.2f} G")
    clock = "wall" if on_gpu else "cpu"
    for name in dtypes:
        dtype = DTYPES[name]
        print(f"\n[{name}] torch._grouped_mm runs here: {grouped_mm_runs(device.type, dtype)}")
        cases = [Case(args, v, dtype, device) for v in VARIANTS]
        start = time.perf_counter()
        run_rounds(cases, args.rounds, args.warmup, on_gpu, lambda s: None, clock)
        grouped = [c for c in cases if c.variant.endswith("grouped")]
        ran = all(getattr(c.module if c.experts_only else c.module.experts,
                          "last_forward_grouped", False) for c in grouped)
        print(f"[{name}] {time.perf_counter() - start:.0f} s; grouped path ran: {ran}")
        base = statistics.median(cases[0].times)
        print(f"  {'variant':<20} {'ms / step':>10} {'x dense':>8} {'GFLOP/s':>8} {'peak MiB':>9}")
        for case in cases:
            t = statistics.median(case.times)
            peak = allocation_peak(case.step, device)["peak"]
            case.release()
            print(f"  {case.variant:<20} {1e3 * t:10.1f} {t / base:8.2f} {flops / t / 1e9:8.1f} "
                  f"{peak / 2**20:9.1f}")
    mcore_ext.destroy_parallel()


if __name__ == "__main__":
    main()
