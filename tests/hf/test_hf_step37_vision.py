"""Step-3.7-Flash with images (``mcore_ext.models.vision_language``, ``load_pretrained(...,
vision=True)``) against transformers' ``Step3p7ForConditionalGeneration``, on real gloo ranks.

The tiny model (tests/hf/models.py: tiny_vl_images_config, build_vl_images): the MoE text model
of test_hf_moe (4 layers, full and sliding, MoE layers 1-3, 8 experts, top-3, a router bias,
clamps) plus one MTP layer, a 2-layer vision tower of width 16 (2 heads, axial 2-D RoPE, layer
scales, quick-GELU, LayerNorms and biases all random) whose position table is laid out for the
112-pixel global view (8 x 8 patches; a 56-pixel crop interpolates it to 4 x 4) and a projector
64 -> 32, saved by transformers (the hub's layout: fused, RoPE-permuted ``attn.in_proj_*``). The
batch (models.vl_inputs, 3 rows of 24 tokens): row 0 holds image 0 (2 local crops, then its
global view) and image 1 (global view only), row 1 no image, row 2 image 2 (1 crop); 15
placeholders (a crop gives 1 feature, a global view 4), the processor's token layout.

- Logits equal transformers' (fp32, max abs) within 1e-5 at TP 1, TP 2 + SP, EP 2, PP 2 and CP 2,
  both for the 3 rows as a [3, 24] batch and for the same rows packed as 3 THD documents of one
  sequence (transformers' logits of the rows are those of the documents). Under CP 2 each rank
  holds placeholders of both row 0's images (image 1 is split between the ranks). CP 2 runs
  megatron's HybridModel (what ``hf import`` writes by default from megatron-core 0.19), the
  others its GPTModel.
- Gradients (a fixed random weighting of the logits summed) of every tower and projector
  parameter, the tower trained, equal transformers' at TP 1 and TP 2 + SP within 1e-5 x the
  largest gradient (layer scales and norms reduced over TP by their ``sequence_parallel`` mark, as
  ``finalize_model_grads`` does).
- The tower frozen (the default), at CP 2: it has no gradient, and the projector's, summed over
  the CP ranks (as DDP sums them), is transformers'.
- A batch one placeholder short of its images' features is refused in one message, at CP 2 on
  both ranks alike (the one that held the placeholder and the other).
"""

import hashlib
import json
import os
import zlib

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


def gather_vocab(local, vocab=models.VOCAB):
    """This TP rank's logits [..., v / TP] -> every rank's [..., vocab] (the padding dropped)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.detach().contiguous(),
                    group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab]


def _vision_grads(model, vision, hf_names):
    """{transformers' name: gradient} of every tower and projector parameter that has one,
    summed over CP (as DDP reduces them), gathered over TP (the layers' norms and layer scales
    first summed over TP under sequence parallelism, as ``finalize_model_grads`` does), and the
    names of those without one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_ext.hf import vision_layout

    group = ps.get_tensor_model_parallel_group()
    params = {n: p for n, p in model.named_parameters() if vision_layout.is_vision_parameter(n)}
    for param in params.values():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=ps.get_context_parallel_group())
        if getattr(param, "sequence_parallel", False) and model.config.sequence_parallel:
            dist.all_reduce(param.grad, group=group)
    out, without = {}, []
    for name, mapping, names in vision_layout.units(vision, hf_names, params):
        grad = params[name].grad
        if grad is None:
            without += names
            continue
        parts = [torch.empty_like(grad) for _ in range(group.size())]
        dist.all_gather(parts, grad.contiguous(), group=group)
        out.update(zip(names, mapping.from_locals(parts)))
    return out, without


def _mismatch(model, tokens, positions, packed, images):
    """The error of a forward whose first placeholder on CP rank 0 is a text token."""
    from megatron.core import parallel_state as ps

    from mcore_ext.vision.placement import ImageTokenMismatch

    tokens = tokens.clone()
    if ps.get_context_parallel_rank() == 0:
        first = (tokens == models.IMAGE_TOKEN).nonzero()[:1]
        tokens[tuple(first.t())] = 0
    try:
        _forward(model, tokens, positions, packed, images)
    except ImageTokenMismatch as err:
        return str(err)
    return None


def _parity(hf_dir, inputs, weights, expected, tp=1, pp=1, cp=1, ep=1, sp=False, grads=False,
            freeze=False, mismatch=False, architecture="gpt", hf_names=()):
    """Max abs logit difference per case (rows, packed) on this rank, the placeholders this rank
    held; with ``grads`` the tower's and projector's gradients (``freeze``: the tower frozen),
    with ``mismatch`` the error of a batch short of one placeholder."""
    from megatron.core import parallel_state as ps

    import mcore_ext
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.config.step3p7 import vision_config

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            context_parallel_size=cp, expert_model_parallel_size=ep)
    with open(os.path.join(hf_dir, "config.json")) as f:
        vision = vision_config(json.load(f), freeze=freeze)
    # megatron 0.19 computes the MTP loss of a forward without labels from its input ids (RL's
    # convention) and back-propagates it: scaled by 0 here, transformers has no MTP.
    model = load_pretrained(hf_dir, architecture=architecture, backend="sdpa", vision=vision,
                            sequence_parallel=sp,
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
            result["diff"][name] = (gather_vocab(out) - ref).abs().max().item()
            if grads and name == "rows":
                tp_rank = ps.get_tensor_model_parallel_rank()
                vocab = out.size(-1)
                padded = torch.nn.functional.pad(w, (0, vocab * tp - w.size(-1)))
                (out * padded[..., tp_rank * vocab:(tp_rank + 1) * vocab]).sum().backward()
                result["grads"] = _vision_grads(model, vision, hf_names)
        if mismatch and name == "rows":
            result["mismatch"] = _mismatch(model, tokens, positions, packed, images)
    return result


def _check_logits(results, world, cp=1):
    diffs = [r["diff"] for r in results if r["diff"]]
    assert diffs, "no rank returned logits"
    for diff in diffs:
        assert set(diff) == {"rows", "packed"}
        assert max(diff.values()) <= TOL, diff
    if cp > 1:  # both ranks hold some of the placeholders (image 1's are split between them)
        assert all(0 < r["placeholders"]["rows"] < 15 for r in results), results
        assert all(0 < r["placeholders"]["packed"] < 15 for r in results), results


def _check_grads(result, expected, frozen=False):
    got, without = result
    tower = {n for n in expected if n.startswith("model.vision_model.")}
    assert set(without) == (tower if frozen else set()), without
    expected = {n: g for n, g in expected.items() if n not in without}
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    assert any("multi_modal_projector" in n for n in got)
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-2
    worst = max(((got[n] - expected[n]).abs().max().item(), n) for n in expected)
    assert worst[0] <= GRAD_TOL * scale, (worst, scale)


# TP 2 + SP (GPTModel) and CP 2 (HybridModel; images split between the ranks, BSHD and packed
# THD) run by default; the others add little to them (TP 1: TP 2's path without collectives;
# EP 2: the tower is dense; PP 2: the tower is stage 0's) and are slow.
LAYOUTS = {
    "tp2_sp": dict(tp=2, sp=True, grads=True),
    "cp2_hybrid": dict(cp=2, grads=True, freeze=True, mismatch=True, architecture="hybrid"),
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
            _check_grads(r["grads"], hf_grads, frozen=layout.get("freeze", False))
    if layout.get("mismatch"):  # every rank, whether it held the missing placeholder or not
        for r in results:
            assert "holds 14 image placeholder token(s) (image_token_id=250) but its images " \
                   "give 15 feature(s)" in r["mismatch"], r["mismatch"]


# ------------------------------------------------------------------------ checkpoint side


def _vision_state(model):
    from mcore_ext.hf import vision_layout

    return {n: p.detach().clone() for n, p in model.named_parameters()
            if vision_layout.is_vision_parameter(n)}


def _fresh(hf_dir, architecture="hybrid"):
    """The model of the folder with every vision parameter zeroed (a load must fill them)."""
    from mcore_ext.hf import load_pretrained

    model = load_pretrained(hf_dir, architecture=architecture, backend="sdpa", vision=True)
    with torch.no_grad():
        for param in _vision_state(model):
            model.get_parameter(param).zero_()
    return model


def _load(model, directory):
    from mcore_ext import checkpoint

    state = checkpoint.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"])
    return model


def _checkpoint_vision(hf_dir, ckpt, key_file):
    """``hf import --vision`` at TP 2 with a signing key; the checkpoint loaded at TP 2 into the
    folder's model and at TP 1 into the launcher's model of its config.yaml (the vision weights
    against the folder's at each layout); ``hf export`` of it at TP 1; then one byte of a tower
    layer's weights flipped in its data file and the file's new size, CRC32 and SHA-256
    recorded in the manifest: the signed load refuses it. Returns (mismatches, the export's
    folder, the load's refusal, the file changed, LoRA's results on the TP 1 model)."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext.checkpoint import signing
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.checkpoint import export_checkpoint, import_checkpoint
    from mcore_ext.training.config import load_config
    from mcore_ext.training.loop import build_model, padded_vocab_size

    signing.use_key_file(key_file)
    try:
        mcore_ext.init_parallel(tensor_model_parallel_size=2)
        directory = import_checkpoint(hf_dir, ckpt, vision=True)  # HybridModel (0.19's)
        expected = _vision_state(load_pretrained(hf_dir, backend="sdpa", vision=True))
        got = _vision_state(_load(_fresh(hf_dir), directory))
        wrong = [n for n in expected if not torch.equal(got[n], expected[n])]
        mcore_ext.destroy_parallel()

        mcore_ext.init_parallel(tensor_model_parallel_size=1)  # 2 data-parallel ranks
        reference = load_pretrained(hf_dir, backend="sdpa", vision=True)
        expected = _vision_state(reference)
        cfg = load_config(os.path.join(directory, "config.yaml"),
                          ["parallelism.tensor_model_parallel_size=1", "data.source=mock"],
                          world_size=2)
        with mcore_ext.cuda_to_cpu():
            launcher = build_model(cfg, padded_vocab_size(models.VOCAB, cfg)).module
        got = _vision_state(_load(launcher, directory))
        wrong += [n for n in expected if not torch.equal(got[n], expected[n])]
        exported = os.path.join(ckpt, "..", "frozen_out")
        export_checkpoint(ckpt, exported)  # at TP 1, 2 data-parallel ranks

        # megatron stacks a block's layers into one tensor per parameter (layer index first)
        tensor = "vision_model.decoder.layers.self_attention.linear_qkv.weight"
        changed = flip_byte(directory, tensor) if dist.get_rank() == 0 else None
        dist.barrier()
        refused = None
        try:
            _load(_fresh(hf_dir), directory)
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            refused = f"{type(err).__name__}: {err}"
        return (wrong, exported, refused, changed, _lora(reference), type(launcher).__name__)
    finally:
        signing.use_key_file(None)


def flip_byte(directory, tensor):
    """One byte of ``tensor`` flipped in the checkpoint ``directory`` (of layer 1's rows of a
    tensor megatron stacks by layer), and what one without the key can do after: the changed
    file's size, CRC32 and SHA-256 recorded in the manifest. Returns the file changed."""
    from torch.distributed.checkpoint import FileSystemReader

    from mcore_ext.checkpoint import manifest

    metadata = FileSystemReader(directory).read_metadata()
    where = next(info for index, info in metadata.storage_data.items()
                 if index.fqn == tensor and index.offset[0] == 1)
    path = os.path.join(directory, where.relative_path)
    with open(path, "r+b") as f:
        f.seek(where.offset + where.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    data = open(path, "rb").read()
    manifest_path = os.path.join(directory, manifest.MANIFEST)
    document = json.load(open(manifest_path))
    document["files"][where.relative_path].update(
        size=len(data), crc32=f"{zlib.crc32(data):08x}", sha256=hashlib.sha256(data).hexdigest())
    with open(manifest_path, "w") as f:
        json.dump(document, f)
    return where.relative_path


def _lora(model):
    """(adapters added, trainable parameters, vision parameters) of LoRA all-linear on
    ``model``."""
    from mcore_ext import lora

    vision = list(_vision_state(model))
    added = lora.apply_lora(model, lora.LoraConfig(rank=2, alpha=4, targets=["all-linear"]))
    return added, [n for n, p in model.named_parameters() if p.requires_grad], vision


@pytest.fixture(scope="module")
def vision_checkpoint(run_distributed_shared, vl_images, tmp_path_factory):
    """``_checkpoint_vision``'s results on 2 ranks (one run for the tests below)."""
    tmp = tmp_path_factory.mktemp("vision_ckpt")
    key = tmp / "key"
    key.write_text("step37-vision-key\n")
    return run_distributed_shared(_checkpoint_vision, vl_images[0], str(tmp / "ckpt"),
                                  str(key), world_size=2)


def test_step37_vision_weights_import_reshard_tp2_to_tp1_and_are_signed(vision_checkpoint,
                                                                        vl_images):
    """The tower's and projector's weights go through megatron's sharded checkpoint: ``hf import
    --vision`` at TP 2 (config.yaml's model.vision), loaded at TP 2 and, into the launcher's
    model of that config.yaml (HybridModel, what import writes by default), at TP 1 bit for bit
    (TP-split layers and projector, replicated convolutions); a signed checkpoint covers them:
    one byte of a tower layer's weights flipped in its data file, the file's checksums rewritten
    in the manifest, and the load is refused (the signature does not verify). Its export at
    TP 1 (before the flip) gives every tensor of the folder back bit for bit, the frozen tower
    and the projector among them (before the vision export: refused in one line, "exporting
    them is not supported yet")."""
    for wrong, exported, refused, _, _, launcher in vision_checkpoint:
        assert wrong == []
        assert launcher == "VisionLanguageMTPHybridModel"
        assert refused is not None and "signature does not verify" in refused, refused
    exported = vision_checkpoint[0][1]
    models.assert_same_tensors(vl_images[0], exported)
    assert any(n.startswith("vision_model.") for n in models.read_tensors(exported))
    assert vision_checkpoint[0][3].endswith(".distcp"), vision_checkpoint[0][3]


def test_step37_lora_adapts_the_text_model_alone(vision_checkpoint):
    """LoRA (all-linear) on the vision-language model (TP 1, in the run above): adapters on the
    text model's layers (MTP included), none in the tower or projector, which stay frozen with
    the rest."""
    added, trainable, vision = vision_checkpoint[0][4]
    assert vision and added
    assert not [n for n in added if n.startswith(("vision_model", "vision_projection"))]
    assert any(n.startswith("decoder.layers.0.self_attention") for n in added)
    assert any(n.startswith("mtp.") for n in added)
    assert not set(vision) & set(trainable)
    assert all(".lora_" in n or "_lora." in n for n in trainable), trainable[:4]



# ------------------------------------------------------------------------------ bf16 (GPU)


@pytest.fixture(scope="module")
def vl_images_bf16(tmp_path_factory):
    """(folder of a bf16 tiny Step-3.7 with images, inputs, transformers' logits on its weights in
    fp32 and in bf16). The text model is the dense one (tiny_config): MoE routing may flip on
    near-tied experts in any bf16 run (test_hf_moe sets such tokens aside), which is not what
    this checks."""
    config = models.tiny_vl_images_config(text_config=models.tiny_config())
    model = models.build_vl_images(config).to(torch.bfloat16)
    directory = models.save_vl(model, str(tmp_path_factory.mktemp("step37") / "vl_bf16"),
                               mtp=False)
    inputs = models.vl_inputs()
    with torch.no_grad():
        in_bf16 = model(**inputs).logits.float()
        in_fp32 = model.float()(**inputs).logits
    return directory, inputs, in_fp32, in_bf16


def _bf16_logits(hf_dir, inputs, device):
    import mcore_ext
    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel()
    model = load_pretrained(hf_dir, backend="sdpa", vision=True, device=device).eval()
    ids = inputs["input_ids"].to(device)
    images = {k: inputs[k].to(device)
              for k in ("pixel_values", "pixel_values_local", "num_local_patches")}
    with torch.no_grad():
        out = model(ids, torch.arange(ids.size(1), device=device).expand_as(ids), None,
                    **images)
    assert out.dtype == torch.bfloat16
    return out[..., : models.VOCAB].float().cpu()


def check_bf16(logits, expected, transformers_bf16):
    """test_hf_parity's bf16 bounds (u = 2^-8 per rounding, about 40 rounded stages adding like a
    random walk; the tower adds 2 layers and 3 linear maps): RMS difference <= 8 u x RMS, max <=
    16 u x max|logits|, and no more than 1.5 x transformers' own bf16 run's RMS difference."""
    from tests import reference

    u = reference.BF16_UNIT_ROUNDOFF
    rms = lambda t: t.square().mean().sqrt().item()
    diff = logits - expected
    assert diff.abs().max() <= 16 * u * expected.abs().max(), diff.abs().max()
    assert rms(diff) <= 8 * u * rms(expected), rms(diff)
    assert 0 < rms(diff) <= 1.5 * rms(transformers_bf16 - expected), (
        rms(diff), rms(transformers_bf16 - expected))


@pytest.mark.gpu
def test_step37_images_in_bf16_on_cuda_within_bf16_rounding(run_distributed, vl_images_bf16):
    """A bf16 Step-3.7 folder with images on one GPU (the tower's SDPA on CUDA kernels): logits
    within bf16 rounding of transformers' fp32 run on the same bf16 weights (check_bf16)."""
    directory, inputs, expected, transformers_bf16 = vl_images_bf16
    (logits,) = run_distributed(_bf16_logits, directory, inputs, "cuda", world_size=1)
    check_bf16(logits, expected, transformers_bf16)
