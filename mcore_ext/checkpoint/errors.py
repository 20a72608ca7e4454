"""What reading or writing a checkpoint raises; each message is meant for the user, on one line."""


class CheckpointLoadError(RuntimeError):
    """Reading the checkpoint failed (corrupt or truncated files, shapes that do not match)."""


class CheckpointCorruptError(CheckpointLoadError):
    """A file differs from what the save recorded (size or checksum): named in the message."""


class CheckpointUnsafeError(CheckpointLoadError):
    """A pickle in the checkpoint holds a type no checkpoint holds (code it would run): refused
    before any of it ran; the message names the file and the type. Every rank raises it: each
    reads the metadata, and torch's DCP gathers a rank's refusal of an object to all ranks."""

    on_every_rank = True


class PickleRefused(BaseException):
    """What ``safe_pickle``'s readers raise, deep inside torch's and megatron's loading code: a
    BaseException, so that no ``except Exception`` there swallows it (torch's DCP falls back to a
    rank's own metadata file on any Exception, logging a traceback). ``safe_pickle.refusals()``
    turns it into ``CheckpointUnsafeError`` at the entry points."""


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

    refused = refusal_in(err)
    if refused is not None:  # the refusal alone: the same on every rank
        return " ".join(str(refused).split())
    text = str(err)
    cause = err if isinstance(err, CheckpointException) else err.__cause__
    if isinstance(cause, CheckpointException):
        failures = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                             for rank, (exc, _) in cause.failures.items())
        text = text.replace(str(cause), failures)
    return " ".join(text.split()) or type(err).__name__


def refusal_in(err: BaseException) -> CheckpointUnsafeError | PickleRefused | None:
    """The refusal (``PickleRefused`` or ``CheckpointUnsafeError``) inside ``err``: itself, a
    cause or context, or a rank's failure of torch's ``CheckpointException`` (which DCP raises
    for any rank's error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen, pending = set(), [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (CheckpointUnsafeError, PickleRefused)):
            return current
        if isinstance(current, CheckpointException):
            pending.extend(failure for failure, _ in current.failures.values())
        pending.extend([current.__cause__, current.__context__])
    return None
