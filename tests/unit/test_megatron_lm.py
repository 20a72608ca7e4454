"""Megatron-LM's flags -> GatedTransformerConfig -> GatedGPTModelConfig -> model, on 2 gloo ranks.

The reference for the megatron.training path is mcore_ext's own API: a GatedTransformerConfig
written field by field and ``mcore_ext.build_gpt_model`` (whose numerics tests/unit/
test_layer_kinds.py checks against plain PyTorch). Both are built from the same seed, so the two
models must have identical parameters and identical logits (exact equality, fp32, same code).
"""

import argparse

import pytest

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")

# Tiny Step-3.5-like model: both layer kinds, gate, clamps, per-kind RoPE, GQA, TP 2.
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "64",
    "--position-embedding-type", "rope", "--no-rope-fusion", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--swiglu", "--disable-bias-linear",
    "--no-bias-swiglu-fusion", "--normalization", "RMSNorm",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
    "--rotary-base", "500000", "--untie-embeddings-and-output-weights",
    "--head-wise-attn-gate", "--head-wise-attn-gate-init-weight-scale", "0.5",
    "--head-wise-attn-gate-init-bias", "1.5", "--add-qkv-bias",
    "--layer-types", "sliding_attention", "full_attention", "--sliding-window", "4",
    "--sliding-rotary-base", "10000", "--sliding-rotary-percent", "0.5",
    "--swiglu-limits", "0", "7.5", "--mcore-ext-backend", "sdpa",
]
EXPECTED = dict(
    head_wise_attn_gate=True, head_wise_attn_gate_init_weight_scale=0.5,
    head_wise_attn_gate_init_bias=1.5, layer_types=["sliding_attention", "full_attention"],
    sliding_window=4, sliding_rotary_base=10000.0, sliding_rotary_percent=0.5,
    swiglu_limits=[0.0, 7.5], rotary_base=500000, add_qkv_bias=True,
)


def _megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    from mcore_ext.megatron_lm import add_mcore_ext_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_mcore_ext_args(add_megatron_arguments(parser))


def _parse(flags, world_size):
    """megatron's parse + validate of ``flags`` (validate_args reads the GPU's architecture when
    TP > 1: under mcore_ext's CPU adaptation)."""
    import os

    from megatron.training.arguments import validate_args

    from mcore_ext import _cpu_compat

    args = _megatron_parser().parse_args(flags)
    args.rank, args.world_size = int(os.environ.get("RANK", 0)), world_size
    with _cpu_compat.megatron_training_on_cpu():
        validate_args(args, {})
    return args


def test_every_field_mcore_ext_adds_has_a_flag():
    from mcore_ext.megatron_lm import mcore_ext_fields

    parser = _megatron_parser()
    dests = {action.dest for action in parser._actions}
    fields = [field.name for field in mcore_ext_fields()]
    assert "head_wise_attn_gate" in fields and "layer_types" in fields
    assert not [name for name in fields if name not in dests]
    assert "mcore_ext_backend" in dests


def test_a_native_flag_of_the_same_name_is_kept():
    from mcore_ext.megatron_lm import add_mcore_ext_args

    parser = argparse.ArgumentParser()
    # A Megatron-LM with its own gate flag (dev) and rotary base (every release).
    native_gate = parser.add_argument("--head-wise-attn-gate", action="store_true")
    parser.add_argument("--rotary-base", type=int, default=10000)
    add_mcore_ext_args(parser)
    assert parser._option_string_actions["--head-wise-attn-gate"] is native_gate
    assert [a.dest for a in parser._actions].count("rotary_base") == 1
    assert parser.parse_args(["--head-wise-attn-gate"]).head_wise_attn_gate is True


def test_unknown_backend_is_refused():
    with pytest.raises(SystemExit):
        _megatron_parser().parse_args(["--mcore-ext-backend", "flash"])


def _sample_based(*flags):
    swapped = [f for f in FLAGS]
    at = swapped.index("--train-iters")
    swapped[at:at + 2] = ["--train-samples", "8"]
    return _parse([*swapped, *flags], world_size=2)


def test_learning_rate_schedule_is_checked_without_changing_the_flags():
    """The entry builds megatron's own scheduler from the flags before any process group; a
    sample-based run keeps its flags as given (megatron's builder derives --train-iters on the
    args it reads: before, that landed in the run's config next to --train-samples)."""
    from megatron.training import global_vars

    from mcore_ext.megatron_lm.pretrain_gpt import FlagError, check_learning_rate_schedule

    args = _sample_based("--lr-warmup-samples", "2")
    before = dict(vars(args))
    global_vars.set_args(args)
    try:
        check_learning_rate_schedule(args)
        assert vars(args) == before and args.train_iters is None
        assert global_vars.get_args() is args
        with pytest.raises(AssertionError):  # megatron's: warm-up samples below decay samples
            check_learning_rate_schedule(_sample_based("--lr-warmup-samples", "8"))
        at = FLAGS.index("--train-iters")
        iteration_based = _parse([*FLAGS[:at], "--train-iters", "3", *FLAGS[at + 2:],
                                  "--lr-warmup-iters", "3"], world_size=2)
        with pytest.raises(FlagError, match="--lr-warmup-iters 3 must be below --train-iters 3"):
            check_learning_rate_schedule(iteration_based)
    finally:
        global_vars.set_args(None)


def test_spec_flag_is_refused():
    from mcore_ext.megatron_lm import gated_gpt_config_from_args

    args = _parse([*FLAGS, "--tensor-model-parallel-size", "1",
                   "--spec", "some.module", "some_spec"], world_size=1)
    with pytest.raises(ValueError, match="transformer_layer_spec"):
        gated_gpt_config_from_args(args)


def _build_both(seed=7):
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection

    import mcore_ext
    from mcore_ext.megatron_lm import GatedGPTModelBuilder, GatedGPTModelConfig
    from mcore_ext.megatron_lm import gated_gpt_config_from_args

    args = _parse(FLAGS, world_size=2)
    model_config = gated_gpt_config_from_args(args)
    config = model_config.transformer
    from mcore_ext.runtime import set_seed

    mcore_ext.init_parallel(tensor_model_parallel_size=2, seed=seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    set_seed(seed)
    via_megatron = GatedGPTModelBuilder(model_config).build_model(pgs)
    # megatron.training's serialisation: as_dict drops callables, from_dict rebuilds the classes.
    restored = GatedGPTModelConfig.from_dict(model_config.as_dict())
    restored.transformer.activation_func = F.silu  # a callable: not serialised (megatron's rule)
    set_seed(seed)
    via_roundtrip = GatedGPTModelBuilder(restored).build_model(pgs)
    set_seed(seed)
    reference_config = mcore_ext.GatedTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, tensor_model_parallel_size=2, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, add_qkv_bias=True,
        head_wise_attn_gate=True, head_wise_attn_gate_init_weight_scale=0.5,
        head_wise_attn_gate_init_bias=1.5, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, rotary_base=500000.0, sliding_rotary_base=10000.0,
        sliding_rotary_percent=0.5, swiglu_limits=[0.0, 7.5], apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    reference = mcore_ext.build_gpt_model(
        reference_config, vocab_size=128, max_sequence_length=16, backend="sdpa"
    )
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    return model_config, restored, via_megatron, via_roundtrip, reference, tokens, positions


def _check_flags_config_model_forward():
    import torch

    from mcore_ext import HeadWiseGatedSelfAttention
    from mcore_ext.megatron_lm import GatedGPTModelConfig

    model_config, restored, via_megatron, via_roundtrip, reference, tokens, positions = (
        _build_both()
    )
    assert type(model_config) is GatedGPTModelConfig and type(restored) is GatedGPTModelConfig
    for name, value in EXPECTED.items():
        assert getattr(model_config.transformer, name) == value, name
        assert getattr(restored.transformer, name) == value, f"{name} after as_dict/from_dict"
    assert model_config.rotary_base == restored.rotary_base == 500000
    assert restored.mcore_ext_backend == "sdpa"

    layers = via_megatron.decoder.layers
    assert all(isinstance(layer.self_attention, HeadWiseGatedSelfAttention) for layer in layers)
    # per rank: ((4 + 2 * 2) * 16 QKV rows + 4 gate rows) / TP 2
    assert layers[0].self_attention.linear_qkv.weight.shape == (66, 64)

    results = []
    for model in (via_megatron, via_roundtrip, reference):
        state = model.state_dict()
        results.append(({k: v for k, v in state.items() if torch.is_tensor(v)},
                        model(tokens, positions, None).detach()))
    reference_params, reference_logits = results[2]
    for name, (params, logits) in zip(("flags", "as_dict/from_dict"), results[:2]):
        assert params.keys() == reference_params.keys(), name
        differ = [k for k in params if not torch.equal(params[k], reference_params[k])]
        assert not differ, f"{name}: {differ}"
        assert torch.equal(logits, reference_logits), name
    return results[0][1].abs().max().item()


def test_flags_config_model_forward_on_two_ranks(run_distributed):
    maxima = run_distributed(_check_flags_config_model_forward, world_size=2)
    assert all(value > 0 for value in maxima)
