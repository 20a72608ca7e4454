"""HF Step-3.5 directory <-> the launcher's distributed checkpoints (``python -m mcore_ext.hf``).

``import_checkpoint`` writes ``<ckpt>/iter_0000000/`` in the launcher's format (megatron
dist_checkpointing, torch_dist, the same ``{"model": ...}`` state the launcher saves) with a
``config.yaml`` of the model and the HF ``hf_config.json`` it came from, then the tracker file,
through the launcher's own save protocol (``mcore_ext.checkpoint.saving``: a ``.saving.``
directory, a manifest of checksums, a rename, the tracker last), so a killed import leaves
nothing that looks like a checkpoint. The HF folder's tokenizer files (``TOKENIZER_FILES``: what
transformers' ``AutoTokenizer`` reads, the chat template included) are copied into
``<ckpt>/iter_0000000/tokenizer/`` in the same save, and the ``config.yaml``'s
``data.tokenizer`` names that folder, so ``data.source: chat`` renders with the model's own chat
template. The launcher loads it at any TP / PP as weights only
(``checkpoint.load: <ckpt>``; it holds no optimizer state, so training starts at iteration 0).

``export_checkpoint`` reads a launcher checkpoint (a save directory or one ``iter_*`` directory),
verifies its files, rebuilds the model from its ``config.yaml``, and writes the HF layout with
``save_pretrained`` (with the run's tokenizer files, when ``data.tokenizer`` is a folder) into a
staging folder that takes the target's place at the end. A target that holds files is refused
unless ``overwrite``.
"""

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from mcore_ext import lora
from mcore_ext._cpu_compat import cuda_to_cpu
from mcore_ext.checkpoint import adapters as adapter_checkpoint
from mcore_ext.checkpoint import manifest, safe_pickle, saving, signing
from mcore_ext.checkpoint.architecture import HYBRID, saved_architecture
from mcore_ext.checkpoint.directory import (
    TRACKER,
    find_checkpoint,
    iteration_dir,
    why_not_a_checkpoint,
)
from mcore_ext.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from mcore_ext.hf import step37, vision_layout
from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.hf.convert import (
    PROVENANCE_NAME,
    HFFolder,
    check_parallel,
    load_pretrained,
    save_pretrained,
)
from mcore_ext.precision import precision_of
from mcore_ext.runtime import device


def launcher_model_section(spec: Step35Config, seq_length: int, multiple: int) -> dict:
    """The launcher's ``model:`` keys for ``spec`` (see mcore_ext/run_config/schema.py)."""
    fields = spec.transformer_config_fields()
    section = dict(
        seq_length=seq_length,
        swiglu=fields["gated_linear_unit"],
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        make_vocab_size_divisible_by=multiple,
    )
    # Keys named as in GatedTransformerConfig take the config's values. A Step-3.5 key the
    # launcher's schema lacks is dropped only where the value is megatron's default (the launcher
    # builds the same model).
    from mcore_ext.config import GatedTransformerConfig
    from mcore_ext.run_config import ModelConfig

    schema = {f.name for f in dataclasses.fields(ModelConfig)}
    defaults = {f.name: f.default for f in dataclasses.fields(GatedTransformerConfig)}
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "head_wise_attn_gate",
                "head_wise_attn_gate_init_bias", "add_qkv_bias",
                "normalization", "rotary_base", "rotary_percent", "layernorm_epsilon",
                "layernorm_zero_centered_gamma", "qk_layernorm", "softmax_scale", "layer_types",
                "sliding_window", "sliding_num_attention_heads", "sliding_num_query_groups",
                "sliding_rotary_base", "sliding_rotary_percent", "swiglu_limits",
                # MoE and MTP (megatron-core's own field names)
                "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_layer_freq",
                "moe_router_score_function", "moe_router_enable_expert_bias",
                "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_expert_swiglu_limits",
                "mtp_num_layers"):
        if key not in fields:
            continue
        if key in schema:
            section[key] = fields[key]
        elif fields[key] != defaults.get(key):
            raise HFConfigError(
                f"the launcher's model section has no key {key!r}, which this model needs "
                f"({key}={fields[key]!r})"
            )
    return section


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt",
                   "processor_config.json", "preprocessor_config.json")
"""The files of a Hugging Face tokenizer, and of a processor around it (a vision-language
model's: ``AutoProcessor`` reads processor_config.json or preprocessor_config.json with the
tokenizer and chat template), that ``import`` copies beside the checkpoint and ``export``
writes."""

TOKENIZER_DIR = "tokenizer"


def tokenizer_files(hf_dir: str) -> list[str]:
    """The ``TOKENIZER_FILES`` in ``hf_dir``; [] when it holds no tokenizer (no
    tokenizer_config.json, tokenizer.json or tokenizer.model)."""
    present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]
    loadable = {"tokenizer_config.json", "tokenizer.json", "tokenizer.model"}
    return present if loadable & set(present) else []


def copy_tokenizer(hf_dir: str, names: list[str], target: str) -> None:
    """Copy ``names`` from ``hf_dir`` into ``target`` (created); the HF folder is only read."""
    os.makedirs(target)
    for name in names:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(target, name))


def import_checkpoint(hf_dir: str, ckpt_dir: str, *, dtype: torch.dtype | None = None,
                      seq_length: int | None = None, make_vocab_size_divisible_by: int = 128,
                      backend: str = "sdpa", architecture: str | None = None,
                      vision: bool = False) -> str:
    """HF directory -> ``<ckpt_dir>/iter_0000000`` (call after ``init_parallel``, any TP / PP).

    Refuses (before writing anything) a ``ckpt_dir`` that already holds a checkpoint, and any
    problem ``load_pretrained`` finds. The HF folder's tokenizer, if it has one, is copied into
    the iteration directory's ``tokenizer/`` (checksummed in its manifest) and becomes the
    config's ``data.tokenizer``. ``architecture`` ``hybrid`` writes megatron's HybridModel
    (``model.architecture: hybrid`` in the config; MTP layers become the pattern's ``/*-``
    depths), ``gpt`` its GPTModel; None: the one the installed megatron-core recommends
    (``run_config.schema.recommended_architecture``). Either class is built once and filled from
    the HF folder, whose config and safetensors headers are read once (``HFFolder``): a rank
    holds one model. ``vision`` (a Step-3.7 folder): the vision-language model, its tower and
    projector in the checkpoint and ``model.vision`` (the folder's ``VisionConfig``, the tower
    frozen) in the config.
    Returns the iteration directory.
    """
    folder = HFFolder(hf_dir)
    try:
        return _import(folder, ckpt_dir, dtype, seq_length, make_vocab_size_divisible_by,
                       backend, architecture, vision)
    finally:
        folder.close()


def _import(folder, ckpt_dir, dtype, seq_length, make_vocab_size_divisible_by, backend,
            architecture, vision) -> str:
    hf_dir, raw, spec, file_dtype = folder.directory, folder.raw, folder.spec, folder.dtype
    check_parallel(spec, parallel_state.get_tensor_model_parallel_world_size())
    from mcore_ext.run_config import PretrainConfig, build
    from mcore_ext.run_config.schema import recommended_architecture

    architecture = architecture or recommended_architecture()
    if architecture not in ("gpt", "hybrid"):
        raise HFConfigError(f"--architecture {architecture!r}: expected gpt or hybrid")
    _refuse_on_every_rank(
        f"{ckpt_dir} already holds a checkpoint ({TRACKER}); choose a new directory"
        if os.path.exists(os.path.join(ckpt_dir, TRACKER)) else None)
    dtype = dtype or file_dtype
    seq_length = seq_length or min(spec.max_position_embeddings, 4096)

    directory = iteration_dir(ckpt_dir, 0)
    tokenizer = tokenizer_files(hf_dir)
    data = {"tokenizer": os.path.join(os.path.abspath(directory), TOKENIZER_DIR)
            } if tokenizer else {}
    if vision:
        from mcore_ext.hf.config.step3p7 import vision_config

        if not step37.is_step37(raw):
            raise HFConfigError(f"{hf_dir}: --vision needs a Step-3.7 folder (model_type "
                                f"'step3p7'), its model_type is {raw.get('model_type')!r}")
        vision = vision_config(raw)
    cfg = build(PretrainConfig, {
        "model": {**launcher_model_section(spec, seq_length, make_vocab_size_divisible_by),
                  "architecture": architecture,
                  **({"vision": dataclasses.asdict(vision)} if vision else {})},
        "training": {"precision": precision_of(dtype)},
        "data": data,
        "checkpoint": {"load": os.path.abspath(ckpt_dir), "finetune": True},
    })
    model = load_pretrained(folder, architecture=architecture, backend=backend, dtype=dtype,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                            max_sequence_length=seq_length, vision=vision or False)
    partial = saving.begin(directory)
    state = {
        "model": model.sharded_state_dict(),
        "iteration": 0,
        "consumed_samples": 0,
        "weights_only": True,  # no optimizer state: the launcher loads the weights only
    }
    failure = None
    try:
        dist_checkpointing.save(state, partial)
        if tokenizer and torch.distributed.get_rank() == 0:  # in the manifest, as rank 0's
            copy_tokenizer(hf_dir, tokenizer, os.path.join(partial, TOKENIZER_DIR))
    except (Exception, CheckpointException) as err:  # reported below, on every rank
        failure = err
    saving.raise_unless_saved(failure, partial, f"checkpoint save to {directory} failed")
    files = {"config.yaml": cfg.to_yaml(), PROVENANCE_NAME: json.dumps(raw, indent=2)}
    if step37.is_step37(raw) and torch.distributed.get_rank() == 0:  # rank 0 writes the files
        # The folder's untrained tensors and other files, fingerprinted for the export.
        files[step37.SOURCE_NAME] = step37.write_source(step37.describe_source(
            hf_dir, folder.source.reader))
    saving.publish(partial, directory, root=ckpt_dir, iteration=0, files=files)
    return directory


def resolve_iteration_dir(ckpt_dir: str) -> str:
    """A save directory (its latest complete iteration) or an ``iter_*`` directory itself."""
    found = find_checkpoint(ckpt_dir)
    if found is None:
        raise CheckpointNotFoundError(f"{ckpt_dir} holds no checkpoint: "
                                      f"{why_not_a_checkpoint(ckpt_dir)}")
    return found.directory


def find_provenance(directory: str, cfg, name: str = PROVENANCE_NAME) -> dict | None:
    """The HF config an imported checkpoint came from (``name``: or another file an import
    writes beside it, e.g. ``step37.SOURCE_NAME``): beside it, or up its ``checkpoint.load``
    chain (a run fine-tuned from an import points there). With a signing key, only as signed
    (``manifest.read_file``), and every checkpoint of the chain up to it intact as signed
    (``manifest.check_listed``: a signed file deleted anywhere in it, the one sought among them,
    refuses the export instead of being passed over); one in a save directory, outside every
    checkpoint, is refused, and so is a ``checkpoint.load`` that holds no checkpoint any more
    (what the export needs of it cannot be known)."""
    signed = signing.key() is not None
    seen = set()
    while directory and directory not in seen:
        seen.add(directory)
        listed = manifest.check_listed(directory) if signed else {}
        if name in listed or os.path.exists(os.path.join(directory, name)):
            return json.loads(manifest.read_file(directory, name))
        outside = os.path.join(os.path.dirname(os.path.abspath(directory)), name)
        if os.path.exists(outside):
            if signed:
                raise CheckpointCorruptError(
                    f"{outside} is outside the signed checkpoint {directory} (no signature "
                    f"covers it, and the export would build its model from it): move it into "
                    f"the checkpoint and sign that again, or export without {signing.KEY_ENV}")
            with open(outside) as f:
                return json.load(f)
        load = cfg.checkpoint.load
        try:
            directory = resolve_iteration_dir(load) if load else None
        except FileNotFoundError as err:
            if signed:
                raise CheckpointCorruptError(
                    f"checkpoint {directory} was trained from checkpoint.load={load} (its "
                    f"config.yaml), which holds no checkpoint now ({err}): the export cannot "
                    f"check what it came from; restore it, or export without {signing.KEY_ENV}"
                    ) from None
            return None
        if directory:
            cfg = _read_launcher_config(directory)
    return None


def _read_launcher_config(directory: str):
    from mcore_ext.run_config import PretrainConfig, build

    # config.yaml: the model to build, LoRA's rank and alpha (the merge's scale); signed with a key
    return build(PretrainConfig, yaml.safe_load(manifest.read_file(directory, "config.yaml")))


@safe_pickle.refusals()  # a pickle that would run code: CheckpointUnsafeError, one line
def export_checkpoint(ckpt_dir: str, hf_dir: str, *, vocab_size: int | None = None,
                      max_shard_bytes: int = 2 * 1024**3, backend: str = "sdpa",
                      overwrite: bool = False, adapter: bool = False) -> None:
    """Launcher checkpoint -> HF directory (call after ``init_parallel``, any TP / PP).

    ``vocab_size`` (the rows to keep of the padded embedding) defaults to the HF config the
    checkpoint was imported from, else the launcher tokenizer's size; HFConfigError when neither
    is known (a tokenizer that does not load is reported, not replaced by the padded size).
    An ``hf_dir`` with files in it is refused (FileExistsError) unless ``overwrite``: then the
    export in it is replaced and its other files stay. A checkpoint whose files differ from its
    manifest is refused (CheckpointCorruptError).

    A LoRA run's checkpoint (its config.yaml's ``lora.rank`` > 0) exports the merged model
    (W + (alpha / r) B A); with ``adapter`` the adapters alone in PEFT's format
    (``mcore_ext.hf.adapter``). Its adapters-only checkpoint takes the base weights from the base
    checkpoint it refers to (``mcore_ext.checkpoint.adapters``), which must be unchanged.
    """
    _refuse_on_every_rank(_target_problem(hf_dir, overwrite))
    from mcore_ext import checkpoint
    from mcore_ext.models import build_gpt_model, build_hybrid_model
    from mcore_ext.models.hybrid import copy_weights
    from mcore_ext.run_config import ParallelismConfig
    from mcore_ext.run_config.megatron_configs import transformer_config

    directory = resolve_iteration_dir(ckpt_dir)
    problems = manifest.verify_checkpoint(directory)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {directory} is corrupt: {manifest.summary(problems)}")
    cfg = _read_launcher_config(directory)
    vision = cfg.model.vision
    adapters = lora.LoraConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                               dropout=cfg.lora.dropout, targets=cfg.lora.targets)
    if adapter and not adapters.enabled:
        raise HFConfigError(f"{directory}: --adapter: the checkpoint holds no LoRA adapters "
                            f"(lora.rank={cfg.lora.rank} in its config.yaml)")
    # An adapters-only checkpoint (a LoRA run over a base): the model's weights are the base's.
    reference = dist_checkpointing.load_common_state_dict(directory).get(
        adapter_checkpoint.BASE_KEY)
    base_dir = directory if reference is None else adapter_checkpoint.find_base(
        reference, directory, cfg.checkpoint.load)
    metadata = dist_checkpointing.load_tensors_metadata(base_dir)
    hybrid = saved_architecture(metadata) == HYBRID
    embedding = metadata.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise HFConfigError(f"{directory}: no embedding.word_embeddings.weight (not a GPT model)")
    dtype = embedding.dtype
    cfg.training.precision = precision_of(dtype)
    # The layout the checkpoint was trained at (TP, PP, CP, SP, EP, ...) is not the export's: a
    # fresh parallelism section at this process's sizes (the checkpoint is layout-free).
    cfg.parallelism = ParallelismConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    config = transformer_config(cfg, use_cpu_initialization=True, perform_initialization=False)

    provenance = find_provenance(directory, cfg)
    extra = {}
    if provenance is not None:
        source = Step35Config.from_hf_dict(provenance)
        if step37.is_step37(provenance) and vocab_size not in (None, source.vocab_size):
            raise HFConfigError(f"--vocab-size {vocab_size}: a Step-3.7 export keeps its "
                                f"folder's config.json (text_config.vocab_size="
                                f"{source.vocab_size})")
        vocab_size = vocab_size or source.vocab_size
        extra = source.extra
    if vision is not None:
        _check_vision(directory, vision, provenance)
    folder = None  # a Step-3.7 import's folder: its untrained tensors and files are kept
    written = []  # its tensors written from the model instead: the tower's and projector's
    if provenance is not None and step37.is_step37(provenance) and not adapter:
        folder = find_provenance(directory, cfg, step37.SOURCE_NAME)
        if folder is None:
            raise HFConfigError(f"{directory}: imported from a Step-3.7 folder but no "
                                f"{step37.SOURCE_NAME} says which (imported before it was "
                                "written): import the folder again")
        if vision is not None:
            written = vision_layout.hf_names(vision, list(folder["tensors"]))
        # Every rank waits for rank 0's reading of the folder (one reader of its bytes).
        _refuse_on_every_rank(step37.check_source(folder, written) if _rank() == 0 else None,
                              HFConfigError)
    if vocab_size is None:
        vocab_size = _tokenizer_vocab(cfg)
    if vocab_size > embedding.global_shape[0]:
        raise HFConfigError(f"vocab_size={vocab_size} is larger than the checkpoint's "
                            f"embedding ({embedding.global_shape[0]} rows)")
    # Refuse what the layout cannot hold before building anything.
    exported = Step35Config.from_transformer_config(config, vocab_size=vocab_size,
                                                    max_position_embeddings=cfg.model.seq_length)
    if folder is not None and _text_model(exported) != _text_model(source):
        raise HFConfigError(f"{directory}: its model is not the text model of the Step-3.7 "
                            f"folder it was imported from ({folder['path']}), whose config.json "
                            "the export keeps")

    build = dict(
        vocab_size=embedding.global_shape[0],
        max_sequence_length=cfg.model.seq_length,
        backend=backend,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        **({"vision": vision} if vision is not None else {}),
    )
    with cuda_to_cpu():  # megatron moves tied output weights with .cuda() (no-op on GPUs)
        model = (build_hybrid_model if hybrid else build_gpt_model)(config, **build)
    model.to(device())  # loaded where the process computes; save_pretrained gathers on the CPU
    lora.apply_lora(model, adapters)  # a LoRA run's adapters load with the base weights
    state = model.sharded_state_dict()
    if reference is None:
        loaded = checkpoint.load({"model": state}, directory, in_place=True)
    else:
        loaded = checkpoint.load({"model": {k: v for k, v in state.items()
                                            if lora.ADAPTER_KEY in k}}, directory, in_place=True)
        loaded["model"].update(checkpoint.load(
            {"model": {k: v for k, v in state.items() if lora.ADAPTER_KEY not in k}}, base_dir,
            in_place=True)["model"])
    try:  # strict: a parameter left out would be exported uninitialised
        model.load_state_dict(loaded["model"], strict=True)
    except RuntimeError as err:
        raise HFConfigError(f"{directory}: the checkpoint does not fill the model ({err})"
                            ) from None
    del loaded
    if hybrid:  # the HF layout is written from the GPTModel of the same weights and adapters
        with cuda_to_cpu():
            gpt = build_gpt_model(config, **build)
        gpt.to(device())
        lora.apply_lora(gpt, adapters)  # each adapter sits where GPT's layer has its linear
        copy_weights(model, gpt, to_hybrid=False)
        model = gpt
    if adapter:
        from mcore_ext.hf.adapter import save_adapter

        # A Step-3.7 import's adapters sit in the stock class's text model.
        root = (step37.NATIVE_PREFIX if provenance is not None and step37.is_step37(provenance)
                else "model.")
        save_adapter(model, hf_dir, adapters, root=root)
        return
    lora.merge_lora(model, remove=True)
    if provenance is not None:
        model.hf_config = source.replace(vocab_size=vocab_size)
    save_pretrained(model, hf_dir, vocab_size=vocab_size, max_shard_bytes=max_shard_bytes,
                    extra_config=extra, extra_files=_tokenizer_of(cfg),
                    kept=step37.KeptTensors(folder, written) if folder is not None else None)


def _check_vision(directory: str, vision, provenance: dict | None) -> None:
    """A checkpoint with ``model.vision`` exports into the layout of the Step-3.7 folder it was
    imported from (``hf import --vision``), whose config.json the export keeps: that folder's
    tower (``vision_config``) must be the model's, ``freeze`` aside (HFConfigError naming the
    first setting that differs)."""
    from mcore_ext.hf.config.step3p7 import vision_config

    if provenance is None or not step37.is_step37(provenance):
        raise HFConfigError(
            f"{directory}: its model has a vision tower and projector (model.vision) but it was "
            "not imported from a Step-3.7 folder (hf import --vision): the export writes them "
            "into that folder's layout, beside its config.json")
    folder = dataclasses.asdict(vision_config(provenance))
    for key, value in dataclasses.asdict(vision).items():
        if key != "freeze" and folder[key] != value:
            raise HFConfigError(
                f"{directory}: model.vision.{key}={value!r}, the Step-3.7 folder it was imported "
                f"from has {folder[key]!r} (its config.json, which the export keeps, would not "
                "describe the tower)")


def _text_model(spec: Step35Config) -> dict:
    """What makes the function of ``spec``'s main model (its MTP layers aside: an import's run
    may leave them out, and the stock Step-3.7 class does not build them)."""
    main = spec.replace(num_mtp_layers=0, mtp_layer_types=None, mtp_swiglu_limits=None)
    return {**main.transformer_config_fields(), "vocab_size": spec.vocab_size,
            "tie_word_embeddings": spec.tie_word_embeddings}


def _tokenizer_of(cfg) -> dict:
    """The files of the run's Hugging Face tokenizer ({name: bytes}), when ``data.tokenizer`` is
    a folder holding one (an imported checkpoint's ``tokenizer/``, or the folder an SFT run named),
    so that the export is a model transformers loads with its tokenizer; {} for the byte tokenizer
    or a hub name (nothing on disk to copy). With a signing key, a folder inside a checkpoint (an
    import's ``tokenizer/``) is read only as signed there (``manifest.read_signed_folder``:
    each file's bytes against its signed SHA-256 as they are read; one deleted, changed or added
    refuses the export)."""
    folder = cfg.data.tokenizer
    if not (isinstance(folder, str) and os.path.isdir(folder)):
        return {}
    signed = manifest.read_signed_folder(
        folder, lambda names: [n for n in TOKENIZER_FILES if n in names])
    if signed is not None:
        return signed
    files = {}
    for name in tokenizer_files(folder):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files


def _target_problem(hf_dir: str, overwrite: bool) -> str | None:
    """Why the export may not go to ``hf_dir``: a file, or a folder with files in it unless
    ``overwrite``; None when it may."""
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        return f"{hf_dir} is a file, not a folder for the export"
    held = sorted(os.listdir(hf_dir)) if os.path.isdir(hf_dir) else []
    if held and not overwrite:
        more = f", ... {len(held)} entries" if len(held) > 3 else ""
        return (f"{hf_dir} is not empty ({', '.join(held[:3])}{more}): pass --overwrite "
                "(overwrite=True) to replace the export in it (its other files stay), or choose "
                "another folder")
    return None


def _refuse_on_every_rank(problem: str | None, error_class=FileExistsError) -> None:
    """Collective: FileExistsError on every rank when any rank found ``problem`` (the first
    rank's that did), before anything is written. Every rank then raises the same message, so
    the entry point says it once (``on_every_rank``); a folder that only some ranks see (node
    local) is refused on all of them."""
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        error = error_class(found)
        error.on_every_rank = True  # one rank reporting it is enough (mcore_ext.cli)
        raise error


def _tokenizer_vocab(cfg) -> int:
    """The launcher tokenizer's vocabulary size; HFConfigError naming it when it cannot be
    loaded here (megatron's padded rows are not the model's vocabulary)."""
    from mcore_ext.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(cfg.data.tokenizer).vocab_size
    except Exception as err:  # any loader failure: reported, never replaced by a guess
        raise HFConfigError(
            f"the vocabulary size is not known: the checkpoint has no hf_config.json and its "
            f"tokenizer (data.tokenizer={cfg.data.tokenizer!r}) does not load here "
            f"({type(err).__name__}: {err}); pass --vocab-size (vocab_size=)"
        ) from None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
