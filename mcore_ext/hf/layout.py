"""Which Hugging Face tensors make which megatron parameter, and how each is split over TP.

A declarative table (``LAYER_TABLE``, ``GLOBAL_TABLE``) names, for every megatron parameter of a
dense Step-3.5 model, the HF tensors it is made of and the ``Mapping`` between them. A mapping
turns full HF tensors into TP rank r's local tensor (``to_local``) and the local tensors of all
ranks, in rank order, back into the HF tensors (``from_locals``). Two are special because of how
megatron fuses and splits rows:

- ``QkvGate``: ``linear_qkv`` holds, on each rank, ``[QKV_r ; Gate_r]``: rank r's contiguous
  block of megatron's per-group interleaved QKV rows (per query group: its query heads, its key,
  its value) followed by the g_proj rows of the query heads it computes. With fewer query groups
  than ranks a block cuts through a group; the rows are still rank r's r-th of QKV.
- ``Glu``: ``linear_fc1`` holds ``[gate_r ; up_r]`` on each rank (SwiGLU's two halves, each split
  over TP on its own).

Shapes: h hidden, np / ng query heads / groups of the layer's kind, hn head dim, f MLP width.
"""

from dataclasses import dataclass

import torch

from mcore_ext.hf.config import Step35Config


class Mapping:
    """How one megatron parameter is made of HF tensors (``hf_names``)."""

    def to_local(self, hf: list[torch.Tensor], rank: int, tp: int) -> torch.Tensor:
        raise NotImplementedError

    def from_locals(self, locals_: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


class Replicated(Mapping):
    """The same tensor on every rank (norm weights)."""

    def to_local(self, hf, rank, tp):
        return hf[0]

    def from_locals(self, locals_):
        return [locals_[0]]


@dataclass
class Split(Mapping):
    """Split evenly along ``dim`` (row-parallel linears: dim 1). ``rows``: the HF size along dim
    0 when megatron pads it (the vocabulary), padded with zeros to ``padded_rows``."""

    dim: int
    rows: int | None = None
    padded_rows: int | None = None

    def to_local(self, hf, rank, tp):
        full = hf[0]
        if self.padded_rows is not None and self.padded_rows != full.size(0):
            pad = full.new_zeros(self.padded_rows - full.size(0), *full.shape[1:])
            full = torch.cat([full, pad])
        return full.chunk(tp, dim=self.dim)[rank]

    def from_locals(self, locals_):
        full = torch.cat(locals_, dim=self.dim)
        return [full[: self.rows] if self.rows is not None else full]


@dataclass
class QkvGate(Mapping):
    """q_proj [np*hn, h], k_proj / v_proj [ng*hn, h], g_proj [np, h] <-> ``[QKV_r ; Gate_r]``."""

    heads: int
    groups: int
    head_dim: int

    def fuse_qkv(self, q, k, v):
        """Megatron's global QKV rows: per query group, its query heads, then its key, value."""
        h = q.shape[1:]
        q = q.view(self.groups, -1, *h)  # [ng, np/ng * hn, h]
        k = k.view(self.groups, self.head_dim, *h)
        v = v.view(self.groups, self.head_dim, *h)
        return torch.cat([q, k, v], dim=1).reshape(-1, *h)

    def to_local(self, hf, rank, tp):
        q, k, v, g = hf
        qkv = self.fuse_qkv(q, k, v)
        return torch.cat([qkv.chunk(tp)[rank], g.chunk(tp)[rank]])

    def from_locals(self, locals_):
        qkv_rows = (self.heads + 2 * self.groups) * self.head_dim // len(locals_)
        qkv = torch.cat([local[:qkv_rows] for local in locals_])
        gate = torch.cat([local[qkv_rows:] for local in locals_])
        per_group = qkv.view(self.groups, -1, *qkv.shape[1:])  # [ng, (np/ng + 2) * hn, h]
        q_rows = self.heads // self.groups * self.head_dim
        q, k, v = per_group.split([q_rows, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, *qkv.shape[1:]).clone() for t in (q, k, v)] + [gate]


class Glu(Mapping):
    """gate_proj / up_proj [f, h] <-> ``[gate_r ; up_r]``."""

    def to_local(self, hf, rank, tp):
        gate, up = hf
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])

    def from_locals(self, locals_):
        halves = [local.chunk(2) for local in locals_]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


@dataclass(frozen=True)
class Entry:
    """One megatron parameter (name relative to its module) and the HF tensors it is made of."""

    megatron: str
    hf: tuple
    aliases: tuple = ()  # the same parameter's name in Transformer Engine layers


# Names relative to ``decoder.layers.<i>.`` and ``model.layers.<L>.``.
LAYER_TABLE = (
    Entry("input_layernorm.weight", ("input_layernorm.weight",),
          aliases=("self_attention.linear_qkv.layer_norm_weight",)),
    Entry("self_attention.linear_qkv.weight",
          ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.g_proj.weight")),
    Entry("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Entry("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    Entry("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Entry("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",),
          aliases=("mlp.linear_fc1.layer_norm_weight",)),
    Entry("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    Entry("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)
# MoE layers: these replace the dense MLP's two entries (names relative to the layer).
MOE_TABLE = (
    Entry("mlp.router.weight", ("moe.gate.weight",)),
    Entry("mlp.router.expert_bias", ("moe.router_bias",)),  # an fp32 buffer on both sides
    Entry("mlp.shared_experts.linear_fc1.weight",
          ("share_expert.gate_proj.weight", "share_expert.up_proj.weight")),
    Entry("mlp.shared_experts.linear_fc2.weight", ("share_expert.down_proj.weight",)),
)
# Routed experts: HF stacks them ([E, ...], expert e = row e), megatron holds its EP rank's
# E / EP experts as local_experts.{j} (global e = ep_rank * E / EP + j), split over ETP.
EXPERT_TABLE = (
    Entry("mlp.experts.local_experts.{j}.linear_fc1.weight",
          ("moe.gate_proj.weight", "moe.up_proj.weight")),
    Entry("mlp.experts.local_experts.{j}.linear_fc2.weight", ("moe.down_proj.weight",)),
)
STACKED_EXPERT_NAMES = ("moe.gate_proj.weight", "moe.up_proj.weight", "moe.down_proj.weight")
# MTP depth k = HF layer num_layers + k: a dense layer (LAYER_TABLE under mtp_model_layer.) plus
# these (names relative to mtp.layers.{k}. and model.layers.{num_layers + k}.).
MTP_TABLE = (
    Entry("enorm.weight", ("enorm.weight",)),
    Entry("hnorm.weight", ("hnorm.weight",)),
    Entry("eh_proj.weight", ("eh_proj.weight",)),
    Entry("final_layernorm.weight", ("transformer.shared_head.norm.weight",)),
    Entry("output_layer.weight", ("transformer.shared_head.output.weight",)),
)
# megatron 0.16 names an MTP depth's layer transformer_layer, later releases mtp_model_layer.
MTP_LAYER_PREFIXES = ("mtp_model_layer.", "transformer_layer.")

# transformers 5.23's names for the released ones (conversion_mapping.py "step3p7"), read on
# import. Its gate_up_proj [E, 2F, H] holds moe.gate_proj (rows :F) and moe.up_proj (F:).
TRANSFORMERS_NAMES = {
    "moe.gate.weight": "mlp.gate.weight",
    "moe.router_bias": "mlp.gate.e_score_correction_bias",
    "moe.down_proj.weight": "mlp.experts.down_proj",
    "share_expert.gate_proj.weight": "mlp.shared_experts.gate_proj.weight",
    "share_expert.up_proj.weight": "mlp.shared_experts.up_proj.weight",
    "share_expert.down_proj.weight": "mlp.shared_experts.down_proj.weight",
}
TRANSFORMERS_GATE_UP = ("mlp.experts.gate_up_proj", ("moe.gate_proj.weight",
                                                     "moe.up_proj.weight"))

EMBEDDING = Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
FINAL_NORM = Entry("decoder.final_layernorm.weight", ("model.norm.weight",))
OUTPUT = Entry("output_layer.weight", ("lm_head.weight",))


def hf_layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_mapping(entry: Entry, spec: Step35Config, layer: int) -> Mapping:
    """The mapping of a per-layer entry for global layer ``layer`` (its kind's head counts)."""
    name = entry.megatron
    if name == "self_attention.linear_qkv.weight":
        return QkvGate(spec.heads(layer), spec.kv_heads(layer), spec.head_dim)
    if name == "mlp.linear_fc1.weight":
        return Glu()
    if name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                "mlp.shared_experts.linear_fc2.weight"):
        return Split(dim=1)
    if name == "mlp.shared_experts.linear_fc1.weight":
        return Glu()
    return Replicated()


@dataclass
class Expert(Mapping):
    """Routed expert ``index`` (global) of a stacked HF tensor: ``inner`` maps its rows
    (``hf[e]``) over the expert-tensor-parallel ranks."""

    inner: Mapping
    index: int

    def to_local(self, hf, rank, tp):
        return self.inner.to_local(hf, rank, tp)

    def from_locals(self, locals_):
        return self.inner.from_locals(locals_)


def expert_mapping(entry: Entry, index: int) -> Expert:
    return Expert(Glu() if entry.megatron.endswith("linear_fc1.weight") else Split(dim=1), index)


def mtp_mapping(entry: Entry, spec: Step35Config, padded_vocab: int) -> Mapping:
    if entry.megatron == "output_layer.weight":
        return vocab_mapping(spec, padded_vocab)
    if entry.megatron == "eh_proj.weight":
        return Split(dim=0)  # column-parallel [H, 2H]; input cat[enorm(emb), hnorm(h)] as HF
    return Replicated()


def vocab_mapping(spec: Step35Config, padded_vocab: int) -> Split:
    return Split(dim=0, rows=spec.vocab_size, padded_rows=padded_vocab)


def hf_shapes(spec: Step35Config) -> dict[str, tuple]:
    """Every HF tensor of the model and its shape, in the order the export writes them: main
    layers, MTP layers (``model.layers.{num_layers + k}``), final norm, lm_head."""
    h, hn, f = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers + spec.num_mtp_layers):
        np_, ng = spec.heads(layer), spec.kv_heads(layer)
        p = hf_layer_prefix(layer)
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (np_ * hn, h),
            p + "self_attn.k_proj.weight": (ng * hn, h),
            p + "self_attn.v_proj.weight": (ng * hn, h),
            p + "self_attn.g_proj.weight": (np_, h),
            p + "self_attn.q_norm.weight": (hn,),
            p + "self_attn.k_norm.weight": (hn,),
            p + "self_attn.o_proj.weight": (h, np_ * hn),
            p + "post_attention_layernorm.weight": (h,),
        })
        if spec.is_sparse(layer):
            e, fe, fs = spec.num_experts, spec.moe_intermediate_size, spec.share_expert_dim
            shapes.update({
                p + "moe.gate.weight": (e, h),
                p + "moe.router_bias": (e,),
                p + "moe.gate_proj.weight": (e, fe, h),
                p + "moe.up_proj.weight": (e, fe, h),
                p + "moe.down_proj.weight": (e, h, fe),
                p + "share_expert.gate_proj.weight": (fs, h),
                p + "share_expert.up_proj.weight": (fs, h),
                p + "share_expert.down_proj.weight": (h, fs),
            })
        else:
            shapes.update({
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            })
        if layer >= spec.num_layers:
            shapes.update({
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "transformer.shared_head.norm.weight": (h,),
                p + "transformer.shared_head.output.weight": (spec.vocab_size, h),
            })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


FP32_NAMES = ("moe.router_bias",)  # kept in fp32 whatever the weights' dtype


def hf_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype HF tensor ``name`` has in a checkpoint of ``dtype`` weights."""
    return torch.float32 if name.endswith(FP32_NAMES) else dtype
MEGATRON_FP32_NAMES = ("router.expert_bias",)  # megatron's fp32 buffer of moe.router_bias
