#!/usr/bin/env python
"""Step-3.5 tiny model, forward + backward time and peak memory: a reference commit vs this tree.

One run measures both, side by side: the reference (default ``main``) is checked out into a
temporary git worktree, and each round runs one fresh process per tree (alternating, so drift in
the machine's load hits both alike) that builds the same model (``build_gpt_model``, same
seed) and times ``--steps`` forward + backward steps after one warm-up. Figures per tree: the
median step time over all rounds, and the peak memory of one step (GPU: max_memory_allocated
minus what was allocated before; CPU: the resident high-water mark, as bench_gate.py / bench_cp.py
measure it).

The model: Step-3.5's attention in miniature (1 full : 3 sliding layers, window ``--window``,
96 / 64 heads, 8 KV groups like the released model scaled down, per-kind RoPE, head-wise gate,
q/k norms), dense SwiGLU MLP. ``--packed N`` packs the sequence as N documents (THD).
``--kernel`` picks the sdpa backend's kernel.

    python benchmarks/bench_attention.py                 # CPU: main vs this tree
    python benchmarks/bench_attention.py --ref HEAD~3 --seq 4096 --rounds 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default="main", help="git commit to compare with (default main)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--packed", type=int, default=0, help="documents per sequence (0: unpacked)")
    p.add_argument("--kernel", default="sdpa", choices=("sdpa", "flex", "varlen"))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=3, help="processes per tree")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-ref", action="store_true",
                   help="measure this tree only (e.g. flex vs sdpa vs varlen on a GPU)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    if args.no_ref:
        runs = {"this tree": [_run_worker(ROOT, argv if argv is not None else sys.argv[1:])
                              for _ in range(args.rounds)]}
        _report(args, runs)
        return
    tmp = tempfile.mkdtemp(prefix="bench_attention_ref_")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tmp, args.ref],
                   check=True)
    ref_sha = subprocess.run(["git", "-C", tmp, "rev-parse", "--short", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
    head_sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    trees = {f"ref {args.ref} ({ref_sha})": tmp, f"this tree ({head_sha}+)": ROOT}
    runs = {name: [] for name in trees}
    try:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(_run_worker(tree, argv if argv is not None else sys.argv[1:]))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tmp], check=False)
    _report(args, runs)


def _run_worker(tree, argv):
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench_attention.py"), "--worker",
                          *argv], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker(args):
    import warnings

    import torch

    warnings.simplefilter("ignore")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        sys.path.insert(0, HERE)
        from bench_gate import fix_malloc_threshold

        fix_malloc_threshold()
    import mcore_ext
    from megatron.core.packed_seq_params import PackedSeqParams

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    mcore_ext.init_parallel()
    heads = args.hidden // args.head_dim
    config = mcore_ext.GatedTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
        num_query_groups=max(1, heads // 8) if heads >= 8 else heads,
        kv_channels=args.head_dim, ffn_hidden_size=3 * args.hidden,
        layer_types=["full_attention" if i % 4 == 0 else "sliding_attention"
                     for i in range(args.layers)],
        sliding_window=args.window, sliding_num_attention_heads=heads * 3 // 2,
        rotary_base=5e6, rotary_percent=0.5, sliding_rotary_base=1e4,
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, head_wise_attn_gate=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype is torch.bfloat16, attention_kernel=args.kernel,
        use_cpu_initialization=True,
    )
    dev = mcore_ext.device()
    torch.manual_seed(0)
    model = mcore_ext.build_gpt_model(config, vocab_size=1024, max_sequence_length=args.seq,
                                      backend="sdpa").to(dev).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (args.batch, args.seq), generator=g).to(dev)
    positions = torch.arange(args.seq, device=dev).expand_as(tokens)
    params = None
    if args.packed:
        doc = args.seq // args.packed
        cu = torch.arange(0, args.seq + 1, doc, dtype=torch.int32, device=dev)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=doc, max_seqlen_kv=doc)
        positions = (positions % doc)

    def step():
        model.zero_grad(set_to_none=False)
        logits = model(tokens, positions, None, packed_seq_params=params)
        logits.float().mean().backward()

    step()  # warm-up; allocates the gradients
    times = []
    for _ in range(args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        from bench_gate import _proc_status_bytes, _reset_resident_peak

        before = _proc_status_bytes("VmRSS")
        _reset_resident_peak()
        step()
        peak = _proc_status_bytes("VmHWM") - before
    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    return dict(times=times, peak=peak, device=device, dtype=str(dtype).split(".")[-1],
                kernels=attention_kernels(step))


def attention_kernels(step) -> list:
    """The attention ops one ``step()`` runs (flash / efficient / math SDPA, flex, varlen), by
    the profiler's op names: which kernel SDPA picked."""
    import torch

    words = ("flash", "efficient_attention", "attention_math", "flex", "varlen", "cudnn_attention")
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    ops = {e.key for e in prof.key_averages()
           if e.key.startswith("aten::") and any(w in e.key for w in words)}
    # The math kernel is SDPA's fallback (a [sq, sk] score matrix per head): which shapes fell
    # back says which call site to fix.
    ops |= {f"{e.key} {e.input_shapes}" for e in prof.key_averages(group_by_input_shape=True)
            if e.key.endswith("_scaled_dot_product_attention_math")}
    return sorted(ops)


def _report(args, runs):
    mib = 2**20
    first = next(iter(runs.values()))[0]
    print(f"[bench_attention] Step-3.5 tiny: {args.layers} layers (1 full : 3 sliding, window "
          f"{args.window}), hidden {args.hidden}, head dim {args.head_dim}, seq {args.seq}, "
          f"batch {args.batch}, packed {args.packed or 'no'}, kernel {args.kernel}, "
          f"{first['dtype']}, {first['device']}; {args.rounds} rounds x {args.steps} steps")
    print(f"{'':32}{'step s (median)':>16}{'peak MiB (median)':>19}")
    figures = {}
    for name, results in runs.items():
        seconds = statistics.median(t for r in results for t in r["times"])
        peak = statistics.median(r["peak"] for r in results) / mib
        figures[name] = dict(seconds=seconds, peak_mib=peak, runs=results)
        print(f"{name:32}{seconds:>16.3f}{peak:>19.1f}")
    for name, fig in figures.items():
        print(f"  {name} attention ops: {', '.join(fig['runs'][0]['kernels']) or '-'}")
    if args.json:  # with --no-ref too (one tree)
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), figures=figures), f, indent=1)
    if len(figures) == 1:
        return
    (ref, ours) = figures.values()
    print(f"ratio this / ref: time {ours['seconds'] / ref['seconds']:.3f}, peak "
          f"{ours['peak_mib'] / ref['peak_mib']:.3f}")


if __name__ == "__main__":
    main()
