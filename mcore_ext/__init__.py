"""mcore_ext: a head-wise attention output gate (Step-3.5-Flash ``g_proj``) for megatron-core."""

from mcore_ext.attention import HeadWiseGatedSelfAttention, SDPAttention
from mcore_ext.config import GatedTransformerConfig
from mcore_ext.runtime import destroy_parallel, device, init_parallel
from mcore_ext.specs import AttentionBackend, get_gpt_block_spec, get_gpt_layer_spec, resolve_backend

__all__ = [
    "AttentionBackend",
    "GatedTransformerConfig",
    "HeadWiseGatedSelfAttention",
    "SDPAttention",
    "destroy_parallel",
    "device",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "init_parallel",
    "resolve_backend",
]
