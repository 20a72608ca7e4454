"""The memory plan of Step-3.7's vision tower and projector (``mcore_ext.plan``: ``VisionShape``,
``params.vision_counts``, ``activations.vision_bytes``) against transformers' parameter count of
the released shape and against measured peaks on a CPU.

- Parameters: the release's tower and projector (tests/hf/fixtures/step37_flash_config.json:
  transformers' ``Step3p7Config`` defaults around Step-3.5-Flash's text config, checked to be
  what it is built from) counted by the plan equal a meta-device ``Step3p7ForConditionalGeneration``
  of that config: vision model, projector and the whole model; a built megatron tower and
  projector at TP 2 hold what ``vision_counts`` says per rank.
- Activations: a tiny bf16 vision-language model (the dense text model of test_memory_plan, a
  2-layer tower of width 128) runs forward + backward with the loss on a micro-batch of 2 rows
  of 512 tokens and 6 views (2 global views of 224 pixels, 4 crops of 112), the tower trained and
  frozen; the plan (text and vision terms) within 15 % of the measured peak, measured as
  test_memory_plan does. Measured / planned (2026-11-29): trained 1.024 (without the vision
  terms 0.805), frozen 0.986 (0.985: the frozen tower saves only the projector's input), trained
  at TP 2 + SP (slow) 1.015 on each rank (0.779).
- ``python -m mcore_ext.hf plan --vision [frozen|trained]`` prints them.
"""

import json
import os

import pytest
import torch

from tests.unit.test_memory_plan import TOLERANCE

SEQ, BATCH, VOCAB, HIDDEN = 512, 2, 1024, 256
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "hf", "fixtures")
STEP35 = os.path.join(FIXTURES, "step35_flash_config.json")
STEP37 = os.path.join(FIXTURES, "step37_flash_config.json")
# The tiny micro-batch's views: (side in pixels, count); placeholders per view: 16 and 4.
VIEWS = ((224, 2), (112, 4))
IMAGE_TOKEN = 1000


def step37_config() -> dict:
    """The released Step-3.7-Flash's config.json as transformers' defaults describe it:
    ``Step3p7Config``'s vision_config, projector_bias and image_token_id around the Step-3.5-Flash
    text config (its released keys; three that transformers' Step-3.7 text config does not
    have and that repeat moe_layers_enum left out: moe_every_n_layer, moe_layer_offset,
    use_moe)."""
    from transformers import Step3p7Config

    with open(STEP35) as f:
        text = json.load(f)
    for key in ("moe_every_n_layer", "moe_layer_offset", "use_moe"):
        text.pop(key)
    defaults = Step3p7Config().to_dict()
    vision = {k: defaults["vision_config"][k] for k in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_channels", "image_size", "patch_size", "hidden_act",
        "layer_norm_eps", "mlp_ratio", "layer_scale_init_value", "rope_parameters",
        "max_position_embeddings")}
    return {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7",
            "text_config": text, "vision_config": vision,
            "projector_bias": defaults["projector_bias"],
            "image_token_id": defaults["image_token_id"],
            "tie_word_embeddings": text.get("tie_word_embeddings", False)}


def test_the_step37_fixture_is_transformers_defaults_around_the_step35_text_config():
    pytest.importorskip("transformers")
    with open(STEP37) as f:
        assert json.load(f) == step37_config()


def test_the_plan_counts_the_released_vision_tower_as_transformers_builds_it():
    """Plan: tower 1,955,848,960, projector 25,165,824 (4C = 6144 -> 4096, no bias), the whole
    model without MTP 198,937,133,056 + 12,096 fp32 router-bias elements (a buffer in
    transformers): each equal to a meta-device Step3p7ForConditionalGeneration's."""
    pytest.importorskip("transformers")
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    from mcore_ext.hf import plan
    from mcore_ext.hf.config import Step35Config
    from mcore_ext.hf.config.step3p7 import vision_config

    with open(STEP37) as f:
        raw = json.load(f)
    with torch.device("meta"):
        model = Step3p7ForConditionalGeneration(Step3p7Config(**raw))
    count = lambda m: sum(p.numel() for p in m.parameters())
    spec = Step35Config.from_hf_dict(raw)
    totals = plan.model_totals(spec, vision_config(raw))
    assert totals["vision"] == count(model.model.vision_model) == 1_955_848_960
    assert totals["projector"] == count(model.model.multi_modal_projector) == 25_165_824
    # transformers' class builds no MTP layers
    assert totals["parameters"] - totals["mtp"] == count(model) == 198_937_133_056


def _vision_model(tp=1, freeze=False, sp=None):
    """The tiny vision-language model (bf16, on this rank's layout) and its VisionConfig."""
    import mcore_ext
    from mcore_ext.vision import VisionConfig

    fields = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        kv_channels=64, ffn_hidden_size=512, head_wise_attn_gate=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", qk_layernorm=True,
        layernorm_zero_centered_gamma=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        bf16=True, tensor_model_parallel_size=tp, sequence_parallel=tp > 1 if sp is None else sp)
    config = mcore_ext.GatedTransformerConfig(**fields)
    vision = VisionConfig(hidden_size=128, num_layers=2, num_attention_heads=4, ffn_hidden_size=512,
                          image_size=224, patch_size=14, image_token_id=IMAGE_TOKEN, freeze=freeze)
    model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      backend="sdpa", vision=vision)
    return config, vision, model.to(torch.bfloat16)


def _counts(tp):
    """(the tiny model's vision parameters on this rank: tower, projector; the plan's)."""
    import mcore_ext
    from mcore_ext.plan.params import vision_counts
    from mcore_ext.plan.shape import ModelShape

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    config, vision, model = _vision_model(tp)
    count = lambda m: sum(p.numel() for p in m.parameters())
    shape = ModelShape.from_transformer_config(config, vocab_size=VOCAB).with_vision(vision)
    return (count(model.vision_model), count(model.vision_projection)), vision_counts(shape, tp)


def test_the_plan_counts_a_built_towers_parameters_per_tp_rank(run_distributed):
    """At TP 2: the layers' linears and the projector split, the rest whole on both ranks."""
    for built, planned in run_distributed(_counts, 2, world_size=2):
        assert built == planned, (built, planned)


def _measure_and_plan(freeze, tp=1):
    import mcore_ext
    from mcore_ext.plan import activations
    from mcore_ext.plan.measure import allocation_peak
    from mcore_ext.plan.shape import ModelShape, VisionShape

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=7)
    config, vision, model = _vision_model(tp, freeze)
    shape = ModelShape.from_transformer_config(config, vocab_size=VOCAB).with_vision(vision)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, IMAGE_TOKEN, (BATCH, SEQ), generator=gen)
    placeholders = sum(count * VisionShape.from_config(vision).features(side)
                       for side, count in VIEWS)
    tokens.view(-1)[torch.randperm(BATCH * SEQ, generator=gen)[:placeholders]] = IMAGE_TOKEN
    images = {"pixel_values": torch.randn(2, 3, 224, 224, generator=gen),
              "pixel_values_local": torch.randn(4, 3, 112, 112, generator=gen),
              "num_local_patches": torch.tensor([2, 2])}
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def step():
        losses = model(tokens, positions, None, labels=labels, **images)
        losses.float().sum().backward()

    step()  # allocates the weight gradients
    measured = min(allocation_peak(step, "cpu")["peak"] for _ in range(3))
    work = activations.Workload(seq=SEQ, micro_batch=BATCH, cpu=True, images=VIEWS,
                                sliding_kernel=activations.installed_sliding_kernel())
    (stage,) = activations.stage_activations(shape, activations.Layout(tp=tp), work)
    mcore_ext.destroy_parallel()
    return measured, stage.peak, stage.vision.total


@pytest.mark.parametrize("freeze, tp", [(False, 1), (True, 1),
                                        pytest.param(False, 2, marks=pytest.mark.slow)])
def test_plan_of_the_vision_tower_matches_the_measured_peak(run_distributed, freeze, tp):
    for rank, (measured, planned, vision) in enumerate(run_distributed(
            _measure_and_plan, freeze, tp, world_size=tp)):
        print(f"rank {rank}: measured {measured / 2**20:.2f} MiB, planned {planned / 2**20:.2f}"
              f" (vision {vision / 2**20:.2f}), ratio {planned / measured:.3f}, without the "
              f"vision terms {(planned - vision) / measured:.3f}")
        assert abs(planned / measured - 1) <= TOLERANCE, (measured, planned, vision)


def _plan_cli(capsys, *argv):
    from mcore_ext.hf.__main__ import main

    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_hf_plan_with_vision_counts_the_tower_frozen_or_trained(capsys):
    """``python -m mcore_ext.hf plan CONFIG --vision [frozen|trained]``: the tower and projector in
    the model line and on the first stage, the frozen tower as weights only (2 bytes each), the
    trained one with its gradients, optimizer state and, with --seq, its activations (every
    view's, per micro-batch); --vision on a Step-3.5 config is one error line."""
    layout = ["--tp", "8", "--pp", "9", "--ep", "16", "--etp", "1", "--dp", "8"]
    code, text, _ = _plan_cli(capsys, STEP37, *layout)
    assert code == 0 and "vision" not in text
    stage = lambda out, k: next(line.split() for line in out.splitlines()
                                if line.split()[:1] == [str(k)])
    first = lambda out: stage(out, 0)
    code, frozen, _ = _plan_cli(capsys, STEP37, *layout, "--vision")
    assert code == 0, frozen
    assert ("+ 1,955,848,960 vision tower (frozen) + 25,165,824 projector = 201,365,316,160 "
            "elements") in frozen
    code, trained, _ = _plan_cli(capsys, STEP37, *layout, "--vision", "trained")
    assert "vision tower (trained)" in trained
    assert first(frozen)[2] == first(trained)[2]  # the same parameters on stage 0
    assert float(first(trained)[-1]) > float(first(frozen)[-1])  # their state: trained only
    assert first(trained)[3:] != first(frozen)[3:] and \
        stage(frozen, 1) == stage(trained, 1)  # stage 1 alike
    seq = ["--seq", "4096", "--crops", "4", "--breakdown"]
    code, acts, _ = _plan_cli(capsys, STEP37, *layout, "--vision", "trained", *seq)
    assert code == 0 and "images 1 x 728 px + 4 x 504 px" in acts, acts
    assert "vision MLP" in acts and "vision projector input" in acts
    # docs/memory-plan.md's figures: the trained tower makes the first stage the largest rank
    assert "largest rank: 54.8 GiB" in acts and first(acts)[-1] == "54.8", acts
    code, frozen_acts, _ = _plan_cli(capsys, STEP37, *layout, "--vision", *seq)
    assert "largest rank: 21.4 GiB" in frozen_acts and first(frozen_acts)[-1] == "15.6"
    code, _, err = _plan_cli(capsys, STEP35, "--vision")
    assert code == 2 and err.startswith("error: ") and "vision tower" in err \
        and err.count("\n") == 1, err
