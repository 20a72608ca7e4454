"""Pretraining with megatron-core: config schema, data, checkpoints and the training loop.

The entry point is ``launch/pretrain.py``; ``main(argv)`` here is what it calls.
"""

import os
import sys

from mcore_ext.training.config import ConfigError, PretrainConfig, load_config

__all__ = ["ConfigError", "PretrainConfig", "load_config", "main"]


def main(argv=None, *, entry_point: bool = False) -> int:
    """``--config FILE [section.key=value ...]``: validate, then train. Returns the exit code.

    The stop signals are recorded from here on (``faults.ExitSignalHandler``): with
    ``checkpoint.exit_on_signal`` every rank stops at the next boundary, before the first step
    too, and returns ``SAVED_NOT_FINISHED``; without it a signal that came while the config was
    read ends the process then, as it would have at once. ``entry_point``: this is the process's
    own entry (``launch/pretrain.py``), so once the exit code is decided a later stop signal is
    ignored until the process has exited (else the previous handlers return).
    """
    from mcore_ext.training.faults import ExitSignalHandler

    with ExitSignalHandler(ignore_on_exit=entry_point) as signals:
        return _main(argv, signals)


def _main(argv, signals) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N launch/pretrain.py",
        description="Pretrain a GPT with megatron-core (and the head-wise attention gate).",
    )
    parser.add_argument("--config", required=True, help="YAML file with the run's sections")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value",
        help="override config values, e.g. training.train_iters=20 model.head_wise_attn_gate=true",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="validate the config, print it fully resolved and exit (no training)",
    )
    parser.add_argument(
        "--world-size", type=int, default=None,
        help="with --check: validate for this many ranks (default: $WORLD_SIZE, else 1)",
    )
    args = parser.parse_args(argv)
    from mcore_ext.checkpoint import GateLayoutMismatch, signing
    from mcore_ext.checkpoint.errors import (
        CheckpointFormatError,
        CheckpointLoadError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        one_line,
    )
    from mcore_ext.cli import is_first_rank, quiet_known_noise, report_error
    from mcore_ext.data.chat import ChatDataError, data_error_line
    from mcore_ext.hf.adapter import AdapterError
    from mcore_ext.training.faults import die_with_torchrun, fault_point
    from mcore_ext.vision.placement import ImageTokenMismatch

    def usage_error(message) -> int:
        # The ranks but the first wait there for the agent to stop them (SIGTERM, once the first
        # has said it and exited): a stop signal ends this rank again, one recorded already now.
        if not is_first_rank():
            signals.release()
        return report_error(message)

    die_with_torchrun()  # a SIGKILL of torchrun ends its ranks too
    quiet_known_noise()
    fault_point("config")
    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
        if not cfg.checkpoint.exit_on_signal:
            signals.release()  # a signal ends the run at once, one that came already now
        signing.use_key_file(cfg.checkpoint.key_file)  # validated: readable, not empty
        # Where the run starts, before anything is written: a checkpoint.load that holds no
        # checkpoint is refused here.
        from mcore_ext.training import checkpointing

        start = checkpointing.start_point(cfg)
    except (ConfigError, CheckpointNotFoundError) as err:
        return usage_error(str(err))  # every rank finds the same error: the first says it
    if args.check:
        print(cfg.to_yaml(), end="")
        return 0
    found, iterations = start.checkpoint, cfg.training.train_iters
    if start.own and found.iteration is not None and found.iteration >= iterations:
        from mcore_ext.training.loop import run_complete

        if is_first_rank():
            print(run_complete(found.iteration, iterations, found.directory), flush=True)
        return 0

    from mcore_ext.training.loop import pretrain

    try:
        finished = pretrain(cfg, config_file=args.config,
                            signals=signals if cfg.checkpoint.exit_on_signal else None)
    except CheckpointSaveError as err:  # raised on every rank with the same message
        print(f"error: [rank {os.environ.get('RANK', '0')}] {err}", file=sys.stderr, flush=True)
        return 1
    except (CheckpointNotFoundError, CheckpointLoadError, CheckpointFormatError,
            GateLayoutMismatch, AdapterError) as err:
        # Found on every rank alike, before training: said once, nothing was written.
        return usage_error(one_line(err))
    except ChatDataError as err:  # found when a row was read (an image changed under the run)
        return report_error(data_error_line(err), seen_by_every_rank=False)
    except ImageTokenMismatch as err:  # text data (.bin / mock) holding the image placeholder
        return report_error(f"data.source={cfg.data.source}: {err}", seen_by_every_rank=False)
    from mcore_ext.training.faults import SAVED_NOT_FINISHED

    return 0 if finished else SAVED_NOT_FINISHED  # same on every rank: StopRequest agreed


