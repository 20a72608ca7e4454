"""Context parallelism on the sdpa backend, against a CP=1 run of the same weights (gloo).

A 2-layer gated GPTModel (hidden 64, seq 32, RoPE) runs at CP=1 on the full sequence, then at
CP > 1 on each rank's load-balanced chunks (megatron's split): the local logits must equal the
CP=1 logits at those positions, and every parameter's gradient summed over the CP group must
equal the CP=1 gradient (fp32, max abs diff <= 1e-5). CP=1 and CP > 1 share weights: the CP=1
model's state dict (this TP rank's shard) is loaded into the CP model.
"""

import pytest
import torch

from tests import builders, reference

TOL = 1e-5
SEQ, BATCH, VOCAB = 32, 2, 64

CASES = {  # name: (tp, cp, num_query_groups[, config overrides])
    "cp2_mha": (1, 2, 8),
    "cp2_gqa": (1, 2, 2),
    # megatron's selective recompute of core attention re-runs the K/V all-gather in backward
    "cp2_gqa_recompute_core_attn": (1, 2, 2, dict(recompute_granularity="selective")),
    "cp4_mha": (1, 4, 8),
    "cp4_gqa": (1, 4, 2),
    "tp2_cp2_gqa": (2, 2, 2),
    "tp2_cp2_gqa_g1_lt_tp": (2, 2, 1),
}

# Model fields of both runs (CP=1 and CP > 1), by case. Step-3.5 layer kinds: sliding layers with
# their own heads, window 5 (the chunks are 8 tokens at CP 2, so a chunk's window reaches into
# the chunk before it), per-kind RoPE base and fraction (each kind slices its own embedding per
# CP rank), zero-centered norms with q/k norms, a SwiGLU clamp.
MODEL_FIELDS = {
    "cp2_step35_kinds": dict(
        num_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=5, sliding_num_attention_heads=4, rotary_percent=0.5, rotary_base=5e5,
        sliding_rotary_base=1e4, normalization="RMSNorm", layernorm_zero_centered_gamma=True,
        qk_layernorm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        swiglu_limits=[None, 0.5, None],
        bias_activation_fusion=False,
    ),
}
CASES["cp2_step35_kinds"] = (1, 2, 2)
# Sliding layers under CP move only their window's halo (issue 25): windows above a chunk (several
# chunks back), above the sequence (the whole prefix), with selective recompute, and TP 2 x CP 2
# with sequence parallelism and fewer KV groups than TP ranks.
_STEP35 = MODEL_FIELDS["cp2_step35_kinds"]
MODEL_FIELDS.update({
    "cp2_step35_window_above_sequence": dict(_STEP35, sliding_window=40),
    "cp2_step35_recompute": _STEP35,
    "cp4_step35_window_above_chunk": dict(_STEP35, sliding_window=9),
    "tp2_cp2_sp_step35_g1": dict(_STEP35, sequence_parallel=True),
})
CASES.update({
    "cp2_step35_window_above_sequence": (1, 2, 2),
    "cp2_step35_recompute": (1, 2, 2, dict(recompute_granularity="selective")),
    "cp4_step35_window_above_chunk": (1, 4, 2),
    "tp2_cp2_sp_step35_g1": (2, 2, 1),
})


def _build(config):
    import mcore_ext

    if config.layer_types is not None:  # RoPE per layer kind, from the config
        return mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                         backend="sdpa")
    return builders.build_gpt(config, VOCAB, SEQ, parallel_output=False)


def _config(tp, cp, groups, **overrides):
    return builders.gated_config(
        hidden_size=64, num_attention_heads=8, kv_channels=8, num_query_groups=groups,
        add_qkv_bias=True, tensor_model_parallel_size=tp, context_parallel_size=cp, **overrides,
    )


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # d(loss)/d(logits), scaled as a mean over tokens is (gradients of order 1: fp32 sums of
    # O(40) gradients in another order differ by ~1e-5, absolute).
    upstream = torch.randn(BATCH, SEQ, VOCAB, generator=g) / (BATCH * SEQ)
    return tokens, upstream


def _run(model, tokens, positions, upstream, packed_seq_params=None):
    """(logits, {name: grad}) of loss = sum(logits * upstream) (logits gathered over TP). Under
    sequence parallelism a replicated parameter's gradient is summed over TP, as megatron's
    finalize_model_grads does."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model.zero_grad()
    logits = model(tokens, positions, None, packed_seq_params=packed_seq_params)
    if logits.size(-1) != upstream.size(-1):  # build_gpt_model keeps the logits TP-split
        logits = gather_from_tensor_model_parallel_region(logits)
    (logits * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return logits.detach(), grads


def _gpt_cp_vs_cp1(names):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    tokens, upstream = _inputs()
    positions = torch.arange(SEQ).expand_as(tokens)
    results = {}
    for name in names:
        tp, cp, groups, *overrides = CASES[name]
        overrides = overrides[0] if overrides else {}
        fields = MODEL_FIELDS.get(name, {})
        mcore_ext.init_parallel(tensor_model_parallel_size=tp)
        model = _build(_config(tp, 1, groups, **fields))
        ref_logits, ref_grads = _run(model, tokens, positions, upstream)
        state = model.state_dict()
        mcore_ext.destroy_parallel()

        mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, seed=99)
        model = _build(_config(tp, cp, groups, **fields, **overrides))
        model.load_state_dict(state)
        local = context_parallel.get_batch_on_this_cp_rank(
            dict(tokens=tokens, positions=positions, upstream=upstream, ref_logits=ref_logits)
        )
        logits, grads = _run(model, local["tokens"], local["positions"], local["upstream"])
        for grad in grads.values():
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        results[name] = dict(
            recompute=model.decoder.layers[0].self_attention.checkpoint_core_attention,
            local_tokens=local["tokens"].size(1),
            logits=(logits - local["ref_logits"]).abs().max().item(),
            grads=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            grad_scale=max(g.abs().max().item() for g in ref_grads.values()),
        )
        mcore_ext.destroy_parallel()
    return results


def _check(results, names, cp_of):
    for name in names:
        r = results[name]
        assert r["local_tokens"] == SEQ // cp_of[name], (name, r)
        assert r["recompute"] == ("recompute" in name), (name, r)
        assert r["grad_scale"] > 1e-2, (name, r)  # the gradients compared are not all ~0
        assert r["logits"] <= TOL and r["grads"] <= TOL, (name, r)


@pytest.mark.smoke  # also run on the older megatron-core releases (their CP batch split differs)
def test_gpt_cp2_matches_cp1_logits_and_grads(run_distributed):
    names = ["cp2_mha", "cp2_gqa", "cp2_gqa_recompute_core_attn", "cp2_step35_kinds",
             "cp2_step35_window_above_sequence", "cp2_step35_recompute"]
    for rank_results in run_distributed(_gpt_cp_vs_cp1, names, world_size=2):
        _check(rank_results, names, {n: CASES[n][1] for n in names})


def _gpt_bf16_cp_and_cp1_vs_fp32(names):
    """bf16 at CP 1 and at CP 2 against fp32 at CP 1, all on the same bf16-rounded weights:
    max abs diff of the logits (this rank's tokens) and of the CP-summed gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    tokens, upstream = _inputs()
    positions = torch.arange(SEQ).expand_as(tokens)
    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)
    results = {}
    for name in names:
        tp, cp, groups = CASES[name][:3]
        fields = MODEL_FIELDS.get(name, {})
        mcore_ext.init_parallel(tensor_model_parallel_size=tp)
        model = _build(_config(tp, 1, groups, **fields))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
        state = model.state_dict()
        ref_logits, ref_grads = _run(model, tokens, positions, upstream)
        model = _build(_config(tp, 1, groups, **fields, **bf16))
        model.load_state_dict(state)
        cp1_logits, cp1_grads = _run(model, tokens, positions, upstream)
        mcore_ext.destroy_parallel()

        mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, seed=99)
        model = _build(_config(tp, cp, groups, **fields, **bf16))
        model.load_state_dict(state)
        local = context_parallel.get_batch_on_this_cp_rank(dict(
            tokens=tokens, positions=positions, upstream=upstream, ref_logits=ref_logits,
            cp1_logits=cp1_logits,
        ))
        logits, grads = _run(model, local["tokens"], local["positions"], local["upstream"])
        for grad in grads.values():
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        grad_diff = lambda gs: max((gs[n].float() - ref_grads[n]).abs().max().item()
                                   for n in ref_grads)
        results[name] = dict(
            dtype=str(logits.dtype),
            cp_logits=(logits.float() - local["ref_logits"]).abs().max().item(),
            cp1_logits=(local["cp1_logits"].float() - local["ref_logits"]).abs().max().item(),
            cp_grads=grad_diff(grads), cp1_grads=grad_diff(cp1_grads),
            logit_scale=ref_logits.abs().max().item(),
            grad_scale=max(g.abs().max().item() for g in ref_grads.values()),
        )
        mcore_ext.destroy_parallel()
    return results


def test_gpt_cp2_in_bf16_is_as_close_to_fp32_as_cp1(run_distributed):
    """bf16 at CP 2 and at CP 1 each stay within bf16 rounding of fp32 at CP 1 (same rounded
    weights). bf16 keeps 8 significant bits (u = 2^-8 per rounding); the 2-3 layer models have
    about 30 rounded stages forward and twice that backward, and independent rounding errors
    add like a random walk: max |diff| <= 8 u max|fp32| for logits, 16 u for gradients (3.1 %
    and 6.3 %). CP changes where the attention sums are cut (each chunk attends to the gathered
    keys; dK/dV are reduce-scattered in bf16), not how many roundings there are."""
    u = reference.BF16_UNIT_ROUNDOFF
    names = ["cp2_gqa", "cp2_step35_kinds"]
    for rank_results in run_distributed(_gpt_bf16_cp_and_cp1_vs_fp32, names, world_size=2):
        for name, r in rank_results.items():
            assert r["dtype"] == "torch.bfloat16", (name, r)
            assert r["grad_scale"] > 1e-2, (name, r)
            for run in ("cp", "cp1"):
                assert r[f"{run}_logits"] <= 8 * u * r["logit_scale"], (name, run, r)
                assert r[f"{run}_grads"] <= 16 * u * r["grad_scale"], (name, run, r)


@pytest.mark.slow
def test_gpt_cp4_and_tp2_cp2_match_cp1_logits_and_grads(run_distributed):
    names = ["cp4_mha", "cp4_gqa", "tp2_cp2_gqa", "tp2_cp2_gqa_g1_lt_tp",
             "cp4_step35_window_above_chunk", "tp2_cp2_sp_step35_g1"]
    for rank_results in run_distributed(_gpt_cp_vs_cp1, names, world_size=4):
        _check(rank_results, names, {n: CASES[n][1] for n in names})


# ------------------------------------------------------------------------------- packed THD

DOC_LENGTHS = [5, 11, 8, 3]  # padded to multiples of 2 x CP = 4: 8, 12, 8, 4 (32 tokens)


def _packed_params(cp):
    from megatron.core.packed_seq_params import PackedSeqParams

    pad = 2 * cp
    padded = [-(-n // pad) * pad for n in DOC_LENGTHS]
    cu = torch.tensor([0] + DOC_LENGTHS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )


def _packed_cp2_vs_cp1(groups):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    cp = 2
    params = _packed_params(cp)
    total = int(params.cu_seqlens_q_padded[-1])
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (1, total), generator=g)
    upstream = torch.randn(1, total, VOCAB, generator=g) / total
    positions = torch.arange(total).unsqueeze(0)  # unused by RoPE with packed sequences

    mcore_ext.init_parallel()
    model = builders.build_gpt(_config(1, 1, groups), VOCAB, SEQ, parallel_output=False)
    ref_logits, ref_grads = _run(model, tokens, positions, upstream, params)
    state = model.state_dict()
    mcore_ext.destroy_parallel()

    mcore_ext.init_parallel(context_parallel_size=cp, seed=99)
    model = builders.build_gpt(_config(1, cp, groups), VOCAB, SEQ, parallel_output=False)
    model.load_state_dict(state)

    def local(x):
        return context_parallel.get_packed_batch_on_this_cp_rank(x, params.cu_seqlens_q_padded,
                                                                 dim=1)

    logits, grads = _run(model, local(tokens), local(positions), local(upstream), params)
    for grad in grads.values():
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
    # Real tokens only: a padding token's logits depend on nothing a user reads.
    real = local(_real_tokens(params).unsqueeze(0))[0]
    return dict(
        local_tokens=logits.size(1),
        logits=(logits - local(ref_logits))[:, real].abs().max().item(),
        grads=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
    )


def _real_tokens(params):
    real = torch.zeros(int(params.cu_seqlens_q_padded[-1]), dtype=torch.bool)
    for start, n in zip(params.cu_seqlens_q_padded[:-1].tolist(), DOC_LENGTHS):
        real[start:start + n] = True
    return real


@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
def test_packed_thd_cp2_matches_cp1(run_distributed, groups):
    for r in run_distributed(_packed_cp2_vs_cp1, groups, world_size=2):
        assert r["local_tokens"] == 16, r
        assert r["logits"] <= TOL and r["grads"] <= TOL, r


# ------------------------------------------------------------------------------------ errors


def _errors():
    from megatron.core.transformer.enums import AttnMaskType

    import mcore_ext
    from mcore_ext.attention import context_parallel
    from mcore_ext.attention.sdpa import SDPAttention

    mcore_ext.init_parallel(context_parallel_size=2)
    messages = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, NotImplementedError) as err:
            messages[name] = str(err)

    odd = dict(tokens=torch.zeros(2, 30, dtype=torch.long))  # 30 % (2 x CP = 4) != 0
    catch("seq_length", lambda: context_parallel.get_batch_on_this_cp_rank(odd))
    catch("local_backend", lambda: mcore_ext.get_gpt_layer_spec(_config(1, 2, 8), "local"))
    catch("cp_comm_type", lambda: SDPAttention(_config(1, 2, 8), 1, AttnMaskType.causal, "self",
                                              cp_comm_type="p2p"))
    catch("config_vs_group", lambda: SDPAttention(_config(1, 1, 8), 1, AttnMaskType.causal,
                                                  "self"))
    catch("varlen", lambda: SDPAttention(_config(1, 2, 8, attention_kernel="varlen"), 1,
                                         AttnMaskType.causal, "self"))
    attn = SDPAttention(_config(1, 2, 8), 1, AttnMaskType.causal, "self")
    q = torch.zeros(8, 1, 8, 8)
    catch("attention_mask", lambda: attn(q, q, q, torch.zeros(1, 1, 8, 16, dtype=torch.bool)))
    padded = torch.tensor([0, 6], dtype=torch.int32)  # a document of 6, not a multiple of 4
    catch("packed", lambda: context_parallel.get_packed_batch_on_this_cp_rank(q, padded))
    return messages


def test_cp_errors_name_the_field_and_value(run_distributed):
    for messages in run_distributed(_errors, world_size=2):
        assert "sequence length 30" in messages["seq_length"], messages
        assert "2 x context_parallel_size = 4" in messages["seq_length"], messages
        assert "context_parallel_size=2 needs backend 'sdpa' or 'te'" in messages["local_backend"]
        assert "cp_comm_type='p2p'" in messages["cp_comm_type"], messages
        assert "attention_mask" in messages["attention_mask"], messages
        assert "padded length 6" in messages["packed"], messages
        assert "attention_kernel='varlen' does not support context_parallel_size=2" in (
            messages["varlen"])
        assert "context_parallel_size=1 but the context-parallel group has 2 ranks" in (
            messages["config_vs_group"])


def test_launcher_refuses_bad_cp_layouts(tmp_path):
    from mcore_ext.training.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("data:\n  source: mock\n")
    cases = {
        "model.seq_length (100) must be divisible by 2 x parallelism.context_parallel_size (4)":
            ["parallelism.context_parallel_size=4", "model.seq_length=100"],
        "ranks are not divisible": ["parallelism.context_parallel_size=3", "model.seq_length=96"],
        "needs model.attention_backend 'sdpa' or 'te'":
            ["parallelism.context_parallel_size=2", "model.attention_backend=local"],
        "parallelism.context_parallel_size=0 must be at least 1":
            ["parallelism.context_parallel_size=0"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(str(path), overrides, world_size=4)
    cfg = load_config(str(path), ["parallelism.context_parallel_size=2"], world_size=4)
    assert cfg.data_parallel_size == 2


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu_machine", "cuda_machine"])
def test_launcher_takes_flex_with_cp_on_a_gpu_and_refuses_varlen(tmp_path, monkeypatch, on_gpu):
    """Under CP the flex kernel trains on a GPU (a CPU has no flex backward); varlen is refused
    on both, before anything is built, naming both values."""
    from mcore_ext.training.config import ConfigError, load_config, validation

    monkeypatch.setattr(validation, "_cuda_available", lambda: on_gpu)
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  source: mock\n")
    overrides = ["parallelism.context_parallel_size=2", "model.attention_backend=sdpa"]
    with pytest.raises(ConfigError) as err:
        load_config(str(path), overrides + ["model.attention_kernel=varlen"], world_size=2)
    assert ("model.attention_kernel=varlen does not support parallelism.context_parallel_size=2"
            in str(err.value)), err.value
    if on_gpu:
        cfg = load_config(str(path), overrides + ["model.attention_kernel=flex"], world_size=2)
        assert cfg.model.attention_kernel == "flex"
    else:
        with pytest.raises(ConfigError, match="flex trains on a GPU only"):
            load_config(str(path), overrides + ["model.attention_kernel=flex"], world_size=2)


def _split_by_given_group():
    """get_batch_on_this_cp_rank with a group that is not the global CP group (which has 1 rank
    here): the split and the length check follow the given 2-rank group."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext.attention import context_parallel

    mcore_ext.init_parallel()  # global CP group: 1 rank
    group = dist.new_group([0, 1])
    rank = group.rank()
    tokens = torch.arange(32).view(2, 16)
    hidden = torch.arange(2 * 16 * 3).view(2, 16, 3)
    split = context_parallel.get_batch_on_this_cp_rank(dict(tokens=tokens, hidden=hidden),
                                                       cp_group=group)
    # Chunks of 4 tokens; rank r keeps chunks r and 3 - r (written out, not megatron's code).
    keep = [*range(4 * rank, 4 * rank + 4), *range(4 * (3 - rank), 4 * (3 - rank) + 4)]
    try:
        context_parallel.get_batch_on_this_cp_rank(dict(tokens=torch.zeros(2, 6)), cp_group=group)
        error = None
    except ValueError as err:
        error = str(err)
    return dict(tokens=torch.equal(split["tokens"], tokens[:, keep]),
                hidden=torch.equal(split["hidden"], hidden[:, keep]), error=error)


@pytest.mark.smoke  # every supported release takes cp_group and splits by it
def test_batch_split_follows_the_given_cp_group(run_distributed):
    """A non-default ``cp_group`` is honoured: megatron's split (0.16 - 0.19 all take the group)
    and mcore_ext's length check both use it, not the global CP group."""
    for r in run_distributed(_split_by_given_group, world_size=2):
        assert r["tokens"] and r["hidden"], r
        assert "2 x context_parallel_size = 4" in (r["error"] or ""), r


# ------------------------------------------------------------------------- the gate under CP


def _gated_layer_cp2_vs_formula(groups):
    """The gated self-attention layer at CP 2 against tests.reference on the full sequence."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    mcore_ext.init_parallel(context_parallel_size=2)
    config = builders.gated_config(num_query_groups=groups, add_qkv_bias=True,
                                   context_parallel_size=2)
    attn = builders.build_self_attention(config)
    heads, hn, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    g = torch.Generator().manual_seed(1)
    w = builders.gated_attention_weights(heads, groups, hn, h, g)
    b_gate = torch.randn(heads, generator=g)
    s = 16
    x, upstream = torch.randn(s, 2, h, generator=g), torch.randn(s, 2, h, generator=g)
    with torch.no_grad():
        qkv = builders.interleave_qkv(w["q"], w["k"], w["v"], heads, groups)
        attn.linear_qkv.weight.copy_(torch.cat([qkv, w["gate"]]))
        attn.linear_qkv.bias.zero_()
        attn.linear_qkv.bias[qkv.size(0):] = b_gate
        attn.linear_proj.weight.copy_(w["o"])

    # Sequence-first [s, b, h]: megatron's split works on dim 1, so split the transposed view.
    def local(t):
        split = context_parallel.get_batch_on_this_cp_rank({"t": t.transpose(0, 1)})
        return split["t"].transpose(0, 1)

    x_local = local(x).clone().requires_grad_(True)
    out, _ = attn(x_local, attention_mask=None)
    (out * local(upstream)).sum().backward()
    gate_grad = attn.linear_qkv.weight.grad[qkv.size(0):].clone()
    dist.all_reduce(gate_grad, group=parallel_state.get_context_parallel_group())

    ref_w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    x_ref = x.clone().requires_grad_(True)
    ref_out = reference.gated_attention(x_ref, ref_w["q"], ref_w["k"], ref_w["v"], ref_w["gate"],
                                        ref_w["o"], heads, groups, b_gate=b_gate)
    (ref_out * upstream).sum().backward()
    return dict(
        output=(out - local(ref_out)).abs().max().item(),
        input_grad=(x_local.grad - local(x_ref.grad)).abs().max().item(),
        gate_grad=(gate_grad - ref_w["gate"].grad).abs().max().item(),
        gate_grad_scale=ref_w["gate"].grad.abs().max().item(),
    )


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_gated_attention_cp2_matches_formula(run_distributed, groups):
    """The gate reads only this rank's tokens (its logits are a per-token projection of the local
    hidden states), so at CP 2 the gated layer is the formula's on the local rows, and the gate
    rows' gradient summed over CP is the full sequence's."""
    for r in run_distributed(_gated_layer_cp2_vs_formula, groups, world_size=2):
        assert r["gate_grad_scale"] > 1e-2, r
        for quantity in ("output", "input_grad", "gate_grad"):
            assert r[quantity] <= TOL, (quantity, r)


# ------------------------------------------------------------- core attention vs the formula


def _core_attention_vs_formula(window):
    """context_parallel.attention at CP 2 (GQA, 8 heads / 2 groups) against tests.reference on
    the full sequence, with a sliding window in HF's terms (key visible iff 0 <= pos_q - pos_k <
    window), given to CP attention as megatron's (left, right) = (window - 1, 0); with window 5 and
    chunks of 4, a chunk's keys start inside an earlier chunk (the keys left of it are skipped)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    mcore_ext.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(2)
    s, b, n, ng, hn = 16, 2, 8, 2, 8
    q, k, v = (torch.randn(s, b, heads, hn, generator=g) for heads in (n, ng, ng))
    upstream = torch.randn(s, b, n * hn, generator=g)

    def local(t):  # [s, ...] -> this rank's [s / 2, ...] rows
        return t.index_select(0, context_parallel.zigzag_positions(s // 2, 2, group.rank()))

    q_l, k_l, v_l = (local(t).requires_grad_(True) for t in (q, k, v))
    out = context_parallel.attention(q_l, k_l, v_l, group=group, causal=True, scale=None,
                                     dropout_p=0.0,
                                     window=None if window is None else (window - 1, 0))
    (out * local(upstream)).sum().backward()
    # dK / dV of a rank's own rows, after the reduce-scatter, are those rows' full gradients.
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    allowed = (j <= i) & (i - j < (window or s))
    ref_out = reference.attention(*ref, allowed)
    (ref_out * upstream).sum().backward()
    dist.barrier()
    return dict(
        output=(out - local(ref_out)).abs().max().item(),
        grads=max((t.grad - local(r.grad)).abs().max().item()
                  for t, r in zip((q_l, k_l, v_l), ref)),
    )


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_core_attention_cp2_matches_formula(run_distributed, window):
    for r in run_distributed(_core_attention_vs_formula, window, world_size=2):
        assert r["output"] <= TOL and r["grads"] <= TOL, r


# ------------------------------------------------- gathered K/V: gathered again in backward


def _gathered_kv_not_kept():
    """A saved view of a gathered tensor is packed as this rank's part (nothing of CP x its size is
    kept between forward and backward) and gathered again in backward: the gradient equals that
    of the same function on the plain gathered tensor."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    mcore_ext.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(4 + group.rank())
    local = torch.randn(4, 3, generator=g)
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])

    def run(hooked):
        x = local.clone().requires_grad_(True)
        hooks = context_parallel._GatherAgainInBackward(group, order)
        full = hooks.gathered(x)
        if hooked:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                y = full[1:6].permute(1, 0) * full[2:7].permute(1, 0)  # saves two views
        else:
            y = full[1:6].permute(1, 0) * full[2:7].permute(1, 0)
        (source,) = hooks.sources.values()
        state = dict(views=source.views, held=source._full is not None)
        del full
        y.sum().backward()
        state.update(after=source.views, held_after=source._full is not None)
        return x.grad, state

    plain, _ = run(hooked=False)
    grad, state = run(hooked=True)
    dist.barrier()
    return dict(state, diff=(grad - plain).abs().max().item(), scale=plain.abs().max().item())


def test_gathered_kv_is_gathered_again_in_backward(run_distributed):
    for r in run_distributed(_gathered_kv_not_kept, world_size=2):
        assert r["views"] == 2 and not r["held"], r  # packed as recipes, no gathered copy kept
        assert r["after"] == 0 and not r["held_after"], r  # freed once both views are unpacked
        assert r["scale"] > 0.1 and r["diff"] <= TOL, r


# ------------------------------------------------- memory: nothing waits for the garbage collector

MEMORY_CASES = {  # name: (cp, mode); mode: train, eval (no backward), recompute, packed
    "cp2_train": (2, "train"),
    "cp2_eval": (2, "eval"),
    "cp2_recompute_core_attn": (2, "recompute"),
    "cp2_packed_thd": (2, "packed"),
    "cp1_gate_hooks": (1, "train"),  # the gate's own saved-tensor hooks, without CP
}
# The control: each step keeps its forward's autograd graph (a grad_fn in a list) and never runs
# backward. What the graph saved is held by autograd's C++ nodes; the intermediates among it never
# had a Python object, so gc cannot list them: the allocator still holds them.
GRAPH_HELD_CONTROL = "cp2_control_graph_held"
# Steps before the allocator is read (torch's and gloo's lazily grown tables settle), and steps
# measured: a leak grows with the steps, the residual noise (measured: at most 38 KB over 30
# steps) does not.
ALLOCATOR_WARMUP_STEPS, ALLOCATOR_STEPS = 8, 30


def _live_tensor_bytes():
    """Bytes of the distinct storages of every tensor the interpreter holds (gc.get_objects lists
    them with the collector off, too)."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    storages = {}
    for obj in gc.get_objects():
        # Tracing tensors (left by an earlier test's torch.compile in this reused worker) have no
        # data pointer and hold no memory.
        if isinstance(obj, torch.Tensor) and not isinstance(obj, (FakeTensor, FunctionalTensor)):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _malloc_bytes_in_use():
    """Bytes glibc's malloc has handed out and not taken back (``mallinfo2``: arenas of every
    thread plus mmapped blocks). torch's CPU allocator is malloc, so this counts every tensor
    storage whoever holds it (a Python object, autograd's C++ nodes, a cache), unlike gc. None
    without glibc >= 2.33."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd  # in use in arenas + in mmapped blocks


def _allocator_growth(step):
    """Growth of the bytes malloc holds over ALLOCATOR_STEPS steps, after ALLOCATOR_WARMUP_STEPS;
    a full collection before each reading, so only what something still references counts (the
    tensors left in cycles are checked apart). None where malloc cannot be read."""
    import gc

    for _ in range(ALLOCATOR_WARMUP_STEPS):
        step()
    gc.collect()
    before = _malloc_bytes_in_use()
    for _ in range(ALLOCATOR_STEPS):
        step()
    gc.collect()
    after = _malloc_bytes_in_use()
    return None if before is None else after - before


def _cycle_garbage_tensors():
    """Tensors reachable only through reference cycles (freed by a full collection alone)."""
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [obj for obj in gc.garbage if isinstance(obj, torch.Tensor)]
        kinds = sorted({type(obj).__qualname__ for obj in gc.garbage
                        if type(obj).__module__.startswith("mcore_ext")})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return len(found), kinds


def _memory_with_collector_off(names, steps=4):
    """Per case: with gc disabled, the growth of live tensor bytes (gc) and of malloc's bytes from
    step 1 to step ``steps`` (each step: forward, backward or not, outputs dropped), the growth of
    live tensor bytes over ``steps - 1`` more (a leak grows in both windows; a cache that fills
    once, in the first only) and the tensors left in cycles; then the growth of malloc's bytes
    over ALLOCATOR_STEPS more, and the bound it must stay under: one gathered K per step (a step
    that leaked its K and V would keep 4 of them, 2 layers)."""
    import gc

    import mcore_ext

    tokens, upstream = _inputs()
    positions = torch.arange(SEQ).expand_as(tokens)
    results = {}
    held_graphs = []
    for name in names:
        cp, mode = MEMORY_CASES.get(name, (2, "hold_graph"))
        mcore_ext.init_parallel(context_parallel_size=cp)
        overrides = dict(recompute_granularity="selective") if mode == "recompute" else {}
        model = builders.build_gpt(_config(1, cp, 2, **overrides), VOCAB, SEQ,
                                   parallel_output=False)
        params = _packed_params(cp) if mode == "packed" else None
        # Any s / CP tokens do for memory (the CP split itself is tested above).
        local = dict(tokens=tokens[:, :SEQ // cp], positions=positions[:, :SEQ // cp],
                     upstream=upstream[:, :SEQ // cp])
        if mode == "packed":
            local = {k: v[:1] for k, v in local.items()}

        def step():
            with torch.set_grad_enabled(mode != "eval"):
                logits = model(local["tokens"], local["positions"], None,
                               packed_seq_params=params)
                if mode == "hold_graph":
                    held_graphs.append(logits.grad_fn)
                elif mode != "eval":
                    (logits * local["upstream"]).sum().backward()

        gc.collect()
        gc.disable()
        try:
            step()  # the first step allocates gradients and caches masks
            before, malloc_before = _live_tensor_bytes(), _malloc_bytes_in_use()
            for _ in range(steps - 1):
                step()
            first_growth = _live_tensor_bytes() - before
            malloc_growth = None if malloc_before is None else (
                _malloc_bytes_in_use() - malloc_before)
            for _ in range(steps - 1):
                step()
            growth = _live_tensor_bytes() - before - first_growth
            cycle_tensors, cycle_kinds = _cycle_garbage_tensors()
            allocator_growth = _allocator_growth(step)
        finally:
            gc.enable()
        tokens_gathered = SEQ if mode == "packed" else BATCH * SEQ  # packed: 1 x 32 padded
        gathered_k_bytes = tokens_gathered * 2 * 8 * 4  # 2 groups, head dim 8, fp32
        results[name] = dict(growth=growth, first_growth=first_growth,
                             first_growth_bound=(steps - 1) * gathered_k_bytes,
                             gathered_k_bytes=gathered_k_bytes, malloc_growth=malloc_growth,
                             allocator_growth=allocator_growth,
                             allocator_bound=ALLOCATOR_STEPS * gathered_k_bytes,
                             cycle_tensors=cycle_tensors, cycle_kinds=cycle_kinds)
        held_graphs.clear()
        del model
        mcore_ext.destroy_parallel()
    return results


def test_cp_attention_frees_kv_without_the_garbage_collector():
    """Large runs turn the collector off (megatron's manual GC): a reference cycle around a
    layer's K/V (or linear_qkv's output they are views of) would keep it until a full collection,
    and memory would grow every step. With gc disabled, nothing tensor-holding is left in a cycle
    after training, evaluation (no backward), core-attention recompute and packed THD steps, and
    live tensor memory does not grow from step 1 to step 7 by three gathered K (4 KB each: half a
    K per step; it may shrink when something an earlier test cached is evicted; a cache may fill once:
    the whole suite grew cp2_eval's live tensors by 6 KB, twice from step 1 to 4 and once from
    step 4 to 7, never this file alone; a step that leaked its K / V, 16 KB, would grow 96 KB).

    gc sees only tensors with a Python object; autograd's C++ nodes hold others. So malloc's
    bytes in use (every CPU tensor's storage) must not grow either, over 30 steps after 8 of
    warm-up: by less than one gathered K per step, a quarter of what a step keeping its K and V
    would leak (measured: at most 38 KB in all, against bounds of 61 and 123 KB). The control, a graph held without backward, grows malloc's bytes
    past its bound (about 420 KB a step) and, in steps 1 to 4, by more than gc's count (1.26 MB
    vs 0.90 MB): the gc count alone misses what autograd's nodes alone hold."""
    from tests.distributed import WorkerPool

    names = [*MEMORY_CASES, GRAPH_HELD_CONTROL]
    # Fresh processes, not the shared pool: what earlier tests left cached in a worker is not what
    # this test measures.
    pool = WorkerPool(2)
    try:
        per_rank = pool.run(_memory_with_collector_off, names, timeout=300)
    finally:
        pool.close()
    for rank_results in per_rank:
        control = rank_results.pop(GRAPH_HELD_CONTROL)
        if control["allocator_growth"] is not None:  # glibc
            assert control["allocator_growth"] > control["allocator_bound"], control
            assert control["malloc_growth"] > max(control["first_growth"], 0), control
        assert control["growth"] > control["gathered_k_bytes"], control  # it grows in both windows
        leaks = {name: r for name, r in rank_results.items()
                 if r["cycle_tensors"]
                 or max(r["first_growth"], 0) + max(r["growth"], 0) >= r["first_growth_bound"] or (
                     r["allocator_growth"] is not None
                     and r["allocator_growth"] >= r["allocator_bound"])}
        assert not leaks, "\n".join(f"{name}: {r}" for name, r in leaks.items())
