#!/usr/bin/env python
"""What checkpoint verification costs: a save's manifest, and a load's verification.

Each of ``--ranks`` gloo processes holds ``--mib-per-rank`` MiB of fp32 tensors (half "model",
half "optimizer", each a slice of a global tensor sharded over the ranks). Per round, measured
between barriers (the slowest rank's time):

    save      megatron's ``dist_checkpointing.save`` into a fresh ``.saving.`` directory
    manifest  ``mcore_ext.checkpoint.saving.publish``: each rank checksums its own files, rank 0
              writes the manifest, renames the directory and writes the tracker
    verify    ``manifest.verify_checkpoint``: the files split over the ranks, each read once
    load      megatron's ``dist_checkpointing.load`` of the same state

and prints the medians and the ratios (save + manifest) / save and (verify + load) / load. The
files are read back from the page cache (just written, or just verified): on a cluster file
system, a load's verification reads from storage, as its load does.

    python benchmarks/bench_checkpoint_manifest.py                     # 2 ranks x 256 MiB, 5 rounds
    python benchmarks/bench_checkpoint_manifest.py --ranks 4 --mib-per-rank 128 --rounds 3
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _state(rank: int, world: int, mib: int):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = mib * 2**20 // 4 // 1024 // 2  # two tensors of [rows, 1024] fp32 per rank
    state = {}
    for name in ("model.weight", "optimizer.exp_avg"):
        local = torch.randn(rows, 1024)
        state[name] = ShardedTensor.from_rank_offsets(name, local, (0, rank, world))
    return state


def _worker(rank, world, port, mib, rounds, root, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import mcore_ext
    from mcore_ext.training.faults import install_checkpoint_writer_queue

    mcore_ext.init_parallel()  # megatron's state, and the CPU adaptations (cuda_to_cpu)
    install_checkpoint_writer_queue(async_save=False)
    with mcore_ext.cuda_to_cpu():
        times = _rounds(rank, world, mib, rounds, root)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    mcore_ext.destroy_parallel()
    dist.destroy_process_group()


def _rounds(rank, world, mib, rounds, root) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_ext.checkpoint import manifest, saving
    from mcore_ext.checkpoint.directory import iteration_dir

    state = _state(rank, world, mib)
    times = {"save": [], "manifest": [], "verify": [], "load": []}

    def timed(name, fn):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        dist.barrier()
        times[name].append(time.perf_counter() - start)
        return result

    for iteration in range(1, rounds + 1):
        directory = iteration_dir(root, iteration)
        partial = saving.begin(directory)
        timed("save", lambda: dist_checkpointing.save(state, partial))
        timed("manifest", lambda: saving.publish(partial, directory, root=root,
                                                 iteration=iteration))
        problems = timed("verify", lambda: manifest.verify_checkpoint(directory))
        assert problems == [], problems
        target = _state(rank, world, mib)  # loaded into fresh tensors
        timed("load", lambda: dist_checkpointing.load(target, directory))
        if rank == 0:
            shutil.rmtree(directory)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="bench_manifest_", dir=args.dir)
    out = os.path.join(root, "times.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_worker, args=(args.ranks, port, args.mib_per_rank, args.rounds, root,
                                          out), nprocs=args.ranks, start_method="spawn")
        with open(out) as f:
            times = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    total_mib = args.ranks * args.mib_per_rank
    print(f"{args.ranks} ranks x {args.mib_per_rank} MiB = {total_mib} MiB per checkpoint, "
          f"{args.rounds} rounds (medians, slowest rank):")
    for name, seconds in median.items():
        print(f"  {name:<9} {seconds:7.3f} s  ({total_mib / seconds:8.0f} MiB/s)")
    print(f"save with manifest / save alone:  {1 + median['manifest'] / median['save']:.3f}")
    print(f"load with verify / load alone:    {1 + median['verify'] / median['load']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
