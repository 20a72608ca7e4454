"""Megatron-LM's flags -> GatedTransformerConfig -> GatedGPTModelConfig -> model, on 2 gloo ranks
(with ``--hybrid-layer-pattern``: GatedHybridModelConfig -> HybridModel).

The reference for the megatron.training path is mcore_ext's own API: a GatedTransformerConfig
written field by field and ``mcore_ext.build_gpt_model`` (whose numerics tests/unit/
test_layer_kinds.py checks against plain PyTorch) or ``mcore_ext.build_hybrid_model``. Both are
built from the same seed, so the two models must have identical parameters and identical logits
(exact equality, fp32, same code); the hybrid one's weights, copied into the GPT reference, give
its logits (fp32, 1e-5: tests/unit/test_hybrid_model.py proves hybrid == GPT per layout). With
MTP (``--mtp-num-layers``, or the pattern's ``/`` depths) also each depth's logits and the MTP
loss, which equals the depth logits' cross entropy written in plain PyTorch.
"""

import argparse
import contextlib
import io

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


def test_sft_flag_is_refused_in_one_line():
    """megatron's --sft would train on its SFTDataset's packed rows without their document
    boundaries (this entry's get_batch builds no PackedSeqParams): refused, with the way that
    fine-tunes on chat data."""
    from mcore_ext.megatron_lm.pretrain_gpt import FlagError, check_data_flags

    check_data_flags(_parse([*FLAGS, "--tensor-model-parallel-size", "1"], world_size=1))
    with pytest.raises(FlagError) as error:
        check_data_flags(_parse([*FLAGS, "--tensor-model-parallel-size", "1", "--sft"],
                                world_size=1))
    assert str(error.value).startswith("--sft: megatron's SFTDataset") and \
        "data.source: chat" in str(error.value) and "\n" not in str(error.value)


def test_spec_flag_is_refused():
    from mcore_ext.megatron_lm import gated_gpt_config_from_args

    args = _parse([*FLAGS, "--tensor-model-parallel-size", "1",
                   "--spec", "some.module", "some_spec"], world_size=1)
    with pytest.raises(ValueError, match="transformer_layer_spec"):
        gated_gpt_config_from_args(args)


def _reference_config(**overrides):
    """The GatedTransformerConfig FLAGS describe, written field by field (and ``overrides``)."""
    import torch.nn.functional as F

    import mcore_ext

    return mcore_ext.GatedTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, tensor_model_parallel_size=2, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, add_qkv_bias=True,
        head_wise_attn_gate=True, head_wise_attn_gate_init_weight_scale=0.5,
        head_wise_attn_gate_init_bias=1.5, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, rotary_base=500000.0, sliding_rotary_base=10000.0,
        sliding_rotary_percent=0.5, swiglu_limits=[0.0, 7.5], apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **overrides,
    )


def _build_both(seed=7, hybrid=False):
    """(model config, its as_dict / from_dict copy, the model of each, the reference model, tokens,
    positions): FLAGS (with HYBRID_FLAGS: the hybrid model) through megatron.training's path,
    and mcore_ext's API, each from ``seed``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection

    import mcore_ext
    from mcore_ext.megatron_lm import model as megatron_lm_model
    from mcore_ext.megatron_lm.pretrain_gpt import given_layer_flags
    from mcore_ext.runtime import set_seed

    flags = [*FLAGS, *HYBRID_FLAGS] if hybrid else FLAGS
    args = _parse(flags, world_size=2)
    if hybrid:
        model_config = megatron_lm_model.gated_hybrid_config_from_args(
            args, **given_layer_flags(flags))
        builder, build = megatron_lm_model.GatedHybridModelBuilder, mcore_ext.build_hybrid_model
    else:
        model_config = megatron_lm_model.gated_gpt_config_from_args(args)
        builder, build = megatron_lm_model.GatedGPTModelBuilder, mcore_ext.build_gpt_model

    mcore_ext.init_parallel(tensor_model_parallel_size=2, seed=seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    set_seed(seed)
    via_megatron = builder(model_config).build_model(pgs)
    # megatron.training's serialisation: as_dict drops callables, from_dict rebuilds the classes.
    restored = type(model_config).from_dict(model_config.as_dict())
    restored.transformer.activation_func = F.silu  # a callable: not serialised (megatron's rule)
    set_seed(seed)
    via_roundtrip = builder(restored).build_model(pgs)
    set_seed(seed)
    reference = build(_reference_config(), vocab_size=128, max_sequence_length=16, backend="sdpa")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    return model_config, restored, via_megatron, via_roundtrip, reference, tokens, positions


def _check_flags_config_model_forward():
    from mcore_ext import HeadWiseGatedSelfAttention
    from mcore_ext.megatron_lm import GatedGPTModelConfig

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        model_config, restored, via_megatron, via_roundtrip, reference, tokens, positions = (
            _build_both()
        )
    # GPTModels built in-process (megatron.training's builder, mcore_ext's API): the entry's
    # deprecation notice is main()'s, once per run, never per model built.
    assert "GPTModel is deprecated" not in printed.getvalue()
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

    return _assert_same_models(via_megatron, via_roundtrip, reference, tokens,
                               positions).abs().max().item()


def _assert_same_models(via_megatron, via_roundtrip, reference, tokens, positions):
    """The models built from the flags and from as_dict/from_dict hold the reference's tensors
    and compute its logits, bit for bit; returns the flags model's logits."""
    import torch

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
    return results[0][1]


def test_flags_config_model_forward_on_two_ranks(run_distributed):
    maxima = run_distributed(_check_flags_config_model_forward, world_size=2)
    assert all(value > 0 for value in maxima)


HYBRID_FLAGS = ["--hybrid-layer-pattern", "*-*-"]


def _check_hybrid_flags_build_the_hybrid_model():
    """The hybrid entry's model is build_hybrid_model's for the same config (parameters and
    logits equal), and computes the GPT reference's logits for the same weights."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    import mcore_ext
    from mcore_ext import HeadWiseGatedSelfAttention
    from mcore_ext.megatron_lm import GatedHybridModelConfig
    from mcore_ext.models.hybrid import copy_weights
    from mcore_ext.runtime import set_seed

    model_config, restored, via_megatron, via_roundtrip, reference, tokens, positions = (
        _build_both(hybrid=True)
    )
    assert type(model_config) is GatedHybridModelConfig and type(restored) is GatedHybridModelConfig
    for config in (model_config, restored):
        assert config.hybrid_layer_pattern == "*-*-" and config.transformer.num_layers == 2
        assert not config.transformer.is_hybrid_model  # GPT's output-layer init (see model.py)
        for name, value in EXPECTED.items():
            assert getattr(config.transformer, name) == value, name
    assert restored.mcore_ext_backend == "sdpa" and restored.rotary_base == 500000
    assert isinstance(via_megatron, HybridModel)
    layers = via_megatron.decoder.layers
    assert [type(layer.self_attention) is HeadWiseGatedSelfAttention for layer in layers] == [
        True, False, True, False]
    assert layers[0].self_attention.linear_qkv.weight.shape == (66, 64)

    # The reference's logits, which the entry's models gave bit for bit.
    reference_logits = _assert_same_models(via_megatron, via_roundtrip, reference, tokens,
                                           positions)
    set_seed(11)  # other weights than the hybrid model's, overwritten by its own
    gpt = mcore_ext.build_gpt_model(_reference_config(), vocab_size=128, max_sequence_length=16,
                                    backend="sdpa")
    copy_weights(via_megatron, gpt, to_hybrid=False)
    gpt_logits = gpt(tokens, positions, None).detach()
    return (reference_logits - gpt_logits).abs().max().item(), reference_logits.abs().max().item()


def test_hybrid_flags_build_the_hybrid_model_on_two_ranks(run_distributed):
    for gpt_diff, scale in run_distributed(_check_hybrid_flags_build_the_hybrid_model,
                                           world_size=2):
        assert scale > 0 and gpt_diff <= 1e-5, (gpt_diff, scale)


# Megatron-LM's two spellings of one MTP depth on HybridModel: the pattern's '/' depth, and
# --mtp-num-layers (to which the entry adds Step-3.5's depth, '/*-', as the launcher does).
MTP_SPELLINGS = (("--hybrid-layer-pattern", "*-*-/*-"),
                 ("--hybrid-layer-pattern", "*-*-", "--mtp-num-layers", "1"))


def _gathered_outputs(model, tokens, positions, labels):
    """(main logits, each MTP depth's logits, both gathered over TP; the per-token loss and the
    MTP depths' losses of a forward with ``labels``, megatron's tracker)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

    from mcore_ext import _mcore_compat
    from mcore_ext.models.mtp_model import mtp_logits

    depths = [gather(logits) for logits in mtp_logits(model, tokens, positions)]
    logits = gather(model(tokens, positions, None))
    _mcore_compat.take_mtp_losses(1)  # HybridModel's forwards above track theirs, from input_ids
    loss = model(tokens, positions, None, labels=labels)
    return (logits.detach(), [d.detach() for d in depths], loss.detach(),
            _mcore_compat.take_mtp_losses(1))


def _check_hybrid_mtp_flags_build_the_gpt_entrys_mtp_model():
    """Both MTP spellings build one HybridModel (every parameter equal from one seed; the
    pattern '*-*-/*-', Step-3.5's depth: own head, global layer 3, sliding as Step's rule makes
    an MTP layer of a 2-entry --layer-types), build_hybrid_model's (the launcher's). The GPT
    entry's --mtp-num-layers 1 model is build_gpt_model's (test_mtp checks its depths against
    plain PyTorch). With the hybrid model's weights the GPT entry's model gives its main and
    depth logits, per-token loss and MTP loss; the MTP loss is the depth logits' cross entropy
    with the labels shifted once more (plain PyTorch: labels t + 1, the last position
    masked)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    import mcore_ext
    from mcore_ext.megatron_lm import model as megatron_lm_model
    from mcore_ext.megatron_lm.pretrain_gpt import given_layer_flags
    from mcore_ext.models.hybrid import copy_weights
    from mcore_ext.runtime import set_seed

    mcore_ext.init_parallel(tensor_model_parallel_size=2, seed=7)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    MTPLossLoggingHelper.tracker.clear()  # sized by the first model of the process to track
    build = dict(vocab_size=128, max_sequence_length=16, backend="sdpa")

    def tensors(model):
        return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}

    def same(a, b):
        a, b = tensors(a), tensors(b)
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    gpt_flags = [*FLAGS, "--mtp-num-layers", "1"]
    gpt_config = megatron_lm_model.gated_gpt_config_from_args(_parse(gpt_flags, world_size=2))
    assert gpt_config.transformer.mtp_num_layers == 1 and gpt_config.transformer.mtp_step35_heads
    set_seed(7)
    gpt = megatron_lm_model.GatedGPTModelBuilder(gpt_config).build_model(pgs)
    set_seed(7)
    assert same(gpt, mcore_ext.build_gpt_model(_reference_config(mtp_num_layers=1), **build))

    hybrids = []
    for spelling in MTP_SPELLINGS:
        flags = [*FLAGS, *spelling]
        config = megatron_lm_model.gated_hybrid_config_from_args(
            _parse(flags, world_size=2), **given_layer_flags(flags))
        assert config.hybrid_layer_pattern == "*-*-/*-", spelling
        assert config.transformer.num_layers == 2 and config.transformer.mtp_num_layers == 1
        set_seed(11)
        hybrids.append(megatron_lm_model.GatedHybridModelBuilder(config).build_model(pgs))
    set_seed(11)
    launcher = mcore_ext.build_hybrid_model(_reference_config(mtp_num_layers=1), **build)
    assert same(hybrids[0], hybrids[1]) and same(hybrids[0], launcher)
    hybrid = hybrids[0]
    assert isinstance(hybrid, HybridModel)
    depth = hybrid.mtp.layers[0]
    assert hasattr(depth, "output_layer")  # Step-3.5's own head
    assert [(layer.gpt_layer_number, layer.config.window_size)
            for layer in depth.mtp_model_layer.layers] == [(3, (3, 0)), (3, (3, 0))]

    copy_weights(hybrid, gpt, to_hybrid=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    labels = torch.randint(0, 128, (2, 16), generator=gen)
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    logits, depths, loss, mtp_loss = _gathered_outputs(hybrid, tokens, positions, labels)
    gpt_logits, gpt_depths, gpt_loss, gpt_mtp_loss = _gathered_outputs(gpt, tokens, positions,
                                                                       labels)
    depth_logits = gpt_depths[0].float()
    formula = F.cross_entropy(depth_logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))
    return dict(logits=(logits - gpt_logits).abs().max().item(),
                depth=(depths[0] - gpt_depths[0]).abs().max().item(),
                loss=(loss - gpt_loss).abs().max().item(),
                mtp_loss=(mtp_loss - gpt_mtp_loss).abs().max().item(),
                mtp_formula=(gpt_mtp_loss[0] - formula).abs().item(),
                scales=(logits.abs().max().item(), depths[0].abs().max().item(),
                        mtp_loss[0].item(), (depths[0] - logits).abs().max().item()))


def test_hybrid_mtp_flags_build_the_gpt_entrys_mtp_model_on_two_ranks(run_distributed):
    for diffs in run_distributed(_check_hybrid_mtp_flags_build_the_gpt_entrys_mtp_model,
                                 world_size=2):
        logits_scale, depth_scale, mtp_loss, depth_vs_main = diffs.pop("scales")
        # Real outputs: O(1) logits, a depth that is not the main head, a cross entropy near
        # log 128.
        assert logits_scale > 0.1 and depth_scale > 0.1 and depth_vs_main > 0.1 and mtp_loss > 1
        assert all(value <= 1e-5 for value in diffs.values()), diffs


def _check_forward_step_hands_the_model_the_loss_mask():
    """The entry's forward step (megatron.training's, pretrain_gpt.forward_step) on the GPT and
    the hybrid MTP model of the flags, a batch whose loss mask drops half the tokens: the MTP
    loss megatron tracks is the masked mean of the depth logits' cross entropy (plain PyTorch:
    position t predicts label t + 1 where the mask keeps it; the last position has none), as
    the launcher's loop computes it; the per-token loss the step returns is the model's."""
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    import mcore_ext
    from mcore_ext import _mcore_compat
    from mcore_ext.megatron_lm import model as megatron_lm_model
    from mcore_ext.megatron_lm.pretrain_gpt import forward_step, given_layer_flags
    from mcore_ext.models.mtp_model import mtp_logits

    mcore_ext.init_parallel(tensor_model_parallel_size=2, seed=7)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    MTPLossLoggingHelper.tracker.clear()  # sized by the first model of the process to track
    gpt_flags, hybrid_flags = [*FLAGS, "--mtp-num-layers", "1"], [*FLAGS, *MTP_SPELLINGS[1]]
    models = [
        megatron_lm_model.GatedGPTModelBuilder(megatron_lm_model.gated_gpt_config_from_args(
            _parse(gpt_flags, world_size=2))).build_model(pgs),
        megatron_lm_model.GatedHybridModelBuilder(megatron_lm_model.gated_hybrid_config_from_args(
            _parse(hybrid_flags, world_size=2), **given_layer_flags(hybrid_flags))).build_model(pgs)]
    gen = torch.Generator().manual_seed(0)
    batch = dict(tokens=torch.randint(0, 128, (2, 16), generator=gen),
                 labels=torch.randint(0, 128, (2, 16), generator=gen),
                 loss_mask=(torch.rand(2, 16, generator=gen) < 0.5).float(),
                 position_ids=torch.arange(16).unsqueeze(0).expand(2, -1).contiguous())
    rolled = torch.cat([batch["loss_mask"][:, 1:], torch.zeros(2, 1)], dim=1)  # label t + 1's
    assert 0 < rolled.sum() < 30
    diffs = []
    for model in models:
        depth = gather(mtp_logits(model, batch["tokens"], batch["position_ids"])[0]).detach()
        shifted = torch.cat([batch["labels"][:, 1:], batch["labels"][:, :1]], dim=1)
        per_token = F.cross_entropy(depth.reshape(-1, 128).float(), shifted.reshape(-1),
                                    reduction="none").view(2, 16)
        formula = (per_token * rolled).sum() / rolled.sum()
        _mcore_compat.take_mtp_losses(1)  # HybridModel's logits forward tracks its own
        output, _ = forward_step(iter([dict(batch)]), model)
        mtp_loss = _mcore_compat.take_mtp_losses(1)
        model_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        diffs.append(((mtp_loss[0] - formula).abs().item(),
                      (output - model_loss).abs().max().item()))
    return diffs


def test_forward_step_hands_the_model_the_loss_mask_on_two_ranks(run_distributed):
    for diffs in run_distributed(_check_forward_step_hands_the_model_the_loss_mask,
                                 world_size=2):
        assert all(mtp <= 1e-5 and loss == 0 for mtp, loss in diffs), diffs


@pytest.mark.parametrize("flags, message", [
    (["--hybrid-layer-pattern", "*-*-/*-", "--mtp-num-layers", "2"],
     "--mtp-num-layers 2 disagrees with --hybrid-layer-pattern '*-*-/*-': 1 MTP depth ('/'); "
     "give --mtp-num-layers 1 or leave it out, or give the pattern without its depths "
     "('*-*-') with --mtp-num-layers 2"),
    (["--hybrid-layer-pattern", "*-*-/-*"],
     "--hybrid-layer-pattern '*-*-/-*' has 1 MTP depths ('/'), --mtp-num-layers is 1: each "
     "depth is '/*-' (one dense GPT layer, the MTP layer mcore_ext builds)"),
    (["--hybrid-layer-pattern", "*-*M"],
     "--hybrid-layer-pattern '*-*M': symbol 'M' is not one of * - E | (attention, dense MLP, "
     "MoE, pipeline stage)"),
    ([*HYBRID_FLAGS, "--num-layers", "3"],
     "--num-layers 3 disagrees with --hybrid-layer-pattern '*-*-': 4 layers, 2 of them "
     "attention ('*', the GPT layers); give --num-layers 4 or 2, or leave it out"),
    (["--hybrid-layer-pattern", "*-*E", "--num-experts", "2", "--moe-router-topk", "2"],
     "--hybrid-layer-pattern '*-*E': hybrid layer 2 is '-' (dense MLP), the MLP of GPT layer 1, "
     "which the flags make MoE (--num-experts 2, --moe-layer-freq 1): give its MLP as 'E'"),
    (["--hybrid-layer-pattern", "*E*-"],
     "--hybrid-layer-pattern '*E*-': hybrid layer 2 is 'E' (MoE), the MLP of GPT layer 1, "
     "which the flags make dense (--num-experts None, --moe-layer-freq 1): give its MLP as '-'"),
])
def test_hybrid_flags_mcore_ext_does_not_build_are_refused(flags, message):
    from mcore_ext.megatron_lm import gated_hybrid_config_from_args
    from mcore_ext.megatron_lm.pretrain_gpt import given_layer_flags

    flags = [*FLAGS, "--tensor-model-parallel-size", "1", *flags]
    with pytest.raises(ValueError) as error:
        gated_hybrid_config_from_args(_parse(flags, world_size=1), **given_layer_flags(flags))
    assert str(error.value) == message


def test_num_layers_of_either_meaning_or_none_builds_the_pattern():
    """--num-layers as megatron counts a pattern (every symbol) or as the GPT entry counts
    layers (its attention symbols), or none: the same config of 2 GPT layers."""
    from mcore_ext.megatron_lm import gated_hybrid_config_from_args
    from mcore_ext.megatron_lm.pretrain_gpt import given_layer_flags

    at = FLAGS.index("--num-layers")
    without = [*FLAGS[:at], *FLAGS[at + 2:], "--tensor-model-parallel-size", "1", *HYBRID_FLAGS]
    for given in ([], ["--num-layers", "4"], ["--num-layers=2"]):
        flags = [*without, *given]
        config = gated_hybrid_config_from_args(_parse(flags, world_size=1),
                                               **given_layer_flags(flags))
        assert config.transformer.num_layers == 2, given
