"""Megatron-LM's GPT pretraining with mcore_ext's model: Megatron-LM's flags plus the gate's.

    torchrun --nproc_per_node=8 -m mcore_ext.megatron_lm.pretrain_gpt \\
        <Megatron-LM pretrain_gpt.py flags> --head-wise-attn-gate [--mcore-ext-backend te] \\
        [--hybrid-layer-pattern '*-*-']

The model is megatron's GPTModel, or with Megatron-LM's own ``--hybrid-layer-pattern`` its
successor HybridModel (megatron.training's choice, as its ``inference_cfg_container_from_args``
makes it): ``*`` attention, ``-`` dense MLP, ``E`` MoE, ``|`` pipeline stages, ``/*-`` an MTP
depth (or ``--mtp-num-layers``), each ``*`` one of the GPT layers the mcore_ext flags describe
(model.py). A run that builds GPTModel on a megatron-core deprecating it is told so once, by the
first rank.

megatron.training (in the megatron-core wheel, >= 0.19 here) parses the flags, builds the
optimizer, schedules, data loaders and checkpoints, and runs its training loop; this module gives
it what Megatron-LM's repository-root ``pretrain_gpt.py`` would (not in the wheel): the flags of
``GatedTransformerConfig``'s fields (arguments.py), the model config and builder (model.py), the
forward step and the dataset provider. ``--mock-data``, ``--data-path`` / ``--*-data-path``,
``--split`` and the tokenizer flags mean what they mean in Megatron-LM.

On the sdpa backend (which makes causal masks from token positions) the dataloader's causal-only
attention mask, Megatron-LM's default, is not made at any CP size: given a mask, full layers would
lose ``is_causal`` and sliding layers their banded kernel. Context parallelism
(``--context-parallel-size``): ``get_batch`` gives each CP rank its two load-balanced chunks of
every sequence, as Megatron-LM's does; on the sdpa backend (which all-gathers K/V) Megatron-LM's
default ``--cp-comm-type p2p`` runs as ``all_gather``. Each change is said once; what it cannot
run (a per-document mask under CP, ``a2a``) is refused in one line before training
(``attention_flags``).

A checkpoint megatron.training is about to load is verified first as the launcher verifies its
own, whichever way megatron chose it (``--load``, ``--pretrained-checkpoint``, ``--ckpt-step``
with or without a tracker) and in every format (``verified_loads``): one with a manifest (the
launcher's) must match it, and with a signing key (``MCORE_EXT_CHECKPOINT_KEY``) carry a valid
signature for that folder; else one line naming the file, exit code 2, before megatron reads any
of it.

A stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) that comes before megatron has installed its
``--exit-signal-handler`` handler (the imports, the flags, megatron's initialization) is recorded
from ``main``'s first line (``python -m mcore_ext.torchrun`` holds it while this module imports)
and handed to megatron's handler as ``--exit-signal`` once it exists; the other stop signals are
passed on to it the same way: megatron saves at the end of the iteration and exits.

On a machine without CUDA it runs on gloo with mcore_ext's CPU adaptations (tests, small runs).
"""

import contextlib
import copy
import functools
import os
import sys
import traceback
import types
import warnings

import torch

import mcore_ext  # noqa: F401  (refuses a megatron-core with a native gate first)
from mcore_ext import _cpu_compat, _mcore_compat
from mcore_ext.cli import (
    ExitSignalHandler,
    gpt_deprecation_notice,
    is_first_rank,
    quiet_known_noise,
    report_error,
)

if __name__ == "__main__":  # the entry point, not a library import: before megatron.training's
    quiet_known_noise()

_mcore_compat.check_megatron_training()

from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    print_rank_0,
)

from mcore_ext.attention.context_parallel import get_batch_on_this_cp_rank  # noqa: E402
from mcore_ext.checkpoint import manifest, safe_pickle, signing  # noqa: E402
from mcore_ext.checkpoint.errors import (  # noqa: E402
    CheckpointCorruptError, one_line, refusal_in)
from mcore_ext.megatron_lm.arguments import add_mcore_ext_args  # noqa: E402
from mcore_ext.megatron_lm.model import (  # noqa: E402
    gated_gpt_config_from_args,
    gated_hybrid_config_from_args,
)
from mcore_ext.models.hybrid import MTP_DEPTH  # noqa: E402
from mcore_ext.specs import AttentionBackend, resolve_backend  # noqa: E402

# megatron's warning for --mtp-num-layers with a --hybrid-layer-pattern without '/' depths.
MEGATRON_NO_MTP_PATTERN = r"Hybrid model with --mtp-num-layers but no MTP pattern"


class FlagError(ValueError):
    """A combination of flags this entry cannot run (the same on every rank: reported once)."""


def get_batch(data_iterator) -> dict:
    """This rank's part of the next micro-batch, on its device.

    Every rank reads its own data loader (the dataset provider is ``is_distributed``): tensor-,
    context- and pipeline-parallel ranks of one data-parallel rank read the same samples, so
    nothing is broadcast. Each CP rank then keeps its two chunks of every sequence (megatron's
    load-balanced split, ``get_batch_on_this_cp_rank``; the whole batch at CP 1).
    """
    batch = next(data_iterator)
    device = mcore_ext.device()
    batch = {
        key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }
    return get_batch_on_this_cp_rank(batch)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked per-token losses, the token count, and megatron's [sum, count] report
    (megatron.training averages the report over the tokens of the global batch)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """megatron.training's forward step: the model's per-token loss and ``loss_func``. The model
    gets the loss mask too: its MTP losses (``--mtp-num-layers``) count the tokens it keeps."""
    batch = get_batch(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
        labels=batch["labels"], loss_mask=batch["loss_mask"],
    )
    return output, functools.partial(loss_func, batch["loss_mask"])


def dataset_config(args) -> GPTDatasetConfig:
    """megatron's GPT dataset config from Megatron-LM's data and tokenizer flags."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=getattr(args, "multiple_validation_sets", None),
        full_validation=getattr(args, "full_validation", None),
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Train, validation and test datasets (mock ones with ``--mock-data``)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, dataset_config(args)
    ).build()


# Every rank builds the datasets and reads its own loader (see get_batch).
train_valid_test_datasets_provider.is_distributed = True


def attention_flags(args) -> list[str]:
    """Fit Megatron-LM's attention flags to the sdpa backend; returns what it changed (to say
    once), raises ``FlagError`` for what it cannot run. Other backends: nothing to do.

    At every CP size the dataloader's causal-only mask (``--create-attention-mask-in-dataloader``,
    megatron's default, without ``--reset-attention-mask``) is not made: the sdpa backend applies
    causality from positions, so full layers keep ``is_causal`` (flash) and sliding layers their
    banded kernel; given a mask, both would run under a dense ``[s, s]`` one. Under CP also
    ``--cp-comm-type``: the sdpa backend's CP all-gathers K/V."""
    cp_size = args.context_parallel_size
    cp = f"--context-parallel-size {cp_size}"
    backend = resolve_backend(getattr(args, "mcore_ext_backend", "auto"))
    if backend is AttentionBackend.LOCAL and cp_size > 1:
        raise FlagError(f"--mcore-ext-backend local with {cp}: megatron's local "
                        "DotProductAttention has no context parallelism; use sdpa or te")
    if backend is not AttentionBackend.SDPA:
        return []
    notes = []
    if args.create_attention_mask_in_dataloader and not args.reset_attention_mask:
        # GPTDataset's mask without --reset-attention-mask is the causal triangle: no information.
        args.create_attention_mask_in_dataloader = False
        notes.append(
            "the dataloader's attention mask (--create-attention-mask-in-dataloader) is causal "
            "only and is not made: the sdpa backend applies causality itself (is_causal, banded "
            "sliding windows)"
        )
    if cp_size == 1:
        return notes  # a per-document mask (--reset-attention-mask) goes to SDPA as given
    if args.create_attention_mask_in_dataloader:
        raise FlagError(
            f"--reset-attention-mask with {cp}: the sdpa backend's context parallelism makes "
            "causal masks from token positions and cannot take the dataloader's per-document "
            "attention mask; drop --reset-attention-mask, or use --mcore-ext-backend te"
        )
    if "p2p" in args.cp_comm_type:
        notes.append(
            "--cp-comm-type p2p runs as all_gather: the sdpa backend's context parallelism "
            "all-gathers K/V (Transformer Engine's p2p ring: --mcore-ext-backend te)"
        )
        args.cp_comm_type = ["all_gather" if kind == "p2p" else kind for kind in args.cp_comm_type]
    unsupported = [kind for kind in args.cp_comm_type if kind != "all_gather"]
    if unsupported:
        raise FlagError(
            f"--cp-comm-type {' '.join(unsupported)} with {cp}: the sdpa backend's context "
            "parallelism all-gathers K/V; use --cp-comm-type all_gather (or p2p, run as "
            "all_gather), or --mcore-ext-backend te"
        )
    return notes


def check_data_flags(args) -> None:
    """Megatron-LM data paths this entry does not build, refused before any process group:
    its datasets are megatron's GPT text datasets (``train_valid_test_datasets_provider``)."""
    if getattr(args, "sft", False):
        # megatron.training's SFTDataset packs conversations into rows with cu_seqlens; this
        # entry's get_batch builds no PackedSeqParams from them, so the documents would attend
        # across each other and the prompts' loss mask would come from another template.
        raise FlagError(
            "--sft: megatron's SFTDataset (conversations packed with cu_seqlens) is not built by "
            "this entry; fine-tune on chat data with the launcher's data.source: chat "
            "(docs/training.md)"
        )


def check_learning_rate_schedule(args) -> None:
    """Build megatron's own LR scheduler from the flags on an optimizer without parameters, so
    its checks run here, before any process group (megatron builds it after the model, where a
    failed assert is a traceback on every rank). The usual mistake, a warm-up as long as the
    decay, is named with its flags; megatron's other asserts say which check failed."""
    from megatron.training.training import get_optimizer_param_scheduler

    if args.train_iters and args.lr_warmup_fraction is None:
        decay = args.lr_decay_iters or args.train_iters
        if args.lr_warmup_iters >= decay:
            decay_flag = (f"--lr-decay-iters {decay}" if args.lr_decay_iters
                          else f"--train-iters {decay} (--lr-decay-iters not given)")
            raise FlagError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below "
                            f"{decay_flag}: megatron's learning rate would never decay")
    # It reads megatron's global args and fills in derived values (--train-iters of a sample-based
    # run, which the config container would then carry too): give it a copy.
    from megatron.training import global_vars

    previous = global_vars._GLOBAL_ARGS
    global_vars.set_args(copy.copy(args))
    try:
        get_optimizer_param_scheduler(types.SimpleNamespace(param_groups=[]))
    finally:
        global_vars.set_args(previous)


@contextlib.contextmanager
def verified_loads():
    """Every checkpoint megatron.training chooses to load is verified first, as the launcher
    verifies its own, whichever way it chose it (``--load`` or ``--pretrained-checkpoint`` and
    their tracker, ``--ckpt-step`` with or without one, ``release``) and whatever its format
    (``_mcore_compat.guard_megatron_lm_checkpoint_choice``; collective, as the load is):
    CheckpointCorruptError on every rank when a file differs from the manifest, or a signing key
    is set and the manifest is missing (every Megatron-LM checkpoint: torch, torch_dcp and
    torch_dist alike), unsigned, signed with another key or for another iteration or run. A
    checkpoint without a manifest (Megatron-LM's own) loads as before when no key is set. The
    whole-file pickles of ``--ckpt-format torch`` (``model_optim_rng.pt``, and
    ``distrib_optim.pt`` through megatron-core's optimizer) are read restricted, as every other
    checkpoint pickle (``safe_pickle``)."""
    from megatron.training import checkpointing, training

    original = training.load_checkpoint
    optimizer_modules = _mcore_compat.megatron_optimizer_modules()
    restricted = safe_pickle.TorchWithRestrictedLoad()

    def load_checkpoint(*args, **kwargs):
        for module in optimizer_modules:  # for the load only: their training steps keep torch
            module.torch = restricted
        try:
            return original(*args, **kwargs)
        finally:
            for module in optimizer_modules:
                module.torch = torch

    training.load_checkpoint = load_checkpoint
    checkpointing.torch = restricted
    undo = _mcore_compat.guard_megatron_lm_checkpoint_choice(_verify)
    try:
        yield
    finally:
        undo()
        training.load_checkpoint = original
        checkpointing.torch = torch


def _verify(directory: str) -> None:
    """The check of the checkpoint directory megatron.training is about to read (collective)."""
    if not os.path.isdir(directory):
        return  # megatron names what is missing
    problems = manifest.verify_once(directory)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {directory} is corrupt: {manifest.summary(problems)}")


def check_checkpoint_flags(args) -> None:
    """What megatron would load that nothing here can verify, refused with a signing key:
    node-local non-persistent checkpoints (``--non-persistent-ckpt-type local``, read by
    nvidia-resiliency-ext's own manager)."""
    if signing.key() is not None and getattr(args, "non_persistent_ckpt_type", None) == "local":
        raise FlagError(
            f"--non-persistent-ckpt-type local with {signing.KEY_ENV}: megatron reads node-local "
            "checkpoints through nvidia-resiliency-ext's manager, which nothing here verifies "
            "against a signed manifest; use --non-persistent-ckpt-type global, or none")


def main(argv=None, *, entry_point: bool = False) -> int:
    """Parse Megatron-LM's flags and mcore_ext's, build the config, run ``pretrain``. A mistake
    in the flags is one ``error:`` line (the first rank) and exit code 2, before any collective.

    The stop signals are recorded from here on (``cli.ExitSignalHandler``; ``python -m
    mcore_ext.torchrun`` starts this entry with them held while it imports): with
    ``--exit-signal-handler`` a recorded one, and any later one, goes to megatron's handler as
    ``--exit-signal`` once megatron has installed it (megatron saves after the iteration and
    exits); without it a recorded one ends the process once the flags are read. ``entry_point``:
    the process's own entry, so stop signals after the exit code is decided are ignored."""
    with ExitSignalHandler(ignore_on_exit=entry_point) as signals:
        return _main(argv, signals)


def _main(argv, signals) -> int:
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    def usage_error(message) -> int:
        # The ranks but the first wait there for the agent to stop them (report_error, which
        # lets a stop signal end them again); a signal recorded here already ends this rank now.
        if not is_first_rank():
            signals.release()
        return report_error(message)

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    _mcore_compat.skip_dataset_helper_compilation()
    # megatron installs its --exit-signal-handler handler as it parses the flags
    # (set_global_variables): a stop signal recorded before goes to it then.
    with _cpu_compat.megatron_training_on_cpu(), \
            _mcore_compat.after_megatron_signal_handler(signals.hand_over):
        try:
            with warnings.catch_warnings():
                # --mtp-num-layers with a pattern without '/': megatron's HybridModel would have
                # no MTP; this entry adds the depths and says so (_mtp_depths_added).
                warnings.filterwarnings("ignore", message=MEGATRON_NO_MTP_PATTERN)
                args = parse_and_validate_args(
                    extra_args_provider=add_mcore_ext_args,
                    args_defaults=_default_tokenizer(sys.argv[1:]),
                )
            notes = attention_flags(args)
            check_learning_rate_schedule(args)
            check_data_flags(args)
            check_checkpoint_flags(args)
            if args.hybrid_layer_pattern is not None:
                model_config = gated_hybrid_config_from_args(
                    args, **given_layer_flags(sys.argv[1:]))
                notes.append(_mtp_depths_added(args, model_config.hybrid_layer_pattern))
            else:
                model_config = gated_gpt_config_from_args(args)
                notes.append(gpt_deprecation_notice(
                    "--hybrid-layer-pattern (one '*-' per layer, '*E' for a MoE layer) builds "
                    "its successor, HybridModel"))
            container = pretrain_cfg_container_from_args(args, model_config)
        except (AssertionError, ValueError) as err:  # megatron's checks of the flags, and ours
            return usage_error(_message(err))
        if not args.exit_signal_handler:
            signals.release()  # a signal ends the run at once, one that came already now
        if is_first_rank():
            for note in filter(None, notes):
                print(f"mcore_ext: {note}", flush=True)
        try:
            with verified_loads():
                pretrain(
                    container,
                    train_valid_test_datasets_provider,
                    ModelType.encoder_or_decoder,
                    forward_step,
                )
        except CheckpointCorruptError as err:  # every rank found the same (verify_checkpoint)
            return usage_error(str(err))
        except BaseException as err:  # torch's CheckpointException is not an Exception
            refused = refusal_in(err)  # a checkpoint pickle that would run code (safe_pickle)
            if refused is None:
                raise
            return usage_error(one_line(refused))
    return 0


def _mtp_depths_added(args, pattern: str) -> str | None:
    """The line saying that ``--mtp-num-layers`` added its depths to ``--hybrid-layer-pattern``
    (the model's ``pattern``; None where the pattern had them). ``args`` then holds the model's
    pattern, which megatron's FLOPs count and the checkpoint's ``args`` read: one run, either
    spelling."""
    if pattern == args.hybrid_layer_pattern:
        return None
    given, args.hybrid_layer_pattern = args.hybrid_layer_pattern, pattern
    return (f"--mtp-num-layers {args.mtp_num_layers} with --hybrid-layer-pattern {given!r}: "
            f"each MTP depth is '/{MTP_DEPTH}' (one dense GPT layer), the model's pattern is "
            f"{pattern!r}")


def given_layer_flags(argv) -> dict:
    """``num_layers`` and ``mtp_num_layers``: the ``--num-layers`` and ``--mtp-num-layers`` in
    ``argv`` (megatron's parser takes no abbreviations), None where not given. megatron's
    validation replaces them with what ``--hybrid-layer-pattern`` counts (its layers; its ``/``
    MTP depths, where it has some), warning."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--num-layers", "--mtp-num-layers"):  # megatron's parser has accepted them
        parser.add_argument(flag, type=int)
    return vars(parser.parse_known_args(argv)[0])


def _default_tokenizer(argv) -> dict:
    """Megatron-LM's GPT default tokenizer unless the flags name one (megatron warns on every
    rank when a flag overrides a default given here)."""
    named = any(arg.split("=")[0] == "--tokenizer-type" for arg in argv)
    return {} if named else {"tokenizer_type": "GPT2BPETokenizer"}


def _message(err: BaseException) -> str:
    """The error's text; an assert without one (megatron has many) says where it failed."""
    if str(err):
        return str(err)
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"a check failed at {frame.filename}:{frame.lineno}: {frame.line}"


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
