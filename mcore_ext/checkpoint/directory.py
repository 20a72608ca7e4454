"""The checkpoint directory layout and how directories are written, shared by the launcher and
``mcore_ext.hf``.

    <save>/iter_0000010/                      megatron dist checkpoint, config.yaml, manifest
    <save>/latest_checkpointed_iteration.txt  "10": the latest complete checkpoint ("release":
                                              <save>/release/, as Megatron-LM names a released
                                              model)
    <save>/mcore_ext_run.json                 {"run": id}: the run whose saves these are, written
                                              by its first save with a signing key (every
                                              manifest names it)
    <save>/.saving.iter_N, .replaced.iter_N   a save in progress: never loaded

A directory (a checkpoint iteration, an HF export) is written as ``.saving.<name>`` beside its
place and renamed to ``<name>`` once complete; an existing ``<name>`` is renamed to
``.replaced.<name>`` first and deleted after (``replace_dir``). Renames are atomic, so a kill at
any moment leaves the old or the new directory under ``<name>``, or, between the two renames,
the old one as ``.replaced.<name>``, which ``recover_dir`` puts back. The tracker is written
last, also by a rename (``write_tracker``).
"""

import dataclasses
import json
import os
import re
import shutil
import uuid

from mcore_ext.checkpoint.errors import CheckpointNotFoundError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
RUN_FILE = "mcore_ext_run.json"
# Prefixes of a directory's name while it is written / while it is being replaced.
SAVING, REPLACED = ".saving.", ".replaced."
_ITERATION_NAME = re.compile(r"iter_(\d{7,})")


def iteration_dir(root: str, iteration: int) -> str:
    """The directory of ``iteration``'s checkpoint under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str | None) -> int | None:
    """The iteration of the latest complete checkpoint under ``root``, or None (no tracker, or
    one that does not name an iteration number)."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except (TypeError, OSError, ValueError):
        return None


def iteration_of_name(directory: str) -> int | None:
    """The iteration a checkpoint directory's name says (``iter_0000010``: 10), or None."""
    name = _ITERATION_NAME.fullmatch(os.path.basename(os.path.normpath(directory)))
    return int(name.group(1)) if name else None


def read_run(root: str) -> str | None:
    """The run id of the save directory ``root`` (its ``RUN_FILE``), or None without one;
    ValueError when the file holds no run id."""
    path = os.path.join(root, RUN_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        run = json.load(f).get("run")
    if not (isinstance(run, str) and run):
        raise ValueError(f"{path} names no run")
    return run


def ensure_run(root: str) -> str:
    """The run id of ``root``, written (a new random id, atomically) by the run's first signed
    save."""
    run = read_run(root)
    if run is None:
        run = uuid.uuid4().hex
        tmp = os.path.join(root, RUN_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"run": run}, f)
        os.replace(tmp, os.path.join(root, RUN_FILE))
    return run


# ------------------------------------------------------------------------------------ reading


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint directory, and how it was found."""

    directory: str
    iteration: int | None  # from the tracker or the directory's name; None: not known from those
    root: str | None = None  # the save directory whose tracker named it; None: named directly


def read_tracker(path: str) -> tuple[int, bool]:
    """(iteration, release) of a tracker file: an iteration number, or ``release`` (iteration 0).

    Content that is neither raises CheckpointNotFoundError naming the file and what it holds.
    megatron.training reads it where its release ships a reader (``_mcore_compat``; collective
    when torch.distributed is initialized: every rank calls it, as for any load).
    """
    from mcore_ext import _mcore_compat

    with open(path) as f:
        text = f.read().strip()
    if text != RELEASE and not (text.isdigit() and text.isascii()):
        raise CheckpointNotFoundError(
            f"{path} holds {text[:40]!r}, not an iteration number or {RELEASE!r}"
        )
    return _mcore_compat.read_checkpoint_tracker(path, fallback=_parse_tracker)


def _parse_tracker(path: str) -> tuple[int, bool]:
    """The tracker reader for a megatron-core whose wheel has no megatron.training."""
    with open(path) as f:
        text = f.read().strip()
    return (0, True) if text == RELEASE else (int(text), False)


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is one megatron dist checkpoint (its ``metadata.json``)."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    return os.path.isdir(path) and check_is_distributed_checkpoint(path)


def find_checkpoint(path: str, as_recovered: bool = False) -> Checkpoint | None:
    """The checkpoint ``path`` names: the tracked one of a save directory (Megatron-LM's
    ``release`` too), or ``path`` itself when it is a checkpoint directory (``iter_0000010``, as
    ``hf import`` prints it). None when it is neither; CheckpointNotFoundError when its tracker
    is unreadable or names a directory that does not exist.

    ``as_recovered``: ``path`` as ``recover_root`` leaves it. A tracked directory that a save
    killed between its two renames left as ``.replaced.<name>`` counts: the repair puts it back
    before anything is loaded, and whether a rank looks before or after rank 0 repaired, it
    finds the same checkpoint."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        iteration, release = read_tracker(tracker)
        directory = os.path.join(path, RELEASE) if release else iteration_dir(path, iteration)
        put_back = as_recovered and os.path.isdir(replaced_dir(directory))
        if not (os.path.isdir(directory) or put_back):
            named = RELEASE if release else f"iteration {iteration}"
            raise CheckpointNotFoundError(f"{TRACKER} names {named} but {directory} does not exist")
        return Checkpoint(directory, iteration, root=path)
    if is_checkpoint_dir(path):
        return Checkpoint(path, iteration_of_name(path))
    return None


def why_not_a_checkpoint(path: str) -> str:
    """What ``path`` holds instead of a checkpoint, for an error message."""
    if not os.path.exists(path):
        return "it does not exist"
    if not os.path.isdir(path):
        return "it is a file, not a directory"
    why = f"it has no {TRACKER} and is not a checkpoint directory"
    iterations = _iteration_names(path)
    if iterations:
        return f"{why} (it holds {', '.join(iterations[-3:])}: name one of them)"
    if any(n.startswith(SAVING) for n in os.listdir(path)):
        return f"{why} (only a save that did not finish)"
    return why


def iterations_in(root: str) -> list[int]:
    """The iterations of the ``iter_*`` directories in ``root``, oldest first ([] when it is no
    directory)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(match.group(1)) for match in map(_ITERATION_NAME.fullmatch, os.listdir(root))
                  if match and os.path.isdir(os.path.join(root, match.group(0))))


def _iteration_names(path: str) -> list[str]:
    return [os.path.basename(iteration_dir(path, i)) for i in iterations_in(path)]


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: ``checkpoint`` (None: from scratch, because ``reason``)."""

    checkpoint: Checkpoint | None
    own: bool  # the run's own checkpoint (in checkpoint.save): resumed whatever finetune says
    reason: str = ""


def find_start(save: str | None, load: str | None) -> Start:
    """The launcher's rule: a complete checkpoint in ``save`` is the run's own and wins (a
    relaunch or a restart continues the run); otherwise ``load``'s checkpoint. Only the run's own
    ``save`` may be empty (its first start): a ``load`` that holds no checkpoint raises
    CheckpointNotFoundError naming it, so a typo never trains from scratch. ``save`` is judged
    as ``recover_root`` leaves it (the launcher repairs it before loading), so a save killed
    half way never blocks the restart that repairs it."""
    if save:
        try:
            tracked = os.path.isfile(os.path.join(save, TRACKER))
            own = find_checkpoint(save, as_recovered=True) if tracked else None
        except CheckpointNotFoundError as err:
            raise CheckpointNotFoundError(
                f"checkpoint.save={save} holds this run's checkpoints, but {err}") from None
        if own is not None:
            return Start(own, own=True)
        untracked = _iteration_names(save)
        if untracked:  # starting there would replace them, one save at a time
            raise CheckpointNotFoundError(
                f"checkpoint.save={save} holds {', '.join(untracked[-3:])} but no {TRACKER}: a "
                f"run started there would replace them. Resume one with checkpoint.load="
                f"{os.path.join(save, untracked[-1])} and another checkpoint.save, or write its "
                f"iteration into {os.path.join(save, TRACKER)}")
    if not load:
        reason = (f"checkpoint.save={save} holds no checkpoint yet and checkpoint.load is not set"
                  if save else "neither checkpoint.save nor checkpoint.load is set")
        return Start(None, own=False, reason=reason)
    if save and os.path.abspath(load) == os.path.abspath(save):
        first = f"checkpoint.save={save} holds no checkpoint yet (the run's first start)"
        return Start(None, own=False, reason=first)
    try:
        found = find_checkpoint(load)
        why = None if found else why_not_a_checkpoint(load)
    except CheckpointNotFoundError as err:
        found, why = None, str(err)
    if found is None:
        raise CheckpointNotFoundError(
            f"checkpoint.load={load} holds no checkpoint: {why}. Give a save directory (with "
            f"{TRACKER}) or one checkpoint directory (iter_NNNNNNN), or set checkpoint.load=null "
            "to start from scratch"
        )
    return Start(found, own=False)


# ------------------------------------------------------------------------------------ writing


def partial_dir(directory: str) -> str:
    """Where ``directory`` is written until it is complete."""
    head, name = os.path.split(os.path.normpath(directory))
    return os.path.join(head, SAVING + name)


def replaced_dir(directory: str) -> str:
    """Where an existing ``directory`` waits while a new one takes its place."""
    head, name = os.path.split(os.path.normpath(directory))
    return os.path.join(head, REPLACED + name)


def replace_dir(new: str, directory: str) -> None:
    """Rename ``new`` to ``directory``; an existing ``directory`` is moved aside first and
    deleted once the new one is in place. ``directory`` is a real folder, not a symbolic link
    (the link would be replaced, its target never written): callers resolve links first."""
    aside = replaced_dir(directory)
    if os.path.exists(directory):
        _remove(aside, ignore_errors=True)
        os.rename(directory, aside)
    os.rename(new, directory)
    _remove(aside, ignore_errors=True)


def write_tracker(root: str, value) -> None:
    """Write the tracker in one atomic step (never half a tracker)."""
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, os.path.join(root, TRACKER))


def recover_dir(directory: str) -> list[str]:
    """Undo what a write of ``directory`` killed half way left beside it: a ``.replaced.`` copy
    goes back in place if ``directory`` is missing (killed between the two renames), and is
    deleted otherwise; a ``.saving.`` directory is deleted. Returns what it did, one line each."""
    done = []
    aside, partial = replaced_dir(directory), partial_dir(directory)
    if os.path.lexists(aside):
        if os.path.exists(directory):
            _remove(aside)  # a link (an export into a link, before they were resolved): unlinked
        else:
            os.rename(aside, directory)
            done.append(f"restored {directory} (a write was killed replacing it)")
    if os.path.exists(partial):
        shutil.rmtree(partial)
        done.append(f"removed {partial}, left by a write that did not finish")
    return done


def _remove(path: str, ignore_errors: bool = False) -> None:
    """Delete the directory ``path``; a symbolic link is unlinked (its target stays)."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=ignore_errors)


def recover_root(root: str) -> list[str]:
    """``recover_dir`` for every directory of a save directory (rank 0, before loading)."""
    done = []
    names = {name.removeprefix(SAVING).removeprefix(REPLACED) for name in os.listdir(root)
             if name.startswith((SAVING, REPLACED))}
    for name in sorted(names):
        done += recover_dir(os.path.join(root, name))
    return done
