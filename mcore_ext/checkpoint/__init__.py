"""Distributed checkpoints for models with the head-wise attention gate.

``save`` and ``load`` are megatron's ``dist_checkpointing.save/load`` plus a check that the
checkpoint and the model agree on the gate: loading an ungated checkpoint into a gated model (or
the reverse) fails with an error naming the gate tensors, before anything is read. The option
``init_missing_gates=True`` starts the gates of a gated model from their init when its checkpoint
has none (QKV rows load as usual).

What every entry point shares about checkpoint directories lives beside it: ``directory`` (the
layout, trackers, which checkpoint a path names, where a launcher run starts), ``saving`` (how
every rank writes one directory: ``.saving.``, manifest, rename, tracker), ``manifest`` (sizes
and checksums of what a save wrote, and their verification), ``safe_pickle`` (no pickle a load
reads runs code), ``content`` (megatron.training's
checkpoint content, which the launcher writes and reads too) and ``errors``.
"""

import dataclasses

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from mcore_ext import _mcore_compat
from mcore_ext.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointUnsafeError,
)
from mcore_ext.checkpoint import safe_pickle
from mcore_ext.checkpoint.sharding import GATE_SUFFIX, QKV_SUFFIX, QkvGateFactory, qkv_gate_factory

from mcore_ext.checkpoint import manifest

# Every pickle a checkpoint load reads is restricted (safe_pickle), and every megatron load of a
# directory is checked against its manifest first (with a key: signed, nothing unlisted),
# whichever entry point loads.
safe_pickle.install()
_mcore_compat.guard_checkpoint_loads(manifest.check_before_read, safe_pickle.load_file)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointUnsafeError",
    "GATE_SUFFIX",
    "GateLayoutMismatch",
    "QKV_SUFFIX",
    "OPTIMIZER_METADATA",
    "load",
    "load_optimizer_state_dict",
    "optimizer_sharded_state_dict",
    "qkv_gate_factory",
    "save",
]


class GateLayoutMismatch(ValueError):
    """The checkpoint and the model disagree on whether linear_qkv carries gate rows."""


def save(sharded_state_dict, checkpoint_dir: str, **kwargs):
    """``dist_checkpointing.save`` (torch_dist format); kwargs go to it."""
    return dist_checkpointing.save(sharded_state_dict, checkpoint_dir, **kwargs)


def load(
    sharded_state_dict,
    checkpoint_dir: str,
    *,
    init_missing_gates: bool = False,
    in_place: bool = False,
    **kwargs,
):
    """``dist_checkpointing.load`` after checking the gate layout of model and checkpoint.

    Raises ``GateLayoutMismatch`` naming the gate tensors that are missing from (or unexpected in)
    the checkpoint, and ``CheckpointLoadError`` when reading fails (truncated or corrupt files,
    mismatched shapes). With ``init_missing_gates=True`` a gated model loads an ungated
    checkpoint: its QKV rows come from the checkpoint and its gate rows keep their current (init)
    values.

    megatron loads into the tensors of ``sharded_state_dict``, i.e. into the live parameters, so a
    failure half way would leave the model partly overwritten. Unless ``in_place=True`` (which
    saves one copy of the parameters' memory), tensors are read into scratch buffers and the
    caller applies the returned state dict (``model.load_state_dict``) only once all succeeded.
    """
    saved = set(dist_checkpointing.load_tensors_metadata(checkpoint_dir))
    missing_gates = []

    def check_gate(value):
        if not isinstance(value, QkvGateFactory) or value.key + GATE_SUFFIX in saved:
            return value
        if init_missing_gates and value.key in saved:
            return value.from_ungated_checkpoint()
        missing_gates.append(value.key + GATE_SUFFIX)
        return value

    dict_list_map_inplace(check_gate, sharded_state_dict)
    if missing_gates:
        hint = (
            " It was saved without head_wise_attn_gate: pass init_missing_gates=True "
            "(checkpoint.init_missing_gates: true in the launcher) to start the gates from init."
            if all(key[: -len(GATE_SUFFIX)] in saved for key in missing_gates)
            else ""
        )
        raise GateLayoutMismatch(
            f"the model has head_wise_attn_gate=True but checkpoint {checkpoint_dir} has no gate "
            f"tensors {_preview(missing_gates)}.{hint}"
        )

    requested = {t.key for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)}
    unexpected = sorted(
        key for key in saved if key.endswith(GATE_SUFFIX) and key[: -len(GATE_SUFFIX)] in requested
    )
    if unexpected:
        raise GateLayoutMismatch(
            f"checkpoint {checkpoint_dir} holds head-wise gate tensors {_preview(unexpected)} but "
            f"the model has head_wise_attn_gate=False: enable the gate to load it"
        )
    if not in_place:
        dict_list_map_inplace(_with_scratch_data, sharded_state_dict)
    try:
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, **kwargs)
    except CheckpointException as error:
        # torch.distributed.checkpoint raises a BaseException subclass, which `except Exception`
        # in a caller's recovery code would not see; re-raise it as an ordinary error.
        raise CheckpointLoadError(
            f"cannot load checkpoint {checkpoint_dir}: "
            f"{_head_count_mismatch(sharded_state_dict, checkpoint_dir)}{error}"
        ) from error


def _head_count_mismatch(sharded_state_dict, checkpoint_dir: str) -> str:
    """A sentence naming both head counts when the gate blocks (one row per head) differ, else "".

    megatron's own message names the first tensor whose global shape differs, often linear_proj,
    which does not say that the head count is what changed.
    """
    try:
        saved = dist_checkpointing.load_tensors_metadata(checkpoint_dir)
    except Exception:  # noqa: BLE001  (the original error is reported either way)
        return ""
    for value in nested_values(sharded_state_dict):
        if not isinstance(value, QkvGateFactory) or value.key + GATE_SUFFIX not in saved:
            continue
        layout = value.layout
        saved_heads = saved[value.key + GATE_SUFFIX].global_shape[len(layout.sharded_offsets)]
        model_heads = (value.data.shape[0] - layout.qkv_rows) * layout.tp_size
        if saved_heads != model_heads:
            return (
                f"it was saved with num_attention_heads={saved_heads} ({value.key}{GATE_SUFFIX} "
                f"has {saved_heads} gate rows, one per head) but the model has "
                f"num_attention_heads={model_heads}; load it into a model with the same head "
                "count. "
            )
    return ""


# The distributed optimizer's layout-free format: per-parameter tensors in model space, which the
# gate's factory splits like the weights. (megatron-core's default, fully_sharded_model_space,
# builds flattened ShardedTensors that its own saver rejects.)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_sharded_state_dict(
    optimizer, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None
):
    """megatron's ``optimizer.sharded_state_dict`` in its TP-reshardable format (``metadata``:
    megatron's content metadata, ``OPTIMIZER_METADATA`` by default)."""
    if is_loading:
        _mcore_compat.prepare_optimizer_for_loading(optimizer)
    with _mcore_compat.steps_for_empty_optimizers(optimizer):
        state_dict = optimizer.sharded_state_dict(
            model_sharded_state_dict, is_loading=is_loading,
            metadata=metadata or OPTIMIZER_METADATA,
        )
    if not is_loading:
        _mcore_compat.complete_chained_state_dict(optimizer, state_dict, saving=True)
    return state_dict


def load_optimizer_state_dict(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict`` of a loaded ``optimizer_sharded_state_dict``.

    Use it instead of ``optimizer.load_state_dict``: it works around bugs of megatron-core's
    distributed optimizer over torch's Adam (see ``mcore_ext._mcore_compat``).
    """
    _mcore_compat.load_optimizer_state_dict(optimizer, state_dict)


def _with_scratch_data(value):
    if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(value.data):
        return dataclasses.replace(value, data=torch.empty_like(value.data))
    return value


def _preview(keys, limit=3):
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more

