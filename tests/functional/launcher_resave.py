"""torchrun helper of test_megatron_lm_checkpoints: the launcher, except that instead of training
it saves the iteration it loaded again, unchanged (a checkpoint read and written by the launcher).

    torchrun --nproc_per_node=2 tests/functional/launcher_resave.py --config ... [overrides]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_ext.training import loop, main  # noqa: E402


class Resave(loop._Trainer):
    def run(self):
        self._save()
        return True  # finished: the launcher exits 0


# Guarded: megatron's checkpoint writer may start a spawn-context process that re-imports this.
if __name__ == "__main__":
    loop._Trainer = Resave
    sys.exit(main())
