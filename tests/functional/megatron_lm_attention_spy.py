"""``python -m tests.functional.megatron_lm_attention_spy <pretrain_gpt flags>``: the Megatron-LM
entry, with rank 0 also printing each distinct call of torch's SDPA it makes (query and key
lengths, the mask's shape or None, is_causal):

    sdpa q=16 k=32 mask=(16, 32) is_causal=False

It observes ``torch.nn.functional.scaled_dot_product_attention`` (what it is handed), changes
nothing.
"""

import functools
import sys

import torch
import torch.nn.functional as F

from mcore_ext.megatron_lm import pretrain_gpt

_sdpa = F.scaled_dot_product_attention
_seen = set()


@functools.wraps(_sdpa)
def _spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
    mask = None if attn_mask is None else tuple(attn_mask.shape)
    call = f"sdpa q={query.size(-2)} k={key.size(-2)} mask={mask} is_causal={is_causal}"
    if call not in _seen and torch.distributed.get_rank() == 0:
        _seen.add(call)
        print(call, flush=True)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)


F.scaled_dot_product_attention = _spy

if __name__ == "__main__":
    sys.exit(pretrain_gpt.main())
