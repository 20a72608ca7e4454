"""Image features into the text embeddings: transformers' order of the features, and their
placeholder positions on this rank under every parallel layout.

transformers (``Step3p7Model``) orders a batch's features per image: the image's local crops'
features first (crop by crop), then its global view's, images in the order of ``pixel_values``;
``masked_scatter`` then writes them, in that order, into the embeddings of the ``image_token_id``
placeholders read row-major over the [b, s] batch. The count must match exactly.

Here the embeddings are this rank's: under context parallelism (CP) megatron's load-balanced
split has given the rank 2 chunks of every sequence (of every document of a packed THD batch),
and under sequence parallelism (SP) the embedding has been scattered along the sequence over the
TP ranks. So each local placeholder's feature is found by its rank among all placeholders of the
whole micro-batch (``placeholder_order``: one all-gather of the local placeholders' global
positions over the CP group), and each TP rank writes the rows of its sequence shard
(``write_features``). Every rank holds all of the micro-batch's features (the tower runs on the
whole images); under SP the features' gradients, each rank's from its own rows, are summed over
TP before they reach the projector and tower (megatron's ``copy_to_tensor_model_parallel_region``),
so every TP rank back-propagates the same gradient, as the unsplit embedding would.

Shapes: b batch, s this rank's tokens of a sequence, S = CP x s, h text hidden, n features.
"""

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from mcore_ext.attention.context_parallel import (
    get_packed_batch_on_this_cp_rank,
    zigzag_positions,
)


class ImageTokenMismatch(ValueError):
    """The placeholders of a micro-batch and its images' features do not match in number."""


def merge_features(global_features: torch.Tensor, local_features,
                   num_local_patches) -> torch.Tensor:
    """[n, h] features in transformers' order: per image, its crops' features then its global
    view's. ``global_features`` [images, t_g, h]; ``local_features`` [crops, t_l, h] or None;
    ``num_local_patches``: crops per image (a list or tensor of ints; None: no crops)."""
    images = global_features.size(0)
    counts = [0] * images if num_local_patches is None else [int(k) for k in num_local_patches]
    crops = 0 if local_features is None else local_features.size(0)
    if len(counts) != images or sum(counts) != crops or min(counts, default=0) < 0:
        raise ImageTokenMismatch(
            f"num_local_patches={counts} does not describe {images} image(s) with {crops} local "
            "crop(s) (pixel_values / pixel_values_local)")
    h = global_features.size(-1)
    parts, start = [], 0
    for image, count in enumerate(counts):
        if count:
            parts.append(local_features[start:start + count].reshape(-1, h))
            start += count
        parts.append(global_features[image])
    return torch.cat(parts)


def _global_positions(input_ids: torch.Tensor, packed_seq_params, cp_group) -> torch.Tensor:
    """[b, s] int64: each local token's index in the row-major flattened [b, S] micro-batch."""
    b, s = input_ids.shape
    device = input_ids.device
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        padded = packed_seq_params.cu_seqlens_q_padded
        if padded is None:
            padded = packed_seq_params.cu_seqlens_q
        total = int(padded[-1])
        slots = torch.arange(total, device=device).unsqueeze(0)  # [1, T]
        return get_packed_batch_on_this_cp_rank(slots, padded, cp_group, dim=1)
    columns = zigzag_positions(s, cp_group.size(), cp_group.rank(), device=device)
    rows = torch.arange(b, device=device).unsqueeze(1) * (s * cp_group.size())
    return rows + columns


def placeholder_order(input_ids: torch.Tensor, image_token_id: int, packed_seq_params=None,
                      cp_group=None) -> tuple[torch.Tensor, int]:
    """(order [b, s] int64, total): each local placeholder's index among all placeholders of the
    micro-batch read row-major (-1 for other tokens), and their number. Collective over
    ``cp_group`` when it has more than one rank (every rank of it must call)."""
    mask = input_ids == image_token_id
    if cp_group is None or cp_group.size() == 1:
        order = mask.flatten().cumsum(0).view_as(mask) - 1
        return torch.where(mask, order, -1), int(mask.sum())
    positions = _global_positions(input_ids, packed_seq_params, cp_group)
    local = torch.where(mask, positions, -1)
    gathered = [torch.empty_like(local) for _ in range(cp_group.size())]
    dist.all_gather(gathered, local.contiguous(), group=cp_group)
    every = torch.cat([g.flatten() for g in gathered])
    every = every[every >= 0].sort().values  # the placeholders' global positions, in order
    order = torch.searchsorted(every, positions)
    return torch.where(mask, order, -1), every.numel()


def write_features(embeddings: torch.Tensor, order: torch.Tensor, features: torch.Tensor,
                   sequence_parallel: bool = False, tp_group=None) -> torch.Tensor:
    """``embeddings`` [s(/TP), b, h] with each placeholder's row replaced by its feature.

    ``order`` [b, s] from ``placeholder_order``; ``features`` [n, h] in transformers' order.
    Under sequence parallelism ``embeddings`` is this TP rank's shard of the sequence, and the
    features' gradients are summed over ``tp_group`` (every TP rank calls)."""
    order = order.t()  # [s, b], as the embeddings
    if sequence_parallel and tp_group.size() > 1:
        order = order.chunk(tp_group.size())[tp_group.rank()]
        features = tensor_parallel.copy_to_tensor_model_parallel_region(features, group=tp_group)
    if order.shape != embeddings.shape[:2]:
        raise ValueError(f"placeholder positions {tuple(order.shape)} do not match the "
                         f"embeddings' [s, b] {tuple(embeddings.shape[:2])}")
    selected = order >= 0
    # Always through the graph, also with no placeholder here: under SP the gradient's sum over
    # TP is a collective every rank enters.
    rows = features.index_select(0, order[selected]).to(embeddings.dtype)
    return embeddings.masked_scatter(selected.unsqueeze(-1), rows)


def check_count(total: int, features: int, image_token_id: int) -> None:
    if total != features:
        raise ImageTokenMismatch(
            f"the micro-batch holds {total} image placeholder token(s) (image_token_id="
            f"{image_token_id}) but its images give {features} feature(s): each image's "
            "placeholders must be exactly its crops' and global view's features")
