"""python launch/torchrun.py [torchrun's flags] PROGRAM ...: ``python -m mcore_ext.torchrun``
with the stop signals held from this file's first line (mcore_ext/torchrun.py says what it does).

The agent imports torch and megatron before it can install its handler (seconds; half a minute
on a loaded node), and ``python -m`` imports the whole mcore_ext package first: a SIGTERM then
ended the agent, and the job with it. Blocked here, a stop signal waits, pending, until
``mcore_ext.torchrun``'s handler takes it over. The Slurm job scripts start their agents so.
"""

import signal

# cli.STOP_SIGNALS, before any import that takes time (tests/unit/test_faults.py keeps them equal)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# Run from a checkout without installing: the package lives one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_ext.torchrun import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
