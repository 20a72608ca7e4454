#!/usr/bin/env python
"""Cost of the head-wise attention output gate: time and memory of forward + backward.

The variants are built side by side in one process and measured interleaved (round r runs every
variant once, in an order rotated each round), so that machine noise hits them alike:

    none       no output gate
    head-wise  mcore_ext's head-wise gate    (GatedTransformerConfig.head_wise_attn_gate=True)
    full       megatron's head_dim-wise gate (TransformerConfig.attention_output_gate=True)
    none-2     (CPU, unless --no-control) a second, identical no-gate module: its ratio to none is
               this run's noise floor, the difference two identical modules show

at two scopes:

    layer      the ``self_attention`` module of one TransformerLayer built from
               ``mcore_ext.get_gpt_layer_spec``; input [s, b, h]
    block      a TransformerBlock of ``--layers`` layers built from ``mcore_ext.get_gpt_block_spec``

and in each dtype asked for (``--dtype fp32,bf16``: the CPU preset measures both, one after the
other in one run).

Time is the median over rounds of one forward + backward (input gradient and all weight gradients).
Memory is measured once per variant, after all timed rounds, as the peak of one forward + backward
plus the module's parameter bytes and the input's bytes:

    GPU  torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was allocated
         before the step.
    CPU  the peak of torch's own CPU allocations during the step (mcore_ext.plan.measure:
         the allocator's events under the profiler, exact). Also reported: the process's
         resident-memory peak (/proc/self/clear_refs resets the kernel's high-water mark, VmHWM,
         before the step; glibc serves every allocation of 64 KiB or more with mmap, so freed
         tensors leave the resident set at once: set only in a child process that measures
         memory after the timed rounds, which keep glibc's default) and the bytes the forward
         leaves allocated for backward (exact, blind to transients).

``--moe``: a MoE block, none vs head-wise with the same weights and an open gate (sigmoid = 1),
every router pinned to the routing the ungated block chooses for the input (megatron's router
replay), so both route every token alike; ``check_same_routing`` asserts it before any round.

Run ``python benchmarks/bench_gate.py --help``; see benchmarks/README.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

# megatron's own gate (attention_output_gate) is torch.compile'd. Compile in this process rather
# than in a pool of worker processes that would linger and steal CPU from the first timed rounds.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The CPU memory measure runs the profiler; keep its tracing library's start/stop lines quiet.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

# Targets for head-wise / none, per preset: (time ratio, peak-memory ratio).
TARGETS = {"cpu": (1.02, 1.03), "gpu": (1.01, 1.01)}

PRESETS = {
    # batch None on GPU: 2 if it fits, else 1 (decided at run time).
    "cpu": dict(hidden=1024, heads=16, seq=512, batch=2, dtype="fp32,bf16"),
    "gpu": dict(hidden=4096, heads=32, seq=4096, batch=None, dtype="bf16"),
    "quick": dict(hidden=128, heads=4, seq=64, batch=2, layers=2, rounds=5, block_rounds=3, warmup=1),
}

VARIANTS = ("none", "head-wise", "full")
CONTROL = "none-2"  # a second no-gate module: the noise floor
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------ options


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=("cpu", "gpu"),
                   help="cpu: fp32 and bf16, hidden 1024, 16 heads, seq 512, batch 2; gpu: bf16, "
                        "hidden 4096, "
                        "32 heads, seq 4096, batch 2 if it fits else 1 (default: the machine's)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and few rounds: a smoke test that finishes in ~20 s on a CPU")
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--groups", type=int, help="query groups (GQA); default: --heads (MHA)")
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--layers", type=int, help="layers of the block (default 4)")
    p.add_argument("--rounds", type=int, help="measured rounds for the layer (default 15 CPU, 30 GPU)")
    p.add_argument("--block-rounds", type=int,
                   help="measured rounds for the block (default 10 CPU, 20 GPU)")
    p.add_argument("--warmup", type=int, help="unmeasured rounds first (default 2 CPU, 3 GPU)")
    p.add_argument("--dtype", type=_dtypes,
                   help="one or more of fp32, bf16, fp16, comma-separated (default: the preset's; "
                        "fp32,bf16 on CPU, bf16 on GPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "sdpa", "local", "te"),
                   help="attention backend of mcore_ext.get_gpt_layer_spec (default auto)")
    p.add_argument("--scope", choices=("layer", "block", "both"), default="both")
    p.add_argument("--clock", choices=("wall", "cpu"),
                   help="CPU runs only: time a step by wall clock or by this process's CPU time "
                        "(default cpu; GPU runs always use wall clock with synchronize)")
    p.add_argument("--threads", type=int,
                   help="CPU runs only: torch.set_num_threads (default 1: on a shared machine the "
                        "CPU time of one thread is the stable measure; several threads wait on "
                        "each other whenever one is descheduled)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one layer step of 'none' and 'head-wise' and print the ops "
                        "whose self time differs most (torch.profiler)")
    p.add_argument("--no-control", action="store_true",
                   help="CPU runs only: leave out the second no-gate module (none-2) that shows "
                        "the run's noise floor")
    p.add_argument("--moe", action="store_true",
                   help="MoE block (Step-3.5's router: 8 experts, top-2, sigmoid + expert bias, "
                        "x3.0, a shared expert; every layer MoE): none vs head-wise gate, with "
                        "the same weights, the gate open (sigmoid = 1) and every router pinned "
                        "to the ungated block's routing, so that both route every token alike "
                        "(checked)")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    return p.parse_args(argv)


def _dtypes(value: str) -> str:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--dtype {value!r}: expected a comma-separated list of {', '.join(sorted(DTYPES))}")
    return ",".join(names)


def resolve_options(args, on_gpu):
    preset = args.preset or ("gpu" if on_gpu else "cpu")
    opts = dict(PRESETS[preset])
    opts.update(groups=None, layers=4,
                rounds=30 if on_gpu else 15, block_rounds=20 if on_gpu else 10,
                warmup=3 if on_gpu else 2)
    if args.quick:
        opts.update({k: v for k, v in PRESETS["quick"].items()})
    for key in ("hidden", "heads", "groups", "seq", "batch", "layers", "rounds", "block_rounds",
                "warmup", "dtype"):
        value = getattr(args, key)
        if value is not None:
            opts[key] = value
    opts["dtype"] = opts.get("dtype") or ("bf16" if on_gpu else "fp32,bf16")
    opts["clock"] = "wall" if on_gpu else (args.clock or "cpu")
    opts["threads"] = None if on_gpu else (args.threads or 1)
    opts["groups"] = opts["groups"] or opts["heads"]
    opts["preset"] = "quick" if args.quick else preset
    opts["moe"] = args.moe
    # The targets hold for a preset run on its own kind of machine, at the preset's shapes.
    shapes = ("hidden", "heads", "seq", "dtype")
    opts["at_preset"] = (
        not args.quick
        and preset == ("gpu" if on_gpu else "cpu")
        and all(opts[k] == PRESETS[preset][k] for k in shapes)
        and PRESETS[preset]["batch"] in (None, opts["batch"])
        and opts["groups"] == opts["heads"]
    )
    return opts


# ------------------------------------------------------------------------------------- models


def make_config(opts, variant, dtype):
    import mcore_ext

    return mcore_ext.GatedTransformerConfig(
        num_layers=opts["layers"],
        hidden_size=opts["hidden"],
        num_attention_heads=opts["heads"],
        num_query_groups=opts["groups"],
        ffn_hidden_size=4 * opts["hidden"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        head_wise_attn_gate=variant == "head-wise",  # none and none-2: no gate
        attention_output_gate=variant == "full",
        **(_moe_fields(opts) if opts.get("moe") else {}),
    )


def _moe_fields(opts):
    """Step-3.5-Flash's MoE in miniature: experts as wide as a quarter of the dense MLP. A QKV
    bias in every variant: it holds the head-wise gate open (``GATE_OPEN``). Router replay on:
    every variant's routers take the routing recorded on the ungated block (``pin_routing``)."""
    return dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=opts["hidden"],
                moe_enable_routing_replay=True,
                moe_shared_expert_intermediate_size=opts["hidden"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=3.0, moe_router_dtype="fp32",
                gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                bias_activation_fusion=False, add_bias_linear=False, add_qkv_bias=True)


# A gate logit whose fp32 sigmoid rounds to exactly 1.0 (1 - 9e-14): the gate multiplies by 1,
# while its GEMM rows, sigmoid, product and saved tensors all still run, so the gated block
# computes the ungated function. Bit for bit only where every kernel sums as the ungated
# layer's does (the GEMM with the gate's extra rows, attention on q / k / v with a longer row
# stride), which nothing guarantees: issue 54 read "head-wise routes layer 2 differently" in
# bf16 (not reproduced here). A MoE block routes on its input, and one token sent elsewhere
# changes the experts' memory and time, which are no cost of the gate: so the routing is not
# left to the arithmetic but pinned (``pin_routing``).
GATE_OPEN = 30.0


def copy_ungated_weights(gated, ungated):
    """Give ``gated`` (head-wise gate, TP 1) every weight and buffer of ``ungated``; its gate rows
    of ``linear_qkv`` (after the QKV rows: ``[QKV ; Gate]``) get weight 0 and bias GATE_OPEN."""
    source = dict(ungated.named_parameters())
    source.update(ungated.named_buffers())
    with torch.no_grad():
        for name, tensor in [*gated.named_parameters(), *gated.named_buffers()]:
            if name not in source:
                raise KeyError(f"{name} has no counterpart in the ungated module")
            value = source.pop(name)
            if tensor.shape == value.shape:
                tensor.copy_(value)
                continue
            if not name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                raise ValueError(f"{name}: {tuple(tensor.shape)} vs {tuple(value.shape)}")
            rows = value.size(0)
            tensor[:rows].copy_(value)
            tensor[rows:].fill_(0.0 if name.endswith("weight") else GATE_OPEN)
    if source:
        raise KeyError(f"the gated module lacks {sorted(source)}")


def _routers(module):
    """The TopKRouters of ``module``, in call order (a block's layers in order)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def record_routing(module, x):
    """[top-k expert indices of each router, in call order] of one forward of ``module`` on
    ``x`` (no backward), as megatron's router replay records them."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(module)
    for router in routers:
        router.router_replay.clear_indices()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            forward(module, "block", x)
        return [router.router_replay.get_recorded_indices().clone() for router in routers]
    finally:
        for router in routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


def pin_routing(module, indices):
    """Every router of ``module`` sends each token to the experts ``indices`` name (megatron's
    router replay, REPLAY_FORWARD: its scores are computed as always and gathered at those experts
    instead of at their top-k), in every later forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    routers = _routers(module)
    if len(routers) != len(indices):
        raise ValueError(f"{len(indices)} recorded routings for {len(routers)} routers")
    for router, idx in zip(routers, indices):
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(idx)
        router.router_replay.replay_backward_list.clear()  # (recompute only; none here)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    # megatron keeps every RouterReplay in a process-wide list for its global setters, which
    # this does not use: the modules hold their own.
    RouterReplay.clear_global_router_replay_instances()


def routing_maps(module, x):
    """[routing_map of each router, in call order] of one forward (no backward)."""
    maps = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
             for m in _routers(module)]
    try:
        with torch.no_grad():
            out = forward(module, "block", x)
    finally:
        for hook in hooks:
            hook.remove()
    return maps, out


def check_same_routing(cases, log):
    """Assert every MoE case routes each token to the experts the first case chooses, with the
    same router and expert weights; log the tokens per expert, the largest output difference and
    how many of a case's top-k choices its own arithmetic would have made otherwise (the pinned
    routing taken off: 0 where the open gate is exact)."""
    base_maps, base_out = routing_maps(cases[0].module, cases[0].x)
    base_params = dict(cases[0].module.named_parameters())
    assert base_maps, "no router ran: not a MoE block"
    for case in cases[1:]:
        for name, p in case.module.named_parameters():
            if ".router." in name or ".experts." in name:
                assert torch.equal(p, base_params[name]), f"{case.variant}: {name} differs"
        maps, out = routing_maps(case.module, case.x)
        assert len(maps) == len(base_maps)
        for layer, (a, b) in enumerate(zip(base_maps, maps)):
            assert torch.equal(a, b), f"{case.variant} routes layer {layer} differently from none"
        diff = (out.float() - base_out.float()).abs().max().item()
        own = sum(int((a != b).any(-1).sum()) for a, b in zip(base_maps, unpinned_maps(case)))
        log(f"  {case.variant}: same router and expert weights, same routing in all "
            f"{len(maps)} layers; largest output difference from none {diff:.3g}; unpinned, "
            f"{own} of {sum(m.size(0) for m in maps)} token routings would differ")
    loads = [m.sum(0).tolist() for m in base_maps]
    log(f"  tokens per expert, layer by layer: {loads}")


def unpinned_maps(case):
    """``routing_maps`` of ``case`` with its routers' pins taken off for the one forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(case.module)
    for router in routers:
        router.router_replay.clear_router_replay_action()
    try:
        return routing_maps(case.module, case.x)[0]
    finally:
        for router in routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def build(opts, variant, scope, dtype, backend):
    import mcore_ext
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = make_config(opts, variant, dtype)
    if scope == "layer":
        layer = build_module(mcore_ext.get_gpt_layer_spec(config, backend), config=config,
                             layer_number=1)
        module = layer.self_attention
        del layer  # only the attention module is kept (and measured)
    else:
        module = TransformerBlock(config, mcore_ext.get_gpt_block_spec(config, backend))
    # All of it in the training dtype, as megatron's Float16Module casts a model (norm weights
    # included: CUDA's layer_norm refuses fp32 weights on bf16 input).
    return module.to(device=mcore_ext.device(), dtype=dtype).train()


def forward(module, scope, x):
    if scope == "layer":
        out, bias = module(x, attention_mask=None)
        return out if bias is None else out + bias
    return module(x, attention_mask=None)


class Case:
    """One variant at one scope, with its own input and output gradient."""

    def __init__(self, opts, variant, scope, dtype, backend, device):
        self.variant, self.scope = variant, scope
        from mcore_ext.runtime import set_seed

        set_seed(0)  # torch's generator and megatron's model-parallel streams (expert weights)
        self.module = build(opts, variant, scope, dtype, backend)
        shape = (opts["seq"], opts["batch"], opts["hidden"])
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        self.dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        if opts.get("moe"):
            # Every variant routes as the ungated block does on this input: pinned, recorded on
            # the module itself (none) or on the ungated block whose weights it takes.
            ungated = self.module
            if variant == "head-wise":
                set_seed(0)
                ungated = build(opts, "none", scope, dtype, backend)
                copy_ungated_weights(self.module, ungated)
            pin_routing(self.module, record_routing(ungated, self.x))
            del ungated
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.times = []  # seconds per step on the chosen clock
        self.times_wall, self.times_cpu = [], []

    def forward(self):
        return forward(self.module, self.scope, self.x)

    def step(self):
        """One forward + backward; returns the output (still referenced)."""
        for p in self.params:
            p.grad = None
        self.x.grad = None
        out = self.forward()
        out.backward(self.dy)
        return out

    def release(self):
        for p in self.params:
            p.grad = None
        self.x.grad = None

    def drop_module(self):
        """Keep the timings only."""
        self.module = self.x = self.dy = self.params = None


# ------------------------------------------------------------------------------------ measure


def sync(on_gpu):
    if on_gpu:
        torch.cuda.synchronize()


def timed_step(case, on_gpu):
    """(wall seconds, CPU seconds of this process) of one step."""
    sync(on_gpu)
    start, start_cpu = time.perf_counter(), time.process_time()
    case.step()
    sync(on_gpu)
    return time.perf_counter() - start, time.process_time() - start_cpu


def run_rounds(cases, rounds, warmup, on_gpu, log, clock="wall"):
    """Interleaved rounds: every case once per round, the order rotated each round."""
    n = len(cases)
    for r in range(warmup + rounds):
        measured = r >= warmup
        step_times = {}
        for case in [cases[(r + i) % n] for i in range(n)]:
            wall, cpu = timed_step(case, on_gpu)
            step_times[case.variant] = wall if clock == "wall" else cpu
            if measured:
                case.times_wall.append(wall)
                case.times_cpu.append(cpu)
                case.times.append(step_times[case.variant])
        label = f"round {r + 1 - warmup:>2}" if measured else f"warmup {r + 1}"
        log(f"    {label:>9}: " + "  ".join(
            f"{c.variant} {1e3 * step_times[c.variant]:8.1f} ms" for c in cases))
    for case in cases:
        case.release()


def memory_gpu(case):
    case.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = case.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    case.release()
    inp = case.x.numel() * case.x.element_size()
    return dict(
        measure="cuda_peak",
        peak_delta_bytes=peak,
        param_bytes=case.param_bytes,
        input_bytes=inp,
        total_bytes=peak + case.param_bytes + inp,
    )


def memory_cpu(case):
    """Peak of one forward + backward (torch's allocations, and the process's resident memory),
    and the bytes the forward holds.

    The allocation peak (``mcore_ext.plan.measure.allocation_peak``): the running sum of the CPU
    allocator's allocation and free events during the step, exact. The resident peak: reset the
    kernel's high-water mark (VmHWM), run the step, read it; with glibc's mmap threshold fixed at
    64 KiB (``fix_malloc_threshold``), every tensor of that size or more is its own mapping,
    returned to the kernel when freed, so resident memory follows live tensors (set at the start
    of the process: ``measure_memory`` runs this in a process of its own), give or take what
    glibc and the kernel do meanwhile. The held bytes (allocated minus freed during the forward,
    from the profiler's memory events) are exact, but blind to transients.
    """
    from mcore_ext.plan.measure import allocation_peak

    case.release()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        out = forward(case.module, case.scope, case.x)
    forward_held = sum(event.self_cpu_memory_usage for event in prof.key_averages())
    del out
    case.release()

    alloc_peak = allocation_peak(case.step, "cpu")["peak"]
    case.release()

    _reset_resident_peak()
    before = _proc_status_bytes("VmRSS")
    out = case.step()
    peak = _proc_status_bytes("VmHWM") - before
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in case.params if p.grad is not None)
    del out
    case.release()
    inp = case.x.numel() * case.x.element_size()
    return dict(
        measure="cpu_allocation_peak",
        peak_delta_bytes=alloc_peak,
        resident_peak_delta_bytes=peak,
        param_bytes=case.param_bytes,
        input_bytes=inp,
        grad_bytes=grad_bytes,
        forward_held_bytes=forward_held,
        total_bytes=alloc_peak + case.param_bytes + inp,
        resident_total_bytes=peak + case.param_bytes + inp,
    )


def measure_memory(keys, variants, opts, backend, on_gpu):
    """{key: {variant: memory figures}}, each on a freshly built module.

    On a CPU in a child process that fixes glibc's mmap threshold before it allocates anything,
    as the peak measure needs (``memory_cpu``). Every large allocation then page-faults afresh,
    so the timed rounds do not run under it: they keep glibc's default, which reuses freed
    memory as a training run does.
    """
    if on_gpu:
        return {key: {v: memory_gpu(_warm_case(key, v, opts, backend)) for v in variants}
                for key in keys}
    with tempfile.TemporaryDirectory() as tmp:
        request = dict(keys=keys, variants=list(variants), opts=opts, backend=backend,
                       out=os.path.join(tmp, "memory.json"))
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # the parent's store
        subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child",
                        json.dumps(request)], env=env, check=True)
        with open(request["out"]) as f:
            return json.load(f)


def _memory_child(request):
    import mcore_ext

    fix_malloc_threshold()
    warnings.filterwarnings("ignore")
    opts = request["opts"]
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    try:
        memory = {key: {v: memory_cpu(_warm_case(key, v, opts, request["backend"]))
                        for v in request["variants"]}
                  for key in request["keys"]}
    finally:
        mcore_ext.destroy_parallel()
    with open(request["out"], "w") as f:
        json.dump(memory, f)


def _case(key, variant, opts, backend):
    """The Case of one variant at ``key`` ("<dtype> <scope>")."""
    import mcore_ext

    dtype_name, scope = key.split()
    return Case(opts, variant, scope, DTYPES[dtype_name], backend, mcore_ext.device())


def _warm_case(key, variant, opts, backend):
    """A fresh Case after one step: a module's first step also allocates what it keeps
    (workspaces, ...), which is no part of a step's peak."""
    case = _case(key, variant, opts, backend)
    case.step()
    return case


def fix_malloc_threshold(threshold=64 * 1024):
    """glibc: allocations >= threshold are mmapped, and the threshold stops adapting upwards."""
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(M_MMAP_THRESHOLD, threshold):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the CPU peak would not be reliable")


def _reset_resident_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)


def step_time_and_peak(step, on_gpu):
    """(seconds, activation peak bytes) of one ``step()``: GPU max_memory_allocated minus what was
    allocated before; CPU the resident high-water mark minus VmRSS before (with the mmap threshold
    fixed by ``fix_malloc_threshold``)."""
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - before
    before = _proc_status_bytes("VmRSS")
    _reset_resident_peak()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0, _proc_status_bytes("VmHWM") - before


def _proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def profile_layer(cases, log, steps=8, rows=24):
    """Self time per op of 'none' and 'head-wise' layer steps (interleaved), largest differences,
    by op name: torch ops (``aten::``, shapes merged: the fused GEMM's extra gate columns are the
    same op) and, on a GPU, the device kernels they launched. The sum of one table is one step's
    device time; a GEMM shows both as its aten op and as its kernel, so read one table at a time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    pair = [c for c in cases if c.variant in ("none", "head-wise")]
    tables = {"op": {c.variant: {} for c in pair}, "kernel": {c.variant: {} for c in pair}}
    for i in range(steps):
        for case in pair if i % 2 else pair[::-1]:
            with profile(activities=activities) as prof:
                case.step()
                sync(on_gpu)
            for e in prof.key_averages():
                table = "op" if e.key.startswith("aten::") else "kernel"
                if table == "kernel" and not on_gpu:
                    continue
                acc = tables[table][case.variant]
                t, n = acc.get(e.key, (0.0, 0))
                acc[e.key] = (t + getattr(e, attr) / steps, n + e.count / steps)
    for case in pair:
        case.release()
    result = {}
    for table, per_variant in tables.items():
        a, b = per_variant["none"], per_variant["head-wise"]
        if not (a or b):
            continue
        diff = sorted(set(a) | set(b), reverse=True,
                      key=lambda k: abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
        total_a, total_b = sum(v[0] for v in a.values()), sum(v[0] for v in b.values())
        log(f"\nprofile by {table}, one layer step, self {'device' if on_gpu else 'CPU'} time (us), "
            f"mean of {steps} interleaved steps; sum: none {total_a / 1e3:.2f} ms, head-wise "
            f"{total_b / 1e3:.2f} ms")
        log(f"  {table:<72} {'none':>8} {'head-w':>8} {'diff':>8} {'calls':>9}")
        result[table] = []
        for k in diff[:rows]:
            ta, ca = a.get(k, (0.0, 0))
            tb, cb = b.get(k, (0.0, 0))
            log(f"  {k[:72]:<72} {ta:8.0f} {tb:8.0f} {tb - ta:+8.0f} {ca:4.0f}/{cb:<4.0f}")
            result[table].append(dict(name=k, none_us=ta, head_wise_us=tb, none_calls=ca,
                                      head_wise_calls=cb))
    return result


# ------------------------------------------------------------------------------------- report


def summarize(cases, mem):
    """Ratios against cases[0] (none); ``cases`` carry the timings, ``mem`` the memory figures."""
    base_t = statistics.median(cases[0].times)
    base_m = mem[cases[0].variant]["total_bytes"]
    rows = {}
    for case in cases:
        t = statistics.median(case.times)
        # Per-round ratio against the same round's no-gate time: a second, noise-robust estimate.
        paired = statistics.median(x / y for x, y in zip(case.times, cases[0].times))
        rows[case.variant] = dict(
            time_s_median=t,
            time_s_min=min(case.times),
            time_s_all=case.times,
            time_s_wall_all=case.times_wall,
            time_s_cpu_all=case.times_cpu,
            time_ratio=t / base_t,
            time_ratio_paired_median=paired,
            # Fastest round against fastest round: the least disturbed estimate on a busy machine.
            time_ratio_min=min(case.times) / min(cases[0].times),
            memory=mem[case.variant],
            memory_ratio=mem[case.variant]["total_bytes"] / base_m,
        )
    return rows


def print_table(rows, on_gpu, log):
    head = f"  {'variant':<10} {'time ratio':>10} {'paired':>8} {'min':>8} {'peak mem ratio':>15}"
    head += f" {'time ms':>9} {'peak MiB':>9}" if on_gpu else (
        f" {'resident ratio':>15} {'held ratio':>11} {'peak MiB':>9}")
    log(head)
    base = next(iter(rows.values()))["memory"]
    for variant, r in rows.items():
        line = (f"  {variant:<10} {r['time_ratio']:10.4f} {r['time_ratio_paired_median']:8.4f} "
                f"{r['time_ratio_min']:8.4f} {r['memory_ratio']:15.4f}")
        mem = r["memory"]
        if on_gpu:
            line += f" {1e3 * r['time_s_median']:9.2f} {mem['total_bytes'] / 2**20:9.1f}"
        else:
            line += (f" {mem['resident_total_bytes'] / base['resident_total_bytes']:15.4f}"
                     f" {mem['forward_held_bytes'] / base['forward_held_bytes']:11.4f}"
                     f" {mem['total_bytes'] / 2**20:9.1f}")
        log(line)


def check_targets(results, opts, on_gpu, log):
    kind = "gpu" if on_gpu else "cpu"
    t_max, m_max = TARGETS[kind]
    note = "" if opts["at_preset"] else (
        f"  (targets are defined for --preset {kind} on a {kind.upper()}; this run is "
        f"{'--quick' if opts['preset'] == 'quick' else 'at other settings'}, so PASS/MISS is only indicative)"
    )
    log(f"\ntargets on {kind.upper()} (--preset {kind}): head-wise / none time ratio <= {t_max}, "
        f"memory ratio <= {m_max}{note}")
    checks = []
    for key, rows in results.items():
        r = rows["head-wise"]
        for what, value, limit in (("time", r["time_ratio"], t_max),
                                   ("memory", r["memory_ratio"], m_max)):
            ok = value <= limit
            checks.append(dict(scope=key, what=what, ratio=value, target=limit, passed=ok))
            log(f"  {'PASS' if ok else 'MISS'}  {key:<10} {what:<6} {value:.4f} <= {limit}")
        if CONTROL in rows:
            c = rows[CONTROL]
            log(f"        {key:<10} noise floor: {CONTROL} / none time {c['time_ratio']:.4f} "
                f"(paired {c['time_ratio_paired_median']:.4f})")
    return checks


# --------------------------------------------------------------------------------------- main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--memory-child"]:
        return _memory_child(json.loads(argv[1]))
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    opts = resolve_options(args, on_gpu)
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    dtypes = opts["dtype"].split(",")
    log = lambda s="": print(s, flush=True)  # noqa: E731

    warnings.filterwarnings("ignore")
    import mcore_ext
    from mcore_ext import _mcore_compat

    if opts["moe"] and not _mcore_compat.has_router_replay():
        print("error: --moe pins every variant's routing with megatron-core's router replay "
              "(moe_enable_routing_replay), which this megatron-core lacks", file=sys.stderr)
        return 2
    backend = mcore_ext.resolve_backend(args.backend).value
    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    device = mcore_ext.device()
    try:
        if opts["batch"] is None:  # the gpu preset: 2 if it fits
            largest = DTYPES[max(dtypes, key=lambda d: DTYPES[d].itemsize)]
            opts["batch"] = pick_gpu_batch(opts, largest, backend, device, log) if on_gpu else 1
        scopes = ("layer", "block") if args.scope == "both" else (args.scope,)
        if opts["moe"]:
            scopes = ("block",)  # the attention layer is the same with or without MoE
        log(f"bench_gate: device {device_name(device)}, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, backend {backend}, dtypes {', '.join(dtypes)}")
        log(f"  preset {opts['preset']}: hidden {opts['hidden']}, heads {opts['heads']}, groups "
            f"{opts['groups']}, seq {opts['seq']}, batch {opts['batch']}, block layers "
            f"{opts['layers']}; rounds layer {opts['rounds']} / block {opts['block_rounds']}, "
            f"warmup {opts['warmup']}; dropout 0")
        clock = "wall clock" if opts["clock"] == "wall" else "process CPU time"
        log(f"  time ratio ({clock}): median over interleaved rounds of one forward + backward, over "
            "the same for 'none' (paired: median of per-round ratios; min: fastest over fastest)")
        if on_gpu:
            log("  memory: CUDA peak of one forward + backward (max_memory_allocated - allocated "
                "before) + parameter bytes + input bytes")
        else:
            log("  memory: peak of torch's CPU allocations in one forward + backward (allocator "
                "events under the profiler) + parameter bytes + input bytes; resident: the same "
                "with the process's resident peak (VmHWM after - VmRSS before, mmap threshold 64 "
                "KiB); held: bytes the forward leaves allocated for backward")

        base = ("none", "head-wise") if opts["moe"] else VARIANTS  # the MoE case: the gate's cost
        variants = base + (() if on_gpu or args.no_control else (CONTROL,))
        timed, profile = {}, None
        for dtype_name in dtypes:
            for scope in scopes:
                key = f"{dtype_name} {scope}"
                log(f"\n[{key}] building {', '.join(variants)}")
                cases = [_case(key, v, opts, backend) for v in variants]
                if opts["moe"]:
                    check_same_routing(cases, log)
                rounds = opts["rounds"] if scope == "layer" else opts["block_rounds"]
                start = time.perf_counter()
                run_rounds(cases, rounds, opts["warmup"], on_gpu, log, opts["clock"])
                log(f"[{key}] {time.perf_counter() - start:.0f} s")
                if args.profile and scope == "layer" and profile is None:
                    profile = profile_layer(cases, log)
                for case in cases:
                    case.drop_module()
                timed[key] = cases

        memory = measure_memory(list(timed), variants, opts, backend, on_gpu)
        results = {}
        for key, cases in timed.items():
            results[key] = summarize(cases, memory[key])
            log(f"\n[{key}]")
            print_table(results[key], on_gpu, log)
        checks = check_targets(results, opts, on_gpu, log)
    finally:
        mcore_ext.destroy_parallel()

    if args.json:
        payload = dict(
            argv=argv,
            device=device_name(device),
            host=platform.node(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            backend=backend,
            options=opts,
            memory_measure="cuda_peak" if on_gpu else "cpu_allocation_peak",
            results=results,
            targets=checks,
            profile=profile,
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"\nwrote {args.json}")
    return 0


def pick_gpu_batch(opts, dtype, backend, device, log):
    """Batch 2 if a block step of the largest variant ('full') fits with room to spare, else 1."""
    free, total = torch.cuda.mem_get_info()
    trial = dict(opts, batch=2)
    torch.cuda.reset_peak_memory_stats()
    try:
        case = Case(trial, "full", "block", dtype, backend, device)
        case.step()
        case.release()
        del case
        torch.cuda.synchronize()
        # Three blocks live at once while measuring: ask for 3x the step's peak.
        need = 3 * torch.cuda.max_memory_allocated()
        batch = 2 if need < 0.9 * free else 1
    except torch.cuda.OutOfMemoryError:
        batch = 1
    torch.cuda.empty_cache()
    log(f"  gpu preset: batch {batch} (free {free / 2**30:.1f} of {total / 2**30:.1f} GiB)")
    return batch


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    sys.exit(main())
