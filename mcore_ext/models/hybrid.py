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

MTP (``mtp_num_layers``) is megatron's hybrid MTP: one ``/*-`` per depth after the main pattern
(``*-*E/*-/*-``), each depth's layer a small ``HybridStack`` of an attention and a dense MLP layer
(``mtp.layers.<k>.mtp_model_layer.layers.0`` / ``.1``) around megatron's enorm / hnorm / eh_proj.
Depth k's two layers are built as global layer ``num_layers + k + 1`` (its kind, its clamp), as
the GPT depth's one layer is (mcore_ext/mtp_layers.py). Step-3.5's depths (``mtp_step35_heads``)
take the decoder's output before its final norm and each has its own head; HybridModel's forward
feeds the MTP block the normed output and hands its loss the one output layer, so
``_mtp_model_class`` adapts both around megatron's forward (see there).
"""

import dataclasses
import functools
import inspect
import re
from typing import Optional

import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from mcore_ext import _mcore_compat
from mcore_ext.attention import layout as attention_layout
from mcore_ext.checkpoint.safe_pickle import guard_extra_states
from mcore_ext.config import GatedTransformerConfig
from mcore_ext.layer_kinds import KindTransformerLayer
from mcore_ext.models.gpt import BUILT_GPT_SETTINGS, stage_ends
from mcore_ext.models.vision_language import with_vision
from mcore_ext.moe import is_moe_layer
from mcore_ext.specs import (
    _final_norm,
    get_gpt_layer_spec,
    get_gpt_mtp_block_spec,
    resolve_backend,
)
from mcore_ext.vision.config import VisionConfig

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
# One MTP depth: a GPT layer, dense (Step-3.5's MTP layers are dense, also in a MoE model).
MTP_DEPTH = ATTENTION + MLP


def gpt_hybrid_pattern(config) -> str:
    """The hybrid pattern of ``config``'s GPT layers: ``*E`` for a MoE layer, else ``*-``; then
    ``/*-`` per MTP depth (``mtp_num_layers``)."""
    return "".join(ATTENTION + (MOE if is_moe_layer(config, number) else MLP)
                   for number in range(1, config.num_layers + 1)) + (
        (MTP + MTP_DEPTH) * (getattr(config, "mtp_num_layers", None) or 0))


def check_hybrid_pattern(pattern: str, config) -> None:
    """Raise ValueError naming ``hybrid_layer_pattern`` when mcore_ext cannot build it for
    ``config``: a symbol other than ``* - E |``, another count of attention layers than
    ``num_layers`` (each ``*`` stands for one GPT layer, in order), an MLP symbol (``-`` /
    ``E``) other than its GPT layer's (``is_moe_layer``: ``num_moe_experts``,
    ``moe_layer_freq``), or MTP depths other than ``mtp_num_layers`` times ``/*-`` (each depth
    one dense GPT layer, as Step-3.5's)."""
    main, *depths = pattern.split(MTP)
    mtp_num_layers = getattr(config, "mtp_num_layers", None) or 0
    if len(depths) != mtp_num_layers or any(depth != MTP_DEPTH for depth in depths):
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r} has {len(depths)} MTP depths ('/'), "
            f"mtp_num_layers is {mtp_num_layers}: each depth is '/{MTP_DEPTH}' (one dense GPT "
            "layer, the MTP layer mcore_ext builds)")
    unknown = sorted(set(main) - set(BUILT_SYMBOLS))
    if unknown:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r}: symbol {unknown[0]!r} is not one of "
            f"{' '.join(BUILT_SYMBOLS)} (attention, dense MLP, MoE, pipeline stage)")
    attention = main.count(ATTENTION)
    if attention != config.num_layers:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r} has {attention} attention layers ('*'), "
            f"num_layers is {config.num_layers}")
    for number, symbol in enumerate(main.replace(PIPE, ""), start=1):
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


def gpt_stage_layer_counts(config) -> Optional[list[int]]:
    """The GPT layers of each pipeline stage (rank 0 first) when ``config`` splits them itself:
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` or
    ``pipeline_model_parallel_layout``, which count GPT layers; None for megatron's even split
    (the same whether it splits GPT layers or their ``*-`` pairs). Not with virtual stages."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    layout = config.pipeline_model_parallel_layout
    if (first is None and last is None and layout is None) or (
            config.virtual_pipeline_model_parallel_size is not None):
        return None
    pp = config.pipeline_model_parallel_size
    if layout is not None:  # megatron's count of a layout is this rank's only
        return [layout.layout[rank][0].count(LayerType.decoder) for rank in range(pp)]
    return [get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)]


def staged_pattern(pattern: str, config) -> str:
    """``pattern`` with ``|`` where ``config`` ends its GPT pipeline stages
    (``gpt_stage_layer_counts``): each stage starts at its first GPT layer's attention. A
    pattern with its own ``|`` is kept if each stage holds as many attention layers as the GPT
    split, else refused (ValueError naming both); unchanged without such a split."""
    counts = gpt_stage_layer_counts(config)
    if counts is None:
        return pattern
    main, mtp, depths = pattern.partition(MTP)
    if PIPE in main:
        given = [stage.count(ATTENTION) for stage in main.split(PIPE)]
        if given != counts:
            split = ("pipeline_model_parallel_layout"
                     if config.pipeline_model_parallel_layout is not None else
                     f"num_layers_in_first_pipeline_stage "
                     f"{config.num_layers_in_first_pipeline_stage}, "
                     f"num_layers_in_last_pipeline_stage {config.num_layers_in_last_pipeline_stage}")
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r} puts {given} attention layers ('*') on its "
                f"pipeline stages, the config's GPT layers per stage are {counts} ({split}): "
                "give each stage that many '*', or leave the '|' out")
        return pattern
    # The GPT layers before each stage but the first; a stage starts at its first attention.
    bounds = [sum(counts[:stage]) for stage in range(1, len(counts))]
    staged, attention = "", 0
    for symbol in main:
        if symbol == ATTENTION:
            staged += PIPE * bounds.count(attention)
            attention += 1
        staged += symbol
    staged += PIPE * bounds.count(attention)  # stages after the last layer hold none
    return staged + mtp + depths


def _config_in_hybrid_layers(config, pattern: str):
    """``config`` as megatron's HybridModel reads it: the config counts GPT layers, HybridModel
    hybrid ones. The first / last pipeline stage counts go (``pattern``'s ``|`` holds them,
    ``staged_pattern``; megatron refuses both at once), and full recompute's
    ``recompute_num_layers`` counts the hybrid layers of as many GPT layers (2 a GPT layer:
    uniform recomputes each ``*-`` pair as one, block the first N pairs, as GPTModel does)."""
    changes = {}
    if PIPE in pattern and (config.num_layers_in_first_pipeline_stage is not None
                            or config.num_layers_in_last_pipeline_stage is not None):
        changes.update(num_layers_in_first_pipeline_stage=None,
                       num_layers_in_last_pipeline_stage=None)
    if config.recompute_granularity == "full" and config.recompute_num_layers:
        layers = len(pattern.split(MTP)[0].replace(PIPE, ""))
        changes["recompute_num_layers"] = (
            config.recompute_num_layers * layers // config.num_layers)
    return dataclasses.replace(config, **changes) if changes else config


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
    holds ``num_layers`` entries). ``gpt_number`` gives the GPT layer instead (an MTP depth's
    layers: global layer ``num_layers + k + 1``, see ``_depth_submodules``)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, pattern: str,
                 gpt_number: Optional[int] = None, **kwargs):
        number = gpt_layer_number(pattern, layer_number) if gpt_number is None else gpt_number
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


def _depth_submodules(hybrid_submodules, number: int):
    """``hybrid_submodules`` (the main stack's) whose layers are built as GPT layer ``number``."""
    layers = {}
    for field in ("attention_layer", "mlp_layer", "moe_layer"):
        spec = getattr(hybrid_submodules, field)
        if isinstance(spec, ModuleSpec) and spec.module is HybridKindLayer:
            layers[field] = dataclasses.replace(spec, params={**spec.params, "gpt_number": number})
    return dataclasses.replace(hybrid_submodules, **layers)


@functools.cache
def _depth_layer_class(base):
    """``base`` (megatron's MTP layer or Step-3.5's) whose inner hybrid layers are global layer
    ``num_layers + k + 1`` of MTP depth k: megatron's block builds every depth from the main
    stack's ``hybrid_submodules``, whose layers would take GPT layer 1's kind."""

    class HybridDepth(base):
        def __init__(self, config, submodules, layer_number: int = 1, *args,
                     hybrid_submodules=None, **kwargs):
            if hybrid_submodules is not None:
                hybrid_submodules = _depth_submodules(hybrid_submodules,
                                                      config.num_layers + layer_number)
            super().__init__(config, submodules, layer_number, *args,
                             hybrid_submodules=hybrid_submodules, **kwargs)

    HybridDepth.__name__ = HybridDepth.__qualname__ = f"Hybrid{base.__name__}"
    return HybridDepth


def get_hybrid_mtp_block_spec(config, backend, vocab_size: Optional[int]):
    """The MTP block spec of ``config`` on HybridModel (None without ``mtp_num_layers``): the GPT
    depth spec's enorm / hnorm / eh_proj / final norm (and Step-3.5's head), its layer left to
    megatron's hybrid path (the pattern's ``/*-``)."""
    spec = get_gpt_mtp_block_spec(config, backend, vocab_size)
    if spec is None:
        return None
    if config.mtp_use_repeated_layer:
        raise ValueError("mtp_use_repeated_layer=True (one MTP layer for every depth) is not "
                         "built on HybridModel: each depth is its own global layer")
    layer_specs = [dataclasses.replace(
        layer, module=_depth_layer_class(layer.module),
        submodules=dataclasses.replace(layer.submodules,
                                       **{_mcore_compat.MTP_INNER_LAYER_FIELD: None}))
        for layer in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layer_specs)


def get_hybrid_stack_spec(config: GatedTransformerConfig, backend: str = "auto",
                          pattern: Optional[str] = None,
                          vocab_size: Optional[int] = None) -> ModuleSpec:
    """The ``hybrid_stack_spec`` for ``HybridModel``: attention (``*``), dense MLP (``-``) and
    MoE (``E``) layers cut from ``get_gpt_layer_spec``'s layer on ``backend``, each a
    ``HybridKindLayer`` of ``pattern`` (default ``gpt_hybrid_pattern(config)``), and with
    ``mtp_num_layers`` the MTP depths' spec (``vocab_size`` sizes Step-3.5's heads)."""
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
    submodules.mtp_block_spec = get_hybrid_mtp_block_spec(config, backend, vocab_size)
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
    vision: Optional[VisionConfig] = None,
):
    """This rank's megatron ``HybridModel`` for ``config`` on ``backend``, the arguments as
    ``build_gpt_model``'s; ``hybrid_layer_pattern`` defaults to the GPT layers' (``*-`` / ``*E``
    per layer; megatron splits it evenly over pipeline stages, whole GPT layers as GPTModel
    does), and may set ``|`` pipeline stages. A config that splits its GPT layers unevenly
    (``num_layers_in_first_pipeline_stage`` / ``..._last_...``,
    ``pipeline_model_parallel_layout``) puts the same GPT layers on each stage
    (``staged_pattern``: ``|`` at its stage ends; a pattern's own ``|`` must agree), and full
    recompute's ``recompute_num_layers`` counts GPT layers as on GPTModel: the model's config
    is then a copy with megatron's hybrid counts (``_config_in_hybrid_layers``).

    RoPE comes from the config (the full layers'; a kind with others computes its own), every
    layer is built with its GPT layer's kind config, and the output matches ``build_gpt_model``'s
    for the same weights. With ``mtp_num_layers`` the pattern ends in ``/*-`` per depth and the
    MTP depths (Step-3.5's with ``mtp_step35_heads``) are ``build_gpt_model``'s, on the last
    pipeline stage (``mtp_logits`` reads their logits). ``vision``: Step-3.7's vision tower and
    projector on the first stage, as ``build_gpt_model``'s.
    """
    _mcore_compat.check_hybrid_model()

    pattern = gpt_hybrid_pattern(config) if hybrid_layer_pattern is None else hybrid_layer_pattern
    pattern = staged_pattern(pattern, config)
    config = _config_in_hybrid_layers(config, pattern)
    if config.mtp_num_layers:
        _mcore_compat.check_mtp_supported(getattr(config, "mtp_step35_heads", False))
    pre_process, post_process = stage_ends(pre_process, post_process, vp_stage)
    model_class, extra = _mtp_model_class(), {}
    if vision is not None:
        model_class, extra = with_vision(model_class), {"vision": vision}
    model = model_class(
        config,
        hybrid_stack_spec=get_hybrid_stack_spec(config, backend, pattern, vocab_size),
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
        **extra,
    )
    # A Transformer Engine extra state in a state dict loaded into it is read restricted first.
    guard_extra_states(model)
    # The attention layout of each batch is made here, once per forward, for every layer.
    return attention_layout.install_on(model)


@functools.cache
def _mtp_model_class():
    """megatron's ``HybridModel`` whose MTP depths follow ``config.mtp_step35_heads``.

    megatron's MTP (DeepSeek-V3's): HybridModel unchanged. Step-3.5's (mcore_ext/mtp_layers.py)
    differs in what HybridModel's ``forward`` hard-codes: it feeds the MTP block the decoder's
    output after ``decoder.final_norm`` and hands ``process_mtp_loss`` its one ``output_layer``
    for every depth. Rather than copy that forward, this model keeps megatron's and adapts both
    for its duration, as ``MTPGPTModel`` does around GPTModel's ``_postprocess``: a pre-hook on
    the final norm keeps its input, a pre-hook on ``self.mtp`` passes it on instead, and a hook
    puts the normed output back in the block's output (its first chunk, the main logits'); the
    output layer's first ``mtp_num_layers`` calls (``process_mtp_loss``, one per depth, in
    order) go to depth k's own head, the next one (the main logits) to the output layer itself.
    The checkpoint keys stay megatron's.
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mcore_ext.models import mtp_model

    class MTPHybridModel(HybridModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pre_norm_hidden = None  # [s, b, h], set by the final norm's pre-hook
            self._post_norm_hidden = None  # [s, b, h], the final norm's output, while MTP runs
            self._mtp_logits_sink = None  # a list while mtp_logits runs
            self._decoder_packed_seq_params = None  # the decoder's, while MTP gets padded ones
            self._step35 = bool(self.mtp_process and self.config.mtp_step35_heads)
            if self.mtp_process and self.post_process:
                self.decoder.register_forward_pre_hook(self._own_documents_into_decoder,
                                                       with_kwargs=True)
            if self._step35:
                final_norm = getattr(self.decoder, "final_norm", None)
                if not self.post_process or final_norm is None:
                    raise ValueError(
                        "mtp_step35_heads=True needs the MTP layers on the stage with the final "
                        "norm and the output layer (the last pipeline stage)")
                final_norm.register_forward_pre_hook(self._keep_pre_norm_hidden)
                self.mtp.register_forward_pre_hook(self._pre_norm_into_mtp, with_kwargs=True)
                self.mtp.register_forward_hook(self._post_norm_out_of_mtp)

        def _keep_pre_norm_hidden(self, module, args):
            self._pre_norm_hidden = args[0]

        def _own_documents_into_decoder(self, module, args, kwargs):
            if self._decoder_packed_seq_params is not None:
                kwargs["packed_seq_params"] = self._decoder_packed_seq_params
                self._decoder_packed_seq_params = None
            return args, kwargs

        def _pre_norm_into_mtp(self, module, args, kwargs):
            # The post-norm output stays the main head's: the block returns its input first.
            self._post_norm_hidden = kwargs["hidden_states"]
            kwargs["hidden_states"], self._pre_norm_hidden = self._pre_norm_hidden, None
            return args, kwargs

        def _post_norm_out_of_mtp(self, module, args, output):
            depths = output.chunk(1 + self.config.mtp_num_layers, dim=0)[1:]
            post_norm, self._post_norm_hidden = self._post_norm_hidden, None
            return torch.cat([post_norm, *depths], dim=0)

        def forward(self, *args, **kwargs):
            # Set below for this forward only: one that failed before its decoder left its own.
            self._decoder_packed_seq_params = None
            if not (self.mtp_process and self.post_process) or self._in_inference(kwargs):
                return super().forward(*args, **kwargs)
            bound = inspect.signature(super().forward).bind(*args, **kwargs).arguments
            params = bound.get("packed_seq_params")
            if params is not None and params.cu_seqlens_q_padded is not None:
                # MTP rolls its labels within the padded documents, as on GPTModel
                # (mtp_model._padded_documents), and HybridModel's forward hands one packed
                # params to the decoder, the MTP block and the loss: the padded ones go in, the
                # decoder gets its own back (_own_documents_into_decoder).
                kwargs["packed_seq_params"] = mtp_model._padded_documents(params)
                self._decoder_packed_seq_params = params
            sink = self._mtp_logits_sink
            if (not (self._step35 or sink is not None)
                    or (bound.get("labels") is None and bound.get("input_ids") is None)):
                return super().forward(*args, **kwargs)  # no head of a depth to route
            heads = [layer.compute_logits for layer in self.mtp.layers] if self._step35 else None
            output_layer = self.output_layer
            routed = _DepthThenMainHead(self.config.mtp_num_layers, heads, output_layer.forward,
                                        sink, self._scale_logits)
            output_layer.forward = routed
            try:
                output = super().forward(*args, **kwargs)
            finally:
                del output_layer.forward  # the class's forward again
            routed.check_done()
            return output

        def compute_mtp_single_step(self, *args, **kwargs):
            """megatron's speculative-decoding MTP step, for megatron's MTP only."""
            if self._step35:
                mtp_model.MTPGPTModel._refuse_speculative_decoding(self)
            return super().compute_mtp_single_step(*args, **kwargs)

        _in_inference = mtp_model.MTPGPTModel._in_inference

    return MTPHybridModel


class _DepthThenMainHead:
    """The output layer's ``forward`` during one MTP forward of ``MTPHybridModel``: calls 1 to
    ``depths`` (``process_mtp_loss``, depth by depth) go to the depths' ``heads`` (None: the
    shared ``main``, megatron's MTP) and their logits, [b, s, v / TP] after ``scale``, to
    ``sink`` when one is given; the next call (the main logits) goes to ``main``."""

    def __init__(self, depths: int, heads, main, sink, scale):
        self._depths, self._heads, self._main = depths, heads, main
        self._sink, self._scale = sink, scale
        self._calls = 0

    def __call__(self, hidden_states, weight=None, runtime_gather_output=None):
        depth, self._calls = self._calls, self._calls + 1
        if depth >= self._depths or self._heads is None:
            logits, bias = self._main(hidden_states, weight=weight,
                                      runtime_gather_output=runtime_gather_output)
        else:
            logits, bias = self._heads[depth](hidden_states,
                                              runtime_gather_output=runtime_gather_output)
        if depth < self._depths and self._sink is not None:
            self._sink.append(self._scale(logits).transpose(0, 1).contiguous())
        return logits, bias

    def check_done(self) -> None:
        """Each depth's head and then the main head ran once."""
        if self._calls != self._depths + 1:
            raise RuntimeError(
                f"HybridModel's forward called the output layer {self._calls} times for "
                f"{self._depths} MTP depths and the main logits: megatron-core "
                f"{_mcore_compat.megatron_core_version()} computes MTP losses differently from "
                "what mcore_ext expects")


_GPT_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_GPT_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.)(?:mtp_model_layer|transformer_layer)\.(.*)")


def hybrid_parameter_name(gpt_name: str) -> str:
    """The name in a HybridModel of the derived pattern (``*-`` / ``*E`` per GPT layer, ``/*-``
    per MTP depth) of a GPTModel state-dict entry (one stage's local names): GPT layer i's input
    norm and attention are hybrid layer 2i, the rest of it (pre-MLP norm, MLP or MoE) 2i + 1;
    ``decoder.final_layernorm`` is ``decoder.final_norm``; MTP depth k's layer
    (``mtp.layers.<k>.mtp_model_layer``) is the depth's two hybrid layers 0 and 1."""
    match = _GPT_LAYER.fullmatch(gpt_name)
    depth = _GPT_MTP_LAYER.fullmatch(gpt_name)
    if match is None and depth is None:
        return gpt_name.replace("decoder.final_layernorm.", "decoder.final_norm.")
    rest = (match or depth)[2]
    half = 0 if rest.startswith(("input_layernorm.", "self_attention.")) else 1
    if depth is not None:
        return f"{depth[1]}mtp_model_layer.layers.{half}.{rest}"
    return f"decoder.layers.{2 * int(match[1]) + half}.{rest}"


_HYBRID_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_HYBRID_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.mtp_model_layer\.)layers\.[01]\.(.*)")


def gpt_parameter_name(hybrid_name: str) -> str:
    """The GPTModel name of a HybridModel state-dict entry of the derived pattern (one stage's
    local names): ``hybrid_parameter_name``'s inverse. Hybrid layer j of a stage (which starts at
    an attention layer, ``staged_pattern``) is half of the stage's GPT layer j // 2; the caller
    checks ``hybrid_parameter_name`` gives the name back (a layer on the wrong half does not)."""
    depth = _HYBRID_MTP_LAYER.fullmatch(hybrid_name)
    if depth is not None:
        return f"{depth[1]}{depth[2]}"
    match = _HYBRID_LAYER.fullmatch(hybrid_name)
    if match is not None:
        return f"decoder.layers.{int(match[1]) // 2}.{match[2]}"
    return hybrid_name.replace("decoder.final_norm.", "decoder.final_layernorm.")


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
