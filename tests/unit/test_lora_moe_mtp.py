"""LoRA on a MoE model at EP 2 (routed experts, each its own A, B; the shared expert) and on MTP
layers, against the formula.

The 4-layer Step-3.5-like MoE model of tests/unit/test_moe.py (dense layer 1, MoE layers 2-4:
4 experts, top-2, a shared expert, routed and shared clamps) at EP 2 on 2 gloo ranks (2 local
experts each, the alltoall dispatcher, mcore_ext's grouped-GEMM experts, which run their loop
while the expert linears carry adapters), every target adapted (``all-linear`` and
``experts.gate_up_proj`` / ``experts.down_proj``), each adapter random and non-zero. The
reference (``tests.reference.step35_logits``, plain PyTorch) runs on the effective weights
``W + (alpha / r) B A`` written here per target: q / k / v / g / o_proj, the dense and shared
gate / up / down_proj, and per routed expert its ``[gate ; up]`` rows (one A, B) and down_proj.

fp32, test_moe's bounds: logits within 1e-5; adapter gradients within 1e-4 max(1, max|ref|)
(an expert's gradient is 2 x the reference's: both ranks feed the whole batch and each expert
sees both copies, as in test_moe). Then only adapters have gradients, and megatron's DDP and
Adam (fp32) hold gradient buffers and optimizer state for the adapters only, the experts'
adapters in the expert-parallel optimizer of the chain.

MTP: test_mtp's model (2 Step-3.5 depths), every all-linear target adapted on the main and MTP
layers, each depth's logits vs ``reference.step35_mtp_logits`` on the effective weights (1e-5);
their export in PEFT's format is refused in one line (transformers' model has no MTP layers).
"""

from pathlib import Path

import pytest
import torch

from tests import builders, reference
from tests.unit import test_moe

RANK, ALPHA = 2, 6.0
TARGETS = ["all-linear", "experts.gate_up_proj", "experts.down_proj"]
TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")
MOE_TINY = str(Path(__file__).resolve().parents[2] / "configs" / "step35_moe_tiny_cpu.yaml")


def _global_adapters(layers, gen):
    """{(layer, HF weight name): (A, B)} for every adapted weight; routed experts' fc1 as one
    ``experts_gate_up`` adapter per expert ([2 f, r] B), listed per expert."""
    h, d = test_moe.HIDDEN, test_moe.HEAD_DIM
    f, fs, fd = test_moe.MOE_FFN, test_moe.SHARED_FFN, test_moe.FFN

    def pair(out, inp):
        return (torch.randn(RANK, inp, generator=gen) * 0.1,
                torch.randn(out, RANK, generator=gen) * 0.1)

    adapters = {}
    for i, kind in enumerate(layers):
        n, g = kind["heads"], kind["groups"]
        shapes = dict(q_proj=(n * d, h), k_proj=(g * d, h), v_proj=(g * d, h), g_proj=(n, h),
                      o_proj=(h, n * d))
        if kind.get("moe"):
            shapes.update(shared_gate_proj=(fs, h), shared_up_proj=(fs, h),
                          shared_down_proj=(h, fs))
            for e in range(test_moe.EXPERTS):
                shapes[f"experts_gate_up.{e}"] = (2 * f, h)
                shapes[f"experts_down_proj.{e}"] = (h, f)
        else:
            shapes.update(gate_proj=(fd, h), up_proj=(fd, h), down_proj=(h, fd))
        for name, (out, inp) in shapes.items():
            adapters[(i, name)] = pair(out, inp)
    return adapters


def _effective(weights, adapters, scaling):
    """The reference's weights: W + scaling B A per adapted weight (A, B leaves with grads)."""
    layers = [dict(w) for w in weights["layers"]]
    f = test_moe.MOE_FFN
    for (i, name), (a, b) in adapters.items():
        delta = scaling * b @ a
        w = layers[i]
        if name.startswith("experts_"):  # expert e's slice of the stacked [E, out, in]
            kind, _, e = name.partition(".")
            one_hot = (torch.arange(test_moe.EXPERTS) == int(e)).view(-1, 1, 1)
            parts = ((("experts_gate_proj", delta[:f]), ("experts_up_proj", delta[f:]))
                     if kind == "experts_gate_up" else (("experts_down_proj", delta),))
            for key, part in parts:
                w[key] = w[key] + one_hot * part
        else:
            w[name] = w[name] + delta
    return {**weights, "layers": layers}


def _megatron_name(model, name):
    """(layer index, HF weight name) of an adapter target's parameters in ``model``."""
    from megatron.core import parallel_state as ps

    parts = name.split(".")
    i = model.decoder.layers[int(parts[2])].layer_number - 1
    target = parts[-1]
    if "local_experts" in parts:
        e = ps.get_expert_model_parallel_rank() * (test_moe.EXPERTS //
                                                   ps.get_expert_model_parallel_world_size()) \
            + int(parts[parts.index("local_experts") + 1])
        return i, (f"experts_gate_up.{e}" if target == "gate_up_proj"
                   else f"experts_down_proj.{e}")
    return i, ("shared_" + target if "shared_experts" in parts else target)


def _moe_lora_vs_formula():
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(expert_model_parallel_size=2)
    config = test_moe.moe_config(ep=2, dispatcher="alltoall", moe_grouped_gemm=True)
    layers = builders.reference_layers(config)
    weights = test_moe.global_weights(layers)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, test_moe.VOCAB, (test_moe.BATCH, test_moe.SEQ), generator=gen)
    target = torch.randn(test_moe.BATCH, test_moe.SEQ, test_moe.VOCAB, generator=gen)
    adapters = _global_adapters(layers, gen)
    for a, b in adapters.values():
        a.requires_grad_()
        b.requires_grad_()
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS)
    expected = reference.step35_logits(tokens, _effective(weights, adapters, cfg.scaling),
                                       layers, test_moe.EPS)
    (expected * target).sum().backward()
    with torch.no_grad():
        base = reference.step35_logits(tokens, weights, layers, test_moe.EPS)

    model = mcore_ext.build_gpt_model(config, vocab_size=test_moe.VOCAB,
                                      max_sequence_length=test_moe.SEQ, backend="sdpa")
    test_moe.load_weights(model, config, weights)
    added = lora.apply_lora(model, cfg)
    found = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.ADAPTER_KEY in name:
                key = _megatron_name(model, name.rpartition(".lora_")[0])
                a, b = adapters[key]
                param.copy_(a if name.endswith("lora_A") else b)
                found[name] = (key, name.endswith("lora_A"))
    positions = torch.arange(test_moe.SEQ).expand_as(tokens)
    with cuda_to_cpu():
        logits = test_moe._logits_and_grads(model, tokens, target, positions)
    grad_diff, grad_scale = 0.0, 0.0
    for name, param in model.named_parameters():
        if name not in found:
            continue
        key, is_a = found[name]
        factor = 2 if key[1].startswith("experts_") else 1  # both ranks' batches reach an expert
        want = adapters[key][0 if is_a else 1].grad
        grad_diff = max(grad_diff, (param.grad - factor * want).abs().max().item())
        grad_scale = max(grad_scale, want.abs().max().item())
    return dict(
        diff=(logits - expected.detach()).abs().max().item(), scale=expected.abs().max().item(),
        moved=(logits - base).abs().max().item(),
        grad_diff=grad_diff,
        grad_scale=grad_scale, adapted=sorted({k for k, _ in found.values()}), added=len(added),
        base_grads=[n for n, p in model.named_parameters()
                    if lora.ADAPTER_KEY not in n and p.grad is not None],
        grouped_ran=[layer.mlp.experts.last_forward_grouped for layer in model.decoder.layers
                     if hasattr(layer.mlp, "experts")],
        optimizer=_optimizer_state(config, model))


def _optimizer_state(config, gpt):
    """One step of megatron's DDP + Adam (fp32) over the adapted model: the parameters with a
    gradient buffer, those in the optimizers (dense / expert-parallel) and their Adam state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mcore_ext import lora
    from mcore_ext._cpu_compat import cuda_to_cpu

    names = {p: n for n, p in gpt.named_parameters()}
    with cuda_to_cpu():
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
        builders.train_step(model, optimizer, torch.randint(
            0, test_moe.VOCAB, (2, test_moe.SEQ + 1), generator=torch.Generator().manual_seed(0)))
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    held = [sorted(names[p] for g in o.optimizer.param_groups for p in g["params"])
            for o in chained]
    state = sum(s["exp_avg"].numel() for o in chained for s in o.optimizer.state.values())
    adapters = [n for n in names.values() if lora.ADAPTER_KEY in n]
    return dict(held=held, state=state, adapters=sorted(adapters),
                adapter_numel=sum(p.numel() for p, n in names.items() if n in adapters),
                buffered=sorted(n for p, n in names.items() if hasattr(p, "main_grad")))


def test_moe_lora_at_ep2_matches_formula_and_trains_adapters_only(run_distributed):
    for rank, r in enumerate(run_distributed(_moe_lora_vs_formula, world_size=2)):
        assert r["diff"] <= test_moe.TOL, (rank, r["diff"], r["scale"])
        assert r["moved"] > 100 * test_moe.TOL, r["moved"]  # the adapters act
        assert r["grad_diff"] <= test_moe.GRAD_TOL * max(1.0, r["grad_scale"]), (rank, r)
        # every kind is adapted: attention, dense and shared MLP, this rank's routed experts
        names = {name for _, name in r["adapted"]}
        local = range(2 * rank, 2 * rank + 2)
        assert {f"experts_gate_up.{e}" for e in local} | {f"experts_down_proj.{e}"
                                                          for e in local} < names, names
        assert {"g_proj", "shared_gate_proj", "shared_down_proj", "up_proj"} < names, names
        assert not any(f"experts_gate_up.{e}" in names for e in range(4) if e not in local)
        assert r["base_grads"] == [], r["base_grads"]
        assert r["grouped_ran"] == [False, False, False]  # the loop, where the hooks run
        opt = r["optimizer"]
        assert opt["buffered"] == opt["adapters"]
        held = opt["held"]
        assert len(held) == 2 and sorted(held[0] + held[1]) == opt["adapters"], held
        expert_part = [h for h in held if any("local_experts" in n for n in h)]
        assert len(expert_part) == 1 and all("local_experts" in n for n in expert_part[0])
        assert opt["state"] == opt["adapter_numel"]


# ------------------------------------------------------------------------------ MTP layers


def _mtp_lora_vs_formula():
    """test_mtp's model (4 main layers, 2 Step-3.5 MTP depths) at TP 1, every all-linear target
    adapted with random A and B on the main and the MTP layers: each depth's logits vs
    ``reference.step35_mtp_logits`` on the effective weights, and the gradients' owners."""
    import mcore_ext
    from mcore_ext import lora
    from mcore_ext.hf import adapter as peft_format
    from mcore_ext.models import mtp_logits
    from tests.unit import test_mtp

    mcore_ext.init_parallel()
    model, weights, main_layers, mtp_layers = test_mtp._build_loaded(1, True)
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets="all-linear")
    lora.apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(5)
    effective = {**weights, "layers": [dict(w) for w in weights["layers"]],
                 "mtp": [dict(w) for w in weights["mtp"]]}
    with torch.no_grad():
        for name, adapter in lora.lora_adapters(model).items():
            parts = name.split(".")
            w = (effective["mtp"] if parts[0] == "mtp" else effective["layers"])[int(parts[2])]
            for target_name, target in adapter.targets.items():
                target.lora_A.normal_(0, 0.1, generator=gen)
                target.lora_B.normal_(0, 0.1, generator=gen)
                w[target_name] = w[target_name] + cfg.scaling * target.lora_B @ target.lora_A
    tokens = torch.randint(0, test_mtp.VOCAB, (test_mtp.BATCH, test_mtp.SEQ),
                           generator=torch.Generator().manual_seed(3))
    got = mtp_logits(model, tokens, torch.arange(test_mtp.SEQ).expand_as(tokens))
    sum(x.sum() for x in got).backward()
    with torch.no_grad():
        expected = reference.step35_mtp_logits(tokens, effective, main_layers, mtp_layers,
                                               test_mtp.EPS)
        base = reference.step35_mtp_logits(tokens, weights, main_layers, mtp_layers,
                                           test_mtp.EPS)
    valid = [slice(None, test_mtp.SEQ - k - 1) for k in range(len(got))]
    # transformers' model has no MTP layers: their adapters are named as the layers after the
    # decoder's (num_layers + depth), which hf export --adapter writes beside the PEFT file.
    import re

    keys = peft_format.adapter_tensors(model, cfg)
    num_layers = model.config.num_layers
    mtp_layers_named = sorted({int(re.search(r"\.layers\.(\d+)\.", k)[1]) for k in keys
                               if peft_format._is_mtp_key(k, num_layers)})
    return dict(mtp_layers_named=mtp_layers_named, num_layers=num_layers,
        diffs=[(g[:, v] - e[:, v]).abs().max().item() for g, e, v in zip(got, expected, valid)],
        moved=[(e[:, v] - b[:, v]).abs().max().item() for e, b, v in zip(expected, base, valid)],
        mtp_adapters=sorted(n for n in lora.lora_adapters(model) if n.startswith("mtp.")),
        with_grad=sorted(n for n, p in model.named_parameters() if p.grad is not None
                         and n.startswith("mtp.")),
        mtp_adapter_params=sorted(n for n, p in model.named_parameters()
                                  if n.startswith("mtp.") and lora.ADAPTER_KEY in n))


def test_mtp_layers_lora_matches_formula_and_only_adapters_get_gradients(run_distributed):
    """The MTP depths' attention and MLP carry adapters that act as the formula says (test_mtp's
    1e-5 on O(1) logits), and the MTP loss's gradients reach those adapters, no base weight;
    PEFT's format cannot hold them (one line naming them)."""
    from tests.unit import test_mtp

    r = run_distributed(_mtp_lora_vs_formula, world_size=1)[0]
    assert all(d <= test_mtp.TOL for d in r["diffs"]), r["diffs"]
    assert all(m > 100 * test_mtp.TOL for m in r["moved"]), r["moved"]
    assert len(r["mtp_adapters"]) == 2 * 4, r["mtp_adapters"]  # 2 depths x qkv, proj, fc1, fc2
    assert r["with_grad"] == r["mtp_adapter_params"] and r["with_grad"], r["with_grad"]
    # Each of the 2 depths' adapters under its own layer number after the decoder's.
    assert r["mtp_layers_named"] == [r["num_layers"], r["num_layers"] + 1], r["mtp_layers_named"]


@pytest.mark.parametrize("overrides, message", [
    (["lora.targets=[experts.down_proj]"],
     "lora.targets: experts.down_proj adapt routed experts, and model.num_moe_experts is not set"),
    (["lora.targets=[all-linear,experts.gate_up_proj]", "model.num_moe_experts=4",
      "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true"],
     "with expert tensor parallelism 2 (parallelism.expert_tensor_parallel_size, default the TP "
     "size): routed experts' adapters need parallelism.expert_tensor_parallel_size=1"),
    (["--config", MOE_TINY, "parallelism.expert_model_parallel_size=2"],
     "lora.rank=4 with model.moe_router_bias_update_rate=0.001: the router's expert bias is a "
     "frozen base weight in a LoRA run"),
])
def test_routed_expert_targets_the_model_cannot_take_are_one_line(overrides, message):
    from mcore_ext.training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        config = overrides[1] if overrides[0] == "--config" else TINY
        load_config(config, ["lora.rank=4", *overrides[2 * (config != TINY):]], world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
