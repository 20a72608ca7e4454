"""Context parallelism on the sdpa backend, against a CP=1 run of the same weights (gloo).

A 2-layer gated GPTModel (hidden 64, seq 32, RoPE) runs at CP=1 on the full sequence, then at
CP > 1 on each rank's load-balanced chunks (megatron's split): the local logits must equal the
CP=1 logits at those positions, and every parameter's gradient summed over the CP group must
equal the CP=1 gradient (fp32, max abs diff <= 1e-5). CP=1 and CP > 1 share weights: the CP=1
model's state dict (this TP rank's shard) is loaded into the CP model.
"""

import pytest
import torch

from tests import builders

TOL = 1e-5
SEQ, BATCH, VOCAB = 32, 2, 64

CASES = {  # name: (tp, cp, num_query_groups)
    "cp2_mha": (1, 2, 8),
    "cp2_gqa": (1, 2, 2),
    "cp4_mha": (1, 4, 8),
    "cp4_gqa": (1, 4, 2),
    "tp2_cp2_gqa": (2, 2, 2),
    "tp2_cp2_gqa_g1_lt_tp": (2, 2, 1),
}


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
    """(logits, {name: grad}) of loss = sum(logits * upstream)."""
    model.zero_grad()
    logits = model(tokens, positions, None, packed_seq_params=packed_seq_params)
    (logits * upstream).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_cp_vs_cp1(names):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel

    tokens, upstream = _inputs()
    positions = torch.arange(SEQ).expand_as(tokens)
    results = {}
    for name in names:
        tp, cp, groups = CASES[name]
        mcore_ext.init_parallel(tensor_model_parallel_size=tp)
        model = builders.build_gpt(_config(tp, 1, groups), VOCAB, SEQ, parallel_output=False)
        ref_logits, ref_grads = _run(model, tokens, positions, upstream)
        state = model.state_dict()
        mcore_ext.destroy_parallel()

        mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, seed=99)
        model = builders.build_gpt(_config(tp, cp, groups), VOCAB, SEQ, parallel_output=False)
        model.load_state_dict(state)
        local = context_parallel.get_batch_on_this_cp_rank(
            dict(tokens=tokens, positions=positions, upstream=upstream, ref_logits=ref_logits)
        )
        logits, grads = _run(model, local["tokens"], local["positions"], local["upstream"])
        for grad in grads.values():
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        results[name] = dict(
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
        assert r["grad_scale"] > 1e-2, (name, r)  # the gradients compared are not all ~0
        assert r["logits"] <= TOL and r["grads"] <= TOL, (name, r)


def test_gpt_cp2_matches_cp1_logits_and_grads(run_distributed):
    names = ["cp2_mha", "cp2_gqa"]
    for rank_results in run_distributed(_gpt_cp_vs_cp1, names, world_size=2):
        _check(rank_results, names, {n: CASES[n][1] for n in names})


@pytest.mark.slow
def test_gpt_cp4_and_tp2_cp2_match_cp1_logits_and_grads(run_distributed):
    names = ["cp4_mha", "cp4_gqa", "tp2_cp2_gqa", "tp2_cp2_gqa_g1_lt_tp"]
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
