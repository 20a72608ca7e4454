"""Checkpoints in megatron's torch_dist format, resumable at any TP / PP / DP layout.

    <save>/iter_0000010/                      megatron dist checkpoint, config.yaml, manifest
    <save>/latest_checkpointed_iteration.txt  "10", written last

A save goes through ``mcore_ext.checkpoint.saving``: every rank writes ``.saving.iter_0000010``,
the files' sizes and checksums go into its manifest, rank 0 renames it into place (an existing
one, possibly the tracked one, is moved aside first and deleted after) and then writes the
tracker. So a save that fails (or a run killed while saving) never touches the tracked
checkpoint; what a killed save leaves is removed when the next run starts and never loaded. A
failed save, synchronous or asynchronous, in megatron's writer or after it, raises
``CheckpointSaveError`` on every rank, naming the failing ranks and their errors, and removes its
partial directory (space on a full disk).

Where a run starts (``directory.find_start``): a complete checkpoint in ``checkpoint.save`` is
the run's own and always wins, fully resumed, so a relaunch or a torchrun restart continues the
run; ``checkpoint.load`` (a save directory, Megatron-LM's ``release`` tracker included, or one
iteration directory; weights only with ``finetune``) initialises a run whose ``save`` holds no
checkpoint yet (Megatron-LM's ``--pretrained-checkpoint``). A ``load`` that holds no checkpoint is
an error, never a silent start from scratch. Before anything is read, the checkpoint's files are
checked against its manifest; a damaged one is an error naming the file and the newest checkpoint
that verifies, which ``checkpoint.on_corrupt: previous`` resumes instead.

What is saved: the model's sharded state (layout-free: megatron and mcore_ext's gate sharding key
every tensor by its global shape), the optimizer's (keyed by model parameter, the distributed
optimizer's in its ``fully_reshardable`` form, so it reshards too), the LR scheduler, iteration
and consumed samples, and each rank's RNG state. RNG states are per rank, so they are restored
only when the layout is unchanged; everything else loads at any layout. Next to this, what
megatron.training reads (mcore_ext.checkpoint.content: ``args``, ``opt_param_scheduler``,
its ``rng_state``; the launcher's RNG is ``mcore_ext_rng_state``), so Megatron-LM resumes these
checkpoints and the launcher resumes Megatron-LM's.
"""

import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.utils import unwrap_model
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from mcore_ext import checkpoint, lora
from mcore_ext.checkpoint import adapters, architecture, content, manifest, safe_pickle, saving
from mcore_ext.checkpoint.directory import (  # noqa: F401  (tests import them here)
    TRACKER,
    Checkpoint,
    find_start,
    iteration_dir,
    latest_iteration,
)
from mcore_ext.checkpoint.errors import (  # noqa: F401  (tests import them here)
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointSaveError,
)
from mcore_ext.run_config.megatron_configs import byte_wise_distributed_optimizer
from mcore_ext.training.faults import fault_point

# Marks the line that says where a run starts, so that it stands out among the others.
START_MARK = "==> [checkpoint]"


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


def _rng_state(key: str = content.LAUNCHER_RNG_KEY) -> ShardedObject:
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

    With ``async_queue`` the write happens in the background; the directory is checksummed,
    renamed and the tracker written when the queue finalizes the request on all ranks, which
    raises ``CheckpointSaveError`` there if the write failed.
    """
    root = cfg.checkpoint.save
    directory = iteration_dir(root, iteration)
    partial = saving.begin(directory)

    model_state = model.module.sharded_state_dict()
    base = getattr(model, "lora_base", None)
    if base is not None:  # a LoRA run over a base checkpoint: the adapters and their reference
        model_state = {k: v for k, v in model_state.items() if lora.ADAPTER_KEY in k}
    metadata = content.content_metadata(byte_wise_distributed_optimizer(cfg))
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
        content.LAUNCHER_RNG_KEY: _rng_state(),
    }
    if base is not None:
        state[adapters.BASE_KEY] = base
    # What megatron.training's load reads too (args, scheduler in samples, its RNG shape).
    state.update(content.megatron_lm_content(
        cfg, iteration, consumed_samples, scheduler.state_dict()
    ))

    def publish():
        saving.publish(partial, directory, files={"config.yaml": cfg.to_yaml()}, root=root,
                       iteration=iteration)

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
            saving.raise_unless_saved(failure, partial, f"checkpoint save to {directory} failed")
            publish()

        async_queue.schedule_async_request(request._replace(finalize_fns=[finalize]))
        return

    failure = None
    try:
        dist_checkpointing.save(state, partial, content_metadata=metadata)
        fault_point("save", iteration)
    except (Exception, CheckpointException) as err:  # reported below, after every rank's say
        failure = err
    saving.raise_unless_saved(failure, partial, f"checkpoint save to {directory} failed")
    publish()


def recover_save_dir(root: str) -> None:
    """Collective, before loading: undo what a save killed half way left in ``root``."""
    saving.recover(root)


def start_point(cfg):
    """Where this run starts (``directory.find_start`` for cfg.checkpoint); raises
    CheckpointNotFoundError when checkpoint.load holds no checkpoint. checkpoint.save is judged
    as ``recover_save_dir`` leaves it, so every rank finds the same start before and after rank
    0 repaired what a killed save left (``main`` asks before any process group exists)."""
    return find_start(cfg.checkpoint.save, cfg.checkpoint.load)


@safe_pickle.refusals()  # a pickle that would run code: CheckpointUnsafeError, one line
def load_checkpoint(cfg, model, optimizer, scheduler, vocab_size: int | None = None
                    ) -> tuple[int, int, str]:
    """Restore where ``start_point(cfg)`` says: (iteration, consumed samples, the line that says
    what was loaded, for the user).

    From scratch: (0, 0, why). With ``checkpoint.finetune`` (and no checkpoint in
    ``checkpoint.save`` yet) only the model weights are loaded and training starts at 0; an
    imported Hugging Face model (weights only) loads so too. The files are verified against the
    checkpoint's manifest first (``_verified``). ``vocab_size`` (the tokenizer's, unpadded) is
    checked against the checkpoint's vocabulary rows (``_check_vocabulary``). A GPT checkpoint
    loads into a hybrid run (``model.architecture``) through megatron's load-time translation,
    model and optimizer state (``mcore_ext.checkpoint.architecture``); a hybrid checkpoint into a
    GPT run is a ``CheckpointFormatError`` naming both.
    """
    c = cfg.checkpoint
    start = start_point(cfg)
    if start.checkpoint is None:
        return 0, 0, f"{START_MARK} starting from scratch: {start.reason}"
    if start.own and c.load and os.path.abspath(c.load) != os.path.abspath(c.save):
        _print0(f"[checkpoint] {c.save} holds this run's checkpoints: resuming it (checkpoint.load="
                f"{c.load} only starts a run whose checkpoint.save is empty)")
    found, instead = _verified(start.checkpoint, c.on_corrupt)
    directory = found.directory
    common = dist_checkpointing.load_common_state_dict(directory)
    by_megatron_lm = content.written_by_megatron_lm(common)
    # Weights only: with finetune (before the run has a checkpoint of its own), and for an
    # imported Hugging Face model (python -m mcore_ext.hf import), which holds nothing else.
    finetune = (c.finetune and not start.own) or common.get("weights_only", False)
    if not finetune:
        # A Megatron-LM checkpoint's launcher content derives from its own (args, scheduler).
        common = content.launcher_common(common, cfg)
        _check_resumable(common, directory, cfg, by_megatron_lm)

    saved_keys = set(dist_checkpointing.load_tensors_metadata(directory))
    saved, ours = architecture.saved_architecture(saved_keys), cfg.model.architecture
    architecture.check_loadable(saved, ours, directory)
    model_state = model.module.sharded_state_dict()
    adapter_keys = [k for k in model_state if lora.ADAPTER_KEY in k]
    reference = common.get(adapters.BASE_KEY)
    if reference is not None and (finetune or not adapter_keys):
        raise CheckpointFormatError(
            f"{directory} holds LoRA adapters only (over the base checkpoint "
            f"{reference['directory']}): resume it with its lora section, or fine-tune from "
            "that base (checkpoint.load)")
    base_dir, base_state = directory, {}
    if finetune:  # the base model's weights; a LoRA run's adapters start fresh (B = 0)
        model_state = {k: v for k, v in model_state.items() if k not in adapter_keys}
    elif reference is not None:  # the frozen weights from the base, the adapters from here
        base_dir = adapters.find_base(reference, directory, c.load)
        base_state = {k: v for k, v in model_state.items() if k not in adapter_keys}
        model_state = {k: model_state[k] for k in adapter_keys}
    if vocab_size is not None:
        _check_vocabulary(base_dir, base_state or model_state, vocab_size)
    state = {"model": model_state}
    if not finetune:
        state["optimizer"] = checkpoint.optimizer_sharded_state_dict(
            optimizer, model_state, is_loading=True, metadata=common.get("content_metadata")
        )
    if saved == architecture.GPT and ours == architecture.HYBRID:
        # megatron's GPT -> hybrid translation, model and optimizer state alike.
        for part in ("model", "optimizer"):
            if part in state:
                architecture.retarget_to_gpt_checkpoint(
                    state[part], _hybrid_pattern(model), saved_keys)
    same_layout = common.get("layout") == _layout() and not common.get("no_rng")
    rng_key = content.launcher_rng_key(common)
    if same_layout and not finetune:
        state[rng_key] = (
            content.megatron_lm_rng_state() if by_megatron_lm else _rng_state(rng_key)
        )
    loaded = checkpoint.load(
        state, directory, init_missing_gates=c.init_missing_gates
    )
    if base_state:
        base = checkpoint.load({"model": base_state}, base_dir,
                               init_missing_gates=c.init_missing_gates)
        loaded["model"].update(base["model"])
        model.lora_base = reference  # the run's next saves refer to the same base

    if finetune and adapter_keys:
        # The innermost module: megatron's Float16Module (bf16 / fp16) returns nothing from
        # load_state_dict, and the keys not matched are what this needs.
        missing, unexpected = unwrap_model(model).load_state_dict(loaded["model"], strict=False)
        left = [k for k in missing if lora.ADAPTER_KEY not in k] + list(unexpected)
        if left:
            raise RuntimeError(f"loading {directory}: keys not matched: {left}")
    else:
        model.module.load_state_dict(loaded["model"])
    if finetune:
        if adapter_keys:  # the run saves its adapters and a reference to this base
            model.lora_base = adapters.base_reference(directory, common.get("iteration"))
        return 0, 0, (f"{START_MARK} finetune: loaded the model weights of {directory}; "
                      "iteration 0, with a new optimizer and schedule" + instead)
    checkpoint.load_optimizer_state_dict(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    if same_layout:
        rng = loaded[rng_key]
        _set_rng_state(content.launcher_rng_from_megatron_lm(rng) if by_megatron_lm
                       else rng)
    iteration = common["iteration"]
    change = f", layout {common.get('layout')} -> {_layout()}, RNG not restored"
    change = "" if same_layout else change
    over = f", the base weights from {base_dir}" if base_state else ""
    return iteration, common["consumed_samples"], (
        f"{START_MARK} resumed from {directory} (iteration {iteration}{change}{over})" + instead)


def _hybrid_pattern(model) -> str:
    """The layer pattern of the HybridModel inside ``model`` (DDP, Float16Module)."""
    while not hasattr(model, "hybrid_layer_pattern"):
        model = model.module
    return model.hybrid_layer_pattern


def _check_resumable(common: dict, directory: str, cfg, by_megatron_lm: bool) -> None:
    """Refuse a full resume the optimizer state does not allow."""
    distributed = cfg.optimizer.use_distributed_optimizer
    saved_distributed = common.get("distributed_optimizer", distributed)
    if saved_distributed != distributed:
        raise CheckpointFormatError(
            f"{directory} was saved with optimizer.use_distributed_optimizer="
            f"{str(saved_distributed).lower()}: resume with the same setting (the two optimizers' "
            "states are not interchangeable), or set checkpoint.finetune=true for weights only"
        )
    layout = common.get("layout")
    if cfg.optimizer.type == "muon" and distributed and layout != _layout():
        raise CheckpointFormatError(
            f"{directory} holds Muon's layer-wise distributed optimizer state (megatron's "
            f"LayerWiseDistributedOptimizer) saved at layout {layout}, this run is {_layout()}: "
            "megatron saves that state for its own layout only; resume at the saved layout, or "
            "set checkpoint.finetune=true for weights only"
        )
    if by_megatron_lm and common["no_optimizer"]:
        raise CheckpointFormatError(
            f"{directory} was saved by Megatron-LM with --no-save-optim: set "
            "checkpoint.finetune=true to load its weights only"
        )


def _verified(found: Checkpoint, on_corrupt: str) -> tuple[Checkpoint, str]:
    """``found`` if its files match its manifest (or it has none: saved before manifests, or by
    Megatron-LM), with "" ; else, with ``on_corrupt='previous'``, the newest older checkpoint
    of the same save directory that verifies, with a note for the start line (and a warning on
    stderr). Otherwise CheckpointCorruptError naming the file and that checkpoint.
    Collective: the ranks share the reading."""
    problems = manifest.verify_checkpoint(found.directory)
    if not problems:
        return found, ""
    what = manifest.summary(problems)
    previous = None
    if found.root is not None and found.iteration is not None:
        previous = manifest.newest_verified(found.root, found.iteration)
    if on_corrupt == "previous" and previous is not None:
        latest = f"iteration {found.iteration}"
        if dist.get_rank() == 0:
            print(f"warning: checkpoint {found.directory} is corrupt: {what}; resuming from "
                  f"iteration {previous.iteration} ({previous.directory}) instead "
                  "(checkpoint.on_corrupt=previous)", file=sys.stderr, flush=True)
        return previous, (f" INSTEAD OF the latest, {latest}: {what} "
                          "(checkpoint.on_corrupt=previous)")
    if previous is not None:
        advice = (f"the newest checkpoint that verifies is iteration {previous.iteration} "
                  f"({previous.directory}): set checkpoint.on_corrupt=previous to resume from it")
    elif found.root is not None:
        advice = f"no older checkpoint in {found.root} verifies"
    else:
        advice = "name another checkpoint in checkpoint.load"
    raise CheckpointCorruptError(f"checkpoint {found.directory} is corrupt: {what}; {advice}")


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
        if rows < vocab_size:  # a CheckpointLoadError: main says it in one line
            raise checkpoint.CheckpointLoadError(
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
