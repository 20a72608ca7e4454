"""torch LayerNorm / RMSNorm usable with sequence parallelism (sdpa, and local without Apex).

megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` although a per-token norm is exact
on a sequence shard; what SP needs is that the norm's weight gradients are summed over the TP
group, which megatron's ``finalize_model_grads`` does for parameters marked ``sequence_parallel``.

With megatron's ``layernorm_zero_centered_gamma`` the scale is ``1 + weight`` and the weight starts
at 0 (Gemma / Step-3.5 RMSNorm: normalized in fp32, ``norm(x) * (1 + w)``, cast back to x's dtype).
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm computing ``x / rms(x) * (1 + weight)`` in fp32; the weight starts at 0."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm computing ``(x - mean) / std * (1 + weight) + bias`` in fp32; the weight starts
    at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(
            x.float(), self.normalized_shape, 1.0 + self.weight.float(), self.bias.float(), self.eps
        )
        return y.to(x.dtype)


_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
_ZERO_CENTERED_NORMS = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


class TorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` from ``config.normalization``
    (their zero-centered forms with ``config.layernorm_zero_centered_gamma``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization not in _NORMS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by TorchNorm (the sdpa "
                "backend, and local without Apex); "
                f"choose one of {sorted(_NORMS)}"
            )
        norms = _ZERO_CENTERED_NORMS if config.layernorm_zero_centered_gamma else _NORMS
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
