"""LoRA on the gated attention + dense MLP: numerics against the formula, frozen base, merge.

Every rank builds the same global weights and adapters (HF layout: q/k/v/g/o_proj,
gate/up/down_proj, A [r, in], B [out, r]) from one seed, loads its TP slices into megatron's
gated attention and MLP, and compares with a plain-PyTorch reference on the effective weights
W + (alpha / r) B A per target (``tests.reference.gated_attention``, then SwiGLU), micro-batch 2,
TP 1 and TP 2 with sequence parallelism, including 1 query group at TP 2 (a rank's QKV rows cut
through the group).

Tolerances: fp32 max abs diff <= 2e-6 max(1, max|ref|) (about 16 fp32 roundings; outputs reach
about 10, gradients about 100). bf16:
the layers compute in bf16 on the bf16-rounded weights, adapters and input, the reference in fp32
on the same values; the adapter adds two rounded GEMMs beside the base's, so outputs within
10 u max|ref| and gradients within 20 u max|ref| (u = 2^-8; a misplaced adapter row moves them by
tens of percent).
"""

import pytest
import torch

from tests import builders, reference

FP32_REL_TOL = 2e-6
BF16_REL_TOL = {"output": 10 * reference.BF16_UNIT_ROUNDOFF,
                "grad": 20 * reference.BF16_UNIT_ROUNDOFF}
RANK, ALPHA = 4, 8.0
FFN = 16

CASES = {
    "gqa": dict(num_attention_heads=4, num_query_groups=2),
    "one_group": dict(num_attention_heads=8, num_query_groups=1, kv_channels=8),
}


def _build(tp, case, dtype, backend="sdpa"):
    import mcore_ext
    from megatron.core.process_groups_config import ProcessGroupCollection

    overrides = dict(CASES[case])
    if dtype == "bf16":
        overrides.update(params_dtype=torch.bfloat16, bf16=True)
    config = builders.gated_config(
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, ffn_hidden_size=FFN,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, **overrides)
    attn = builders.build_self_attention(config, backend)
    mlp_spec = mcore_ext.get_gpt_layer_spec(config, backend).submodules.mlp
    mlp = mlp_spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                   is_mtp_layer=False)
    return config, torch.nn.ModuleDict(dict(attn=attn, mlp=mlp))


def _global_weights(config, generator, bf16):
    heads, groups, hn, h = (config.num_attention_heads, config.num_query_groups,
                            config.kv_channels, config.hidden_size)
    w = builders.gated_attention_weights(heads, groups, hn, h, generator)
    w = dict(q_proj=w["q"], k_proj=w["k"], v_proj=w["v"], g_proj=w["gate"], o_proj=w["o"],
             gate_proj=torch.randn(FFN, h, generator=generator) * 0.2,
             up_proj=torch.randn(FFN, h, generator=generator) * 0.2,
             down_proj=torch.randn(h, FFN, generator=generator) * 0.2)
    lora = {name: (torch.randn(RANK, t.size(1), generator=generator) * 0.2,
                   torch.randn(t.size(0), RANK, generator=generator) * 0.2)
            for name, t in w.items()}
    if bf16:  # the reference computes in fp32 on exactly the values the layers hold
        w = {k: v.bfloat16().float() for k, v in w.items()}
        lora = {k: (a.bfloat16().float(), b.bfloat16().float()) for k, (a, b) in lora.items()}
    return w, lora


def _load(model, config, w, lora, rank, tp):
    from mcore_ext import lora as lora_mod

    attn, mlp = model["attn"], model["mlp"]
    heads, groups = config.num_attention_heads, config.num_query_groups
    qkv = builders.interleave_qkv(w["q_proj"], w["k_proj"], w["v_proj"], heads, groups)
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(torch.cat([builders.rank_rows(qkv, rank, tp),
                                                builders.rank_rows(w["g_proj"], rank, tp)]))
        attn.linear_proj.weight.copy_(w["o_proj"].chunk(tp, dim=1)[rank])
        mlp.linear_fc1.weight.copy_(torch.cat([builders.rank_rows(w["gate_proj"], rank, tp),
                                               builders.rank_rows(w["up_proj"], rank, tp)]))
        mlp.linear_fc2.weight.copy_(w["down_proj"].chunk(tp, dim=1)[rank])
        for adapter in lora_mod.lora_adapters(model).values():
            for name, target in adapter.targets.items():
                a, b = lora[name]
                if adapter.parallel == "row":
                    target.lora_A.copy_(a.chunk(tp, dim=1)[rank])
                    target.lora_B.copy_(b)
                else:
                    target.lora_A.copy_(a)
                    target.lora_B.copy_(b if target.rows is not None
                                        else builders.rank_rows(b, rank, tp))


def _local_grad(adapter, name, which, full_grad, rank, tp):
    """This rank's part of a reference gradient of target ``name``'s A or B."""
    target = adapter.targets[name]
    if which == "A":
        return full_grad.chunk(tp, dim=1)[rank] if adapter.parallel == "row" else full_grad
    if adapter.parallel == "row" or target.rows is not None:
        return full_grad
    return builders.rank_rows(full_grad, rank, tp)


def _reference(x, w, lora, config, scaling):
    """The formula: W_t + scaling B_t A_t per target, gated attention then SwiGLU."""
    eff = {name: w[name] + scaling * b @ a for name, (a, b) in lora.items()}
    attn = reference.gated_attention(x, eff["q_proj"], eff["k_proj"], eff["v_proj"],
                                     eff["g_proj"], eff["o_proj"], config.num_attention_heads,
                                     config.num_query_groups)
    hidden = torch.nn.functional.silu(attn @ eff["gate_proj"].T) * (attn @ eff["up_proj"].T)
    return hidden @ eff["down_proj"].T


def _lora_matches_formula(tp, cases, dtype, backend="sdpa"):
    import mcore_ext
    from mcore_ext import lora as lora_mod
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    rank, _ = builders.tp_rank_and_size()
    results = {}
    for case in cases:
        torch.manual_seed(0)
        config, model = _build(tp, case, dtype, backend)
        lora_cfg = lora_mod.LoraConfig(rank=RANK, alpha=ALPHA, targets="all-linear")
        added = lora_mod.apply_lora(model, lora_cfg)
        g = torch.Generator().manual_seed(3)
        w, lora = _global_weights(config, g, dtype == "bf16")
        _load(model, config, w, lora, rank, tp)
        s, batch, h = 8, 2, config.hidden_size
        x = torch.randn(s, batch, h, generator=g)
        upstream = torch.randn(s, batch, h, generator=g)
        if dtype == "bf16":
            x, upstream = x.bfloat16().float(), upstream.bfloat16().float()
        rows = slice(rank * s // tp, (rank + 1) * s // tp) if tp > 1 else slice(None)
        x_local = x[rows].clone().to(config.params_dtype).requires_grad_(True)

        model.train()
        with cuda_to_cpu():  # megatron's local attention allocates its causal mask on "cuda"
            attn_out, _ = model["attn"](x_local, attention_mask=None)
        out, _ = model["mlp"](attn_out)
        (out * upstream[rows].to(out)).sum().backward()

        ref_lora = {k: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
                    for k, (a, b) in lora.items()}
        x_ref = x.clone().requires_grad_(True)
        ref_out = _reference(x_ref, w, ref_lora, config, lora_cfg.scaling)
        (ref_out * upstream).sum().backward()

        pairs = dict(output=(out.float(), ref_out[rows]),
                     input_grad=(x_local.grad.float(), x_ref.grad[rows]))
        adapters = lora_mod.lora_adapters(model)
        for adapter in adapters.values():
            for name, target in adapter.targets.items():
                a_ref, b_ref = ref_lora[name]
                pairs[f"{name}.A_grad"] = (target.lora_A.grad.float(),
                                           _local_grad(adapter, name, "A", a_ref.grad, rank, tp))
                pairs[f"{name}.B_grad"] = (target.lora_B.grad.float(),
                                           _local_grad(adapter, name, "B", b_ref.grad, rank, tp))
        frozen_with_grad = [n for n, p in model.named_parameters()
                            if "_lora." not in n and (p.requires_grad or p.grad is not None)]
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)

        # Merged: the base weights W + scaling B A at each target's rows give the same output.
        lora_mod.merge_lora(model)
        with torch.no_grad(), cuda_to_cpu():
            merged_attn, _ = model["attn"](x_local.detach(), attention_mask=None)
            merged, _ = model["mlp"](merged_attn)
        pairs["merged"] = (merged.float(), out.detach().float())

        results[case] = dict(
            diffs={k: ((ours - ref).abs().max().item(), ref.abs().max().item())
                   for k, (ours, ref) in pairs.items()},
            added=added, frozen_with_grad=frozen_with_grad, trainable=trainable,
            dtype=str(out.dtype))
    return results


def _assert_close(per_rank, dtype):
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            assert result["frozen_with_grad"] == [], (rank, case, result["frozen_with_grad"])
            assert len(result["added"]) == 8, result["added"]  # q k v g o gate up down
            assert all("_lora." in n and n.endswith(("lora_A", "lora_B"))
                       for n in result["trainable"]), result["trainable"]
            assert len(result["trainable"]) == 16
            assert result["dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
            for quantity, (diff, scale) in result["diffs"].items():
                if dtype == "fp32":
                    tol = FP32_REL_TOL * max(1.0, scale)
                else:
                    kind = "output" if quantity in ("output", "merged") else "grad"
                    tol = BF16_REL_TOL[kind] * scale
                assert diff <= tol, (rank, case, quantity, diff, tol)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_layer_matches_formula_fp32(run_distributed, tp):
    _assert_close(run_distributed(_lora_matches_formula, tp, list(CASES), "fp32", world_size=2),
                  "fp32")


def test_lora_layer_matches_formula_fp32_tp4(run_distributed):
    """TP 4 + SP: one head a rank (2 query groups) and 2 heads a rank of the one query group."""
    _assert_close(run_distributed(_lora_matches_formula, 4, list(CASES), "fp32", world_size=4),
                  "fp32")


def test_lora_layer_matches_formula_on_the_local_backend(run_distributed):
    """megatron's own core attention (``local``) under the same adapted linears, TP 2 + SP."""
    _assert_close(run_distributed(_lora_matches_formula, 2, ["gqa"], "fp32", "local",
                                  world_size=2), "fp32")


def test_lora_layer_matches_formula_bf16_one_group_tp2(run_distributed):
    _assert_close(run_distributed(_lora_matches_formula, 2, ["one_group"], "bf16", world_size=2),
                  "bf16")


def _fresh_adapter_changes_nothing():
    import mcore_ext
    from mcore_ext import lora as lora_mod

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    _, model = _build(2, "one_group", "fp32")
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model["mlp"](model["attn"](x, attention_mask=None)[0])[0]
        lora_mod.apply_lora(model, lora_mod.LoraConfig(rank=2, targets="q_proj g_proj"))
        after = model["mlp"](model["attn"](x, attention_mask=None)[0])[0]
    return torch.equal(before, after), sorted(lora_mod.lora_adapters(model)["attn.linear_qkv_lora"]
                                              .targets)


def test_fresh_adapter_changes_nothing_and_targets_are_selectable(run_distributed):
    for equal, targets in run_distributed(_fresh_adapter_changes_nothing, world_size=2):
        assert equal
        assert targets == ["g_proj", "q_proj"]


def _adapters_follow_the_base_device():
    import mcore_ext
    from mcore_ext import lora as lora_mod

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    _, model = _build(1, "gqa", "fp32")
    model.to("meta")  # where the launcher has moved the model (a GPU) before LoRA is applied
    lora_mod.apply_lora(model, lora_mod.LoraConfig(rank=2, targets="all-linear"))
    adapters = lora_mod.lora_adapters(model)
    return {f"{name}.{p}": t.device.type for name, adapter in adapters.items()
            for p, t in [*adapter.named_parameters(), *adapter.named_buffers()]
            if "lora_" in p or p.endswith(("cols", "rows"))}


def test_adapters_are_made_on_the_base_weights_device(run_distributed):
    """The launcher moves the model to its GPU, then adds the adapters: made on the CPU, they
    stopped megatron's bf16 optimizer ('Wrapped parameters must be one of torch.cuda...',
    an H200 run). A model on the meta device stands for the GPU here."""
    devices = run_distributed(_adapters_follow_the_base_device, world_size=1)[0]
    assert devices and set(devices.values()) == {"meta"}, devices


@pytest.mark.parametrize("fields, message", [
    (dict(rank=-1), "lora.rank must be an integer >= 0, got -1"),
    (dict(rank=4, alpha=0), "lora.alpha must be a number > 0, got 0"),
    (dict(rank=4, dropout=1.0), "lora.dropout must be in [0, 1), got 1.0"),
    (dict(rank=4, targets="q_proj w_proj"), "lora.targets: unknown target(s) ['w_proj']"),
    (dict(rank=4, targets=["all-linear", "q_proj"]), "lora.targets: all-linear stands alone"),
    (dict(rank=4, targets="experts.up_proj"), "lora.targets: unknown target(s) "
                                              "['experts.up_proj']"),
])
def test_lora_config_names_the_bad_field(fields, message):
    from mcore_ext.lora import LoraConfig

    with pytest.raises(ValueError) as err:
        LoraConfig(**fields)
    assert str(err.value).startswith(message), str(err.value)


def test_lora_config_all_linear_and_rank_zero():
    from mcore_ext.lora import ATTENTION_TARGETS, EXPERT_TARGETS, MLP_TARGETS, LoraConfig

    # PEFT's all-linear: the linears, not the routed experts' 3-D weights (named to add them)
    assert LoraConfig(rank=8, targets="all-linear").targets == ATTENTION_TARGETS + MLP_TARGETS
    assert LoraConfig(rank=8, targets=["experts.down_proj", "all-linear"]).targets == \
        ATTENTION_TARGETS + MLP_TARGETS + ("experts.down_proj",)
    assert LoraConfig(rank=8, alpha=16, targets="v_proj q_proj").targets == ("q_proj", "v_proj")
    assert LoraConfig(rank=8, alpha=16).scaling == 2.0
    assert not LoraConfig(rank=0).enabled


def _optimizer_holds_adapters_only(distributed):
    """bf16 GPTModel at TP 2 with every target adapted, megatron's DDP and Adam (fp32 main
    params), one training step: what has a gradient buffer, a main copy and Adam state."""
    import mcore_ext
    from mcore_ext import lora as lora_mod
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    with cuda_to_cpu():  # megatron's mixed-precision optimizer allocates on "cuda" literally
        return _adapters_only_state(distributed)


def _adapters_only_state(distributed):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mcore_ext import lora as lora_mod

    torch.manual_seed(0)
    config = builders.gated_config(tensor_model_parallel_size=2, params_dtype=torch.bfloat16,
                                   bf16=True, ffn_hidden_size=FFN)
    gpt = builders.build_gpt(config)
    total = sum(p.numel() for p in gpt.parameters())
    lora_mod.apply_lora(gpt, lora_mod.LoraConfig(rank=RANK, targets="all-linear"))
    adapters = {n: p for n, p in gpt.named_parameters() if lora_mod.ADAPTER_KEY in n}
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
        Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=distributed), [model])
    builders.train_step(model, optimizer, torch.randint(0, 64, (2, 17),
                                                        generator=torch.Generator().manual_seed(0)))
    buffered = sorted(n for n, p in gpt.named_parameters() if hasattr(p, "main_grad"))
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    main = [p for o in chained for g in o.optimizer.param_groups for p in g["params"]]
    state = [s for o in chained for s in o.optimizer.state.values()]
    return dict(
        buffered=buffered, adapters=sorted(adapters),
        adapter_numel=sum(p.numel() for p in adapters.values()), total=total,
        main_numel=sum(p.numel() for p in main), main_dtypes={str(p.dtype) for p in main},
        moment_numel=sum(s["exp_avg"].numel() for s in state),
        base_dtypes={str(p.dtype) for n, p in gpt.named_parameters() if n not in adapters})


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed"])
def test_frozen_base_has_no_gradient_buffer_main_copy_or_adam_state(run_distributed,
                                                                   distributed):
    """The memory LoRA saves: only the adapters get a gradient buffer, an fp32 main copy and
    Adam's moments (the distributed optimizer at DP 1 holds all of them); the base stays bf16."""
    for got in run_distributed(_optimizer_holds_adapters_only, distributed, world_size=2):
        assert got["buffered"] == got["adapters"], got["buffered"]
        assert got["main_numel"] == got["adapter_numel"], got
        assert got["moment_numel"] == got["adapter_numel"], got
        assert got["main_dtypes"] == {"torch.float32"}
        assert got["base_dtypes"] == {"torch.bfloat16"}
        assert got["main_numel"] < got["total"] / 2, got  # the base (most weights) is not there
