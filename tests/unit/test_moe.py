"""MoE layers (megatron's MoELayer) with Step-3.5's router and clamps, and expert parallelism.

Numerics: every rank builds one set of global weights from a seed (HF's shapes), loads its TP /
EP / expert-TP slices into the megatron model and compares the logits with
``tests.reference.step35_logits`` / ``sigmoid_topk_moe``, plain PyTorch written from HF's
formulas (router logits in fp32, p = sigmoid, topk(p + bias) selects, the selected p renormalised
(sum + 1e-20) times the scaling factor; routed out = sum_k w_k expert_k(x), plus the shared expert
unscaled). fp32, max abs diff <= 1e-5 (logits are O(1)).

The model has 4 layers: layer 1 dense, layers 2-4 MoE (4 experts, top-2, scaling 3.0, a router
bias that changes which experts are chosen, a shared expert), both attention kinds, and a distinct
clamp per layer and per expert kind (dense MLP 0.11, routed 0.07 / 0.05 on layers 2 / 4, shared
0.06 / 0.09 on layers 3 / 4), each one hit. Controls: the reference without any one of these
clamps, with layer 4's routed and shared clamps swapped, with layer 4's clamps also on layer 2,
or without the router bias, differs from the model by more than 100 x the tolerance, so a clamp
seen by another layer or expert kind, or a bias that does not select, fails the test.

Gradients: loss = sum(logits * a fixed random tensor); every DP rank feeds the same tokens, so an
expert's weight gradient summed over its expert-DP replicas is DP x the reference's.

Load balancing (one training step in megatron's DDP at EP 2 x DP 2, finalize_model_grads as the
launcher runs it) with aux_loss, seq_aux_loss and global_aux_loss together: each MoE layer's
recorded value of each equals the Switch formula on the normalised sigmoid scores (top-k without
the bias; over the micro-batch, per sequence then averaged, or with expert counts over every DP
rank's tokens) within 1e-5 relative, their gradient reaches the last router's weight
(DP-averaged, 1e-5), and the expert bias moves by rate x sign(mean - count) with counts of the
biased top-k over both DP ranks' tokens.
"""

import pytest
import torch

from tests import builders, reference

TOL = 1e-5
GRAD_TOL = 1e-4
SEQ, BATCH, VOCAB, WINDOW, EPS = 8, 2, 64, 3, 1e-5
HIDDEN, HEAD_DIM, FFN, MOE_FFN, SHARED_FFN, EXPERTS, TOPK, SCALING = 32, 8, 48, 16, 24, 4, 2, 3.0
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
MOE_LAYER_FREQ = [0, 1, 1, 1]
SWIGLU_LIMITS = [0.11, None, 0.06, 0.09]  # dense MLP (layer 1), shared experts (layers 3, 4)
EXPERT_SWIGLU_LIMITS = [None, 0.07, 0.0, 0.05]  # routed experts (layers 2, 4)


def moe_config(tp=1, ep=1, dispatcher="allgather", etp=None, **overrides):
    """The 4-layer Step-3.5-like MoE config of these tests (global sizes)."""
    import torch.nn.functional as F

    fields = dict(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, normalization="RMSNorm", layernorm_zero_centered_gamma=True,
        qk_layernorm=True, layernorm_epsilon=EPS, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, layer_types=LAYER_TYPES, sliding_window=WINDOW,
        sliding_num_attention_heads=8, rotary_base=5e6, rotary_percent=0.5,
        sliding_rotary_base=1e4, swiglu_limits=SWIGLU_LIMITS,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN, moe_layer_freq=MOE_LAYER_FREQ,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=SCALING, moe_router_dtype="fp32",
        moe_expert_swiglu_limits=EXPERT_SWIGLU_LIMITS, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
    fields.update(overrides)
    return builders.gated_config(**fields)


def global_weights(layers, seed=0):
    """HF-shaped global weights; MoE layers get router, bias, stacked experts and a shared one."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    h, d = HIDDEN, HEAD_DIM
    weights = {"embed": rand(VOCAB, h, std=1.0), "norm": rand(h, std=0.3),
               "lm_head": rand(VOCAB, h, std=0.2), "layers": []}
    for kind in layers:
        n, g = kind["heads"], kind["groups"]
        w = dict(input_layernorm=rand(h, std=0.3), post_attention_layernorm=rand(h, std=0.3),
                 q_proj=rand(n * d, h, std=0.3), k_proj=rand(g * d, h, std=0.3),
                 v_proj=rand(g * d, h, std=0.3), g_proj=rand(n, h, std=0.3),
                 q_norm=rand(d, std=0.3), k_norm=rand(d, std=0.3), o_proj=rand(h, n * d, std=0.1))
        if kind.get("moe"):
            w.update(router=rand(EXPERTS, h, std=0.3), router_bias=rand(EXPERTS, std=0.5),
                     experts_gate_proj=rand(EXPERTS, MOE_FFN, h, std=0.3),
                     experts_up_proj=rand(EXPERTS, MOE_FFN, h, std=0.3),
                     experts_down_proj=rand(EXPERTS, h, MOE_FFN, std=0.3),
                     shared_gate_proj=rand(SHARED_FFN, h, std=0.2),
                     shared_up_proj=rand(SHARED_FFN, h, std=0.2),
                     shared_down_proj=rand(h, SHARED_FFN, std=0.2))
        else:
            w.update(gate_proj=rand(FFN, h, std=0.2), up_proj=rand(FFN, h, std=0.2),
                     down_proj=rand(h, FFN, std=0.2))
        weights["layers"].append(w)
    return weights


def local_weights(model, config, weights):
    """This rank's TP / EP / expert-TP slices of the global weights, by megatron name (parameters
    and the router's expert_bias buffer), for the layers of this pipeline stage."""
    from megatron.core import parallel_state as ps

    rank, tp = builders.tp_rank_and_size()
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    etp_rank, etp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()

    def rows(t, r=rank, n=tp):
        return t.chunk(n, dim=0)[r]

    def cols(t, r=rank, n=tp):
        return t.chunk(n, dim=1)[r]

    local = {}
    if model.pre_process:
        local["embedding.word_embeddings.weight"] = rows(weights["embed"])
    if model.post_process:
        local["decoder.final_layernorm.weight"] = weights["norm"]
        local["output_layer.weight"] = rows(weights["lm_head"])
    for i, layer in enumerate(model.decoder.layers):
        number = layer.layer_number
        w = weights["layers"][number - 1]
        kind = config.get_config_for_layer(number)
        p = f"decoder.layers.{i}."
        qkv = builders.interleave_qkv(w["q_proj"], w["k_proj"], w["v_proj"],
                                      kind.num_attention_heads, kind.num_query_groups)
        local.update({
            p + "input_layernorm.weight": w["input_layernorm"],
            p + "self_attention.linear_qkv.weight": torch.cat([rows(qkv), rows(w["g_proj"])]),
            p + "self_attention.q_layernorm.weight": w["q_norm"],
            p + "self_attention.k_layernorm.weight": w["k_norm"],
            p + "self_attention.linear_proj.weight": cols(w["o_proj"]),
            p + "pre_mlp_layernorm.weight": w["post_attention_layernorm"],
        })
        if "router" not in w:
            local[p + "mlp.linear_fc1.weight"] = torch.cat([rows(w["gate_proj"]),
                                                            rows(w["up_proj"])])
            local[p + "mlp.linear_fc2.weight"] = cols(w["down_proj"])
            continue
        local[p + "mlp.router.weight"] = w["router"]
        local[p + "mlp.router.expert_bias"] = w["router_bias"]
        local[p + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [rows(w["shared_gate_proj"]), rows(w["shared_up_proj"])])
        local[p + "mlp.shared_experts.linear_fc2.weight"] = cols(w["shared_down_proj"])
        per_rank = EXPERTS // ep
        for j in range(per_rank):
            e = ep_rank * per_rank + j
            q = f"{p}mlp.experts.local_experts.{j}."
            local[q + "linear_fc1.weight"] = torch.cat(
                [rows(w["experts_gate_proj"][e], etp_rank, etp),
                 rows(w["experts_up_proj"][e], etp_rank, etp)])
            local[q + "linear_fc2.weight"] = cols(w["experts_down_proj"][e], etp_rank, etp)
    return local


def load_weights(model, config, weights):
    local = local_weights(model, config, weights)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    assert set(tensors) == set(local), set(tensors) ^ set(local)
    with torch.no_grad():
        for name, value in local.items():
            tensors[name].copy_(value)


def _clamp_variants(layers):
    """Reference layer lists that move, swap or drop one clamp (or the router bias)."""
    def edit(number, key, value, moe=False):
        out = [dict(kind, moe=dict(kind["moe"])) if kind.get("moe") else dict(kind)
               for kind in layers]
        (out[number - 1]["moe"] if moe else out[number - 1])[key] = value
        return out

    variants = {
        "no dense clamp (layer 1)": edit(1, "swiglu_limit", None),
        "no routed clamp (layer 2)": edit(2, "routed_limit", None, moe=True),
        "no shared clamp (layer 3)": edit(3, "swiglu_limit", None),
        "no routed clamp (layer 4)": edit(4, "routed_limit", None, moe=True),
        "no shared clamp (layer 4)": edit(4, "swiglu_limit", None),
        "layer 4 routed clamp on layer 2": edit(2, "routed_limit", 0.05, moe=True),
        "layer 4 shared clamp on layer 2": edit(2, "swiglu_limit", 0.09),
        "layer 3 shared clamp on layer 4": edit(4, "swiglu_limit", 0.06),
    }
    swapped = edit(4, "routed_limit", 0.09, moe=True)
    swapped[3]["swiglu_limit"] = 0.05
    variants["layer 4 routed / shared swapped"] = swapped
    return variants


def _logits_and_grads(model, tokens, target, positions):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))
    (logits * target).sum().backward()
    return logits.detach()


def _expert_grads(model, weights):
    """{(global layer, global expert): (fc1 grad, fc2 grad)} of this rank's experts, as the
    global [2 f / etp, h] / [h, f / etp] slices."""
    out = {}
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for j, expert in enumerate(experts.local_experts):
            e = layer.mlp.local_expert_indices[j]
            out[(layer.layer_number, e)] = (expert.linear_fc1.weight.grad.clone(),
                                            expert.linear_fc2.weight.grad.clone())
    return out


def model_vs_reference(tp=1, ep=1, dispatcher="allgather", etp=None, controls=False, cp=1,
                       backend="sdpa", grouped=False, device="cpu"):
    """Logits of the model vs the reference, and expert gradients vs the reference's.

    With CP each rank holds its load-balanced chunks of the sequence (the logits are compared
    there). Every DP rank feeds the whole batch once (split over its TP ranks by sequence
    parallelism and over its CP ranks), and the replicas of an expert (its expert-DP group) see
    different shares of those tokens, so an expert's gradient summed over its expert-DP group
    is DP = world / (TP x CP) times the reference's, at any EP / expert-TP."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.attention import context_parallel
    from megatron.core import parallel_state as ps

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=etp, context_parallel_size=cp)
    config = moe_config(tp, ep, dispatcher, etp, context_parallel_size=cp,
                        moe_grouped_gemm=grouped)
    layers = builders.reference_layers(config)
    weights = global_weights(layers)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randn(BATCH, SEQ, VOCAB, generator=gen)

    ref_weights = {**weights, "layers": [{k: v.clone().requires_grad_() for k, v in w.items()}
                                         for w in weights["layers"]]}
    expected = reference.step35_logits(tokens, ref_weights, layers, EPS)
    (expected * target).sum().backward()
    local = dict(tokens=tokens, target=target, expected=expected.detach(),
                 positions=torch.arange(SEQ).expand_as(tokens))
    if cp > 1:
        local = context_parallel.get_batch_on_this_cp_rank(local)

    model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      backend=backend)
    load_weights(model, config, weights)
    model.to(device)
    with cuda_to_cpu():  # the local backend allocates its masks on "cuda"
        logits = _logits_and_grads(model, *(local[k].to(device)
                                            for k in ("tokens", "target", "positions"))).cpu()
    expert_grads = {k: tuple(g.cpu() for g in grads)
                    for k, grads in _expert_grads(model, weights).items()}
    for fc1, fc2 in expert_grads.values():
        for grad in (fc1, fc2):
            dist.all_reduce(grad, group=ps.get_expert_data_parallel_group())
    factor = dist.get_world_size() // (tp * cp)  # DP: copies of the batch over all ranks

    etp_rank = ps.get_expert_tensor_parallel_rank()
    etp_size = ps.get_expert_tensor_parallel_world_size()
    grad_diff, grad_scale = 0.0, 0.0
    for (number, e), (fc1, fc2) in expert_grads.items():
        w = ref_weights["layers"][number - 1]
        ref_fc1 = torch.cat([w["experts_gate_proj"].grad[e].chunk(etp_size)[etp_rank],
                             w["experts_up_proj"].grad[e].chunk(etp_size)[etp_rank]])
        ref_fc2 = w["experts_down_proj"].grad[e].chunk(etp_size, dim=1)[etp_rank]
        for got, want in ((fc1, ref_fc1), (fc2, ref_fc2)):
            grad_diff = max(grad_diff, (got - factor * want).abs().max().item())
            grad_scale = max(grad_scale, want.abs().max().item())
    result = dict(diff=(logits - local["expected"]).abs().max().item(),
                  scale=expected.abs().max().item(), grad_diff=grad_diff, grad_scale=grad_scale,
                  experts=sorted(expert_grads),
                  expert_modules={type(layer.mlp.experts).__name__ for layer in
                                  model.decoder.layers if hasattr(layer.mlp, "experts")},
                  grouped_ran=[getattr(layer.mlp.experts, "last_forward_grouped", None)
                               for layer in model.decoder.layers if hasattr(layer.mlp, "experts")])
    if controls:
        with torch.no_grad():
            result["controls"] = {
                name: (reference.step35_logits(tokens, weights, variant, EPS) - logits)
                .abs().max().item()
                for name, variant in _clamp_variants(layers).items()
            }
            no_bias = {**weights, "layers": [dict(w, router_bias=torch.zeros(EXPERTS))
                                             if "router" in w else w
                                             for w in weights["layers"]]}
            result["controls"]["no router bias"] = (
                reference.step35_logits(tokens, no_bias, layers, EPS) - logits).abs().max().item()
            result["limits"] = _module_limits(model)
    return result


def _module_limits(model):
    """The clamp each MLP module of the model applies: {(layer, module): limit or None}."""
    limits = {}
    for layer in model.decoder.layers:
        mlp = layer.mlp
        modules = {"dense": mlp} if not hasattr(mlp, "router") else {
            **{f"expert {e}": m for e, m in zip(mlp.local_expert_indices,
                                                 mlp.experts.local_experts)},
            "shared": mlp.shared_experts}
        for name, module in modules.items():
            fn = module.activation_func
            limits[(layer.layer_number, name)] = getattr(fn, "keywords", {}).get("limit")
    return limits


@pytest.mark.smoke  # also on megatron-core 0.16 - 0.18
@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_moe_model_matches_hf_formulas_with_distinct_clamps(run_distributed, backend):
    (r,) = run_distributed(model_vs_reference, controls=True, backend=backend, world_size=1)
    assert r["diff"] <= TOL and r["scale"] > 0.1, r
    assert r["grad_diff"] <= GRAD_TOL * max(1.0, r["grad_scale"]), r
    for name, effect in r["controls"].items():
        assert effect > 100 * TOL, (name, effect)  # each clamp / the bias is seen by the check
    # every module holds its own clamp, and only its own
    expected = {(1, "dense"): 0.11, (2, "shared"): None, (3, "shared"): 0.06, (4, "shared"): 0.09}
    for e in range(EXPERTS):
        expected.update({(2, f"expert {e}"): 0.07, (3, f"expert {e}"): None,
                         (4, f"expert {e}"): 0.05})
    assert r["limits"] == expected, r["limits"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_moe_model_on_cuda_matches_hf_formulas(run_distributed, backend):
    # One GPU, fp32; megatron's MoE kernels on CUDA (permute / unpermute, the router's top-k)
    # sum in other orders than the CPU reference: 1e-4 on O(1) logits.
    (r,) = run_distributed(model_vs_reference, backend=backend, device="cuda", world_size=1)
    assert r["diff"] <= 1e-4 and r["scale"] > 0.1, r
    assert r["grad_diff"] <= GRAD_TOL * max(1.0, r["grad_scale"]), r


@pytest.mark.parametrize("world_size, tp, ep, dispatcher, etp, cp", [
    pytest.param(2, 1, 2, "allgather", None, 1, marks=pytest.mark.smoke),
    (2, 1, 2, "alltoall", None, 1),
    (4, 1, 4, "allgather", None, 1),
    (4, 1, 4, "alltoall", None, 1),
    (4, 2, 2, "allgather", None, 1),
    (4, 2, 2, "alltoall", None, 1),
    (4, 1, 2, "alltoall", None, 1),  # with expert data parallelism 2
    (4, 2, 2, "alltoall", 1, 1),     # expert TP 1 under TP 2
    (4, 1, 2, "alltoall", 2, 1),     # expert TP 2 over TP 1
    (4, 1, 2, "alltoall", None, 2),  # EP 2 with CP 2 (dense DP 2)
    (2, 1, 2, "allgather", None, 2),  # EP 2 over the CP 2 ranks
])
def test_expert_parallel_matches_reference(run_distributed, world_size, tp, ep, dispatcher, etp,
                                           cp):
    results = run_distributed(model_vs_reference, tp, ep, dispatcher, etp, cp=cp,
                              world_size=world_size)
    seen = set()
    for rank, r in enumerate(results):
        assert r["diff"] <= TOL, (rank, r)
        assert r["grad_diff"] <= GRAD_TOL * max(1.0, r["grad_scale"]), (rank, r)
        seen.update(r["experts"])
        assert len(r["experts"]) == 3 * EXPERTS // ep, (rank, r["experts"])
    assert seen == {(n, e) for n in (2, 3, 4) for e in range(EXPERTS)}


@pytest.mark.parametrize("world_size, tp, ep, dispatcher, etp", [
    (1, 1, 1, "allgather", None),
    (2, 1, 2, "alltoall", None),
    (4, 2, 2, "alltoall", 1),   # expert TP 1 under TP 2
    (4, 1, 2, "alltoall", 2),   # expert TP 2: each expert's width split
])
def test_grouped_gemm_experts_match_reference_with_clamps(run_distributed, world_size, tp, ep,
                                                          dispatcher, etp):
    """moe_grouped_gemm on the sdpa backend: the same experts (parameters, keys, clamps) run as
    one torch grouped GEMM per linear layer, within the same 1e-5 of the HF formulas, clamps on
    layers 2 and 4 included (the controls show each clamp is seen)."""
    results = run_distributed(model_vs_reference, tp, ep, dispatcher, etp,
                              controls=world_size == 1, grouped=True, world_size=world_size)
    for rank, r in enumerate(results):
        assert r["expert_modules"] == {"GroupedGemmSequentialMLP"}, r["expert_modules"]
        assert r["grouped_ran"] == [True] * 3, (rank, r["grouped_ran"])
        assert r["diff"] <= TOL and r["scale"] > 0.1, (rank, r)
        assert r["grad_diff"] <= GRAD_TOL * max(1.0, r["grad_scale"]), (rank, r)
        for name, effect in r.get("controls", {}).items():
            assert effect > 100 * TOL, (name, effect)


def _te_grouped_mlp_with_clamp():
    """megatron's TEGroupedMLP (its grouped linears stood in by plain torch: no Transformer
    Engine here) under clamp_moe_layer: every layer's clamp in its own module, the output
    equal to the clamped SwiGLU experts' computed one by one; the op-fused form refused by
    layer."""
    import functools

    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import mcore_ext
    from mcore_ext import moe
    from mcore_ext.swiglu_clamp import clamped_swiglu

    mcore_ext.init_parallel()
    config = moe_config(moe_grouped_gemm=True)
    pgs = ps.ProcessGroupCollection.use_mpu_process_groups() if hasattr(
        ps, "ProcessGroupCollection") else None
    if pgs is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection.use_mpu_process_groups()
    submodules = GroupedMLPSubmodules(linear_fc1=_TorchGroupedLinear,
                                      linear_fc2=_TorchGroupedLinear)
    layers = [TEGroupedMLP(EXPERTS, config, submodules, pg_collection=pgs) for _ in range(2)]
    holder = [MoELayer.__new__(MoELayer) for _ in layers]
    for h, experts in zip(holder, layers):
        torch.nn.Module.__init__(h)
        h.experts, h.shared_experts = experts, None
    moe.clamp_moe_layer(holder[0], 0.07, None, layer_number=2)
    moe.clamp_moe_layer(holder[1], 0.05, None, layer_number=4)

    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 5, 4])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=gen)
    probs = torch.rand(int(counts.sum()), generator=gen)
    out = {}
    for limit, experts in zip((0.07, 0.05), layers):
        got, _ = experts(x, counts, probs)
        want = []
        for e, (xe, pe) in enumerate(zip(x.split(counts.tolist()), probs.split(counts.tolist()))):
            fc1 = getattr(experts.linear_fc1, f"weight{e}")
            fc2 = getattr(experts.linear_fc2, f"weight{e}")
            want.append((clamped_swiglu(xe @ fc1.t(), limit) * pe.unsqueeze(-1)) @ fc2.t())
        unclamped = F.silu((x @ experts.linear_fc1.weight0.t()).chunk(2, -1)[0])
        out[limit] = dict(diff=(got - torch.cat(want)).abs().max().item(),
                          limit=experts.activation_func.keywords["limit"],
                          clamp_hit=bool((unclamped > limit).any()))
    out["shared config untouched"] = not config.use_te_activation_func
    fused = TEGroupedMLP.__new__(TEGroupedMLP)
    torch.nn.Module.__init__(fused)
    fused._with_fused_impl, fused.config = True, config
    h = MoELayer.__new__(MoELayer)
    torch.nn.Module.__init__(h)
    h.experts, h.shared_experts = fused, None
    try:
        moe.clamp_moe_layer(h, 7.0, None, layer_number=44)
        out["fused"] = None
    except NotImplementedError as err:
        out["fused"] = str(err)
    return out


class _TorchGroupedLinear(torch.nn.Module):
    """Transformer Engine's GroupedLinear in plain torch (weights ``weight{i}`` [out, in], a
    loop over the groups): enough for TEGroupedMLP's forward on a CPU."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection=None, name=None):
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            w = torch.empty(output_size, input_size)
            init_method(w)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))

    def forward(self, x, m_splits):
        parts = x.split(list(m_splits))
        return torch.cat([p @ getattr(self, f"weight{i}").t() for i, p in enumerate(parts)]), None


def test_te_grouped_mlp_applies_each_layers_clamp_exactly(run_distributed):
    (r,) = run_distributed(_te_grouped_mlp_with_clamp, world_size=1)
    for limit in (0.07, 0.05):
        assert r[limit]["limit"] == limit and r[limit]["clamp_hit"], r
        assert r[limit]["diff"] <= 1e-6, r
    assert r["shared config untouched"], r
    assert r["fused"] and "(layer 44)" in r["fused"] and "op_fuser" in r["fused"], r["fused"]


# ------------------------------------------------------- load balancing and the bias update


def _train_step_with_balancing(coeff, rate):
    """One forward + backward + megatron's finalize_model_grads (what the launcher's loop runs
    after the last micro-batch) of the MoE model in megatron's DDP at EP 2 x DP 2, each DP rank
    on its own tokens. Returns the routers' inputs, the recorded aux losses, the expert biases
    before and after, and the router weights' reduced gradients."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext import _mcore_compat
    from mcore_ext._cpu_compat import cuda_to_cpu
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    mcore_ext.init_parallel(expert_model_parallel_size=2)
    config = moe_config(1, 2, "alltoall", moe_router_load_balancing_type=list(BALANCING),
                        moe_aux_loss_coeff=[coeff] * len(BALANCING),
                        moe_router_bias_update_rate=rate)
    weights = global_weights(builders.reference_layers(config))
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    gpt = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                    backend="sdpa")
    load_weights(gpt, config, weights)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    routers = {layer.layer_number: layer.mlp.router for layer in gpt.decoder.layers
               if hasattr(layer.mlp, "router")}
    inputs = {}
    for number, router in routers.items():
        router.register_forward_pre_hook(
            lambda _, args, n=number: inputs.__setitem__(n, args[0].detach().reshape(-1, HIDDEN)))
    bias_before = {n: r.expert_bias.clone() for n, r in routers.items()}
    _mcore_compat.take_moe_aux_losses()  # nothing left over from another test
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # the schedule sets 1 / micro-batches
    model.train()
    with cuda_to_cpu():  # as the launcher's loop: megatron's DDP asks for a CUDA stream
        _logits_and_grads(model, tokens, target, torch.arange(SEQ).expand_as(tokens))
        recorded = _mcore_compat.take_moe_aux_losses()
        finalize_model_grads([model])
    return dict(inputs=inputs, weights=weights, bias_before=bias_before,
                bias_after={n: r.expert_bias.clone() for n, r in routers.items()},
                aux={name: values for name, (values, _) in recorded.items()},
                router_grads={n: r.weight.main_grad.clone() for n, r in routers.items()})


# megatron's load-balancing types and the names it records them under
BALANCING = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss"}


def _switch_loss(normalised, chosen, all_tokens=None):
    """Switch load balancing, E / (k T^2) x sum_i count_i x sum_x s(x, i); ``all_tokens`` counts
    experts (and T) over more tokens than the scores cover (megatron's global aux loss)."""
    counted = chosen if all_tokens is None else all_tokens
    tokens = counted.sum() / TOPK
    return EXPERTS / (TOPK * tokens**2) * (counted.sum(0) * normalised.sum(0)).sum()


def balancing_vs_reference(coeff=0.05, rate=0.01):
    """Megatron's load-balancing losses and expert-bias update under this project's router
    settings, against the formulas written out here: Switch load balancing on the normalised
    sigmoid scores with a top-k that ignores the bias, over the micro-batch (aux_loss), per
    sequence then averaged (seq_aux_loss), or with expert counts over every DP rank's tokens
    (global_aux_loss); bias += rate * sign(mean count - count) over the global batch, counted
    with the biased top-k that routes."""
    import torch.distributed as dist

    import mcore_ext

    run = _train_step_with_balancing(coeff, rate)
    mcore_ext.destroy_parallel()
    without = _train_step_with_balancing(0.0, rate)
    out = {"aux": {}, "bias": {}, "aux_grad": None}
    for number, x in run["inputs"].items():
        w = run["weights"]["layers"][number - 1]
        router = w["router"].clone().requires_grad_()
        logits = x.float() @ router.t()
        scores = logits.sigmoid()
        normalised = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter(1, normalised.topk(TOPK).indices, 1.0)
        everywhere = [torch.empty_like(chosen) for _ in range(dist.get_world_size())]
        dist.all_gather(everywhere, chosen)
        by_sequence = zip(normalised.view(SEQ, BATCH, -1).unbind(1),
                          chosen.view(SEQ, BATCH, -1).unbind(1))  # tokens are [s, b] in order
        expected = {
            "aux_loss": _switch_loss(normalised, chosen),
            "seq_aux_loss": sum(_switch_loss(p, c) for p, c in by_sequence) / BATCH,
            "global_aux_loss": _switch_loss(normalised, chosen, torch.cat(everywhere)),
        }
        aux = sum(expected.values())
        for kind, name in BALANCING.items():
            out["aux"][(kind, number)] = (run["aux"][name][number - 1].item(),
                                          expected[kind].item())
        routed = torch.zeros_like(scores).scatter(
            1, (scores + run["bias_before"][number]).topk(TOPK).indices, 1.0).sum(0)
        dist.all_reduce(routed)  # the global batch: every DP rank's tokens
        expected_bias = run["bias_before"][number] + rate * torch.sign(routed.mean() - routed)
        out["bias"][number] = (run["bias_after"][number] - expected_bias).abs().max().item()
        if number == max(run["inputs"]):
            # The last MoE layer's router weight gets only its own losses' gradient (earlier
            # routers also get later layers' through the hidden states): DDP averages over DP.
            (grad,) = torch.autograd.grad(coeff * aux, router)
            dist.all_reduce(grad)
            got = run["router_grads"][number] - without["router_grads"][number]
            out["aux_grad"] = ((got - grad / dist.get_world_size()).abs().max().item(),
                               grad.abs().max().item() / dist.get_world_size())
    out["bias_moved"] = max((run["bias_after"][n] - run["bias_before"][n]).abs().max().item()
                            for n in run["inputs"])
    return out


def test_balancing_losses_and_expert_bias_update_match_the_formulas(run_distributed):
    for r in run_distributed(balancing_vs_reference, world_size=2):
        assert sorted(r["aux"]) == sorted((k, n) for k in BALANCING for n in (2, 3, 4)), r
        for where, (got, want) in r["aux"].items():
            assert got == pytest.approx(want, rel=1e-5), (where, got, want)
        assert all(diff <= 1e-7 for diff in r["bias"].values()), r["bias"]
        assert r["bias_moved"] == pytest.approx(0.01, rel=1e-5)  # the update did happen
        diff, scale = r["aux_grad"]
        assert scale > 1e-4 and diff <= 1e-5 * max(1.0, scale / 1e-3), r["aux_grad"]


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_router_score_function="softmax"),
     "moe_router_enable_expert_bias=True needs moe_router_score_function 'sigmoid' or "
     "'sqrtsoftplus', got 'softmax'"),
    (dict(moe_layer_freq=[0, 1, 1]), "moe_layer_freq has 3 entries, num_layers is 4"),
    (dict(moe_layer_freq=[0, 1, 2, 1]), "moe_layer_freq=[0, 1, 2, 1]: entry 2 is not 0 or 1"),
    (dict(expert_model_parallel_size=3), "expert_model_parallel_size=3 must divide "
                                         "num_moe_experts=4"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype='bf16' is not one of"),
    (dict(moe_router_topk=5), "moe_router_topk=5 must be in [1, num_moe_experts=4]"),
    (dict(moe_token_dispatcher_type="a2a"), "moe_token_dispatcher_type='a2a' is not one of"),
    (dict(moe_router_bias_update_rate=-1e-3), "moe_router_bias_update_rate=-0.001 must be >= 0"),
    (dict(moe_expert_swiglu_limits=[None, 7.0]), "moe_expert_swiglu_limits has 2 entries"),
    (dict(moe_expert_swiglu_limits=[None, -1.0, None, None]), "-1.0 is negative"),
    (dict(gated_linear_unit=False, swiglu_limits=None),
     "moe_expert_swiglu_limits clamps SwiGLU experts: it needs gated_linear_unit=True"),
    (dict(activation_func_clamp_value=7.0), "activation_func_clamp_value=7.0 (megatron's clamp"),
    (dict(moe_expert_swiglu_limits=None, swiglu_limits=None, activation_func_clamp_value=7.0,
          bias_activation_fusion=True), "megatron's fused SwiGLU ignores the clamp"),
    (dict(num_moe_experts=None, expert_model_parallel_size=1),
     "moe_expert_swiglu_limits=[None, 0.07, 0.0, 0.05] clamps routed experts: it needs "
     "num_moe_experts"),
])
def test_moe_config_errors_name_field_and_value(overrides, message):
    with pytest.raises(ValueError) as err:
        moe_config(**overrides)
    assert message in str(err.value)


def test_moe_defaults_keep_routing_unchanged():
    config = moe_config()  # no load-balancing loss, a frozen expert bias
    assert config.moe_router_load_balancing_type == "none"
    assert config.moe_router_bias_update_rate == 0.0


def test_moe_expert_limits_take_main_or_mtp_padded_lists():
    with pytest.raises(ValueError, match="moe_expert_swiglu_limits has 5 entries"):
        moe_config(moe_expert_swiglu_limits=EXPERT_SWIGLU_LIMITS + [None])
    padded = moe_config(moe_expert_swiglu_limits=EXPERT_SWIGLU_LIMITS + [7.0], mtp_num_layers=1)
    assert [padded.moe_expert_swiglu_limit(n) for n in range(1, 6)] == [None, 0.07, None, 0.05, 7.0]
