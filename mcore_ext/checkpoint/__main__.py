"""``python -m mcore_ext.checkpoint inspect DIR``: what a distributed checkpoint holds.

Reads only the checkpoint's metadata (global shapes), so it needs neither the saving run's
parallel layout nor a process group.
"""

import argparse
import re
import sys

from megatron.core import dist_checkpointing

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
    inspect.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)

    try:
        metadata = dist_checkpointing.load_tensors_metadata(args.checkpoint_dir)
    except Exception as error:  # noqa: BLE001 - report any unreadable checkpoint plainly
        print(f"error: cannot read checkpoint {args.checkpoint_dir}: {error}", file=sys.stderr)
        return 1
    shapes = {key: tuple(t.global_shape) for key, t in metadata.items()}
    width = max(map(len, shapes), default=0)
    print(f"{len(shapes)} tensors in {args.checkpoint_dir}")
    for key in sorted(shapes):
        print(f"  {key:<{width}}  {list(shapes[key])}  {metadata[key].dtype}")
    print("attention layout:")
    for line in attention_layout(shapes) or ["  (no linear_qkv tensors)"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
