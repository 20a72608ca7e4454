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
