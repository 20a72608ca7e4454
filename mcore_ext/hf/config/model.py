"""``Step35Config``: the Step-3.5 text decoder as both sides of the conversion need it.

One dataclass with the semantics of transformers' ``Step3p7TextConfig`` (model_type ``step3p5``):
its fields, their validation (``__post_init__``: each error names the field and value) and the
per-layer questions the name table and the converter ask (``heads``, ``kv_heads``, ``is_sparse``,
``layer_type``). What turns other forms into it and back lives beside it: ``read`` (a config.json
in any of its dialects), ``released`` (the config.json we write) and ``megatron_config``
(megatron's ``GatedTransformerConfig`` fields, both ways); the methods here only call them.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from mcore_ext.hf.config import megatron_config, read, released
from mcore_ext.hf.config.base import DENSE, FULL, SLIDING, SPARSE, HFConfigError


@dataclass
class Step35Config:
    """A dense Step-3.5 text decoder: what the weights of both layouts need, nothing more."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # full-attention layers
    num_kv_heads: int
    head_dim: int
    layer_types: list = None  # one of FULL / SLIDING per layer
    num_sliding_heads: Optional[int] = None  # None = num_heads
    num_sliding_kv_heads: Optional[int] = None  # None = num_kv_heads (vLLM reads it; see README)
    sliding_window: Optional[int] = None
    rope_theta: dict = field(default_factory=lambda: {FULL: 10000.0})  # per layer type
    partial_rotary_factor: dict = field(default_factory=lambda: {FULL: 1.0})  # per layer type
    swiglu_limits: list = None  # per layer, None = no clamp
    rms_norm_eps: float = 1e-5
    query_pre_attn_scalar: Optional[float] = None  # None = head_dim
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # read.PASSTHROUGH keys of the source config
    # MoE (Step3p7SparseMoeBlock): a sigmoid router whose fp32 bias only selects experts,
    # renormalised top-k weights, the routed output scaled, one always-on shared expert.
    mlp_layer_types: list = None  # DENSE / SPARSE per main layer; None = all dense
    num_experts: Optional[int] = None
    moe_top_k: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    share_expert_dim: Optional[int] = None
    moe_router_scaling_factor: float = 1.0
    router_fp32: bool = True  # need_fp32_gate: router logits in fp32
    expert_swiglu_limits: list = None  # routed experts' clamp per main layer (HF swiglu_limits)
    # MTP layers: dense, global index num_layers + k, their own output head and norm.
    num_mtp_layers: int = 0
    mtp_layer_types: list = None  # attention kind per MTP layer
    mtp_swiglu_limits: list = None  # the MTP layers' MLP clamps (HF swiglu_limits_shared tail)

    def __post_init__(self):
        # One spelling per model: values equal to their defaults are stored as None.
        if self.query_pre_attn_scalar is not None and float(self.query_pre_attn_scalar) == self.head_dim:
            self.query_pre_attn_scalar = None
        if self.num_sliding_kv_heads == self.num_kv_heads:
            self.num_sliding_kv_heads = None
        if self.num_sliding_heads == self.num_heads:
            self.num_sliding_heads = None
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_layers
        if self.swiglu_limits is None:
            self.swiglu_limits = [None] * self.num_layers
        for name in ("layer_types", "swiglu_limits"):
            if len(getattr(self, name)) != self.num_layers:
                raise HFConfigError(
                    f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is "
                    f"{self.num_layers}"
                )
        for i, kind in enumerate(self.layer_types):
            if kind not in (FULL, SLIDING):
                raise HFConfigError(
                    f"layer_types[{i}]={kind!r}: only {FULL!r} and {SLIDING!r} are supported"
                )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise HFConfigError("layer_types has sliding_attention layers but sliding_window is "
                                f"{self.sliding_window!r}")
        self._post_init_moe_mtp()

    def _post_init_moe_mtp(self):
        n, m = self.num_layers, self.num_mtp_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [DENSE] * n
        if self.expert_swiglu_limits is None:
            self.expert_swiglu_limits = [None] * n
        if self.mtp_layer_types is None:
            self.mtp_layer_types = [SLIDING if SLIDING in self.layer_types else FULL] * m
        if self.mtp_swiglu_limits is None:
            self.mtp_swiglu_limits = [None] * m
        for name, length in (("mlp_layer_types", n), ("expert_swiglu_limits", n),
                             ("mtp_layer_types", m), ("mtp_swiglu_limits", m)):
            if len(getattr(self, name)) != length:
                raise HFConfigError(f"{name} has {len(getattr(self, name))} entries, expected "
                                    f"{length}")
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in (DENSE, SPARSE):
                raise HFConfigError(f"mlp_layer_types[{i}]={kind!r}: only {DENSE!r} and "
                                    f"{SPARSE!r} are supported")
        for i, kind in enumerate(self.mtp_layer_types):
            if kind not in (FULL, SLIDING):
                raise HFConfigError(f"mtp_layer_types[{i}]={kind!r}: only {FULL!r} and "
                                    f"{SLIDING!r} are supported")
        if SLIDING in self.mtp_layer_types and not self.sliding_window:
            raise HFConfigError("the MTP layers are sliding_attention but sliding_window is "
                                f"{self.sliding_window!r}")
        if self.is_moe:
            for name in ("num_experts", "moe_top_k", "moe_intermediate_size", "share_expert_dim"):
                value = getattr(self, name)
                if not value or int(value) < 1:
                    raise HFConfigError(f"{name}={value!r}: MoE layers need a positive value")
            if self.moe_top_k < 2:
                raise HFConfigError(f"moe_top_k={self.moe_top_k}: Step-3.5 renormalises the "
                                    "top-k weights, megatron only when top-k > 1")
            if self.moe_top_k > self.num_experts:
                raise HFConfigError(f"moe_top_k={self.moe_top_k} exceeds moe_num_experts="
                                    f"{self.num_experts}")

    # ------------------------------------------------------------------------ per layer

    @property
    def is_moe(self) -> bool:
        return SPARSE in (self.mlp_layer_types or ())

    def layer_type(self, layer: int) -> str:
        """Attention kind of global layer ``layer`` (0-based; MTP layers follow the main ones)."""
        if layer >= self.num_layers:
            return self.mtp_layer_types[layer - self.num_layers]
        return self.layer_types[layer]

    def is_sparse(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is an MoE layer (MTP layers are dense)."""
        return layer < self.num_layers and self.mlp_layer_types[layer] == SPARSE

    def heads(self, layer: int) -> int:
        if self.layer_type(layer) == SLIDING and self.num_sliding_heads:
            return self.num_sliding_heads
        return self.num_heads

    def kv_heads(self, layer: int) -> int:
        if self.layer_type(layer) == SLIDING and self.num_sliding_kv_heads:
            return self.num_sliding_kv_heads
        return self.num_kv_heads


    # ---------------------------------------------------------------- other forms <-> here

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "Step35Config":
        """Normalize a config.json dict (any of the dialects ``read`` names)."""
        return cls(**read.fields_from_hf_dict(raw))

    def to_hf_dict(self) -> dict:
        """config.json in the released layout (``Step3p5ForCausalLM``), which transformers'
        ``Step3p7TextConfig`` also reads (see ``released.to_hf_dict``)."""
        return released.to_hf_dict(self)

    def transformer_config_fields(self) -> dict:
        """``GatedTransformerConfig`` fields of this model (parallel sizes and dtypes left out)."""
        return megatron_config.transformer_config_fields(self)

    @classmethod
    def from_transformer_config(
        cls, config, *, vocab_size: int, max_position_embeddings: int,
        share_embeddings: bool = False, position_embedding_type: str = "rope", extra=None,
        rope_scaling: bool = False, seq_len_interpolation_factor: Optional[float] = None,
    ) -> "Step35Config":
        """The Step-3.5 description of a megatron model, or ``HFConfigError`` naming what the
        layout cannot hold. ``rope_scaling`` / ``seq_len_interpolation_factor``: the GPTModel's
        (they are not config fields)."""
        return cls(**megatron_config.fields_from_transformer_config(
            config, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
            share_embeddings=share_embeddings, position_embedding_type=position_embedding_type,
            extra=extra, rope_scaling=rope_scaling,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
        ))

    def replace(self, **changes) -> "Step35Config":
        return dataclasses.replace(self, **changes)
