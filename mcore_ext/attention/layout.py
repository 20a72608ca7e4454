"""The per-batch attention layout: made once per forward at the model level, read by every layer.

Everything attention derives from the batch rather than from a layer's weights (document
boundaries of a packed batch, CP chunk ranges and key orders, and the masks of each layer kind)
is computed here once per batch; the kernels (``sdpa``, ``flex``, ``varlen``,
``context_parallel``) only consume it. The host reads a packed batch's ``cu_seqlens`` once, when
the layout is made (``begin_batch``, called by the model's forward pre-hook that
``install_on`` adds), so a layer's forward never waits on the device.

A layer finds the layout with ``layout_for(packed_seq_params)``: the active one when it was made
for that batch (the same ``PackedSeqParams`` object, or none for both), otherwise a new one
(a model built without ``install_on``, a test calling core attention directly). A layout lives
until the next batch replaces it; the masks it caches are the ones SDPA saves for backward
anyway (one tensor shared by every layer of a kind, not one per layer), bounded by
``MASK_CACHE_BYTES``.
"""

import functools
from typing import Callable, Optional

import torch

# Masks larger than this in total are built per call instead of cached (a packed 32K batch under
# CP needs 0.5 GB per dense mask; a layout rarely holds more than one mask per layer kind).
MASK_CACHE_BYTES = 2 << 30


class AttentionLayout:
    """Per-batch facts and masks shared by every attention layer of one forward.

    ``packed``: the batch is THD (``PackedSeqParams`` with ``qkv_format == 'thd'``); then
    ``cu_q`` / ``cu_kv`` (host lists of cumulative real lengths), ``starts_q`` / ``starts_kv``
    (each document's first slot, padded layout), ``lengths_q`` / ``lengths_kv``, ``max_q`` /
    ``max_kv`` and ``self_attention`` (queries and keys are the same documents).
    ``builds`` counts the masks built (tests check one per batch per layer kind).
    """

    def __init__(self, packed_seq_params=None):
        params = packed_seq_params
        self.params = params
        self.packed = params is not None and params.qkv_format == "thd"
        self.builds = 0
        self._cache: dict = {}
        self._cached_bytes = 0
        if self.packed:
            # The one host read of the batch: every layer uses these lists.
            self.cu_q = params.cu_seqlens_q.tolist()
            self.cu_kv = (self.cu_q if params.cu_seqlens_kv is params.cu_seqlens_q
                          else params.cu_seqlens_kv.tolist())
            padded_q = _tolist_or(params.cu_seqlens_q_padded, self.cu_q)
            padded_kv = (padded_q if params.cu_seqlens_kv_padded is params.cu_seqlens_q_padded
                         else _tolist_or(params.cu_seqlens_kv_padded, self.cu_kv))
            self.cu_q_padded, self.cu_kv_padded = padded_q, padded_kv
            self.starts_q, self.starts_kv = padded_q[:-1], padded_kv[:-1]
            self.lengths_q = [b - a for a, b in zip(self.cu_q, self.cu_q[1:])]
            self.lengths_kv = [b - a for a, b in zip(self.cu_kv, self.cu_kv[1:])]
            self.max_q = max(self.lengths_q, default=0)
            self.max_kv = max(self.lengths_kv, default=0)
            self.self_attention = self.cu_q == self.cu_kv and padded_q == padded_kv

    def matches(self, packed_seq_params) -> bool:
        """Whether this layout was made for the batch described by ``packed_seq_params``."""
        return self.params is packed_seq_params

    def cached(self, key, build: Callable):
        """``build()`` once per batch for ``key`` (a layer kind's mask, a CP key order, ...)."""
        if key in self._cache:
            return self._cache[key]
        value = build()
        self.builds += 1
        size = _nbytes(value)
        if self._cached_bytes + size <= MASK_CACHE_BYTES:
            self._cache[key] = value
            self._cached_bytes += size
        return value

    def document_ids(self, t: int, device) -> torch.Tensor:
        """[t] int32: each packed slot's document, -1 for padding slots (THD only); built on the
        device from the boundaries, once per batch."""
        def build():
            slot = torch.arange(t, device=device)
            starts = torch.tensor(self.starts_q, device=device)
            ends = starts + torch.tensor(self.lengths_q, device=device)
            doc = torch.bucketize(slot, starts, right=True) - 1
            real = (doc >= 0) & (slot < ends[doc.clamp(min=0)])
            return torch.where(real, doc, -1).to(torch.int32)

        return self.cached(("document_ids", t, device), build)


def _tolist_or(tensor, default):
    return default if tensor is None else tensor.tolist()


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


_active: Optional[AttentionLayout] = None


def begin_batch(packed_seq_params=None) -> AttentionLayout:
    """Make the layout of a new batch and make it the active one (the model's pre-hook does)."""
    global _active
    _active = AttentionLayout(packed_seq_params)
    return _active


def layout_for(packed_seq_params=None) -> AttentionLayout:
    """The active layout if it describes this batch, else a new one (made here, in the layer)."""
    if _active is not None and _active.matches(packed_seq_params):
        return _active
    return begin_batch(packed_seq_params)


def install_on(model: torch.nn.Module) -> torch.nn.Module:
    """Make a new layout at the start of each ``model`` forward (a megatron ``GPTModel``: its
    ``packed_seq_params`` argument describes the batch). Returns ``model``."""
    import inspect

    signature = inspect.signature(model.forward)

    def pre_hook(module, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        begin_batch(bound.get("packed_seq_params"))

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return model


# ----------------------------------------------------------------------------- mask helpers


def additive_mask(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere, in the compute dtype, as a view of a buffer whose rows
    are a multiple of 8 long: SDPA's memory-efficient kernel would otherwise pad and copy it on
    every call, and SDPA would convert a boolean mask per call (and save the copy per layer)."""
    sq, sk = allowed.shape[-2:]
    padded = -(-sk // 8) * 8
    buffer = torch.full((*allowed.shape[:-1], padded), float("-inf"), dtype=dtype,
                        device=allowed.device)
    view = buffer[..., :sk]
    view.masked_fill_(allowed, 0.0)
    return view


def key_prefix_causal(sq: int, sk: int, materialize: Callable) -> torch.Tensor:
    """Bottom-right-aligned causal attention of ``sq`` queries over ``sk`` keys: the last query
    sees every key, query i sees keys up to ``i + sk - sq`` (a CP chunk attending its key prefix).

    torch's ``causal_lower_right``, which SDPA runs on flash (GQA too) or the efficient kernel
    without a dense mask. Where neither applies (a CPU, fp32 with GQA) torch materializes the
    mask per call; this one hands out ``materialize(device)`` instead, the layout's mask shared
    by every layer. (torch's constructor also allocates ``2 x sq x sk`` floats it never reads:
    an empty tensor backs this one.)
    """
    return _key_prefix_causal_class()(sq, sk, materialize)


@functools.cache
def _key_prefix_causal_class():
    # torch.nn.attention.bias imports TorchDynamo (about 1 s of CPU per process): import it when
    # a layer first attends a key prefix (a CP chunk, decoding), not with the package.
    from torch.nn.attention.bias import CausalBias, CausalVariant

    class KeyPrefixCausal(CausalBias):
        @staticmethod
        def __new__(cls, sq: int, sk: int, materialize: Callable):
            return torch.Tensor._make_subclass(cls, torch.empty(0))

        def __init__(self, sq: int, sk: int, materialize: Callable):
            super().__init__(CausalVariant.LOWER_RIGHT, sq, sk)
            self._shared = materialize

        def _materialize(self, device=None) -> torch.Tensor:
            return self._shared(device)

    return KeyPrefixCausal
