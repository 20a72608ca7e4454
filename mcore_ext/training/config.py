"""The launcher's configuration: schema, YAML + command-line merge, validation.

A run is configured by one YAML file with the sections below, plus ``section.key=value``
overrides on the command line (values parsed as YAML). Precedence: dataclass defaults < YAML <
overrides. ``load_config`` merges once and validates once; every problem it finds is a
``ConfigError`` with a message meant for the user, raised before anything is built or written.
"""

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration the launcher refuses to run: the message says what to change."""


# ----------------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Transformer layers (split evenly over pipeline stages)."""

    hidden_size: int = 128
    """Model width h."""

    ffn_hidden_size: Optional[int] = None
    """MLP width; null -> 4 * hidden_size (8/3 * hidden_size rounded up to 64 with swiglu)."""

    num_attention_heads: int = 4
    """Query heads."""

    num_query_groups: Optional[int] = None
    """Key/value heads (GQA); null -> num_attention_heads (plain multi-head attention)."""

    kv_channels: Optional[int] = None
    """Head dim; null -> hidden_size / num_attention_heads."""

    seq_length: int = 128
    """Tokens per training sample."""

    head_wise_attn_gate: bool = False
    """Gate each attention head's output with a learned sigmoid scalar (Step-3.5 g_proj)."""

    head_wise_attn_gate_init_weight_scale: float = 0.1
    """Gate weight rows are scaled by this after init."""

    head_wise_attn_gate_init_bias: float = 2.0
    """Initial gate bias, sigmoid(2) ~ 0.88; needs add_qkv_bias (resolved to 0 without it)."""

    add_qkv_bias: bool = False
    """Bias on linear_qkv (and so on the gate rows)."""

    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer type."""

    swiglu: bool = True
    """SwiGLU MLP (gated SiLU); false -> GeLU MLP."""

    rotary_base: int = 10000
    """RoPE base."""

    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output projection."""

    init_method_std: float = 0.02
    """Std of the normal weight init."""

    hidden_dropout: float = 0.0
    """Dropout after attention / MLP."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    attention_backend: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Attention implementation; auto: Transformer Engine on a GPU if installed, else SDPA."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocab to a multiple of this; independent of TP so checkpoints reshard across TP."""

    recompute_granularity: Optional[Literal["selective", "full"]] = None
    """Activation recompute: selective (core attention) or full (whole layers); null = off."""

    recompute_method: Literal["uniform", "block"] = "uniform"
    """With full recompute: how layers are grouped."""

    recompute_num_layers: int = 1
    """With full recompute: layers per group (uniform) or recomputed layers per stage (block)."""


@dataclass
class ParallelismConfig:
    tensor_model_parallel_size: int = 1
    """TP size: layers split across this many ranks."""

    pipeline_model_parallel_size: int = 1
    """PP size: layers staged across this many ranks."""

    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over TP ranks (needs TP > 1)."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel rank."""

    global_batch_size: int = 8
    """Samples per optimizer step = micro_batch_size x data-parallel size x micro-batches."""

    train_iters: int = 100
    """Optimizer steps of the whole run (also sizes the LR schedule and the dataset)."""

    exit_interval: Optional[int] = None
    """Stop (saving a checkpoint) at multiples of this; schedule and data still span train_iters."""

    eval_interval: Optional[int] = 50
    """Evaluate on the validation split every this many steps (and at the end); null = never."""

    eval_iters: int = 2
    """Global batches per evaluation (the same batches every time)."""

    seed: int = 1234
    """Seed for init, data order and dropout."""

    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute dtype; auto -> bf16 on GPU, fp32 on CPU."""


@dataclass
class OptimizerConfig:
    lr: float = 1.0e-3
    """Peak learning rate."""

    min_lr: float = 1.0e-4
    """Learning rate at the end of the decay."""

    lr_warmup_iters: int = 10
    """Linear warmup steps from 0 to lr."""

    lr_decay_iters: Optional[int] = None
    """Steps from start to min_lr; null -> training.train_iters."""

    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""

    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay; not applied to biases and norms."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.95
    """Adam beta2."""

    adam_eps: float = 1.0e-8
    """Adam epsilon."""

    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    loss_scale: Optional[float] = None
    """fp16 only: static loss scale; null -> dynamic."""


@dataclass
class DataConfig:
    source: Literal["files", "stdlib", "mock"] = "files"
    """files: the .bin/.idx dataset at prefix; stdlib: same, built from the Python standard
    library's source on first use; mock: megatron's MockGPTDataset (no files)."""

    prefix: Optional[str] = None
    """Path prefix of <prefix>.bin / <prefix>.idx (from python -m mcore_ext.data.preprocess)."""

    tokenizer: str = "byte"
    """'byte' (256 bytes + EOD) or a local Hugging Face tokenizer directory."""

    split: str = "98,2,0"
    """train,valid,test weights of the document split."""

    cache_dir: Optional[str] = None
    """Where megatron caches sample indices; null -> cache/ beside the .bin/.idx files."""

    num_workers: int = 0
    """DataLoader worker processes per rank."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Checkpoint directory (iter_NNNNNNN/, latest_checkpointed_iteration.txt); null = no saving."""

    load: Optional[str] = None
    """Resume from the latest complete checkpoint here; missing or empty -> start fresh."""

    save_interval: Optional[int] = None
    """Save every this many steps (and always at the end); null = at the end only."""

    finetune: bool = False
    """Load model weights only and start at iteration 0 with a fresh optimizer and schedule."""

    init_missing_gates: bool = False
    """Load a checkpoint saved without head_wise_attn_gate into a gated model: QKV rows load, the
    gates start from their init (combine with finetune; otherwise loading such a checkpoint fails
    with an error naming the missing gate tensors)."""

    async_save: bool = False
    """GPU only: write checkpoints in the background."""


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print (and record) training metrics every this many steps."""

    metrics_file: Optional[str] = None
    """JSON-lines file of metrics, appended by rank 0; null = none."""

    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory (skipped when tensorboard is not installed); null = none."""

    peak_tflops: Optional[float] = None
    """Per-device dense peak TFLOP/s for MFU; null -> known GPUs' bf16/fp16 peak."""


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # Derived at validation; not part of the YAML.
    world_size: int = field(default=1, metadata={"derived": True})
    data_parallel_size: int = field(default=1, metadata={"derived": True})
    num_microbatches: int = field(default=1, metadata={"derived": True})

    def to_dict(self) -> dict:
        """The YAML-able sections (derived fields left out): what config.yaml holds."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in _sections()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _sections():
    return [f for f in dataclasses.fields(PretrainConfig) if not f.metadata.get("derived")]


# ------------------------------------------------------------------------------------ merge


def load_config(path: str | None, overrides=(), world_size: int | None = None) -> PretrainConfig:
    """Defaults < YAML file < ``section.key=value`` overrides, validated for ``world_size`` ranks.

    ``world_size`` defaults to $WORLD_SIZE (set by torchrun), else 1.
    """
    raw = _read_yaml(path) if path else {}
    for item in overrides:
        section, key, value = _parse_override(item)
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"section {section!r} in the YAML is not a mapping")
        raw[section][key] = value
    cfg = _build(raw)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _validate(cfg, world_size)
    return cfg


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of sections, got {type(raw).__name__}"
        )
    return raw


def _parse_override(item: str) -> tuple[str, str, object]:
    key, sep, text = item.partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name or "." in name:
        raise ConfigError(
            f"override {item!r} is not of the form section.key=value (e.g. training.train_iters=20)"
        )
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # e.g. a path with a colon: keep the text as it is
    return section.strip(), name.strip(), value


def _build(raw: dict) -> PretrainConfig:
    all_keys = [
        f"{s.name}.{f.name}" for s in _sections() for f in dataclasses.fields(s.default_factory)
    ]
    sections = {}
    for section_field in _sections():
        cls = section_field.default_factory
        given = raw.get(section_field.name) or {}
        if not isinstance(given, dict):
            raise ConfigError(
                f"section {section_field.name!r} must be a mapping of keys, got {given!r}"
            )
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in given.items():
            if key not in hints:
                raise ConfigError(_unknown(f"{section_field.name}.{key}", all_keys))
            values[key] = _check_type(f"{section_field.name}.{key}", value, hints[key])
        sections[section_field.name] = cls(**values)
    for name in raw:
        if name not in sections:
            raise ConfigError(_unknown(str(name), [s.name for s in _sections()], kind="section"))
    return PretrainConfig(**sections)


def _unknown(key: str, valid: list[str], kind: str = "key") -> str:
    """Unknown ``key``: suggest the same name in another section, else the closest valid key."""
    message = f"unknown config {kind} {key!r}"
    close = []
    if kind == "key":
        section, name = key.split(".", 1)
        close = [k for k in valid if k.split(".", 1)[1] == name]  # right key, wrong section
        if not close:
            in_section = [k.split(".", 1)[1] for k in valid if k.startswith(section + ".")]
            close = [f"{section}.{n}" for n in difflib.get_close_matches(name, in_section, n=1)]
    if not close:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"{message}; did you mean {close[0]!r}?"
    return f"{message}; valid {kind}s: {', '.join(valid)}" if kind == "section" else message


def _check_type(key: str, value, hint):
    """``value`` if it fits ``hint`` (int, float, bool, str, Optional, Literal), else an error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _check_type(key, value, hint)
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint_text = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{key}={value!r} is not one of {', '.join(repr(a) for a in args)}{hint_text}"
        )
    if hint is float:
        # YAML reads 1e-3 (no dot) as a string: accept any number spelled as one.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # YAML reads data.split=100 or a numeric path as a number
    elif isinstance(value, hint):
        return value
    raise ConfigError(
        f"{key}={value!r} has type {type(value).__name__}, expected {_type_name(hint)}"
    )


def _type_name(hint) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


# ------------------------------------------------------------------------------- validation


def _validate(cfg: PretrainConfig, world_size: int) -> None:
    m, p, t, o = cfg.model, cfg.parallelism, cfg.training, cfg.optimizer
    d, c = cfg.data, cfg.checkpoint
    on_gpu = _cuda_available()

    for key, value in [
        ("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads), ("model.seq_length", m.seq_length),
        ("parallelism.tensor_model_parallel_size", p.tensor_model_parallel_size),
        ("parallelism.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
        ("training.micro_batch_size", t.micro_batch_size),
        ("training.global_batch_size", t.global_batch_size),
        ("training.train_iters", t.train_iters), ("logging.log_interval", cfg.logging.log_interval),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
    ]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    for key in ("training.exit_interval", "training.eval_interval", "checkpoint.save_interval"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1 (or null)")

    # Layout: world = TP x PP x DP, global batch = micro batch x DP x micro-batches.
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"parallel layout does not divide the world size: {world_size} ranks are not "
            f"divisible by tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size "
            f"({pp}) = {tp * pp}"
        )
    dp = world_size // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp}) = "
            f"{t.micro_batch_size * dp}"
        )
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
    if m.head_wise_attn_gate_init_bias and m.head_wise_attn_gate and not m.add_qkv_bias:
        m.head_wise_attn_gate_init_bias = 0.0  # nothing to initialize without a QKV bias
    if m.recompute_granularity == "full" and m.recompute_num_layers > m.num_layers // pp:
        raise ConfigError(
            f"model.recompute_num_layers ({m.recompute_num_layers}) exceeds the layers per "
            f"pipeline stage ({m.num_layers // pp})"
        )

    if t.precision == "auto":
        t.precision = "bf16" if on_gpu else "fp32"
    elif t.precision in ("bf16", "fp16") and not on_gpu:
        raise ConfigError(
            f"training.precision={t.precision} needs a GPU; use fp32 (or auto) on CPU"
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
    if c.async_save and not on_gpu:
        raise ConfigError("checkpoint.async_save=true needs a GPU (CUDA); set it to false on CPU")
    if c.finetune and not c.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load (the weights to use)")

    # Last, let megatron's own config reject what it does not support (gate x TP, GQA, ...).
    from mcore_ext.training.megatron_configs import transformer_config

    try:
        transformer_config(cfg)
    except (ValueError, NotImplementedError, AssertionError) as err:
        raise ConfigError(f"model config rejected by megatron-core: {err}") from None


def _validate_data(d: DataConfig, t: TrainingConfig) -> None:
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
    if d.source != "mock" and os.path.isfile(d.prefix + ".idx"):
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
    try:
        weights = [float(w) for w in d.split.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.split={d.split!r} must be up to 3 comma-separated weights, e.g. 98,2,0"
        )
    if t.eval_interval and t.eval_iters > 0 and (len(weights) < 2 or weights[1] == 0):
        raise ConfigError(
            f"evaluation is on (training.eval_interval={t.eval_interval}) but "
            f"data.split={d.split!r} has no validation part; give it one (e.g. 98,2,0) or set "
            "training.eval_interval=null"
        )


def _tokenizer_id(name: str) -> str:
    return name if name == "byte" else os.path.abspath(name)


def _sidecar_tokenizer(prefix: str) -> str | None:
    """The tokenizer recorded by mcore_ext.data.preprocess in <prefix>.json (None if absent)."""
    import json

    try:
        with open(prefix + ".json") as f:
            return json.load(f).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
