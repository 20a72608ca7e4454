"""A user's mistake in an entry point: one ``error:`` line, printed once, exit code 2.

Every entry point (the YAML launcher, ``python -m mcore_ext.hf``, the Megatron-LM entry) checks
what a user gave it before its first collective, so under torchrun every rank finds the same
mistake: the first rank prints it, and every rank exits with ``USAGE_ERROR`` without a
traceback. torchrun itself turns any rank's non-zero exit into its own failure report and exit
code 1; ``python -m mcore_ext.torchrun`` (same flags) exits 2 quietly instead.
"""

import logging
import os
import sys
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
