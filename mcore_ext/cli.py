"""A user's mistake in an entry point: one ``error:`` line, printed once, exit code 2; and the
exit codes and stop signals every entry point shares (``ExitSignalHandler``).

Every entry point (the YAML launcher, ``python -m mcore_ext.hf``, the Megatron-LM entry) checks
what a user gave it before its first collective, so under torchrun every rank finds the same
mistake: the first rank prints it, and every rank exits with ``USAGE_ERROR`` without a
traceback. torchrun itself turns any rank's non-zero exit into its own failure report and exit
code 1; ``python -m mcore_ext.torchrun`` (same flags) exits 2 quietly instead.
"""

import logging
import os
import signal
import sys
import threading
import time
import warnings

USAGE_ERROR = 2
# "A checkpoint was saved, the run is not finished: start it again to go on" (a preemption
# signal, training.exit_duration_mins). 16 is the code Megatron-LM's rerun state machine exits
# with to ask for its job to be resumed from its checkpoint; launch/slurm/ requeues on it.
SAVED_NOT_FINISHED = 16
# Signals to one process within this many seconds are one request (Slurm signals every process
# of a job step, and torchrun's agent passes its copy on): mcore_ext.training.faults,
# mcore_ext.torchrun.
SIGNAL_REPEAT_WINDOW_S = 5.0
# The signals that stop a run to be resumed (checkpoint.exit_on_signal): what a scheduler sends
# before a time limit or a preemption (Slurm's --signal: TERM by default, USR1 / USR2 are common
# choices) and an operator's Ctrl-C. python -m mcore_ext.torchrun passes each on to its workers
# (mcore_ext.training.faults, mcore_ext.torchrun, launch/slurm/job.sh).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")

# The first rank to exit makes torchrun's agent stop the others: had another rank left first, the
# agent could stop the first rank before it printed the message (seen under load: no line at
# all). So under torchrun the other ranks wait, at most this long, for the agent to stop them.
AGENT_STOPS_THE_OTHERS_S = 30.0


def is_first_rank() -> bool:
    """Rank 0 of a torchrun job, or a process that is not part of one."""
    return os.environ.get("RANK", "0") == "0"


def report_error(message: str, seen_by_every_rank: bool = True) -> int:
    """Print ``error: message`` (on the first rank only when every rank saw the same mistake,
    else on this rank, naming it) and return USAGE_ERROR."""
    if seen_by_every_rank and not is_first_rank():
        if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent
            # Its SIGTERM must end this rank at once: a handler that holds the stop signals
            # (ExitSignalHandler, entered from an entry's first line) would keep it waiting here
            # until the agent's SIGKILL, which torchrun reports as a warning of its own.
            signals = [getattr(signal, name) for name in STOP_SIGNALS]
            for number in signals:
                signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
            time.sleep(AGENT_STOPS_THE_OTHERS_S)
        return USAGE_ERROR
    where = "" if seen_by_every_rank or os.environ.get("WORLD_SIZE", "1") == "1" else \
        f"[rank {os.environ.get('RANK')}] "
    # One write: lines of ranks printing at once stay whole.
    sys.stderr.write(f"error: {where}{' '.join(str(message).split())}\n")
    sys.stderr.flush()
    return USAGE_ERROR


def gpt_deprecation_notice(how_to_switch: str) -> str | None:
    """The line an entry point prints once (its first rank) when a user's choice builds megatron's
    GPTModel on a megatron-core that deprecates it (0.19+, which has HybridModel); None on older
    releases. ``how_to_switch``: that entry point's way to HybridModel. megatron's own notice,
    logged per GPTModel built (per rank, per model in a test), stays filtered away."""
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_hybrid_model():
        return None
    return (f"GPTModel is deprecated in megatron-core {_mcore_compat.megatron_core_version()} "
            f"(critical fixes only); {how_to_switch}")


class _DropMessages(logging.Filter):
    def __init__(self, *prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# Third-party notices every run of an entry point prints, none of them about what the user asked
# for: (message regex, category) for warnings, (logger, message prefixes) for log records.
_KNOWN_WARNINGS = (
    (r".*(Apex|Transformer Engine and Apex|absl\.logging) (is|are) not installed",  # megatron
     UserWarning),
    (r"Only transformer-engine>=[\d.]+ supports MoE experts", UserWarning),
    (r"MimoModelConfig is experimental", UserWarning),
    (r"full scope is deprecated", UserWarning),  # megatron's TransformerConfig, its own default
    (r"When using async grad allreduce", UserWarning),
    # torch's distributed checkpoint, loading in one process as mcore_ext.hf does
    (r"torch\.distributed is disabled, unavailable or uninitialized", UserWarning),
    (r"The argument order of load has been changed", UserWarning),
    # megatron's IndexedDataset logs on rank 0 only, asking for the rank before any process
    # group (the chat data's stores are opened while the config is validated)
    (r"Could not determine rank from torch\.distributed", UserWarning),
    # torch's, for the ShardedTensor that megatron's MoE experts' sharded state builds (hf export
    # of a MoE checkpoint); megatron-core chooses the type, a user cannot act on it
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)
_KNOWN_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", ("GPTModel IS DEPRECATED",)),
    # every synchronous torch_dist save goes through megatron's async code path
    ("megatron.core.dist_checkpointing.strategies.torch", ("MCore's async save is deprecated",)),
)


def quiet_known_noise() -> None:
    """Silence the known third-party notices above (entry points only: a library user keeps
    them)."""
    for message, category in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefixes in _KNOWN_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(*prefixes))


class ExitSignalHandler:
    """Record the stop signals (``STOP_SIGNALS``) instead of dying, from an entry point's first
    line: the launcher's ``training.faults.StopRequest`` tells all ranks at a boundary; the
    Megatron-LM entry hands a recorded one over to megatron.training's handler (``hand_over``).

    Entering unblocks them: ``python -m mcore_ext.torchrun`` starts these entries with them
    blocked, so one that arrives while they import is pending, not fatal, and is recorded here.
    ``release()`` hands them back to the previous handlers (a run that does not save on a
    signal), a recorded one included. On exit the previous handlers return, or with
    ``ignore_on_exit`` (a process's own entry point, whose exit code is decided) later ones are
    ignored.

    A second signal, at least ``REPEAT_WINDOW_S`` after the first, restores the previous handlers
    and re-sends itself: an operator who insists (a second Ctrl-C) still ends the process at
    once. Signals within the window are one request: SLURM signals every process and torchrun
    forwards the SIGTERM it got, so a rank receives two SIGTERMs milliseconds apart.
    Handlers are installed from the main thread only (Python runs them there).
    """

    SIGNALS = tuple(getattr(signal, name) for name in STOP_SIGNALS)
    REPEAT_WINDOW_S = SIGNAL_REPEAT_WINDOW_S

    def __init__(self, ignore_on_exit: bool = False):
        self.received: int = 0
        self._received_at = 0.0
        self._previous = {}
        self.ignore_on_exit = ignore_on_exit

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # Held for this process by its torchrun agent until now: delivered (recorded) here.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return self

    def __exit__(self, *exc):
        if self.ignore_on_exit and self._previous:
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            self._previous = {}
        self._restore()

    def release(self):
        """The previous handlers again; a signal recorded meanwhile is sent to them now."""
        received = self.received
        self._restore()
        if received:
            os.kill(os.getpid(), received)

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def hand_over(self, target: int) -> None:
        """Another handler now records ``target`` (megatron.training's, installed over this one
        for its ``--exit-signal``): the other stop signals are passed on to it as ``target``, and
        one recorded here is sent to it now."""
        target = int(target)

        def relay(signum, frame):
            os.kill(os.getpid(), target)

        for sig in self._previous:
            if sig != target:
                signal.signal(sig, relay)
        self._previous = {}
        if self.received:
            os.kill(os.getpid(), target)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if not self.received:
            self.received, self._received_at = signum, now
        elif now - self._received_at >= self.REPEAT_WINDOW_S:
            self._restore()
            if signal.getsignal(signum) == self._handle:  # nothing else to go back to
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
