"""The launcher's checkpoint directory layout, shared by the launcher and ``mcore_ext.hf``.

    <save>/iter_0000010/                      megatron dist checkpoint + config.yaml
    <save>/latest_checkpointed_iteration.txt  "10": the latest complete checkpoint
    <save>/.saving.iter_N, .replaced.iter_N   a save in progress: never loaded
"""

import os

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of ``iteration``'s checkpoint under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str | None) -> int | None:
    """The iteration of the latest complete checkpoint under ``root``, or None."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except (TypeError, OSError, ValueError):
        return None
