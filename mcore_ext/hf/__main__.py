"""python -m mcore_ext.hf import HF_DIR CKPT_DIR  |  export CKPT_DIR HF_DIR  |  plan HF_DIR

Runs as one process (TP = PP = 1) or under torchrun at any TP / PP / EP (``--tp``, ``--pp``,
``--ep``, ``--etp``). ``plan`` (HF_DIR or its config.json; no weights read) prints parameters and
memory per rank at ``--tp --pp --ep --dp`` (a Step-3.7 model's vision tower and projector with
``--vision [frozen|trained]``); with ``--seq`` activations too (``--cp --vpp
--recompute --micro-batch``), with ``--search`` the layouts with the fewest GPUs that fit. Errors
are one ``error:`` line and exit code 2, with nothing written; under torchrun the first rank
prints a mistake every rank finds (a layout the world size does not divide, a bad config), a
rank's own failure names the rank.
"""

import argparse
import os
import sys
import time

from mcore_ext.cli import gpt_deprecation_notice, is_first_rank, quiet_known_noise, report_error
from mcore_ext.precision import DTYPES

_DTYPES = {"auto": None, **DTYPES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_ext.hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF Step-3.5 directory -> launcher checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    imp.add_argument("--dtype", choices=list(_DTYPES), default="auto",
                     help="parameter dtype of the checkpoint (auto: the safetensors' dtype)")
    imp.add_argument("--seq-length", type=int, default=None,
                     help="the launcher's model.seq_length (default: min(max positions, 4096))")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    imp.add_argument("--vision", action="store_true",
                     help="a Step-3.7 folder: import its vision tower and projector too (the "
                          "vision-language model; config.yaml's model.vision, tower frozen)")
    imp.add_argument("--architecture", choices=["gpt", "hybrid"], default=None,
                     help="the launcher's model.architecture of the checkpoint: megatron's "
                          "GPTModel or HybridModel (default: the one the installed "
                          "megatron-core recommends, hybrid from 0.19; export reads either)")
    exp = sub.add_parser("export", help="launcher checkpoint -> HF Step-3.5 directory")
    exp.add_argument("ckpt_dir")
    exp.add_argument("hf_dir")
    exp.add_argument("--vocab-size", type=int, default=None,
                     help="rows of the padded vocabulary to keep (default: the imported HF "
                          "config's, else the launcher tokenizer's)")
    exp.add_argument("--max-shard-size", type=float, default=2.0, help="GiB per safetensors file")
    exp.add_argument("--overwrite", action="store_true",
                     help="replace the export in a folder that holds one (config.json, weights); "
                          "its other files stay (default: a folder with files is refused)")
    exp.add_argument("--adapter", action="store_true",
                     help="a LoRA run's adapters alone, in Hugging Face PEFT's format "
                          "(adapter_config.json, adapter_model.safetensors); default: the "
                          "merged model")
    pln = sub.add_parser("plan", help="parameters and memory per rank at a parallel layout")
    pln.add_argument("hf_dir", help="an HF model directory or its config.json")
    pln.add_argument("--dp", type=int, default=1, help="data-parallel size")
    pln.add_argument("--no-distributed-optimizer", action="store_true",
                     help="optimizer state on every DP rank (default: sharded over DP)")
    pln.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    pln.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    pln.add_argument("--vision", nargs="?", const="frozen", choices=("frozen", "trained"),
                     help="a Step-3.7 model: its vision tower and projector too, the tower "
                          "frozen (as import --vision writes it; the default) or trained")
    for p in (imp, exp):
        p.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel size (run under torchrun with a multiple of TP x PP "
                            "processes)")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (as --tp)")
    pln.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the plan")
    pln.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the plan")
    from mcore_ext.plan.cli import add_activation_args

    add_activation_args(pln)
    for p in (imp, exp, pln):
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
        p.add_argument("--etp", type=int, default=None,
                       help="expert-tensor-parallel size (default: --tp)")
    args = parser.parse_args(argv)
    quiet_known_noise()
    if args.command == "plan":
        return _plan(args)
    layout_error = _layout_error(args, int(os.environ.get("WORLD_SIZE", "1")))
    if layout_error:  # before any process group: every rank finds it, the first says it
        return report_error(layout_error)

    import mcore_ext

    start = time.perf_counter()
    try:
        out = _run(args)
    except BaseException as err:  # torch's CheckpointException is not an Exception
        if not isinstance(err, _user_errors()):
            raise
        # Conversion errors (mcore_ext.hf's, megatron's checkpoint and process-group errors,
        # files): one line for the user; nothing was written (the writers stage their files).
        from mcore_ext.checkpoint.errors import one_line

        return report_error(one_line(err), seen_by_every_rank=_seen_by_every_rank(err))
    finally:
        mcore_ext.destroy_parallel()
    print(f"[hf] {args.command}: wrote {out} in {time.perf_counter() - start:.1f}s")
    if args.command == "export" and args.adapter and is_first_rank():
        from mcore_ext.hf.adapter import MTP_ADAPTER_WEIGHTS

        if os.path.isfile(os.path.join(out, MTP_ADAPTER_WEIGHTS)):
            print(f"[hf] export --adapter: the MTP layers' adapters are in "
                  f"{os.path.join(out, MTP_ADAPTER_WEIGHTS)}, beside the PEFT adapter (peft and "
                  "vLLM load the decoder's; lora.init_from reads both)", flush=True)
    if args.command == "import" and args.architecture == "gpt" and is_first_rank():
        notice = gpt_deprecation_notice(
            "--architecture hybrid writes a HybridModel checkpoint (model.architecture: hybrid)")
        if notice:
            print(f"[hf] import --architecture gpt: {notice}", flush=True)
    return 0


def _run(args) -> str:
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=args.tp,
                            pipeline_model_parallel_size=args.pp,
                            expert_model_parallel_size=args.ep,
                            expert_tensor_parallel_size=args.etp)
    with mcore_ext.cuda_to_cpu():
        if args.command == "import":
            from mcore_ext.hf.checkpoint import import_checkpoint

            return import_checkpoint(
                args.hf_dir, args.ckpt_dir, dtype=_DTYPES[args.dtype],
                seq_length=args.seq_length,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                architecture=args.architecture, vision=args.vision)
        from mcore_ext.hf.checkpoint import export_checkpoint

        export_checkpoint(args.ckpt_dir, args.hf_dir, vocab_size=args.vocab_size,
                          max_shard_bytes=int(args.max_shard_size * 1024**3),
                          overwrite=args.overwrite, adapter=args.adapter)
        return args.hf_dir


def _layout_error(args, world_size: int) -> str | None:
    """What init_parallel would refuse, found without a process group."""
    sizes = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp or args.tp)
    for name, size in sizes.items():
        if size < 1:
            return f"--{name} {size}: expected a positive integer"
    for names in (("tp", "pp"), ("etp", "ep", "pp")):
        product = 1
        for name in names:
            product *= sizes[name]
        if world_size % product:
            terms = " x ".join(f"--{n} {sizes[n]}" for n in names)
            return (f"{world_size} process(es) are not divisible by {terms} = {product}: run "
                    f"under torchrun --nproc_per_node=N with N a multiple of {product}")
    return None


def _seen_by_every_rank(err: BaseException) -> bool:
    """Errors every rank raises alike: configs and missing inputs (each rank reads the same
    files), errors gathered over the ranks (raise_unless_all_ok, torch's and megatron's checkpoint
    errors). Others (a shard only this rank reads, a failed write) name their rank."""
    import yaml
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from mcore_ext.checkpoint import GateLayoutMismatch
    from mcore_ext.hf.config import HFConfigError
    from mcore_ext.run_config import ConfigError

    return getattr(err, "on_every_rank", False) or isinstance(err, (
        HFConfigError, ConfigError, GateLayoutMismatch, yaml.YAMLError, CheckpointingException,
        CheckpointException, FileNotFoundError, NotADirectoryError))


def _user_errors() -> tuple:
    """What a conversion raises for bad input or a failed read / write (HFConfigError,
    SafetensorsError, ConfigError, GateLayoutMismatch are ValueErrors; CheckpointLoadError and
    the all-ranks errors RuntimeErrors); torch's CheckpointException is a BaseException."""
    import yaml
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    return (ValueError, RuntimeError, OSError, yaml.YAMLError, CheckpointingException,
            CheckpointException)


def _plan(args) -> int:
    from mcore_ext.hf import plan
    from mcore_ext.hf.config import HFConfigError, Step35Config
    from mcore_ext.userfiles import read_json

    path = args.hf_dir
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        raw = read_json(path, HFConfigError)
        spec = Step35Config.from_hf_dict(raw)
        vision = None
        if args.vision:
            from mcore_ext.hf.config.step3p7 import vision_config

            vision = vision_config(raw, freeze=args.vision == "frozen")
        if args.seq or args.search:  # activations too: mcore_ext.plan's table
            from mcore_ext.plan.cli import print_plan

            if not args.seq:
                raise ValueError("--search needs --seq (tokens per sample)")
            shape = plan.shape_of(spec, vision)
            print_plan(shape, args, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dp=args.dp,
                       distributed_optimizer=not args.no_distributed_optimizer)
            return 0
        rows = plan.plan(spec, tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, etp=args.etp,
                         distributed_optimizer=not args.no_distributed_optimizer,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         vision=vision)
    except (OSError, ValueError, HFConfigError) as err:
        return report_error(str(err))
    print(plan.format_plan(spec, rows, tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp,
                           etp=args.etp, gpu_gib=args.gpu_gib, vision=vision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
