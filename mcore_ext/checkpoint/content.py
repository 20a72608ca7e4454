"""The checkpoint content both entry points write and read: megatron.training's.

Megatron-LM (``mcore_ext.megatron_lm``) writes it itself; the YAML launcher (``mcore_ext.training``)
writes it next to its own and reads it back, so each resumes the other's checkpoints. Both sit
above this module, which needs megatron.core only (every release the launcher supports).

What megatron.training (checkpointing.py of megatron-core 0.19: ``generate_state_dict``,
``get_rng_state``, ``_build_sharded_state_dict_metadata``, ``load_checkpoint``) keeps in a
torch_dist checkpoint ``<dir>/iter_NNNNNNN`` (tracker ``latest_checkpointed_iteration.txt``, the
launcher's names too):

- common: ``args`` (its argparse.Namespace: a resume reads ``consumed_train_samples``,
  ``skipped_train_samples``, ``consumed_valid_samples``, the TP / PP / DP sizes, ``no_save_optim``
  and ``no_save_rng``, and compares ``num_layers``, ``hidden_size``, ``num_attention_heads``,
  ``add_position_embedding``), ``checkpoint_version`` 3.0, ``iteration``, ``opt_param_scheduler``
  (``OptimizerParamScheduler.state_dict()`` with its steps counted in samples);
- sharded: ``model``, ``optimizer``, and ``rng_state``: a ShardedObject on a (PP, TP) grid whose
  replica id is the DP x CP rank, holding a one-element list of {random_rng_state, np_rng_state,
  torch_rng_state, cuda_rng_state, rng_tracker_states} (one per DP rank with
  ``--data-parallel-random-init``);
- content metadata: how model and optimizer state were sharded (``distrib_optim_sharding_type``
  ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``, ``singleton_local_shards``,
  ``chained_optim_avoid_prefix``); a load builds its sharded state dicts from it.

The launcher writes all of that next to its own content (``scheduler`` counted in iterations,
``consumed_samples``, ``layout``, ``distributed_optimizer``, and its per-rank RNG on a (PP, TP,
[CP,] DP) grid, stored under ``mcore_ext_rng_state`` because Megatron-LM owns ``rng_state``), and
reads a Megatron-LM checkpoint by deriving its own content from Megatron-LM's (``launcher_common``).

Schedules: the launcher steps its scheduler once per iteration, Megatron-LM by the global batch
size (samples), so step counts map by ``x global_batch_size``; both must have been configured alike
(peak / min LR, warmup, decay iterations and style, weight decay, train iterations), which each
side's scheduler checks on load. The data position is the consumed sample count on both sides.
"""

import argparse
import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from mcore_ext.checkpoint.errors import CheckpointFormatError

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointFormatError",
    "LAUNCHER_RNG_KEY",
    "MEGATRON_RNG_KEY",
    "content_metadata",
    "launcher_common",
    "launcher_rng_from_megatron_lm",
    "launcher_rng_key",
    "megatron_lm_args",
    "megatron_lm_content",
    "megatron_lm_rng_state",
    "scheduler_from_megatron_lm",
    "scheduler_to_megatron_lm",
    "written_by_megatron_lm",
]

CHECKPOINT_VERSION = 3.0
LAUNCHER_RNG_KEY = "mcore_ext_rng_state"
MEGATRON_RNG_KEY = "rng_state"
# OptimizerParamScheduler.state_dict() entries counted in steps (launcher: iterations,
# Megatron-LM: samples).
_STEP_FIELDS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def content_metadata(distributed_optimizer: bool) -> dict:
    """The content metadata Megatron-LM writes with ``--ckpt-format torch_dist`` (plus
    ``--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable`` for a distributed
    optimizer): the sharding both launchers build their model and optimizer state dicts with."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def megatron_lm_args(cfg, iteration: int, consumed_samples: int) -> argparse.Namespace:
    """The ``args`` Megatron-LM's resume reads, from the launcher's config (Megatron-LM's names)."""
    m, p, t, o = cfg.model, cfg.parallelism, cfg.training, cfg.optimizer
    return argparse.Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        seq_length=m.seq_length,
        max_position_embeddings=m.seq_length,
        add_position_embedding=True,  # megatron.training keeps its default with RoPE too
        position_embedding_type="rope",
        head_wise_attn_gate=m.head_wise_attn_gate,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        data_parallel_size=cfg.data_parallel_size,
        world_size=cfg.world_size,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        seed=t.seed,
        iteration=iteration,
        consumed_train_samples=consumed_samples,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_iters=o.lr_warmup_iters,
        lr_decay_iters=o.lr_decay_iters,
        lr_decay_style=o.lr_decay_style,
        weight_decay=o.weight_decay,
        # Muon's is megatron's layer-wise distributed optimizer, as Megatron-LM's arguments
        # turn --optimizer muon --use-distributed-optimizer into.
        use_distributed_optimizer=o.use_distributed_optimizer and o.type != "muon",
        use_layer_wise_distributed_optimizer=o.use_distributed_optimizer and o.type == "muon",
        dist_ckpt_optim_fully_reshardable=o.use_distributed_optimizer and o.type != "muon",
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        no_save_optim=False,
        no_save_rng=False,
        data_parallel_random_init=False,
        mcore_ext_launcher=True,  # who wrote it
    )


def scheduler_to_megatron_lm(state: dict, global_batch_size: int) -> dict:
    """The launcher's scheduler state (steps = iterations) as Megatron-LM's (steps = samples)."""
    state = dict(state)
    for name in _STEP_FIELDS:
        state[name] = state[name] * global_batch_size
    return state


def scheduler_from_megatron_lm(state: dict, global_batch_size: int) -> dict:
    """Megatron-LM's scheduler state (samples) as the launcher's (iterations); refuses counts that
    are not whole iterations (a sample-based schedule or another global batch size)."""
    state = dict(state)
    for name in _STEP_FIELDS:
        steps, rest = divmod(state[name], global_batch_size)
        if rest:
            raise CheckpointFormatError(
                f"opt_param_scheduler.{name}={state[name]} of the Megatron-LM checkpoint is not a "
                f"whole number of iterations of global_batch_size {global_batch_size}: the "
                "launcher's schedule counts iterations"
            )
        state[name] = int(steps) if float(steps).is_integer() else steps
    return state


def megatron_lm_content(cfg, iteration: int, consumed_samples: int, scheduler_state: dict) -> dict:
    """What to add to the launcher's state dict so that megatron.training resumes it."""
    return {
        "args": megatron_lm_args(cfg, iteration, consumed_samples),
        "checkpoint_version": CHECKPOINT_VERSION,
        "opt_param_scheduler": scheduler_to_megatron_lm(
            scheduler_state, cfg.training.global_batch_size
        ),
        "num_floating_point_operations_so_far": 0,
        MEGATRON_RNG_KEY: megatron_lm_rng_state(),
    }


def megatron_lm_rng_state() -> ShardedObject:
    """This rank's RNG streams as megatron.training's ``get_rng_state`` shards them (DP ranks are
    replicas: the DP-rank-0 state is the one saved, and the one every DP rank resumes with)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        # Megatron-LM on a CPU (mcore_ext's adaptations) keeps its "CUDA" stream on the CPU one.
        "cuda_rng_state": (
            torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()
        ),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        MEGATRON_RNG_KEY,
        [state],
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def launcher_rng_from_megatron_lm(loaded: list) -> dict:
    """A loaded Megatron-LM ``rng_state`` entry in the launcher's RNG layout."""
    state = loaded[parallel_state.get_data_parallel_rank()] if len(loaded) > 1 else loaded[0]
    return {
        "random": state["random_rng_state"],
        "numpy": state["np_rng_state"],
        "torch": state["torch_rng_state"],
        "cuda": state["cuda_rng_state"] if torch.cuda.is_available() else None,
        "tracker": state["rng_tracker_states"],
    }


def written_by_megatron_lm(common: dict) -> bool:
    """True for a checkpoint that megatron.training wrote (no launcher content in it)."""
    return "checkpoint_version" in common and "scheduler" not in common


def launcher_rng_key(common: dict) -> str:
    """Where the launcher's own per-rank RNG grid is: ``rng_state`` in checkpoints written before
    the launcher wrote Megatron-LM's content, ``mcore_ext_rng_state`` since."""
    return LAUNCHER_RNG_KEY if "checkpoint_version" in common else MEGATRON_RNG_KEY


def launcher_common(common: dict, cfg) -> dict:
    """The launcher's common content of a checkpoint; for one megatron.training wrote, derived
    from ``args`` and ``opt_param_scheduler``. Refuses a global batch size other than the run's
    (sample counts, and the schedule's, map to iterations through it)."""
    if not written_by_megatron_lm(common):
        return common
    args = common.get("args")
    if args is None:
        raise CheckpointFormatError(
            "the Megatron-LM checkpoint has no args (saved by a Megatron-LM without them): "
            "load it with checkpoint.finetune=true for weights only"
        )
    gbs = cfg.training.global_batch_size
    if args.global_batch_size != gbs:
        raise CheckpointFormatError(
            f"training.global_batch_size={gbs} but the Megatron-LM checkpoint was trained with "
            f"--global-batch-size {args.global_batch_size}: resume with the same global batch "
            "size (or set checkpoint.finetune=true for weights only)"
        )
    layout = {
        "tp": args.tensor_model_parallel_size,
        "pp": args.pipeline_model_parallel_size,
        "dp": args.data_parallel_size,
    }
    if getattr(args, "context_parallel_size", 1) > 1:
        layout["cp"] = args.context_parallel_size
    common = dict(common)
    common.update(
        scheduler=scheduler_from_megatron_lm(common["opt_param_scheduler"], gbs),
        consumed_samples=args.consumed_train_samples,
        layout=layout,
        # --optimizer muon --use-distributed-optimizer: the layer-wise distributed optimizer
        distributed_optimizer=bool(args.use_distributed_optimizer or getattr(
            args, "use_layer_wise_distributed_optimizer", False)),
        no_optimizer=bool(getattr(args, "no_save_optim", False)),
        no_rng=bool(getattr(args, "no_save_rng", False)),
    )
    return common
