"""Checkpoints in megatron's torch_dist format, resumable at any TP / PP / DP layout.

    <save>/iter_0000010/                      megatron dist checkpoint + config.yaml
    <save>/latest_checkpointed_iteration.txt  "10", written last

A save writes ``<save>/.saving.iter_0000010/``; once every rank reports a completed write, rank 0
renames it to ``iter_0000010`` (an existing one, possibly the tracked one, is moved aside first
and deleted after) and then writes the tracker. So a save that fails (or a run killed while
saving) never touches the tracked checkpoint, which stays the latest one; what a killed save
leaves is removed when the next run starts (``recover_save_dir``) and never loaded. A failed save,
synchronous or asynchronous, in megatron's writer or after it, raises ``CheckpointSaveError`` on
every rank, naming the failing ranks and their errors, and removes its partial directory (space
on a full disk).

Where a run starts (``load_checkpoint``): a complete checkpoint in ``checkpoint.save`` is the
run's own and always wins, fully resumed, so a relaunch or a torchrun restart continues the run;
``checkpoint.load`` (weights only with ``finetune``) only initialises a run whose ``save`` holds
no checkpoint yet (Megatron-LM's ``--pretrained-checkpoint``).

What is saved: the model's sharded state (layout-free: megatron and mcore_ext's gate sharding key
every tensor by its global shape), the optimizer's (keyed by model parameter, the distributed
optimizer's in its ``fully_reshardable`` form, so it reshards too), the LR scheduler, iteration
and consumed samples, and each rank's RNG state. RNG states are per rank, so they are restored
only when the layout is unchanged; everything else loads at any layout. Next to this, what
megatron.training reads (mcore_ext.megatron_lm.checkpoint_format: ``args``, ``opt_param_scheduler``,
its ``rng_state``; the launcher's RNG is ``mcore_ext_rng_state``), so Megatron-LM resumes these
checkpoints and the launcher resumes Megatron-LM's.
"""

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from mcore_ext import checkpoint
from mcore_ext.checkpoint.directory import TRACKER, iteration_dir, latest_iteration  # noqa: F401
from mcore_ext.megatron_lm import checkpoint_format
from mcore_ext.runtime import device, raise_unless_all_ok
from mcore_ext.training.faults import CheckpointSaveError, fault_point

# Prefixes of an iteration directory's name while it is written / while it is being replaced.
_SAVING, _REPLACED = ".saving.", ".replaced."


def _layout() -> dict:
    layout = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:  # only then, so checkpoints saved before CP existed keep their layout
        layout["cp"] = cp
    return layout


def _rng_state(key: str = checkpoint_format.LAUNCHER_RNG_KEY) -> ShardedObject:
    """This rank's RNG streams, one entry of a (pp, tp, dp) grid of ranks ((pp, tp, cp, dp)
    with context parallelism: CP ranks are data-parallel replicas of the model, not of the RNG)."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    layout = _layout()
    cp = [layout["cp"]] if "cp" in layout else []
    cp_rank = [parallel_state.get_context_parallel_rank()] if cp else []
    return ShardedObject(
        key,
        state,
        (layout["pp"], layout["tp"], *cp, layout["dp"]),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            *cp_rank,
            parallel_state.get_data_parallel_rank(),
        ),
        replica_id=0,
    )


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    cfg, iteration, model, optimizer, scheduler, consumed_samples, async_queue=None
):
    """Save at ``iteration`` under cfg.checkpoint.save; the tracker moves only if all ranks succeed.

    With ``async_queue`` the write happens in the background; the directory is renamed and the
    tracker written when the queue finalizes the request on all ranks, which raises
    ``CheckpointSaveError`` there if the write failed.
    """
    root = cfg.checkpoint.save
    directory = iteration_dir(root, iteration)
    partial = _partial_dir(directory)
    failure = None
    if dist.get_rank() == 0:
        try:
            # Leftovers of an earlier failed save at this iteration are not a checkpoint.
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as err:
            failure = err
    raise_unless_all_ok(
        failure, f"creating checkpoint directory {partial} failed", CheckpointSaveError
    )

    model_state = model.module.sharded_state_dict()
    metadata = checkpoint_format.content_metadata(cfg.optimizer.use_distributed_optimizer)
    state = {
        "model": model_state,
        "optimizer": checkpoint.optimizer_sharded_state_dict(
            optimizer, model_state, metadata=metadata
        ),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": _layout(),
        "distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
        checkpoint_format.LAUNCHER_RNG_KEY: _rng_state(),
    }
    # What megatron.training's load reads too (args, scheduler in samples, its RNG shape).
    state.update(checkpoint_format.megatron_lm_content(
        cfg, iteration, consumed_samples, scheduler.state_dict()
    ))

    def publish():
        """Every rank has written: rename into place, then move the tracker (rank 0)."""
        failure = None
        if dist.get_rank() == 0:
            try:
                with open(os.path.join(partial, "config.yaml"), "w") as f:
                    f.write(cfg.to_yaml())
                _replace_dir(partial, directory)
                tmp = os.path.join(root, TRACKER + ".tmp")
                with open(tmp, "w") as f:
                    f.write(str(iteration))
                os.replace(tmp, os.path.join(root, TRACKER))  # atomic: never half a tracker
                shutil.rmtree(_replaced_dir(directory), ignore_errors=True)
            except OSError as err:
                failure = err
        _raise_unless_saved(failure, partial, f"publishing {directory} failed")

    if async_queue is not None:
        request = dist_checkpointing.save(
            state, partial, async_sharded_save=True, async_strategy=_async_strategy(),
            content_metadata=metadata,
        )
        writer_finalize = list(request.finalize_fns)

        def finalize():  # megatron's finalization raises if a rank's writer failed
            failure = None
            try:
                for fn in writer_finalize:
                    fn()
            except (Exception, CheckpointException) as err:  # reported below, on every rank
                failure = err
            _raise_unless_saved(failure, partial, f"checkpoint save to {directory} failed")
            publish()

        async_queue.schedule_async_request(request._replace(finalize_fns=[finalize]))
        return

    try:
        dist_checkpointing.save(state, partial, content_metadata=metadata)
        fault_point("save", iteration)
    except (Exception, CheckpointException) as err:  # reported below, after every rank's say
        failure = err
    _raise_unless_saved(failure, partial, f"checkpoint save to {directory} failed")
    publish()


def _partial_dir(directory: str) -> str:
    head, name = os.path.split(directory)
    return os.path.join(head, _SAVING + name)


def _replaced_dir(directory: str) -> str:
    head, name = os.path.split(directory)
    return os.path.join(head, _REPLACED + name)


def _replace_dir(new: str, directory: str) -> None:
    """Rename ``new`` to ``directory``; an existing ``directory`` is moved aside first (renames,
    atomic each: a kill in between leaves the aside copy, restored by ``recover_save_dir``)."""
    if os.path.exists(directory):
        aside = _replaced_dir(directory)
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(directory, aside)
    os.rename(new, directory)


def _raise_unless_saved(failure, partial: str, what: str) -> None:
    """Collective: raise CheckpointSaveError on every rank if the save failed on any, after rank
    0 removed the partial directory (not a checkpoint; space on a full disk)."""
    try:
        raise_unless_all_ok(_own_error(failure), what, CheckpointSaveError)
    except CheckpointSaveError:
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _own_error(failure):
    """Collective: this rank's own error in a failed save, for the all-ranks report.

    When any rank's writer fails, megatron (torch.distributed.checkpoint) raises
    ``CheckpointException``, a BaseException, on every rank, with each failing rank's error only
    on the coordinator, rank 0 (``failures``: {rank: (error, traceback)}). Rank 0 sends each rank
    its own, so that the report names the ranks that failed, not every rank.
    """
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


def recover_save_dir(root: str) -> None:
    """Collective, before loading: undo what a save killed half way left in ``root`` (rank 0).

    A partially written ``.saving.iter_N`` is deleted. A ``.replaced.iter_N`` (moved aside to
    make way for a new ``iter_N``) goes back in place if the kill came between the two renames
    and the tracker names ``iter_N``, and is deleted otherwise.
    """
    failure = None
    if dist.get_rank() == 0:
        try:
            _recover(root)
        except OSError as err:
            failure = err
    raise_unless_all_ok(
        failure, f"cleaning up interrupted saves in {root} failed", CheckpointSaveError
    )


def _recover(root: str) -> None:
    tracked = latest_iteration(root)
    tracked = iteration_dir(root, tracked) if tracked is not None else None
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(_REPLACED):
            original = os.path.join(root, name[len(_REPLACED):])
            if original == tracked and not os.path.exists(original):
                os.rename(path, original)
                _print0(f"[checkpoint] restored {original} (a save was killed replacing it)")
            else:
                shutil.rmtree(path)
        elif name.startswith(_SAVING):
            shutil.rmtree(path)
            _print0(f"[checkpoint] removed {path}, left by a save that did not finish")


def resume_source(cfg) -> tuple[str | None, bool]:
    """(directory to load, weights only?): where this run starts from.

    A complete checkpoint in ``checkpoint.save`` is this run's own: it wins, fully resumed (a
    relaunch or restart must continue the run, not restart it from ``load``). Otherwise
    ``checkpoint.load``, weights only with ``checkpoint.finetune``; (None, False) without either.
    """
    c = cfg.checkpoint
    if c.save and latest_iteration(c.save) is not None:
        return c.save, False
    return c.load, bool(c.load and c.finetune)


def load_checkpoint(cfg, model, optimizer, scheduler, vocab_size: int | None = None
                    ) -> tuple[int, int]:
    """Restore from the latest checkpoint of ``resume_source(cfg)``; (iteration, consumed samples).

    Returns (0, 0) without loading when there is no complete checkpoint. With
    ``checkpoint.finetune`` (and no checkpoint in ``checkpoint.save`` yet) only the model weights
    of ``checkpoint.load`` are loaded and training starts at 0. ``vocab_size`` (the tokenizer's,
    unpadded) is checked against the checkpoint's vocabulary rows (``_check_vocabulary``).
    """
    root, finetune = resume_source(cfg)
    if root is None:
        return 0, 0
    iteration = latest_iteration(root)
    if iteration is None:
        _print0(f"[checkpoint] no complete checkpoint in {root}: starting from scratch")
        return 0, 0
    load = cfg.checkpoint.load
    if load and os.path.abspath(root) != os.path.abspath(load):
        _print0(f"[checkpoint] {root} holds this run's checkpoints: resuming it (checkpoint.load="
                f"{load} only starts a run whose checkpoint.save is empty)")
    directory = iteration_dir(root, iteration)
    # A Megatron-LM checkpoint's launcher content derives from its own (args, scheduler).
    common = dist_checkpointing.load_common_state_dict(directory)
    by_megatron_lm = checkpoint_format.written_by_megatron_lm(common)
    common = checkpoint_format.launcher_common(common, cfg)
    # An imported Hugging Face model (python -m mcore_ext.hf import) holds weights only.
    finetune = finetune or common.get("weights_only", False)
    distributed = cfg.optimizer.use_distributed_optimizer
    saved_distributed = common.get("distributed_optimizer", distributed)
    if not finetune and saved_distributed != distributed:
        raise RuntimeError(
            f"{directory} was saved with optimizer.use_distributed_optimizer="
            f"{str(saved_distributed).lower()}: resume with the same setting (the two optimizers' "
            "states are not interchangeable), or set checkpoint.finetune=true for weights only"
        )

    if by_megatron_lm and not finetune and common["no_optimizer"]:
        raise RuntimeError(
            f"{directory} was saved by Megatron-LM with --no-save-optim: set "
            "checkpoint.finetune=true to load its weights only"
        )

    model_state = model.module.sharded_state_dict()
    if vocab_size is not None:
        _check_vocabulary(directory, model_state, vocab_size)
    state = {"model": model_state}
    if not finetune:
        state["optimizer"] = checkpoint.optimizer_sharded_state_dict(
            optimizer, model_state, is_loading=True, metadata=common.get("content_metadata")
        )
    same_layout = common.get("layout") == _layout() and not common.get("no_rng")
    rng_key = checkpoint_format.launcher_rng_key(common)
    if same_layout and not finetune:
        state[rng_key] = (
            checkpoint_format.megatron_lm_rng_state() if by_megatron_lm else _rng_state(rng_key)
        )
    loaded = checkpoint.load(
        state, directory, init_missing_gates=cfg.checkpoint.init_missing_gates
    )

    model.module.load_state_dict(loaded["model"])
    if finetune:
        _print0(f"[checkpoint] finetune: loaded the model weights of {directory}; iteration 0")
        return 0, 0
    checkpoint.load_optimizer_state_dict(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    if same_layout:
        rng = loaded[rng_key]
        _set_rng_state(checkpoint_format.launcher_rng_from_megatron_lm(rng) if by_megatron_lm
                       else rng)
    change = f", layout {common.get('layout')} -> {_layout()}, RNG not restored"
    change = "" if same_layout else change
    _print0(f"[checkpoint] resumed from {directory} (iteration {iteration}{change})")
    return iteration, common["consumed_samples"]


def _check_vocabulary(directory: str, model_state: dict, vocab_size: int) -> None:
    """Refuse a checkpoint without a row for every token; say so when the padding changed.

    megatron loads word embeddings and output layers (MTP heads too) with
    ``allow_shape_mismatch``: the vocabulary padding may differ between runs (another TP size,
    Megatron-LM's rule), so the rows present in both load and the others start at zero. That is
    exact while the checkpoint holds every token's row; with fewer rows than the tokenizer has
    tokens, real tokens would silently start at zero.
    """
    saved = dist_checkpointing.load_tensors_metadata(directory)
    changed = []
    for value in model_state.values():
        if not (isinstance(value, ShardedTensor) and value.allow_shape_mismatch
                and value.key in saved):
            continue
        rows, ours = saved[value.key].global_shape[0], value.global_shape[0]
        if rows < vocab_size:
            raise RuntimeError(
                f"{directory}: {value.key} has {rows} rows, fewer than the {vocab_size} tokens of "
                "this run's tokenizer (data.tokenizer): it was trained with another vocabulary"
            )
        if rows != ours:
            changed.append(f"{value.key} {rows} -> {ours}")
    if changed:
        _print0(f"[checkpoint] vocabulary padding differs ({', '.join(changed)} rows): the "
                f"{vocab_size} token rows load exactly; padding rows the checkpoint lacks start "
                "at zero, its extra padding rows are dropped")


def _async_strategy() -> str:
    import importlib.util

    return "nvrx" if importlib.util.find_spec("nvidia_resiliency_ext") else "mcore"


def _print0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
