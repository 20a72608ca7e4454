"""Writing one checkpoint directory from every rank: the protocol of the launcher's saves and of
``hf import`` (``directory`` has the layout).

    partial = begin(directory)                  # rank 0: a fresh .saving.<name>
    ... every rank writes into partial (megatron's dist_checkpointing.save) ...
    raise_unless_saved(failure, partial, what)  # a rank failed: the error on every rank
    publish(partial, directory, files=..., root=..., iteration=...)

``publish`` adds rank 0's ``files`` (config.yaml, ...), the manifest of every rank's files
(``manifest``: with the iteration and the run of ``root``, ``directory.RUN_FILE``, which the
run's first save with a signing key writes), renames the directory into place and then writes the tracker. A save that fails
(or a process killed while saving) never touches the tracked checkpoint, which stays the latest
one; what a killed save leaves is removed by ``recover`` and never loaded.
"""

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mcore_ext.checkpoint import directory as layout
from mcore_ext.checkpoint import manifest, signing
from mcore_ext.checkpoint.errors import CheckpointSaveError
from mcore_ext.runtime import device, raise_unless_all_ok


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def begin(directory: str) -> str:
    """Collective: create ``directory``'s ``.saving.`` directory (rank 0; leftovers of an earlier
    failed save there are not a checkpoint and go first). Returns it."""
    partial = layout.partial_dir(directory)
    failure = None
    if _rank() == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as err:
            failure = err
    _all_ok(failure, f"creating checkpoint directory {partial} failed")
    return partial


def publish(partial: str, directory: str, *, files: dict | None = None, root: str | None = None,
            iteration=None) -> None:
    """Collective, once every rank has written into ``partial``: rank 0 writes ``files``
    ({name: text}: config.yaml and the like, from which a load builds its model; in the
    manifest, signed with a key, edited freely without one: ``manifest.EDITABLE``), every rank
    checksums its own files, rank 0 writes the manifest, renames ``partial`` to ``directory``
    and, with ``root``, writes ``iteration`` to its tracker.
    CheckpointSaveError on every rank if any step fails on any rank: the ranks agree on it
    before anything is renamed, so a manifest never lacks a rank's files."""
    failure, entries = None, {}
    try:
        if _rank() == 0:  # first: rank 0's entries cover them
            for name, text in (files or {}).items():
                with open(os.path.join(partial, name), "w") as f:
                    f.write(text)
        entries = manifest.describe(partial, manifest.files_of_rank(partial, _rank()))
    except OSError as err:
        failure = err
    raise_unless_saved(failure, partial, f"publishing {directory} failed")
    everyone = [entries]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, entries)
    if _rank() == 0:
        try:
            # The run of the save directory (its first signed save names it), signed with the
            # iteration.
            run = None
            if root is not None:
                run = layout.ensure_run(root) if signing.key() else layout.read_run(root)
            if iteration is None:
                iteration = layout.iteration_of_name(directory)
            manifest.write(partial, {k: v for entries in everyone for k, v in entries.items()},
                           iteration=iteration, run=run)
            layout.replace_dir(partial, directory)
            if root is not None:
                layout.write_tracker(root, iteration)
        except (OSError, ValueError) as err:  # ValueError: a RUN_FILE that names no run
            failure = err
    raise_unless_saved(failure, partial, f"publishing {directory} failed")


def raise_unless_saved(failure, partial: str, what: str) -> None:
    """Collective: raise CheckpointSaveError on every rank if the save failed on any, after rank
    0 removed the partial directory (not a checkpoint; space on a full disk)."""
    try:
        _all_ok(_own_error(failure), what)
    except CheckpointSaveError:
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def recover(root: str) -> None:
    """Collective, before loading: rank 0 undoes what saves killed half way left in ``root``
    (``directory.recover_root``) and says so."""
    failure = None
    if _rank() == 0:
        try:
            for line in layout.recover_root(root):
                print(f"[checkpoint] {line}", flush=True)
        except OSError as err:
            failure = err
    _all_ok(failure, f"cleaning up interrupted saves in {root} failed")


def _all_ok(failure, what: str) -> None:
    if not dist.is_initialized():
        if failure is not None:
            raise CheckpointSaveError(f"{what} ({type(failure).__name__}: {failure})") from failure
        return
    raise_unless_all_ok(failure, what, CheckpointSaveError)


def _own_error(failure):
    """Collective: this rank's own error in a failed save, for the all-ranks report.

    When any rank's writer fails, megatron (torch.distributed.checkpoint) raises
    ``CheckpointException``, a BaseException, on every rank, with each failing rank's error only
    on the coordinator, rank 0 (``failures``: {rank: (error, traceback)}). Rank 0 sends each rank
    its own, so that the report names the ranks that failed, not every rank.
    """
    if not dist.is_initialized():
        return failure
    everywhere = torch.tensor(
        [int(isinstance(failure, CheckpointException))], dtype=torch.int32, device=device()
    )
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not everywhere.item():
        return failure
    causes = [failure.failures if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(causes, src=0)
    if not causes[0]:
        return failure  # no details: report the exception itself
    cause = causes[0].get(dist.get_rank())
    return cause[0] if cause is not None else None
