"""GPT checkpoints in HybridModel runs: which model a checkpoint holds, and the load-time
translation of a hybrid model's sharded state dict onto a GPT checkpoint's keys.

A GPTModel layer holds attention and MLP under ``decoder.layers.<g>.``; HybridModel gives each
its own layer (GPT layer g's attention is hybrid layer 2g, its MLP or MoE 2g + 1, 0-based, in the
pattern ``*-*E...`` that ``build_hybrid_model`` derives). megatron-core 0.19 translates at load
time (``megatron.core.dist_checkpointing.gpt_checkpoint_interop``): the hybrid run's sharded
state dict (model, and the optimizer's, which copies the model's keys and sharding) is retargeted
at the GPT checkpoint's keys, and ``dist_checkpointing.load`` reads the GPT checkpoint as it is,
resharding across TP / PP / EP on the way. Nothing is rewritten on disk.

megatron's translation knows GPT's stacked format (``decoder.layers.<name>`` with the layer as a
sharding axis), which mcore_ext's uniform models save; it is used for those. Models whose layers
differ (Step-3.5's full / sliding kinds, dense first layers before MoE ones) save one key per layer
(``decoder.layers.<g>.<name>``): there the layer number in the key is renumbered, the same
correspondence. Both point HybridModel's ``decoder.final_norm`` at GPT's
``decoder.final_layernorm`` and keep the ``output_layer._extra_state`` GPT checkpoints omit.
MTP depth k's layer (GPT's ``mtp.layers.<k>.transformer_layer.``, one layer) is the depth's two
hybrid layers (``mtp.layers.<k>.mtp_model_layer.layers.0.`` attention, ``.1.`` MLP), which
megatron's translation refuses ("MTP layers ... have no source weights"): those keys are
pointed at the GPT depth's here, its enorm / hnorm / eh_proj / heads keep their keys.

The reverse, a hybrid checkpoint into a GPT run, is refused (as megatron.training refuses it):
``check_loadable`` says so in one line naming both architectures.
"""

import os
import re

import yaml
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

from mcore_ext.checkpoint.errors import CheckpointFormatError

GPT, HYBRID = "gpt", "hybrid"
_GPT_FINAL_NORM, _HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."
_GPT_OMITTED = "output_layer._extra_state"  # HybridModel's, absent from GPT checkpoints
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.)mtp_model_layer\.layers\.[01]\.")
_GPT_LAYERS = re.compile(r"(\*[-E])+")

__all__ = [
    "GPT", "HYBRID", "check_loadable", "checkpoint_architecture", "retarget_to_gpt_checkpoint",
    "saved_architecture",
]


def saved_architecture(saved_keys) -> str | None:
    """``'gpt'`` or ``'hybrid'``: the model a checkpoint's tensor keys (its metadata) were saved
    from, by the final norm (GPTModel's ``decoder.final_layernorm``, HybridModel's
    ``decoder.final_norm``; the metadata holds every pipeline stage's keys); None without one."""
    for key in saved_keys:
        if key.startswith(_GPT_FINAL_NORM):
            return GPT
        if key.startswith(_HYBRID_FINAL_NORM):
            return HYBRID
    return None


def checkpoint_architecture(directory: str) -> str | None:
    """The model a checkpoint directory (one iteration) holds: ``saved_architecture`` of its
    tensor keys, and for a LoRA run's adapters-only checkpoint (no final norm in it) the
    ``model.architecture`` of its config.yaml (``gpt`` when the key is missing: launcher
    checkpoints from before HybridModel was built). None for neither."""
    found = saved_architecture(dist_checkpointing.load_tensors_metadata(directory))
    if found is not None:
        return found
    try:
        with open(os.path.join(directory, "config.yaml")) as f:
            saved = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    model = saved.get("model") if isinstance(saved, dict) else None
    return model.get("architecture", GPT) if isinstance(model, dict) else None


def check_loadable(saved: str | None, model: str, directory: str) -> None:
    """Raise ``CheckpointFormatError`` when a ``model`` run cannot load a checkpoint of the
    ``saved`` architecture: a hybrid checkpoint into a GPT run (megatron translates GPT ->
    hybrid only)."""
    if saved == HYBRID and model == GPT:
        raise CheckpointFormatError(
            f"{directory} holds a HybridModel checkpoint (model.architecture=hybrid) but this run "
            "builds GPTModel (model.architecture=gpt): a hybrid checkpoint does not load into GPT "
            "(megatron translates GPT -> hybrid only); continue it with model.architecture=hybrid")


def gpt_layer_maps(pattern: str):
    """megatron's ``GPTCompatLayerMaps`` for a hybrid ``pattern`` that is a GPT model's: each GPT
    layer an attention ``*`` followed by its MLP (``-`` dense or ``E`` MoE), ``|`` stages
    anywhere. (megatron's ``gpt_compatible_layer_maps`` also refuses a pattern mixing ``-`` and
    ``E``, which Step-3.5's dense first layers before MoE ones are.)"""
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import GPTCompatLayerMaps

    layers = pattern.split("/")[0].replace("|", "")  # the MTP depths are retargeted apart
    if not _GPT_LAYERS.fullmatch(layers):
        raise CheckpointFormatError(
            f"hybrid_layer_pattern={pattern!r} cannot load a GPT checkpoint: each GPT layer is an "
            "attention '*' followed by its MLP ('-' or 'E')")
    count = len(layers) // 2
    return GPTCompatLayerMaps(
        attention_to_gpt={2 * g: g for g in range(count)},
        mlp_to_gpt={2 * g + 1: g for g in range(count)},
        fresh_init=frozenset(), num_gpt_layers=count)


def retarget_to_gpt_checkpoint(sharded_state_dict, pattern: str, saved_keys) -> None:
    """Point a hybrid model's sharded state dict (or the optimizer's built from it) of
    ``pattern`` at the GPT checkpoint whose tensor keys are ``saved_keys``, in place: megatron's
    translation for a stacked checkpoint, the layer numbers renumbered for a per-layer one. The
    nested dict keys stay the model's, so the loaded dict goes to its ``load_state_dict``."""
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    maps = gpt_layer_maps(pattern)

    def retarget_mtp(entry):
        if isinstance(entry, ShardedBase):
            entry.key = _MTP_LAYER.sub(r"\1transformer_layer.", entry.key, count=1)
        return entry

    dict_list_map_inplace(retarget_mtp, sharded_state_dict)
    if not any(_LAYER.search(key) for key in saved_keys):
        retarget_sharded_state_dict_to_gpt_checkpoint(sharded_state_dict, maps)
        return

    def retarget(entry):
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_GPT_OMITTED):
            return LocalNonpersistentObject(entry.data)
        layer = _LAYER.search(entry.key)
        if layer is not None:
            number = int(layer.group(1))
            gpt = maps.attention_to_gpt.get(number, maps.mlp_to_gpt.get(number))
            entry.key = f"{entry.key[:layer.start()]}decoder.layers.{gpt}.{entry.key[layer.end():]}"
        elif _HYBRID_FINAL_NORM in entry.key:
            entry.key = entry.key.replace(_HYBRID_FINAL_NORM, _GPT_FINAL_NORM, 1)
        return entry

    dict_list_map_inplace(retarget, sharded_state_dict)
