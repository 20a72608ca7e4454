"""SDPAttention against the plain softmax(QK^T)V reference, on real gloo ranks.

Every rank builds the same full inputs from one seed, keeps the heads its TP rank owns, and
compares its output with the reference on those heads. Tolerance: fp32, max abs diff <= 1e-5.
"""

import pytest
import torch

from tests import reference

TOL = 1e-5


def _rank_heads(full_SBND, tp_rank, tp):
    per_rank = full_SBND.size(2) // tp
    return full_SBND[:, :, tp_rank * per_rank : (tp_rank + 1) * per_rank]


def _check_against_reference(tp, heads, groups, case):
    import mcore_ext
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    rank = parallel_state.get_tensor_model_parallel_rank()
    head_dim, s, b = 8, 12, 2
    softmax_scale = 0.37 if case == "scale" else None
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
        num_query_groups=groups, tensor_model_parallel_size=tp, softmax_scale=softmax_scale,
    )
    mask_type = AttnMaskType.padding if case == "padding" else AttnMaskType.causal
    attn = mcore_ext.SDPAttention(config, layer_number=1, attn_mask_type=mask_type,
                                  attention_type="self", softmax_scale=softmax_scale).eval()

    g = torch.Generator().manual_seed(0)
    sq = 1 if case == "decode" else s
    q = torch.randn(sq, b, heads, head_dim, generator=g)
    k = torch.randn(s, b, groups, head_dim, generator=g)
    v = torch.randn(s, b, groups, head_dim, generator=g)
    q_r, k_r, v_r = _rank_heads(q, rank, tp), _rank_heads(k, rank, tp), _rank_heads(v, rank, tp)

    if case == "padding":
        # megatron's mask: True = masked out. Batch 1 has its last 5 keys padded.
        masked_B1QK = torch.zeros(b, 1, sq, s, dtype=torch.bool)
        masked_B1QK[1, ..., -5:] = True
        out = attn(q_r, k_r, v_r, masked_B1QK)
        ref = reference.attention(q_r, k_r, v_r, ~masked_B1QK, softmax_scale)
    elif case == "thd":
        lengths = [5, 7]
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=7, max_seqlen_kv=7)
        t_q, t_k, t_v = (x[:, 0] for x in (q_r, k_r, v_r))  # [t, n, d]: batch 0 as 12 tokens
        out = attn(t_q, t_k, t_v, None, packed_seq_params=params)
        refs, start = [], 0
        for n in lengths:
            rows = slice(start, start + n)
            one = lambda x: x[rows].unsqueeze(1)
            refs.append(reference.attention(one(t_q), one(t_k), one(t_v),
                                            reference.causal(n, n)).squeeze(1))
            start += n
        ref = torch.cat(refs)
    else:  # causal, gqa, scale, decode (one query against 12 cached keys)
        out = attn(q_r, k_r, v_r, None)
        ref = reference.attention(q_r, k_r, v_r, reference.causal(sq, s), softmax_scale)

    assert out.shape == ref.shape, (out.shape, ref.shape)
    return (out - ref).abs().max().item()


@pytest.mark.parametrize("case", ["causal", "padding", "scale", "decode", "thd"])
def test_sdpa_matches_reference_tp2(run_distributed, case):
    diffs = run_distributed(_check_against_reference, 2, 4, 4, case, world_size=2)
    assert max(diffs) <= TOL, diffs


@pytest.mark.parametrize("groups", [4, 8])
def test_sdpa_gqa_matches_reference_tp4(run_distributed, groups):
    diffs = run_distributed(_check_against_reference, 4, 8, groups, "causal", world_size=4)
    assert max(diffs) <= TOL, diffs


def _dropout_streams(tp):
    """Dropout draws from the TP rank's RNG stream: reproducible, and different per TP rank."""
    import mcore_ext
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               tensor_model_parallel_size=tp, attention_dropout=0.5)
    attn = mcore_ext.SDPAttention(config, 1, AttnMaskType.causal, "self").train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 1, 2 // tp, 8, generator=g) for _ in range(3))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    first = attn(q, k, v, None)
    tracker.set_states({name: state.clone() for name, state in states.items()})
    again = attn(q, k, v, None)
    no_dropout = attn.eval()(q, k, v, None)
    return first, again, no_dropout


def test_sdpa_dropout_uses_tensor_parallel_rng_stream(run_distributed):
    (first0, again0, plain0), (first1, _, _) = run_distributed(_dropout_streams, 2, world_size=2)
    assert torch.equal(first0, again0)  # replaying the stream replays the mask
    assert not torch.allclose(first0, plain0)  # dropout is active in training
    assert not torch.equal(first0, first1)  # TP ranks draw different masks from equal inputs
