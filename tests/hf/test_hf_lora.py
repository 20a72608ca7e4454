"""A LoRA adapter exported in PEFT's format loads with ``peft`` over transformers' model.

The tiny Step-3.5 model of tests/hf/models.py (both layer kinds, 1 KV head on the full layers
and 2 on the sliding ones, so 1 query group at TP 2) is loaded into megatron at TP 1 and TP 2;
every target (q, k, v, g, o, gate, up, down_proj) gets the same random non-zero adapter on each
layout, the megatron logits are taken and the adapter exported (``mcore_ext.hf.adapter``).
``peft.PeftModel.from_pretrained`` over transformers' model must give the megatron logits in
fp32 within 2e-5 max abs (the HF parity bound of 1e-5, doubled for the adapters' two extra
GEMMs per target), and the TP 1 and TP 2 exports must be the same tensors bit for bit.

Through the command line: test_hf_lora_moe.py's released-layout test (a launcher LoRA
checkpoint's merged export and its ``--adapter`` export, loaded by transformers and by ``peft``,
agree).
"""

import json
import os

import pytest
import torch

from tests import builders
from tests.hf import models
from tests.hf.test_hf_parity import _full_logits

TOL = 2e-5
RANK, ALPHA = 4, 8.0


def _set_random_adapters(model, seed):
    """The same global adapters on every layout: each tensor drawn whole, this rank's slice kept."""
    from mcore_ext import lora

    rank, tp = builders.tp_rank_and_size()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, adapter in sorted(lora.lora_adapters(model).items()):
            for target_name, target in adapter.targets.items():
                a_shape, b_shape = list(target.lora_A.shape), list(target.lora_B.shape)
                if adapter.parallel == "row":
                    a_shape[1] *= tp
                elif target.rows is None:
                    b_shape[0] *= tp
                a = torch.randn(*a_shape, generator=g) * 0.2
                b = torch.randn(*b_shape, generator=g) * 0.2
                if adapter.parallel == "row":
                    a = a.chunk(tp, dim=1)[rank]
                elif target.rows is None:
                    b = b.chunk(tp, dim=0)[rank]
                target.lora_A.copy_(a)
                target.lora_B.copy_(b)


def _export(hf_dir, out_dir, tokens, tp):
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.adapter import save_adapter

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets="all-linear")
    lora.apply_lora(model, cfg)
    _set_random_adapters(model, seed=5)
    logits = _full_logits(model, tokens)[..., : models.VOCAB]
    save_adapter(model, out_dir, cfg)
    return logits


@pytest.fixture(scope="module")
def exported(run_distributed_shared, tmp_path_factory):
    pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("hf_lora")
    config = models.tiny_config(num_key_value_heads=1, sliding_kv_heads=2)
    hf = models.build(config)
    hf_dir = models.save_released(hf, str(tmp / "hf"))
    tokens = models.tokens()
    out = {}
    for tp in (1, 2):
        logits = run_distributed_shared(_export, hf_dir, str(tmp / f"tp{tp}"), tokens, tp,
                                        world_size=2)
        out[tp] = (str(tmp / f"tp{tp}"), logits[0])
    return config, tokens, out


def test_tp1_and_tp2_adapters_are_the_same_hf_tensors(exported):
    _, _, out = exported
    one, two = (models.read_tensors(out[tp][0]) for tp in (1, 2))
    assert one.keys() == two.keys()
    assert len(one) == 4 * 8 * 2  # layers x targets x (A, B)
    assert "base_model.model.model.layers.1.self_attn.g_proj.lora_B.weight" in one
    assert all(torch.equal(one[k], two[k]) for k in one)
    with open(os.path.join(out[1][0], "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_loads_the_adapter_over_transformers_with_megatrons_logits(exported, tp):
    from peft import PeftModel

    config, tokens, out = exported
    directory, megatron_logits = out[tp]
    peft_model = PeftModel.from_pretrained(models.build(config), directory).eval()
    with torch.no_grad():
        hf_logits = peft_model(tokens)
        base_logits = models.build(config)(tokens)
    diff = (hf_logits - megatron_logits).abs().max().item()
    assert diff <= TOL, diff
    assert (hf_logits - base_logits).abs().max().item() > 100 * TOL  # the adapter acts


# ----------------------------------------------------------------- a PEFT adapter, imported


def _import(hf_dir, adapter_dir, tokens, tp, targets):
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.hf import load_pretrained
    from mcore_ext.hf.adapter import load_adapter

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=targets)
    lora.apply_lora(model, cfg)
    load_adapter(model, adapter_dir, cfg)
    return _full_logits(model, tokens)[..., : models.VOCAB]


def _peft_adapter(config, directory, targets, seed=3):
    """An adapter made by ``peft`` itself over transformers' model: A and B random
    (init_lora_weights=False, so B is not zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(models.build(config), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False))
    peft_model.save_pretrained(directory)
    return peft_model.eval()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_peft_made_adapter_imports_with_peft_logits(run_distributed_shared, tmp_path, tp):
    """peft's random adapter on every target over the tiny Step-3.5 model (1 query group at TP 2:
    q / k / v's B whole on each rank), loaded into megatron with ``load_adapter``: the logits of
    peft's model within 2e-5 (fp32), not the base's."""
    pytest.importorskip("peft")
    config = models.tiny_config(num_key_value_heads=1, sliding_kv_heads=2)
    hf_dir = models.save_released(models.build(config), str(tmp_path / "hf"))
    targets = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    peft_model = _peft_adapter(config, str(tmp_path / "adapter"), targets)
    tokens = models.tokens()
    with torch.no_grad():
        peft_logits, base_logits = peft_model(tokens), models.build(config)(tokens)
    logits = run_distributed_shared(_import, hf_dir, str(tmp_path / "adapter"), tokens, tp,
                                    "all-linear", world_size=2)[0]
    assert (logits - peft_logits).abs().max().item() <= TOL
    assert (peft_logits - base_logits).abs().max().item() > 100 * TOL  # the adapter acts


def _refused(hf_dir, adapter_dir, targets):
    from mcore_ext.hf.adapter import AdapterError

    try:
        _import(hf_dir, adapter_dir, models.tokens(), 1, targets)
    except AdapterError as err:
        return str(err)
    return None


def test_a_peft_adapter_the_project_cannot_place_is_refused_by_name(run_distributed_shared,
                                                                    tmp_path):
    """lm_head among peft's targets: refused naming it; r other than lora.rank: refused naming
    both."""
    pytest.importorskip("peft")
    config = models.tiny_config()
    hf_dir = models.save_released(models.build(config), str(tmp_path / "hf"))
    _peft_adapter(config, str(tmp_path / "head"), ["q_proj", "lm_head"])
    _peft_adapter(config, str(tmp_path / "q"), ["q_proj"])
    head, other = run_distributed_shared(_refused, hf_dir, str(tmp_path / "head"), "q_proj",
                                         world_size=1)[0], \
        run_distributed_shared(_refused, hf_dir, str(tmp_path / "q"), "q_proj k_proj",
                               world_size=1)[0]
    assert head is not None and "target_modules lm_head: the project cannot place" in head, head
    assert other is not None and "target_modules=['q_proj'] but lora.targets=" in other, other
