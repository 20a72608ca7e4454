"""``VisionConfig``: Step-3.7-Flash's vision tower and projector as the model builds them, and the
megatron ``TransformerConfig`` of the tower's layers.

The fields are transformers' ``Step3p7VisionConfig`` (and the ``Step3p7Config`` keys that concern
images: ``projector_bias``, ``image_token_id``) under megatron-core's names, plus ``freeze``; the
defaults are the release's (47 layers of width 1536, 16 heads, MLP 8960, patch 14, 728-pixel
global view). ``mcore_ext.hf.config.step3p7.vision_config`` reads them from a config.json; the
launcher's ``model.vision`` section holds them as they are.
"""

import dataclasses
from dataclasses import dataclass

from megatron.core.activations import quick_gelu
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class VisionConfig:
    """The vision tower (``model.vision_model``), the projector and how images meet the tokens."""

    hidden_size: int = 1536
    """Tower width C (HF vision_config.hidden_size, the release's width). Its output, after two
    stride-2 convolutions, is 4 C wide."""

    num_layers: int = 47
    """Tower transformer layers (HF num_hidden_layers)."""

    num_attention_heads: int = 16
    """Tower attention heads (the head dim C / heads must be a multiple of 4: 2-D RoPE)."""

    ffn_hidden_size: int = 8960
    """Tower MLP width (HF intermediate_size = int(hidden_size x mlp_ratio))."""

    num_channels: int = 3
    """Image channels."""

    image_size: int = 728
    """Side in pixels of the image the learned position table is laid out for ((image_size /
    patch_size)^2 positions: the global view); other sizes (local crops) interpolate it
    bilinearly, as transformers does."""

    patch_size: int = 14
    """Side in pixels of a patch (the first convolution's kernel and stride)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the tower's LayerNorms (HF layer_norm_eps)."""

    rotary_base: float = 10000.0
    """Base of the tower's axial 2-D RoPE (HF rope_parameters.rope_theta)."""

    layer_scale_init: float = 0.1
    """Initial value of each layer's two layer scales (HF layer_scale_init_value); a loaded
    model has its checkpoint's."""

    projector_bias: bool = False
    """Bias on the projector (4 C -> the text model's hidden size; HF projector_bias)."""

    image_token_id: int = 151679
    """The placeholder token (``<im_patch>``) whose embeddings the image features replace."""

    freeze: bool = True
    """Freeze the tower (no gradient, no optimizer state; it runs without saving activations);
    the projector trains either way. false: the tower trains too."""

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "num_channels", "image_size", "patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VisionConfig.{name}={value!r}: expected a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"VisionConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 4:
            raise ValueError(f"VisionConfig: head dim hidden_size / num_attention_heads = "
                             f"{self.head_dim} is not a multiple of 4 (axial 2-D RoPE rotates "
                             "a quarter of it per axis and direction)")
        if self.image_size % self.patch_size:
            raise ValueError(f"VisionConfig.image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        if not self.layernorm_epsilon > 0 or not self.rotary_base > 0:
            raise ValueError(f"VisionConfig: layernorm_epsilon={self.layernorm_epsilon!r} and "
                             f"rotary_base={self.rotary_base!r} must be positive")
        if isinstance(self.image_token_id, bool) or not isinstance(self.image_token_id, int) \
                or self.image_token_id < 0:
            raise ValueError(f"VisionConfig.image_token_id={self.image_token_id!r}: expected a "
                             "token id")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per side of the position table."""
        return self.image_size // self.patch_size

    @property
    def output_size(self) -> int:
        """Width of the tower's output (two convolutions, each doubling the channels)."""
        return 4 * self.hidden_size


def tower_transformer_config(vision: VisionConfig, text: TransformerConfig) -> TransformerConfig:
    """The megatron config of the tower's layers: ``vision``'s shape, the text model's tensor
    parallelism, sequence parallelism, dtypes and initialisation; no pipeline, context or expert
    parallelism (the tower sits on the first pipeline stage and sees whole images)."""
    return TransformerConfig(
        num_layers=vision.num_layers,
        hidden_size=vision.hidden_size,
        num_attention_heads=vision.num_attention_heads,
        kv_channels=vision.head_dim,
        ffn_hidden_size=vision.ffn_hidden_size,
        normalization="LayerNorm",
        layernorm_epsilon=vision.layernorm_epsilon,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=quick_gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=text.tensor_model_parallel_size,
        sequence_parallel=text.sequence_parallel,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        params_dtype=text.params_dtype,
        pipeline_dtype=text.pipeline_dtype,
        bf16=text.bf16,
        fp16=text.fp16,
        use_cpu_initialization=text.use_cpu_initialization,
        perform_initialization=text.perform_initialization,
        init_method_std=text.init_method_std,
        gradient_accumulation_fusion=text.gradient_accumulation_fusion,
    )


def projector_transformer_config(tower: TransformerConfig, text: TransformerConfig,
                                 vision: VisionConfig) -> TransformerConfig:
    """The config of megatron's ``MultimodalProjector`` (affine: one column-parallel linear,
    gathered): out width the text model's, bias as ``projector_bias``, and no sequence
    parallelism (it projects whole images, the same on every TP rank)."""
    return dataclasses.replace(tower, hidden_size=text.hidden_size,
                               add_bias_linear=vision.projector_bias, sequence_parallel=False)
