"""The async checkpoint writer's Manager dies with the process that started it (no torchrun)."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RANK = """
import os, signal
from megatron.core.dist_checkpointing.strategies import filesystem_async
from mcore_ext.training import faults

faults.install_checkpoint_writer_queue(async_save=True)
queue = filesystem_async._results_queue  # what megatron's writer will use
queue.put("written")
assert queue.get() == "written"
print(faults._writer_manager._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as an operator's kill -9 of a rank
"""


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_async_writer_manager_dies_with_its_rank():
    result = subprocess.run(
        [sys.executable, "-c", _RANK], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == -9, result.stderr[-3000:]
    manager = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(manager)
    if alive:  # megatron's own Manager() would stay: clean up, then fail
        os.kill(manager, 9)
    assert not alive, "the writer's Manager outlived its rank"
