"""mcore_ext: a head-wise attention output gate (Step-3.5-Flash ``g_proj``) for megatron-core."""

import logging
import warnings

# megatron-core warns at import time about every optional accelerator library it does not find
# (Apex, Transformer Engine, absl), and torch logs that no CUDA runtime exists on a CPU machine.
# mcore_ext picks its backend explicitly (see specs.resolve_backend), so silence that noise once.
_cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
_previous_level = _cpp_extension_log.level
_cpp_extension_log.setLevel(logging.ERROR)
from mcore_ext._eager_fusions import eager_fusions  # noqa: E402

with warnings.catch_warnings(), eager_fusions():
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    warnings.filterwarnings("ignore", message=r"absl\.logging is not installed")
    # First: refuses a megatron-core that has the gate natively (it would add the rows twice).
    from mcore_ext import _mcore_compat  # noqa: F401
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.attention import HeadWiseGatedSelfAttention, SDPAttention
    from mcore_ext.config import GatedTransformerConfig
    from mcore_ext.models import build_gpt_model, build_hybrid_model
    from mcore_ext.runtime import destroy_parallel, device, init_parallel
    from mcore_ext.specs import (
        AttentionBackend,
        get_gpt_block_spec,
        get_gpt_layer_spec,
        resolve_backend,
    )
_cpp_extension_log.setLevel(_previous_level)

__all__ = [
    "AttentionBackend",
    "GatedTransformerConfig",
    "build_gpt_model",
    "build_hybrid_model",
    "HeadWiseGatedSelfAttention",
    "SDPAttention",
    "cuda_to_cpu",
    "destroy_parallel",
    "device",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "init_parallel",
    "resolve_backend",
]
