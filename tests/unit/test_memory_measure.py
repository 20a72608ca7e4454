"""``mcore_ext.plan.measure.allocation_peak`` (torch's CPU allocations under the profiler) and the
like-for-like MoE comparison of ``benchmarks/bench_gate.py --moe`` that uses it."""

import importlib.util
import os

import torch

from mcore_ext.plan.measure import allocation_peak

MIB = 1 << 20


def test_allocation_peak_is_the_largest_live_sum_of_a_call():
    def step():
        a = torch.ones(MIB // 4)  # 1 MiB, kept to the end
        b = torch.ones(2 * MIB // 4)  # 2 MiB transient
        del b
        c = torch.ones(MIB // 4)  # 1 MiB
        return a, c

    assert allocation_peak(step, "cpu") == {"peak": 3 * MIB, "end": 0}


def test_allocation_peak_ignores_the_free_of_a_block_allocated_before():
    # The allocator's size table keeps the size of a block allocated under an earlier profiler
    # session: its free, inside the measured call, must not lower the running sum.
    older = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True):
        older["t"] = torch.ones(8 * MIB // 4)

    def step():
        older.pop("t")
        return torch.ones(MIB // 4)

    assert allocation_peak(step, "cpu")["peak"] == MIB


def _bench_gate():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_gate.py")
    spec = importlib.util.spec_from_file_location("bench_gate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _moe_cases():
    import mcore_ext

    bench = _bench_gate()
    mcore_ext.init_parallel()
    opts = bench.resolve_options(bench.parse_args(["--quick", "--moe", "--dtype", "fp32"]), False)
    cases = [bench._case("fp32 block", v, opts, "sdpa") for v in ("none", "head-wise", "none-2")]
    bench.check_same_routing(cases, log=lambda _: None)  # raises unless alike
    peaks = [allocation_peak(case.step, "cpu")["peak"] for case in cases]
    experts = {name: p for name, p in cases[1].module.named_parameters() if ".experts." in name}
    mcore_ext.destroy_parallel()
    return peaks, len(experts)


def test_bench_gate_moe_variants_share_weights_and_routing(run_distributed):
    (none, head_wise, control), experts = run_distributed(_moe_cases, world_size=1)[0]
    assert experts > 0
    assert control == none  # identical modules: identical allocations
    # The open gate costs its GEMM rows and [s, b, np] tensors only: well under 1 %.
    assert none <= head_wise <= 1.01 * none
