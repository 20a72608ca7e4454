"""How a run ends when something goes wrong: no process outlives it, preemption saves, restarts
resume, save errors are clear.

- Helper processes. megatron's dist-checkpoint writer keeps its write results in a
  ``multiprocessing`` Manager queue (spawn context, one server process per rank, started on the
  first save: ``filesystem_async._results_queue``, the same global in megatron-core 0.16 - 0.19).
  Nothing stops that server when its rank dies by SIGKILL, so every killed rank left one behind.
  A synchronous save writes in the rank's own process and needs no Manager: an in-process queue
  replaces it. An asynchronous save (GPU) needs one; ours dies with its rank (Linux parent-death
  signal). Ranks started by torchrun die with torchrun the same way.
- Preemption (``checkpoint.exit_on_signal``): the stop signals (``cli.STOP_SIGNALS``: SIGTERM,
  SIGINT, SIGUSR1, SIGUSR2) only set a flag, from the launcher's first line to its exit
  (``python -m mcore_ext.torchrun`` starts it with them held, so that one arriving while it
  imports waits for the handler: ``ExitSignalHandler``); at each step boundary the ranks
  all-reduce it, and if any rank was signalled all of them save (skipping a due evaluation) and
  exit ``SAVED_NOT_FINISHED`` (Megatron-LM's ``--exit-signal-handler`` saves the same way but
  exits 0, which a job script cannot tell from a finished run; megatron-core ships no such
  handler). Before the first step the ranks ask the same at the start-up's boundaries (once
  the process group exists, after the data preparation, before the first step) and, signalled,
  all stop there with nothing to save (``StoppedBeforeTraining``), exit ``SAVED_NOT_FINISHED``
  too: nothing was trained, so the next start begins where this one did. A scheduler signals
  every process and torchrun forwards its own copy, so a repeat within
  ``ExitSignalHandler.REPEAT_WINDOW_S`` is the same request.
- Time limits (``training.exit_duration_mins``, Megatron-LM's ``--exit-duration-in-mins``):
  rank 0's clock decides, every rank learns it in the same all-reduce as the signal flag
  (``StopRequest``), and the run saves and exits ``SAVED_NOT_FINISHED`` too.
- Restarts: a worker restarted by ``torchrun --max-restarts`` resumes from the latest complete
  checkpoint in ``checkpoint.save`` (``checkpoint.directory.find_start``).
- Save errors: every rank checks that it can write ``checkpoint.save`` before training, and a
  failed save reports the failing ranks and their errors on every rank (``CheckpointSaveError``).
- Fault injection for tests and drills: ``MCORE_EXT_KILL_AT=<point>,<iteration>,<rank>`` makes
  that rank SIGKILL itself at ``fault_point(point, iteration)`` (first torchrun attempt only);
  ``MCORE_EXT_DELAY_AT=<point>,<seconds>,<rank>`` makes it sleep there instead (a rank that
  starts late, as on a loaded node: what the ranks decide must not depend on when each looks);
  ``MCORE_EXT_SIGNAL_AT=<point>,<iteration>,<rank>[,<signal>[,self]]`` makes it send a stop
  signal (SIGTERM unless named) to torchrun's agent, which passes it on to every rank (as a
  scheduler's signal to the job), or with ``self`` to itself alone, and go on.
"""

import ctypes
import os
import queue
import signal
import sys
import time

import torch
import torch.distributed as dist

from mcore_ext.checkpoint.errors import CheckpointSaveError
# The launcher's exit code after such a stop; ``python -m mcore_ext.torchrun`` passes it through
# (torchrun: 1) and launch/slurm/ requeues the job on it.
from mcore_ext.cli import SAVED_NOT_FINISHED, SIGNAL_REPEAT_WINDOW_S, STOP_SIGNALS  # noqa: F401
# Shared with the Megatron-LM entry (mcore_ext.megatron_lm), which holds the signals the same way.
from mcore_ext.cli import ExitSignalHandler  # noqa: F401
from mcore_ext.runtime import raise_unless_all_ok  # noqa: F401  (data.py, tests import it here)

_PR_SET_PDEATHSIG = 1

# Keeps an async save's Manager (and so its server process) alive as long as this process.
_writer_manager = None


# ----------------------------------------------------------------------------- helper processes


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have Linux send ``sig`` to this process when its parent exits (prctl PR_SET_PDEATHSIG).

    ``parent``: the pid the parent had when this process started; if it is already gone (it died
    before this call), ``sig`` is sent now. Returns False where the kernel offers no such signal.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_torchrun() -> None:
    """Under torchrun, end this rank (SIGKILL) when the torchrun agent that started it dies.

    torchrun stops its workers itself when it exits normally or on SIGTERM / SIGINT; only a
    SIGKILL of torchrun left them running. A rank already orphaned (re-parented to init) ends now.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ and die_with_parent(signal.SIGKILL):
        if os.getppid() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def install_checkpoint_writer_queue(async_save: bool) -> None:
    """Give megatron's filesystem writer a results queue that no process outlives.

    Call before the first save. Synchronous saves write in this process: a plain queue. Async
    saves write in a forked child: a spawn-context Manager whose server dies with this rank.
    """
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    current = filesystem_async._results_queue  # None until a save (or an earlier call) sets it
    if not async_save:
        if current is None:
            filesystem_async._results_queue = queue.Queue()
        return
    if current is not None and not isinstance(current, queue.Queue):
        return  # a Manager queue from an earlier run in this process
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=torch.multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(signal.SIGKILL, os.getpid()))
    _writer_manager = manager
    filesystem_async._results_queue = manager.Queue()


# ---------------------------------------------------------------------------------- preemption


class StoppedBeforeTraining(Exception):
    """Raised on every rank alike when a stop signal came before the first step: nothing was
    trained since the start, so there is nothing to save (``stop_before_training``)."""


def stop_before_training(stop: "StopRequest | None") -> None:
    """Collective, at a start-up boundary: raise ``StoppedBeforeTraining`` on every rank if any
    rank has received a stop signal."""
    reason = stop.agreed(signals_only=True) if stop is not None else None
    if reason is not None:
        raise StoppedBeforeTraining(reason)


class StopRequest:
    """Collective, at each step boundary: should every rank save and stop now, and why.

    Two reasons, both answered in one all-reduce (none when neither is on): a signal some rank
    received (``ExitSignalHandler``), and rank 0's clock past ``exit_duration_mins`` since
    ``started`` (time.monotonic()). Only rank 0's clock counts: ranks that each read their own
    could disagree at the boundary, and a rank that stopped alone would leave the others in the
    save's collectives.
    """

    def __init__(self, signals: "ExitSignalHandler | None", exit_duration_mins: float | None,
                 started: float, clock=time.monotonic):
        self.signals, self.minutes, self.started, self.clock = (
            signals, exit_duration_mins, started, clock)

    def agreed(self, signals_only: bool = False) -> str | None:
        """The reason every rank stops for (the same string on each), or None. ``signals_only``:
        the start-up's question (a time limit is for a run that has trained since it began)."""
        minutes = None if signals_only else self.minutes
        if self.signals is None and minutes is None:
            return None
        elapsed = (self.clock() - self.started) / 60
        late = minutes is not None and dist.get_rank() == 0 and elapsed >= minutes
        flags = torch.tensor([self.signals.received if self.signals else 0, int(late)],
                             dtype=torch.int32, device=_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, late = (int(x) for x in flags.tolist())
        if signum:
            return f"{signal.Signals(signum).name} received"
        if late:
            return f"training.exit_duration_mins={self.minutes:g} reached"
        return None


# ------------------------------------------------------------------------------------ restarts


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# ---------------------------------------------------------------------------------- save errors


def check_writable(directory: str) -> None:
    """Collective: raise CheckpointSaveError on every rank unless every rank can write here.

    Each rank writes its own checkpoint files, so each one checks (a node-local or read-only
    mount fails on some ranks only).
    """
    failure = None
    probe = os.path.join(directory, f".write_test.rank{dist.get_rank()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        failure = err
    raise_unless_all_ok(
        failure, f"checkpoint.save={directory!r} is not writable", CheckpointSaveError
    )


# ----------------------------------------------------------------------------- fault injection


def fault_point(point: str, iteration: int | None = None) -> None:
    """SIGKILL this rank here if MCORE_EXT_KILL_AT names this point, iteration and rank; sleep
    first if MCORE_EXT_DELAY_AT names this point and rank (any iteration, every attempt); send a
    stop signal first if MCORE_EXT_SIGNAL_AT names them (first attempt only).

    ``MCORE_EXT_KILL_AT=save,8,1``: rank 1 dies in the save at iteration 8 (``*``: any
    iteration). Only on torchrun's first attempt, so a restarted worker runs through.
    """
    delay = os.environ.get("MCORE_EXT_DELAY_AT")
    if delay:
        name, seconds, rank = delay.split(",")
        if name == point and rank == os.environ.get("RANK", "0"):
            print(f"[fault] rank {rank}: {seconds} s late at {point}", file=sys.stderr,
                  flush=True)
            time.sleep(float(seconds))
    signal_spec = os.environ.get("MCORE_EXT_SIGNAL_AT")
    if signal_spec and not restart_count():
        name, at, rank, *how = signal_spec.split(",")
        if name == point and at in ("*", str(iteration)) and rank == os.environ.get("RANK", "0"):
            sig = getattr(signal, how[0] if how else "SIGTERM")
            to_self = how[1:] == ["self"]
            print(f"[fault] rank {rank}: {sig.name} to {'itself' if to_self else 'torchrun'} at "
                  f"{point} {iteration}", file=sys.stderr, flush=True)
            os.kill(os.getpid() if to_self else os.getppid(), sig)
    spec = os.environ.get("MCORE_EXT_KILL_AT")
    if not spec or restart_count():
        return
    name, at, rank = spec.split(",")
    if (
        name == point
        and at in ("*", str(iteration))
        and rank == os.environ.get("RANK", "0")
    ):
        print(f"[fault] rank {rank}: SIGKILL at {point} {iteration}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _device():
    from mcore_ext.runtime import device

    return device()
