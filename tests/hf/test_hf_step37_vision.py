"""Step-3.7-Flash with images (``mcore_ext.models.vision_language``, ``load_pretrained(...,
vision=True)``) against transformers' ``Step3p7ForConditionalGeneration``, on real gloo ranks.

The tiny model (tests/hf/models.py: tiny_vl_images_config, build_vl_images): the MoE text model
of test_hf_moe (4 layers, full and sliding, MoE layers 1-3, 8 experts, top-3, a router bias,
clamps) plus one MTP layer, a 2-layer vision tower of width 16 (2 heads, axial 2-D RoPE, layer
scales, quick-GELU, LayerNorms and biases all random) whose position table is laid out for the
112-pixel global view (8 x 8 patches; a 56-pixel crop interpolates it to 4 x 4) and a projector
64 -> 32, saved by transformers (the hub's layout: fused, RoPE-permuted ``attn.in_proj_*``). The
batch (models.vl_inputs, 3 rows of 24 tokens): row 0 holds image 0 (2 local crops, then its
global view) and image 1 (global view only), row 1 no image, row 2 image 2 (1 crop); 13
placeholders, the processor's token layout.

- Logits equal transformers' (fp32, max abs) within 1e-5 at TP 1, TP 2 + SP, EP 2, PP 2 and CP 2,
  both for the 3 rows as a [3, 24] batch and for the same rows packed as 3 THD documents of one
  sequence (transformers' logits of the rows are those of the documents). Under CP 2 each rank
  holds placeholders of both row 0's images (image 1 is split between the ranks).
- Gradients (a fixed random weighting of the logits summed) of every tower and projector
  parameter, the tower trained, equal transformers' at TP 1 and TP 2 + SP within 1e-5 x the
  largest gradient (layer scales and norms reduced over TP by their ``sequence_parallel`` mark, as
  ``finalize_model_grads`` does).
- The tower frozen (the default): it has no gradient, and the projector's gradient is transformers'.
- A placeholder count that does not match the images' features is refused in one message, on
  every rank alike.
"""

import json
import os

import pytest
import torch

from tests.hf import models

pytest.importorskip("transformers")
TOL = 1e-5
GRAD_TOL = 1e-5  # x the largest gradient of the tower and projector


@pytest.fixture(scope="module")
def vl_images(tmp_path_factory):
    """(folder, inputs, weights of the loss, transformers' logits, its vision gradients)."""
    model = models.build_vl_images()
    directory = models.save_vl(model, str(tmp_path_factory.mktemp("step37") / "vl"))
    inputs = models.vl_inputs()
    weights = torch.randn(*inputs["input_ids"].shape, models.VOCAB,
                          generator=torch.Generator().manual_seed(11))
    logits = model(**inputs).logits
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if n.startswith(("model.vision_model.", "model.multi_modal_projector."))}
    return directory, inputs, weights, logits.detach(), grads


def _cases(inputs, weights, expected):
    """{"rows": [3, 24] batch, "packed": the rows as one THD sequence of 3 documents}: (tokens,
    positions, packed params or None, weights, expected logits), before any CP split."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = inputs["input_ids"]
    b, s = ids.shape
    positions = torch.arange(s).expand_as(ids)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                             max_seqlen_q=s, max_seqlen_kv=s)
    flat = lambda t: t.reshape(1, b * s, *t.shape[2:])
    return {"rows": (ids, positions, None, weights, expected),
            "packed": (flat(ids), flat(positions), packed, flat(weights), flat(expected))}


def _cp_split(case):
    """This CP rank's part of a case (megatron's split; per document when packed)."""
    from megatron.core import parallel_state as ps

    from mcore_ext.attention.context_parallel import (
        get_batch_on_this_cp_rank,
        get_packed_batch_on_this_cp_rank,
    )

    tokens, positions, packed, weights, expected = case
    if ps.get_context_parallel_world_size() == 1:
        return case
    if packed is None:
        local = get_batch_on_this_cp_rank(dict(tokens=tokens, positions=positions,
                                               weights=weights, expected=expected))
        return local["tokens"], local["positions"], None, local["weights"], local["expected"]
    split = lambda t: get_packed_batch_on_this_cp_rank(t, packed.cu_seqlens_q_padded, dim=1)
    return split(tokens), split(positions), packed, split(weights), split(expected)


def _forward(model, tokens, positions, packed, images):
    """This rank's logits [b, s, v / TP] on the last stage (None elsewhere); stages exchange
    hidden states point to point."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(tokens.size(1), tokens.size(0), model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(tokens, positions, None, packed_seq_params=packed, **images)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _gather_vocab(local):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.detach().contiguous(),
                    group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : models.VOCAB]


def _vision_grads(model, vision, hf_names):
    """{transformers' name: gradient} of every tower and projector parameter, gathered over TP
    (the layers' norms and layer scales first summed over TP under sequence parallelism)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_ext.hf import vision_layout

    group = ps.get_tensor_model_parallel_group()
    params = {n: p for n, p in model.named_parameters() if vision_layout.is_vision_parameter(n)}
    for param in params.values():
        if getattr(param, "sequence_parallel", False) and model.config.sequence_parallel:
            dist.all_reduce(param.grad, group=group)
    out = {}
    for name, mapping, names in vision_layout.units(vision, hf_names, params):
        grad = params[name].grad
        parts = [torch.empty_like(grad) for _ in range(group.size())]
        dist.all_gather(parts, grad.contiguous(), group=group)
        out.update(zip(names, mapping.from_locals(parts)))
    return out


def _parity(hf_dir, inputs, weights, expected, tp=1, pp=1, cp=1, ep=1, sp=False, grads=False,
            hf_names=()):
    """Max abs logit difference per case (rows, packed) on this rank, the placeholders this rank
    held, and with ``grads`` the tower's and projector's gradients (tower trained)."""
    from megatron.core import parallel_state as ps

    import mcore_ext
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.config.step3p7 import vision_config

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            context_parallel_size=cp, expert_model_parallel_size=ep)
    with open(os.path.join(hf_dir, "config.json")) as f:
        vision = vision_config(json.load(f), freeze=False)
    # megatron 0.19 computes the MTP loss of a forward without labels from its input ids (RL's
    # convention) and back-propagates it: scaled by 0 here, transformers has no MTP.
    model = load_pretrained(hf_dir, backend="sdpa", vision=vision, sequence_parallel=sp,
                            context_parallel_size=cp, mtp_loss_scaling_factor=0.0).eval()
    images = {k: inputs[k] for k in ("pixel_values", "pixel_values_local", "num_local_patches")}
    result = {"diff": {}, "placeholders": {}}
    for name, case in _cases(inputs, weights, expected).items():
        tokens, positions, packed, w, ref = _cp_split(case)
        result["placeholders"][name] = int((tokens == models.IMAGE_TOKEN).sum())
        with torch.set_grad_enabled(grads and name == "rows"):
            out = _forward(model, tokens, positions, packed, images)
            if out is None:
                continue
            result["diff"][name] = (_gather_vocab(out) - ref).abs().max().item()
            if grads and name == "rows":
                tp_rank = ps.get_tensor_model_parallel_rank()
                vocab = out.size(-1)
                padded = torch.nn.functional.pad(w, (0, vocab * tp - w.size(-1)))
                (out * padded[..., tp_rank * vocab:(tp_rank + 1) * vocab]).sum().backward()
                result["grads"] = _vision_grads(model, vision, hf_names)
    return result


def _check_logits(results, world, cp=1):
    diffs = [r["diff"] for r in results if r["diff"]]
    assert diffs, "no rank returned logits"
    for diff in diffs:
        assert set(diff) == {"rows", "packed"}
        assert max(diff.values()) <= TOL, diff
    if cp > 1:  # both ranks hold some of the placeholders (image 1's are split between them)
        assert all(0 < r["placeholders"]["rows"] < 13 for r in results), results
        assert all(0 < r["placeholders"]["packed"] < 13 for r in results), results


def _check_grads(got, expected):
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-2
    worst = max(((got[n] - expected[n]).abs().max().item(), n) for n in expected)
    assert worst[0] <= GRAD_TOL * scale, (worst, scale)


# TP 2 + SP and CP 2 (images split between the ranks, BSHD and packed THD) run by default; the
# layouts the others add nothing to (TP 1: TP 2's path without collectives; EP 2: the tower
# is dense; PP 2: the tower is stage 0's) are slow.
LAYOUTS = {
    "tp2_sp": dict(tp=2, sp=True, grads=True),
    "cp2": dict(cp=2),
    "tp1": pytest.param(dict(grads=True), marks=pytest.mark.slow),
    "ep2": pytest.param(dict(ep=2), marks=pytest.mark.slow),
    "pp2": pytest.param(dict(pp=2), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_step37_images_logits_and_vision_grads_match_transformers(run_distributed, vl_images,
                                                                  layout):
    directory, inputs, weights, expected, hf_grads = vl_images
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("ep", 1)
    results = run_distributed(_parity, directory, inputs, weights, expected,
                              hf_names=list(hf_grads), world_size=world, **layout)
    _check_logits(results, world, layout.get("cp", 1))
    if layout.get("grads"):
        for r in results:
            _check_grads(r["grads"], hf_grads)
