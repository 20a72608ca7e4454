#!/usr/bin/env python
"""Activation memory per rank of a gated TransformerBlock with context parallelism, CP N vs CP 1.

One run measures both, side by side: N ranks (spawned here on gloo, or started by torchrun) run
the block at CP 1 on the full sequence (rank 0 only; the others wait), then at CP N on their
load-balanced chunks (all ranks); then both again with megatron's selective recompute of core
attention (``recompute_granularity="selective"``, ``core_attn``), which under CP also drops the
all-gathered K/V (re-gathered in backward). The block is ``--layers`` head-wise gated layers from
``mcore_ext.get_gpt_block_spec`` on the sdpa backend, causal, dropout 0.

Per configuration, one unmeasured forward + backward allocates the weight gradients, then one
measured step reports:

    peak        activation peak of forward + backward: GPU max_memory_allocated minus the bytes
                allocated before the step; CPU the resident-memory high-water mark (VmHWM, reset
                through /proc/self/clear_refs, glibc's mmap threshold fixed at 64 KiB so freed
                tensors leave the resident set; as in bench_gate.py) minus VmRSS before the step.
                Parameters, gradients and the input are allocated before, so they are not in it.
    saved       bytes the forward keeps for backward (unique storages seen by saved-tensor hooks):
                exact, blind to transients.
    time        seconds of the measured step (indicative only on shared cores).
    moved       K / V bytes this rank receives in the step (all-gathers and point-to-point
                halos, forward and backward; the reduce-scatter of dK / dV not counted).

``--window W`` makes every layer a sliding-window layer (megatron's window (W - 1, 0)): under CP
it exchanges only each chunk's halo of W - 1 keys instead of all-gathering K / V.

The CP N figures are the largest over the N ranks. Run ``python benchmarks/bench_cp.py --help``.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGET = 0.35  # CP 4 peak / CP 1 peak, the target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4, help="context-parallel size N (default 4)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, help="query groups (GQA); default: --heads")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--window", type=int, help="sliding window (HF's W) on every layer")
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH (rank 0)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.seq % (2 * args.cp):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2 x --cp = {2 * args.cp}")
    if "WORLD_SIZE" in os.environ:  # torchrun
        _rank_main(int(os.environ["RANK"]), args)
        return
    if torch.cuda.is_available():
        raise SystemExit("on GPUs start it with torchrun --nproc_per_node=<--cp>")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.cp))
    mp.spawn(_spawned, args=(args,), nprocs=args.cp)


def _spawned(rank, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    _rank_main(rank, args)


def _rank_main(rank, args):
    import warnings

    import torch.distributed as dist

    import mcore_ext

    warnings.simplefilter("ignore")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from bench_gate import fix_malloc_threshold

        torch.set_num_threads(1)
        fix_malloc_threshold()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # The default group outlives both configurations (init_parallel then does not own it).
    dist.init_process_group("nccl" if on_gpu else "gloo")
    results = {}
    for recompute in (False, True):
        for cp in (1, args.cp):
            mcore_ext.init_parallel(context_parallel_size=cp)
            if cp > 1 or rank == 0:
                results[cp, recompute] = _measure(args, cp, dtype, on_gpu, recompute)
            dist.barrier()
            mcore_ext.destroy_parallel()
    gathered = [None] * args.cp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        _report(args, dtype, gathered, on_gpu)
    dist.destroy_process_group()


def _measure(args, cp, dtype, on_gpu, recompute):
    import mcore_ext
    from megatron.core.transformer.transformer_block import TransformerBlock

    from bench_gate import step_time_and_peak

    from mcore_ext.attention import context_parallel

    config = mcore_ext.GatedTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups or args.heads, ffn_hidden_size=4 * args.hidden,
        head_wise_attn_gate=True, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype is torch.bfloat16, context_parallel_size=cp,
        recompute_granularity="selective" if recompute else None,
        window_size=(args.window - 1, 0) if args.window else None,
    )
    dev = mcore_ext.device()
    block = TransformerBlock(config, mcore_ext.get_gpt_block_spec(config, "sdpa")).to(dev, dtype).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)  # [b, s, h] for the split
    if cp > 1:
        x = context_parallel.get_batch_on_this_cp_rank({"x": x})["x"]
    x = x.transpose(0, 1).contiguous().to(dev, dtype).requires_grad_(True)  # [s_local, b, h]
    upstream = torch.randn_like(x)

    def step():
        x.grad = None
        out = block(x, attention_mask=None)
        out.backward(upstream)

    step()  # allocates the weight gradients, which the measured step accumulates into
    saved = _saved_bytes(block, x)
    seconds, peak = step_time_and_peak(step, on_gpu)
    if on_gpu:
        from bench_attention import attention_kernels

        print(f"[bench_cp] rank {torch.distributed.get_rank()} CP {cp} recompute {recompute}: "
              f"attention ops {attention_kernels(step)}", flush=True)
    with _CountReceived() as received:
        step()
    return dict(peak=peak, saved=saved, seconds=seconds, local_seq=x.size(0),
                moved=received.bytes)


class _CountReceived:
    """Bytes this rank receives through all-gathers and point-to-point receives."""

    def __enter__(self):
        import torch.distributed as dist

        self.bytes, self.real = 0, (dist.all_gather_into_tensor, dist.batch_isend_irecv)
        counter = self

        def all_gather_into_tensor(out, x, *args, **kwargs):
            counter.bytes += (out.numel() - x.numel()) * out.element_size()
            return counter.real[0](out, x, *args, **kwargs)

        def batch_isend_irecv(ops):
            counter.bytes += sum(op.tensor.numel() * op.tensor.element_size()
                                 for op in ops if op.op is dist.irecv)
            return counter.real[1](ops)

        dist.all_gather_into_tensor, dist.batch_isend_irecv = (all_gather_into_tensor,
                                                               batch_isend_irecv)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_into_tensor, dist.batch_isend_irecv = self.real


def _saved_bytes(block, x):
    """Bytes of the unique storages the forward saves for backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, attention_mask=None)
    del out
    storages.pop(x.untyped_storage().data_ptr(), None)  # the input is not an activation
    return sum(storages.values())


def _report(args, dtype, gathered, on_gpu):
    cp, mib = args.cp, 2**20
    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    window = f"window {args.window}" if args.window else "no window"
    print(f"[bench_cp] {args.layers}-layer gated block, seq {args.seq}, batch {args.batch}, hidden "
          f"{args.hidden}, heads {args.heads}/{args.groups or args.heads}, {window}, "
          f"{str(dtype).split('.')[-1]}, sdpa, {device}")
    print(f"{'':30}{'local seq':>10}{'peak MiB':>10}{'saved MiB':>11}{'step s':>8}"
          f"{'moved MiB':>11}")
    figures = {}
    for recompute in (False, True):
        label = "recompute core_attn" if recompute else "no recompute"
        base = gathered[0][1, recompute]
        ranks = [r[cp, recompute] for r in gathered]
        worst = {k: max(r[k] for r in ranks) for k in ("peak", "saved", "seconds", "moved")}
        for name, row in ((f"CP 1, {label}", base), (f"CP {cp} max, {label}", worst)):
            print(f"{name:30}{(base if row is base else ranks[0])['local_seq']:>10}"
                  f"{row['peak'] / mib:>10.1f}{row['saved'] / mib:>11.1f}{row['seconds']:>8.2f}"
                  f"{row['moved'] / mib:>11.2f}")
        ratio = {k: worst[k] / base[k] for k in ("peak", "saved")}
        met = "met" if ratio["peak"] <= TARGET else "MISSED"
        print(f"  ratio CP {cp} / CP 1 ({label}): peak {ratio['peak']:.3f}, saved "
              f"{ratio['saved']:.3f}" + (f" (target <= {TARGET}: {met})" if cp == 4 else ""))
        figures[label] = dict(cp1=base, cp_ranks=ranks, ratio=ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(options=vars(args), dtype=str(dtype), device=device, **figures), f,
                      indent=1)


if __name__ == "__main__":
    main()
