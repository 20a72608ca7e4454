"""Everything that differs between the megatron-core releases mcore_ext supports.

Supported: the PyPI releases 0.16 to 0.19 (CI: the full suite on 0.19.2, a smoke run on 0.16.1,
0.17.1 and 0.18.2, see ``scripts/test_versions.sh``). The rest of the package is written as if
there were one megatron-core; each shim below says which releases need it and why.

1. A megatron-core with its own head-wise gate is refused at import (``check_no_native_gate``).
2. ``SelfAttention.__init__`` gained ``pp_layer_offset`` in 0.17 and ``name`` in 0.18
   (``self_attention_init_kwargs``).
3. ``gpt_layer_specs.TENorm`` exists without Transformer Engine only from 0.17 (``TENorm``).
4. The distributed optimizer over torch's Adam cannot load its own ``fully_reshardable``
   checkpoints correctly (``prepare_optimizer_for_loading``, ``load_optimizer_state_dict``); a
   chained optimizer's entry without parameters on global rank 0 (the expert optimizer of a
   pipeline stage without MoE layers) writes a common state other layouts cannot load
   (``complete_chained_state_dict``, ``steps_for_empty_optimizers``). All releases.
5. ``utils.get_batch_on_this_cp_rank`` gained a required ``is_hybrid_cp`` argument in 0.18
   (``get_batch_on_this_cp_rank``).
6. MTP: the layer inside an MTP depth is ``transformer_layer`` in 0.16 and ``mtp_model_layer``
   from 0.17 (``MTP_INNER_LAYER_FIELD``); the MTP loss is a function (``process_mtp_loss``) only
   from 0.17, whose arguments grew in later releases; Step-3.5's MTP needs that function
   (``check_mtp_supported``).
7. megatron.training (mcore_ext.megatron_lm): 0.19 only (``check_megatron_training``); the wheel's
   dataset helpers come compiled, without the Makefile megatron runs (``skip_dataset_helper_...``);
   0.19.2's help of ``--moe-paged-stash-buffer-size-factor-cuda`` has an unescaped ``%``, which
   makes ``--help`` raise (``escape_help_percent_signs``).
8. The MoE aux-loss tracker moved from a dict in ``moe_utils`` (0.16, 0.17) to a
   ``MoEMetricsTracker`` in ``moe_logging`` (0.18+), whose ``report`` replaces the deprecated
   ``moe_utils.track_moe_metrics`` (``reduce_moe_metrics``, ``take_moe_aux_losses``).
9. 0.16's fp32 router GEMM reads ``moe_utils.te_general_gemm``, which it defines only when
   Transformer Engine is installed (NameError without it; 0.17+ set it to None)
   (``_define_missing_te_general_gemm``).
10. Checkpoint trackers are read by megatron.training's ``read_metadata`` where the wheel ships
    megatron.training (0.17+), by mcore_ext's own small reader on 0.16
    (``read_checkpoint_tracker``).
11. megatron's MoE spec builds its layer and experts as ``functools.partial``s from 0.19, as
    ModuleSpecs before (``replace_experts_module``).
12. ``HybridModel`` (``megatron.core.models.hybrid``) exists from 0.19 (``check_hybrid_model``).
13. Muon (0.19+, with ``emerging-optimizers``) splits ``linear_qkv`` into q, k, v only; the gated
    layer's gate rows are split off as a fourth matrix (``_install_gate_aware_muon``, ``has_muon``).
    It takes every 2-D weight but the embedding and output layers, a MoE router's included; the
    router goes to Adam (``_install_router_on_adam``).
14. Muon's layer-wise distributed optimizer (0.19+) wraps its torch optimizers in megatron's
    mixed-precision optimizer for bf16 only; in fp32 they stay bare (no loss scale, grad copy or
    config) and its first step raises. They get megatron's FP32Optimizer
    (``_install_layer_wise_fp32``).

This module adapts megatron-core to other releases; ``_cpu_compat`` adapts it to a CPU.
"""

import contextlib
import copy
import dataclasses
import functools
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


# ------------------------- 4. optimizer checkpoints: torch's Adam, chain entries without parameters
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
#
# A chained optimizer can hold an entry with no parameters on a rank: megatron builds the expert
# optimizer on every rank of a MoE model, and a pipeline stage without MoE layers has no experts.
# Global rank 0 alone writes a checkpoint's common (non-tensor) state, so when rank 0 is such a
# stage, what its empty entry writes is what every layout loads. Three bugs (0.16 - 0.19):
#   d. FP32Optimizer / Float16Optimizer keep the step as one 'common_step' per entry, and an
#      entry without parameters has none: loading where it has parameters gives them Adam state
#      without a step (KeyError: 'step' in torch's Adam).
#   e. The distributed optimizer over torch's Adam reads the step from its parameters' state and
#      asserts there is exactly one: an entry without parameters cannot be saved at all.
#   f. Float16Optimizer's empty list of fp32 master weights ([[]]) lands in the common state and
#      contradicts the loading layout's list ("Cannot merge two lists with different lengths").
# The chain's entries share one step (megatron's ChainedOptimizer._synchronize_steps), so the
# empty entry takes its siblings' (d, e); the empty master-weight lists are not saved and are
# restored on load (f). Checkpoints written before the fix of f load only where rank 0 again has
# no experts.


def torch_adam_distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers in ``optimizer`` (chained or not) that wrap torch's Adam(W).

    Only these get the workarounds; a distributed optimizer over Apex's or Transformer Engine's
    fused Adam, and every non-distributed optimizer, is left to megatron.
    """
    return [
        inner
        for inner in _chain(optimizer)
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
    """``optimizer.load_state_dict(state_dict)``, with bugs b, c, d and f worked around where
    they apply.

    A chain's entries without parameters are completed first (d, f). For each torch-Adam
    distributed optimizer (a MoE model's optimizer chains one for the dense and one for the
    expert parameters) and a fully_reshardable state dict: the param groups load first, then the
    parameter state with the steps set aside, and each parameter gets its own copy of the step.
    Other optimizers load as megatron loads them.
    """
    chained = _chain(optimizer)
    complete_chained_state_dict(optimizer, state_dict, saving=False)
    if not torch_adam_distributed_optimizers(optimizer):
        optimizer.load_state_dict(state_dict)  # megatron's own path (e.g. Apex / TE fused Adam)
        return
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


def _chain(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _has_parameters(inner) -> bool:
    return any(group["params"] for group in inner.optimizer.param_groups)


def _chain_step(optimizer):
    """The step the chain's entries share: Adam's per-parameter step of any entry that has one."""
    for inner in _chain(optimizer):
        for state in inner.optimizer.state.values():
            if "step" in state:
                return state["step"]
    return None


@contextlib.contextmanager
def steps_for_empty_optimizers(optimizer):
    """Let a torch-Adam distributed optimizer without parameters report the chain's step to
    megatron's ``state_dict`` (bug e) while the block runs."""
    empty = [inner for inner in torch_adam_distributed_optimizers(optimizer)
             if not _has_parameters(inner)]
    step = _chain_step(optimizer) if empty else None
    if step is None:
        yield
        return
    for inner in empty:
        inner_state_dict = inner.optimizer.state_dict

        def with_step(inner_state_dict=inner_state_dict):
            state_dict = inner_state_dict()
            state_dict["state"] = {0: {"step": step}}  # read for the step only
            return state_dict

        inner.optimizer.state_dict = with_step
    try:
        yield
    finally:
        for inner in empty:
            del inner.optimizer.state_dict


def complete_chained_state_dict(optimizer, state_dict, *, saving: bool) -> None:
    """Fix a chained optimizer's state dict in place for its entries without parameters on this
    rank (bugs d and f): the sharded one about to be saved (``saving``), or a loaded one."""
    chain = _chain(optimizer)
    if len(chain) < 2 or not isinstance(state_dict, dict) or len(state_dict) != len(chain):
        return
    entries = [entry for _, entry in sorted(state_dict.items())]
    states = [entry.get("optimizer", entry).get("state") for entry in entries]
    steps = [state["common_step"] for state in states
             if isinstance(state, dict) and "common_step" in state]
    for inner, entry, state in zip(chain, entries, states):
        if isinstance(state, dict) and steps:
            state.setdefault("common_step", copy.deepcopy(steps[0]))
        groups = getattr(inner, "fp32_from_float16_groups", None)
        if groups is None or _has_parameters(inner):
            continue
        if saving:
            entry.pop("fp32_from_fp16_params", None)  # saved, it would be rank 0's list shape
        else:
            entry.setdefault("fp32_from_fp16_params", [[] for _ in groups])


def _load_one_optimizer(inner, state_dict) -> None:
    if not (
        torch_adam_distributed_optimizers(inner)
        and state_dict.get("param_state_sharding_type") == "fully_reshardable"
    ):
        inner.load_state_dict(state_dict)
        return
    state_dict = dict(state_dict)
    param_state = state_dict.pop("param_state", None)
    state_dict.pop("param_state_sharding_type")
    if param_state is None and _has_parameters(inner):
        raise RuntimeError("the distributed optimizer's checkpoint has no parameter state")
    inner.load_state_dict(state_dict)
    if param_state is None:  # an entry without parameters on this rank: nothing more to load
        return
    steps = {p: state.pop("step") for p, state in inner.optimizer.state.items() if "step" in state}
    try:
        inner.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for param, step in steps.items():
            inner.optimizer.state[param]["step"] = step.clone()


# ---------------------------------------------------------- 5. context-parallel batch split


def get_batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """megatron's load-balanced CP split of a batch of [b, s] tensors, on any supported release.

    Without ``cu_seqlens`` every release splits each sequence into 2 x CP chunks. 0.18 added a
    required ``is_hybrid_cp``. Every supported release takes ``cp_group`` and splits by that
    group when it is given (0.16 and 0.17: ``get_pg_size`` / ``get_pg_rank`` of it; 0.18 and
    0.19: ``torch.distributed.get_world_size`` / ``get_rank`` of it, where None would mean the
    *world*), so it is always passed.
    """
    from megatron.core import utils

    kwargs = {"cp_group": cp_group}
    if "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters:
        kwargs["is_hybrid_cp"] = False
    return utils.get_batch_on_this_cp_rank(dict(batch), **kwargs)


# -------------------------------------------------------------------------------------- 6. MTP

from megatron.core.transformer import multi_token_prediction as _mtp  # noqa: E402

_MTP_LAYER_FIELDS = {field.name for field in dataclasses.fields(
    _mtp.MultiTokenPredictionLayerSubmodules)}
# The slot of the transformer layer inside an MTP depth (also its module and checkpoint name).
MTP_INNER_LAYER_FIELD = "mtp_model_layer" if "mtp_model_layer" in _MTP_LAYER_FIELDS else (
    "transformer_layer")


# 0.16's GPTModel computes MTP losses inside _postprocess, from labels it requires.
MTP_LOSS_NEEDS_LABELS = not hasattr(_mtp, "process_mtp_loss")


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
    if "tp_group" not in parameters:
        # 0.17 / 0.18 take the TP group from parallel_state: the same group, or an error.
        from megatron.core import parallel_state

        group = kwargs.pop("tp_group", None)
        if group is not None and group is not parallel_state.get_tensor_model_parallel_group():
            raise TypeError(
                f"megatron-core {megatron_core_version()}'s process_mtp_loss uses parallel_state's "
                "tensor-parallel group; a model built with another tp_group needs megatron-core "
                ">= 0.19"
            )
    return _mtp.process_mtp_loss(**supported_kwargs(_mtp.process_mtp_loss, **kwargs))


def reset_mtp_losses() -> None:
    """Empty megatron's MTP loss tracker, a class attribute kept for the whole process: sized by
    the first model that tracks, and zeroed (not emptied) after each step. A second run in the
    same process (``mcore_ext.training.main`` called again) would otherwise find the earlier
    run's zeros on a pipeline stage without the MTP depth (``take_mtp_losses`` counts them: the
    logged MTP loss halved at PP 2) or a tracker of another depth (IndexError)."""
    _mtp.MTPLossLoggingHelper.tracker.clear()


def take_mtp_losses(num_layers: int):
    """This rank's MTP losses since the last call, one per depth, summed over micro-batches (as
    megatron's MTPLossLoggingHelper tracks them in training: 'values' up to 0.17,
    'loss_values' later), then cleared; None where nothing was tracked (other pipeline stages)."""
    tracker = _mtp.MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))
    if values is None or values.numel() != num_layers:
        return None
    losses = values.detach().clone()
    helper = _mtp.MTPLossLoggingHelper
    if hasattr(helper, "clean_metrics_in_tracker"):  # 0.18+
        helper.clean_metrics_in_tracker()
    else:
        helper.clean_loss_in_tracker()
    return losses


def tp_group_kwargs(tp_group) -> dict:
    """``tp_group=`` for megatron's parallel linears where a group is given (every supported
    release takes it; None = megatron's default group)."""
    return {} if tp_group is None else {"tp_group": tp_group}


# ------------------------------------------------------------------ 7. megatron.training
#
# The megatron-core wheel ships megatron.training from 0.17 (0.16's has only megatron.core), but
# its model config / builder API (megatron.training.models.gpt) and today's pretrain() signature
# (a config container first, no model_provider) only from 0.19: 0.17 takes (dataset provider,
# model_provider, model_type, forward_step, extra_args_provider=...), 0.18 (config container,
# dataset provider, model_provider, ...). mcore_ext.megatron_lm supports 0.19.

MEGATRON_TRAINING_RELEASES = ">=0.19.0"


def check_megatron_training() -> None:
    """Refuse a megatron-core whose megatron.training mcore_ext.megatron_lm cannot drive."""
    from packaging.version import Version

    version = megatron_core_version()
    if Version(version).release < (0, 17):
        reason = "its wheel has no megatron.training (the wheel ships it from 0.17)"
    elif Version(version).release < (0, 19):
        reason = ("its megatron.training has no GPTModelConfig / GPTModelBuilder, and its "
                  "pretrain() takes a model_provider (0.17: no config container, 0.18: after one)")
    else:
        return
    raise ImportError(
        f"mcore_ext.megatron_lm does not support megatron-core {version}: {reason}. Install "
        f"megatron-core{MEGATRON_TRAINING_RELEASES},<0.20, or use mcore_ext's own launcher "
        "(launch/pretrain.py), which supports 0.16 to 0.19"
    )


def guard_megatron_lm_checkpoint_choice(check):
    """Make megatron.training call ``check(directory)`` with the checkpoint directory it has
    chosen to load, before it reads any of it, whichever way it chose it (the tracker of
    ``--load`` or ``--pretrained-checkpoint``, ``--ckpt-step`` with or without a tracker, a
    ``release`` tracker) and whatever its format (torch_dist, torch, torch_dcp, fsdp_dtensor):
    0.19's ``_load_base_checkpoint`` detects the format of that directory
    (``_get_checkpoint_format``) before reading it, for every rank, at every load (also
    ``--use-checkpoint-args``' read of the args). Non-persistent checkpoints do not pass there:
    a global one is megatron's dist_checkpointing load (``guard_checkpoint_loads``). Returns the
    undo."""
    from megatron.training import checkpointing

    original = getattr(checkpointing, "_get_checkpoint_format", None)
    if original is None:
        raise ImportError(
            f"megatron.training {megatron_core_version()} has no checkpointing."
            "_get_checkpoint_format: mcore_ext.megatron_lm cannot verify the checkpoint it "
            "chooses before reading it")

    def get_checkpoint_format(checkpoint_name, args):
        check(str(checkpoint_name))
        return original(checkpoint_name, args)

    checkpointing._get_checkpoint_format = get_checkpoint_format
    return lambda: setattr(checkpointing, "_get_checkpoint_format", original)


def megatron_optimizer_modules() -> list:
    """megatron-core's optimizer modules that read a whole checkpoint file with ``torch.load``
    and torch's defaults (``load_parameter_state``: Megatron-LM's ``--ckpt-format torch``
    ``distrib_optim.pt``), for the Megatron-LM entry to read restricted."""
    import importlib

    modules = []
    for name in ("megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.layer_wise_optimizer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is not None:
            modules.append(module)
    return modules


def skip_dataset_helper_compilation() -> None:
    """megatron.training compiles megatron/core/datasets/helpers.cpp with ``make`` at start-up; the
    wheel ships it compiled (helpers_cpp) and without the Makefile, so ``make`` fails and
    megatron exits. Skip the compilation when the compiled module imports (every wheel)."""
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source tree: megatron compiles it as usual
    dataset_utils.compile_helpers = lambda: None


@contextlib.contextmanager
def after_megatron_signal_handler(callback):
    """Within: ``callback(exit_signal)`` right after megatron.training installs its
    ``--exit-signal-handler`` handler (``global_vars._set_signal_handler``, called by
    ``set_global_variables`` in ``initialize_megatron``, 0.19), so that a signal recorded before
    can be handed to it."""
    from megatron.training import global_vars

    original = global_vars._set_signal_handler

    def _set_signal_handler(exit_signal):
        original(exit_signal)
        callback(exit_signal)

    global_vars._set_signal_handler = _set_signal_handler
    try:
        yield
    finally:
        global_vars._set_signal_handler = original


def escape_help_percent_signs(parser) -> None:
    """Escape the ``%`` of a flag's help that argparse cannot format (it formats every help with
    ``%``: ``--help`` raised ValueError: unsupported format character)."""
    for action in parser._actions:
        if not action.help or "%" not in action.help:
            continue
        try:
            action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


# ------------------------------------------------------------------- 8. MoE aux-loss tracker


def reduce_moe_metrics(names: list, moe_layer_pattern: list, loss_scale: float) -> dict:
    """megatron's reduction of the MoE metrics its routers recorded since the last call, which it
    then clears: {name: mean over the MoE layers}, on every rank.

    Every rank calls it with the same ``names`` (collectives over the pipeline, the metric's own
    group and data-parallel ranks); a stage that recorded nothing gets megatron's zeros
    (``force_initialize``). ``moe_layer_pattern``: 1 / 0 per global layer, MTP layers included,
    whose length sizes those zeros like the routers' records (``num_layers + mtp_num_layers``)
    and whose sum is the number of MoE layers averaged over (megatron would add every MTP layer
    to it; Step-3.5's MTP layers are dense). ``loss_scale``: 1 / micro-batches.
    """
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        report = get_moe_metrics_tracker().report
    except ImportError:  # 0.16, 0.17
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics as report
    means = {}
    report(loss_scale=loss_scale, iteration=0, total_loss_dict=means, force_initialize=True,
           track_names=list(names), num_layers=len(moe_layer_pattern),
           moe_layer_freq=list(moe_layer_pattern), mtp_num_layers=None)
    return {name: float(means[name]) for name in names}


def take_moe_aux_losses() -> dict:
    """The MoE routers' recorded losses since the last call, and clear them: {name: (per-layer
    values [num_layers], reduce_group)}; values summed over this rank's micro-batches, not
    reduced over ranks (the per-layer values, for tests; ``reduce_moe_metrics`` reduces)."""
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


# ------------------------------------------------- 9. 0.16's router GEMM without Transformer Engine


def _define_missing_te_general_gemm() -> None:
    """0.16 imports ``te_general_gemm`` into moe_utils only with Transformer Engine, then tests
    ``te_general_gemm is not None`` in the fp32 router GEMM (``moe_router_dtype='fp32'``): define
    it as None, as 0.17+ do, so the torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_define_missing_te_general_gemm()


# ------------------------------------------------------------------ 10. checkpoint tracker


def read_checkpoint_tracker(path: str, fallback) -> tuple[int, bool]:
    """(iteration, release) of a ``latest_checkpointed_iteration.txt`` through megatron.training's
    ``read_metadata``, else ``fallback(path)`` (0.16's wheel has no megatron.training).

    Check the content first: megatron's reader calls ``sys.exit()`` (exit code 0) on text that
    is neither a number nor ``release``. With torch.distributed initialized it is a collective
    (every rank reads, all agree on the highest iteration) on a "cuda" tensor, which a CPU run
    maps to the CPU.
    """
    try:
        from megatron.training.checkpointing import read_metadata
    except Exception:  # noqa: BLE001  (no megatron.training, or one that does not import here)
        return fallback(path)
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():
        iteration, release = read_metadata(path)
    return int(iteration), bool(release)


# --------------------------------------------------------------- 11. expert modules in a spec


def replace_experts_module(moe_spec, old: type, new: type):
    """``moe_spec`` (how a MoELayer is built) with its experts built by ``new`` where they are
    ``old``. 0.19 gives the layer and its experts as ``functools.partial``s of their classes,
    earlier releases as ModuleSpecs."""
    import dataclasses
    import functools

    def swap(builder, keep):
        if isinstance(builder, functools.partial):
            submodules = builder.keywords.get("submodules")
            return functools.partial(builder.func, *builder.args,
                                     **{**builder.keywords, "submodules": keep(submodules)})
        return dataclasses.replace(builder, submodules=keep(builder.submodules))

    def experts_of(submodules):
        experts = submodules.experts
        if isinstance(experts, functools.partial) and experts.func is old:
            experts = functools.partial(new, *experts.args, **experts.keywords)
        elif getattr(experts, "module", None) is old:
            experts = dataclasses.replace(experts, module=new)
        return dataclasses.replace(submodules, experts=experts)

    return swap(moe_spec, experts_of)


# ------------------------------------------------------------------------ 12. HybridModel


def has_hybrid_model() -> bool:
    """Whether this megatron-core has the ``HybridModel`` mcore_ext builds on
    (``megatron.core.models.hybrid`` of 0.19+; 0.18 ships an earlier one, untested here)."""
    import importlib.util

    from packaging.version import Version

    return (Version(megatron_core_version()).release >= (0, 19)
            and importlib.util.find_spec("megatron.core.models.hybrid") is not None)


def check_hybrid_model(field: str = "architecture") -> None:
    """Refuse ``architecture: hybrid`` on a megatron-core without 0.19's HybridModel
    (0.16 - 0.18), naming ``field`` and the installed release."""
    if not has_hybrid_model():
        raise ValueError(
            f"{field}=hybrid needs megatron-core's HybridModel (0.19+), megatron-core "
            f"{megatron_core_version()} is installed: use {field}=gpt, or megatron-core 0.19")


# ------------------------------------------------------------- 13. Muon and the gate rows


def _orthogonalize_qkv_gate(orthogonalize):
    """``TensorParallelMuon.orthogonalize`` that splits a gated ``linear_qkv`` into q, k, v and
    gate, each orthogonalised as its own matrix; every other parameter as megatron does."""

    @functools.wraps(orthogonalize)
    def orthogonalize_qkv_gate(self, p, grad, **kwargs):
        split = getattr(p, "qkv_gate_split", None)
        if split is None or not self.split_qkv:
            return orthogonalize(self, p, grad, **kwargs)
        groups, sizes, gate_rows = split
        if groups is None:
            raise RuntimeError(
                "Muon on the gated linear_qkv needs num_query_groups >= tensor_model_parallel_size "
                "(a rank's QKV rows cut through a query group)")
        # As megatron's orthogonalize: the TP group and, unless blockwise, the dimension the
        # blocks are gathered along over it (a projection is then one global matrix).
        tp_group = self.pg_collection.tp if self.pg_collection else None
        partition_dim = None if self.tp_mode == "blockwise" else getattr(p, "partition_dim", None)
        if partition_dim == -1:
            partition_dim = None
        columns = grad.size(-1)
        qkv, gate = grad.split([grad.size(0) - gate_rows, gate_rows])
        parts = qkv.view(groups, sum(sizes), columns).split(sizes, dim=1)
        parts = [
            self.scaled_orthogonalize_fn_with_gtp_remat(
                p, part.reshape(-1, columns), tp_group, partition_dim
            ).view(part.shape)
            for part in parts
        ]
        gate = self.scaled_orthogonalize_fn_with_gtp_remat(p, gate, tp_group, partition_dim)
        return torch.cat([torch.cat(parts, dim=1).view(-1, columns), gate])

    orthogonalize_qkv_gate.knows_gate_rows = True
    return orthogonalize_qkv_gate


def _install_gate_aware_muon() -> None:
    """megatron-core's Muon (0.19+, ``emerging-optimizers``) orthogonalises a ``linear_qkv``
    weight per projection: its ``qkv_split_shapes`` cut each query group's rows into q, k and v,
    and the q rows of all groups are one matrix, the k rows one, the v rows one. A gated
    linear_qkv is ``[QKV_r; Gate_r]`` on each rank: megatron's shapes do not divide its rows (it
    then orthogonalises the whole fused matrix as one) or, where the counts happen to divide, cut
    it in the wrong places. HeadWiseGatedSelfAttention tags its weight with ``qkv_gate_split``
    (local query groups, megatron's (q, k, v) rows per group, gate rows); Muon splits such a
    weight into q, k, v and gate and orthogonalises each as megatron orthogonalises a
    projection (its TP mode, scale and Newton-Schulz). The tag is one of megatron's
    tensor-parallel attributes, so the fp32 main copy of a bf16 weight carries it too.
    Releases without Muon: nothing to do."""
    from megatron.core.tensor_parallel import layers

    try:
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    except ImportError:  # 0.16 - 0.18
        return
    layers._MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.setdefault("qkv_gate_split", None)
    if not getattr(TensorParallelMuon.orthogonalize, "knows_gate_rows", False):
        TensorParallelMuon.orthogonalize = _orthogonalize_qkv_gate(TensorParallelMuon.orthogonalize)


_install_gate_aware_muon()


# The router's weight in megatron's MoE layer (TopKRouter), under any prefix.
MOE_ROUTER_WEIGHT = "*.router.weight"


def _install_router_on_adam() -> None:
    """megatron's Muon entry sends to Adam what ``_is_nonlinear_or_embedding`` picks (vectors,
    the embedding and output layers) through its registry's ``default_param_overrides``; every
    other 2-D weight goes to Muon, a MoE router's ``[experts, hidden]`` weight included. The
    router scores experts rather than mapping the hidden state, and issue 35 asks for it on
    Adam: one more override of the same kind, by name, in Muon's and adaptive Muon's entries
    (megatron applies ``muon_scalar_optimizer`` to it as to its own). Routed experts need
    nothing: each expert's fc1 and fc2 are parameters of their own (``SequentialMLP``,
    mcore_ext's grouped form of it, ``TEGroupedMLP``'s ``weight{i}``), orthogonalised expert by
    expert. The expert bias is a buffer that megatron's bias update moves, not a parameter.
    Releases without Muon: nothing to do."""
    try:
        from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS
        from megatron.core.optimizer.optimizer_config import ParamKey
    except ImportError:  # 0.16 - 0.18
        return
    for name in ("muon", "adaptive_muon"):
        if name in _EMERGING_OPTIMIZERS:
            overrides = _EMERGING_OPTIMIZERS[name].default_param_overrides
            overrides.setdefault(ParamKey(name=MOE_ROUTER_WEIGHT), {"optimizer": "adam"})


_install_router_on_adam()


# ------------------------------------- 14. the layer-wise distributed optimizer in fp32


def _wrap_fp32_optimizers(init):
    """``LayerWiseDistributedOptimizer.__init__`` that wraps its (already sharded) torch
    optimizers in ``FP32Optimizer`` when the run is neither bf16 nor fp16, as megatron's
    non-distributed Muon entry does, then chains them again (the chain takes its config
    from them)."""

    @functools.wraps(init)
    def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None,
                 model_chunks=None):
        init(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        if config.bf16 or config.fp16:
            return
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        fns = init_state_fn_list or [None] * len(self.chained_optimizers)
        wrapped = [_fp32_optimizer_class()(opt, config, fn)
                   for opt, fn in zip(self.chained_optimizers, fns)]
        model_chunks = self.model_chunks
        ChainedOptimizer.__init__(self, wrapped)
        self.model_chunks = model_chunks

    __init__.wraps_fp32 = True
    return __init__


@functools.cache
def _fp32_optimizer_class():
    """megatron's FP32Optimizer with its sharded state under ``"optimizer"``, where the
    layer-wise optimizer's dist-checkpoint state dict reads and writes it, as
    Float16OptimizerWithFloat16Params keeps it."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    class LayerWiseFP32Optimizer(FP32Optimizer):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict.get("optimizer", state_dict))

        def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
            return {"optimizer": super().sharded_state_dict(
                model_sharded_state_dict, is_loading, metadata)}

    return LayerWiseFP32Optimizer


def _install_layer_wise_fp32() -> None:
    """Muon with ``use_layer_wise_distributed_optimizer`` in fp32: megatron's
    ``LayerWiseDistributedOptimizer`` wraps its torch optimizers in
    ``Float16OptimizerWithFloat16Params`` under bf16 and leaves them bare otherwise, where the
    chain's ``get_loss_scale``, gradient copy and config are then missing. Releases without it
    (0.16 - 0.18): nothing to do."""
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except ImportError:
        return
    if not getattr(LayerWiseDistributedOptimizer.__init__, "wraps_fp32", False):
        LayerWiseDistributedOptimizer.__init__ = _wrap_fp32_optimizers(
            LayerWiseDistributedOptimizer.__init__)


_install_layer_wise_fp32()


def has_muon() -> bool:
    """Whether megatron-core's Muon can run: 0.19+ with the ``emerging-optimizers`` package."""
    try:
        from megatron.core.optimizer import emerging_optimizers
    except ImportError:
        return False
    return emerging_optimizers.HAVE_EMERGING_OPTIMIZERS and "muon" in getattr(
        emerging_optimizers, "_EMERGING_OPTIMIZERS", {})


def has_router_replay() -> bool:
    """Whether megatron-core's MoE routers can replay recorded top-k experts
    (``TransformerConfig.moe_enable_routing_replay``; benchmarks/bench_gate.py --moe pins every
    variant's routing with it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "moe_enable_routing_replay" in {f.name for f in dataclasses.fields(TransformerConfig)}


# ------------------------------------------- 15. what megatron's dist_checkpointing loads read
#
# Every load of dist_checkpointing (load, load_common_state_dict, load_tensors_metadata,
# load_sharded_metadata, ...) starts with its module's verify_checkpoint(dir); a checkpoint with a
# legacy common.pt has its common state read by strategies.common.load_common, torch.load with
# torch's defaults (plain pickle under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1). Both are looked up as
# globals of serialization.py at call time, on every release that has them (0.16 - 0.19).


def guard_checkpoint_loads(check, read_common) -> None:
    """Make every dist_checkpointing load call ``check(directory)`` after megatron's own check
    of the directory, and read a ``common.pt`` with ``read_common(path)`` instead of
    ``torch.load``, whoever loads (the launcher, hf export, megatron.training, Megatron-Bridge).
    Idempotent."""
    import os

    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    megatron_check = getattr(serialization, "verify_checkpoint", None)
    if megatron_check is None or getattr(megatron_check, "_mcore_ext", False):
        return

    def verify_checkpoint(checkpoint_dir):
        megatron_check(checkpoint_dir)
        check(str(checkpoint_dir))

    megatron_load_common = common.load_common

    def load_common(checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), common.COMMON_STATE_FNAME)
        if not os.path.isfile(path):
            return megatron_load_common(checkpoint_dir)  # its error, naming what is there
        return read_common(path)

    verify_checkpoint._mcore_ext = load_common._mcore_ext = True
    serialization.verify_checkpoint = verify_checkpoint
    common.load_common = load_common
    if hasattr(serialization, "load_common"):
        serialization.load_common = load_common
