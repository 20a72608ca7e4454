"""The shapes a memory plan needs, per global layer, from a megatron config (nothing is built).

``ModelShape.from_transformer_config`` reads a ``GatedTransformerConfig`` (the launcher's, or one
made from a Hugging Face config): per layer its attention kind (heads, query groups, head dim,
window), whether it is MoE (experts, top-k, widths, clamps) or dense, and the model-wide sizes
(hidden, vocabulary, norms, MTP depths). Layers are numbered from 0; MTP depth k is layer
``num_layers + k``, as in Hugging Face's checkpoint. A Step-3.7 model's vision tower and
projector are a ``VisionShape`` beside them (``ModelShape.with_vision``).
"""

from dataclasses import dataclass
from typing import Optional

from mcore_ext.config import SLIDING_ATTENTION


@dataclass(frozen=True)
class LayerShape:
    index: int  # global, 0-based; >= num_layers: an MTP depth
    sliding: bool
    heads: int
    groups: int
    head_dim: int
    window: Optional[int]  # keys a sliding layer's query sees (HF's sliding_window)
    gate: bool  # head-wise output gate: one linear_qkv row per head
    qk_norm: bool
    moe: bool
    ffn: int  # dense MLP width (MoE layers: unused)
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # 0 = no shared expert
    expert_clamp: bool = False  # HF's clamped SwiGLU on the routed experts
    clamp: bool = False  # on the dense MLP or the shared expert
    mtp: bool = False


@dataclass(frozen=True)
class VisionShape:
    """Step-3.7's vision tower and projector (``mcore_ext.vision.VisionConfig``) in front of the
    text model, on the first pipeline stage: ``layers`` ViT layers of width ``hidden`` (LayerNorm,
    biases, quick-GELU MLP of width ``ffn``, two layer scales), the patch embedding (no bias) and
    position table of ``image_size`` / ``patch`` squared patches, ln_pre, two 3 x 3 stride-2
    convolutions (C -> 2C -> 4C) and the projector (4C -> the text model's hidden size)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    channels: int = 3
    patch: int = 14
    image_size: int = 728
    projector_bias: bool = False
    frozen: bool = True  # the tower frozen (model.vision.freeze); the projector trains

    @classmethod
    def from_config(cls, vision) -> "VisionShape":
        return cls(hidden=vision.hidden_size, layers=vision.num_layers,
                   heads=vision.num_attention_heads, ffn=vision.ffn_hidden_size,
                   channels=vision.num_channels, patch=vision.patch_size,
                   image_size=vision.image_size, projector_bias=vision.projector_bias,
                   frozen=vision.freeze)

    def patches(self, side: int) -> int:
        """Patches of a side x side view (the tower's tokens)."""
        return (side // self.patch) ** 2

    def features(self, side: int) -> int:
        """Features (placeholder tokens) of a side x side view: the patch grid halved twice."""
        grid = side // self.patch
        for _ in range(2):
            grid = (grid + 1) // 2
        return grid * grid


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int  # rows of the embedding / output heads before padding
    num_layers: int  # main layers (MTP depths follow them in ``layers``)
    layers: tuple  # LayerShape per global layer, MTP depths last
    gated_mlp: bool = True  # SwiGLU: fc1 is [gate; up]
    layer_norm: bool = False  # LayerNorm (a bias per norm) rather than RMSNorm
    qkv_bias: bool = False  # linear_qkv bias rows (add_qkv_bias or add_bias_linear)
    linear_bias: bool = False  # biases on linear_proj, fc1, fc2 (add_bias_linear)
    tied_embeddings: bool = False
    mtp_own_heads: bool = True  # Step-3.5 MTP: an output head per depth
    make_vocab_size_divisible_by: int = 128
    lora_rank: int = 0  # LoRA's r: the base frozen, adapters trained (``params.with_lora``)
    lora_targets: tuple = ()  # the PEFT names adapted (mcore_ext.lora's resolution)
    vision: Optional[VisionShape] = None  # Step-3.7's tower and projector (first stage)

    @property
    def mtp_layers(self) -> int:
        return len(self.layers) - self.num_layers

    @property
    def is_moe(self) -> bool:
        return any(layer.moe for layer in self.layers)

    def without_mtp(self) -> "ModelShape":
        """The main layers alone (``--without-mtp``)."""
        return ModelShape(**{**self.__dict__, "layers": self.layers[: self.num_layers]})

    def with_vision(self, vision) -> "ModelShape":
        """With a ``VisionConfig``'s tower and projector (None: without)."""
        return ModelShape(**{**self.__dict__, "vision": None if vision is None
                             else VisionShape.from_config(vision)})

    @classmethod
    def from_transformer_config(cls, config, *, vocab_size: int,
                                make_vocab_size_divisible_by: int = 128,
                                tied_embeddings: bool = False) -> "ModelShape":
        from mcore_ext.moe import is_moe_layer

        n, m = config.num_layers, int(getattr(config, "mtp_num_layers", None) or 0)
        layers = []
        for number in range(1, n + m + 1):  # megatron's 1-based global layer numbers
            kind = config.get_config_for_layer(number)
            sliding = config.layer_type(number) == SLIDING_ATTENTION
            moe = is_moe_layer(config, number)
            layers.append(LayerShape(
                index=number - 1,
                sliding=sliding,
                heads=kind.num_attention_heads,
                groups=kind.num_query_groups or kind.num_attention_heads,
                head_dim=kind.kv_channels,
                window=config.sliding_window if sliding else None,
                gate=bool(getattr(config, "head_wise_attn_gate", False)),
                qk_norm=bool(config.qk_layernorm),
                moe=moe,
                ffn=config.ffn_hidden_size,
                experts=(config.num_moe_experts or 0) if moe else 0,
                topk=config.moe_router_topk if moe else 0,
                expert_ffn=(config.moe_ffn_hidden_size or config.ffn_hidden_size) if moe else 0,
                shared_ffn=(config.moe_shared_expert_intermediate_size or 0) if moe else 0,
                expert_clamp=bool(config.moe_expert_swiglu_limit(number)) if moe else False,
                clamp=bool(config.swiglu_limit(number)),
                mtp=number > n,
            ))
        return cls(
            hidden=config.hidden_size,
            vocab=vocab_size,
            num_layers=n,
            layers=tuple(layers),
            gated_mlp=bool(config.gated_linear_unit),
            layer_norm=config.normalization == "LayerNorm",
            qkv_bias=bool(config.add_qkv_bias or config.add_bias_linear),
            linear_bias=bool(config.add_bias_linear),
            tied_embeddings=tied_embeddings,
            mtp_own_heads=bool(getattr(config, "mtp_step35_heads", False)),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
