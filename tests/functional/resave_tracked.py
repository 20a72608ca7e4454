"""torchrun helper of test_faults: the launcher, except that instead of training it saves the
iteration it resumed (checkpoint.save's tracked one) again, with every weight changed, and rank 1
is killed inside megatron's writer: SIGXFSZ at its first byte of checkpoint data (RLIMIT_FSIZE 0
with the signal's default action; Python ignores SIGXFSZ otherwise).

    torchrun --nproc_per_node=2 tests/functional/resave_tracked.py --config ... [overrides]
"""

import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_ext.training import loop, main  # noqa: E402


class ResaveTracked(loop._Trainer):
    def run(self):
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(1.0)
        if dist.get_rank() == 1:
            print("[resave] rank 1: writing with RLIMIT_FSIZE 0", file=sys.stderr, flush=True)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        self._save()


# Guarded: megatron's checkpoint writer may start a spawn-context process that re-imports this.
if __name__ == "__main__":
    loop._Trainer = ResaveTracked
    sys.exit(main())
