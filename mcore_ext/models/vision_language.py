"""Step-3.7-Flash as a vision-language model: a language model class (GPTModel, MTPGPTModel,
HybridModel) with the vision tower and projector in front of its embedding.

``with_vision(model_class)`` is that class plus ``VisionLanguageModel``'s parts: on the stage with
the embedding (the first pipeline stage) it builds

- ``vision_model``: the tower (``mcore_ext.vision.tower.Step37VisionTower``, megatron transformer
  layers split over TP like the text model's);
- ``vision_projection``: megatron's ``MultimodalProjector`` (affine: 4 C -> the text hidden size,
  one column-parallel linear, gathered);

and its ``forward`` takes the micro-batch's images beside the tokens (transformers' names):
``pixel_values`` [images, 3, H, W] (global views, in the order of their placeholders),
``pixel_values_local`` [crops, 3, h, w] and ``num_local_patches`` [images] (crops per image).
It embeds the tokens as the text model does (megatron's embedding: under SP already scattered),
computes transformers' ``get_image_features`` (per image its crops' features, then its global
view's), writes them at the ``image_token_id`` placeholders (``mcore_ext.vision.placement``: CP
and SP split them as the tokens) and hands the result to the language model as
``decoder_input``. Everything after the embedding is the language model's, unchanged: TP, SP,
PP, CP, EP, MTP (whose depths embed their shifted tokens themselves, the placeholders' rows as
the placeholder token: megatron's MTP).

Under PP the tower sits on the first stage only (the other stages get no images); under CP every
rank of a sequence runs the tower on all of its micro-batch's images and keeps the features of
its own chunks; under EP nothing changes (the tower is dense). ``VisionConfig.freeze`` freezes
the tower (no gradients, run without saving activations); the projector trains either way.

The text model's parameters and checkpoint keys are the language model's own; the tower's are
``vision_model.*`` (``conv1``, ``position_embeddings``, ``ln_pre``, ``decoder.layers.<i>.*``,
``downsampler1`` / ``2``) and the projector's ``vision_projection.encoder.weight`` (megatron's
LLaVA names), TP-sharded where megatron shards them.
"""

import contextlib
import functools

import torch
from megatron.core import parallel_state
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules

from mcore_ext.vision import placement
from mcore_ext.vision.config import (
    VisionConfig,
    projector_transformer_config,
    tower_transformer_config,
)
from mcore_ext.vision.tower import Step37VisionTower


class VisionLanguageModel:
    """The vision parts of ``with_vision(model_class)``; see the module docstring."""

    def __init__(self, config, *args, vision: VisionConfig, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.vision = vision
        if not self.pre_process:
            return
        tower_config = tower_transformer_config(vision, config)
        pg = getattr(self, "pg_collection", None)
        self.vision_model = Step37VisionTower(tower_config, vision, pg_collection=pg)
        self.vision_projection = MultimodalProjector(
            projector_transformer_config(tower_config, config, vision),
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=None),
            projector_type="affine",
            input_size=vision.output_size, tp_group=self.vision_model.tp_group)
        self.vision_model.requires_grad_(not vision.freeze)

    # ------------------------------------------------------------------------------ images

    def image_features(self, pixel_values, pixel_values_local=None, num_local_patches=None):
        """[n, h] features of a micro-batch's images in transformers' order (``Step3p7Model.
        get_image_features``): per image, its local crops' then its global view's."""
        frozen = not any(p.requires_grad for p in self.vision_model.parameters())
        with torch.no_grad() if frozen else contextlib.nullcontext():
            views = self.vision_model(pixel_values)  # [images, t_g, 4C]
            crops = (self.vision_model(pixel_values_local)
                     if pixel_values_local is not None and pixel_values_local.numel() else None)
        global_features = self.vision_projection(views)  # [images, t_g, h]
        local_features = self.vision_projection(crops) if crops is not None else None
        return placement.merge_features(global_features, local_features, num_local_patches)

    def embed_with_images(self, input_ids, position_ids, pixel_values=None,
                          pixel_values_local=None, num_local_patches=None,
                          packed_seq_params=None):
        """The embedding ([s, b, h], [s / TP, b, h] under SP) with the images' features at their
        placeholders; the placeholders and features must match in number
        (``placement.ImageTokenMismatch`` otherwise, on every rank alike)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids)
        cp_group = getattr(getattr(self, "pg_collection", None), "cp", None)
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        order, total = placement.placeholder_order(
            input_ids, self.vision.image_token_id, packed_seq_params, cp_group)
        if pixel_values is None:
            placement.check_count(total, 0, self.vision.image_token_id)
            return embeddings
        features = self.image_features(pixel_values, pixel_values_local, num_local_patches)
        placement.check_count(total, features.size(0), self.vision.image_token_id)
        return placement.write_features(embeddings, order, features,
                                        self.config.sequence_parallel, self.vision_model.tp_group)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                *, packed_seq_params=None, pixel_values=None, pixel_values_local=None,
                num_local_patches=None, **kwargs):
        """The language model's ``forward`` (its keyword arguments pass through) with a
        micro-batch's images (see the module docstring); stages without the embedding ignore
        them."""
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed_with_images(
                input_ids, position_ids, pixel_values, pixel_values_local, num_local_patches,
                packed_seq_params)
        return super().forward(input_ids, position_ids, attention_mask,
                               decoder_input=decoder_input, labels=labels,
                               packed_seq_params=packed_seq_params, **kwargs)


@functools.cache
def with_vision(model_class: type) -> type:
    """``model_class`` (a megatron language model class) with Step-3.7's vision tower and
    projector (``VisionLanguageModel``); built with ``vision=VisionConfig(...)``."""
    return type(f"VisionLanguage{model_class.__name__}", (VisionLanguageModel, model_class),
                {"__doc__": f"{model_class.__name__} with Step-3.7's vision tower: "
                            f"{VisionLanguageModel.__doc__}",
                 "__module__": __name__})
