"""Everything that differs between the megatron-core releases mcore_ext supports.

Supported: the PyPI releases 0.16 to 0.19 (CI: the full suite on 0.19.2, a smoke run on 0.16.1,
0.17.1 and 0.18.2, see ``scripts/test_versions.sh``). The rest of the package is written as if
there were one megatron-core; each shim below says which releases need it and why.

1. A megatron-core with its own head-wise gate is refused at import (``check_no_native_gate``).
2. ``SelfAttention.__init__`` gained ``pp_layer_offset`` in 0.17 and ``name`` in 0.18
   (``self_attention_init_kwargs``).
3. ``gpt_layer_specs.TENorm`` exists without Transformer Engine only from 0.17 (``TENorm``).
4. The distributed optimizer over torch's Adam cannot load its own ``fully_reshardable``
   checkpoints correctly (``prepare_optimizer_for_loading``, ``load_optimizer_state_dict``).
5. ``utils.get_batch_on_this_cp_rank`` gained ``is_hybrid_cp`` / ``cp_group`` arguments in later
   releases (``get_batch_on_this_cp_rank``).
6. MTP: the layer inside an MTP depth is ``transformer_layer`` in 0.16 and ``mtp_model_layer``
   from 0.17 (``MTP_INNER_LAYER_FIELD``); the MTP loss is a function (``process_mtp_loss``) only
   from 0.17, whose arguments grew in later releases; Step-3.5's MTP needs that function
   (``check_mtp_supported``).

This module adapts megatron-core to other releases; ``_cpu_compat`` adapts it to a CPU.
"""

import dataclasses
import importlib.metadata
import inspect

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer import transformer_config
from megatron.core.transformer.attention import SelfAttention

# The releases mcore_ext supports, as in pyproject.toml (a test keeps the two equal).
SUPPORTED_RELEASES = ">=0.16.0,<0.20"


def megatron_core_version() -> str:
    """The installed megatron-core's version, as pip reports it (its own __version__ may carry
    a local git suffix)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        from megatron.core import package_info

        return package_info.__version__


# ------------------------------------------------------------------------ 1. native gate


def check_no_native_gate(config_class=None) -> None:
    """Refuse a megatron-core whose TransformerConfig has its own ``head_wise_attn_gate``.

    Upstream Megatron-LM's dev branch (and a release after 0.19, presumably) has the gate natively:
    its SelfAttention appends the gate rows to linear_qkv itself, so HeadWiseGatedSelfAttention
    would append them a second time, and dev passes ``head_wise_gate=`` / ``is_mtp_layer``
    arguments this subclass does not take. dev still calls itself 0.19.0, so the version number
    cannot tell; the config field can.
    """
    config_class = config_class or transformer_config.TransformerConfig
    if "head_wise_attn_gate" in {field.name for field in dataclasses.fields(config_class)}:
        raise ImportError(
            f"mcore_ext cannot run on megatron-core {megatron_core_version()}: its "
            f"{config_class.__name__} has a native head_wise_attn_gate field, so its SelfAttention "
            "adds the gate rows itself and mcore_ext's gate would add them twice. Use the native "
            "gate (TransformerConfig(head_wise_attn_gate=True) with megatron's own layer specs; "
            "its checkpoints use the same ._qkv / ._gate keys), or install a megatron-core "
            f"release <= 0.19.x: pip install 'megatron-core{SUPPORTED_RELEASES}'"
        )


check_no_native_gate()


# ------------------------------------------------------------ 2. SelfAttention arguments

_SELF_ATTENTION_PARAMETERS = inspect.signature(SelfAttention.__init__).parameters


def self_attention_init_kwargs(**kwargs) -> dict:
    """The keyword arguments that the installed ``SelfAttention.__init__`` accepts.

    ``pp_layer_offset`` exists from 0.17, ``name`` from 0.18. A release's TransformerLayer passes
    only what its SelfAttention takes, so an argument it does not know always arrives here as None
    and is dropped; a value for one would be lost, which is an error.
    """
    unknown = {key: value for key, value in kwargs.items() if key not in _SELF_ATTENTION_PARAMETERS}
    given = {key: value for key, value in unknown.items() if value is not None}
    if given:
        raise TypeError(
            f"megatron-core {megatron_core_version()}'s SelfAttention takes no argument "
            + ", ".join(f"{key}={value!r}" for key, value in given.items())
        )
    return {key: value for key, value in kwargs.items() if key not in unknown}


# ------------------------------------------------------------------------ 3. layer specs

# 0.16 imports TENorm into gpt_layer_specs only when Transformer Engine is installed; 0.17+ sets it
# to None otherwise. (Only the "te" backend uses it, and that backend requires TE.)
TENorm = getattr(gpt_layer_specs, "TENorm", None)


# ------------------------------------------------- 4. distributed optimizer over torch Adam
#
# Without Apex and Transformer Engine, megatron's DistributedOptimizer wraps torch.optim.Adam(W),
# which keeps a per-parameter 'step' tensor in its state (the fused Adams of Apex and TE keep the
# step in the param groups instead, and megatron's code paths for them are fine). Over torch's
# Adam, every supported release has three bugs in the fully_reshardable format (a and b fail the
# resume tests on 0.16.1, 0.17.1, 0.18.2 and 0.19.2 without these workarounds; the code is the same
# in all of them and on Megatron-LM dev as of 2026-08; gate these on the version once fixed):
#   a. sharded_state_dict(is_loading=True) first builds a state dict from the current state and
#      asserts that every parameter has one and the same step: an optimizer that has never
#      stepped has no state and fails.
#   b. load_parameter_state_from_fully_reshardable copies every tensor of a parameter's state
#      from the checkpoint, 'step' included, which the checkpoint keeps only in the param groups:
#      KeyError: 'step'.
#   c. load_state_dict gives all parameters one shared step tensor, which torch's Adam then
#      increments once per parameter per iteration: wrong bias correction after a resume.
# The functions below work around them for exactly that case and otherwise leave megatron alone.


def torch_adam_distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers in ``optimizer`` (chained or not) that wrap torch's Adam(W).

    Only these get the workarounds; a distributed optimizer over Apex's or Transformer Engine's
    fused Adam, and every non-distributed optimizer, is left to megatron.
    """
    return [
        inner
        for inner in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(inner, DistributedOptimizer)
        and isinstance(inner.optimizer, (torch.optim.Adam, torch.optim.AdamW))
    ]


def prepare_optimizer_for_loading(optimizer) -> None:
    """Give a torch-Adam distributed optimizer that has never stepped zero Adam state (bug a).

    Loading overwrites these values.
    """
    for inner in torch_adam_distributed_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                if not inner.optimizer.state[param]:
                    inner.optimizer.state[param].update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )


def load_optimizer_state_dict(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict(state_dict)``, with bugs b and c worked around where they apply.

    For a single torch-Adam distributed optimizer and a fully_reshardable state dict: the param
    groups load first, then the parameter state with the steps set aside, and each parameter gets
    its own copy of the step.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    torch_adam = torch_adam_distributed_optimizers(optimizer)
    if not (
        len(chained) == len(torch_adam) == 1
        and state_dict.get("param_state_sharding_type") == "fully_reshardable"
    ):
        optimizer.load_state_dict(state_dict)
        return
    (inner,) = torch_adam
    state_dict = dict(state_dict)
    param_state = state_dict.pop("param_state")
    state_dict.pop("param_state_sharding_type")
    inner.load_state_dict(state_dict)
    steps = {p: state.pop("step") for p, state in inner.optimizer.state.items() if "step" in state}
    try:
        inner.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for param, step in steps.items():
            inner.optimizer.state[param]["step"] = step.clone()


# ---------------------------------------------------------- 5. context-parallel batch split


def get_batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """megatron's load-balanced CP split of a batch of [b, s] tensors, on any supported release.

    Without ``cu_seqlens`` every release splits each sequence into 2 x CP chunks; later releases
    take ``is_hybrid_cp`` (required) and ``cp_group`` (else the global CP group).
    """
    from megatron.core import utils

    parameters = inspect.signature(utils.get_batch_on_this_cp_rank).parameters
    kwargs = {}
    if "is_hybrid_cp" in parameters:
        kwargs["is_hybrid_cp"] = False
    if "cp_group" in parameters:
        kwargs["cp_group"] = cp_group
    return utils.get_batch_on_this_cp_rank(dict(batch), **kwargs)


# -------------------------------------------------------------------------------------- 6. MTP

from megatron.core.transformer import multi_token_prediction as _mtp  # noqa: E402

_MTP_LAYER_FIELDS = {field.name for field in dataclasses.fields(
    _mtp.MultiTokenPredictionLayerSubmodules)}
# The slot of the transformer layer inside an MTP depth (also its module and checkpoint name).
MTP_INNER_LAYER_FIELD = "mtp_model_layer" if "mtp_model_layer" in _MTP_LAYER_FIELDS else (
    "transformer_layer")


def check_mtp_supported(step35_heads: bool) -> None:
    """Refuse Step-3.5's MTP on a release without megatron's ``process_mtp_loss`` (0.16), which
    computes its losses; megatron's own MTP runs on every supported release."""
    if step35_heads and not hasattr(_mtp, "process_mtp_loss"):
        raise NotImplementedError(
            f"mtp_step35_heads=True (Step-3.5's MTP: one output head per depth) needs "
            f"megatron-core >= 0.17 (its process_mtp_loss); megatron-core "
            f"{megatron_core_version()} computes MTP losses inside GPTModel with the shared head. "
            "Upgrade megatron-core, or set mtp_step35_heads=False for megatron's own MTP"
        )


def supported_kwargs(function, **kwargs) -> dict:
    """The keyword arguments ``function`` takes. One it does not take must be None (a release
    without it has nothing to pass it to); a value for it would be lost, which is an error."""
    parameters = inspect.signature(function).parameters
    lost = {k: v for k, v in kwargs.items() if k not in parameters and v is not None}
    if lost:
        raise TypeError(
            f"megatron-core {megatron_core_version()}'s {function.__qualname__} takes no argument "
            + ", ".join(f"{key}={value!r}" for key, value in lost.items())
        )
    return {key: value for key, value in kwargs.items() if key in parameters}


def process_mtp_loss(**kwargs):
    """megatron's ``process_mtp_loss`` with the arguments this release takes (0.17: no
    ``tp_group`` / ``input_ids``). Without labels, a release that cannot derive them from
    ``input_ids`` (0.17) computes no MTP loss: the main hidden states come back unchanged."""
    parameters = inspect.signature(_mtp.process_mtp_loss).parameters
    if kwargs.get("labels") is None and "input_ids" not in parameters:
        hidden_states = kwargs["hidden_states"]
        return hidden_states.chunk(1 + kwargs["config"].mtp_num_layers, dim=0)[0]
    if "input_ids" not in parameters:
        kwargs.pop("input_ids", None)  # only used to derive missing labels
    return _mtp.process_mtp_loss(**supported_kwargs(_mtp.process_mtp_loss, **kwargs))


def tp_group_kwargs(tp_group) -> dict:
    """``tp_group=`` for megatron's parallel linears where a group is given (every supported
    release takes it; None = megatron's default group)."""
    return {} if tp_group is None else {"tp_group": tp_group}
