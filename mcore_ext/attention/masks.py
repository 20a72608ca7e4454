"""The one position rule every attention mask here is built from (dense, flex and CP masks)."""

import torch


def allowed(q_pos, k_pos, causal: bool, window=None):
    """Whether the query at position ``q_pos`` may attend the key at ``k_pos`` (tensors that
    broadcast; True = attend).

    ``causal``: keys at or before the query. ``window`` = megatron's (left, right): keys in
    [q - left, q + right], a negative bound = unbounded. HF's ``sliding_window`` W is (W - 1, 0):
    q - W < k <= q.
    """
    ok = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
    if window is not None:
        left, right = window
        if left >= 0:
            ok = ok & (k_pos >= q_pos - left)
        if right >= 0:
            ok = ok & (k_pos <= q_pos + right)
    return ok
