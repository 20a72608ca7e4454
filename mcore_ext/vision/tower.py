"""Step-3.7-Flash's vision tower on megatron-core's transformer layers.

transformers' ``Step3p7VisionModel``, computed the same way:

    pixels [B, 3, H, W] -> conv1 (patch x patch, stride patch, no bias) -> [B, N, C] patches
    (N = H/p x W/p) + learned positions (bilinearly interpolated when the grid is not the
    table's) -> ln_pre -> L x layer -> [B, C, H/p, W/p] -> downsampler1 (3 x 3, stride 2,
    C -> 2C) -> downsampler2 (2C -> 4C) -> [B, n, 4C] features

    layer: x + ls_1 * attn(ln_1(x)), then x + ls_2 * mlp(ln_2(x)); attention bidirectional over
    the image's N patches with axial 2-D RoPE on q and k; mlp fc1 -> quick_gelu -> fc2 (biases).

The layers are megatron's ``TransformerLayer`` (ViT spec ``get_vit_layer_with_local_spec``:
``SelfAttention`` with no mask, column / row-parallel linears, ``MLP``) in a ``TransformerBlock``,
so they are split over tensor parallelism (and sequence parallelism, as the text model's) and
their checkpoint is megatron's sharded one; three slots differ: the core attention
(``VisionCoreAttention``: torch SDPA, no mask, no context parallelism: an image is not split), the
norms (``TorchNorm``: LayerNorm, sequence-parallel) and the two bias-dropout-adds, which carry the
layer scales (``LayerScaleBiasDropoutAdd``). The 2-D RoPE reaches megatron's RoPE as per-patch
frequencies. The patch embedding, positions, ln_pre and the two convolutions are small and run
whole on every TP rank.

Shapes: B images, C width, N patches of an image (its sequence), n features, TP tensor-parallel
size; megatron's activations are [N, B, C] ([N / TP, B, C] under sequence parallelism).
"""

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.vision_module.vision_module import VisionModule
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_ext.norm import TorchNorm
from mcore_ext.vision.config import VisionConfig


class VisionCoreAttention(MegatronModule):
    """megatron's ``core_attention`` slot for the tower: softmax(q k^T / sqrt(hn)) v over all of
    an image's patches (torch SDPA, no mask).

    query / key / value [N, B, np, hn] -> [N, B, np x hn]. The tower's sequence is one image, so
    there is no context parallelism and no packing here (the text model's attention layout is
    not touched)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout=None, softmax_scale=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type is not AttnMaskType.no_mask:
            raise ValueError(f"VisionCoreAttention attends without a mask, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("VisionCoreAttention takes whole images: no packing, no bias")
        n, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, np, N, hn]
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(n, b, -1)  # [N, B, np x hn]


class LayerScaleBiasDropoutAdd(torch.nn.Module):
    """megatron's bias-dropout-add slot with Step's layer scale: ``residual + dropout(scale *
    (x + bias))``. ``scale`` [C] is a parameter (HF ``lambda_1`` / ``lambda_2``); under sequence
    parallelism each rank sees its patches only, so its gradient is summed over TP by
    ``finalize_model_grads`` (marked ``sequence_parallel``, as the norms are)."""

    def __init__(self, config: TransformerConfig, init_value: float):
        super().__init__()
        self.layer_scale = torch.nn.Parameter(
            torch.full((config.hidden_size,), float(init_value), dtype=config.params_dtype))
        self.layer_scale.sequence_parallel = config.sequence_parallel

    def forward(self, training: bool, fused: bool = False):
        """The function megatron's layer calls: ``(x, bias), residual, prob -> out``."""
        def scale_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return residual + F.dropout(self.layer_scale * x, p=prob, training=training)

        return scale_dropout_add


def vision_layer_spec(config: TransformerConfig, vision: VisionConfig) -> ModuleSpec:
    """megatron's local ViT layer spec with the tower's core attention, norms and layer scales."""
    spec = get_vit_layer_with_local_spec()
    layer = spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=VisionCoreAttention))
    scale = ModuleSpec(module=LayerScaleBiasDropoutAdd,
                       params={"config": config, "init_value": vision.layer_scale_init})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm, self_attention=attention,
        self_attn_bda=scale, mlp_bda=scale))


def rotary_frequencies(grid_h: int, grid_w: int, head_dim: int, base: float,
                       device=None) -> torch.Tensor:
    """[N, 1, 1, hn] RoPE angles of a grid_h x grid_w patch grid (row-major patches), for
    megatron's rotate-half RoPE: per patch at (row i, column j), [j f; i f; j f; i f] with f the
    hn / 4 frequencies base^(-4k / hn) (transformers' axial 2-D RoPE: columns first, then rows,
    repeated for the two halves)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device)
                               / spatial))  # [hn / 4]
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w).float()
    cols = torch.arange(grid_w, device=device).repeat(grid_h).float()
    half = torch.cat([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1)
    return torch.cat([half, half], dim=-1)[:, None, None, :]


class Step37VisionTower(VisionModule):
    """The vision tower (see the module docstring): pixels [B, 3, H, W] -> features [B, n, 4C].

    ``config``: the layers' megatron config (``vision.config.tower_transformer_config``);
    ``pg_collection``: the text model's process groups (its TP group splits the layers)."""

    def __init__(self, config: TransformerConfig, vision: VisionConfig, pg_collection=None):
        super().__init__(config=config)
        self.vision = vision
        c = vision.hidden_size
        dtype = config.params_dtype
        self.conv1 = torch.nn.Conv2d(vision.num_channels, c, kernel_size=vision.patch_size,
                                     stride=vision.patch_size, bias=False, dtype=dtype)
        self.position_embeddings = torch.nn.Embedding(vision.grid ** 2, c, dtype=dtype)
        self.ln_pre = torch.nn.LayerNorm(c, eps=vision.layernorm_epsilon, dtype=dtype)
        self.decoder = TransformerBlock(config=config, spec=vision_layer_spec(config, vision),
                                        pre_process=True, post_process=False,
                                        pg_collection=pg_collection)
        self.tp_group = self.decoder.pg_collection.tp
        self.downsampler1 = torch.nn.Conv2d(c, 2 * c, kernel_size=3, stride=2, padding=1,
                                            dtype=dtype)
        self.downsampler2 = torch.nn.Conv2d(2 * c, 4 * c, kernel_size=3, stride=2, padding=1,
                                            dtype=dtype)
        if config.perform_initialization:
            config.init_method(self.position_embeddings.weight)

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[1, N, C] learned positions of a grid_h x grid_w grid: the table itself on its own
        grid, else the table bilinearly resized (align_corners=False), as transformers does."""
        table = self.position_embeddings.weight
        side = self.vision.grid
        if (grid_h, grid_w) == (side, side):
            return table.unsqueeze(0)
        grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bilinear", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, -1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, 3, H, W] (H, W multiples of patch_size) -> features [B, n, 4C]."""
        b, _, height, width = pixel_values.shape
        p = self.vision.patch_size
        if height % p or width % p:
            raise ValueError(f"pixel_values of {height} x {width} pixels: not a multiple of the "
                             f"vision tower's patch_size {p}")
        grid_h, grid_w = height // p, width // p
        x = self.conv1(pixel_values.to(self.conv1.weight.dtype))  # [B, C, H/p, W/p]
        x = x.flatten(2).transpose(1, 2) + self.positions(grid_h, grid_w)  # [B, N, C]
        x = self.ln_pre(x).transpose(0, 1).contiguous()  # [N, B, C]
        sequence_parallel = self.config.sequence_parallel and self.tp_group.size() > 1
        if sequence_parallel:
            if x.size(0) % self.tp_group.size():
                raise ValueError(
                    f"an image view of {grid_h} x {grid_w} = {x.size(0)} patches does not split "
                    f"over tensor_model_parallel_size={self.tp_group.size()} for sequence "
                    "parallelism (the tower splits each image's patches)")
            x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.tp_group)
        freqs = rotary_frequencies(grid_h, grid_w, self.vision.head_dim, self.vision.rotary_base,
                                   device=x.device)
        x = self.decoder(x, attention_mask=None, rotary_pos_emb=freqs)  # [N(/TP), B, C]
        if sequence_parallel:
            # What follows runs whole on every TP rank, with the same gradient on each: the
            # backward keeps this rank's rows (no sum).
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=self.tp_group)
        x = x.permute(1, 2, 0).reshape(b, -1, grid_h, grid_w)  # [B, C, H/p, W/p]
        x = self.downsampler2(self.downsampler1(x))  # [B, 4C, h, w]
        return x.flatten(2).transpose(1, 2)  # [B, n, 4C]
