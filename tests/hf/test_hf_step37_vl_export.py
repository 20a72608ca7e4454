"""Step-3.7-Flash with images, exported whole: ``hf export`` of a checkpoint with ``model.vision``
(``hf import --vision``) writes the trained vision tower and projector with the text model, the
processor and chat template beside them, and ``--adapter`` writes a LoRA run's adapters for
``peft`` over the stock class; checked against transformers' ``Step3p7ForConditionalGeneration``
and ``AutoProcessor`` on images the repository's tiny processor renders.

The folder (tests/hf/models.py: tiny_vl_processor_config, save_vl_with_processor): the MoE + MTP
text model of test_hf_step37_vision (vocabulary 265, <im_patch> 259), a 2-layer vision tower of
width 16, and configs/vl_tiny/processor's files (processor_config.json, byte-level tokenizer,
chat template). The batch: configs/vl_tiny/captions.jsonl lines 0 (an image with 2 local crops)
and 2 (a global view alone) and a conversation without an image, rendered by that processor.

One run on 2 ranks (TP 2 + SP, a signing key set), ``_export_run``: ``hf import --vision`` (the
HybridModel import writes); the import's model trained one step in-process on the batch, the
tower trained too (every tower, projector and text weight moved), saved as a run fine-tuned from
the import (config.yaml: ``model.vision.freeze: false``, ``checkpoint.load`` the import); a LoRA
run over the import (every target, routed experts included, the tower and projector frozen),
saved as the launcher saves one (the adapters and a reference to the import); each exported at
TP 2 (merged; the LoRA run with ``--adapter`` too); then the import's signed processor file
changed and the export refused.
"""

import json
import os
import warnings

import pytest
import torch

from tests.hf import models

pytest.importorskip("transformers")
pytest.importorskip("torchvision")  # transformers' Step3p7ImageProcessor
pytest.importorskip("PIL")
TOL = 1e-5
LORA_TOL = 2e-5
RANK, ALPHA = 4, 8
TARGETS = ["all-linear", "experts.gate_up_proj", "experts.down_proj"]
PROCESSOR_FILES = ("processor_config.json", "chat_template.jinja", "tokenizer.json",
                   "tokenizer_config.json")
IMAGES = ("pixel_values", "pixel_values_local", "num_local_patches")


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    """(folder with the tiny processor, the processor's batch)."""
    directory = str(tmp_path_factory.mktemp("step37") / "vl")
    models.save_vl_with_processor(models.build_vl_images(models.tiny_vl_processor_config()),
                                  directory)
    return directory, models.processor_batch(directory)


def _logits(model, batch):
    """The model's full logits [b, s, vocab] on ``batch`` (gathered over TP), without a graph."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ids = batch["input_ids"]
    with torch.no_grad():
        local = model(ids, torch.arange(ids.size(1)).expand_as(ids), None,
                      **{k: batch[k] for k in IMAGES})
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : models.VL_TINY_VOCAB]


def _train_one_step(model, batch):
    """One step on a fixed random weighting of the logits: every parameter with a gradient moves
    by at most 0.01 (its gradient over the gradient's largest value)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ids = batch["input_ids"]
    out = model(ids, torch.arange(ids.size(1)).expand_as(ids), None,
                **{k: batch[k] for k in IMAGES})
    padded = out.size(-1) * ps.get_tensor_model_parallel_world_size()
    weights = torch.randn(*ids.shape, models.VL_TINY_VOCAB,
                          generator=torch.Generator().manual_seed(5))
    weights = torch.nn.functional.pad(weights, (0, padded - weights.size(-1)))
    rank = ps.get_tensor_model_parallel_rank()
    (out * weights[..., rank * out.size(-1):(rank + 1) * out.size(-1)]).sum().backward()
    moved = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            # Summed as DDP and finalize_model_grads do: over TP where each rank saw its part
            # of the sequence, and a routed expert's over the ranks holding a copy of it (its
            # expert-data-parallel group: here the two TP ranks, ETP 1), each of which routed
            # its own part of the sequence.
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
            if not getattr(param, "allreduce", True):
                dist.all_reduce(param.grad, group=ps.get_expert_data_parallel_group())
            if param.grad is not None and param.grad.abs().max() > 0:
                param -= 0.01 * param.grad / param.grad.abs().max()
                moved.append(name)
            param.grad = None
    return moved


def _save_run(state: dict, cfg, root: str) -> str:
    """``state`` saved as a launcher run's iteration 1 under ``root`` (the launcher's protocol:
    ``saving``, megatron's dist_checkpointing, config.yaml in the manifest)."""
    from megatron.core import dist_checkpointing

    from mcore_ext.checkpoint import saving
    from mcore_ext.checkpoint.directory import iteration_dir

    directory = iteration_dir(root, 1)
    partial = saving.begin(directory)
    dist_checkpointing.save({**state, "iteration": 1, "consumed_samples": 0}, partial)
    cfg.checkpoint.save = root
    saving.publish(partial, directory, files={"config.yaml": cfg.to_yaml()}, root=root,
                   iteration=1)
    return directory


def _import_model(hf_dir, directory, freeze):
    """The import's model (HybridModel), filled from its checkpoint ``directory``."""
    from mcore_ext import checkpoint
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.config.step3p7 import vision_config

    with open(os.path.join(hf_dir, "config.json")) as f:
        vision = vision_config(json.load(f), freeze=freeze)
    # megatron 0.19 back-propagates the MTP loss of a forward without labels: scaled by 0. MoE
    # under TP trains with sequence parallelism (megatron refuses it without).
    model = load_pretrained(hf_dir, architecture="hybrid", backend="sdpa", vision=vision,
                            mtp_loss_scaling_factor=0.0, sequence_parallel=True)
    state = checkpoint.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"])
    return model


def _export_run(hf_dir, root, key_file, batch):
    import torch.distributed as dist
    import yaml

    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.checkpoint import adapters as adapter_checkpoint
    from mcore_ext.checkpoint import manifest, signing
    from mcore_ext.hf.checkpoint import export_checkpoint, import_checkpoint
    from mcore_ext.run_config import PretrainConfig, build

    signing.use_key_file(key_file)
    try:
        # ETP 1: routed experts' adapters need it (mcore_ext.lora)
        mcore_ext.init_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        ckpt = os.path.join(root, "ckpt")
        imported = import_checkpoint(hf_dir, ckpt, vision=True)
        config = lambda: build(PretrainConfig, yaml.safe_load(
            manifest.read_file(imported, "config.yaml")))
        out = {"tokenizer": sorted(os.listdir(os.path.join(imported, "tokenizer")))}

        # The tower trained: one step, saved as a run fine-tuned from the import.
        model = _import_model(hf_dir, imported, freeze=False)
        out["moved"] = _train_one_step(model.train(), batch)
        out["trained"] = _logits(model.eval(), batch)
        cfg = config()
        cfg.model.vision.freeze = False
        trained = _save_run({"model": model.sharded_state_dict()}, cfg, os.path.join(root, "run"))
        del model

        # LoRA over the import (the tower and projector frozen), saved as the launcher saves a
        # LoRA run: its adapters and a reference to the import.
        model = _import_model(hf_dir, imported, freeze=True)
        adapters = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS)
        lora.apply_lora(model, adapters)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, adapter in sorted(lora.lora_adapters(model).items()):
                for target in adapter.targets.values():
                    target.lora_A.copy_(torch.randn(target.lora_A.shape, generator=gen) * 0.2)
                    target.lora_B.copy_(torch.randn(target.lora_B.shape, generator=gen) * 0.2)
        out["lora"] = _logits(model.eval(), batch)
        cfg = config()
        cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets = RANK, ALPHA, TARGETS
        state = {k: v for k, v in model.sharded_state_dict().items() if lora.ADAPTER_KEY in k}
        lora_run = _save_run({"model": state, adapter_checkpoint.BASE_KEY:
                              adapter_checkpoint.base_reference(imported, 0)},
                             cfg, os.path.join(root, "lora"))
        del model

        for name, (directory, adapter) in {"trained_out": (trained, False),
                                           "merged_out": (lora_run, False),
                                           "adapter_out": (lora_run, True)}.items():
            export_checkpoint(directory, os.path.join(root, name), adapter=adapter)

        # A signed file of the chain changed: the import's processor_config.json.
        if dist.get_rank() == 0:
            with open(os.path.join(imported, "tokenizer", "processor_config.json"), "a") as f:
                f.write(" ")
        dist.barrier()
        try:
            export_checkpoint(trained, os.path.join(root, "refused_out"))
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            out["refused"] = f"{type(err).__name__}: {err}"
        return out
    finally:
        signing.use_key_file(None)


@pytest.fixture(scope="module")
def exported(run_distributed_shared, vl_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_export")
    key = root / "key"
    key.write_text("step37-vl-export-key\n")
    results = run_distributed_shared(_export_run, vl_folder[0], str(root), str(key),
                                     vl_folder[1], world_size=2)
    return root, results[0]


def _stock(directory):
    """The stock class from ``directory``, its tensors copied into torch's own memory (a
    tensor loaded where its file's mmap puts it may round otherwise in CPU GEMMs: see
    test_hf_step37), and its loading info."""
    from transformers import Step3p7ForConditionalGeneration

    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32)
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model.eval(), info


def _stock_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _vision(tensors):
    return {n: t for n, t in tensors.items()
            if n.startswith(("vision_model.", "vit_large_projector."))}


def test_step37_export_writes_the_trained_vision_tower_the_stock_class_loads(vl_folder,
                                                                             exported):
    """The tower trained one step (every tower, projector and text parameter moved): the export
    writes the trained weights (none of the folder's vision tensors is what it was), the stock
    class loads them with no missing or unexpected keys and its logits on the images equal the
    project's model's within 1e-5 (fp32). Before this change such a checkpoint's export was
    refused ("exporting them is not supported yet")."""
    hf_dir, batch = vl_folder
    root, out = exported
    moved = set(out["moved"])
    assert any(n.startswith("vision_model.decoder.layers.1.") for n in moved), sorted(moved)[:8]
    assert {"vision_model.conv1.weight", "vision_model.downsampler2.weight",
            "vision_projection.encoder.weight", "decoder.layers.0.self_attention.linear_qkv.weight"
            } <= moved, sorted(moved)[:8]
    source, written = models.read_tensors(hf_dir), models.read_tensors(str(root / "trained_out"))
    assert set(written) == set(source)
    same = [n for n in _vision(source) if torch.equal(source[n], written[n])]
    assert not same, same
    model, info = _stock(str(root / "trained_out"))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    logits = _stock_logits(model, batch)
    assert (logits - out["trained"]).abs().max().item() <= TOL
    base = _stock_logits(_stock(hf_dir)[0], batch)
    assert (base - out["trained"]).abs().max().item() > 100 * TOL  # the step changed them


def test_step37_export_carries_the_processor_and_chat_template(vl_folder, exported):
    """``hf import`` copies the processor's files into the checkpoint's signed tokenizer folder
    (before: the tokenizer's alone, processor_config.json left in the HF folder) and the export
    writes them: ``AutoProcessor.from_pretrained(OUT)`` renders the conversations with their
    images exactly as the source folder's processor does (every tensor equal)."""
    from transformers import AutoProcessor

    hf_dir, _ = vl_folder
    root, out = exported
    assert set(PROCESSOR_FILES) <= set(out["tokenizer"]), out["tokenizer"]
    for name in PROCESSOR_FILES:
        assert (root / "trained_out" / name).read_bytes() == \
            open(os.path.join(hf_dir, name), "rb").read(), name
    rendered = [models.render(AutoProcessor.from_pretrained(d, local_files_only=True),
                              *models.caption_conversations())
                for d in (hf_dir, str(root / "trained_out"))]
    assert rendered[0].keys() == rendered[1].keys() >= {"input_ids", *IMAGES}
    assert all(torch.equal(rendered[0][k], rendered[1][k]) for k in rendered[0])
    assert (rendered[0]["input_ids"] == models.VL_TINY_IMAGE_TOKEN).sum() == 10


def test_step37_lora_over_the_frozen_tower_exports_merged_and_for_peft(vl_folder, exported):
    """A LoRA run over the import (the tower and projector frozen; the launcher's adapters-only
    checkpoint): the merged export keeps every vision tensor bit for bit and gives the project's
    logits on the images (2e-5); ``--adapter`` writes only text adapters, which ``peft`` loads
    over the stock class of the source folder with the merged export's logits (2e-5, as
    test_hf_step37's text-only adapters), adapting the text model alone."""
    pytest.importorskip("peft")
    from peft import PeftModel

    hf_dir, batch = vl_folder
    root, out = exported
    source = models.read_tensors(hf_dir)
    merged = models.read_tensors(str(root / "merged_out"))
    assert all(torch.equal(t, merged[n]) for n, t in _vision(source).items())
    model, info = _stock(str(root / "merged_out"))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    merged_logits = _stock_logits(model, batch)
    # 2e-5: the merged W + s B A rounds otherwise than the adapters' own path (test_hf_step37)
    assert (merged_logits - out["lora"]).abs().max().item() <= LORA_TOL
    keys = models.read_tensors(str(root / "adapter_out"))
    assert not [k for k in keys if not k.startswith("base_model.model.model.language_model.")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(_stock(hf_dir)[0],
                                               str(root / "adapter_out")).eval()
    # peft adapts the text model alone: before, target_modules q/k/v_proj matched the tower's
    # q/k/v_proj too, where peft added adapters of its own ("missing adapter keys")
    adapted = {n.rpartition(".lora_")[0] for n, _ in peft_model.named_parameters()
               if ".lora_" in n}
    assert adapted and all(".language_model.layers." in n for n in adapted), sorted(adapted)[:4]
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    peft_logits = _stock_logits(peft_model, batch)
    assert (peft_logits - merged_logits).abs().max().item() <= LORA_TOL
    assert (peft_logits - _stock_logits(_stock(hf_dir)[0], batch)).abs().max().item() > 100 * TOL


def test_step37_export_refuses_a_changed_signed_processor_file(exported):
    """The processor's files travel in the import's signed tokenizer folder: one changed there
    refuses the export of a run trained from it (the key set), naming the file, nothing
    written."""
    root, out = exported
    assert "processor_config.json" in out["refused"], out["refused"]
    assert out["refused"].startswith("CheckpointCorruptError"), out["refused"]
    assert not (root / "refused_out").exists()


def test_step37_export_refuses_a_vision_model_the_folder_does_not_describe(vl_folder):
    """The export keeps the source folder's config.json: a checkpoint whose model.vision is not
    that folder's tower (freeze aside), or that has a vision tower but no Step-3.7 folder behind
    it, is refused in one line naming the setting."""
    import dataclasses

    from mcore_ext.hf import HFConfigError
    from mcore_ext.hf.checkpoint import _check_vision
    from mcore_ext.hf.config.step3p7 import vision_config

    with open(os.path.join(vl_folder[0], "config.json")) as f:
        raw = json.load(f)
    vision = vision_config(raw)
    _check_vision("CKPT", dataclasses.replace(vision, freeze=False), raw)  # freeze: either way
    with pytest.raises(HFConfigError, match=r"CKPT: model.vision.num_layers=3, the Step-3.7 "
                                            r"folder it was imported from has 2"):
        _check_vision("CKPT", dataclasses.replace(vision, num_layers=3), raw)
    with pytest.raises(HFConfigError, match="not imported from a Step-3.7 folder"):
        _check_vision("CKPT", vision, None)


def _export_at(directory, out, **layout):
    import mcore_ext
    from mcore_ext.hf.checkpoint import export_checkpoint

    mcore_ext.init_parallel(**layout)
    export_checkpoint(directory, out)


@pytest.mark.slow
def test_step37_trained_vision_export_is_the_same_at_pp2(run_distributed, exported, tmp_path):
    """The trained run (saved at TP 2 + SP) exported at PP 2 (the tower and projector on the first
    stage, sent to the writer by their stage) writes the same tensors as at TP 2, bit for bit."""
    root, _ = exported
    run = str(root / "run")
    run_distributed(_export_at, run, str(tmp_path / "pp2"), pipeline_model_parallel_size=2,
                    world_size=2)
    models.assert_same_tensors(str(root / "trained_out"), str(tmp_path / "pp2"))
