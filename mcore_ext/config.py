"""Transformer config with the head-wise attention output gate (Step-3.5-Flash ``g_proj``)."""

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, Union

from megatron.core.transformer.transformer_config import TransformerConfig

# Per-partition GEMM output dims that FP8 / FP4 kernels accept.
_QUANT_ALIGNMENT = {"fp8": 16, "fp4": 32}

# Hugging Face's names for the two attention layer kinds (Step-3.5 ``layer_types``).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ATTENTION_KERNELS = ("sdpa", "flex", "varlen")


@dataclass
class GatedTransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus a learned sigmoid gate per attention head.

    With ``head_wise_attn_gate`` on, ``linear_qkv`` gets ``num_attention_heads`` extra output
    rows and every head's attention output is scaled by ``sigmoid(x @ w_gate_h + b_gate_h)``
    before ``linear_proj``. With it off, this config behaves exactly like ``TransformerConfig``.

    ``head_wise_attn_gate`` has the name and meaning of upstream Megatron-LM dev's field. The two
    init fields exist only here (upstream's init surgery, PR #4848, was not merged); by default
    the gates start as dev's and every released implementation's do, drawn like any QKV row with
    bias 0 (near sigmoid(0) = 0.5): measured to train as well as no gate or better, where the
    surgery's start (weight rows x 0.1, bias 2) trailed (docs/gate-training.md).

    The Step-3.5 fields (``layer_types`` and the ``sliding_*`` values, per-kind RoPE,
    ``swiglu_limits``, ``attention_kernel``) give layers of two kinds in one model, with Hugging
    Face's semantics; ``get_config_for_layer`` returns a layer's kind config (see layer_kinds.py).
    """

    head_wise_attn_gate: bool = False
    """Gate each attention head's output with one learned sigmoid scalar (fused into linear_qkv)."""

    head_wise_attn_gate_init_weight_scale: float = 1.0
    """Gate weight rows, drawn like linear_qkv's other rows, are scaled by this (1.0: as upstream
    dev and every released gate start; the original surgery's 0.1 trailed the ungated run at
    the 1B's step size in bench_convergence, docs/gate-training.md)."""

    head_wise_attn_gate_init_bias: float = 0.0
    """Gate bias rows start at this value (0.0: sigmoid ~ 0.5, as upstream dev; the original
    surgery's 2.0, sigmoid ~ 0.88, trailed: docs/gate-training.md). Needs a linear_qkv bias (add_qkv_bias or add_bias_linear):
    without one there are no bias rows, the value is kept but has no effect
    (``effective_head_wise_attn_gate_init_bias`` is then 0.0, gates start near sigmoid(0) = 0.5)
    and building the attention warns once."""

    # ---------------------------------------------------------------- layer kinds (Step-3.5)
    # Semantics are Hugging Face's (transformers' Step3p7 text model). Defaults keep the model
    # exactly as before: one kind of layer, full causal attention, RoPE from rotary_base /
    # rotary_percent, no clamp.

    layer_types: Optional[list[str]] = None
    """One entry per global layer, "full_attention" or "sliding_attention"; None = all full.
    Full layers use num_attention_heads / num_query_groups / rotary_base / rotary_percent, sliding
    layers the sliding_* fields (each None = the full layers' value) and sliding_window."""

    sliding_window: Optional[int] = None
    """Keys a query of a sliding layer sees: query i attends keys j with
    i - sliding_window < j <= i (HF's semantics; megatron's window_size (sliding_window - 1, 0))."""

    sliding_num_attention_heads: Optional[int] = None
    """Query heads of sliding layers; None = num_attention_heads."""

    sliding_num_query_groups: Optional[int] = None
    """Key/value groups of sliding layers; None = num_query_groups."""

    rotary_base: float = 10000.0
    """RoPE base of full layers (and of the model's rotary embedding)."""

    rotary_percent: float = 1.0
    """Fraction of each head's dims that RoPE rotates (the first ones), full layers."""

    sliding_rotary_base: Optional[float] = None
    """RoPE base of sliding layers; None = rotary_base."""

    sliding_rotary_percent: Optional[float] = None
    """Rotary fraction of sliding layers; None = rotary_percent."""

    swiglu_limits: Optional[list[Optional[float]]] = None
    """Per global layer, HF's SwiGLU clamp L: silu(gate).clamp(max=L) * up.clamp(-L, L). None or
    0 = no clamp. (megatron's activation_func_clamp_value clamps the gate before the SiLU: not
    the same function.)"""

    # ---------------------------------------------------------------- MoE (Step-3.5)
    # megatron's own MoE fields (num_moe_experts, moe_router_topk, moe_layer_freq, ...) apply;
    # mcore_ext/moe.py validates them. Two defaults differ from TransformerConfig's so that a
    # converted model routes as it was trained: no load-balancing loss and a frozen expert bias
    # (training options: "aux_loss" with moe_aux_loss_coeff, moe_router_bias_update_rate > 0).

    moe_router_load_balancing_type: Union[str, list[str]] = "none"
    """megatron's field: "none" (default here), "aux_loss", "seq_aux_loss", ..."""

    moe_router_bias_update_rate: float = 0.0
    """megatron's field: step of the aux-loss-free expert-bias update per global batch; 0 (the
    default here) keeps the expert bias as loaded."""

    moe_expert_swiglu_limits: Optional[list[Optional[float]]] = None
    """Per global layer, the ROUTED experts' SwiGLU clamp L (HF's ``swiglu_limits``):
    silu(gate).clamp(max=L) * up.clamp(-L, L); None or 0 = no clamp. ``swiglu_limits`` clamps the
    dense MLPs and, on MoE layers, the shared expert (HF's ``swiglu_limits_shared``). One entry
    per main layer, or ``num_layers + mtp_num_layers`` (HF's lists padded with MTP entries)."""

    attention_kernel: Literal["sdpa", "flex", "varlen"] = "sdpa"
    """Inner attention of the sdpa backend: torch scaled_dot_product_attention with a dense
    mask where one is needed ("sdpa"), or torch flex_attention with a block mask for causal,
    window and packed documents ("flex"), or torch's flash varlen kernel for packed batches
    ("varlen", CUDA only). Other backends ignore it."""

    # ------------------------------------------------------------ MTP (Step-3.5, see mtp.py)

    mtp_step35_heads: bool = True
    """With ``mtp_num_layers`` (megatron's field; HF ``num_nextn_predict_layers``): Step-3.5's
    MTP. Each depth has its own output head (``mtp.layers.{k}.output_layer``) and norm
    (``final_layernorm``), takes the main model's hidden state before the final norm and chains
    the previous depth's pre-norm output. False: megatron's own MTP (the main output layer for
    every depth, post-norm inputs). MTP layer k is global layer ``num_layers + k + 1`` of
    ``layer_types`` / ``swiglu_limits`` (lists of ``num_layers`` or ``num_layers +
    mtp_num_layers`` entries; with ``num_layers`` entries, MTP layers are sliding when
    ``layer_types`` is set, Step's rule, and unclamped)."""

    def __post_init__(self):
        from mcore_ext import moe

        moe.validate_moe_fields(self)  # before megatron's asserts, to name fields and values
        super().__post_init__()
        self._mcore_ext_post_init()

    def _mcore_ext_post_init(self):
        """mcore_ext's checks and derived fields, after megatron's ``__post_init__`` (a separate
        method: Megatron-Bridge's providers defer megatron's post-init to ``finalize()``, which
        calls megatron's by name, so they call this one from there)."""
        from mcore_ext import moe

        moe.validate_moe_clamps(self)
        if self.head_wise_attn_gate:
            self._validate_head_wise_attn_gate()
        self._validate_layer_kinds()
        if self.mtp_num_layers:
            self._validate_mtp()
        # Layers whose parameters differ in shape cannot share megatron's stacked checkpoint
        # tensors ([num_layers, ...]): save each layer under its own key, as megatron does for
        # heterogeneous blocks (TransformerBlock.sharded_state_dict). Values that do not change
        # shapes (window, RoPE, clamps) keep the stacked format.
        if self._kinds_differ_in_shape():
            self.heterogeneous_block_specs = True

    def _validate_head_wise_attn_gate(self):
        tp = self.tensor_model_parallel_size
        heads, groups, head_dim = self.num_attention_heads, self.num_query_groups, self.kv_channels

        if self.attention_output_gate:
            raise ValueError(
                "head_wise_attn_gate=True and attention_output_gate=True are mutually exclusive: "
                "choose the per-head scalar gate or the full head_dim gate"
            )
        for field in ("multi_latent_attention", "fused_single_qkv_rope", "qk_clip", "flash_decode"):
            if getattr(self, field):
                raise NotImplementedError(f"head_wise_attn_gate=True does not support {field}=True")

        # num_attention_heads and num_query_groups vs TP are validated by TransformerConfig; with
        # the gate appended per rank, the QKV rows must also split evenly on their own.
        qkv_rows = self.qkv_rows
        if qkv_rows % tp:
            raise ValueError(
                f"head_wise_attn_gate=True needs the {qkv_rows} QKV rows of linear_qkv "
                f"((num_attention_heads {heads} + 2 * num_query_groups {groups}) * kv_channels "
                f"{head_dim}) divisible by tensor_model_parallel_size ({tp})"
            )
        rows_per_rank = self.linear_qkv_rows // tp
        for recipe, alignment in _QUANT_ALIGNMENT.items():
            if getattr(self, recipe) and rows_per_rank % alignment:
                raise ValueError(
                    f"{recipe}={getattr(self, recipe)!r} needs the per-partition linear_qkv output "
                    f"dim to be a multiple of {alignment}, but with head_wise_attn_gate=True it is "
                    f"{rows_per_rank} ((QKV rows {qkv_rows} + gate rows {heads}) / "
                    f"tensor_model_parallel_size {tp})"
                )

    def _validate_layer_kinds(self):
        n, tp = self.num_layers, self.tensor_model_parallel_size
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention_kernel={self.attention_kernel!r} is not one of {ATTENTION_KERNELS}"
            )
        for field in ("rotary_percent", "sliding_rotary_percent"):
            value = getattr(self, field)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{field}={value} must be in (0, 1]")
        for field in ("rotary_base", "sliding_rotary_base"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"{field}={value} must be positive")
        lengths = self._per_layer_list_lengths()
        if self.swiglu_limits is not None:
            if len(self.swiglu_limits) not in lengths:
                raise ValueError(
                    f"swiglu_limits has {len(self.swiglu_limits)} entries, num_layers is {n}"
                    f"{self._mtp_phrase()}: give one per layer (None or 0 = no clamp)"
                )
            bad = [v for v in self.swiglu_limits if v is not None and v < 0]
            if bad:
                raise ValueError(f"swiglu_limits={self.swiglu_limits}: {bad[0]} is negative")
            if any(self.swiglu_limits) and not self.gated_linear_unit:
                raise ValueError(
                    "swiglu_limits clamps a SwiGLU MLP: it needs gated_linear_unit=True"
                )
        if self.layer_types is None:
            for field in ("sliding_num_attention_heads", "sliding_num_query_groups",
                          "sliding_rotary_base", "sliding_rotary_percent"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field}={getattr(self, field)} needs layer_types with "
                        "'sliding_attention' layers"
                    )
            return
        if len(self.layer_types) not in lengths:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers is {n}"
                f"{self._mtp_phrase()}: give one per layer, each one of {LAYER_TYPES}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"layer_types entry {unknown[0]!r} is not one of {LAYER_TYPES}"
            )
        sliding_numbers = [i for i in range(1, self.num_layers + (self.mtp_num_layers or 0) + 1)
                           if self.layer_type(i) == SLIDING_ATTENTION]
        if sliding_numbers and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValueError(
                f"layer_types has 'sliding_attention' layers (global layers {sliding_numbers}; "
                f"MTP layers without an entry are sliding): sliding_window must be at least 1, "
                f"got {self.sliding_window}"
            )
        if self.window_size is not None:
            raise ValueError(
                f"window_size={self.window_size} applies one window to every layer; with "
                "layer_types, give the sliding layers' window as sliding_window instead"
            )
        heads = self.sliding_num_attention_heads or self.num_attention_heads
        groups = self.sliding_num_query_groups or self.num_query_groups
        if heads < 1 or groups < 1:
            raise ValueError(
                f"sliding_num_attention_heads ({heads}) and sliding_num_query_groups ({groups}) "
                "must be at least 1"
            )
        if heads % tp:
            raise ValueError(
                f"sliding_num_attention_heads={heads} (sliding layers) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if groups % tp and tp % groups:  # megatron's rule for num_query_groups
            raise ValueError(
                f"sliding_num_query_groups={groups} (sliding layers) must be a multiple or divisor "
                f"of tensor_model_parallel_size ({tp})"
            )
        if heads % groups:
            raise ValueError(
                f"sliding_num_attention_heads ({heads}) must be divisible by "
                f"sliding_num_query_groups ({groups})"
            )

    def _per_layer_list_lengths(self) -> tuple:
        """Entries a per-layer list may have: one per main layer, or HF's padded lists with the
        MTP layers' entries last."""
        return (self.num_layers, self.num_layers + (self.mtp_num_layers or 0))

    def _mtp_phrase(self) -> str:
        return f", mtp_num_layers is {self.mtp_num_layers}" if self.mtp_num_layers else ""

    def _validate_mtp(self):
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers} must be >= 0")
        if not self.mtp_step35_heads:
            return
        # Step's depths differ from each other (own head, own layer kind): refuse megatron's
        # options that would share or detach them.
        for field in ("mtp_use_repeated_layer", "mtp_detach_heads"):
            if getattr(self, field, False):
                raise ValueError(
                    f"{field}=True is megatron's MTP option; with mtp_step35_heads=True every "
                    "depth has its own layer and output head: set mtp_step35_heads=False"
                )
        if self.pipeline_model_parallel_layout is not None:
            raise ValueError(
                "mtp_step35_heads=True places the MTP layers on the last pipeline stage: "
                "pipeline_model_parallel_layout is not supported with it"
            )

    def is_mtp_layer_number(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) is an MTP layer (after the main ones)."""
        return layer_number > self.num_layers

    def layer_type(self, layer_number: int) -> str:
        """The kind of global layer ``layer_number`` (1-based, as megatron counts; MTP layer k is
        ``num_layers + k + 1``)."""
        if self.layer_types is None:
            return FULL_ATTENTION
        if layer_number > len(self.layer_types):  # an MTP layer without its own entry
            return SLIDING_ATTENTION
        return self.layer_types[layer_number - 1]

    def swiglu_limit(self, layer_number: int) -> Optional[float]:
        """HF's SwiGLU clamp of global layer ``layer_number`` (1-based); None = no clamp."""
        if self.swiglu_limits is None or layer_number > len(self.swiglu_limits):
            return None
        return self.swiglu_limits[layer_number - 1] or None

    def moe_expert_swiglu_limit(self, layer_number: int) -> Optional[float]:
        """The routed experts' SwiGLU clamp of global layer ``layer_number`` (1-based); None = no
        clamp (also for layers past the list, e.g. MTP layers of a main-layers-only list)."""
        limits = self.moe_expert_swiglu_limits
        if limits is None or layer_number > len(limits):
            return None
        return limits[layer_number - 1] or None

    def get_config_for_layer(self, layer_number: int) -> "GatedTransformerConfig":
        """The config of global layer ``layer_number`` (1-based): this one for full layers, the
        sliding kind's for sliding layers (megatron's TransformerBlock calls this for
        heterogeneous blocks; mcore_ext's block spec passes the same config either way)."""
        if self.layer_type(layer_number) == FULL_ATTENTION:
            return self
        return self.sliding_config()

    def sliding_config(self) -> "GatedTransformerConfig":
        """The config every sliding layer is built with: heads, groups, window, RoPE of the
        sliding kind, as one plain layer config (no layer_types of its own)."""
        cached = self.__dict__.get("_sliding_config")
        if cached is None:
            window = self.sliding_window
            cached = dataclasses.replace(
                self,
                num_attention_heads=self.sliding_num_attention_heads or self.num_attention_heads,
                num_query_groups=self.sliding_num_query_groups or self.num_query_groups,
                rotary_base=(self.sliding_rotary_base if self.sliding_rotary_base is not None
                             else self.rotary_base),
                rotary_percent=(self.sliding_rotary_percent
                                if self.sliding_rotary_percent is not None
                                else self.rotary_percent),
                # megatron's (left, right) window: keys i - (W - 1) .. i, HF's i - W < j <= i.
                window_size=(window - 1, 0),
                layer_types=None, sliding_window=None, sliding_num_attention_heads=None,
                sliding_num_query_groups=None, sliding_rotary_base=None,
                sliding_rotary_percent=None, swiglu_limits=None, moe_expert_swiglu_limits=None,
                heterogeneous_block_specs=False,
                # megatron's fused GPU softmax (local backend) ignores window_size; its torch
                # softmax applies it.
                masked_softmax_fusion=False,
            )
            self.__dict__["_sliding_config"] = cached
        return cached

    def _kinds_differ_in_shape(self) -> bool:
        if self.layer_types is None or SLIDING_ATTENTION not in self.layer_types:
            return False
        return (
            (self.sliding_num_attention_heads or self.num_attention_heads)
            != self.num_attention_heads
            or (self.sliding_num_query_groups or self.num_query_groups) != self.num_query_groups
        )

    # The rows of linear_qkv, counted once here for the attention module, FLOP counters and
    # checks. Global (all TP ranks together); each rank holds 1 / tensor_model_parallel_size.

    @property
    def qkv_rows(self) -> int:
        """linear_qkv output rows for Q, K and V: (num_attention_heads + 2 * num_query_groups) *
        kv_channels (megatron's own layout, without the gate)."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    @property
    def head_wise_gate_rows(self) -> int:
        """Extra linear_qkv output rows added by the gate (0 when it is off)."""
        return self.num_attention_heads if self.head_wise_attn_gate else 0

    @property
    def linear_qkv_rows(self) -> int:
        """All linear_qkv output rows: ``qkv_rows + head_wise_gate_rows``."""
        return self.qkv_rows + self.head_wise_gate_rows

    @property
    def effective_head_wise_attn_gate_init_bias(self) -> float:
        """The value the gate bias rows start at: ``head_wise_attn_gate_init_bias`` when
        linear_qkv has a bias, else 0.0 (no bias rows: gate logits start at x @ w_gate alone).
        0.0 too when the gate is off. Where it differs from ``head_wise_attn_gate_init_bias``, the
        configured value has no effect (the attention module warns once)."""
        if self.head_wise_attn_gate and self._linear_qkv_has_bias:
            return self.head_wise_attn_gate_init_bias
        return 0.0

    @property
    def _linear_qkv_has_bias(self) -> bool:
        # SelfAttention builds linear_qkv with bias=add_bias_linear or add_qkv_bias.
        return bool(self.add_bias_linear or self.add_qkv_bias)
