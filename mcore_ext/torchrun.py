"""``python -m mcore_ext.torchrun [torchrun's flags] PROGRAM ...``: torchrun, except for a user's
mistake, a run that saved to be resumed, and signals.

- When the ranks stop on a mistake in what the user gave them (exit code 2, the message already
  printed once by the first rank: ``mcore_ext.cli``), this exits 2 with nothing more, where
  torchrun prints its failure report (about 40 lines: one table entry per rank) and exits 1.
- When they stop having saved a checkpoint to be resumed from (exit code 16,
  ``faults.SAVED_NOT_FINISHED``: a preemption signal, ``training.exit_duration_mins``), this exits
  16 quietly too, where torchrun reports a failure and exits 1: a job script requeues on 16.
- The stop signals (``cli.STOP_SIGNALS``: SIGTERM, SIGINT, SIGUSR1, SIGUSR2) to this agent are
  passed on to its workers and the agent keeps waiting for them, so ranks with
  ``checkpoint.exit_on_signal`` finish their step and save; their exit code is the agent's. One
  that comes before the workers exist (the agent's rendezvous) is passed on as each starts.
  torchrun's agent instead raises on SIGTERM / SIGINT, stops its workers (SIGTERM, then SIGKILL
  30 s later, wherever their save is) and exits 1, and dies of SIGUSR1 / SIGUSR2. A second
  signal at least ``cli.SIGNAL_REPEAT_WINDOW_S`` after the first gets torchrun's handling (an
  operator who insists); within it, it is the same request (Slurm signals every process of a
  step at once).
- The workers of the launcher (``launch/pretrain.py``) and of the Megatron-LM entry (``-m
  mcore_ext.megatron_lm.pretrain_gpt``), whose ``main`` records the stop signals from its first
  line, start with the stop signals blocked: one that comes while they import (several seconds:
  torch, megatron) waits, pending, for their handler instead of ending them. Other programs
  start as under torchrun (a program that never unblocked them would never see one).
  The agent's own imports: ``python launch/torchrun.py`` holds the signals from its first line
  (``python -m`` imports the whole package before this module runs).

Any other failure gets torchrun's report and exit code unchanged.
"""

import logging
import os
import signal
import sys
import time

from mcore_ext.cli import SAVED_NOT_FINISHED, SIGNAL_REPEAT_WINDOW_S, STOP_SIGNALS, USAGE_ERROR

_QUIET_EXITS = (USAGE_ERROR, SAVED_NOT_FINISHED)
_FORWARDED = STOP_SIGNALS
# The programs whose workers start with the stop signals held: their first act is to take them
# over (mcore_ext.training.faults.ExitSignalHandler unblocks them).
_LAUNCHER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                         "pretrain.py")
_HOLDING_MODULES = ("mcore_ext.megatron_lm.pretrain_gpt",)  # its main: cli.ExitSignalHandler


class _NotUsageErrors(logging.Filter):
    """Drops the agent's "failed (exitcode: 2) ..." line (other failures keep theirs) and its
    "Sending process N closing signal SIGTERM" lines (a failure's report lists those ranks)."""

    def filter(self, record) -> bool:
        if record.msg.startswith("Sending process"):
            return False
        return not (record.msg.startswith("failed (exitcode") and record.args[0] in _QUIET_EXITS)


def _children() -> list[int]:
    """This process's child processes (torchrun's workers)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    return pids


class _ForwardSignals:
    """The agent's handler of the stop signals: pass the signal to the workers and keep waiting;
    workers that start later get it as they start (``spawned``)."""

    def __init__(self, repeat_window_s: float):
        self.repeat_window_s = repeat_window_s
        self.first_at = None
        self.signum = None

    def install(self):
        for name in _FORWARDED:
            signal.signal(getattr(signal, name), self)

    def __call__(self, signum, frame):
        now = time.monotonic()
        if self.first_at is not None and now - self.first_at >= self.repeat_window_s:
            from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

            _terminate_process_handler(signum, frame)  # raises: torchrun's own shutdown
        workers = _children()
        if self.first_at is None:
            self.first_at, self.signum = now, signum
            to = (f"the workers (pids {' '.join(map(str, workers))})" if workers else
                  "the workers as they start")
            print(f"[torchrun] {signal.Signals(signum).name}: passed on to {to}; waiting for them "
                  f"to save and exit", file=sys.stderr, flush=True)
        _send(signum, workers)

    def spawned(self, pid: int) -> None:
        """A worker has just started: a signal this agent received before is its too."""
        if self.signum is not None:
            _send(self.signum, [pid])


def _send(signum, pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _holds_signals(args) -> bool:
    """Whether the workers of this torchrun command take the stop signals over as they start."""
    if args.no_python:
        return False
    if args.module:
        return args.training_script in _HOLDING_MODULES
    return os.path.realpath(args.training_script) == os.path.realpath(_LAUNCHER)


def _start_workers_with(forwarder: _ForwardSignals, hold: bool) -> None:
    """torch's worker start (``SubprocessHandler._popen``, one Popen per worker), with the stop
    signals blocked in the new worker when ``hold`` (the mask of the thread that forks is the
    child's), and a stop signal received before it started passed on to it."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    start = subprocess_handler.SubprocessHandler._popen
    held = [getattr(signal, name) for name in _FORWARDED]

    def _popen(self, args, env):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, held) if hold else None
        try:
            proc = start(self, args, env)
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        forwarder.spawned(proc.pid)
        return proc

    subprocess_handler.SubprocessHandler._popen = _popen


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    # torchrun sets 1 too, with a banner saying so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NotUsageErrors())
    forwarder = _ForwardSignals(SIGNAL_REPEAT_WINDOW_S)
    forwarder.install()
    # Held until now where this agent was started through launch/torchrun.py: handled from here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, name) for name in _FORWARDED])

    @record  # as torchrun's main: a failed rank's error file becomes this process's
    def launch():
        args = parse_args(argv)
        _start_workers_with(forwarder, hold=_holds_signals(args))
        # torchrun installs its raising handler for the signals its --signals-to-handle names
        # when it starts the workers: the forwarded ones are left out, so that ours stays.
        args.signals_to_handle = ",".join(
            name for name in args.signals_to_handle.split(",") if name.strip() not in _FORWARDED)
        run(args)

    try:
        launch()
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode in _QUIET_EXITS:
            return first.exitcode
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
