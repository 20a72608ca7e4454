#!/usr/bin/env python
"""Packed SFT rows against one conversation per row: real tokens per second and loss-token share.

The same conversations (the first ``--conversations`` of configs/sft_tiny/chat.jsonl, rendered
with configs/sft_tiny/tokenizer's chat template, loss on the answers) become ``seq_length`` rows
two ways, with the launcher's own code (``mcore_ext.data.chat``: ``pack_documents`` and
``ChatDataset.__getitem__``, ``mcore_ext.training.data.collate_packed``):

    packed     several conversations per row, best fit (``data.pack: true``)
    one-each   one conversation per row, the rest padding (``data.pack: false``)

and one model (configs/step35_sft_tiny_cpu.yaml's tiny Step-3.5: MoE, MTP, head-wise gate; TP 1,
fp32, sdpa) trains on both: an epoch is every row once, in micro-batches of ``--micro-batch``
rows (a THD batch, as the launcher's ``_forward_step``), forward + backward of the loss summed
over the loss tokens and divided by their count. Epochs of the two are interleaved (the order
alternates each repetition) so machine noise hits both alike.

Reported: the loss-token share (loss tokens over all row slots, what the launcher's ``[data]``
line prints), real (non-padding) tokens per second of each epoch's median, and the median over
repetitions of the ratio packed / one-each of tokens per second. Both epochs hold the same real
tokens, so the ratio is one-each's epoch time over packed's.

    python benchmarks/bench_sft_packing.py
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows_of(conversations, seq_length: int, pack: bool) -> list[dict]:
    """Every row of the conversations as the launcher's ChatDataset yields it, in packing order
    (no splits, no shuffle)."""
    from megatron.core.datasets.utils import Split

    from mcore_ext.data.chat import ChatDataset, ChatDatasetConfig, ChatFile

    config = ChatDatasetConfig(random_seed=1, sequence_length=seq_length, split="1,0,0",
                               tokenizer=None, hf_tokenizer=None, pack=pack)
    dataset = ChatDataset(ChatFile("bench", list(conversations), len(conversations), 0, 0),
                          "bench", numpy.arange(len(conversations)), None, Split.train, config)
    return [dataset.row(r) for r in range(dataset.num_rows)]


def batches_of(rows, micro_batch: int) -> list[dict]:
    from mcore_ext.training.data import collate_packed

    return [collate_packed(rows[i:i + micro_batch]) for i in range(0, len(rows), micro_batch)]


def epoch(model, batches) -> float:
    """Seconds of forward + backward over every micro-batch."""
    from mcore_ext.training.data import packed_seq_params

    start = time.perf_counter()
    for batch in batches:
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"],
                       packed_seq_params=packed_seq_params(batch, "cpu"))
        mask = batch["loss_mask"]
        ((losses.float() * mask).sum() / mask.sum().clamp(min=1)).backward()
        for p in model.parameters():
            p.grad = None
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=48,
                        help="the first N conversations of the file (default 48)")
    parser.add_argument("--rounds", type=int, default=5, help="epochs of each, interleaved")
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    import mcore_ext
    from mcore_ext.data.chat import read_chat_file
    from mcore_ext.data.tokenizers import load_tokenizer
    from mcore_ext.models import build_gpt_model
    from mcore_ext.run_config import PretrainConfig, build
    from mcore_ext.run_config.megatron_configs import transformer_config
    from mcore_ext.run_config.overrides import apply_overrides, read_yaml
    from mcore_ext.training.loop import padded_vocab_size

    raw = apply_overrides(read_yaml(os.path.join(ROOT, "configs", "step35_sft_tiny_cpu.yaml")), [
        "parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
        "training.precision=fp32",
        f"model.seq_length={args.seq_length}"])
    cfg = build(PretrainConfig, raw)
    tokenizer = load_tokenizer(os.path.join(ROOT, cfg.data.tokenizer))
    chat = read_chat_file(os.path.join(ROOT, cfg.data.path), tokenizer.hf, args.seq_length,
                          cfg.data.loss_on, cfg.data.overlong)
    conversations = chat.conversations[:args.conversations]

    mcore_ext.init_parallel()
    with mcore_ext.cuda_to_cpu():
        model = build_gpt_model(
            transformer_config(cfg), vocab_size=padded_vocab_size(tokenizer.vocab_size, cfg),
            max_sequence_length=args.seq_length, backend=cfg.model.attention_backend,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights)

    modes = {}
    for name, pack in (("packed", True), ("one-each", False)):
        rows = rows_of(conversations, args.seq_length, pack)
        real = sum(len(c.ids) - 1 for c in conversations)
        loss = sum(float(r["loss_mask"].sum()) for r in rows)
        modes[name] = dict(batches=batches_of(rows, args.micro_batch), rows=len(rows), real=real,
                           share=loss / (len(rows) * args.seq_length), times=[])
    epoch(model, modes["packed"]["batches"][:1])  # warm-up

    names = list(modes)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            modes[name]["times"].append(epoch(model, modes[name]["batches"]))

    print(f"[bench_sft_packing] {len(conversations)} conversations of {cfg.data.path}, "
          f"{modes['packed']['real']} real tokens, seq_length {args.seq_length}, micro-batch "
          f"{args.micro_batch}, {args.rounds} rounds, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name, m in modes.items():
        median = statistics.median(m["times"])
        print(f"  {name:9s} rows {m['rows']:4d}  loss-token share {m['share']:6.1%}  "
              f"epoch {median:6.2f} s  real tokens/s {m['real'] / median:8.0f}")
    ratios = [one / packed for packed, one in zip(modes["packed"]["times"],
                                                   modes["one-each"]["times"])]
    share = modes["packed"]["share"] / modes["one-each"]["share"]
    print(f"  packed / one-each: real tokens/s x{statistics.median(ratios):.2f} (median of "
          f"{', '.join(f'{x:.2f}' for x in ratios)}), loss-token share x{share:.2f}")
    mcore_ext.destroy_parallel()


if __name__ == "__main__":
    main()
