"""The launcher's Step-3.5 fields: opt-in, validated with errors naming the keys, shipped configs."""

from pathlib import Path

import pytest
import torch

from mcore_ext.training.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "step35_tiny_cpu.yaml")
FLASH = str(CONFIGS / "step35_flash_dense.yaml")


def test_step35_fields_are_opt_in():
    from mcore_ext.run_config.megatron_configs import transformer_config

    config = transformer_config(load_config(str(CONFIGS / "tiny_cpu.yaml"), world_size=2))
    assert config.layer_types is None and config.swiglu_limits is None
    assert not config.layernorm_zero_centered_gamma and config.attention_kernel == "sdpa"
    assert not config.heterogeneous_block_specs  # megatron's stacked checkpoint keys as before


def test_flash_dense_config_has_step35_flash_attention():
    from mcore_ext.run_config.megatron_configs import transformer_config

    # Validated as on 8 GPUs at TP 8 (flex trains on a GPU only; sdpa validates here too).
    cfg = load_config(FLASH, ["parallelism.tensor_model_parallel_size=8",
                              "model.attention_kernel=sdpa"], world_size=8)
    m = cfg.model
    assert (m.num_attention_heads, m.sliding_num_attention_heads, m.num_query_groups,
            m.kv_channels, m.sliding_window) == (64, 96, 8, 128, 512)
    assert (m.rotary_base, m.rotary_percent, m.sliding_rotary_base) == (5e6, 0.5, 1e4)
    config = transformer_config(cfg)
    sliding = config.get_config_for_layer(2)
    assert sliding.window_size == (511, 0) and sliding.num_attention_heads == 96
    assert config.layernorm_zero_centered_gamma and config.qk_layernorm
    assert config.head_wise_attn_gate and not config.add_qkv_bias


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_flex_kernel_is_refused_for_training_on_a_cpu():
    with pytest.raises(ConfigError, match="flex trains on a GPU only"):
        load_config(FLASH, world_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["model.layer_types=[full_attention]"],
     "layer_types has 1 entries, num_layers is 4"),
    (["model.layer_types=[full_attention, swa, full_attention, full_attention]"],
     "layer_types entry 'swa' is not one of"),
    (["model.sliding_window=null"], "sliding_window must be at least 1"),
    (["model.sliding_num_attention_heads=5"],
     "sliding_num_attention_heads=5 (sliding layers) must be divisible by "
     "tensor_model_parallel_size (2)"),
    (["model.swiglu_limits=[1.0]"], "swiglu_limits has 1 entries"),
    (["model.swiglu_limits=[0, 0, 0, lots]"], "model.swiglu_limits[3]='lots' has type str"),
    (["model.swiglu=false"], "model.swiglu_limits clamps a SwiGLU MLP"),
    (["model.attention_kernel=flex", "model.attention_backend=local"],
     "model.attention_kernel=flex is the sdpa backend's kernel"),
    (["model.rotary_percent=1.5"], "rotary_percent=1.5 must be in (0, 1]"),
])
def test_bad_step35_fields_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides, world_size=2)
    assert message in str(err.value)


def test_flops_count_each_kind_and_the_window():
    from mcore_ext.training.loop import flops_per_iteration
    from mcore_ext.run_config.megatron_configs import transformer_config

    cfg = load_config(TINY, world_size=2)
    m, t = cfg.model, cfg.training
    config = transformer_config(cfg)
    kinds = flops_per_iteration(config, 384, m.seq_length, t.global_batch_size)
    cfg.model.layer_types = None
    cfg.model.sliding_num_attention_heads = cfg.model.sliding_rotary_base = None
    cfg.model.sliding_rotary_percent = None
    full = flops_per_iteration(transformer_config(cfg), 384, m.seq_length, t.global_batch_size)
    s, w, hn, h = m.seq_length, m.sliding_window, m.kv_channels, m.hidden_size
    per_token = 3 * (  # three sliding layers: 6 heads, window 16 instead of 4 heads, causal
        h * (config.get_config_for_layer(2).linear_qkv_rows - config.linear_qkv_rows)
        + 2 * hn * (6 * sum(min(i + 1, w) for i in range(s)) / s - 4 * s / 2)
        + 2 * hn * h
    )
    assert kinds - full == pytest.approx(6 * per_token * t.global_batch_size * s)


def test_flops_of_moe_and_mtp_follow_the_formula():
    """flops_per_iteration of configs/step35_moe_tiny_cpu.yaml (MoE layers 2-4, one MTP depth)
    against the count written out here from the config's numbers, layer by layer, in
    multiply-adds per token (x 2 FLOPs x 3 for forward + backward x tokens). Megatron's
    convention: causal attention counts half of the s x s scores; a window of w keys counts
    min(i + 1, w) keys for query i."""
    from mcore_ext.training.loop import flops_per_iteration
    from mcore_ext.run_config.megatron_configs import transformer_config

    cfg = load_config(str(CONFIGS / "step35_moe_tiny_cpu.yaml"), world_size=4)
    t = cfg.training
    h, s, vocab, hn, groups = 64, 64, 256, 16, 2
    assert (cfg.model.hidden_size, cfg.model.seq_length, cfg.model.kv_channels,
            cfg.model.num_query_groups) == (h, s, hn, groups)

    def attention(heads, keys):
        qkv_and_gate = h * (heads * hn + 2 * groups * hn + heads)  # Q, K, V, one gate row a head
        return qkv_and_gate + 2 * heads * hn * keys + heads * hn * h  # QK^T, PV; linear_proj

    full = attention(heads=4, keys=s / 2)
    sliding = attention(heads=6, keys=sum(min(i + 1, 16) for i in range(s)) / s)
    dense_mlp = 3 * h * 128  # SwiGLU: fc1 (gate and up) 2 h ffn, fc2 ffn h
    moe_mlp = (h * 8  # router over 8 experts
               + 2 * 3 * h * 32  # top-2 routed experts of width 32
               + 3 * h * 32)  # the shared expert
    main = (full + dense_mlp) + 3 * (sliding + moe_mlp)  # layer 1 full/dense, 2-4 sliding/MoE
    mtp = 2 * h * h + (sliding + dense_mlp) + h * vocab  # eh_proj, its (dense) layer, its head
    macs_per_token = main + h * vocab + mtp
    expected = 3 * 2 * macs_per_token * t.global_batch_size * s
    got = flops_per_iteration(transformer_config(cfg), vocab, s, t.global_batch_size)
    assert got == pytest.approx(expected, rel=1e-12)
