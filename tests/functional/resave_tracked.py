"""torchrun helper of test_faults: the launcher, except that instead of training it saves the
iteration it resumed (checkpoint.save's tracked one) again, with every weight changed, and a rank
is killed in that save. ``RESAVE_KILL`` says where:

- ``writer`` (default): rank 1 inside megatron's writer, SIGXFSZ at its first byte of checkpoint
  data (RLIMIT_FSIZE 0 with the signal's default action; Python ignores SIGXFSZ otherwise);
- ``renames``: rank 0 by SIGKILL between the two renames that put the new directory in place
  (``directory.replace_dir``), right after the tracked one was moved aside as ``.replaced.``.

    RESAVE_KILL=renames torchrun --nproc_per_node=2 tests/functional/resave_tracked.py --config ...
"""

import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_ext.checkpoint.directory import REPLACED  # noqa: E402
from mcore_ext.training import loop, main  # noqa: E402


def _die_after_moving_aside(rename):
    def renamed(source, target, *args, **kwargs):
        rename(source, target, *args, **kwargs)
        if os.path.basename(target).startswith(REPLACED):
            print("[resave] rank 0: SIGKILL between the two renames", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return renamed


class ResaveTracked(loop._Trainer):
    def run(self):
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(1.0)
        kill = os.environ.get("RESAVE_KILL", "writer")
        if kill == "writer" and dist.get_rank() == 1:
            print("[resave] rank 1: writing with RLIMIT_FSIZE 0", file=sys.stderr, flush=True)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        if kill == "renames" and dist.get_rank() == 0:
            os.rename = _die_after_moving_aside(os.rename)
        self._save()
        return True  # finished: the launcher exits 0


# Guarded: megatron's checkpoint writer may start a spawn-context process that re-imports this.
if __name__ == "__main__":
    loop._Trainer = ResaveTracked
    sys.exit(main())
