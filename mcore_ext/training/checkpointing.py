"""Checkpoints in megatron's torch_dist format, resumable at any TP / PP / DP layout.

    <save>/iter_0000010/                      megatron dist checkpoint + config.yaml
    <save>/latest_checkpointed_iteration.txt  "10", written last

The tracker is written by rank 0 only after every rank reports a completed save, so a save that
fails (or a run killed while saving) leaves the previous checkpoint as the latest one. A failed
save raises ``CheckpointSaveError`` on every rank, naming the failing ranks and their errors, and
removes its partial directory (space on a full disk).

What is saved: the model's sharded state (layout-free: megatron and mcore_ext's gate sharding key
every tensor by its global shape), the optimizer's (keyed by model parameter, the distributed
optimizer's in its ``fully_reshardable`` form, so it reshards too), the LR scheduler, iteration
and consumed samples, and each rank's RNG state. RNG states are per rank, so they are restored
only when the layout is unchanged; everything else loads at any layout.
"""

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from mcore_ext import checkpoint
from mcore_ext.checkpoint.directory import TRACKER, iteration_dir, latest_iteration  # noqa: F401
from mcore_ext.runtime import raise_unless_all_ok
from mcore_ext.training.faults import CheckpointSaveError, fault_point


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


def _rng_state() -> ShardedObject:
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
        "rng_state",
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

    With ``async_queue`` (GPU only) the write happens in the background and the tracker is written
    when the queue finalizes the request on all ranks.
    """
    root = cfg.checkpoint.save
    directory = iteration_dir(root, iteration)
    failure = None
    if dist.get_rank() == 0:
        try:
            # Leftovers of an earlier failed save at this iteration are not a checkpoint.
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
        except OSError as err:
            failure = err
    raise_unless_all_ok(
        failure, f"creating checkpoint directory {directory} failed", CheckpointSaveError
    )

    model_state = model.module.sharded_state_dict()
    state = {
        "model": model_state,
        "optimizer": checkpoint.optimizer_sharded_state_dict(optimizer, model_state),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": _layout(),
        "distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
        "rng_state": _rng_state(),
    }

    def finalize():
        failure = None
        if dist.get_rank() == 0:
            try:
                with open(os.path.join(directory, "config.yaml"), "w") as f:
                    f.write(cfg.to_yaml())
                tmp = os.path.join(root, TRACKER + ".tmp")
                with open(tmp, "w") as f:
                    f.write(str(iteration))
                os.replace(tmp, os.path.join(root, TRACKER))  # atomic: never half a tracker
            except OSError as err:
                failure = err
        raise_unless_all_ok(
            failure, f"writing the tracker of {directory} failed", CheckpointSaveError
        )

    if async_queue is not None:
        request = dist_checkpointing.save(
            state, directory, async_sharded_save=True, async_strategy=_async_strategy()
        )
        request.add_finalize_fn(finalize)
        async_queue.schedule_async_request(request)
        return

    try:
        dist_checkpointing.save(state, directory)
        fault_point("save", iteration)
    except Exception as err:  # reported below, after every rank has had its say
        failure = err
    try:
        raise_unless_all_ok(failure, f"checkpoint save to {directory} failed", CheckpointSaveError)
    except CheckpointSaveError:
        if dist.get_rank() == 0:  # not a checkpoint: free its space (a full disk)
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finalize()


def load_checkpoint(cfg, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore from the latest checkpoint under cfg.checkpoint.load; (iteration, consumed samples).

    Returns (0, 0) without loading when there is no complete checkpoint. With
    ``checkpoint.finetune`` only the model weights are loaded and training starts at 0.
    """
    root = cfg.checkpoint.load
    iteration = latest_iteration(root)
    if iteration is None:
        _print0(f"[checkpoint] no complete checkpoint in {root}: starting from scratch")
        return 0, 0
    directory = iteration_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(directory)
    # An imported Hugging Face model (python -m mcore_ext.hf import) holds weights only.
    finetune = cfg.checkpoint.finetune or common.get("weights_only", False)
    distributed = cfg.optimizer.use_distributed_optimizer
    saved_distributed = common.get("distributed_optimizer", distributed)
    if not finetune and saved_distributed != distributed:
        raise RuntimeError(
            f"{directory} was saved with optimizer.use_distributed_optimizer="
            f"{str(saved_distributed).lower()}: resume with the same setting (the two optimizers' "
            "states are not interchangeable), or set checkpoint.finetune=true for weights only"
        )

    model_state = model.module.sharded_state_dict()
    state = {"model": model_state}
    if not finetune:
        state["optimizer"] = checkpoint.optimizer_sharded_state_dict(
            optimizer, model_state, is_loading=True
        )
    same_layout = common.get("layout") == _layout()
    if same_layout and not finetune:
        state["rng_state"] = _rng_state()
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
        _set_rng_state(loaded["rng_state"])
    change = f", layout {common.get('layout')} -> {_layout()}, RNG not restored"
    change = "" if same_layout else change
    _print0(f"[checkpoint] resumed from {directory} (iteration {iteration}{change})")
    return iteration, common["consumed_samples"]


def _async_strategy() -> str:
    import importlib.util

    return "nvrx" if importlib.util.find_spec("nvidia_resiliency_ext") else "mcore"


def _print0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)
