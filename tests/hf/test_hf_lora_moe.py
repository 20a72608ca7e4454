"""LoRA adapters of MoE experts in PEFT's format, both ways, at EP 2.

The tiny MoE model of tests/hf/models.py (layers 1-3 MoE: 8 experts, top-3, a shared expert;
routed clamps) is loaded into megatron at EP 2 on 2 gloo ranks. Export: every target adapted
(``all-linear``, the shared experts' gate / up / down_proj among them, and the routed experts'
``experts.gate_up_proj`` / ``experts.down_proj``, each expert its own random A and B), the
megatron logits taken and the adapter written (``mcore_ext.hf.adapter``): ``peft``'s
``PeftModel.from_pretrained`` over transformers' model (the experts through PEFT's
``target_parameters``) gives those logits within 2e-5 (fp32, test_hf_lora's bound). Import: an
adapter ``peft`` made itself on the same targets (random A and B) loads with ``load_adapter`` at
EP 2 and gives peft's logits within 2e-5.
"""

import json
import os

import pytest
import torch

from tests.hf import models
from tests.hf.test_hf_lora import ALPHA, RANK, TOL
from tests.hf.test_hf_parity import _full_logits

TARGETS = ["all-linear", "experts.gate_up_proj", "experts.down_proj"]
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj"]
PEFT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def _load(hf_dir):
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(expert_model_parallel_size=2)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS)
    lora.apply_lora(model, cfg)
    return model, cfg


def _export(hf_dir, out_dir, tokens):
    """Random adapters (TP 1; an expert's drawn with its EP rank in the seed, so no two experts
    share one), the logits, and the PEFT export."""
    from megatron.core import parallel_state as ps

    from mcore_ext import lora
    from mcore_ext.hf.adapter import save_adapter

    model, cfg = _load(hf_dir)
    shared = torch.Generator().manual_seed(5)
    own = torch.Generator().manual_seed(100 + ps.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, adapter in sorted(lora.lora_adapters(model).items()):
            g = own if ".local_experts." in name else shared
            for target in adapter.targets.values():
                target.lora_A.copy_(torch.randn(target.lora_A.shape, generator=g) * 0.2)
                target.lora_B.copy_(torch.randn(target.lora_B.shape, generator=g) * 0.2)
    logits = _full_logits(model, tokens)[..., : models.VOCAB]
    save_adapter(model, out_dir, cfg)
    return logits


def _import(hf_dir, adapter_dir, tokens):
    from mcore_ext.hf.adapter import load_adapter

    model, cfg = _load(hf_dir)
    load_adapter(model, adapter_dir, cfg)
    return _full_logits(model, tokens)[..., : models.VOCAB]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    pytest.importorskip("peft")
    directory, _ = models.save_moe(models.build_moe(),
                                   str(tmp_path_factory.mktemp("hf_lora_moe") / "moe"), mtp=False)
    return directory


def test_expert_adapters_export_to_peft_with_megatrons_logits(run_distributed_shared, moe_dir,
                                                              tmp_path):
    from peft import PeftModel

    tokens = models.tokens()
    out = str(tmp_path / "adapter")
    logits = run_distributed_shared(_export, moe_dir, out, tokens, world_size=2)[0]
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["target_parameters"] == PEFT_PARAMETERS and config["lora_dropout"] == 0.0
    tensors = models.read_tensors(out)
    # layer 1's routed experts: gate_up_proj inner (base_layer), down_proj outer, 8 experts x r
    assert tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"] \
        .shape == (8 * RANK, 32)
    assert tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"].shape == \
        (32, 8 * RANK)
    assert "base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_B.weight" in tensors
    peft_model = PeftModel.from_pretrained(models.build_moe(), out).eval()
    with torch.no_grad():
        hf_logits = peft_model(tokens)
        base_logits = models.build_moe()(tokens)
    assert (hf_logits - logits).abs().max().item() <= TOL
    assert (hf_logits - base_logits).abs().max().item() > 100 * TOL  # the adapter acts


def test_a_peft_made_expert_adapter_imports_with_peft_logits(run_distributed_shared, moe_dir,
                                                             tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    peft_model = get_peft_model(models.build_moe(), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=PEFT_MODULES,
        target_parameters=PEFT_PARAMETERS, init_lora_weights=False)).eval()
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    tokens = models.tokens()
    with torch.no_grad():
        peft_logits, base_logits = peft_model(tokens), models.build_moe()(tokens)
    logits = run_distributed_shared(_import, moe_dir, str(tmp_path / "adapter"), tokens,
                                    world_size=2)[0]
    assert (logits - peft_logits).abs().max().item() <= TOL
    assert (peft_logits - base_logits).abs().max().item() > 100 * TOL


# ------------------------------------- the released layout (MoE + MTP): import, LoRA, --adapter

ATTENTION = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj"]


def _released_lora_path(hf_dir, tmp):
    """On 2 ranks, in process: ``hf import`` (HybridModel, the default on megatron-core 0.19), a
    LoRA run of the launcher at TP 2 + SP on the attention targets for 3 steps, ``hf export``
    merged and ``--adapter``, then a new run started from that adapter (``lora.init_from``, lr 0,
    1 step) that saves what it read."""
    from tests.functional.inprocess import launch
    from tests.functional.test_lora import _hf

    out = {"import": _hf("import", hf_dir, tmp / "imported", "--seq-length", 16)}
    common = ["--config", tmp / "imported" / "iter_0000000" / "config.yaml", "data.source=mock",
              "training.micro_batch_size=2", "training.global_batch_size=2",
              "training.eval_interval=null", "model.attention_backend=sdpa",
              "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
              "model.moe_router_bias_update_rate=0", "lora.rank=4", "lora.alpha=8",
              f"lora.targets=[{','.join(ATTENTION)}]", "logging.metrics_file=null"]
    steps = [
        ("lora", lambda: launch(*common, "training.train_iters=3", "optimizer.lr=1e-2",
                                "optimizer.lr_warmup_iters=0", f"checkpoint.save={tmp / 'run'}",
                                "checkpoint.save_interval=3")),
        ("merged", lambda: _hf("export", tmp / "run", tmp / "merged")),
        ("adapter", lambda: _hf("export", tmp / "run", tmp / "adapter", "--adapter")),
        ("from_peft", lambda: launch(*common, "training.train_iters=1", "optimizer.lr=0",
                                     "optimizer.min_lr=0", "optimizer.lr_warmup_iters=0",
                                     f"lora.init_from={tmp / 'adapter'}",
                                     f"checkpoint.save={tmp / 'from_peft'}",
                                     "checkpoint.save_interval=1")),
    ]
    for name, step in steps:
        if any(r["code"] for r in out.values()):
            break
        out[name] = step()
    return out


def test_released_layout_lora_exports_a_peft_adapter_and_its_mtp_adapters(run_distributed,
                                                                          tmp_path):
    """Issue 44, item 9: LoRA on q/k/v/g/o_proj adapts the MTP layer too (it has the same
    linears); ``hf export --adapter`` writes the decoder's adapters in PEFT's format and the MTP
    layer's beside them (``mtp_adapter_model.safetensors``, said once in one line). ``peft``
    over transformers' model gives the merged export's logits (fp32, within 2e-5), not the base
    model's; ``lora.init_from`` reads both files back: the new run's adapters, MTP layer's
    included, are the trained run's bit for bit (lr 0)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.functional.test_lora import ADAPTER
    from tests.functional.test_megatron_lm_pretrain import checkpoint_tensors

    hf_dir, _ = models.save_moe(models.build_moe(), str(tmp_path / "hf"), mtp=True)
    results = run_distributed(_released_lora_path, hf_dir, tmp_path, world_size=2, timeout=900)
    for rank in results:
        assert all(r["code"] == 0 for r in rank.values()), {
            k: (r["code"], r["stderr"][-1500:]) for k, r in rank.items() if r["code"]}
    lines = [line for rank in results for line in rank["adapter"]["stdout"].splitlines()
             if "MTP layers' adapters" in line]
    assert len(lines) == 1 and "mtp_adapter_model.safetensors" in lines[0], lines
    assert "LoRA adapters from" in results[0]["from_peft"]["stdout"]
    assert "start new" not in results[0]["from_peft"]["stdout"]
    adapter = tmp_path / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "mtp_adapter_model.safetensors"]
    n = len(models.MOE_TYPES)
    mtp, decoder = (load_file(adapter / f"{name}.safetensors")
                    for name in ("mtp_adapter_model", "adapter_model"))
    assert all(k.startswith(f"base_model.model.model.layers.{n}.self_attn.") for k in mtp)
    assert len(mtp) == len(ATTENTION) * 2, sorted(mtp)
    assert len(decoder) == n * len(ATTENTION) * 2, sorted(decoder)

    # peft over transformers' model (MTP layers dropped) = the merged export, in transformers.
    merged = models.build_moe()
    merged.load_state_dict(models.transformers_tensors(models.read_tensors(
        str(tmp_path / "merged")), n), strict=True)
    peft_model = PeftModel.from_pretrained(models.build_moe(), str(adapter)).eval()
    tokens = models.tokens()
    with torch.no_grad():
        merged_logits, peft_logits = merged.eval()(tokens), peft_model(tokens)
        base_logits = models.build_moe()(tokens)
    assert (merged_logits - peft_logits).abs().max().item() <= TOL
    assert (peft_logits - base_logits).abs().max().item() > 100 * TOL  # the adapters act

    # lora.init_from read the MTP file back: every adapter as trained (lr 0 keeps them).
    trained, started = ({k: v for k, v in checkpoint_tensors(path).items()
                         if ADAPTER in k and not k.startswith("optimizer.")}
                        for path in (tmp_path / "run" / "iter_0000003",
                                     tmp_path / "from_peft" / "iter_0000001"))
    assert any(k.startswith("mtp.") for k in trained), sorted(trained)
    assert sorted(trained) == sorted(started)
    assert all(torch.equal(trained[k], started[k]) for k in trained), [
        k for k in trained if not torch.equal(trained[k], started[k])]
