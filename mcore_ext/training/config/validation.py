"""What a runnable config is: layout, batch, schedule, precision, data and model checks.

Runs after ``overrides.build`` has type-checked every value, so the checks here are about values
and their combinations. Each error names the keys and values involved. Model rules that megatron
(or ``GatedTransformerConfig``) owns are not repeated: the last check builds the model config and
turns its refusal into a ``ConfigError``.
"""

import json
import math
import os

import torch

from mcore_ext.run_config.schema import ConfigError, DataConfig, PretrainConfig, TrainingConfig


def validate(cfg: PretrainConfig, world_size: int) -> None:
    """Check ``cfg`` for ``world_size`` ranks and fill in what it leaves to be derived.

    Fills the derived sizes (data-parallel size, micro-batches per step, head dim, query groups,
    MLP width, LR decay steps, the precision of ``auto``) so that the printed and saved config is
    fully resolved. Raises ``ConfigError`` for the first problem found.
    """
    m, p, t, o = cfg.model, cfg.parallelism, cfg.training, cfg.optimizer
    d, c = cfg.data, cfg.checkpoint
    on_gpu = _cuda_available()

    for key, value in [
        ("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads), ("model.seq_length", m.seq_length),
        ("parallelism.tensor_model_parallel_size", p.tensor_model_parallel_size),
        ("parallelism.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
        ("parallelism.context_parallel_size", p.context_parallel_size),
        ("training.micro_batch_size", t.micro_batch_size),
        ("training.global_batch_size", t.global_batch_size),
        ("training.train_iters", t.train_iters), ("logging.log_interval", cfg.logging.log_interval),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
    ]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if cfg.logging.gate_statistics and not m.head_wise_attn_gate:
        raise ConfigError("logging.gate_statistics=true records the head-wise gate's values: it "
                          "needs model.head_wise_attn_gate=true (it is false)")
    for key in ("training.exit_interval", "training.eval_interval", "checkpoint.save_interval",
                "logging.attention_probe"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (or null)")

    # Layout: world = TP x CP x PP x DP, global batch = micro batch x DP x micro-batches.
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    cp = p.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"parallel layout does not divide the world size: {world_size} ranks are not "
            f"divisible by tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size "
            f"({pp}) x context_parallel_size ({cp}) = {tp * pp * cp}"
        )
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must be divisible by 2 x "
            f"parallelism.context_parallel_size ({cp}) = {2 * cp}: each CP rank holds 2 chunks"
        )
    if cp > 1 and m.attention_backend == "local":
        raise ConfigError(
            f"parallelism.context_parallel_size={cp} needs model.attention_backend 'sdpa' or "
            "'te' (or 'auto'); megatron's local attention has no context parallelism"
        )
    dp = world_size // (tp * pp * cp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp}) = "
            f"{t.micro_batch_size * dp}"
        )
    _validate_experts(m, p, world_size)
    cfg.world_size, cfg.data_parallel_size = world_size, dp
    cfg.num_microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if m.num_layers % pp:
        raise ConfigError(
            f"model.num_layers ({m.num_layers}) must be divisible by "
            f"parallelism.pipeline_model_parallel_size ({pp})"
        )
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallelism.sequence_parallel=true needs tensor_model_parallel_size > 1")

    # Derived model sizes, filled in so that the printed / saved config is fully resolved.
    if m.kv_channels is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({m.hidden_size}) is not divisible by "
                f"model.num_attention_heads ({m.num_attention_heads}): set model.kv_channels "
                "(the head dim) explicitly"
            )
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = (
            64 * math.ceil(8 * m.hidden_size / 3 / 64) if m.swiglu else 4 * m.hidden_size
        )
    if m.recompute_granularity == "full" and m.recompute_num_layers > m.num_layers // pp:
        raise ConfigError(
            f"model.recompute_num_layers ({m.recompute_num_layers}) exceeds the layers per "
            f"pipeline stage ({m.num_layers // pp})"
        )

    if t.precision == "auto":
        t.precision = "bf16" if on_gpu else "fp32"
    if t.exit_duration_mins is not None and not t.exit_duration_mins > 0:
        raise ConfigError(f"training.exit_duration_mins={t.exit_duration_mins} must be above 0 "
                          f"(or null)")
    if t.exit_duration_mins is not None and not cfg.checkpoint.save:
        raise ConfigError(
            f"training.exit_duration_mins={t.exit_duration_mins:g} needs checkpoint.save: the "
            f"run saves there before it stops, to be resumed"
        )
    if t.exit_interval is not None and t.exit_interval > t.train_iters:
        raise ConfigError(
            f"training.exit_interval ({t.exit_interval}) is beyond training.train_iters "
            f"({t.train_iters})"
        )

    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    if o.lr_warmup_iters >= o.lr_decay_iters:
        raise ConfigError(
            f"optimizer.lr_warmup_iters ({o.lr_warmup_iters}) must be below "
            f"optimizer.lr_decay_iters ({o.lr_decay_iters})"
        )
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(
            f"optimizer.min_lr ({o.min_lr}) must be between 0 and optimizer.lr ({o.lr})"
        )

    _validate_data(d, t)
    if cfg.logging.attention_probe and d.source != "mock" and _validation_weight(d.split) == 0:
        raise ConfigError(
            f"logging.attention_probe={cfg.logging.attention_probe} measures the validation "
            f"split's first micro-batch, but data.split={d.split!r} has no validation part; give "
            "it one (e.g. 98,2,0) or set logging.attention_probe=null")
    if d.source == "chat":
        _validate_chat(cfg)
    if d.document_masking:
        if d.source not in ("files", "stdlib"):
            raise ConfigError(f"data.document_masking=true applies to text (data.source files or "
                              f"stdlib), got data.source={d.source}")
        _refuse_variable_lengths_under_pp(p)
    if c.async_save and not on_gpu:
        raise ConfigError("checkpoint.async_save=true needs a GPU (CUDA); set it to false on CPU")
    if c.finetune and not c.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load (the weights to use)")
    if c.key_file is not None:
        try:
            with open(c.key_file, "rb") as f:
                empty = not f.read().rstrip(b"\r\n")
        except OSError as err:
            raise ConfigError(f"checkpoint.key_file={c.key_file}: cannot read it ({err.strerror})")
        if empty:
            raise ConfigError(f"checkpoint.key_file={c.key_file} is empty: it must hold the key")

    if m.attention_backend == "te":  # the model is built on every rank: say it once, now
        from mcore_ext.specs import resolve_backend

        try:
            resolve_backend("te")
        except ImportError as err:
            raise ConfigError(f"model.attention_backend=te: {err}") from None
    if m.attention_kernel in ("flex", "varlen"):
        kernel = m.attention_kernel
        if cp > 1 and kernel == "varlen":  # no hardware helps: say it first
            raise ConfigError(
                f"model.attention_kernel=varlen does not support "
                f"parallelism.context_parallel_size={cp}: under context parallelism use the sdpa "
                "or flex kernel (set model.attention_kernel=sdpa or flex, or "
                "parallelism.context_parallel_size=1)"
            )
        if m.attention_backend != "sdpa":
            raise ConfigError(
                f"model.attention_kernel={kernel} is the sdpa backend's kernel: set "
                f"model.attention_backend=sdpa (got {m.attention_backend!r})"
            )
        if not on_gpu and kernel == "varlen":
            raise ConfigError(
                "model.attention_kernel=varlen runs on a GPU only (torch's varlen_attn is a "
                "CUDA flash kernel): use model.attention_kernel=sdpa on a CPU"
            )
        if not on_gpu:
            raise ConfigError(
                "model.attention_kernel=flex trains on a GPU only (torch's flex_attention has no "
                "CPU backward): use model.attention_kernel=sdpa on a CPU"
            )
    if m.mtp_num_layers is not None and m.mtp_num_layers < 1:
        raise ConfigError(
            f"model.mtp_num_layers ({m.mtp_num_layers}) must be at least 1, or null for no MTP"
        )
    if m.architecture == "hybrid":
        from mcore_ext import _mcore_compat

        try:
            _mcore_compat.check_hybrid_model("model.architecture")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if m.swiglu_limits is not None and any(m.swiglu_limits) and not m.swiglu:
        raise ConfigError("model.swiglu_limits clamps a SwiGLU MLP: it needs model.swiglu=true")
    _validate_lora(cfg)
    if o.type == "muon":
        _validate_muon(cfg)
    if m.vision is not None:
        _validate_vision(m.vision, p.tensor_model_parallel_size)

    # Last, let megatron's own config reject what it does not support (gate x TP, GQA, ...).
    from mcore_ext.run_config.megatron_configs import transformer_config

    try:
        transformer_config(cfg)
    except (ValueError, NotImplementedError, AssertionError) as err:
        raise ConfigError(f"model config rejected by megatron-core: {err}") from None


def lora_config(cfg: PretrainConfig):
    """The run's ``mcore_ext.lora.LoraConfig`` (targets resolved); ``ConfigError`` names a bad
    lora.* value."""
    from mcore_ext import lora

    section = cfg.lora
    try:
        return lora.LoraConfig(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                               targets=section.targets)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _validate_lora(cfg: PretrainConfig) -> None:
    """What LoRA cannot adapt: routed experts where there are none or at expert TP > 1, the te
    backend's layernorm-fused linears; and an expert-bias update, which would change a frozen
    base weight."""
    from mcore_ext.lora import EXPERT_TARGETS

    adapters = lora_config(cfg)
    if not adapters.enabled:
        if cfg.lora.init_from:
            raise ConfigError(f"lora.init_from={cfg.lora.init_from} needs lora.rank > 0 (the "
                              "adapter's r)")
        return
    if cfg.lora.init_from:  # a PEFT adapter: read and checked here, loaded when the run starts
        from mcore_ext.hf.adapter import AdapterError, read_adapter_config

        try:
            read_adapter_config(cfg.lora.init_from)
        except AdapterError as err:
            raise ConfigError(f"lora.init_from: {err}") from None
    m, p = cfg.model, cfg.parallelism
    if m.num_moe_experts and m.moe_router_bias_update_rate:
        raise ConfigError(f"lora.rank={adapters.rank} with model.moe_router_bias_update_rate="
                          f"{m.moe_router_bias_update_rate}: the router's expert bias is a frozen "
                          "base weight in a LoRA run (its adapters-only checkpoint would not "
                          "keep the updates); set model.moe_router_bias_update_rate=0")
    experts = [t for t in adapters.targets if t in EXPERT_TARGETS]
    if experts and not m.num_moe_experts:
        raise ConfigError(f"lora.targets: {' '.join(experts)} adapt routed experts, and "
                          "model.num_moe_experts is not set")
    etp = (p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None
           else p.tensor_model_parallel_size)
    if experts and etp > 1:
        raise ConfigError(f"lora.targets: {' '.join(experts)} with expert tensor parallelism "
                          f"{etp} (parallelism.expert_tensor_parallel_size, default the TP size): "
                          "routed experts' adapters need parallelism.expert_tensor_parallel_size=1")
    if m.attention_backend == "te":
        raise ConfigError("lora.rank > 0 with model.attention_backend=te: Transformer Engine "
                          "fuses the norm into linear_qkv / linear_fc1; use sdpa or local")


def _validate_vision(vision, tp: int) -> None:
    """The tower's layers split over TP as the text model's: heads and MLP width."""
    for key, value in (("num_attention_heads", vision.num_attention_heads),
                       ("ffn_hidden_size", vision.ffn_hidden_size)):
        if value % tp:
            raise ConfigError(f"model.vision.{key}={value} is not divisible by "
                              f"parallelism.tensor_model_parallel_size={tp} (the vision tower's "
                              "layers are split over TP)")


def _validate_muon(cfg: PretrainConfig) -> None:
    """optimizer.type=muon: megatron-core's Muon, and the combinations it (or the gate split)
    cannot do."""
    from mcore_ext import _mcore_compat

    m, o, tp = cfg.model, cfg.optimizer, cfg.parallelism.tensor_model_parallel_size
    if not _mcore_compat.has_muon():
        raise ConfigError(
            "optimizer.type=muon needs megatron-core 0.19+ with the emerging-optimizers package "
            f"(megatron-core {_mcore_compat.megatron_core_version()} is installed): use "
            "optimizer.type=adam")
    if cfg.training.precision == "fp16":
        raise ConfigError("optimizer.type=muon with training.precision=fp16: megatron's Muon does "
                          "not support fp16; use bf16 or fp32")
    if cfg.lora.rank:
        raise ConfigError(
            f"optimizer.type=muon with lora.rank={cfg.lora.rank}: Muon on LoRA adapters is not "
            "built (docs/known-gaps.md); use optimizer.type=adam for LoRA")
    groups = min(m.num_query_groups, m.sliding_num_query_groups or m.num_query_groups)
    if m.head_wise_attn_gate and o.muon_split_qkv and groups < tp:
        raise ConfigError(
            f"optimizer.type=muon on the gated linear_qkv needs num_query_groups ({groups}) >= "
            f"parallelism.tensor_model_parallel_size ({tp}): a rank's rows would cut through a "
            "query group; lower TP or set optimizer.muon_split_qkv=false")
    if o.muon_num_ns_steps < 1:
        raise ConfigError(f"optimizer.muon_num_ns_steps={o.muon_num_ns_steps} must be at least 1")
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1)")
    from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types

    supported = [name for name in get_supported_coefficient_types() if name != "custom"]
    if o.muon_coefficient_type not in supported:
        raise ConfigError(f"optimizer.muon_coefficient_type={o.muon_coefficient_type!r} is not "
                          f"one of {', '.join(supported)}")


def _validate_experts(m, p, world_size: int) -> None:
    """Expert parallelism: experts' ranks are ETP x EP x expert-DP x PP = world."""
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    pp = p.pipeline_model_parallel_size
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else tp
    if ep < 1 or etp < 1:
        raise ConfigError(
            f"parallelism.expert_model_parallel_size={ep} and expert_tensor_parallel_size={etp} "
            "must be at least 1"
        )
    if m.num_moe_experts is None:
        if ep > 1:
            raise ConfigError(
                f"parallelism.expert_model_parallel_size={ep} needs MoE layers "
                "(model.num_moe_experts)"
            )
        return
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"expert layout does not divide the world size: {world_size} ranks are not divisible "
            f"by expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
            f"pipeline_model_parallel_size ({pp}) = {etp * ep * pp}"
        )
    if tp > 1 and not p.sequence_parallel:  # megatron's MoELayer raises in its first forward
        raise ConfigError(
            f"model.num_moe_experts={m.num_moe_experts} with "
            f"parallelism.tensor_model_parallel_size={tp} needs "
            "parallelism.sequence_parallel=true (megatron's MoE layer does not train with TP "
            "without it)"
        )


def _validate_data(d: DataConfig, t: TrainingConfig) -> None:
    if d.valid_path is not None and d.source != "chat":
        raise ConfigError(f"data.valid_path is read with data.source=chat only, got "
                          f"data.source={d.source}")
    if d.source in ("files", "stdlib") and not d.prefix:
        raise ConfigError(f"data.source={d.source} needs data.prefix (path prefix of .bin/.idx)")
    if d.source == "files":
        missing = [p for p in (d.prefix + ".bin", d.prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise ConfigError(
                f"data path {d.prefix!r} does not exist (missing {', '.join(missing)}); build "
                "it with: python -m mcore_ext.data.preprocess --input FILES --output-prefix "
                f"{d.prefix}"
            )
    if d.source not in ("mock", "chat") and os.path.isfile(d.prefix + ".idx"):
        built_with = _sidecar_tokenizer(d.prefix)
        if built_with is not None and built_with != _tokenizer_id(d.tokenizer):
            raise ConfigError(
                f"data at {d.prefix!r} was tokenized with tokenizer {built_with!r}, but "
                f"data.tokenizer is {d.tokenizer!r}: set data.tokenizer to match"
            )
    if d.tokenizer != "byte" and not os.path.isdir(d.tokenizer):
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} is neither 'byte' nor an existing tokenizer directory"
        )
    if d.tokenizer != "byte":  # every rank loads it: say now what is missing, not in a traceback
        from mcore_ext.data.tokenizers import auto_tokenizer_class

        try:
            auto_tokenizer_class(d.tokenizer)
        except ImportError as err:
            raise ConfigError(f"data.tokenizer: {err}") from None
    try:
        weights = [float(w) for w in d.split.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.split={d.split!r} must be up to 3 comma-separated weights, e.g. 98,2,0"
        )
    if d.build_workers is not None and d.build_workers < 1:
        raise ConfigError(f"data.build_workers={d.build_workers} must be at least 1 (or null)")
    if d.source == "chat" and d.valid_path is not None:
        return  # the validation conversations are their own files: data.split is not used
    if t.eval_interval and t.eval_iters > 0 and (len(weights) < 2 or weights[1] == 0):
        raise ConfigError(
            f"evaluation is on (training.eval_interval={t.eval_interval}) but "
            f"data.split={d.split!r} has no validation part; give it one (e.g. 98,2,0) or set "
            "training.eval_interval=null"
        )


def _validation_weight(split: str) -> float:
    """data.split's validation weight (0 when it has none; a malformed split is refused by
    ``_validate_data``)."""
    weights = split.split(",")
    try:
        return float(weights[1]) if len(weights) > 1 else 0.0
    except ValueError:
        return 0.0


def chat_cache_dir(d: DataConfig) -> str:
    """Where chat data's tokenized conversations are cached: data.cache_dir, else
    runs/data/cache (never beside the user's file)."""
    return d.cache_dir or os.path.join("runs", "data", "cache")


def chat_blend(value, key: str):
    """megatron's blend (files, weights or None) of data.path / data.valid_path: a file, a list
    of files, or megatron's blend form [weight, file, weight, file, ...]."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ConfigError(f"{key}=[] names no file")
    weights = None
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
    if weights is None:
        return items, None
    files = items[1::2]
    for weight, path in zip(weights, files):
        if not weight > 0:
            raise ConfigError(f"{key}: the weight of {path!r} must be above 0, got {weight}")
    return files, weights


def _validate_chat(cfg: PretrainConfig) -> None:
    """Chat data: the layouts packed batches run at here, then every conversation of every file
    (data.path, data.valid_path) tokenized, before training (a bad line is one error naming
    file:line). The first rank of each node (LOCAL_RANK 0) reads each file's store or builds it
    (``load_chat_file``: one writer for every node of a shared filesystem, the others wait for it
    and read); the other ranks read the store if it is there and otherwise leave the file to
    their first rank: under torchrun they wait in the process group's rendezvous, which it joins
    only after it has checked and stored the files; where the process group already exists (the
    launcher in process) the ranks agree on the first's result before going on."""
    d, p, m = cfg.data, cfg.parallelism, cfg.model
    if not d.path:
        raise ConfigError("data.source=chat needs data.path (a JSONL file of conversations)")
    blends = [("data.path", chat_blend(d.path, "data.path")),
              ("data.valid_path", chat_blend(d.valid_path, "data.valid_path"))]
    files = []
    for key, blend in blends:
        for path in (blend[0] if blend else []):
            if not os.path.isfile(path):
                raise ConfigError(f"{key}={path!r} is not a file")
            files.append((key, path))
    if d.tokenizer == "byte":
        raise ConfigError(
            "data.source=chat needs data.tokenizer: a Hugging Face tokenizer directory with a "
            "chat template (the model's own; 'byte' has none)")
    cp = p.context_parallel_size
    if p.sequence_parallel and (m.seq_length * cfg.training.micro_batch_size // cp) % (
            p.tensor_model_parallel_size):  # a CP rank's tokens of a micro-batch, split over TP
        raise ConfigError(
            f"data.source=chat with sequence_parallel: micro_batch_size x seq_length / "
            f"context_parallel_size ({cfg.training.micro_batch_size} x {m.seq_length} / {cp}) "
            f"must divide by tensor_model_parallel_size={p.tensor_model_parallel_size}")
    from mcore_ext.data.chat import ChatDataError, load_chat_file
    from mcore_ext.data.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(d.tokenizer)
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} cannot be loaded: "
                          f"{' '.join(str(err).split())}") from None
    if not getattr(tokenizer.hf, "chat_template", None):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} has no chat template "
                          "(tokenizer_config.json chat_template or chat_template.jinja)")
    writer = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"
    failure = None
    try:
        for key, path in files:
            chat = load_chat_file(path, tokenizer.hf, m.seq_length, d.loss_on, d.overlong,
                                  cache_dir=chat_cache_dir(d), write_cache=writer,
                                  tokenize=writer, workers=d.build_workers)
            if chat is not None:
                if key == "data.path" and d.valid_path is None:
                    _refuse_empty_splits(cfg, len(chat), path)
                _check_images(cfg, chat, tokenizer.hf)
    except (ChatDataError, ConfigError) as err:
        failure = str(err)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        failures = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise ConfigError(failure)


def _check_images(cfg: PretrainConfig, chat, hf_tokenizer) -> None:
    """Images and the model agree: a file with images needs a vision tower (model.vision), whose
    placeholder is the processor's; with one, no conversation without images holds its
    placeholder (nothing would fill it)."""
    from mcore_ext.data import chat_images
    from mcore_ext.data.chat import ChatDataError

    d, vision = cfg.data, cfg.model.vision
    with_images = chat.with_images()
    where = chat.where(int(with_images[0])) if len(with_images) else None
    if where is not None and vision is None:
        raise ConfigError(
            f"{where}: the conversation has images, but the model has no vision tower "
            "(model.vision is not set): fine-tune a vision-language model (hf import --vision "
            "of a Step-3.7 folder writes model.vision), or give text-only conversations")
    if where is not None:
        processor = chat_images.processor_for(hf_tokenizer.name_or_path, where, ChatDataError)
        if processor.image_token_id != vision.image_token_id:
            raise ConfigError(
                f"model.vision.image_token_id={vision.image_token_id}, but the processor of "
                f"data.tokenizer={d.tokenizer!r} writes its image placeholder "
                f"{processor.image_token!r} as token {processor.image_token_id}: the model and "
                "the tokenizer are not the same model's")
    if vision is not None:
        chat_images.stray_placeholders(chat, vision.image_token_id, ChatDataError)


def _refuse_empty_splits(cfg: PretrainConfig, count: int, path: str) -> None:
    """A split the run reads (training; validation when evaluation or the attention probe is
    on) that megatron's
    builder would leave without a conversation: it gives split i the conversations
    [round(begin_i x count), round(end_i x count)) of the file."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    d, t = cfg.data, cfg.training
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(d.split))
    read = [("training", matrix[0])]
    if (t.eval_interval and t.eval_iters > 0) or cfg.logging.attention_probe:
        read.append(("validation", matrix[1]))
    for name, bookends in read:
        begin, end = ((int(round(x * count)) for x in bookends) if bookends else (0, 0))
        if begin >= end:
            raise ConfigError(
                f"data.split={d.split!r} leaves the {name} split of data.path={path!r} no "
                f"conversation ({count} conversations); give it a larger share or more data")


def _refuse_variable_lengths_under_pp(p) -> None:
    """Text with document masking under CP pads each document to 2 x CP slots, so its THD
    micro-batches vary in length; megatron's pipeline schedule sends tensors of one shape
    (``variable_seq_lengths`` is not wired: docs/known-gaps.md)."""
    pp, cp = p.pipeline_model_parallel_size, p.context_parallel_size
    if pp > 1 and cp > 1:
        raise ConfigError(
            f"data.document_masking=true at parallelism.context_parallel_size={cp} gives "
            f"micro-batches of varying length, which the pipeline schedule cannot send: "
            f"parallelism.pipeline_model_parallel_size must be 1 there, got {pp}")


def _tokenizer_id(name: str) -> str:
    return name if name == "byte" else os.path.abspath(name)


def _sidecar_tokenizer(prefix: str) -> str | None:
    """The tokenizer recorded by mcore_ext.data.preprocess in <prefix>.json (None if absent)."""
    try:
        with open(prefix + ".json") as f:
            return json.load(f).get("tokenizer")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def _cuda_available() -> bool:
    return torch.cuda.is_available()
