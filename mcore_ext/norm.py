"""torch LayerNorm / RMSNorm usable with sequence parallelism (sdpa, and local without Apex).

megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` although a per-token norm is exact
on a sequence shard; what SP needs is that the norm's weight gradients are summed over the TP
group, which megatron's ``finalize_model_grads`` does for parameters marked ``sequence_parallel``.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` from ``config.normalization``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization not in _NORMS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by TorchNorm (the sdpa "
                "backend, and local without Apex); "
                f"choose one of {sorted(_NORMS)}"
            )
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError(
                "layernorm_zero_centered_gamma=True is not supported by TorchNorm (the sdpa "
                "backend, and local without Apex); use the 'te' backend"
            )
        norm = _NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
