"""HF's SwiGLU clamp, ``silu(gate).clamp(max=L) * up.clamp(-L, L)``, on megatron's MLPs.

Step-3.5 clamps the SwiGLU of its dense MLPs, its shared experts and its routed experts, each
with its own limit per layer (``swiglu_limits``, ``moe_expert_swiglu_limits``). megatron's
``activation_func_clamp_value`` clamps the gate before the SiLU, a different function, so the
clamp is set here on each MLP module: dense layers through ``mcore_ext.layer_kinds``, MoE layers
through ``mcore_ext.moe``.
"""

import copy
import functools

import torch
import torch.nn.functional as F


def clamped_swiglu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2 f] (gate then up, megatron's fc1 layout) -> silu(gate).clamp(max=L) * up.clamp(-L, L)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def clamp_swiglu_mlp(mlp, limit: float, field: str = "swiglu_limits") -> None:
    """Make megatron's MLP (a dense MLP, a routed expert or a shared expert) apply
    ``clamped_swiglu`` to the whole fc1 output.

    megatron's MLP calls ``self.activation_func`` on the whole fc1 output (bias added; an expert's
    routing weights applied after it) when its config has ``use_te_activation_func``, before any
    fused path (``bias_activation_fusion``, whose SwiGLU would drop a clamp); this MLP reads a
    private copy of the config with that flag on, as HeadWiseGatedSelfAttention does for its gate,
    and every other module (other layers, other experts) keeps its own config.
    """
    config = mlp.config
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise NotImplementedError(
            f"{field}: Transformer Engine's op-fused MLP (use_transformer_engine_op_fuser=True) "
            "has no SwiGLU clamp; turn it off"
        )
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        raise ValueError(
            f"{field} clamps a SwiGLU MLP (gated_linear_unit=True, activation_func=silu), "
            f"got gated_linear_unit={config.gated_linear_unit}, "
            f"activation_func={getattr(config.activation_func, '__name__', config.activation_func)}"
        )
    mlp.config = copy.copy(config)
    mlp.config.use_te_activation_func = True
    mlp.activation_func = functools.partial(clamped_swiglu, limit=float(limit))
