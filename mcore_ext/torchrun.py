"""``python -m mcore_ext.torchrun [torchrun's flags] PROGRAM ...``: torchrun, except for a user's
mistake, a run that saved to be resumed, and signals.

- When the ranks stop on a mistake in what the user gave them (exit code 2, the message already
  printed once by the first rank: ``mcore_ext.cli``), this exits 2 with nothing more, where
  torchrun prints its failure report (about 40 lines: one table entry per rank) and exits 1.
- When they stop having saved a checkpoint to be resumed from (exit code 16,
  ``faults.SAVED_NOT_FINISHED``: a preemption signal, ``training.exit_duration_mins``), this exits
  16 quietly too, where torchrun reports a failure and exits 1: a job script requeues on 16.
- SIGTERM / SIGINT to this agent are passed on to its workers and the agent keeps waiting for
  them, so ranks with ``checkpoint.exit_on_signal`` finish their step and save; their exit code
  is the agent's. torchrun's agent instead raises on the signal, stops its workers (SIGTERM, then
  SIGKILL 30 s later, wherever their save is) and exits 1. A second signal at least
  ``cli.SIGNAL_REPEAT_WINDOW_S`` after the first gets torchrun's handling (an operator who
  insists); within it, it is the same request (Slurm signals every process of a step at once).

Any other failure gets torchrun's report and exit code unchanged.
"""

import logging
import os
import signal
import sys
import time

from mcore_ext.cli import SAVED_NOT_FINISHED, SIGNAL_REPEAT_WINDOW_S, USAGE_ERROR

_QUIET_EXITS = (USAGE_ERROR, SAVED_NOT_FINISHED)
_FORWARDED = ("SIGTERM", "SIGINT")


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
    """The agent's SIGTERM / SIGINT handler: pass the signal to the workers and keep waiting."""

    def __init__(self, repeat_window_s: float):
        self.repeat_window_s = repeat_window_s
        self.first_at = None

    def install(self):
        for name in _FORWARDED:
            signal.signal(getattr(signal, name), self)

    def __call__(self, signum, frame):
        now = time.monotonic()
        if self.first_at is not None and now - self.first_at >= self.repeat_window_s:
            from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

            _terminate_process_handler(signum, frame)  # raises: torchrun's own shutdown
        if self.first_at is None:
            self.first_at = now
            print(f"[torchrun] {signal.Signals(signum).name}: passed on to the workers "
                  f"(pids {' '.join(map(str, _children()))}); waiting for them to save and exit",
                  file=sys.stderr, flush=True)
        for pid in _children():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    # torchrun sets 1 too, with a banner saying so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NotUsageErrors())
    _ForwardSignals(SIGNAL_REPEAT_WINDOW_S).install()

    @record  # as torchrun's main: a failed rank's error file becomes this process's
    def launch():
        args = parse_args(argv)
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
