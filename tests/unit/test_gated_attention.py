"""HeadWiseGatedSelfAttention: numerics against a plain-PyTorch gated attention, init, gates.

Every rank builds the same global weights from one seed, loads its TP slice into the megatron
layer ([QKV_r ; Gate_r] rows of linear_qkv, its columns of linear_proj), and compares outputs and
gradients with ``tests.reference.gated_attention`` computed in fp32 on the full weights.

Every numerics test runs on each core-attention backend this machine has: ``sdpa`` and megatron's
``local`` DotProductAttention (on a CPU inside ``cuda_to_cpu``, as the launcher runs it), and
``te`` where Transformer Engine and a GPU exist. Batches have 2 sequences (micro-batch > 1).

Tolerances:
- fp32: outputs and gradients max abs diff <= 2e-5 (values are O(1)).
- bf16: the layer computes in bf16 on the bf16-rounded weights and input, the reference in fp32 on
  the same rounded values, so the difference is the layer's own rounding. bf16 keeps 8 significant
  bits: each rounding moves a value by at most u = 2^-8 of itself. Forward there are about 6
  rounded stages (QKV GEMM output, attention scores, probabilities, attention output, gated
  output, projection), backward twice as many, and errors add up over them, so
  max |diff| <= 8 u max|ref| for outputs and <= 16 u max|ref| for gradients (3% and 6%).
  A gate computed wrongly (a sigmoid in bf16 is fine, a missing or misplaced gate is not) moves
  outputs by tens of percent.
"""

import importlib.util

import pytest
import torch

from tests import builders, reference

TOL = 2e-5
BF16_REL_TOL = {"output": 8 * reference.BF16_UNIT_ROUNDOFF,
                "grad": 16 * reference.BF16_UNIT_ROUNDOFF}


def _te_skip_reason():
    from mcore_ext.specs import transformer_engine_available

    if not torch.cuda.is_available():
        return "the te backend needs a GPU (CUDA)"
    if not transformer_engine_available():
        return "Transformer Engine is not installed"
    return None


BACKENDS = [
    "sdpa",
    "local",
    pytest.param("te", marks=pytest.mark.skipif(_te_skip_reason() is not None,
                                                reason=str(_te_skip_reason()))),
]

# name -> config overrides (hidden 32 = 4 heads x 8; 8 heads use kv_channels 8 -> hidden 32 still)
CASES = {
    "mha_bias": dict(num_attention_heads=4, num_query_groups=4, add_qkv_bias=True),
    "mha_nobias": dict(num_attention_heads=4, num_query_groups=4),
    "gqa_bias": dict(num_attention_heads=8, num_query_groups=2, kv_channels=8, add_qkv_bias=True),
    "gqa_one_group": dict(num_attention_heads=8, num_query_groups=1, kv_channels=8),
    "qk_layernorm": dict(num_attention_heads=4, num_query_groups=2, qk_layernorm=True),
    "recompute": dict(num_attention_heads=4, num_query_groups=2, add_qkv_bias=True,
                      recompute_granularity="selective", recompute_modules=["core_attn"]),
}


def _compare_with_reference(tp, cases, sequence_parallel, packed=False, backend="sdpa",
                            dtype="fp32", device="cpu"):
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from megatron.core.packed_seq_params import PackedSeqParams

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    rank, _ = builders.tp_rank_and_size()
    bf16 = dtype == "bf16"
    results = {}
    for name in cases:
        overrides = dict(CASES[name])
        if bf16:
            overrides.update(params_dtype=torch.bfloat16, bf16=True)
        config = builders.gated_config(tensor_model_parallel_size=tp,
                                       sequence_parallel=sequence_parallel and tp > 1, **overrides)
        # In the training dtype, as megatron's Float16Module casts a model (norm weights too:
        # CUDA's layer_norm refuses fp32 weights on bf16 input).
        attn = builders.build_self_attention(config, backend=backend).to(device,
                                                                        config.params_dtype)
        heads, groups, hn, h = (config.num_attention_heads, config.num_query_groups,
                                config.kv_channels, config.hidden_size)

        g = torch.Generator().manual_seed(1)
        w = builders.gated_attention_weights(heads, groups, hn, h, g)
        b = dict(q=torch.randn(heads * hn, generator=g) * 0.1,
                 k=torch.randn(groups * hn, generator=g) * 0.1,
                 v=torch.randn(groups * hn, generator=g) * 0.1,
                 gate=torch.randn(heads, generator=g))
        has_bias = config.add_qkv_bias
        s, batch = (12, 1) if packed else (8, 2)
        x = torch.randn(s, batch, h, generator=g)
        upstream = torch.randn(s, batch, h, generator=g)
        if bf16:  # the reference computes in fp32 on exactly the values the layer holds
            w, b = ({k: v.bfloat16().float() for k, v in d.items()} for d in (w, b))
            x, upstream = x.bfloat16().float(), upstream.bfloat16().float()

        # Megatron side: this rank's rows [QKV_r ; Gate_r] and linear_proj columns.
        qkv_w = builders.interleave_qkv(w["q"], w["k"], w["v"], heads, groups)
        qkv_b = builders.interleave_qkv(b["q"], b["k"], b["v"], heads, groups)
        with torch.no_grad():
            attn.linear_qkv.weight.copy_(torch.cat([builders.rank_rows(qkv_w, rank, tp),
                                                    builders.rank_rows(w["gate"], rank, tp)]))
            if has_bias:
                attn.linear_qkv.bias.copy_(torch.cat([builders.rank_rows(qkv_b, rank, tp),
                                                      builders.rank_rows(b["gate"], rank, tp)]))
            attn.linear_proj.weight.copy_(w["o"].chunk(tp, dim=1)[rank])

        seq_rows = slice(rank * s // tp, (rank + 1) * s // tp) if config.sequence_parallel else slice(None)
        x_local = x[seq_rows].clone().to(device, config.params_dtype).requires_grad_(True)
        params = None
        allowed = None
        if packed:
            cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=7, max_seqlen_kv=7)
            allowed = torch.block_diag(reference.causal(5, 5), reference.causal(7, 7))
        attn.train()
        with cuda_to_cpu():  # megatron's local attention allocates its causal mask on "cuda"
            out, _ = attn(x_local, attention_mask=None, packed_seq_params=params)
            (out * upstream[seq_rows].to(out)).sum().backward()
        out = out.cpu()

        # Reference side: the formula on the full weights, in fp32.
        ref_w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        x_ref = x.clone().requires_grad_(True)
        norm = (lambda t: torch.nn.functional.layer_norm(t, (hn,), eps=config.layernorm_epsilon)) \
            if config.qk_layernorm else None
        ref_out = reference.gated_attention(
            x_ref, ref_w["q"], ref_w["k"], ref_w["v"], ref_w["gate"], ref_w["o"], heads, groups,
            *(b[k] for k in ("q", "k", "v", "gate")) if has_bias else (None,) * 4,
            q_norm=norm, k_norm=norm, allowed=allowed)
        (ref_out * upstream).sum().backward()

        ref_qkv_grad = builders.interleave_qkv(ref_w["q"].grad, ref_w["k"].grad, ref_w["v"].grad,
                                               heads, groups)
        qkv_rows = attn.qkv_rows_per_partition
        local_grad = attn.linear_qkv.weight.grad.float().cpu()
        pairs = dict(
            output=(out.float(), ref_out[seq_rows]),
            input_grad=(x_local.grad.float().cpu(), x_ref.grad[seq_rows]),
            gate_grad=(local_grad[qkv_rows:], builders.rank_rows(ref_w["gate"].grad, rank, tp)),
            qkv_grad=(local_grad[:qkv_rows], builders.rank_rows(ref_qkv_grad, rank, tp)),
        )
        results[name] = {
            quantity: ((ours - ref).abs().max().item(), ref.abs().max().item())
            for quantity, (ours, ref) in pairs.items()
        }
        results[name]["gate_grad_norm"] = local_grad[qkv_rows:].norm().item()
        results[name]["dtype"] = str(out.dtype)
    return results


def _assert_close(per_rank, dtype="fp32", fp32_tol=TOL):
    for rank, results in enumerate(per_rank):
        for name, diffs in results.items():
            assert diffs["gate_grad_norm"] > 0, (rank, name)  # the gate rows do receive gradient
            assert diffs["dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
            for quantity in ("output", "input_grad", "gate_grad", "qkv_grad"):
                diff, scale = diffs[quantity]
                if dtype == "fp32":
                    tol = fp32_tol
                else:
                    tol = BF16_REL_TOL["output" if quantity == "output" else "grad"] * scale
                assert diff <= tol, (rank, name, quantity, diff, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_tp1(run_distributed, backend):
    _assert_close(run_distributed(_compare_with_reference, 1, list(CASES), False,
                                  backend=backend, world_size=2))


@pytest.mark.smoke
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_matches_reference_tp2(run_distributed, sequence_parallel, backend):
    # gqa_one_group: 1 group < TP 2.
    cases = ["mha_bias", "mha_nobias", "gqa_bias", "gqa_one_group", "qk_layernorm", "recompute"]
    _assert_close(run_distributed(_compare_with_reference, 2, cases, sequence_parallel,
                                  backend=backend, world_size=2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_matches_reference_tp4_including_fewer_groups_than_ranks(run_distributed, sequence_parallel,
                                                                  backend):
    # gqa_bias: 2 groups < TP 4; gqa_one_group: 1 group < TP 4.
    cases = ["mha_bias", "gqa_bias", "gqa_one_group"]
    _assert_close(run_distributed(_compare_with_reference, 4, cases, sequence_parallel,
                                  backend=backend, world_size=4))


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_thd_matches_reference(run_distributed, tp):
    # sdpa only: megatron's local DotProductAttention has no packed-sequence support.
    _assert_close(run_distributed(_compare_with_reference, tp, ["mha_bias", "gqa_bias"], False,
                                  packed=True, world_size=2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_matches_fp32_reference_within_bf16_rounding(run_distributed, tp, backend):
    cases = ["mha_bias", "gqa_bias", "gqa_one_group", "recompute"]
    _assert_close(run_distributed(_compare_with_reference, tp, cases, tp > 1, backend=backend,
                                  dtype="bf16", world_size=2), dtype="bf16")


# On CUDA (one GPU, one rank): the reference stays fp32 on the CPU. fp32 on the GPU sums in other
# orders (cuBLAS, SDPA's efficient kernel) than the CPU: 1e-4 on O(1) values; bf16 keeps its bounds.
GPU_FP32_TOL = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_gated_layer_on_cuda_matches_fp32_reference(run_distributed, backend, dtype):
    # Micro-batch 2 in every case (MHA, GQA, one group, q/k norms, selective recompute).
    _assert_close(run_distributed(_compare_with_reference, 1, list(CASES), False, backend=backend,
                                  dtype=dtype, device="cuda", world_size=1),
                  dtype=dtype, fp32_tol=GPU_FP32_TOL)


@pytest.mark.gpu
def test_packed_thd_on_cuda_matches_reference(run_distributed):
    _assert_close(run_distributed(_compare_with_reference, 1, ["mha_bias", "gqa_bias"], False,
                                  packed=True, device="cuda", world_size=1),
                  fp32_tol=GPU_FP32_TOL)


# ------------------------------------------------------------------------------------------ init


def _init_statistics(tp, use_cpu_initialization):
    import mcore_ext
    from mcore_ext.attention import gated

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    # The surgery knobs (the original head-wise gate's start; the default is the released
    # gates' start, weight scale 1 and bias 0: test_gate_rows_leave_every_shared_weight...).
    surgery = dict(head_wise_attn_gate_init_weight_scale=0.1, head_wise_attn_gate_init_bias=2.0)
    config = builders.gated_config(hidden_size=256, num_attention_heads=8, num_query_groups=4,
                                   add_qkv_bias=True, init_method_std=0.02,
                                   tensor_model_parallel_size=tp,
                                   use_cpu_initialization=use_cpu_initialization, **surgery)
    attn = builders.build_self_attention(config)
    weight, bias = attn.linear_qkv.weight.detach(), attn.linear_qkv.bias.detach()
    qkv_rows = attn.qkv_rows_per_partition

    # Output at init against the same layer without gate (identical QKV and projection weights).
    plain = builders.build_self_attention(builders.gated_config(
        hidden_size=256, num_attention_heads=8, num_query_groups=4, add_qkv_bias=True,
        tensor_model_parallel_size=tp, head_wise_attn_gate=False))
    with torch.no_grad():
        plain.linear_qkv.weight.copy_(weight[:qkv_rows])
        plain.linear_qkv.bias.copy_(bias[:qkv_rows])
        plain.linear_proj.weight.copy_(attn.linear_proj.weight)
    x = torch.randn(8, 2, 256, generator=torch.Generator().manual_seed(0))
    gated_out, plain_out = attn(x, None)[0], plain(x, None)[0]

    gated._warned.clear()
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            builders.build_self_attention(builders.gated_config(
                hidden_size=256, num_attention_heads=8, tensor_model_parallel_size=tp,
                **surgery))
    bias_warnings = [str(w.message) for w in caught if "gates start near sigmoid(0)" in str(w.message)]
    return dict(
        rows=weight.shape[0], qkv_rows=qkv_rows, cols=weight.shape[1],
        std_ratio=(weight[qkv_rows:].std() / weight[:qkv_rows].std()).item(),
        gate_bias=bias[qkv_rows:].tolist(), qkv_bias_max=bias[:qkv_rows].abs().max().item(),
        init_output_rel_err=((gated_out - torch.sigmoid(torch.tensor(2.0)) * plain_out).abs().max()
                             / plain_out.abs().max()).item(),
        bias_warnings=bias_warnings,
    )


@pytest.mark.parametrize("use_cpu_initialization", [True, False])
def test_init_surgery_on_every_rank(run_distributed, use_cpu_initialization):
    tp = 2
    for stats in run_distributed(_init_statistics, tp, use_cpu_initialization, world_size=2):
        # linear_qkv out dim = QKV + one row per head, split evenly over TP.
        assert stats["rows"] == ((8 + 2 * 4) * 32 + 8) // tp and stats["cols"] == 256
        assert stats["qkv_rows"] == (8 + 2 * 4) * 32 // tp
        # Gate rows are scaled by 0.1 (std ratio 0.1; +-30% for 1024 samples per rank).
        assert 0.07 < stats["std_ratio"] < 0.13, stats["std_ratio"]
        assert stats["gate_bias"] == [2.0] * (8 // tp) and stats["qkv_bias_max"] == 0.0
        # Gates start near sigmoid(2): output ~= 0.88 x the ungated layer (2% relative).
        assert stats["init_output_rel_err"] < 0.02, stats["init_output_rel_err"]
        assert len(stats["bias_warnings"]) == 1, stats["bias_warnings"]


def _model_weights(tp, gate, use_cpu_initialization, **fields):
    """A tiny GPTModel's global-layout weights, built after seeding as the launcher seeds (the
    gate rows apart: key ``gate_rows``, gathered over TP)."""
    from mcore_ext.runtime import set_seed

    set_seed(1234)
    config = builders.gated_config(
        hidden_size=64, num_attention_heads=4, num_query_groups=2, add_qkv_bias=True,
        init_method_std=0.02, tensor_model_parallel_size=tp, head_wise_attn_gate=gate,
        use_cpu_initialization=use_cpu_initialization, **fields)
    model = builders.build_gpt(config)
    weights, gate_rows = {}, []
    for name, param in model.named_parameters():
        tensor = param.detach().clone()
        if gate and "linear_qkv" in name:
            rows = model.decoder.layers[0].self_attention.qkv_rows_per_partition
            if name.endswith("weight"):
                gate_rows.append(tensor[rows:])
            else:  # the gate's bias rows: the configured value
                assert torch.equal(tensor[rows:], torch.full_like(
                    tensor[rows:], config.head_wise_attn_gate_init_bias)), name
            tensor = tensor[:rows]
        weights[name] = tensor
    return weights, [_gather_tp_rows(g) for g in gate_rows]


def _gather_tp_rows(tensor):
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def _gated_and_ungated_start_equal(tp, use_cpu_initialization):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    off, _ = _model_weights(tp, False, use_cpu_initialization)
    on, gate_rows = _model_weights(tp, True, use_cpu_initialization,
                                   head_wise_attn_gate_init_weight_scale=1.0)
    scaled, scaled_rows = _model_weights(tp, True, use_cpu_initialization,
                                         head_wise_attn_gate_init_weight_scale=0.1)
    return dict(
        names_equal=sorted(on) == sorted(off) == sorted(scaled),
        max_shared_diff=max((w[n] - off[n]).abs().max().item() for w in (on, scaled) for n in off),
        gate_rows=[g.tolist() for g in gate_rows],
        scale_exact=all(torch.equal(h, g * 0.1) for h, g in zip(scaled_rows, gate_rows)),
    )


@pytest.mark.parametrize("use_cpu_initialization", [True, False])
def test_gate_rows_leave_every_shared_weight_as_the_ungated_model_draws_it(
        run_distributed, use_cpu_initialization):
    # A gated and an ungated model of one seed start from the same weights (every weight but the
    # gate rows, exactly), so a run with the gate and one without differ by the gate alone; the
    # gate rows are drawn like QKV rows (std 0.02) for every head at once, the same at TP 1 and 2.
    tp1 = run_distributed(_gated_and_ungated_start_equal, 1, use_cpu_initialization,
                          world_size=1)[0]
    tp2 = run_distributed(_gated_and_ungated_start_equal, 2, use_cpu_initialization,
                          world_size=2)
    for stats in [tp1, *tp2]:
        assert stats["names_equal"]
        assert stats["max_shared_diff"] == 0.0, stats["max_shared_diff"]
        assert stats["scale_exact"]  # the weight scale multiplies the same draw
    for layer, rows in enumerate(tp1["gate_rows"]):
        rows = torch.tensor(rows)
        assert rows.shape == (4, 64)
        assert 0.015 < rows.std().item() < 0.025, rows.std()  # 256 draws of N(0, 0.02)
        assert torch.equal(rows, torch.tensor(tp2[0]["gate_rows"][layer]))
        assert torch.equal(rows, torch.tensor(tp2[1]["gate_rows"][layer]))
    # Each layer its own rows, independent of the QKV rows.
    assert not torch.equal(torch.tensor(tp1["gate_rows"][0]), torch.tensor(tp1["gate_rows"][1]))


def _meta_device_build():
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    with torch.device("meta"):
        attn = builders.build_self_attention(builders.gated_config(
            tensor_model_parallel_size=2, init_model_with_meta_device=True, perform_initialization=False))
    return attn.linear_qkv.weight.device.type, tuple(attn.linear_qkv.weight.shape)


def test_meta_device_skips_surgery(run_distributed):
    # (QKV (4 + 2 * 4) * 8 + 4 gate rows) / TP 2 = 50 rows per rank, nothing materialized.
    assert run_distributed(_meta_device_build, world_size=2) == [("meta", (50, 32))] * 2


# ------------------------------------------------------------------------- gates and flag off


def _gated_and_plain_pair(tp, **overrides):
    """A gated layer and an ungated SelfAttention sharing every QKV and projection weight."""
    fields = dict(tensor_model_parallel_size=tp, add_qkv_bias=True, num_query_groups=2,
                  init_method_std=0.2, **overrides)
    gated = builders.build_self_attention(builders.gated_config(**fields))
    plain = builders.build_self_attention(builders.gated_config(head_wise_attn_gate=False, **fields))
    rows = gated.qkv_rows_per_partition
    with torch.no_grad():
        plain.linear_qkv.weight.copy_(gated.linear_qkv.weight[:rows])
        plain.linear_qkv.bias.copy_(gated.linear_qkv.bias[:rows])
        plain.linear_proj.weight.copy_(gated.linear_proj.weight)
    return gated, plain


def _saturated_gates(tp):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    gated, plain = _gated_and_plain_pair(tp)
    rows = gated.qkv_rows_per_partition
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0))
    plain_out = plain(x, None)[0]
    diffs = {}
    for gate_bias, expected in [(1e4, plain_out), (-1e4, torch.zeros_like(plain_out)), (0.0, plain_out / 2)]:
        with torch.no_grad():
            gated.linear_qkv.weight[rows:].zero_()
            gated.linear_qkv.bias[rows:].fill_(gate_bias)
        diffs[gate_bias] = (gated(x, None)[0] - expected).abs().max().item()
    return diffs, plain_out.abs().max().item()


def test_saturated_gates_open_close_and_halve(run_distributed):
    for diffs, scale in run_distributed(_saturated_gates, 2, world_size=2):
        assert scale > 0.1  # the ungated output is not trivially zero
        assert diffs[1e4] <= 1e-5  # gate open: the ungated layer
        assert diffs[-1e4] <= 1e-5  # gate closed: zero output
        assert diffs[0.0] <= 1e-5  # sigmoid(0) = 1/2: half of it


def _flag_off_is_plain_self_attention():
    import mcore_ext
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    config = builders.gated_config(head_wise_attn_gate=False, tensor_model_parallel_size=2,
                                   add_qkv_bias=True)
    spec = mcore_ext.get_gpt_layer_spec(config, "sdpa").submodules.self_attention
    ours = build_module(ModuleSpec(mcore_ext.HeadWiseGatedSelfAttention, params=spec.params,
                                   submodules=spec.submodules), config=config, layer_number=1)
    theirs = build_module(spec, config=config, layer_number=1)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0))
    shapes = lambda m: {k: getattr(v, "shape", None) for k, v in m.state_dict().items()}
    sharded_keys = lambda m: sorted(m.sharded_state_dict(metadata={"dp_cp_group": None}).keys())
    return dict(
        spec_module=spec.module is SelfAttention,
        same_shapes=shapes(ours) == shapes(theirs),
        same_sharded_keys=sharded_keys(ours) == sharded_keys(theirs),
        output_diff=(ours(x, None)[0] - theirs(x, None)[0]).abs().max().item(),
    )


def test_flag_off_changes_nothing(run_distributed):
    for result in run_distributed(_flag_off_is_plain_self_attention, world_size=2):
        assert result == dict(spec_module=True, same_shapes=True, same_sharded_keys=True,
                              output_diff=0.0)


# --------------------------------------------------------------------------------- inference


def _kv_cache_decode_matches_full_forward(tp, device="cpu"):
    import mcore_ext
    from megatron.core.inference.contexts import StaticInferenceContext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    gated, plain = (module.to(device) for module in _gated_and_plain_pair(tp))
    gated.eval(), plain.eval()
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        full = gated(x, None)[0]
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=8)
        prefill = gated(x[:7], None, inference_context=context)[0]
        context.sequence_len_offset = 7
        decode = gated(x[7:], None, inference_context=context)[0]
        plain_last = plain(x, None)[0][7:]
    return dict(
        prefill=(prefill - full[:7]).abs().max().item(),
        decode=(decode - full[7:]).abs().max().item(),
        gate_effect=(decode - plain_last).abs().max().item(),
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_static_kv_cache_decoding_applies_the_gate(run_distributed, tp):
    for result in run_distributed(_kv_cache_decode_matches_full_forward, tp, world_size=2):
        assert result["prefill"] <= 1e-5 and result["decode"] <= 1e-5, result
        assert result["gate_effect"] > 1e-3, result  # the decoded token is gated


@pytest.mark.gpu
def test_static_kv_cache_decoding_on_cuda_applies_the_gate(run_distributed):
    for result in run_distributed(_kv_cache_decode_matches_full_forward, 1, "cuda", world_size=1):
        assert result["prefill"] <= GPU_FP32_TOL and result["decode"] <= GPU_FP32_TOL, result
        assert result["gate_effect"] > 1e-3, result


def _full_recompute_matches_plain(tp, device="cpu"):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    common = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=8,
                  add_qkv_bias=True, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    plain = builders.build_gpt(builders.gated_config(**common)).to(device)
    recomputed = builders.build_gpt(builders.gated_config(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        **common)).to(device)
    recomputed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(16, device=device).expand_as(tokens)
    losses, grads = [], []
    for model in (plain, recomputed):
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    gate_grad = plain.decoder.layers[0].self_attention.linear_qkv.weight.grad
    return losses, worst, gate_grad[plain.decoder.layers[0].self_attention.qkv_rows_per_partition:].norm().item()


def test_full_activation_recompute_gives_the_same_loss_and_gradients(run_distributed):
    for losses, worst_grad_diff, gate_grad_norm in run_distributed(_full_recompute_matches_plain,
                                                                   2, world_size=2):
        assert losses[0] == losses[1]
        assert worst_grad_diff <= 1e-6 and gate_grad_norm > 0, (worst_grad_diff, gate_grad_norm)


@pytest.mark.gpu
def test_full_activation_recompute_on_cuda_gives_the_same_loss_and_gradients(run_distributed):
    # The recomputed forward runs the same kernels on the same inputs: equal up to kernels that
    # are not bitwise deterministic on a GPU (atomics in some backward kernels), hence 1e-6.
    for losses, worst_grad_diff, gate_grad_norm in run_distributed(_full_recompute_matches_plain,
                                                                   1, "cuda", world_size=1):
        assert abs(losses[0] - losses[1]) <= 1e-6, losses
        assert worst_grad_diff <= 1e-6 and gate_grad_norm > 0, (worst_grad_diff, gate_grad_norm)


def _bytes_held_after(fn):
    """Net CPU bytes allocated by fn() and still held when it returns (its output included).

    Measured by the allocator (profiler memory events), not by saved-tensor hooks, which the
    gated layer installs itself and which do not nest.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        output = fn()
    del output
    return sum(event.self_cpu_memory_usage for event in profile.key_averages())


def _activation_bytes_held_for_backward(dtype):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    params_dtype = getattr(torch, dtype)
    gated, plain = _gated_and_plain_pair(1, hidden_size=64, num_attention_heads=4, kv_channels=16,
                                         params_dtype=params_dtype,
                                         bf16=params_dtype is torch.bfloat16)
    x = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(0)).to(params_dtype)
    x.requires_grad_(True)
    return _bytes_held_after(lambda: gated(x, None)), _bytes_held_after(lambda: plain(x, None))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_keeps_only_its_fp32_sigmoid_for_backward(run_distributed, dtype):
    """What a forward leaves held for backward grows by gate-sized tensors [s, b, np] only: the
    gate's fp32 sigmoid, and (sdpa keeps q, k, v as views of the fused linear_qkv output) the gate
    columns of that output. Not by the gated [s, b, np * hn] output that linear_proj saves: it is
    recomputed in backward (without the recompute this fails by one [s, b, h])."""
    gated_bytes, plain_bytes = run_distributed(_activation_bytes_held_for_backward, dtype,
                                               world_size=2)[0]
    s, b, heads, hidden = 32, 2, 4, 64
    sigmoid_bytes = s * b * heads * 4
    gate_columns_bytes = s * b * heads * getattr(torch, dtype).itemsize
    assert 0 < gated_bytes - plain_bytes <= sigmoid_bytes + gate_columns_bytes, (
        gated_bytes, plain_bytes)


# --------------------------------------------------------------------- layouts handed downstream


def _layouts_handed_downstream(tp, case, backend):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    fields = dict(CASES[case], tensor_model_parallel_size=tp)
    config = builders.gated_config(**fields)
    gated = builders.build_self_attention(config, backend)
    plain = builders.build_self_attention(builders.gated_config(head_wise_attn_gate=False,
                                                                **fields), backend)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0))
    layout = lambda t: (tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
    with torch.no_grad():
        *gated_qkv, gate = gated.get_query_key_value_tensors(x)
        plain_qkv = plain.get_query_key_value_tensors(x)
    return dict(
        copied=gated.copy_qkv_out,
        qkv=[(layout(a), layout(b)) for a, b in zip(gated_qkv, plain_qkv)],
        fused_output_bytes=8 * 2 * (config.linear_qkv_rows // tp) * 4,
        gate=(tuple(gate.shape), gate.is_contiguous(), gate.untyped_storage().nbytes(),
              gate.numel() * gate.element_size()),
        heads_per_rank=config.num_attention_heads // tp,
        fewer_groups_than_ranks=config.num_query_groups < tp,
    )


@pytest.mark.parametrize("backend", ["local", "sdpa"])
@pytest.mark.parametrize("tp,case", [(1, "mha_bias"), (2, "mha_nobias"), (2, "gqa_bias"),
                                     (4, "gqa_bias"), (4, "gqa_one_group")])
def test_query_key_value_layouts_fit_the_core_attention(run_distributed, tp, case, backend):
    """local: q, k, v get the shapes, strides, offsets and storage sizes of the ungated layer's
    (megatron's local attention .views them), copied out of the fused linear_qkv output.
    sdpa (takes strided q/k/v): the same shapes, as views of the fused output, no copy.
    The gate logits are a contiguous tensor of their own either way. 4 ranks: fewer groups than
    TP, where the all-gather copies anyway."""
    for result in run_distributed(_layouts_handed_downstream, tp, case, backend,
                                  world_size=max(tp, 2)):
        assert result["copied"] == (backend == "local")
        for (shape, stride, offset, nbytes), plain_layout in result["qkv"]:
            if result["copied"] or result["fewer_groups_than_ranks"]:
                assert (shape, stride, offset, nbytes) == plain_layout
            else:
                assert shape == plain_layout[0] and nbytes == result["fused_output_bytes"]
        shape, contiguous, nbytes, tensor_bytes = result["gate"]
        assert shape == (8, 2, result["heads_per_rank"]) and contiguous and nbytes == tensor_bytes


# ------------------------------------------------------------- other saved-tensor hooks around


def _gradients_under_outer_hooks():
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    gated, _ = _gated_and_plain_pair(1)
    g = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    layer = lambda inp: gated(inp, None)[0]

    def grads(run):
        gated.zero_grad()
        inp = x.clone().requires_grad_(True)
        (run(inp) * upstream).sum().backward()
        return [inp.grad] + [p.grad.clone() for p in gated.parameters()]

    seen_by_outer = []

    def with_outer_hooks(inp):
        pack = lambda t: seen_by_outer.append(t) or t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return layer(inp)

    plain_grads = grads(layer)
    outer_grads = grads(with_outer_hooks)
    checkpoint_grads = grads(lambda inp: torch.utils.checkpoint.checkpoint(layer, inp,
                                                                            use_reentrant=False))
    gated_output_shape = (8, 2, 32)  # linear_proj's input, [s, b, np * hn]
    return dict(
        outer_equal=all(torch.equal(a, b) for a, b in zip(plain_grads, outer_grads)),
        checkpoint_equal=all(torch.equal(a, b) for a, b in zip(plain_grads, checkpoint_grads)),
        outer_saw_gated_output=any(tuple(t.shape[-3:]) == gated_output_shape
                                   and t.dtype == torch.float32 for t in seen_by_outer),
    )


def test_steps_aside_for_saved_tensor_hooks_around_the_layer(run_distributed):
    """Saved-tensor hooks do not nest. Under hooks of its caller (here a recorder, and torch's
    non-reentrant activation checkpoint) the layer installs none of its own: the outer hooks see
    every saved tensor, the gated output included, and gradients are exactly those of a plain run."""
    for result in run_distributed(_gradients_under_outer_hooks, world_size=2):
        assert result == dict(outer_equal=True, checkpoint_equal=True, outer_saw_gated_output=True)


def _offloading_matches_plain():
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    common = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=8,
                  add_qkv_bias=True)
    plain = builders.build_gpt(builders.gated_config(**common)).to(mcore_ext.device())
    offloaded = builders.build_gpt(builders.gated_config(
        fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"],
        **common)).to(mcore_ext.device())
    offloaded.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(mcore_ext.device())
    positions = torch.arange(16, device=tokens.device).expand_as(tokens)
    grads = []
    for model in (plain, offloaded):
        model(tokens, positions, None, labels=tokens).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


@pytest.mark.gpu  # megatron's activation offloading needs CUDA streams
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="megatron's fine-grained activation offloading runs on Transformer "
                           "Engine's cpu_offload ('TE CPU offload is not available' without it); "
                           "Transformer Engine is not installed")
def test_megatron_activation_offloading_gives_the_same_gradients(run_distributed):
    # One rank: a second rank would ask for a second GPU (LOCAL_RANK 1).
    assert max(run_distributed(_offloading_matches_plain, world_size=1)) <= 1e-6
