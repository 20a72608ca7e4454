"""What reading or writing a checkpoint raises; each message is meant for the user, on one line."""


class CheckpointLoadError(RuntimeError):
    """Reading the checkpoint failed (corrupt or truncated files, shapes that do not match)."""


class CheckpointCorruptError(CheckpointLoadError):
    """A file differs from what the save recorded (size or checksum): named in the message."""


class CheckpointNotFoundError(FileNotFoundError):
    """A path that should hold a checkpoint holds none (the message says what it holds)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoint is still the latest."""


class CheckpointFormatError(ValueError):
    """A checkpoint the launcher cannot continue exactly: the message names the field."""


def one_line(err: BaseException) -> str:
    """The error's message on one line; torch's checkpoint errors (which hold every failing
    rank's traceback), raised or as the cause, as each failing rank's error alone."""
    from torch.distributed.checkpoint.api import CheckpointException

    text = str(err)
    cause = err if isinstance(err, CheckpointException) else err.__cause__
    if isinstance(cause, CheckpointException):
        failures = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                             for rank, (exc, _) in cause.failures.items())
        text = text.replace(str(cause), failures)
    return " ".join(text.split()) or type(err).__name__
