"""``build_hybrid_model``: megatron's HybridModel with mcore_ext's layers and the config's RoPE.

megatron-core 0.19 deprecates GPTModel for ``HybridModel`` (``megatron/core/models/hybrid/``),
whose stack is one layer per symbol of a pattern: ``*`` attention, ``-`` dense MLP, ``E`` MoE
(``|`` pipeline stages, ``/`` MTP depths). A GPT layer is two hybrid layers, ``*-`` or ``*E``.

Every symbol's layer is the GPT layer spec's (``get_gpt_layer_spec``: the gated attention, the
backend's core attention, linears and norms, Step's MoE) with the other half left out, built as a
``HybridKindLayer``: a ``KindTransformerLayer`` of the GPT layer it stands for, whose number is
the count of attention symbols up to it. Full / sliding kinds (heads, window, RoPE), SwiGLU
clamps and MoE layers therefore follow the GPT config's per-layer fields unchanged, while each
layer keeps its hybrid number (megatron's checkpoint keys: GPT layer g's attention is hybrid
layer 2g - 1, its MLP 2g, as in megatron's GPT -> hybrid translation).
"""

import dataclasses
import functools
import re
from typing import Optional

import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from mcore_ext import _mcore_compat
from mcore_ext.attention import layout as attention_layout
from mcore_ext.config import GatedTransformerConfig
from mcore_ext.layer_kinds import KindTransformerLayer
from mcore_ext.models.gpt import BUILT_GPT_SETTINGS, stage_ends
from mcore_ext.moe import is_moe_layer
from mcore_ext.specs import _final_norm, get_gpt_layer_spec, resolve_backend

ATTENTION, MLP, MOE, PIPE, MTP = "*", "-", "E", "|", "/"
# The symbols mcore_ext builds; megatron's others (Mamba, GDN, DSA, MLA) are refused by name.
BUILT_SYMBOLS = (ATTENTION, MLP, MOE, PIPE)
# The BUILT_GPT_SETTINGS a hybrid model config (megatron.training's HybridModelConfig, Bridge's
# HybridModelProvider) carries: it has no rope_scaling, and HybridModel always scatters the
# embedding under sequence parallelism.
BUILT_HYBRID_SETTINGS = {
    name: value for name, value in BUILT_GPT_SETTINGS.items()
    if name in ("position_embedding_type", "seq_len_interpolation_factor",
                "fp16_lm_cross_entropy", "parallel_output")
}


def gpt_hybrid_pattern(config) -> str:
    """The hybrid pattern of ``config``'s GPT layers: ``*E`` for a MoE layer, else ``*-``."""
    return "".join(ATTENTION + (MOE if is_moe_layer(config, number) else MLP)
                   for number in range(1, config.num_layers + 1))


def check_hybrid_pattern(pattern: str, config) -> None:
    """Raise ValueError naming ``hybrid_layer_pattern`` when mcore_ext cannot build it for
    ``config``: a symbol other than ``* - E |``, MTP depths, another count of attention
    layers than ``num_layers`` (each ``*`` stands for one GPT layer, in order), or an MLP symbol
    (``-`` / ``E``) other than its GPT layer's (``is_moe_layer``: ``num_moe_experts``,
    ``moe_layer_freq``)."""
    if MTP in pattern:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r}: MTP depths ('/') are not built on HybridModel "
            "yet (docs/known-gaps.md); use architecture gpt for MTP")
    unknown = sorted(set(pattern) - set(BUILT_SYMBOLS))
    if unknown:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r}: symbol {unknown[0]!r} is not one of "
            f"{' '.join(BUILT_SYMBOLS)} (attention, dense MLP, MoE, pipeline stage)")
    attention = pattern.count(ATTENTION)
    if attention != config.num_layers:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r} has {attention} attention layers ('*'), "
            f"num_layers is {config.num_layers}")
    for number, symbol in enumerate(pattern.replace(PIPE, ""), start=1):
        if symbol not in (MLP, MOE):
            continue
        gpt_number = gpt_layer_number(pattern, number)
        moe = is_moe_layer(config, gpt_number)
        if (symbol == MOE) != moe:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r}: hybrid layer {number} is {symbol!r} "
                f"({'MoE' if symbol == MOE else 'dense MLP'}), the MLP of GPT layer "
                f"{gpt_number}, which the config makes {'MoE' if moe else 'dense'} "
                f"(num_moe_experts {getattr(config, 'num_moe_experts', None)}, moe_layer_freq "
                f"{getattr(config, 'moe_layer_freq', 1)}): give its MLP as "
                f"{MOE if moe else MLP!r}")


def gpt_layer_number(pattern: str, hybrid_number: int) -> int:
    """The GPT layer (1-based) hybrid layer ``hybrid_number`` (1-based, ``|`` not counted) of
    ``pattern`` stands for: the attention layers up to it; an MLP before any attention belongs
    to layer 1."""
    layers = pattern.split(MTP)[0].replace(PIPE, "")
    return max(1, layers[:hybrid_number].count(ATTENTION))


class HybridKindLayer(KindTransformerLayer):
    """A hybrid stack's layer (attention, dense MLP or MoE) built as the GPT layer it stands for:
    that layer's kind config, RoPE and clamps (``KindTransformerLayer``), its own hybrid
    ``layer_number``. A MoE layer's router counts its GPT layer (megatron's aux-loss tracker
    holds ``num_layers`` entries)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, pattern: str,
                 **kwargs):
        number = gpt_layer_number(pattern, layer_number)
        self.gpt_layer_number = number
        has_mlp = submodules.mlp is not IdentityOp  # the clamps are the MLP's
        super().__init__(
            config, submodules, layer_number, *args,
            layer_config=config.get_config_for_layer(number),
            model_rotary=(config.rotary_base, config.rotary_percent),
            swiglu_limit=config.swiglu_limit(number) if has_mlp else None,
            moe_expert_swiglu_limit=config.moe_expert_swiglu_limit(number) if has_mlp else None,
            **kwargs)
        if hasattr(self.mlp, "set_layer_number"):
            self.mlp.set_layer_number(number)


def _stack_class():
    """``HybridStack`` with the backend's final norm (megatron's always builds Transformer
    Engine's, which needs TE)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class GatedHybridStack(HybridStack):
        """megatron's ``HybridStack`` whose final norm is ``final_norm`` (a norm class)."""

        def __init__(self, config, submodules, *args, final_norm=None,
                     post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = build_module(final_norm, config=config,
                                               hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)

    return GatedHybridStack


def get_hybrid_stack_spec(config: GatedTransformerConfig, backend: str = "auto",
                          pattern: Optional[str] = None) -> ModuleSpec:
    """The ``hybrid_stack_spec`` for ``HybridModel``: attention (``*``), dense MLP (``-``) and
    MoE (``E``) layers cut from ``get_gpt_layer_spec``'s layer on ``backend``, each a
    ``HybridKindLayer`` of ``pattern`` (default ``gpt_hybrid_pattern(config)``)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules

    backend = resolve_backend(backend)
    pattern = gpt_hybrid_pattern(config) if pattern is None else pattern
    check_hybrid_pattern(pattern, config)
    dense = get_gpt_layer_spec(config, backend, moe=False).submodules
    attention = dataclasses.replace(dense, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp,
                                    mlp_bda=IdentityFuncOp)

    def mlp_half(layer):
        return dataclasses.replace(layer, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                   self_attn_bda=IdentityFuncOp)

    layer = functools.partial(ModuleSpec, module=HybridKindLayer, params={"pattern": pattern})
    submodules = HybridStackSubmodules(attention_layer=layer(submodules=attention),
                                       mlp_layer=layer(submodules=mlp_half(dense)))
    if MOE in pattern:
        moe = get_gpt_layer_spec(config, backend, moe=True).submodules
        submodules.moe_layer = layer(submodules=mlp_half(moe))
    return ModuleSpec(module=_stack_class(), submodules=submodules,
                      params={"final_norm": _final_norm(backend)})


def build_hybrid_model(
    config: GatedTransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "auto",
    share_embeddings_and_output_weights: bool = False,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    hybrid_layer_pattern: Optional[str] = None,
):
    """This rank's megatron ``HybridModel`` for ``config`` on ``backend``, the arguments as
    ``build_gpt_model``'s; ``hybrid_layer_pattern`` defaults to the GPT layers' (``*-`` / ``*E``
    per layer; megatron splits it evenly over pipeline stages, whole GPT layers as GPTModel
    does), and may set ``|`` pipeline stages.

    RoPE comes from the config (the full layers'; a kind with others computes its own), every
    layer is built with its GPT layer's kind config, and the output matches ``build_gpt_model``'s
    for the same weights. MTP (``mtp_num_layers``) is refused: not built on HybridModel yet.
    """
    _mcore_compat.check_hybrid_model()
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if config.mtp_num_layers:
        raise ValueError(f"mtp_num_layers={config.mtp_num_layers}: MTP is not built on "
                         "HybridModel yet (docs/known-gaps.md); use architecture gpt")
    pattern = gpt_hybrid_pattern(config) if hybrid_layer_pattern is None else hybrid_layer_pattern
    pre_process, post_process = stage_ends(pre_process, post_process, vp_stage)
    model = HybridModel(
        config,
        hybrid_stack_spec=get_hybrid_stack_spec(config, backend, pattern),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=config.rotary_percent,
        rotary_base=config.rotary_base,
        vp_stage=vp_stage,
    )
    # The attention layout of each batch is made here, once per forward, for every layer.
    return attention_layout.install_on(model)


_GPT_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def hybrid_parameter_name(gpt_name: str) -> str:
    """The name in a HybridModel of the derived pattern (``*-`` / ``*E`` per GPT layer) of a
    GPTModel state-dict entry (one stage's local names): GPT layer i's input norm and attention
    are hybrid layer 2i, the rest of it (pre-MLP norm, MLP or MoE) 2i + 1;
    ``decoder.final_layernorm`` is ``decoder.final_norm``."""
    match = _GPT_LAYER.fullmatch(gpt_name)
    if match is None:
        return gpt_name.replace("decoder.final_layernorm.", "decoder.final_norm.")
    layer, rest = int(match[1]), match[2]
    attention = rest.startswith(("input_layernorm.", "self_attention."))
    return f"decoder.layers.{2 * layer + (0 if attention else 1)}.{rest}"


@torch.no_grad()
def copy_weights(source, target, *, to_hybrid: bool) -> None:
    """Copy every weight of ``source`` into ``target``, a GPTModel and the HybridModel of the
    same config and layout (``to_hybrid``: GPT -> hybrid, else hybrid -> GPT), strictly: each
    entry has its place (``hybrid_parameter_name``). ``target`` takes ``source``'s dtypes (the
    router's expert bias stays fp32)."""
    gpt = source if to_hybrid else target
    rename = {name: hybrid_parameter_name(name) for name in gpt.state_dict()}
    if not to_hybrid:
        rename = {hybrid: name for name, hybrid in rename.items()}
    mapped = {rename.get(name, name): value for name, value in source.state_dict().items()}
    for name, tensor in [*target.named_parameters(), *target.named_buffers()]:
        if name in mapped and torch.is_tensor(mapped[name]):
            tensor.data = tensor.data.to(mapped[name].dtype)
    target.load_state_dict(mapped, strict=True)
