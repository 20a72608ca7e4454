"""``python -m mcore_ext.checkpoint inspect DIR [--verify]``: what a distributed checkpoint holds.

DIR is a checkpoint directory or a save directory (its tracked checkpoint). Reads only the
checkpoint's metadata (global shapes), so it needs neither the saving run's parallel layout nor
a process group. ``--verify`` also reads every file and compares it with the manifest the save
wrote (sizes, CRC32; with ``MCORE_EXT_CHECKPOINT_KEY`` its signature and SHA-256s, and a file the
manifest does not list is a problem), and reads every pickle of the checkpoint the restricted way a
load does (``safe_pickle``). It refuses what a load refuses, as a load does: every problem on its
own ``CORRUPT:`` line (stdout), then one ``error:`` line (stderr), exit code 2, nothing more read.
A pickle that would run code is one ``error:`` line, exit code 2, with or without ``--verify``.
Exit code 1: no manifest to verify against (a Megatron-LM checkpoint), or an unreadable one.
"""

import argparse
import re
import sys

from megatron.core import dist_checkpointing

from mcore_ext.checkpoint import manifest, safe_pickle
from mcore_ext.checkpoint.directory import find_checkpoint
from mcore_ext.checkpoint.errors import (
    CheckpointCorruptError, CheckpointNotFoundError, CheckpointUnsafeError)
from mcore_ext.checkpoint.sharding import GATE_SUFFIX, QKV_SUFFIX


def attention_layout(shapes: dict[str, tuple]) -> list[str]:
    """Heads, groups and gate of every linear_qkv in the checkpoint, derived from global shapes.

    With the gate, heads = gate rows; head_dim = linear_proj columns / heads;
    groups = (QKV rows / head_dim - heads) / 2. Without it only the row count is known for sure.
    """
    lines = []
    for key, shape in sorted(shapes.items()):
        if key.startswith("optimizer.") or not re.search(r"linear_qkv\.weight(\._qkv)?$", key):
            continue
        base = key.removesuffix(QKV_SUFFIX)
        layers = f"{shape[0]} layers, " if len(shape) == 3 else ""
        proj = shapes.get(base.replace("linear_qkv.weight", "linear_proj.weight"))
        gate = shapes.get(base + GATE_SUFFIX)
        if gate is not None and proj is not None:
            heads, qkv_rows = gate[-2], shape[-2]
            head_dim = proj[-1] // heads
            groups = (qkv_rows // head_dim - heads) // 2
            lines.append(
                f"{base}: {layers}hidden {shape[-1]}, {heads} heads, {groups} query groups, "
                f"head dim {head_dim}, head-wise gate: yes ({heads} rows)"
            )
        else:
            lines.append(f"{base}: {layers}{shape[-2]} QKV rows, hidden {shape[-1]}, head-wise gate: no")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_ext.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list tensors, global shapes and attention layout")
    inspect.add_argument("checkpoint_dir", help="a checkpoint directory or a save directory")
    inspect.add_argument("--verify", action="store_true",
                         help="compare every file with the sizes and checksums its save recorded")
    args = parser.parse_args(argv)

    directory = args.checkpoint_dir
    try:
        found = find_checkpoint(directory)
    except (CheckpointNotFoundError, OSError) as error:
        print(f"error: {directory}: {error}", file=sys.stderr)
        return 1
    directory = found.directory if found is not None else directory
    try:
        with safe_pickle.refusals():
            ok = not args.verify or _verify(directory)
            metadata = dist_checkpointing.load_tensors_metadata(directory)
    except (CheckpointUnsafeError, CheckpointCorruptError) as error:  # nothing of it ran
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - report any unreadable checkpoint plainly
        print(f"error: cannot read checkpoint {directory}: {error}", file=sys.stderr)
        return 1
    shapes = {key: tuple(t.global_shape) for key, t in metadata.items()}
    width = max(map(len, shapes), default=0)
    print(f"{len(shapes)} tensors in {directory}")
    for key in sorted(shapes):
        print(f"  {key:<{width}}  {list(shapes[key])}  {metadata[key].dtype}")
    print("attention layout:")
    for line in attention_layout(shapes) or ["  (no linear_qkv tensors)"]:
        print(f"  {line}")
    return 0 if ok else 1


def _verify(directory: str) -> bool:
    """Print what verification finds; True when every file matches the manifest, False without
    a manifest; CheckpointCorruptError (as a load raises it) when a file differs."""
    problems = manifest.verify_checkpoint(directory, collective=False)
    if problems is None:
        print(f"verify: {directory} has no {manifest.MANIFEST} (saved before checksums were "
              "recorded, or by Megatron-LM): cannot verify it")
        return False
    if problems:
        for name, what in problems:
            print(f"CORRUPT: {directory}/{name}: {what}")
        raise CheckpointCorruptError(
            f"checkpoint {directory} is corrupt: {manifest.summary(problems)}")
    entries = manifest.read(directory)
    size = sum(entry["size"] for entry in entries.values())
    print(f"verified: all {len(entries)} files of {directory} ({size / 2**20:.1f} MiB) match "
          "their recorded sizes and checksums")
    objects = safe_pickle.check_objects(directory)
    print(f"verified: the metadata and all {objects} pickled objects hold only checkpoint types")
    return True


if __name__ == "__main__":
    sys.exit(main())
