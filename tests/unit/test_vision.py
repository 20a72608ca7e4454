"""Step-3.7's vision pieces on their own (no process group): the config read from a config.json,
the tower's RoPE angles and the q/k/v row layouts against transformers' own code, and
transformers' feature order and placeholder order.

The model with images against transformers' model, at every layout: tests/hf/test_hf_step37_vision.
"""

import pytest
import torch

from mcore_ext.hf.config import HFConfigError
from mcore_ext.hf.config.step3p7 import vision_config
from mcore_ext.hf.vision_layout import VisionQkv, rope_rows
from mcore_ext.vision import VisionConfig
from mcore_ext.vision.placement import ImageTokenMismatch, merge_features, placeholder_order
from mcore_ext.vision.tower import rotary_frequencies


def _raw(**vision):
    return {"model_type": "step3p7", "image_token_id": 7, "projector_bias": True,
            "vision_config": vision}


def test_vision_config_reads_the_release_and_transformers_spellings():
    release = vision_config(_raw(width=64, layers=3, heads=4, ls_init_value=0.5, image_size=56,
                                 mlp_ratio=2.5, rope_parameters={"rope_type": "axial",
                                                                 "rope_theta": 500.0}))
    assert release == VisionConfig(hidden_size=64, num_layers=3, num_attention_heads=4,
                                   ffn_hidden_size=160, image_size=56, layer_scale_init=0.5,
                                   rotary_base=500.0, projector_bias=True, image_token_id=7)
    # transformers' defaults are the release's tower (MLP int(1536 x 8960 / 1536) = 8960)
    assert vision_config(_raw()) == VisionConfig(projector_bias=True, image_token_id=7)
    assert vision_config(_raw(), freeze=False).freeze is False


@pytest.mark.parametrize("vision, said", [
    ({"hidden_size": 64, "width": 32}, "disagree"),
    ({"sparse_patches": 4}, "vision_config.sparse_patches=4"),
    ({"hidden_size": 64, "mlp_ratio": 2.0, "intermediate_size": 100}, "int(hidden_size x mlp"),
    ({"hidden_act": "gelu"}, "quick_gelu"),
    ({"rope_parameters": {"rope_type": "default"}}, "axial"),
    ({"hidden_size": 18, "num_attention_heads": 3}, "multiple of 4"),
])
def test_vision_config_refuses_what_it_would_compute_otherwise(vision, said):
    with pytest.raises(HFConfigError, match=said.replace("(", r"\(")):
        vision_config(_raw(**vision))


def test_rotary_angles_are_transformers_axial_rope():
    """cos / sin of the angles = Step3p7VisionRotaryEmbedding's on get_vision_position_ids of
    the same (non-square) grid."""
    pytest.importorskip("transformers")
    from transformers import Step3p7VisionConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionRotaryEmbedding
    from transformers.vision_utils import get_vision_position_ids

    config = Step3p7VisionConfig(hidden_size=32, num_attention_heads=2,
                                 rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    rope = Step3p7VisionRotaryEmbedding(config)
    positions = get_vision_position_ids(torch.tensor([[1, 3, 5]]), spatial_merge_size=1)
    cos, sin = rope(torch.zeros(1), positions)  # [N, hn]
    freqs = rotary_frequencies(3, 5, head_dim=16, base=100.0)
    assert freqs.shape == (15, 1, 1, 16)
    assert torch.equal(freqs.squeeze(1).squeeze(1).cos(), cos)
    assert torch.equal(freqs.squeeze(1).squeeze(1).sin(), sin)


def test_qkv_rows_round_trip_and_match_transformers_rope_permutation():
    """The hub's stacked in_proj (release RoPE order) and transformers' q / k / v (its
    PermuteForRope applied) give the same fused rows on every TP rank, and each comes back bit
    for bit from the ranks' rows."""
    pytest.importorskip("transformers")
    from transformers.core_model_loading import PermuteForRope

    heads, hn, c = 4, 8, 32

    class Config:
        vision_config = type("V", (), {"num_attention_heads": heads})()

    gen = torch.Generator().manual_seed(0)
    for shape in ((3 * heads * hn, c), (3 * heads * hn,)):  # weight, bias
        in_proj = torch.randn(shape, generator=gen)
        q, k, v = in_proj.chunk(3)
        theirs = PermuteForRope(subconfig_key="vision_config")
        native = [theirs._permute_for_rope(q, Config()), theirs._permute_for_rope(k, Config()), v]
        assert torch.equal(rope_rows(q, heads), native[0])
        assert torch.equal(rope_rows(native[0], heads, inverse=True), q)
        for tp in (1, 2, 4):
            hub_rows = [VisionQkv(heads, hn, hub=True).to_local([in_proj], r, tp)
                        for r in range(tp)]
            native_rows = [VisionQkv(heads, hn, hub=False).to_local(native, r, tp)
                           for r in range(tp)]
            assert all(torch.equal(a, b) for a, b in zip(hub_rows, native_rows))
            assert torch.equal(VisionQkv(heads, hn, hub=True).from_locals(hub_rows)[0], in_proj)
            back = VisionQkv(heads, hn, hub=False).from_locals(native_rows)
            assert all(torch.equal(a, b) for a, b in zip(back, native))
        # megatron's fused rows: per head its q, then k, then v rows
        fused = VisionQkv(heads, hn, hub=False).to_local(native, 0, 1)
        assert torch.equal(fused[hn:2 * hn], native[1][:hn])
        assert torch.equal(fused[3 * hn:4 * hn], native[0][hn:2 * hn])


def test_features_are_ordered_per_image_crops_then_global_view():
    h = 2
    glob = torch.arange(3 * 4 * h).float().view(3, 4, h)  # 3 images, 4 tokens each
    local = -torch.arange(3 * 1 * h).float().view(3, 1, h) - 1  # 3 crops, 1 token each
    out = merge_features(glob, local, torch.tensor([2, 0, 1]))
    expected = torch.cat([local[0], local[1], glob[0], glob[1], local[2], glob[2]])
    assert torch.equal(out, expected)
    assert torch.equal(merge_features(glob, None, None), glob.reshape(-1, h))
    for counts in ([2, 0], [2, 0, 2], [-1, 2, 2]):
        with pytest.raises(ImageTokenMismatch, match="num_local_patches"):
            merge_features(glob, local, counts)


def test_placeholders_are_numbered_row_major():
    ids = torch.tensor([[5, 9, 9, 5], [5, 5, 5, 5], [9, 5, 5, 9]])
    order, total = placeholder_order(ids, 9)
    assert total == 4
    assert order.tolist() == [[-1, 0, 1, -1], [-1, -1, -1, -1], [2, -1, -1, 3]]


# ------------------------------------------------------------------ the launcher's model


def _launcher_vl_step(architecture):
    """The launcher's model (build_model: DDP around the vision-language model) of a tiny config
    with model.vision (tower trained) at TP 2 + SP: one forward / backward with images and
    megatron's finalize_model_grads. Returns what each rank saw."""
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.training.config import load_config
    from mcore_ext.training.loop import build_model

    cfg = load_config(None, [
        "data.source=mock", "model.num_layers=2", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.seq_length=16", "model.attention_backend=sdpa",
        f"model.architecture={architecture}", "parallelism.tensor_model_parallel_size=2",
        "parallelism.sequence_parallel=true", "model.vision.hidden_size=16",
        "model.vision.num_layers=1", "model.vision.num_attention_heads=2",
        "model.vision.ffn_hidden_size=32", "model.vision.image_size=56",
        "model.vision.image_token_id=7", "model.vision.freeze=false"], world_size=2)
    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    with cuda_to_cpu():  # as the launcher runs (megatron's DDP asks for CUDA streams)
        return _step(build_model(cfg, vocab_size=128))


def _step(model):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    inner = model.module
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, 128, (2, 16), generator=gen)
    tokens[0, 3:7] = 7  # one 56-pixel image: 4 x 4 patches -> 1 feature; 3 more crops
    pixels = torch.randn(1, 3, 56, 56, generator=gen)
    crops = torch.randn(3, 3, 56, 56, generator=gen)
    positions = torch.arange(16).expand_as(tokens)
    losses = model(tokens, positions, None, labels=tokens, pixel_values=pixels,
                   pixel_values_local=crops, num_local_patches=torch.tensor([3]))
    losses.sum().backward()
    inner.config.finalize_model_grads_func([model])
    grads = {n: p.main_grad.clone() for n, p in inner.named_parameters()
             if n.startswith(("vision_model.", "vision_projection.")) and p.requires_grad}
    same = {}
    for name, grad in grads.items():  # replicated over TP: the same gradient on both ranks
        if grad.shape != inner.get_parameter(name).shape or "linear_" in name or \
                "encoder" in name:
            continue
        other = grad.clone()
        dist.broadcast(other, src=dist.get_global_rank(ps.get_tensor_model_parallel_group(), 0),
                       group=ps.get_tensor_model_parallel_group())
        same[name] = torch.equal(other, grad)
    return type(inner).__name__, {n: g.abs().sum().item() for n, g in grads.items()}, same


@pytest.mark.parametrize("architecture", ["hybrid"])
def test_launcher_builds_and_steps_the_vision_language_model(run_distributed, architecture):
    """model.vision in a launcher config builds the vision-language model inside megatron's DDP
    (TP 2 + SP, the tower trained): a step with an image and its crops gives every tower and
    projector parameter a gradient, and after megatron's finalize_model_grads the parameters
    TP replicates (convolutions, positions, norms, layer scales: the latter two summed over the
    sequence-parallel ranks) hold the same gradient on both ranks."""
    for name, grads, same in run_distributed(_launcher_vl_step, architecture, world_size=2):
        assert name.startswith("VisionLanguage"), name
        assert grads and all(v > 0 for v in grads.values()), grads
        assert any("layer_scale" in n for n in same) and all(same.values()), same
