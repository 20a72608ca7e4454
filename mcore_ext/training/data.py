"""Datasets and batch iterators for pretraining, from megatron-core's GPT datasets.

Every rank builds the same datasets and the same sample order from the same seed, and takes its
own micro-batches from it, so no rank broadcasts data (megatron's ``broadcast_data`` needs CUDA).
The sample stream is cut into chunks of micro_batch_size x DP samples; data-parallel rank r takes
the r-th micro-batch of every chunk. Sample k of the run is therefore the same sample at every
parallel layout with the same global batch, and resuming at iteration i starts at sample
i x global_batch_size. With context parallelism every CP rank of a DP replica loads the same
micro-batch and keeps its 2 chunks of each sequence (``cp_shard``).

Chat data (``data.source: chat``, ``mcore_ext.data.chat``) gives rows of packed conversations; a
micro-batch of them is one THD sequence (``collate_packed``): its b rows side by side, the
documents' boundaries in ``cu_seqlens``, so each attends only to itself and its positions restart.
Under context parallelism every document is padded to a multiple of 2 x CP
(``cu_seqlens_padded``) and split on its own into 2 x CP chunks, megatron's THD convention.

Chat rows with images (``mcore_ext.data.chat_images``) add, to a micro-batch that has any:
``pixel_values`` [n, 3, H, W] (each image's global view), ``pixel_values_local`` [crops, 3, h, w]
(when there are local crops) and ``num_local_patches`` [n] (int64) - what the model's processor
gives for the images, in the order their placeholders come in the micro-batch's tokens: the
vision-language model's keywords (transformers' names). Every rank of the first pipeline stage
reads the images of its own micro-batch as it reads its tokens: the ranks of a TP group and of a
CP group read the same rows, hence the same bytes (checked against their SHA-256) through the
same processor, so they hold equal pixels with no broadcast; later stages, which run no tower,
read none (``ChatDatasetConfig.images``). ``cp_shard`` leaves the images whole on every CP rank:
the tower runs on all of the micro-batch's images, and the model numbers the placeholders of
each rank's chunks among the whole micro-batch's itself (``mcore_ext.vision.placement``).
"""

import os
from functools import partial

import numpy
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_ext.attention.context_parallel import (
    get_batch_on_this_cp_rank,
    get_packed_batch_on_this_cp_rank,
)
from mcore_ext.data import chat_images
from mcore_ext.data.chat import ChatDataset, ChatDatasetConfig
from mcore_ext.data.preprocess import preprocess, stdlib_sources
from mcore_ext.data.tokenizers import load_tokenizer
from mcore_ext.runtime import device, raise_unless_all_ok
from mcore_ext.training.config.validation import chat_blend, chat_cache_dir
from mcore_ext.training.faults import fault_point


def prepare_tokenizer_and_data(cfg):
    """The tokenizer; for data.source=stdlib, first builds the dataset if missing (on rank 0).

    Rank 0 decides whether to build and every rank takes its decision: a rank that looked for
    itself and started after rank 0 had written the index would skip the build's collective and
    wait in the next one while the others waited in this one, for ever."""
    d = cfg.data
    fault_point("start")  # a rank that starts late (MCORE_EXT_DELAY_AT=start,SECONDS,RANK)
    if d.source == "stdlib" and _rank_0_says(not os.path.isfile(d.prefix + ".idx")):
        failure = None
        fault_point("data")
        if dist.get_rank() == 0:  # assumes one node or a shared filesystem
            sources = stdlib_sources()
            print(f"[data] building {d.prefix}.bin/.idx from {len(sources)} stdlib files")
            try:
                meta = preprocess(sources, d.prefix, d.tokenizer)
                print(f"[data] {meta['documents']} documents, {meta['tokens']} tokens", flush=True)
            except (OSError, ValueError) as err:
                failure = err
        raise_unless_all_ok(failure, f"building the stdlib dataset at {d.prefix} failed")
    return load_tokenizer(d.tokenizer)


def _rank_0_says(decision: bool) -> bool:
    """Collective: rank 0's ``decision``, on every rank."""
    shared = torch.tensor([int(decision)], dtype=torch.int32, device=device())
    dist.broadcast(shared, src=0)
    return bool(shared.item())


def build_datasets(cfg, tokenizer):
    """(train, valid) megatron datasets sized for the whole run."""
    d, t = cfg.data, cfg.training
    valid_samples = t.eval_iters * t.global_batch_size if t.eval_interval else 0
    if cfg.logging.attention_probe:  # its probe batch: the validation split's first micro-batch
        valid_samples = max(valid_samples, t.micro_batch_size)
    sizes = [t.train_iters * t.global_batch_size, valid_samples, 0]
    if d.source == "chat":
        return _build_chat_datasets(cfg, tokenizer, sizes)
    config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=cfg.model.seq_length,
        blend=None if d.source == "mock" else ([d.prefix], None),
        split=None if d.source == "mock" else d.split,
        # megatron's default cache is <prefix>/cache, a directory named like the dataset.
        path_to_cache=d.cache_dir or (
            None if d.source == "mock" else os.path.join(os.path.dirname(d.prefix) or ".", "cache")
        ),
        tokenizer=tokenizer,
        # document_masking: positions restart after each end-of-document token; the documents
        # become a THD batch (collate_documents), so no [b, 1, s, s] mask is needed.
        reset_position_ids=d.document_masking,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # Core attention applies the causal mask itself: no [b, 1, s, s] mask tensors.
        create_attention_mask=False,
    )
    cls = MockGPTDataset if d.source == "mock" else GPTDataset
    # Every rank builds (rank 0 first: it writes the index cache the others read).
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    return train, valid


def _build_chat_datasets(cfg, tokenizer, sizes):
    """(train, valid) ``ChatDataset``s (or megatron ``BlendedDataset``s of them, for a blend):
    megatron's builder splits each file's conversations by data.split, or takes data.valid_path
    for validation."""
    d, t, cp = cfg.data, cfg.training, cfg.parallelism.context_parallel_size
    train_blend = chat_blend(d.path, "data.path")
    if d.valid_path is None:
        blends = dict(blend=train_blend, split=d.split)
    else:
        blends = dict(blend_per_split=[train_blend, chat_blend(d.valid_path, "data.valid_path"),
                                       None])
    config = ChatDatasetConfig(
        random_seed=t.seed,
        sequence_length=cfg.model.seq_length,
        **blends,
        tokenizer=tokenizer,
        hf_tokenizer=tokenizer.hf,
        loss_on=d.loss_on,
        overlong=d.overlong,
        pack=d.pack,
        # megatron's THD convention under CP: every document a multiple of 2 x CP (cp_shard)
        pad_to_multiple=2 * cp if cp > 1 else 1,
        # only the first pipeline stage runs the vision tower (every rank does without model
        # parallel groups: a caller that set up no pipeline)
        images=(not parallel_state.model_parallel_is_initialized()
                or parallel_state.is_pipeline_first_stage()),
        # the stores of the tokenized conversations (built during validation) and the rows
        path_to_cache=chat_cache_dir(d),
    )
    dist.barrier()  # the stores are built (validation); every rank reads them
    train, valid, _ = BlendedMegatronDatasetBuilder(ChatDataset, sizes, lambda: True,
                                                    config).build()
    if dist.get_rank() == 0:
        files = {}
        for split in (train, valid):
            for part in _chat_parts(split):
                files.setdefault(part.dataset.path, part.dataset)
        for chat in files.values():
            print(chat.summary(cfg.model.seq_length), flush=True)
        for name, split in (("train", train), ("valid", valid)):
            parts = _chat_parts(split)
            if parts:
                rows = sum(part.num_rows for part in parts)
                share = sum(part.loss_token_share() * part.num_rows for part in parts) / max(
                    1, rows)
                print(f"[data] {name}: {rows} rows of {cfg.model.seq_length} "
                      f"({'packed' if d.pack else 'one conversation each'}"
                      f"{f', {len(parts)} files blended' if len(parts) > 1 else ''}), "
                      f"{share:.1%} of the slots carry loss", flush=True)
    return train, valid


def _chat_parts(split) -> list:
    """The ``ChatDataset``s of a split: itself, or a ``BlendedDataset``'s."""
    if split is None:
        return []
    return list(split.datasets) if isinstance(split, BlendedDataset) else [split]


def collate_packed(samples: list, total_multiple: int = 1) -> dict:
    """Rows of packed documents -> one THD micro-batch: ``tokens`` / ``labels`` / ``loss_mask`` /
    ``position_ids`` [1, t], the rows side by side, ``cu_seqlens`` (int32, every row's documents
    and padding, real lengths), ``cu_seqlens_padded`` (the slots each takes: ``padded_lengths``,
    as is without them) and ``max_seqlen`` (the longest padded one). ``total_multiple``: a last
    padding document makes t a multiple of it (the rows of ``collate_documents`` vary in length).
    """
    batch = {key: numpy.concatenate([x[key] for x in samples])
             for key in ("tokens", "labels", "loss_mask", "position_ids")}
    lengths = numpy.concatenate([x["lengths"] for x in samples])
    padded = numpy.concatenate([x.get("padded_lengths", x["lengths"]) for x in samples])
    extra = -len(batch["tokens"]) % total_multiple
    if extra:  # a document of its own, no loss
        batch = {key: numpy.pad(value, (0, extra)) for key, value in batch.items()}
        batch["position_ids"][-extra:] = numpy.arange(extra)
        lengths, padded = numpy.append(lengths, extra), numpy.append(padded, extra)
    batch = {key: torch.from_numpy(value)[None] for key, value in batch.items()}
    batch["cu_seqlens"], batch["cu_seqlens_padded"] = _cumulative(lengths), _cumulative(padded)
    batch["max_seqlen"] = int(padded.max())
    if any("pixel_values" in x for x in samples):
        batch.update(chat_images.collate(samples))  # whole, not [1, t]
    return batch


def _cumulative(lengths) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 boundaries from 0 (megatron's cu_seqlens)."""
    return torch.nn.functional.pad(torch.from_numpy(lengths).cumsum(0), (1, 0)).to(torch.int32)


def collate_documents(samples: list, multiple: int = 1, total_multiple: int = 1) -> dict:
    """Text samples with restarted positions (``data.document_masking``) -> one THD micro-batch
    as ``collate_packed`` makes it: a document begins wherever its position is 0. ``multiple``
    (2 x CP): each document is followed by slots without loss up to a multiple of it."""
    rows = []
    for sample in samples:
        row = {key: numpy.asarray(sample[key])
               for key in ("tokens", "labels", "loss_mask", "position_ids")}
        starts = numpy.flatnonzero(row["position_ids"] == 0)
        lengths = numpy.diff(numpy.append(starts, len(row["position_ids"])))
        padded = -(-lengths // multiple) * multiple
        if multiple > 1:  # each document's tokens at its padded offset, zeros after them
            at = numpy.concatenate([[0], padded.cumsum()[:-1]])
            slots = numpy.concatenate([a + numpy.arange(n) for a, n in zip(at, lengths)])
            for key, value in row.items():
                row[key] = numpy.zeros(int(padded.sum()), value.dtype)
                row[key][slots] = value
            row["position_ids"] = numpy.concatenate([numpy.arange(n) for n in padded])
        rows.append(dict(row, lengths=lengths, padded_lengths=padded))
    return collate_packed(rows, total_multiple)


def packed_seq_params(batch: dict, dev) -> PackedSeqParams | None:
    """The ``PackedSeqParams`` (THD) of a packed micro-batch; None for a [b, s] one."""
    if "cu_seqlens" not in batch:
        return None
    padded = batch.get("cu_seqlens_padded")
    if padded is not None and torch.equal(padded, batch["cu_seqlens"]):
        padded = None  # no padding inside documents (CP 1): megatron reads cu_seqlens then
    cu_seqlens = batch["cu_seqlens"].to(dev)
    padded = padded.to(dev) if padded is not None else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])


class _MicroBatchSampler:
    """This DP rank's micro-batches of sample indices, from sample ``start`` on."""

    def __init__(self, num_samples, start, micro_batch_size, dp_rank, dp_size):
        self.num_samples, self.start = num_samples, start
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        chunk = self.micro_batch_size * self.dp_size
        first = self.dp_rank * self.micro_batch_size
        for begin in range(self.start, self.num_samples - chunk + 1, chunk):
            yield list(range(begin + first, begin + first + self.micro_batch_size))

    def __len__(self):
        return max(0, (self.num_samples - self.start) // (self.micro_batch_size * self.dp_size))


def batch_iterator(dataset, cfg, start_sample: int = 0):
    """Iterator of micro-batches {"tokens", "labels", "loss_mask", "position_ids": [b, s]}."""
    sampler = _MicroBatchSampler(
        len(dataset),
        start_sample,
        cfg.training.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.data.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        collate_fn=_collate_fn(cfg),
    )
    return iter(loader)


def first_micro_batch(dataset, cfg) -> dict:
    """The first micro_batch_size samples of ``dataset`` as one micro-batch, the same on every
    rank (the attention probe's batch: every data-parallel replica runs it)."""
    samples = [dataset[i] for i in range(cfg.training.micro_batch_size)]
    return (_collate_fn(cfg) or torch.utils.data.default_collate)(samples)


def _collate_fn(cfg):
    """How samples become a micro-batch: THD for chat rows and text with document masking (each
    document padded to 2 x CP under context parallelism), megatron's default collation else."""
    if cfg.data.source == "chat":
        return collate_packed  # the rows hold padded documents already (ChatDataset)
    if not cfg.data.document_masking:
        return None
    p = cfg.parallelism
    cp = p.context_parallel_size
    if cp == 1:
        return collate_documents
    # each CP rank's share of the micro-batch splits evenly over TP (sequence parallelism)
    return partial(collate_documents, multiple=2 * cp,
                   total_multiple=2 * cp * p.tensor_model_parallel_size)


def cp_shard(batch: dict) -> dict:
    """This CP rank's tokens of a micro-batch (megatron's load-balanced split; as is at CP 1).

    A packed (THD) micro-batch is split per document, as megatron splits one with
    ``cu_seqlens_padded``: every document's 2 x CP chunks r and 2CP-1-r; its ``cu_seqlens*``
    still describe the whole micro-batch (core attention and RoPE read them so). The images
    (``chat_images.IMAGE_KEYS``) stay whole on every CP rank: the tower runs on all of them.
    """
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    images = {key: batch[key] for key in chat_images.IMAGE_KEYS if key in batch}
    if "cu_seqlens" not in batch:
        tokens = {key: value for key, value in batch.items() if key not in images}
        return dict(get_batch_on_this_cp_rank(tokens), **images)
    padded = batch["cu_seqlens_padded"]
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return dict(batch, **{key: get_packed_batch_on_this_cp_rank(batch[key], padded, dim=1)
                          for key in keys})
