"""The released Step-3.5-Flash's shape (tests/hf/fixtures/step35_flash_config.json, reconstructed
from /work/shared/notes/step35-flash.md section 1) and ``python -m mcore_ext.hf plan``.

Expected counts (the note's, checked there against the checkpoint's 398,768,626,944 serialized
bytes): 196,956,130,368 main + 2,428,171,008 MTP = 199,384,301,376 elements in 804 tensors, of
which 12,096 are the fp32 router bias (42 layers x 288). The fixture's full-layer RoPE base (5e6)
and rotary fraction (0.5) are not in the note; no count depends on them.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from mcore_ext.hf import layout, plan
from mcore_ext.hf.config import Step35Config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "step35_flash_config.json")
MAIN, MTP, TOTAL, BIAS = 196_956_130_368, 2_428_171_008, 199_384_301_376, 12_096


def _spec():
    with open(FIXTURE) as f:
        return Step35Config.from_hf_dict(json.load(f))


def test_the_released_config_parses_into_megatrons_moe_and_mtp_fields():
    spec = _spec()
    fields = spec.transformer_config_fields()
    assert fields["moe_layer_freq"] == [0] * 3 + [1] * 42
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_ffn_hidden_size"],
            fields["moe_shared_expert_intermediate_size"]) == (288, 8, 1280, 1280)
    assert fields["moe_router_topk_scaling_factor"] == 3.0
    assert fields["moe_router_dtype"] == "fp32" and fields["mtp_num_layers"] == 3
    routed, shared = fields["moe_expert_swiglu_limits"], fields["swiglu_limits"]
    assert len(routed) == 45 and len(shared) == 48  # shared/dense list covers the MTP layers
    assert [i for i, x in enumerate(routed) if x] == [43, 44] and routed[43] == 7.0
    assert [i for i, x in enumerate(shared) if x] == [43, 44] and shared[44] == 16.0
    assert fields["layer_types"][45:] == ["sliding_attention"] * 3
    assert spec.heads(45) == 96 and spec.heads(44) == 64
    back = Step35Config.from_hf_dict(spec.to_hf_dict())  # the export's config reads back the same
    assert vars(back) == vars(spec)


def test_the_shape_table_counts_the_checkpoint_exactly():
    spec = _spec()
    shapes = layout.hf_shapes(spec)
    assert len(shapes) == 804
    total = sum(math.prod(s) for s in shapes.values())
    mtp = sum(math.prod(s) for n, s in shapes.items() if int((n.split(".") + [0, 0])[2] if
                                                              n.startswith("model.layers.") else 0)
              >= 45)
    bias = sum(math.prod(s) for n, s in shapes.items() if n.endswith("router_bias"))
    assert (total, total - mtp, mtp, bias) == (TOTAL, MAIN, MTP, BIAS)
    totals = plan.model_totals(spec)  # the plan's own arithmetic, per layer
    assert totals["main"] + totals["router_bias"] == MAIN and totals["mtp"] == MTP


@pytest.mark.slow
def test_the_megatron_model_built_on_the_meta_device_has_the_checkpoints_count(run_distributed):
    counts = run_distributed(_meta_count, FIXTURE, world_size=1, timeout=900)[0]
    assert counts == {"parameters": TOTAL - BIAS, "expert_bias": BIAS, "mtp": MTP}


def _meta_count(path):
    import torch

    import mcore_ext
    from mcore_ext.hf.convert import build_config
    from mcore_ext.models import build_gpt_model

    mcore_ext.init_parallel()
    with open(path) as f:
        spec = Step35Config.from_hf_dict(json.load(f))
    config = build_config(spec, torch.bfloat16)  # use_cpu_initialization, no init
    with torch.device("meta"):  # no memory: every parameter is a meta tensor
        model = build_gpt_model(config, vocab_size=spec.vocab_size, max_sequence_length=4096,
                                backend="sdpa")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "expert_bias": sum(b.numel() for n, b in model.named_buffers()
                               if n.endswith("router.expert_bias")),
            "mtp": sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))}


def _rank_count(hf_dir, tp, pp, ep):
    import mcore_ext
    from megatron.core import parallel_state as ps

    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep)
    model = load_pretrained(hf_dir, backend="sdpa", make_vocab_size_divisible_by=128)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)
    return (ps.get_pipeline_model_parallel_rank(),
            sum(p.numel() for p in model.parameters()) - experts, experts,
            sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias")))


@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 2), (1, 2, 2)])
def test_plan_counts_equal_the_built_models_per_rank(run_distributed, tmp_path, tp, pp, ep):
    """The plan's per-rank arithmetic against the parameters each rank of the real (tiny MoE +
    MTP) model holds."""
    from tests.hf import models

    directory, _ = models.save_moe(models.build_moe(), str(tmp_path / "moe"))
    spec = Step35Config.from_hf_dict(json.load(open(os.path.join(directory, "config.json"))))
    stages = plan.stage_counts(spec, tp=tp, pp=pp, ep=ep)
    for stage, dense, experts, bias in run_distributed(_rank_count, directory, tp, pp, ep,
                                                       world_size=4):
        want = stages[stage]
        assert (dense, experts, bias) == (want.dense, want.expert, want.expert_bias)


def test_plan_command_prints_per_rank_memory_and_the_verdict():
    out = subprocess.run(
        [sys.executable, "-m", "mcore_ext.hf", "plan", FIXTURE, "--tp", "1", "--pp", "9",
         "--ep", "16", "--dp", "16"], capture_output=True, text=True, check=True).stdout
    assert "196,956,130,368 main" in out and "199,384,301,376 elements" in out
    assert "144 ranks" in out and "fits in 80 GiB" in out
    rows = plan.plan(_spec(), tp=1, pp=9, ep=16, dp=16)
    # stage 8 holds layers 40-44, the 3 MTP layers and 4 output heads: the largest rank.
    largest = max(mem["total"] for _, mem in rows)
    assert largest == rows[-1][1]["total"] and f"{largest / plan.GIB:.1f} GiB" in out
    # bytes per parameter: 2 (bf16) + 4 (fp32 grad) + 12 / (data-parallel ranks sharing it)
    count, mem = rows[1]
    dense_dp, expert_dp = 16, 144 // (16 * 1 * 9)
    assert mem["total"] == pytest.approx(
        6 * (count.dense + count.expert) + 4 * count.expert_bias
        + 12 * (count.dense / dense_dp + count.expert / expert_dp))
    bad = subprocess.run([sys.executable, "-m", "mcore_ext.hf", "plan", FIXTURE, "--pp", "8"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "num_hidden_layers=45 is not divisible" in bad.stderr


def test_the_flash_launcher_config_is_the_fixture_model_at_a_layout_that_fits():
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    with open(os.path.join(root, "configs", "step35_flash.yaml")) as f:
        cfg = yaml.safe_load(f)
    fields = _spec().transformer_config_fields()
    for key, value in fields.items():
        if key in cfg["model"]:
            assert cfg["model"][key] == value, key
    missing = {"num_layers", "num_moe_experts", "moe_layer_freq", "moe_expert_swiglu_limits",
               "swiglu_limits", "mtp_num_layers", "layer_types"} - set(cfg["model"])
    assert not missing
    par = cfg["parallelism"]
    rows = plan.plan(_spec(), tp=par["tensor_model_parallel_size"],
                     pp=par["pipeline_model_parallel_size"],
                     ep=par["expert_model_parallel_size"], dp=8,  # 144 GPUs, as its comment says
                     etp=par["expert_tensor_parallel_size"])
    assert max(mem["total"] for _, mem in rows) <= 40 * plan.GIB  # half a GPU for activations
