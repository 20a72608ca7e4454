"""Step-3.7-Flash folders (transformers' ``Step3p7ForConditionalGeneration``): the text model in
and out, the vision tower kept.

The tiny model (tests/hf/models.py: build_vl): tiny_moe_config's text model (4 layers, full and
sliding, MoE layers 1-3 with 8 experts, a random router bias, clamps) plus one MTP layer in a
shard of its own, a 1-layer vision tower and the projector, saved by transformers itself (the
hub's layout: model.layers.*, vision_model.*, vit_large_projector.*, lm_head).

- Text-only logits (no images) of ``load_pretrained`` equal the stock class's within 1e-5 (fp32)
  at TP 1 (TP 2 and EP 2 slow).
- ``hf import`` at TP 2, ``hf export`` at TP 1: every tensor of the folder back bit for bit
  (text, MTP, vision, projector), config.json and the processor file byte for byte; the stock
  class loads it with no missing or unexpected keys. A changed or removed folder is refused in
  one line with nothing written.
- LoRA adapters of a Step-3.7 import written for the stock class (model.language_model.layers):
  ``peft`` over it gives megatron's logits; ``load_adapter`` reads the file back.
"""

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from tests.hf import models
from tests.hf.test_hf_parity import _full_logits

pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(folder, tokens, the stock class's text-only logits)."""
    model = models.build_vl()
    directory = models.save_vl(model, str(tmp_path_factory.mktemp("step37") / "vl"))
    tokens = models.tokens()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return directory, tokens, logits


def _logits(hf_dir, tokens, tp, ep):
    import mcore_ext
    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    return _full_logits(model, tokens)[..., : models.VOCAB]


# TP 2 and EP 2 are slow: the same text model's parity at those layouts is test_hf_moe's, and the
# Step-3.7 model with images (a row without among them) runs at TP 2 + SP and CP 2 by default
# (test_hf_step37_vision); TP 1 stays, the text-only build of a Step-3.7 folder.
@pytest.mark.parametrize("tp, ep", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                    pytest.param(1, 2, marks=pytest.mark.slow)])
def test_step37_text_logits_match_the_stock_class(run_distributed, vl, tp, ep):
    directory, tokens, expected = vl
    for logits in run_distributed(_logits, directory, tokens, tp, ep, world_size=tp * ep):
        assert (logits - expected).abs().max().item() <= TOL


def _import(hf_dir, ckpt, tp):
    import mcore_ext
    from mcore_ext.hf import import_checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    return import_checkpoint(hf_dir, ckpt)


def _cli_in_process(*argv):
    """(exit code, stderr) of ``python -m mcore_ext.hf ARGV`` in this worker."""
    from mcore_ext.hf.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def _in_torch_memory(model):
    """``model`` with every parameter and buffer copied into memory torch allocated."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def test_step37_import_export_keeps_the_vision_tower_bit_for_bit(run_distributed, vl, tmp_path):
    from transformers import Step3p7ForConditionalGeneration

    source, tokens, expected = vl
    hf_dir = str(tmp_path / "vl")
    shutil.copytree(source, hf_dir)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run_distributed(_import, hf_dir, ckpt, 2, world_size=2)
    recorded = json.load(open(os.path.join(ckpt, "iter_0000000", "hf_source.json")))
    assert recorded["text_prefix"] == "model."
    assert "vit_large_projector.weight" in recorded["tensors"]
    assert not any(n.startswith(("model.", "lm_head")) for n in recorded["tensors"])

    code, err = run_distributed(_cli_in_process, "export", ckpt, out, world_size=1)[0]
    assert code == 0, err
    models.assert_same_tensors(hf_dir, out)  # text, MTP, vision and projector
    for name in ("config.json", "preprocessor_config.json", "generation_config.json"):
        assert open(os.path.join(out, name), "rb").read() == \
            open(os.path.join(hf_dir, name), "rb").read(), name
    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # Bit for bit against the source folder's model: every tensor is equal, but a loaded tensor
    # lies where its file's mmap puts it, and CPU GEMM kernels round by the operands' alignment
    # (the two folders' logits differed by ~1e-6 with every tensor equal). Copied into torch's
    # own (aligned) allocations, equal weights give equal logits.
    source_model = Step3p7ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = [_in_torch_memory(m).eval()(input_ids=tokens).logits for m in (model, source_model)]
        assert torch.equal(*logits)
        assert (logits[0] - expected).abs().max().item() <= TOL

    # The folder changed (one vision tensor), then gone: one line each, nothing written.
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    shard = os.path.join(hf_dir, index["vision_model.conv1.weight"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    tensors["vision_model.conv1.weight"] = tensors["vision_model.conv1.weight"] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    code, err = run_distributed(_cli_in_process, "export", ckpt, str(tmp_path / "x"),
                                world_size=1)[0]
    assert code == 2 and err.count("\n") == 1, err
    assert "has changed: vision_model.conv1.weight is not the tensor it was" in err
    shutil.rmtree(hf_dir)
    code, err = run_distributed(_cli_in_process, "export", ckpt, str(tmp_path / "x"),
                                world_size=1)[0]
    assert code == 2 and "is gone" in err and err.startswith("error: "), err
    assert not os.path.exists(tmp_path / "x")


def test_step37_text_config_settings_beyond_step35_are_refused_by_name(vl):
    from mcore_ext.hf import HFConfigError, Step35Config

    raw = json.load(open(os.path.join(vl[0], "config.json")))
    assert Step35Config.from_hf_dict(raw).num_experts == models.EXPERTS
    for key, value, said in (("sparse_attention_config", {"sparse_attention_freq": [1, 0, 0, 0]},
                              "text_config.sparse_attention_config="),
                             ("num_local_experts", 16, "disagree"),
                             ("moe_num_experts", 16, "disagree")):
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = value
        if key == "moe_num_experts":
            bad["text_config"]["n_routed_experts"] = models.EXPERTS
        with pytest.raises(HFConfigError, match=said):
            Step35Config.from_hf_dict(bad)


# ------------------------------------------------------------------------------- adapters

RANK, ALPHA = 4, 8
TARGETS = ["all-linear", "experts.gate_up_proj", "experts.down_proj"]


def _adapters(hf_dir, out_dir, tokens, tp):
    """Random adapters on every target of the Step-3.7 import at ``tp``, the logits, the PEFT
    export for the stock class; then load_adapter of that file into a fresh model."""
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.adapter import load_adapter, save_adapter

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    lora.apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, adapter in sorted(lora.lora_adapters(model).items()):
            for target in adapter.targets.values():
                target.lora_A.copy_(torch.randn(target.lora_A.shape, generator=gen) * 0.2)
                target.lora_B.copy_(torch.randn(target.lora_B.shape, generator=gen) * 0.2)
    logits = _full_logits(model, tokens)[..., : models.VOCAB]
    save_adapter(model, out_dir, cfg, root="model.language_model.")
    fresh = load_pretrained(hf_dir, backend="sdpa").eval()
    lora.apply_lora(fresh, cfg)
    load_adapter(fresh, out_dir, cfg)
    return logits, _full_logits(fresh, tokens)[..., : models.VOCAB]


def test_step37_adapter_loads_in_peft_over_the_stock_class(run_distributed, vl, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    _, tokens, base = vl
    # The folder without its MTP layer: the stock class has no module for MTP adapters.
    directory = models.save_vl(models.build_vl(), str(tmp_path / "vl"), mtp=False)
    out = str(tmp_path / "adapter")
    logits, read_back = run_distributed(_adapters, directory, out, tokens, 1, world_size=1)[0]
    assert torch.equal(logits, read_back)  # lora.init_from's reader places every tensor
    keys = models.read_tensors(out)
    assert "base_model.model.model.language_model.layers.0.self_attn.g_proj.lora_A.weight" in keys
    assert not [k for k in keys if not k.startswith("base_model.model.model.language_model.")]
    peft_model = PeftModel.from_pretrained(models.build_vl(), out).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=tokens).logits
    assert (peft_logits - logits).abs().max().item() <= 2e-5
    assert (peft_logits - base).abs().max().item() > 100 * TOL  # the adapter acts


# ------------------------------------------------------------- through the launcher (slow)


@pytest.mark.slow
def test_step37_chat_lora_fine_tune_exports_what_the_stock_class_and_peft_load(
        run_distributed, tmp_path):
    """hf import of a Step-3.7 folder with the SFT recipe's ChatML tokenizer, a LoRA chat
    fine-tune through the launcher (in-process, 3 steps), then ``hf export`` (merged) and
    ``hf export --adapter``: the stock class loads the merged folder with no missing or
    unexpected keys, its vision tower and projector bit for bit the source's, and peft over the
    stock class with the adapter gives the merged model's logits within 2e-5."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Step3p7ForConditionalGeneration

    from tests.functional.inprocess import completed, launch
    from tests.functional.test_pretrain import check
    from tests.hf.test_hf_sft import CHAT, TOKENIZER, VOCAB

    config = models.tiny_vl_config(models.tiny_moe_config(vocab_size=VOCAB,
                                                          max_position_embeddings=128))
    hf = tmp_path / "hf"
    models.save_vl(models.build_vl(config), str(hf), mtp=False)
    for name in os.listdir(TOKENIZER):
        shutil.copyfile(TOKENIZER / name, hf / name)
    ckpt, run = tmp_path / "ckpt", tmp_path / "ft"
    code, err = run_distributed(_cli_in_process, "import", str(hf), str(ckpt), world_size=1)[0]
    assert code == 0, err
    result = check(completed(run_distributed(
        launch, "--config", str(ckpt / "iter_0000000" / "config.yaml"), "data.source=chat",
        f"data.path={CHAT}", "training.micro_batch_size=2", "training.global_batch_size=2",
        "training.train_iters=3", "training.eval_interval=null", "optimizer.lr=1e-2",
        "optimizer.lr_warmup_iters=1", "model.attention_backend=sdpa", "lora.rank=4",
        "lora.alpha=8", f"checkpoint.save={run}", "logging.metrics_file=null",
        world_size=1, timeout=600)[0]), "launcher")
    assert "LoRA adapter parameters trained" in result.stdout
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for target, extra in ((merged, ()), (adapter, ("--adapter",))):
        code, err = run_distributed(_cli_in_process, "export", str(run), str(target), *extra,
                                    world_size=1)[0]
        assert code == 0, err

    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        str(merged), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before, after = models.read_tensors(str(hf)), models.read_tensors(str(merged))
    kept = [n for n in before if not n.startswith(("model.", "lm_head"))]
    assert kept and all(torch.equal(before[n], after[n]) for n in kept)
    assert (merged / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    tokens = models.tokens() % VOCAB
    peft_model = PeftModel.from_pretrained(models.build_vl(config), str(adapter)).eval()
    with torch.no_grad():
        merged_logits = model.eval()(input_ids=tokens).logits
        peft_logits = peft_model(input_ids=tokens).logits
        base_logits = models.build_vl(config)(input_ids=tokens).logits
    assert (merged_logits - peft_logits).abs().max().item() <= 2e-5
    assert (peft_logits - base_logits).abs().max().item() > 100 * TOL


def _import_export(hf_dir, ckpt, out):
    return [_cli_in_process("import", hf_dir, ckpt), _cli_in_process("export", ckpt, out)]


@pytest.mark.slow
def test_step37_folder_in_transformers_module_names_round_trips(run_distributed, vl, tmp_path):
    """A folder saved with transformers' own names (save_original_format=False: the text model
    under model.language_model., fused experts.gate_up_proj) imports and exports under the same
    prefix (MoE tensors in the hub's spelling, which the stock class reads through its
    conversion mapping): no missing or unexpected keys, the same logits, the vision tower bit
    for bit."""
    from transformers import Step3p7ForConditionalGeneration

    _, tokens, expected = vl
    hf_dir, out = str(tmp_path / "native"), str(tmp_path / "out")
    models.build_vl().save_pretrained(hf_dir, save_original_format=False)
    results = run_distributed(_import_export, hf_dir, str(tmp_path / "ckpt"), out,
                              world_size=1)[0]
    assert all(code == 0 for code, _ in results), results
    before, after = models.read_tensors(hf_dir), models.read_tensors(out)
    assert "model.language_model.layers.1.moe.gate_proj.weight" in after
    kept = [n for n in before if not n.startswith(("model.language_model.", "lm_head"))]
    assert kept and all(torch.equal(before[n], after[n]) for n in kept)
    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # Bit for bit against the source folder's model: every tensor is equal, but a loaded tensor
    # lies where its file's mmap puts it, and CPU GEMM kernels round by the operands' alignment
    # (the two folders' logits differed by ~1e-6 with every tensor equal). Copied into torch's
    # own (aligned) allocations, equal weights give equal logits.
    source_model = Step3p7ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = [_in_torch_memory(m).eval()(input_ids=tokens).logits for m in (model, source_model)]
        assert torch.equal(*logits)
        assert (logits[0] - expected).abs().max().item() <= TOL


KEY = "MCORE_EXT_CHECKPOINT_KEY"


def _with_key(fn, *args):
    os.environ[KEY] = "k3y"
    try:
        return fn(*args)
    finally:
        del os.environ[KEY]


def _export_swapping_between_check_and_write(ckpt, out, shard, name):
    """``hf export`` (with the key) during which ``name`` in the folder's ``shard`` is replaced
    right after the export checked the folder (step37.check_source), before it is written."""
    from safetensors.torch import load_file, save_file

    from mcore_ext.hf import step37

    check = step37.check_source

    def check_then_swap(source, *written):
        found = check(source, *written)
        tensors = load_file(shard)
        tensors[name] = tensors[name] + 1
        save_file(tensors, shard, metadata={"format": "pt"})
        return found

    step37.check_source = check_then_swap
    try:
        return _with_key(_cli_in_process, "export", ckpt, out)
    finally:
        step37.check_source = check


def test_step37_export_with_the_key_writes_only_what_it_checked(run_distributed, vl, tmp_path):
    """Issue 54.4: the export hashed the kept tensors (check_source), then read them again to
    write them: a vision tensor swapped in between went out under the key (old code: exit 0, the
    swapped tensor exported). Now each is checked as it is read for writing: one line, exit 2,
    nothing written. Issue 54.2's Step-3.7 case: the import's signed hf_config.json deleted, the
    old export of a run fine-tuned from it passed over it and wrote a Step-3.5 model without the
    vision tower (exit 0); now refused naming it."""
    source = vl[0]
    hf_dir, ckpt = str(tmp_path / "vl"), str(tmp_path / "ckpt")
    shutil.copytree(source, hf_dir)
    run_distributed(_with_key, _import, hf_dir, ckpt, 1, world_size=1)
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    name = "vision_model.conv1.weight"
    code, err = run_distributed(_export_swapping_between_check_and_write, ckpt,
                                str(tmp_path / "out"), os.path.join(hf_dir, index[name]), name,
                                world_size=1)[0]
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the Step-3.7 folder this checkpoint was imported from") and (
        f"has changed: {name} is not the tensor it was at import" in err), err
    assert not os.path.exists(tmp_path / "out")

    # A run fine-tuned from the import (1 step), then the import's hf_config.json deleted.
    run = str(tmp_path / "run")
    (trained,) = run_distributed(_with_key, _fine_tune_one_step, ckpt, run, world_size=1)
    assert trained["code"] == 0, trained
    os.remove(os.path.join(ckpt, "iter_0000000", "hf_config.json"))
    code, err = run_distributed(_with_key, _cli_in_process, "export", run,
                                str(tmp_path / "out"), world_size=1)[0]
    assert code == 2 and err.startswith(
        f"error: checkpoint {ckpt}/iter_0000000 is corrupt: hf_config.json missing"), err
    assert not os.path.exists(tmp_path / "out")


def _fine_tune_one_step(ckpt, run):
    from tests.functional.inprocess import launch

    return launch("--config", os.path.join(ckpt, "iter_0000000", "config.yaml"),
                  "data.source=mock", f"checkpoint.load={ckpt}", "checkpoint.finetune=true",
                  f"checkpoint.save={run}", "training.micro_batch_size=1",
                  "training.global_batch_size=1", "training.train_iters=1",
                  "optimizer.lr_warmup_iters=0", "training.eval_interval=null",
                  "logging.metrics_file=null")
