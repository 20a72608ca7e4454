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
7. 0.16's fp32 router GEMM reads ``moe_utils.te_general_gemm``, which it defines only when
   Transformer Engine is installed (NameError without it; 0.17+ set it to None)
   (``_define_missing_te_general_gemm``).
6. The MoE aux-loss tracker moved from a dict in ``moe_utils`` (0.16, 0.17) to a
   ``MoEMetricsTracker`` in ``moe_logging`` (0.18+) (``take_moe_aux_losses``).
5. ``utils.get_batch_on_this_cp_rank`` gained ``is_hybrid_cp`` / ``cp_group`` arguments in later
   releases (``get_batch_on_this_cp_rank``).

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

    For each torch-Adam distributed optimizer (a MoE model's optimizer chains one for the dense
    and one for the expert parameters) and a fully_reshardable state dict: the param groups load
    first, then the parameter state with the steps set aside, and each parameter gets its own
    copy of the step. Other optimizers load as megatron loads them.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1:
        _load_one_optimizer(chained[0], state_dict)
        return
    if len(state_dict) != len(chained):  # megatron's own check, with its message
        raise RuntimeError(f"Expected {len(chained)} entries in state dict, but got "
                           f"{len(state_dict)}.")
    states = [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, dict) else (
        list(state_dict))
    for inner, state in zip(chained, states):
        _load_one_optimizer(inner, state)
    if hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


def _load_one_optimizer(inner, state_dict) -> None:
    if not (
        torch_adam_distributed_optimizers(inner)
        and state_dict.get("param_state_sharding_type") == "fully_reshardable"
    ):
        inner.load_state_dict(state_dict)
        return
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


# ------------------------------------------------------------------- 6. MoE aux-loss tracker


def take_moe_aux_losses() -> dict:
    """The MoE routers' recorded losses since the last call, and clear them: {name: (per-layer
    values [num_layers], reduce_group)}; values summed over this rank's micro-batches, not yet
    reduced over ranks (megatron's own reduction averages with ReduceOp.AVG, which gloo lacks)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16, 0.17
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        out = {}
        for name, entry in get_moe_layer_wise_logging_tracker().items():
            out[name] = (entry["values"].clone(), entry.get("reduce_group"))
            entry["values"].zero_()
        return out
    out = {}
    for name, entry in get_moe_metrics_tracker().metrics.items():
        out[name] = (entry.values.clone(), entry.reduce_group)
        entry.values.zero_()
    return out


# ------------------------------------------------- 7. 0.16's router GEMM without Transformer Engine


def _define_missing_te_general_gemm() -> None:
    """0.16 imports ``te_general_gemm`` into moe_utils only with Transformer Engine, then tests
    ``te_general_gemm is not None`` in the fp32 router GEMM (``moe_router_dtype='fp32'``): define
    it as None, as 0.17+ do, so the torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_define_missing_te_general_gemm()
