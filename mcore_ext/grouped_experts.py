"""Routed experts as one grouped GEMM per linear layer, without Transformer Engine.

``GroupedGemmSequentialMLP`` is megatron's ``SequentialMLP``: the same local experts (each an
``MLP`` with its own config, clamp and parameters), the same checkpoint keys and EP / expert-TP
sharding, the same activation arithmetic. Only its forward differs: instead of one fc1 and one
fc2 GEMM per expert (288 small GEMMs each way for Step-3.5-Flash, and as many in backward), the
local experts' weights are stacked (a copy of ``E_local x 3 f h`` elements, next to the
``2 x tokens x k x 3 f h`` FLOPs, made again in backward rather than kept) and fc1 and fc2 each
run as one ``torch._grouped_mm`` over the tokens sorted by expert. Expert linears do no TP communication of their own (the dispatcher
does it), so nothing else changes. Gradients reach every expert's own parameter through the
stack.

The specs use it on the ``sdpa`` and ``local`` backends when ``moe_grouped_gemm`` is set (the
``te`` backend keeps megatron's ``TEGroupedMLP``). Where torch's grouped GEMM does not run (its
device / dtype, probed once), or for what the loop handles and this does not (expert biases, FP8
/ FP4 padding, probabilities applied on the input, delayed weight gradients, a fused activation,
a forward hook on an expert linear: LoRA's expert adapters), the forward is ``SequentialMLP``'s
loop.

Shapes: N routed tokens sorted by local expert, h hidden, f the expert width on this expert-TP
rank, E the local experts.
"""

import functools

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (torch >= 2.8; on a CPU in
    2.13 for fp32 and bf16; on CUDA for bf16 on recent GPUs)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 16, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(4, 16, device=device_type,
                                                               dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class GroupedGemmSequentialMLP(SequentialMLP):
    """megatron's SequentialMLP whose experts run as one grouped GEMM per linear layer."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states  # [N, h], sorted by local expert
        if not self._groupable(x):
            self.last_forward_grouped = False
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        self.last_forward_grouped = True
        offsets = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        experts = self.local_experts
        fc1 = [e.linear_fc1.weight for e in experts]  # [2f, h] each
        fc2 = [e.linear_fc2.weight for e in experts]  # [h, f] each
        intermediate = _GroupedLinear.apply(x, offsets, *fc1)  # [N, 2f]
        intermediate = _activation(experts[0], intermediate)  # every expert's is the same
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return _GroupedLinear.apply(intermediate, offsets, *fc2), None  # [N, h]

    def _groupable(self, x) -> bool:
        config, expert = self.config, self.local_experts[0]
        return (
            self.num_local_experts > 1
            and not config.add_bias_linear
            and not (config.fp8 or config.fp4)
            and not config.moe_apply_probs_on_input
            and not getattr(config, "delay_wgrad_compute", False)
            and (expert.config.use_te_activation_func or not expert.config.bias_activation_fusion)
            and not any(e.linear_fc1._forward_hooks or e.linear_fc2._forward_hooks
                        for e in self.local_experts)
            and grouped_mm_runs(x.device.type, x.dtype)
        )


class _GroupedLinear(torch.autograd.Function):
    """x [N, in] (rows sorted by group) -> [N, out], group g's rows times weight g [out, in]^T.

    The weights are stacked for the grouped GEMM and the stack dropped at once: backward stacks
    them again rather than keeping a copy of every expert's weights per layer until then (at
    Step-3.5-Flash's size and EP 8, 1.1 GB a layer). The weight gradients come out of one
    grouped GEMM as one [E, out, in] tensor, handed to the experts as its slices.
    """

    @staticmethod
    def forward(ctx, x, offsets, *weights):
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)
        grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)  # [E, out, in]
        return (grad_x, None, *grad_w.unbind(0))


def _activation(expert, x):
    """``MLP.forward``'s activation of ``expert`` (not fused) on fc1's output [N, 2f] (no bias)."""
    config = expert.config
    if config.use_te_activation_func:  # e.g. HF's clamped SwiGLU (swiglu_clamp.clamp_swiglu_mlp)
        return expert.activation_func(x)
    if not config.gated_linear_unit:
        return expert.activation_func(x)
    gate, linear = torch.chunk(x, 2, dim=-1)
    if (limit := config.activation_func_clamp_value) is not None:
        gate = gate.clamp(min=None, max=limit)
        linear = linear.clamp(min=-limit, max=limit)
    return config.activation_func(gate) * (linear + config.glu_linear_offset)


__all__ = ["GroupedGemmSequentialMLP", "grouped_mm_runs"]
