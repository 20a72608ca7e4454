"""Sliding-window layers that cost their window, not the sequence (issue 25), on CPU.

- The banded sdpa kernel (``attention/sliding.py``) equals the formula forward and backward (fp32
  within 1e-5; bf16 within bf16 rounding of the fp32 formula): windows smaller than, equal to and
  larger than a block, sequence tails, queries behind a key prefix (KV-cache decoding, CP chunks),
  a window longer than the sequence, GQA and MHA; packed documents shorter and longer than the
  window through ``SDPAttention``.
- Its cost: SDPA computes at most ``3B`` scores per query (B = the window rounded up to 8) and
  never sees a mask larger than ``[B, 2B]``; a dense mask computes ``s`` per query.
- Under CP (real gloo ranks), a causal window moves only its halo: CP 2 and CP 4, windows smaller
  than, equal to and larger than a chunk and larger than the sequence, packed documents shorter
  and longer than the window, against the formula; the elements moved are counted and equal the
  halo's, whatever the sequence length; dK / dV of a row used by several ranks are summed in fp32.

Reference: ``tests.reference.attention`` (softmax(QK^T) V written out, GQA by repeating K/V) under
the mask ``0 <= pos_q - pos_k <= left`` (megatron's window (left, 0), HF's sliding_window left + 1).
"""

import pytest
import torch

from tests import reference

TOL = 1e-5
U = reference.BF16_UNIT_ROUNDOFF


def _window_allowed(q_pos, k_pos, left, q_doc=None, k_doc=None):
    """[sq, sk] True where the query may attend the key: causal, at most ``left`` back."""
    diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    ok = (diff >= 0) & (diff <= left)
    if q_doc is not None:
        ok &= q_doc.unsqueeze(1) == k_doc.unsqueeze(0)
    return ok


def _qkv(s_q, s_k, b, n, g, hn, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, b, n, hn, generator=gen)
    k, v = (torch.randn(s_k, b, g, hn, generator=gen) for _ in range(2))
    return [x.to(dtype) for x in (q, k, v)]


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------ the banded kernel alone

BAND_CASES = {  # name: (sq, sk, left, heads, groups)
    "window_below_block_tail": (37, 37, 4, 4, 2),  # B = 8; 37 is not a multiple of it
    "window_equals_block": (64, 64, 8, 4, 4),
    "window_above_block": (70, 70, 9, 4, 1),  # B = 16, 9 keys back reach into block j - 1
    "kv_cache_decode": (1, 100, 16, 4, 2),
    "queries_behind_a_long_prefix": (20, 120, 3, 2, 2),
    "prefix_shorter_than_a_block": (33, 38, 9, 4, 2),
    "window_longer_than_the_sequence": (40, 40, 60, 4, 2),  # dense: the band saves nothing
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(BAND_CASES))
def test_banded_window_matches_the_formula(case, dtype):
    from mcore_ext.attention import layout, sliding

    sq, sk, left, n, g = BAND_CASES[case]
    q, k, v = _qkv(sq, sk, 2, n, g, 8, seed=1, dtype=dtype)
    upstream = torch.randn(sq, 2, n * 8, generator=torch.Generator().manual_seed(2))
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    # [s, b, n, hn] -> [b, n, s, hn], as SDPAttention hands them over
    out = sliding.window_attention(*(x.permute(1, 2, 0, 3) for x in xs), left, None, 0.0,
                                   layout.AttentionLayout())
    out = out.permute(2, 0, 1, 3).reshape(sq, 2, -1)
    (out.float() * upstream).sum().backward()

    refs = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    allowed = _window_allowed(torch.arange(sk - sq, sk), torch.arange(sk), left)
    ref = reference.attention(*refs, allowed)
    (ref * upstream).sum().backward()

    if dtype is torch.float32:
        out_bound, grad_bound = TOL, TOL
    else:  # one attention: a handful of bf16 roundings per output (u = 2^-8 each)
        out_bound = 4 * U * ref.abs().max().item()
        grad_bound = 8 * U * max(r.grad.abs().max().item() for r in refs)
    assert _max_diff(out, ref) <= out_bound, (case, _max_diff(out, ref), out_bound)
    for x, r in zip(xs, refs):
        assert _max_diff(x.grad, r.grad) <= grad_bound, (case, _max_diff(x.grad, r.grad))


def _mean_relative_error(x, ref):
    return ((x.double() - ref).abs().mean() / ref.abs().mean()).item()


def test_banded_bf16_gradients_stay_within_a_quarter_of_the_dense_kernels_error():
    """Issue 32 item 7: a key row's dK / dV on the banded path come from two block pairs (and
    block 0's call of its own), each rounded to bf16 by its SDPA call and added by autograd in
    bf16 (sliding.py says so; fp32 blocks would cost a GPU its flash kernel). Measured 12-14 %
    further from the fp64 formula than one dense bf16 SDPA call; over 4 seeds each gradient's
    mean relative error against fp64 (the formula on the same bf16 inputs) must stay within
    1.25 x the dense bf16 kernel's under a [s, s] window mask."""
    import torch.nn.functional as F

    from mcore_ext.attention import layout, sliding

    s, left, b, n, g, hn = 512, 15, 2, 4, 2, 16
    allowed = _window_allowed(torch.arange(s), torch.arange(s), left)
    mask = torch.zeros(s, s, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
    errors = {"banded": [0.0] * 3, "dense": [0.0] * 3}
    for seed in range(4):
        q, k, v = _qkv(s, s, b, n, g, hn, seed=20 + seed, dtype=torch.bfloat16)
        upstream = torch.randn(s, b, n * hn, generator=torch.Generator().manual_seed(seed))
        upstream = upstream.bfloat16()
        refs = [x.double().requires_grad_(True) for x in (q, k, v)]
        (reference.attention(*refs, allowed) * upstream.double()).sum().backward()
        for name in errors:
            xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
            bnsd = [x.permute(1, 2, 0, 3) for x in xs]
            if name == "banded":
                out = sliding.window_attention(*bnsd, left, None, 0.0, layout.AttentionLayout())
            else:
                out = F.scaled_dot_product_attention(*bnsd, attn_mask=mask, enable_gqa=True)
            assert out.dtype is torch.bfloat16
            (out.permute(2, 0, 1, 3).reshape(s, b, -1) * upstream).sum().backward()
            for i, (x, r) in enumerate(zip(xs, refs)):
                assert x.grad.dtype is torch.bfloat16
                errors[name][i] += _mean_relative_error(x.grad, r.grad)
    for name, banded, dense in zip(("dq", "dk", "dv"), errors["banded"], errors["dense"]):
        assert banded <= 1.25 * dense, (name, banded / 4, dense / 4)


# ------------------------------------------------- through SDPAttention: cost and documents


class _CountScores:
    """Counts the scores (query x key pairs, per batch and head) and the mask elements of every
    SDPA call in the process."""

    def __init__(self):
        self.scores, self.largest_mask = 0, 0

    def __enter__(self):
        import torch.nn.functional as F

        self.real = F.scaled_dot_product_attention

        def counted(q, k, v, attn_mask=None, **kwargs):
            self.scores += q.numel() // q.size(-1) * k.size(-2)
            if attn_mask is not None:
                self.largest_mask = max(self.largest_mask, attn_mask.numel())
            return self.real(q, k, v, attn_mask=attn_mask, **kwargs)

        F.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self.real


def _core_attention(window_tokens, heads=4, groups=2, hn=8):
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_ext.attention.sdpa import SDPAttention
    from tests import builders

    config = builders.gated_config(head_wise_attn_gate=False, num_attention_heads=heads,
                                   num_query_groups=groups, kv_channels=hn,
                                   hidden_size=heads * hn, window_size=(window_tokens - 1, 0))
    return SDPAttention(config, 1, AttnMaskType.causal, "self")


def _sdpattention_cost_and_documents():
    import mcore_ext
    from mcore_ext.attention import layout
    from megatron.core.packed_seq_params import PackedSeqParams

    mcore_ext.init_parallel()
    results = {}
    # One sequence of 512 tokens, window 16 (B = 16), micro-batch 2.
    attention = _core_attention(16)
    s = 512
    q, k, v = _qkv(s, s, 2, 4, 2, 8, seed=3)
    layout.begin_batch()
    with _CountScores() as count:
        out = attention(q, k, v, None)
    ref = reference.attention(q, k, v, _window_allowed(torch.arange(s), torch.arange(s), 15))
    results["sbhd"] = dict(output=_max_diff(out, ref), scores_per_query=count.scores / (2 * 4 * s),
                           largest_mask=count.largest_mask, block=16)

    # Packed: documents of 5 (shorter than the window), 300 (longer) and 37 tokens, padded.
    lengths, padded = [5, 300, 37], [8, 304, 40]
    cu = torch.tensor([0, 5, 305, 342], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 312, 352], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=300, max_seqlen_kv=300)
    t = int(cu_padded[-1])
    q, k, v = (x[:, 0] for x in _qkv(t, t, 1, 4, 2, 8, seed=4))
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    layout.begin_batch(params)
    with _CountScores() as count:
        out = attention(*xs, None, packed_seq_params=params)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * upstream).sum().backward()
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(padded))
    position = torch.cat([torch.arange(n) for n in padded])
    real = position < torch.tensor(lengths)[doc]
    refs = [x.detach()[real].unsqueeze(1).requires_grad_(True) for x in (q, k, v)]
    allowed = _window_allowed(position[real], position[real], 15, doc[real], doc[real])
    ref = reference.attention(*refs, allowed)
    (ref * upstream[real].unsqueeze(1)).sum().backward()
    results["thd"] = dict(
        output=_max_diff(out[real], ref[:, 0]), padding=out[~real].abs().max().item(),
        grads=max(_max_diff(x.grad[real], r.grad[:, 0]) for x, r in zip(xs, refs)),
        scores_per_query=count.scores / (4 * sum(lengths)),
    )
    mcore_ext.destroy_parallel()
    return results


def test_sliding_layers_cost_their_window_and_respect_documents(run_distributed):
    (r,) = run_distributed(_sdpattention_cost_and_documents, world_size=1)
    sbhd, thd = r["sbhd"], r["thd"]
    assert sbhd["output"] <= TOL and thd["output"] <= TOL and thd["grads"] <= TOL, r
    assert thd["padding"] == 0.0, r
    # 2B keys per query in the batched call (plus block 0's shorter call); old code: a dense
    # [512, 512] mask, 512 scores per query.
    assert sbhd["scores_per_query"] <= 2 * sbhd["block"] + 1, r
    assert sbhd["largest_mask"] <= 2 * sbhd["block"] ** 2, r
    # The 300-token document is banded; the short ones are dense and tiny. Old code: 300 x 300.
    assert thd["scores_per_query"] <= 40, r


# --------------------------------------------------------------- under context parallelism


class _CountMoved:
    """Elements received by this rank through torch.distributed's point-to-point ops and
    all-gathers (the real collectives still run)."""

    def __init__(self):
        self.elements = 0

    def __enter__(self):
        import torch.distributed as dist

        self.real = dist.batch_isend_irecv, dist.all_gather_into_tensor
        counter = self

        def batch_isend_irecv(ops):
            counter.elements += sum(op.tensor.numel() for op in ops if op.op is dist.irecv)
            return counter.real[0](ops)

        def all_gather_into_tensor(out, x, *args, **kwargs):
            counter.elements += out.numel() - x.numel()
            return counter.real[1](out, x, *args, **kwargs)

        dist.batch_isend_irecv, dist.all_gather_into_tensor = (batch_isend_irecv,
                                                               all_gather_into_tensor)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.batch_isend_irecv, dist.all_gather_into_tensor = self.real


def _expected_halo_rows(s, cp, rank, left):
    """Keys this rank receives: those of its chunks' windows that other ranks hold."""
    c = s // (2 * cp)
    owners = [i if i < cp else 2 * cp - 1 - i for i in range(2 * cp)]
    rows = 0
    for chunk in (rank, 2 * cp - 1 - rank):
        for p in range(max(0, chunk * c - left), chunk * c):
            rows += owners[p // c] != rank
    return rows


CP_CASES = {  # name: (sequence, HF window = left + 1); chunks are s / (2 CP) tokens
    "window_below_chunk": (32, 3),
    "window_equals_chunk": (32, None),  # left = chunk
    "window_above_chunk": (32, 11),
    "window_above_sequence": (32, 40),
    "longer_sequence": (64, 3),  # same window, twice the sequence: the same halo
}


def _cp_core_attention_vs_formula(names, dtype_name):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel, layout

    dtype = getattr(torch, dtype_name)
    cp = dist.get_world_size()
    mcore_ext.init_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    results = {}
    for name in names:
        s, window = CP_CASES[name]
        left = s // (2 * cp) if window is None else window - 1
        b, n, g, hn = 2, 8, 2, 8  # GQA
        q, k, v = _qkv(s, s, b, n, g, hn, seed=6, dtype=dtype)
        upstream = torch.randn(s, b, n * hn, generator=torch.Generator().manual_seed(7))
        split = context_parallel.zigzag_positions(s // cp, cp, group.rank())
        xs = [x[split].clone().requires_grad_(True) for x in (q, k, v)]
        layout.begin_batch()
        with _CountMoved() as moved:
            out = context_parallel.attention(*xs, group=group, causal=True, scale=None,
                                             dropout_p=0.0, window=(left, 0))
            (out.float() * upstream[split]).sum().backward()
        refs = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
        ref = reference.attention(*refs, _window_allowed(torch.arange(s), torch.arange(s), left))
        (ref * upstream).sum().backward()
        halo_rows = _expected_halo_rows(s, cp, group.rank(), left)
        results[name] = dict(
            output=_max_diff(out, ref[split]),
            grads=max(_max_diff(x.grad, r.grad[split]) for x, r in zip(xs, refs)),
            out_scale=ref.abs().max().item(),
            grad_scale=max(r.grad.abs().max().item() for r in refs),
            moved=moved.elements,
            # K and V rows, forward and their gradients back
            halo_elements=2 * 2 * halo_rows * b * g * hn, left=left, s=s,
            gathered_elements=2 * 2 * (cp - 1) * (s // cp) * b * g * hn,
        )
    dist.barrier()
    mcore_ext.destroy_parallel()
    return results


def _check_cp(rank_results, dtype_name):
    for r in rank_results:
        for name, x in r.items():
            if dtype_name == "float32":
                assert x["output"] <= TOL and x["grads"] <= TOL, (name, x)
            else:  # bf16 inputs against the fp32 formula, bounds as without CP
                assert x["output"] <= 4 * U * x["out_scale"], (name, x)
                assert x["grads"] <= 8 * U * x["grad_scale"], (name, x)
            if x["left"] >= x["s"] - 1:  # the window is the whole causal prefix: all-gathered
                assert x["moved"] == x["gathered_elements"], (name, x)
            else:  # old code all-gathered every sliding layer's K/V
                assert x["moved"] == x["halo_elements"], (name, x)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_cp2_sliding_layer_moves_its_halo_and_matches_the_formula(run_distributed, dtype_name):
    names = list(CP_CASES)
    results = run_distributed(_cp_core_attention_vs_formula, names, dtype_name, world_size=2)
    _check_cp(results, dtype_name)
    # Doubling the sequence moves the same halo.
    for r in results:
        assert r["longer_sequence"]["moved"] == r["window_below_chunk"]["moved"], r


def test_cp4_sliding_layer_moves_its_halo_and_matches_the_formula(run_distributed):
    names = ["window_below_chunk", "window_equals_chunk", "window_above_chunk",
             "window_above_sequence"]
    _check_cp(run_distributed(_cp_core_attention_vs_formula, names, "float32", world_size=4),
              "float32")


# ------------------------------------------------------------- packed documents under CP

PACKED_DOCS = [5, 27, 11, 3]  # real lengths; padded to multiples of 2 x CP


def _packed_cp_vs_formula(window):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    import mcore_ext
    from mcore_ext.attention import context_parallel, layout

    cp = dist.get_world_size()
    mcore_ext.init_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    padded = [-(-n // (2 * cp)) * 2 * cp for n in PACKED_DOCS]
    cu = torch.tensor([0] + PACKED_DOCS, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=max(PACKED_DOCS), max_seqlen_kv=max(PACKED_DOCS))
    t = int(cu_padded[-1])
    q, k, v = (x[:, 0] for x in _qkv(t, t, 1, 4, 2, 8, seed=8))
    upstream = torch.randn(t, 32, generator=torch.Generator().manual_seed(9))

    def local(x):
        return context_parallel.get_packed_batch_on_this_cp_rank(x, cu_padded, group)

    xs = [local(x).clone().requires_grad_(True) for x in (q, k, v)]
    layout.begin_batch(params)
    with _CountMoved() as moved:
        out = context_parallel.packed_attention(
            *xs, params, group=group, causal=True, scale=None, dropout_p=0.0,
            window=(window - 1, 0))
        (out * local(upstream)).sum().backward()

    doc = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    position = torch.cat([torch.arange(n) for n in padded])
    real = position < torch.tensor(PACKED_DOCS)[doc]
    refs = [x.detach()[real].unsqueeze(1).requires_grad_(True) for x in (q, k, v)]
    ref = reference.attention(*refs, _window_allowed(position[real], position[real], window - 1,
                                                     doc[real], doc[real]))
    (ref * upstream[real].unsqueeze(1)).sum().backward()

    def full(x):  # real rows -> [t, ...] with zero padding rows, then this rank's rows
        y = x.new_zeros(t, *x.shape[1:])
        y[real] = x
        return local(y)

    local_real = local(real)
    dist.barrier()
    mcore_ext.destroy_parallel()
    return dict(
        output=_max_diff(out[local_real], full(ref[:, 0])[local_real]),
        padding=out[~local_real].abs().max().item() if (~local_real).any() else 0.0,
        grads=max(_max_diff(x.grad[local_real], full(r.grad[:, 0])[local_real])
                  for x, r in zip(xs, refs)),
        moved=moved.elements, all_gather=2 * 2 * (cp - 1) * (t // cp) * 2 * 8,
    )


@pytest.mark.parametrize("window", [3, 9], ids=["window3", "window9"])
def test_packed_documents_under_cp2_keep_their_windows(run_distributed, window):
    """Documents of 5, 27, 11 and 3 tokens: shorter and longer than the window; chunks of 2 to
    7 tokens, so windows 9 reach back over more than one chunk."""
    for r in run_distributed(_packed_cp_vs_formula, window, world_size=2):
        assert r["output"] <= TOL and r["grads"] <= TOL and r["padding"] == 0.0, r
        assert 0 < r["moved"] < r["all_gather"], r


# ------------------------------------------------------------- dK / dV summed in fp32


def _halo_gradients_in_fp32():
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import halo

    mcore_ext.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    # Chunks of 2 tokens, window left 3: chunk 0's last token (rank 0) is in its own segment
    # and in the halos of chunks 1 and 2 (rank 1).
    plan = halo.plan([2], 2, group.rank(), 3)
    k = torch.zeros(4, 1, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(4, 1, dtype=torch.bfloat16, requires_grad=True)
    k_ext, v_ext = halo.halo_kv(k, v, plan, group)
    # Own rows get 1, halo rows 2^-8: the fp32 sum 1 + 2 x 2^-8 is a bf16 number; added in
    # bf16 one at a time each 2^-8 is a tie that rounds back to 1.
    grad = torch.ones_like(k_ext)
    for segment in plan.segments:
        grad[segment.ext_start:segment.ext_start + segment.halo] = 2.0 ** -8
    (k_ext.float() * grad.float()).sum().backward()
    dist.barrier()
    mcore_ext.destroy_parallel()
    return k.grad.float().flatten().tolist()


def test_halo_dkdv_are_summed_in_fp32(run_distributed):
    rank0, rank1 = run_distributed(_halo_gradients_in_fp32, world_size=2)
    # Rank 0 holds chunks 0 and 3 (rows 0-1 and 2-3). Token 1 is in the halos of chunk 1
    # (tokens 0-1) and chunk 2 (tokens 1-3): 1 + 2 x 2^-8 (bf16-summed: 1). Token 0 is in one
    # halo: 1 + 2^-8 is a tie, rounded to 1 either way.
    assert rank0[:2] == [1.0, 1.0 + 2.0 ** -7], rank0
    # Rank 1 holds chunks 1 and 2: token 3 is in chunk 2's halo (on rank 1 itself) and in chunk
    # 3's (rank 0): a local and a returned gradient, summed in fp32 too.
    assert rank1 == [1.0, 1.0 + 2.0 ** -7, 1.0, 1.0], rank1


# ------------------------------------------------------- what a sliding layer saves under CP

# Issue 32 item 6: Step-3.5-Flash at TP 8, micro-batch 1, has one KV group per rank; CP 2 chunks of
# 256 tokens and a halo of 30 keys (left 30 < B = 32) send both local chunks' block 0 to a call of
# its own.
SAVED_SEQ, SAVED_LEFT, SAVED_HEADS, SAVED_HN = 1024, 30, 2, 8


def _saved_by_a_sliding_layer_under_cp(batch, groups):
    """Every tensor the CP halo path saves for backward (``saved_tensors_hooks``), as storages:
    how many view the extended K/V that ``halo.halo_kv`` returned, and the bytes of all the
    distinct storages but the batch's shared masks (the plan counts those once per batch)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import mcore_ext
    from mcore_ext.attention import context_parallel, halo, layout

    mcore_ext.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    s = SAVED_SEQ // 2
    q, k, v = (x.requires_grad_(True) for x in _qkv(s, s, batch, SAVED_HEADS, groups, SAVED_HN,
                                                      seed=10, dtype=torch.bfloat16))
    extended, saved = [], []
    real_halo_kv = halo.halo_kv

    def halo_kv(*args):  # the real exchange; its outputs are remembered
        extended.extend(real_halo_kv(*args))
        return extended[-2:]

    batch_layout = layout.AttentionLayout()
    halo.halo_kv = halo_kv
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = context_parallel.attention(q, k, v, group=group, causal=True, scale=None,
                                             dropout_p=0.0, window=(SAVED_LEFT, 0),
                                             layout=batch_layout)
    finally:
        halo.halo_kv = real_halo_kv
    out.float().sum().backward()  # what was saved serves the backward

    def storage(t):
        return t.untyped_storage().data_ptr()

    masks = {storage(t) for t in batch_layout._cache.values() if isinstance(t, torch.Tensor)}
    extended_storages = {storage(t) for t in extended}
    distinct = {storage(t): t.untyped_storage().nbytes() for t in saved
                if storage(t) not in masks}
    dist.barrier()
    mcore_ext.destroy_parallel()
    return dict(views_of_extended=sum(storage(t) in extended_storages for t in saved),
                saved_bytes=sum(distinct.values()),
                extended_bytes=sum(t.untyped_storage().nbytes() for t in extended))


def _planned_sliding_attention_bytes(batch, groups):
    """The plan's core-attention terms of such a layer on a CP rank."""
    from mcore_ext.plan import activations
    from mcore_ext.plan.shape import LayerShape, ModelShape

    layer = LayerShape(index=0, sliding=True, heads=SAVED_HEADS, groups=groups,
                       head_dim=SAVED_HN, window=SAVED_LEFT + 1, gate=False, qk_norm=False,
                       moe=False, ffn=0)
    shape = ModelShape(hidden=SAVED_HEADS * SAVED_HN, vocab=128, num_layers=1, layers=(layer,))
    terms = activations.attention_bytes(
        shape, layer, activations.Layout(cp=2),
        activations.Workload(seq=SAVED_SEQ, micro_batch=batch)).terms
    return terms["sliding blocks"] + terms["log-sum-exp"]


@pytest.mark.parametrize("batch,groups", [(1, 1), (2, 1), (1, 2)], ids=["b1_ng1", "b2", "ng2"])
def test_sliding_layer_under_cp_saves_its_blocks_not_the_extended_kv(run_distributed, batch,
                                                                      groups):
    """No saved tensor views the whole extended K/V (one did per K and V and chunk at micro-batch
    1 with one group: a slice of it was contiguous, so ``.contiguous()`` copied nothing), and
    what is saved is the plan's "sliding blocks" and log-sum-exp within 10 %."""
    planned = _planned_sliding_attention_bytes(batch, groups)
    for rank in run_distributed(_saved_by_a_sliding_layer_under_cp, batch, groups, world_size=2):
        assert rank["views_of_extended"] == 0, rank
        assert abs(rank["saved_bytes"] / planned - 1) <= 0.10, (rank, planned)


# ------------------------------------------------------------------ flex under CP (forward)


def _flex_under_cp2():
    """The flex kernel under CP 2 against the formula, forward only (a CPU has no flex
    backward): causal chunks (all-gathered keys), a sliding window (halo) and packed documents
    (block masks from the tokens' positions and documents)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    import mcore_ext
    from mcore_ext.attention import context_parallel, layout

    mcore_ext.init_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    diffs = {}
    s = 32
    q, k, v = _qkv(s, s, 2, 4, 2, 8, seed=10)
    split = context_parallel.zigzag_positions(s // 2, 2, group.rank())
    for name, left in (("causal", None), ("window5", 4)):
        layout.begin_batch()
        with torch.no_grad():
            out = context_parallel.attention(
                q[split], k[split], v[split], group=group, causal=True, scale=None,
                dropout_p=0.0, window=None if left is None else (left, 0), kernel="flex")
        ref = reference.attention(q, k, v, _window_allowed(torch.arange(s), torch.arange(s),
                                                           s if left is None else left))
        diffs[name] = _max_diff(out, ref[split])

    lengths, padded = [5, 19], [8, 24]
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 32], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=19, max_seqlen_kv=19)
    q, k, v = (x[:, 0] for x in (q, k, v))
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor(padded))
    position = torch.cat([torch.arange(n) for n in padded])
    real = position < torch.tensor(lengths)[doc]

    def local(x):
        return context_parallel.get_packed_batch_on_this_cp_rank(x, cu_padded, group)

    for name, left in (("packed_causal", None), ("packed_window5", 4)):
        layout.begin_batch(params)
        with torch.no_grad():
            out = context_parallel.packed_attention(
                local(q), local(k), local(v), params, group=group, causal=True, scale=None,
                dropout_p=0.0, window=None if left is None else (left, 0), kernel="flex")
        allowed = _window_allowed(position[real], position[real], s if left is None else left,
                                  doc[real], doc[real])
        ref = q.new_zeros(s, 1, 32)
        ref[real] = reference.attention(*(x[real].unsqueeze(1) for x in (q, k, v)), allowed)
        diffs[name] = _max_diff(out, local(ref[:, 0]))
    dist.barrier()
    mcore_ext.destroy_parallel()
    return diffs


def test_flex_kernel_under_cp2_matches_the_formula(run_distributed):
    for diffs in run_distributed(_flex_under_cp2, world_size=2):
        assert len(diffs) == 4 and max(diffs.values()) <= TOL, diffs
