"""GPTModel with MTP of either kind (``config.mtp_step35_heads``), and ``mtp_logits``.

Shapes (megatron notation): s sequence, b batch, h hidden, v padded vocab, D = mtp_num_layers.
"""

import dataclasses

import torch
from megatron.core.models.gpt import GPTModel

from mcore_ext import _mcore_compat


class MTPGPTModel(GPTModel):
    """megatron's ``GPTModel`` whose MTP depths follow ``config.mtp_step35_heads``.

    Step-3.5 (see mcore_ext/mtp_layers.py): the MTP block gets the decoder's output BEFORE its final
    norm (``decoder.final_layernorm``'s input, kept by a forward pre-hook: the checkpoint keys stay
    megatron's), and megatron's MTP loss (``process_mtp_loss``: rolled labels and masks, scaling,
    logging) takes depth k's logits from depth k's own head. megatron's MTP: GPTModel unchanged.
    Both kinds serve ``mtp_logits``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pre_norm_hidden = None  # [s, b, h], set by the hook, taken by _postprocess
        self._mtp_logits_sink = None  # a list while mtp_logits runs
        self._step35 = bool(self.mtp_process and self.config.mtp_step35_heads)
        if self._step35:
            final_norm = getattr(self.decoder, "final_layernorm", None)
            if not self.post_process or final_norm is None:
                raise ValueError(
                    "mtp_step35_heads=True needs the MTP layers on the stage with the final norm "
                    "and the output layer (the last pipeline stage)"
                )
            final_norm.register_forward_pre_hook(self._keep_pre_norm_hidden)

    def _keep_pre_norm_hidden(self, module, args):
        self._pre_norm_hidden = args[0]

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, **kwargs):
        if self._step35 and _speculative_decoding(kwargs.get("inference_context")):
            self._refuse_speculative_decoding()
        if kwargs.get("packed_seq_params") is not None:  # only MTP reads it from here on
            kwargs["packed_seq_params"] = _padded_documents(kwargs["packed_seq_params"])
        pre_norm, self._pre_norm_hidden = self._pre_norm_hidden, None
        sink = self._mtp_logits_sink
        runs_mtp_here = self._step35 or sink is not None
        if (mtp_in_postprocess and not runs_mtp_here and labels is None
                and _mcore_compat.MTP_LOSS_NEEDS_LABELS and not self._in_inference(kwargs)):
            # megatron 0.16's GPTModel computes MTP losses unconditionally and fails without
            # labels: a logits-only forward skips MTP there.
            return self._main_output(hidden_states, None, kwargs.get("runtime_gather_output"))
        if not mtp_in_postprocess or self._in_inference(kwargs) or not runs_mtp_here:
            # megatron's path: no MTP here, inference (Step's MTP is not used for inference),
            # or megatron's own MTP in training.
            if self._step35:
                mtp_in_postprocess = False
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess, **kwargs,
            )
        if kwargs.get("output_processor") is not None:
            raise NotImplementedError("output_processor is not supported with MTP here")
        mtp_hidden = self.mtp(**_mcore_compat.supported_kwargs(
            self.mtp.forward,
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=pre_norm if self._step35 else hidden_states,
            attention_mask=kwargs.get("attention_mask"),
            padding_mask=kwargs.get("padding_mask"),
            inference_params=None,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=kwargs.get("packed_seq_params"),
            sequence_len_offset=kwargs.get("sequence_len_offset"),
            extra_block_kwargs=kwargs.get("extra_block_kwargs"),
            embedding=self.embedding,
        ))
        depth_hidden = mtp_hidden.chunk(1 + self.config.mtp_num_layers, dim=0)[1:]  # D x [s, b, h]
        heads = self._depth_heads()
        runtime_gather_output = kwargs.get("runtime_gather_output")
        if sink is not None:
            for head, hidden in zip(heads, depth_hidden):
                logits, _ = head(hidden, runtime_gather_output=runtime_gather_output)
                sink.append(self._scaled(logits).transpose(0, 1).contiguous())  # [b, s, v/TP]
        else:
            depth_heads = _DepthHeads(heads)
            hidden_states = _mcore_compat.process_mtp_loss(
                hidden_states=torch.cat([hidden_states, *depth_hidden], dim=0),
                labels=labels,
                loss_mask=kwargs.get("loss_mask"),
                output_layer=depth_heads,
                output_weight=None,
                runtime_gather_output=runtime_gather_output,
                is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss,
                config=self.config,
                cp_group=self.pg_collection.cp,
                tp_group=self.tp_group,
                packed_seq_params=kwargs.get("packed_seq_params"),
                scale_logits_fn=self._scale_logits if getattr(self.config, "use_mup", False)
                else None,
                input_ids=input_ids,
            )
            depth_heads.check_done(labels is not None)
        return self._main_output(hidden_states, labels, runtime_gather_output)

    def compute_mtp_single_step(self, *args, **kwargs):
        """megatron's speculative-decoding MTP step (>= 0.19), for megatron's MTP only."""
        if self._step35:
            self._refuse_speculative_decoding()
        return super().compute_mtp_single_step(*args, **kwargs)

    def _refuse_speculative_decoding(self):
        # megatron caches the decoder's post-norm output and runs every depth through the main
        # output layer: Step's depths take the pre-norm output and have their own heads, so the
        # drafts would be worse, silently (lower acceptance).
        raise NotImplementedError(
            "megatron's speculative decoding with MTP (num_speculative_tokens > 0, "
            "compute_mtp_single_step) feeds the depths the decoder's post-norm output and the "
            "main output layer; mtp_step35_heads=True models need the pre-norm output and each "
            "depth's own head: decode without speculative tokens"
        )

    def _main_output(self, hidden_states, labels, runtime_gather_output):
        """GPTModel's training / eval tail: [b, s, v / TP] logits, or [b, s] losses with labels."""
        logits, _ = self.output_layer(
            hidden_states, weight=self._output_weight(), runtime_gather_output=runtime_gather_output
        )
        logits = self._scaled(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
        return self.compute_language_model_loss(labels, logits)

    def _depth_heads(self) -> list:
        """Per depth: hidden [s, b, h] -> (logits [s, b, v / TP], bias)."""
        if self._step35:
            return [layer.compute_logits for layer in self.mtp.layers]
        weight = self._output_weight()

        def shared_head(hidden, runtime_gather_output=None):
            return self.output_layer(hidden, weight=weight,
                                     runtime_gather_output=runtime_gather_output)

        return [shared_head] * self.config.mtp_num_layers

    def _output_weight(self):
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return None

    def _scaled(self, logits):
        # MuP output scaling (0.19's GPTModel._scale_logits; earlier releases have none).
        scale = getattr(self, "_scale_logits", None)
        return scale(logits) if scale is not None else logits

    def _in_inference(self, kwargs) -> bool:
        try:
            from megatron.core.inference.utils import InferenceMode
        except ImportError:  # releases before InferenceMode: an inference context outside training
            return kwargs.get("inference_context") is not None and not self.training
        return InferenceMode.is_active()


def _padded_documents(params):
    """The packed batch as megatron's MTP needs it: documents ending where their padded slots end.

    megatron's MTP shifts the labels, the loss mask and the input ids one token left within each
    document (``roll_tensor``), reading ``cu_seqlens_q`` as the tensor's own slots (under CP
    each rank's, ``cu_seqlens_q`` // CP): with documents padded to 2 x CP
    (``cu_seqlens_q_padded``) those are the padded boundaries. A document's padding has token
    id 0 and no loss, what the shift puts at a document's last token anyway, and causal
    attention never lets a real token see the padding after it, so the MTP depths compute the
    same for every real token.
    """
    if params.cu_seqlens_q_padded is None:
        return params
    return dataclasses.replace(params, cu_seqlens_q=params.cu_seqlens_q_padded,
                               cu_seqlens_kv=params.cu_seqlens_kv_padded)


def _speculative_decoding(inference_context) -> bool:
    """Whether megatron's dynamic-batching inference drafts speculative tokens (its test)."""
    return (inference_context is not None
            and getattr(inference_context, "num_speculative_tokens", 0) > 0
            and inference_context.is_dynamic_batching())


class _DepthHeads:
    """``process_mtp_loss``'s ``output_layer``: megatron calls it once per depth, in depth order,
    and reads its ``gather_output``; call k goes to depth k's head."""

    gather_output = False  # the heads' logits stay vocab-parallel, like GPTModel's output_layer

    def __init__(self, heads: list):
        self._heads, self._calls = heads, 0

    def __call__(self, hidden_states, weight=None, runtime_gather_output=None):
        head = self._heads[self._calls]
        self._calls += 1
        return head(hidden_states, runtime_gather_output=runtime_gather_output)

    def check_done(self, with_labels: bool) -> None:
        """Every depth's head was used (megatron's loss visits each depth once)."""
        if with_labels and self._calls != len(self._heads):
            raise RuntimeError(
                f"megatron's process_mtp_loss called the MTP heads {self._calls} times for "
                f"{len(self._heads)} depths: megatron-core {_mcore_compat.megatron_core_version()} "
                "computes MTP losses differently from what mcore_ext expects"
            )


def mtp_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> list:
    """One ``[b, s, v / TP]`` logits tensor per MTP depth, TP-split like the main logits.

    Depth k's logits at position t predict token t + k + 2 (the main logits predict t + 1). At
    the last k + 1 positions depth k has no real input token (megatron rolls in token 0 there),
    so those logits are not meaningful. ``model`` is a whole model (pipeline size 1) built by
    ``build_gpt_model`` or ``build_hybrid_model`` with ``mtp_num_layers`` (any wrapper with
    ``.module``: DDP, Float16Module); runs its forward once, in its current train / eval mode
    (HybridModel's forward also computes the MTP losses from ``input_ids``, as in RL training).
    """
    gpt = model
    while not hasattr(gpt, "_mtp_logits_sink") and hasattr(gpt, "module"):
        gpt = gpt.module
    if not hasattr(gpt, "_mtp_logits_sink") or not gpt.config.mtp_num_layers:
        raise ValueError(
            f"mtp_logits needs a model built by mcore_ext.build_gpt_model or build_hybrid_model "
            f"with mtp_num_layers, got {type(gpt).__name__}"
        )
    if not (gpt.mtp_process and gpt.pre_process and gpt.post_process):
        raise ValueError(
            "mtp_logits runs the whole model in one forward: build it with pipeline size 1 "
            f"(this rank: pre_process={gpt.pre_process}, post_process={gpt.post_process}, "
            f"MTP layers here: {gpt.mtp_process})"
        )
    sink: list = []
    gpt._mtp_logits_sink = sink
    try:
        model(input_ids, position_ids, None)
    finally:
        gpt._mtp_logits_sink = None
    return sink
