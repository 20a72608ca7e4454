#!/usr/bin/env python
"""What the restricted reads of a checkpoint's pickles cost (``mcore_ext.checkpoint.safe_pickle``).

On one checkpoint directory, in one process, per round, each read done the restricted way (as
every load does now) and torch's plain way (``pickle.load`` / ``torch.load(weights_only=False)``,
torch's own functions swapped back in for the measurement), alternately:

    metadata  ``FileSystemReader.read_metadata``: the ``.metadata`` pickle
    objects   a DCP load of every byte object (common state, RNG states, extra states, ...)

and prints the medians and the ratios restricted / plain. Tensors are read with
``weights_only=True`` either way (torch's reader), so a load's tensor time does not change.

    python benchmarks/bench_checkpoint_safe_load.py runs/a/checkpoints/iter_0000020 --rounds 20
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="one checkpoint directory (iter_NNNNNNN)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)

    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    plain = (FileSystemReader.read_metadata, FileSystemReader.read_data,
             DefaultLoadPlanner.load_bytes)
    import mcore_ext.checkpoint  # noqa: F401  (installs the restricted reads)

    restricted = (FileSystemReader.read_metadata, FileSystemReader.read_data,
                  DefaultLoadPlanner.load_bytes)
    assert restricted != plain, "mcore_ext did not install its restricted reads"

    def use(functions):
        (FileSystemReader.read_metadata, FileSystemReader.read_data,
         DefaultLoadPlanner.load_bytes) = functions

    directory = args.checkpoint_dir
    metadata = FileSystemReader(directory).read_metadata()
    objects = [fqn for fqn, item in metadata.state_dict_metadata.items()
               if isinstance(item, BytesStorageMetadata)]

    def read_metadata():
        FileSystemReader(directory).read_metadata()

    def read_objects():
        state = {fqn: io.BytesIO() for fqn in objects}
        dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)

    times = {(what, way): [] for what in ("metadata", "objects") for way in ("plain", "safe")}
    for _ in range(args.rounds):
        for way, functions in (("plain", plain), ("safe", restricted)):
            use(functions)
            for what, read in (("metadata", read_metadata), ("objects", read_objects)):
                start = time.perf_counter()
                read()
                times[what, way].append(time.perf_counter() - start)
    use(restricted)

    size = (Path(directory) / ".metadata").stat().st_size
    print(f"{directory}: .metadata {size / 1024:.0f} KiB, {len(objects)} byte objects, "
          f"medians of {args.rounds} rounds")
    print("| read | plain | restricted | restricted / plain |")
    print("|---|---|---|---|")
    for what in ("metadata", "objects"):
        a = statistics.median(times[what, "plain"])
        b = statistics.median(times[what, "safe"])
        print(f"| {what} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
