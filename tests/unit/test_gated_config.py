"""GatedTransformerConfig validation: every rule with a failing and a passing case."""

import pytest

from mcore_ext import GatedTransformerConfig


def make(**overrides):
    fields = dict(num_layers=1, hidden_size=64, num_attention_heads=8, head_wise_attn_gate=True)
    fields.update(overrides)
    return GatedTransformerConfig(**fields)


def test_flag_off_by_default_and_adds_no_rows():
    config = GatedTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8)
    assert config.head_wise_attn_gate is False
    assert config.head_wise_gate_rows == 0
    # The released gates' start (docs/gate-training.md): rows drawn like QKV rows, bias 0.
    assert (config.head_wise_attn_gate_init_weight_scale, config.head_wise_attn_gate_init_bias) == (1.0, 0.0)


def test_flag_off_accepts_what_the_gate_rejects():
    # Rules of the gate do not apply to ungated models (6 QKV rows over 4 ranks, see below).
    make(head_wise_attn_gate=False, hidden_size=4, num_attention_heads=4, num_query_groups=1,
         tensor_model_parallel_size=4)


def test_linear_qkv_row_counts():
    # 8 heads, 2 groups, head dim 8: Q 64 + K 16 + V 16 = 96 rows, plus one gate row per head.
    config = make(num_query_groups=2)
    assert (config.qkv_rows, config.head_wise_gate_rows, config.linear_qkv_rows) == (96, 8, 104)
    plain = make(num_query_groups=2, head_wise_attn_gate=False)
    assert (plain.qkv_rows, plain.head_wise_gate_rows, plain.linear_qkv_rows) == (96, 0, 96)
    # kv_channels set apart from hidden_size / heads: (4 + 2 * 4) * 24 + 4.
    assert make(num_attention_heads=4, kv_channels=24).linear_qkv_rows == 292


@pytest.mark.parametrize(
    "fields, effective",
    [
        (dict(add_qkv_bias=True, head_wise_attn_gate_init_bias=2.0), 2.0),
        (dict(add_bias_linear=True, head_wise_attn_gate_init_bias=2.0), 2.0),
        (dict(add_qkv_bias=True, head_wise_attn_gate_init_bias=-1.5), -1.5),
        (dict(add_qkv_bias=False, add_bias_linear=False, head_wise_attn_gate_init_bias=2.0),
         0.0),  # no bias rows to fill
        (dict(add_qkv_bias=True, head_wise_attn_gate=False, head_wise_attn_gate_init_bias=2.0),
         0.0),  # no gate rows
    ],
)
def test_effective_init_bias_needs_a_linear_qkv_bias(fields, effective):
    config = make(**fields)
    assert config.effective_head_wise_attn_gate_init_bias == effective
    assert config.head_wise_attn_gate_init_bias == fields["head_wise_attn_gate_init_bias"]


def test_output_gate_is_mutually_exclusive():
    with pytest.raises(ValueError, match="attention_output_gate=True are mutually exclusive"):
        make(attention_output_gate=True)
    assert make(attention_output_gate=False).head_wise_gate_rows == 8


# Heads and groups vs TP are megatron's own rules; they must still hold with the gate on.
def test_heads_must_divide_by_tp():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tensor_model_parallel_size \(4\)"):
        make(hidden_size=48, num_attention_heads=6, num_query_groups=6, tensor_model_parallel_size=4)
    make(hidden_size=48, num_attention_heads=6, num_query_groups=6, tensor_model_parallel_size=2)


def test_groups_at_least_tp_must_divide_by_tp():
    with pytest.raises(ValueError, match=r"num_query_groups \(6\).*tensor_model_parallel_size \(4\)"):
        make(hidden_size=96, num_attention_heads=12, num_query_groups=6, tensor_model_parallel_size=4)
    make(hidden_size=96, num_attention_heads=12, num_query_groups=4, tensor_model_parallel_size=4)


def test_groups_below_tp_must_divide_tp():
    with pytest.raises(ValueError, match=r"num_query_groups \(3\).*tensor_model_parallel_size \(4\)"):
        make(hidden_size=96, num_attention_heads=12, num_query_groups=3, tensor_model_parallel_size=4)
    make(num_query_groups=2, tensor_model_parallel_size=4)  # supported (upstream rejects it)


def test_qkv_rows_must_split_evenly():
    # (4 heads + 2 * 1 group) * kv_channels 1 = 6 QKV rows do not split over 4 ranks.
    with pytest.raises(ValueError, match=r"the 6 QKV rows of linear_qkv"):
        make(hidden_size=4, num_attention_heads=4, num_query_groups=1, tensor_model_parallel_size=4)
    make(hidden_size=8, num_attention_heads=4, num_query_groups=1, tensor_model_parallel_size=4)


@pytest.mark.parametrize("recipe, value, alignment", [("fp8", "e4m3", 16), ("fp4", "e2m1", 32)])
def test_quantized_gemm_alignment(recipe, value, alignment):
    # 8 heads, hn 8: QKV 192 rows + 8 gate rows = 200 per rank at TP=1: not a multiple of 16 or 32.
    with pytest.raises(ValueError, match=rf"{recipe}='{value}' needs .* multiple of {alignment}.* 200"):
        make(**{recipe: value})
    # 32 heads, kv_channels 15: (32 + 2 * 32) * 15 + 32 = 1472 rows, a multiple of 16 and 32.
    # The config is accepted (megatron checks Transformer Engine when layers are built, not here).
    aligned = make(hidden_size=256, num_attention_heads=32, kv_channels=15, **{recipe: value})
    assert getattr(aligned, recipe) == value
    assert aligned.linear_qkv_rows == 1472 and aligned.linear_qkv_rows % alignment == 0


def test_quantized_alignment_counts_rows_per_rank():
    # 16 heads, head dim 2: (16 + 2 * 16) * 2 + 16 = 112 rows, a multiple of 16 at TP 1, but
    # 56 per rank at TP 2.
    shape = dict(hidden_size=32, num_attention_heads=16, kv_channels=2, fp8="e4m3")
    assert make(**shape).linear_qkv_rows == 112
    with pytest.raises(ValueError, match=r"multiple of 16, .* it is 56 \(\(QKV rows 96 \+ gate rows 16\) / "
                                         r"tensor_model_parallel_size 2\)"):
        make(**shape, tensor_model_parallel_size=2)


@pytest.mark.parametrize("field", ["multi_latent_attention", "fused_single_qkv_rope", "qk_clip", "flash_decode"])
def test_unsupported_combinations_are_rejected(field):
    with pytest.raises(NotImplementedError, match=f"does not support {field}=True"):
        make(**{field: True})
    make(**{field: False})
