"""Fault handling without torchrun: the async writer's Manager dies with the process that
started it, duplicate preemption signals, and the clean-up after a save killed half way."""

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


_SIGNALS = """
import os, signal, time
from mcore_ext.training.faults import ExitSignalHandler

with ExitSignalHandler() as handler:
    # SLURM's SIGTERM and torchrun's forwarded copy, milliseconds apart: one request.
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    print("alive", handler.received, flush=True)
    # An operator's second signal after the window ends the process at once.
    handler._received_at -= ExitSignalHandler.REPEAT_WINDOW_S
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still alive", flush=True)
"""


def test_a_repeated_signal_within_the_window_is_one_request():
    result = subprocess.run(
        [sys.executable, "-c", _SIGNALS], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.stdout.split("\n")[0] == "alive 15", (result.stdout, result.stderr[-2000:])
    assert "still alive" not in result.stdout
    assert result.returncode == -2, result.stderr[-2000:]  # SIGINT's default action


def _tree(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text() if p.is_file() else "/"
        for p in sorted(Path(root).rglob("*"))
    }


def test_recover_restores_a_tracked_checkpoint_moved_aside_and_drops_partial_saves(tmp_path):
    """A save killed between its two renames (iter_4 moved aside, the new one not yet in place):
    the tracked iteration's old directory goes back; unfinished writes are deleted."""
    from mcore_ext.checkpoint.directory import TRACKER
    from mcore_ext.checkpoint.directory import recover_root as _recover

    (tmp_path / TRACKER).write_text("4")
    (tmp_path / ".replaced.iter_0000004").mkdir()
    (tmp_path / ".replaced.iter_0000004" / "common.pt").write_text("old")
    (tmp_path / ".saving.iter_0000004").mkdir()
    (tmp_path / ".saving.iter_0000004" / "common.pt").write_text("new, complete")
    (tmp_path / ".saving.iter_0000008").mkdir()
    (tmp_path / ".saving.iter_0000008" / "__0_0.distcp").write_text("partial")
    _recover(str(tmp_path))
    assert _tree(tmp_path) == {TRACKER: "4", "iter_0000004": "/", "iter_0000004/common.pt": "old"}


def test_recover_drops_a_replaced_directory_once_the_new_one_is_in_place(tmp_path):
    from mcore_ext.checkpoint.directory import TRACKER
    from mcore_ext.checkpoint.directory import recover_root as _recover

    (tmp_path / TRACKER).write_text("4")
    for name, text in [("iter_0000004", "new"), (".replaced.iter_0000004", "old"),
                       ("iter_0000002", "older")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "common.pt").write_text(text)
    _recover(str(tmp_path))
    assert _tree(tmp_path) == {
        TRACKER: "4", "iter_0000002": "/", "iter_0000002/common.pt": "older",
        "iter_0000004": "/", "iter_0000004/common.pt": "new",
    }
