"""Which tensors of a Step-3.7 folder make the vision tower's and projector's megatron parameters
(``mcore_ext.models.vision_language``), and how each is split over TP.

A Step-3.7 folder holds the vision side in one of two spellings, as it holds the text model
(``mcore_ext.hf.step37``):

- the hub's (what transformers' ``save_pretrained`` writes): ``vision_model.conv1.weight``,
  ``vision_model.positional_embedding``, ``vision_model.ln_pre.*``,
  ``vision_model.transformer.resblocks.<i>.{ln_1, attn.in_proj_*, attn.out_proj.*, ls_1.gamma,
  ln_2, mlp.c_fc.*, mlp.c_proj.*, ls_2.gamma}``, ``vision_model.vit_downsampler{1,2}.*``,
  ``vit_large_projector.*``. ``attn.in_proj_*`` stacks q, k, v; its q and k rows are in the
  release's interleaved RoPE order, which transformers permutes into its rotate-half order on
  load (``PermuteForRope``) and back on save;
- transformers' module names: ``model.vision_model.{embeddings.patch_embedding,
  embeddings.position_embedding, pre_layernorm, layers.<i>.{layernorm_before,
  self_attn.{q,k,v,out}_proj, lambda_1, layernorm_after, mlp.fc{1,2}, lambda_2},
  downsampler{1,2}}``, ``model.multi_modal_projector.*``.

The table (``VISION_TABLE``, ``LAYER_TABLE``) names each megatron parameter's tensors in both
spellings and its ``Mapping`` (``mcore_ext.hf.layout``); megatron fuses q, k, v per head
(``VisionQkv``) in transformers' rotate-half order, the order its RoPE rotates.
"""

from dataclasses import dataclass

import torch

from mcore_ext.hf.layout import Mapping, Replicated, Split

HUB, NATIVE = "hub", "native"
MODEL_PREFIX = "vision_model."  # the model's tower; its projector is vision_projection.


@dataclass(frozen=True)
class VisionEntry:
    """One megatron parameter (relative to the model, or to a tower layer in ``LAYER_TABLE``),
    the tensors it is made of in each spelling, and its mapping's kind."""

    megatron: str
    hub: tuple
    native: tuple
    kind: str = "replicated"  # replicated, rows (split dim 0), columns (split dim 1), qkv


VISION_TABLE = (
    VisionEntry("vision_model.conv1.weight", ("vision_model.conv1.weight",),
                ("model.vision_model.embeddings.patch_embedding.weight",)),
    VisionEntry("vision_model.position_embeddings.weight", ("vision_model.positional_embedding",),
                ("model.vision_model.embeddings.position_embedding.weight",)),
    VisionEntry("vision_model.ln_pre.weight", ("vision_model.ln_pre.weight",),
                ("model.vision_model.pre_layernorm.weight",)),
    VisionEntry("vision_model.ln_pre.bias", ("vision_model.ln_pre.bias",),
                ("model.vision_model.pre_layernorm.bias",)),
)
# after the layers
VISION_TAIL = tuple(
    VisionEntry(f"vision_model.downsampler{k}.{p}", (f"vision_model.vit_downsampler{k}.{p}",),
                (f"model.vision_model.downsampler{k}.{p}",))
    for k in (1, 2) for p in ("weight", "bias")
) + (
    VisionEntry("vision_projection.encoder.weight", ("vit_large_projector.weight",),
                ("model.multi_modal_projector.weight",), "rows"),
    VisionEntry("vision_projection.encoder.bias", ("vit_large_projector.bias",),
                ("model.multi_modal_projector.bias",), "rows"),
)
# Relative to vision_model.decoder.layers.<i>. / vision_model.transformer.resblocks.<i>. /
# model.vision_model.layers.<i>.
LAYER_TABLE = (
    VisionEntry("input_layernorm.weight", ("ln_1.weight",), ("layernorm_before.weight",)),
    VisionEntry("input_layernorm.bias", ("ln_1.bias",), ("layernorm_before.bias",)),
    VisionEntry("self_attention.linear_qkv.weight", ("attn.in_proj_weight",),
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                "qkv"),
    VisionEntry("self_attention.linear_qkv.bias", ("attn.in_proj_bias",),
                ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                "qkv"),
    VisionEntry("self_attention.linear_proj.weight", ("attn.out_proj.weight",),
                ("self_attn.out_proj.weight",), "columns"),
    VisionEntry("self_attention.linear_proj.bias", ("attn.out_proj.bias",),
                ("self_attn.out_proj.bias",)),
    VisionEntry("self_attn_bda.layer_scale", ("ls_1.gamma",), ("lambda_1",)),
    VisionEntry("pre_mlp_layernorm.weight", ("ln_2.weight",), ("layernorm_after.weight",)),
    VisionEntry("pre_mlp_layernorm.bias", ("ln_2.bias",), ("layernorm_after.bias",)),
    VisionEntry("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), ("mlp.fc1.weight",), "rows"),
    VisionEntry("mlp.linear_fc1.bias", ("mlp.c_fc.bias",), ("mlp.fc1.bias",), "rows"),
    VisionEntry("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), ("mlp.fc2.weight",), "columns"),
    VisionEntry("mlp.linear_fc2.bias", ("mlp.c_proj.bias",), ("mlp.fc2.bias",)),
    VisionEntry("mlp_bda.layer_scale", ("ls_2.gamma",), ("lambda_2",)),
)
LAYER_PREFIXES = {HUB: "vision_model.transformer.resblocks.{i}.",
                  NATIVE: "model.vision_model.layers.{i}."}


def spelling(names) -> str:
    """Which spelling a folder's tensor names use for the vision side."""
    return NATIVE if any(n.startswith("model.vision_model.") for n in names) else HUB


def rope_rows(t: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """q or k rows (weight [heads x hn, C] or bias) between the release's interleaved RoPE order
    (pairs (2k, 2k + 1) per head) and transformers' rotate-half order (evens, then odds):
    transformers' ``PermuteForRope`` (``inverse``: rotate-half -> interleaved)."""
    rest = t.shape[1:]
    half = t.shape[0] // heads // 2
    shape = (heads, 2, half) if inverse else (heads, half, 2)
    return t.reshape(*shape, *rest).transpose(1, 2).reshape(t.shape)


@dataclass
class VisionQkv(Mapping):
    """q, k, v (their weights or biases; the hub's stacked ``in_proj``) <-> megatron's fused
    ``linear_qkv`` rows (per head: its q, k, v rows; heads split over TP)."""

    heads: int
    head_dim: int
    hub: bool

    def to_local(self, hf, rank, tp):
        if self.hub:
            q, k, v = hf[0].chunk(3)
            q, k = rope_rows(q, self.heads), rope_rows(k, self.heads)
        else:
            q, k, v = hf
        rest = q.shape[1:]
        fused = torch.stack([t.reshape(self.heads, self.head_dim, *rest) for t in (q, k, v)], 1)
        return fused.reshape(-1, *rest).chunk(tp)[rank]  # [3 x heads/TP x hn, ...]

    def from_locals(self, locals_):
        fused = torch.cat(locals_)
        rest = fused.shape[1:]
        q, k, v = (t.reshape(-1, *rest).clone()
                   for t in fused.reshape(self.heads, 3, self.head_dim, *rest).unbind(1))
        if not self.hub:
            return [q, k, v]
        q, k = rope_rows(q, self.heads, inverse=True), rope_rows(k, self.heads, inverse=True)
        return [torch.cat([q, k, v])]


def mapping(entry: VisionEntry, vision, hub: bool) -> Mapping:
    if entry.kind == "qkv":
        return VisionQkv(vision.num_attention_heads, vision.head_dim, hub)
    if entry.kind == "rows":
        return Split(dim=0)
    if entry.kind == "columns":
        return Split(dim=1)
    return Replicated()


def units(vision, names, params):
    """(megatron name, mapping, HF names) of every vision parameter in ``params`` (the model's
    names), in order: the tensors under ``names``' spelling. The projector's bias only with
    ``projector_bias``."""
    which = spelling(names)
    hub = which == HUB
    entries = [(e, None) for e in VISION_TABLE]
    entries += [(e, i) for i in range(vision.num_layers) for e in LAYER_TABLE]
    entries += [(e, None) for e in VISION_TAIL
                if vision.projector_bias or not e.megatron.endswith("encoder.bias")]
    for entry, layer in entries:
        hf = entry.hub if hub else entry.native
        name = entry.megatron
        if layer is not None:
            name = f"{MODEL_PREFIX}decoder.layers.{layer}.{name}"
            hf = tuple(LAYER_PREFIXES[which].format(i=layer) + n for n in hf)
        if name in params:
            yield name, mapping(entry, vision, hub), hf


def is_vision_parameter(name: str) -> bool:
    return name.startswith((MODEL_PREFIX, "vision_projection."))


class _Every:
    """Every name is a parameter (to list all of a config's tensors, whatever the model holds)."""

    def __contains__(self, name):
        return True


def hf_names(vision, names) -> list:
    """Every HF tensor of ``vision``'s tower and projector in ``names``' spelling, in the table's
    order (the tensors a vision-language model's export writes from its parameters)."""
    return [n for _, _, hf in units(vision, names, _Every()) for n in hf]


def unit_of(megatron: str) -> str:
    """The export's unit of a vision parameter (one unit's tensors are gathered and written
    together): ``vision_head`` (patch embedding, positions, ln_pre), ``vision_layer<i>``,
    ``vision_tail`` (the two convolutions and the projector)."""
    layers = MODEL_PREFIX + "decoder.layers."
    if megatron.startswith(layers):
        return f"vision_layer{megatron[len(layers):].split('.')[0]}"
    if megatron.startswith(("vision_projection.", MODEL_PREFIX + "downsampler")):
        return "vision_tail"
    return "vision_head"


def unit_names(vision, names) -> dict:
    """{unit: its HF tensors} of ``vision``'s tower and projector in ``names``' spelling, the
    units in the export's order (``unit_of``)."""
    out = {}
    for name, _, hf in units(vision, names, _Every()):
        out.setdefault(unit_of(name), []).extend(hf)
    return out
