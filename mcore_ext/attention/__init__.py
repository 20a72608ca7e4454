from mcore_ext.attention.gated import HeadWiseGatedSelfAttention
from mcore_ext.attention.sdpa import SDPAttention

__all__ = ["HeadWiseGatedSelfAttention", "SDPAttention"]
