"""python -m mcore_ext.plan --config CONFIG.yaml [section.key=value ...] [--dp N] [--seq N] ...

Memory per rank of a launcher config (``launch/pretrain.py``'s YAML, with the same overrides):
weights, gradients and optimizer state per pipeline stage, and the activations of one
micro-batch times the micro-batches the stage holds (megatron's 1F1B schedule), at the config's
layout (TP, PP, CP, EP, ETP, sequence parallelism), ``model.seq_length``,
``training.micro_batch_size`` and ``model.recompute_granularity`` unless the options say
otherwise; packed documents (``--packed``) where the config packs them (``data.source: chat``
with ``data.pack``, or ``data.document_masking``); with ``model.vision`` the vision tower and
projector too (``--images`` / ``--crops`` per micro-batch). ``--search`` lists the layouts with
the fewest GPUs that fit. Nothing is built.
Errors are one ``error:`` line and exit code 2.
"""

import argparse
import sys
import warnings

from mcore_ext.plan.cli import PlanError, add_activation_args, print_plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_ext.plan",
                                     description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--config", required=True, help="a launcher YAML config")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as the launcher takes")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--vocab-size", type=int,
                        help="vocabulary before padding (default: the config's tokenizer's)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--without-mtp", action="store_true",
                        help="plan the model without its MTP layers")
    add_activation_args(parser, dict(seq=None, micro_batch=None, cp=None, recompute=None))
    args = parser.parse_args(argv)
    # megatron's config warns about GPU-only settings (TE's fused attention, CUDA graphs)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        cfg, shape = _load(args)
        p = cfg.parallelism
        args.seq = args.seq or cfg.model.seq_length
        args.micro_batch = args.micro_batch or cfg.training.micro_batch_size
        args.cp = args.cp or p.context_parallel_size
        args.recompute = args.recompute or cfg.model.recompute_granularity or "none"
        d = cfg.data
        args.packed = args.packed or (d.source == "chat" and d.pack) or d.document_masking
        print_plan(shape, args, tp=p.tensor_model_parallel_size,
                   pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                   etp=p.expert_tensor_parallel_size, dp=args.dp, sp=p.sequence_parallel,
                   distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
        _note_deprecated_model(cfg)
    except (OSError, ValueError, ImportError, PlanError) as err:  # ImportError: transformers
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _note_deprecated_model(cfg) -> None:
    """The launcher's GPTModel notice for a config it would build GPTModel from, on stderr (the
    plan on stdout stays the plan: the same for either architecture)."""
    from mcore_ext.cli import gpt_deprecation_notice

    notice = cfg.model.architecture == "gpt" and gpt_deprecation_notice(
        "model.architecture: hybrid builds its successor, HybridModel (the same plan)")
    if notice:
        print(f"note: model.architecture=gpt: {notice}", file=sys.stderr)


def _load(args):
    """(the launcher config, its ModelShape): the YAML with overrides, the model config the
    launcher would build (at the config's own parallel sizes; nothing is validated against a
    world size)."""
    from mcore_ext.lora import LoraConfig
    from mcore_ext.plan.params import with_lora
    from mcore_ext.plan.shape import ModelShape
    from mcore_ext.run_config import PretrainConfig, apply_overrides, build, read_yaml
    from mcore_ext.run_config.megatron_configs import transformer_config

    cfg = build(PretrainConfig, apply_overrides(read_yaml(args.config), args.overrides))
    vocab = args.vocab_size
    if vocab is None:
        from mcore_ext.data.tokenizers import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    config = transformer_config(cfg)
    shape = ModelShape.from_transformer_config(
        config, vocab_size=vocab, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        tied_embeddings=not cfg.model.untie_embeddings_and_output_weights)
    if args.without_mtp:
        shape = shape.without_mtp()
    shape = shape.with_vision(cfg.model.vision)  # Step-3.7's tower and projector, if any
    adapters = cfg.lora
    return cfg, with_lora(shape, LoraConfig(rank=adapters.rank, alpha=adapters.alpha,
                                            dropout=adapters.dropout, targets=adapters.targets))


if __name__ == "__main__":
    sys.exit(main())
