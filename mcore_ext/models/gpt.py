"""``build_gpt_model``: megatron's GPTModel with mcore_ext's block spec and the config's RoPE."""

import math
from typing import Optional

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from mcore_ext import _mcore_compat
from mcore_ext.attention import layout as attention_layout
from mcore_ext.checkpoint.safe_pickle import guard_extra_states
from mcore_ext.config import GatedTransformerConfig
from mcore_ext.models.mtp_model import MTPGPTModel
from mcore_ext.models.vision_language import with_vision
from mcore_ext.specs import get_gpt_block_spec, get_gpt_mtp_block_spec
from mcore_ext.vision.config import VisionConfig


def build_gpt_model(
    config: GatedTransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "auto",
    share_embeddings_and_output_weights: bool = False,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    vision: Optional[VisionConfig] = None,
) -> GPTModel:
    """This rank's megatron ``GPTModel`` for ``config`` on ``backend`` (see ``get_gpt_block_spec``).

    RoPE comes from the config (``rotary_base``, ``rotary_percent``: the full layers'; a layer
    kind with other values computes its own), every layer is built with its kind's config, and
    parameter names are megatron's. With ``config.mtp_num_layers`` the model is an ``MTPGPTModel``
    with MTP layers on the last pipeline stage (Step-3.5's with ``mtp_step35_heads``, see
    mcore_ext/mtp_layers.py; ``vocab_size`` also sizes their heads). ``pre_process`` /
    ``post_process`` (embedding / output layer on this rank) default to whether this is the
    first / last pipeline stage. Each forward first makes the batch's attention layout
    (``mcore_ext.attention.layout``), shared by every layer. With ``vision`` the model also takes
    images: Step-3.7's vision tower and projector on the first stage
    (``mcore_ext.models.vision_language``).
    """
    pre_process, post_process = stage_ends(pre_process, post_process, vp_stage)
    mtp_block_spec, model_class = None, GPTModel
    if config.mtp_num_layers:
        _mcore_compat.check_mtp_supported(getattr(config, "mtp_step35_heads", False))
        mtp_block_spec = get_gpt_mtp_block_spec(config, backend, vocab_size)
        model_class = MTPGPTModel
    extra = {}
    if vision is not None:
        model_class, extra = with_vision(model_class), {"vision": vision}
    model = model_class(
        config,
        transformer_layer_spec=get_gpt_block_spec(config, backend, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=config.rotary_percent,
        rotary_base=config.rotary_base,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        **extra,
    )
    # A Transformer Engine extra state in a state dict loaded into it is read restricted first.
    guard_extra_states(model)
    # The attention layout of each batch is made here, once per forward, for every layer.
    return attention_layout.install_on(model)


def stage_ends(pre_process: Optional[bool], post_process: Optional[bool],
               vp_stage: Optional[int]) -> tuple[bool, bool]:
    """(pre_process, post_process): each as given, else whether this rank holds the first /
    last pipeline stage (of ``vp_stage``)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return pre_process, post_process


def padded_vocab_size(vocab_size: int, multiple: int, tensor_model_parallel_size: int) -> int:
    """Rows of the embedding / output layer: ``vocab_size`` rounded up to a multiple of
    lcm(``multiple``, TP), the same at every TP size dividing ``multiple`` (as Megatron-LM's
    ``make_vocab_size_divisible_by``). Extra rows are padding."""
    step = math.lcm(multiple, tensor_model_parallel_size)
    return step * math.ceil(vocab_size / step)


# GPTModel settings Megatron-LM's and Megatron-Bridge's configs carry that build_gpt_model
# builds one way only (an adapter onto it refuses any other value rather than ignore it).
BUILT_GPT_SETTINGS = {
    "position_embedding_type": "rope",
    "rope_scaling": False,
    "seq_len_interpolation_factor": None,
    "fp16_lm_cross_entropy": False,
    "parallel_output": True,
    "scatter_embedding_sequence_parallel": True,
}


def refuse_unbuilt_settings(config, built: dict = BUILT_GPT_SETTINGS) -> None:
    """Raise ValueError naming the first of ``built``'s settings ``config`` holds otherwise."""
    for name, value in built.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is not supported by mcore_ext's GPT "
                f"(it builds {name}={value!r})"
            )
