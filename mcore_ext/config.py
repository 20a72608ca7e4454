"""Transformer config with the head-wise attention output gate (Step-3.5-Flash ``g_proj``)."""

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

# Per-partition GEMM output dims that FP8 / FP4 kernels accept.
_QUANT_ALIGNMENT = {"fp8": 16, "fp4": 32}


@dataclass
class GatedTransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus a learned sigmoid gate per attention head.

    With ``head_wise_attn_gate`` on, ``linear_qkv`` gets ``num_attention_heads`` extra output
    rows and every head's attention output is scaled by ``sigmoid(x @ w_gate_h + b_gate_h)``
    before ``linear_proj``. With it off, this config behaves exactly like ``TransformerConfig``.

    ``head_wise_attn_gate`` has the name and meaning of upstream Megatron-LM dev's field. The two
    init fields exist only here (upstream's init surgery, PR #4848, was not merged); dev's gates
    start near sigmoid(0) = 0.5: ``head_wise_attn_gate_init_weight_scale=1.0`` and
    ``head_wise_attn_gate_init_bias=0.0`` give the same init distribution.
    """

    head_wise_attn_gate: bool = False
    """Gate each attention head's output with one learned sigmoid scalar (fused into linear_qkv)."""

    head_wise_attn_gate_init_weight_scale: float = 0.1
    """Gate weight rows are scaled by this after init, so gate logits start small (not in
    upstream dev, which keeps the init of linear_qkv: 1.0 here)."""

    head_wise_attn_gate_init_bias: float = 2.0
    """Gate bias rows start at this value (sigmoid(2.0) ~ 0.88; not in upstream dev, whose gate
    biases start at 0: 0.0 here). Needs a linear_qkv bias (add_qkv_bias or add_bias_linear):
    without one there are no bias rows, the value is kept but has no effect
    (``effective_head_wise_attn_gate_init_bias`` is then 0.0, gates start near sigmoid(0) = 0.5)
    and building the attention warns once."""

    def __post_init__(self):
        super().__post_init__()
        if self.head_wise_attn_gate:
            self._validate_head_wise_attn_gate()

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
