"""Pretraining launcher: torchrun --nproc_per_node=N launch/pretrain.py --config FILE [k=v ...]

See mcore_ext/run_config/schema.py for the config sections and keys.
"""

import sys
from pathlib import Path

# Run from a checkout without installing: the package lives one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ext.training import main  # noqa: E402

# Guarded: megatron's checkpoint writer starts a spawn-context process that re-imports this file.
if __name__ == "__main__":
    sys.exit(main(entry_point=True))
