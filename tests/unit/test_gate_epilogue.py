"""The gate's own kernels and its backward recompute, tested on their own (single process).

- ``_SplitQKVGate``: linear_qkv's output -> q, k, v, gate logits, and one gradient buffer back.
  Compared with torch.split, forward and backward.

- ``_ScaleHeads``: attn * sigmoid(logits) per head with upstream megatron's arithmetic (fp32
  sigmoid rounded to attn's dtype, product in attn's dtype). Compared bit for bit with upstream
  dev's formula written out, and with the formula in fp64; gradients with torch autograd on the
  formula in fp64.
- The recompute hooks: only a tensor that is the whole gated output (its storage from offset 0,
  contiguous, same dtype and size) is packed as a recipe, and unpacking rebuilds it bit for bit.
"""

import pytest
import torch

from mcore_ext.attention import gated
from tests import reference

# [sq, b, np, hn]
SHAPE = (6, 2, 4, 8)


def _inputs(dtype, logit_scale=3.0):
    g = torch.Generator().manual_seed(0)
    attn = torch.randn(SHAPE, generator=g).to(dtype)
    logits = (torch.randn(SHAPE[:-1], generator=g) * logit_scale).to(dtype)
    return attn, logits


def _gate(attn, logits):
    """The module's epilogue: fp32 sigmoid, then the fused product."""
    return gated._ScaleHeads.apply(attn, torch.sigmoid(logits.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_upstream_devs_arithmetic(dtype):
    attn, logits = _inputs(dtype)
    out = _gate(attn, logits)
    assert out.dtype == dtype
    # Upstream dev's native gate (megatron/core/transformer/attention.py, head_wise_gate):
    #   core_attn_out * torch.sigmoid(gate.float()).to(core_attn_out.dtype)
    upstream = attn * torch.sigmoid(logits.float()).to(dtype).unsqueeze(-1)
    assert torch.equal(out, upstream)
    # Against the exact value: the scale and the product are each rounded once, so the relative
    # error is at most 2 u + u^2 (u = 2^-8 for bf16's 8 significant bits, 2^-24 for fp32).
    exact = attn.double() * torch.sigmoid(logits.double()).unsqueeze(-1)
    u = reference.BF16_UNIT_ROUNDOFF if dtype is torch.bfloat16 else 2.0**-24
    assert ((out.double() - exact).abs() <= (2 * u + u * u) * exact.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_autograd_on_the_formula(dtype):
    attn, logits = _inputs(dtype)
    attn.requires_grad_(True), logits.requires_grad_(True)
    upstream = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(dtype)
    (_gate(attn, logits) * upstream).sum().backward()

    ref_attn = attn.detach().double().requires_grad_(True)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = ref_attn * torch.sigmoid(ref_logits).unsqueeze(-1)
    (ref * upstream.double()).sum().backward()
    # fp32: a few roundings of O(1) values. bf16: the gradients are stored in bf16 (u = 2^-8),
    # the per-head dot product over hn = 8 is rounded once more: 4 u relative to the largest.
    rel = 1e-6 if dtype is torch.float32 else 4 * reference.BF16_UNIT_ROUNDOFF
    for ours, theirs in ((attn.grad, ref_attn.grad), (logits.grad, ref_logits.grad)):
        assert ours.dtype == dtype
        assert (ours.double() - theirs).abs().max().item() <= rel * theirs.abs().max().item()


@pytest.mark.parametrize("copy_qkv", [False, True])
def test_split_matches_torch_split_forward_and_backward(copy_qkv):
    """2 query groups of 2 heads, hn 8, 4 gate columns. q, k, v are views of the fused output, or
    of one copy of its QKV columns; the gate logits are a contiguous tensor of their own. A part
    that gets no gradient (key, unused here) has zeros in the gradient buffer."""
    groups, sizes, gate_columns = 2, (16, 8, 8), 4
    g = torch.Generator().manual_seed(3)
    mixed = torch.randn(5, 2, groups * sum(sizes) + gate_columns, generator=g, dtype=torch.float64,
                        requires_grad=True)
    ours = gated._SplitQKVGate.apply(mixed, groups, sizes, copy_qkv)
    qkv, gate = mixed.split([groups * sum(sizes), gate_columns], dim=-1)
    reference = (*qkv.reshape(5, 2, groups, -1).split(sizes, dim=-1), gate)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and torch.equal(a, b)
    shares_storage = [t.untyped_storage().data_ptr() == mixed.untyped_storage().data_ptr()
                      for t in ours]
    assert shares_storage == [not copy_qkv] * 3 + [False] and ours[-1].is_contiguous()

    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ours]
    loss = lambda parts: sum((p * w).sum() for i, (p, w) in enumerate(zip(parts, weights))
                             if i != 1)
    (grad,) = torch.autograd.grad(loss(ours), mixed)
    (expected,) = torch.autograd.grad(loss(reference), mixed)
    assert torch.equal(grad, expected)
    key_columns = grad[..., : groups * sum(sizes)].unflatten(-1, (groups, -1))[..., 16:24]
    assert key_columns.abs().sum() == 0 and grad.abs().sum() > 0


@pytest.mark.parametrize("one_cat", [False, True])
def test_joined_gradient_is_the_split_gradient_in_linear_qkvs_column_order(one_cat):
    """Both joins (a GPU's one cat of every group's parts, a CPU's two cats) give the gradient
    torch.split's autograd gives, bit for bit: 3 groups of 2 query heads (GQA), hn 4, a part
    without gradient (zeros expanded from a scalar, as the backward passes it)."""
    groups, sizes, gate_columns = 3, (8, 4, 4), 6
    g = torch.Generator().manual_seed(4)
    mixed = torch.randn(3, 2, groups * sum(sizes) + gate_columns, generator=g,
                        dtype=torch.float64, requires_grad=True)
    qkv, gate = mixed.split([groups * sum(sizes), gate_columns], dim=-1)
    parts = (*qkv.reshape(3, 2, groups, -1).split(sizes, dim=-1), gate)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in parts]
    grads[1] = torch.zeros((), dtype=torch.float64).expand(parts[1].shape)
    (expected,) = torch.autograd.grad(parts, mixed, grads)
    joined = gated._join_gradients(grads[:3], grads[3], one_cat=one_cat)
    assert joined.is_contiguous() and torch.equal(joined, expected)


def _recipe_for(out, attn, scale):
    return {out.untyped_storage().data_ptr(): gated._Recipe(attn, scale, out.dtype)}


def test_only_the_whole_gated_output_is_packed_and_it_unpacks_bit_for_bit():
    attn, logits = _inputs(torch.bfloat16)
    scale = torch.sigmoid(logits.float())
    out = gated._ScaleHeads.apply(attn, scale).flatten(-2)  # [sq, b, np * hn], as linear_proj sees
    recipes = _recipe_for(out, attn, scale)

    # The output itself, or folded to 2-D as a linear layer may save it: rebuilt exactly.
    for view in (out, out.view(-1, out.size(-1))):
        packed = gated._pack_gated(recipes, view)
        assert isinstance(packed, gated._Packed)
        rebuilt = gated._unpack_gated(packed)
        assert torch.equal(rebuilt, view) and rebuilt.stride() == view.stride()

    # Same storage, another view (offset, part, strides, dtype): kept as it is.
    for view in (out[1:], out[:, :1], out.transpose(0, 1), out.view(torch.int16)):
        assert gated._pack_gated(recipes, view) is view
    other = out.clone()
    assert gated._pack_gated(recipes, other) is other


def test_recompute_gives_the_gradients_of_keeping_the_gated_output():
    """The linear_proj stand-in saves the gated output; with the hooks it is rebuilt in backward.
    Gradients are identical to a run that keeps it (the same kernel computes both)."""
    attn, logits = _inputs(torch.bfloat16)
    weight = torch.randn(8, SHAPE[2] * SHAPE[3], generator=torch.Generator().manual_seed(2))
    weight = weight.bfloat16().requires_grad_(True)  # so the matmul saves its input

    def run(recompute):
        a, l = attn.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        recipes, packed = {}, []

        def pack(t):
            packed.append(gated._pack_gated(recipes, t))
            return packed[-1]

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, gated._unpack_gated)
        with hooks if recompute else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t
        ):
            scale = torch.sigmoid(l.float())
            out = gated._ScaleHeads.apply(a, scale).flatten(-2)
            recipes.update(_recipe_for(out, a.detach(), scale.detach()))
            y = out @ weight.T  # saves `out`
        y.float().square().sum().backward()
        return a.grad, l.grad, sum(isinstance(p, gated._Packed) for p in packed)

    kept, recomputed = run(False), run(True)
    assert recomputed[2] == 1  # `out` was saved as a recipe, and rebuilt for backward
    assert torch.equal(kept[0], recomputed[0]) and torch.equal(kept[1], recomputed[1])


@pytest.mark.gpu  # the product and the fused backward are compiled for CUDA only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled product and backward run on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_product_and_backward_on_cuda_equal_the_eager_formulas(dtype):
    """On a GPU, _ScaleHeads' product and its backward are compiled kernels: the product and
    grad_x are the eager products bit for bit, its per-head dots (fp32) the fp64 dot within fp32 rounding of a sum of hn = 128
    exact products: 1e-5 of the largest."""
    g = torch.Generator().manual_seed(5)
    shape = (64, 2, 8, 128)
    attn = torch.randn(shape, generator=g).to(dtype).cuda().requires_grad_(True)
    scale = torch.sigmoid(torch.randn(shape[:-1], generator=g) * 3).cuda().requires_grad_(True)
    upstream = torch.randn(shape, generator=g).to(dtype).cuda()
    out = gated._ScaleHeads.apply(attn, scale)
    out.backward(upstream)

    # The compiled forward product: upstream's arithmetic, as eager computes it.
    assert torch.equal(out, attn.detach() * scale.detach().to(dtype).unsqueeze(-1))

    assert torch.equal(attn.grad, gated._scale_heads(upstream, scale.detach()))
    exact = (upstream.double() * attn.detach().double()).sum(-1)
    assert scale.grad.dtype == torch.float32
    assert (scale.grad.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
