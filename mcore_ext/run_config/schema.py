"""The launcher's config schema: one dataclass per YAML section, every key documented.

A run's YAML file has the sections of ``PretrainConfig`` (``model``, ``parallelism``,
``training``, ``optimizer``, ``data``, ``checkpoint``, ``logging``, ``lora``); each key is a field below,
with its default and a docstring. How a file and command-line overrides become these objects is
``overrides.py``; what a runnable combination is, the launcher's ``training/config/validation.py``.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import yaml

from mcore_ext.vision.config import VisionConfig


class ConfigError(ValueError):
    """A configuration the launcher refuses to run: the message says what to change."""


def recommended_architecture() -> str:
    """The model class the installed megatron-core recommends: ``hybrid`` from 0.19, which
    deprecates GPTModel for the HybridModel mcore_ext builds on (``has_hybrid_model``), else
    ``gpt`` (0.18 ships an earlier HybridModel and recommends GPTModel)."""
    from mcore_ext import _mcore_compat

    return "hybrid" if _mcore_compat.has_hybrid_model() else "gpt"


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

    head_wise_attn_gate_init_weight_scale: float = 1.0
    """Gate weight rows (drawn like the QKV rows) are scaled by this: 1.0 starts the gate as every
    released implementation does (docs/gate-training.md: why, measured)."""

    head_wise_attn_gate_init_bias: float = 0.0
    """Initial gate bias (0: sigmoid ~ 0.5). Needs add_qkv_bias: without it a value other than 0
    has no effect and the model build warns, as GatedTransformerConfig defines
    (effective_head_wise_attn_gate_init_bias)."""

    add_qkv_bias: bool = False
    """Bias on linear_qkv (and so on the gate rows)."""

    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer type."""

    swiglu: bool = True
    """SwiGLU MLP (gated SiLU); false -> GeLU MLP."""

    rotary_base: float = 10000
    """RoPE base (of the full-attention layers when layer_types is set)."""

    rotary_percent: float = 1.0
    """Fraction of each head's dims that RoPE rotates (HF's partial_rotary_factor)."""

    layer_types: Optional[list[str]] = None
    """Step-3.5 layer kinds, one per layer: full_attention / sliding_attention; null = all full.
    Sliding layers use sliding_window and the sliding_* values below."""

    sliding_window: Optional[int] = None
    """Keys a query of a sliding layer sees (HF's sliding_window: i - W < j <= i)."""

    sliding_num_attention_heads: Optional[int] = None
    """Query heads of sliding layers; null = num_attention_heads."""

    sliding_num_query_groups: Optional[int] = None
    """Key/value groups of sliding layers; null = num_query_groups."""

    sliding_rotary_base: Optional[float] = None
    """RoPE base of sliding layers; null = rotary_base."""

    sliding_rotary_percent: Optional[float] = None
    """Rotary fraction of sliding layers; null = rotary_percent."""

    swiglu_limits: Optional[list[Optional[float]]] = None
    """Per layer, HF's SwiGLU clamp L (silu(gate).clamp(max=L) * up.clamp(-L, L)); null or 0 =
    none. Needs swiglu: true."""

    # MoE (megatron's MoELayer; field names are megatron's TransformerConfig's)
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer; null = a dense model."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_ffn_hidden_size: Optional[int] = None
    """Routed experts' MLP width; null = ffn_hidden_size."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the always-on shared expert (output added unscaled); null = none."""

    moe_layer_freq: Union[int, list[int]] = 1
    """Which layers are MoE: a list of 0 (dense) / 1 (MoE), one per layer, or N = every N-th
    layer starting with the first (HF's moe_layers_enum / mlp_layer_types)."""

    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """Router scores: softmax or sigmoid (Step-3.5, DeepSeek-V3)."""

    moe_router_enable_expert_bias: bool = False
    """An fp32 per-expert bias added to the scores only to choose experts (needs sigmoid)."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """The routed output's scale (Step-3.5: 3.0); null = 1."""

    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Router logits / scores dtype; null = the activations' dtype."""

    moe_router_load_balancing_type: str = "none"
    """none (keeps a converted model's routing), aux_loss, seq_aux_loss, global_aux_loss."""

    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (with an aux-loss type); logged as load_balancing_loss."""

    moe_router_bias_update_rate: float = 0.0
    """Aux-loss-free balancing: the expert bias moves by this per step towards balance; 0 keeps
    it as loaded."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach their experts' ranks (flex: DeepEP, GPU only)."""

    moe_grouped_gemm: bool = False
    """Run each MoE layer's experts as one grouped GEMM per linear layer: Transformer Engine's
    TEGroupedMLP on the te backend, torch's grouped GEMM over the same experts on sdpa / local
    (mcore_ext.grouped_experts); HF's clamps stay exact on both."""

    moe_expert_swiglu_limits: Optional[list[Optional[float]]] = None
    """Per layer, the routed experts' SwiGLU clamp (HF's swiglu_limits); swiglu_limits clamps
    dense MLPs and shared experts (HF's swiglu_limits_shared). null or 0 = none."""

    layernorm_zero_centered_gamma: bool = False
    """Norms scale by 1 + weight, weights start at 0 (Gemma / Step-3.5 RMSNorm), q/k norms too."""

    qk_layernorm: bool = False
    """Per-head norm of queries and keys before RoPE (normalization's kind)."""

    layernorm_epsilon: float = 1.0e-5
    """Epsilon of every norm (HF's rms_norm_eps)."""

    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output projection."""

    init_method_std: float = 0.02
    """Std of the normal weight init."""

    hidden_dropout: float = 0.0
    """Dropout after attention / MLP."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    architecture: Literal["gpt", "hybrid"] = field(default_factory=recommended_architecture)
    """megatron-core model class: gpt (GPTModel, deprecated from megatron-core 0.19) or hybrid
    (HybridModel, 0.19+: each GPT layer an attention layer and an MLP / MoE layer, pattern *- /
    *E, MTP depths /*-). Left out: the model of the checkpoint the run loads (a run continues as
    it was saved), else the one the installed megatron-core recommends (hybrid on 0.19+, gpt on
    0.16 - 0.18). The same weights compute the same; a GPT checkpoint loads into a hybrid run,
    not the reverse."""

    attention_backend: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Attention implementation; auto: Transformer Engine on a GPU if installed, else SDPA."""

    attention_kernel: Literal["sdpa", "flex", "varlen"] = "sdpa"
    """Inner kernel of the sdpa backend: torch SDPA (a mask made once per batch for windows),
    flex_attention (block mask: windows stay fast on long sequences; GPU for training, a CPU
    runs it forward only) or varlen (torch's flash varlen kernel for packed batches; GPU only)."""

    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths (HF num_nextn_predict_layers), on the last pipeline stage;
    null = none. Depth k predicts token t + k + 2 with its own layer (global layer
    num_layers + k + 1 of layer_types / swiglu_limits, which may list them)."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss (the mean over depths) next to the main loss."""

    mtp_step35_heads: bool = True
    """Step-3.5's MTP (own output head and norm per depth, pre-final-norm input, pre-norm
    chaining); false = megatron's own MTP (the main output layer for every depth)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocab to a multiple of this; independent of TP so checkpoints reshard across TP."""

    recompute_granularity: Optional[Literal["selective", "full"]] = None
    """Activation recompute: selective (core attention) or full (whole layers); null = off."""

    recompute_method: Literal["uniform", "block"] = "uniform"
    """With full recompute: how layers are grouped."""

    recompute_num_layers: int = 1
    """With full recompute: layers per group (uniform) or recomputed layers per stage (block)."""

    vision: Optional[VisionConfig] = None
    """Step-3.7-Flash's vision tower and projector in front of the text model (a mapping of
    mcore_ext.vision.VisionConfig's keys: its shape, projector_bias, image_token_id, and freeze,
    default true: the tower frozen, the projector trained); null = a text model. ``hf import
    --vision`` of a Step-3.7 folder writes it; the micro-batches then carry images
    (docs/design.md#step-37-flash-with-images)."""


@dataclass
class ParallelismConfig:
    tensor_model_parallel_size: int = 1
    """TP size: layers split across this many ranks."""

    pipeline_model_parallel_size: int = 1
    """PP size: layers staged across this many ranks."""

    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over TP ranks (needs TP > 1)."""

    context_parallel_size: int = 1
    """CP size: each sequence split over this many ranks (megatron's load-balanced 2 x CP
    chunks; model.seq_length must be divisible by 2 x CP; sdpa backend or te)."""

    expert_model_parallel_size: int = 1
    """EP size: each MoE layer's experts split over this many ranks (must divide
    model.num_moe_experts; ETP x EP x PP must divide the world size)."""

    expert_tensor_parallel_size: Optional[int] = None
    """Each expert's TP size; null = tensor_model_parallel_size."""


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

    exit_duration_mins: Optional[float] = None
    """Save and stop at the first step boundary this many minutes after the launcher started
    (rank 0's clock; Megatron-LM's --exit-duration-in-mins), exit code 16: set it below a job's
    time limit by more than a step and a save. Needs checkpoint.save."""

    eval_interval: Optional[int] = 50
    """Evaluate on the validation split every this many steps (and at the end); null = never."""

    eval_iters: int = 2
    """Global batches per evaluation (the same batches every time)."""

    seed: int = 1234
    """Seed for init, data order and dropout."""

    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute dtype; auto -> bf16 on GPU, fp32 on CPU. bf16 / fp16 run on a CPU too (megatron's
    Float16Module and mixed-precision optimizer with fp32 main weights), slowly: for tests."""


@dataclass
class OptimizerConfig:
    type: Literal["adam", "muon"] = "adam"
    """adam: megatron's Adam (AdamW) for every parameter. muon: megatron-core's Muon (0.19+, the
    emerging-optimizers package) for the 2-D weights of linear layers, Adam for the rest
    (embeddings, output layer, norms, biases, MoE router); on the gated linear_qkv the q, k, v
    and gate rows are orthogonalised each as its own matrix (docs/training.md#optimizer)."""

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

    muon_momentum: float = 0.95
    """Muon: momentum of its internal SGD (megatron's muon_momentum)."""

    muon_nesterov: bool = False
    """Muon: Nesterov momentum."""

    muon_split_qkv: bool = True
    """Muon: orthogonalise linear_qkv's q, k, v (and gate) rows each as its own matrix; false:
    the fused weight as one matrix."""

    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """Muon: scale of the orthogonalised update (spectral: sqrt(max(rows, columns)))."""

    muon_extra_scale_factor: float = 1.0
    """Muon: extra factor on the update (e.g. 0.2 to match AdamW's update RMS)."""

    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""

    muon_coefficient_type: str = "quintic"
    """Muon: Newton-Schulz coefficients, as emerging-optimizers names them (quintic, simple,
    polar_express, cans, aol, deepseekv4)."""

    muon_fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    """Muon: matmul precision of Newton-Schulz on fp32 (medium: in bf16, as megatron's default;
    highest: fp32)."""

    muon_tp_mode: Literal["blockwise", "duplicated", "distributed"] = "blockwise"
    """Muon under TP: blockwise orthogonalises each rank's rows of a projection on their own;
    duplicated gathers the projection over TP and orthogonalises it whole (TP-independent);
    distributed runs Newton-Schulz sharded over TP."""

    loss_scale: Optional[float] = None
    """fp16 only: static loss scale; null -> dynamic (megatron's: starts at 2^32 and halves on
    each overflow, so about the first 16 steps are skipped)."""


@dataclass
class DataConfig:
    source: Literal["files", "stdlib", "mock", "chat"] = "files"
    """files: the .bin/.idx dataset at prefix; stdlib: same, built from the Python standard
    library's source on first use; mock: megatron's MockGPTDataset (no files); chat: the
    conversations of the JSONL file at path (fine-tuning: the tokenizer's chat template, loss
    on the answers, packed documents)."""

    prefix: Optional[str] = None
    """Path prefix of <prefix>.bin / <prefix>.idx (from python -m mcore_ext.data.preprocess)."""

    path: Optional[Union[str, list[str]]] = None
    """source=chat: the JSONL file, one conversation a line: {"messages": [{"role", "content"},
    ...]} (system / user / assistant / tool) or {"prompt", "completion"}; or several, blended as
    megatron blends text (its blend form): [weight, file, weight, file, ...] samples each file in
    proportion to its weight, a list of files alone in proportion to their conversations."""

    valid_path: Optional[Union[str, list[str]]] = None
    """source=chat: validation conversations of their own (a file, or a blend as path); then
    every conversation of path trains and data.split is not used."""

    loss_on: Literal["assistant", "last_turn", "all"] = "assistant"
    """source=chat: the tokens that carry loss: every assistant answer (with the template's
    end-of-turn tokens), the last answer only, or every token."""

    overlong: Literal["truncate", "drop"] = "truncate"
    """source=chat: a conversation longer than model.seq_length is cut to it, or left out;
    either is counted and reported once."""

    pack: bool = True
    """source=chat: several conversations per seq_length row, each attending only to itself with
    positions restarting (a packed THD batch); false: one conversation per row."""

    tokenizer: str = "byte"
    """'byte' (256 bytes + EOD) or a local Hugging Face tokenizer directory (source=chat: one
    with a chat template)."""

    split: str = "98,2,0"
    """train,valid,test weights of the document split."""

    document_masking: bool = False
    """source files / stdlib: each document of a sample (ended by the tokenizer's end-of-document
    token) attends only to itself and its positions restart (megatron's reset_position_ids; a
    packed THD batch, as chat data); the loss is normalised over the global batch's tokens."""

    cache_dir: Optional[str] = None
    """Where megatron caches sample indices; null -> cache/ beside the .bin/.idx files.
    source=chat: where the tokenized conversations are cached; null -> runs/data/cache."""

    num_workers: int = 0
    """DataLoader worker processes per rank."""

    build_workers: Optional[int] = None
    """source=chat: processes that tokenize a file the first time it is used (its store is then
    built once for every node of the filesystem and memory-mapped); null: 1 for a file up to
    16 MiB, else as many as the CPUs this process may use, up to 8."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Checkpoint directory (iter_NNNNNNN/, latest_checkpointed_iteration.txt); null = no saving."""

    load: Optional[str] = None
    """Start from this checkpoint when checkpoint.save holds none (a checkpoint in save always
    wins: the run resumes it): a save directory (its tracked iteration; Megatron-LM's
    ``release`` too) or one iteration directory (iter_NNNNNNN). A path that holds no checkpoint
    is an error, unless it is checkpoint.save itself (the run's first start); null = none."""

    save_interval: Optional[int] = None
    """Save every this many steps (and always at the end); null = at the end only."""

    finetune: bool = False
    """Initialise an empty run from checkpoint.load's model weights only, at iteration 0 with a
    fresh optimizer and schedule (ignored once checkpoint.save holds the run's checkpoints)."""

    init_missing_gates: bool = False
    """Load a checkpoint saved without head_wise_attn_gate into a gated model: QKV rows load, the
    gates start from their init (combine with finetune; otherwise loading such a checkpoint fails
    with an error naming the missing gate tensors)."""

    on_corrupt: Literal["error", "previous"] = "error"
    """When the checkpoint to load differs from what its save recorded (a truncated or damaged
    file): ``error`` stops, naming the file and the newest checkpoint that verifies;
    ``previous`` resumes from that one instead, and says so."""

    key_file: Optional[str] = None
    """A file holding a secret key (its text, trailing newline dropped): saves sign their
    manifest with it and loads refuse a checkpoint not signed with it (docs/checkpoints.md);
    null = ``MCORE_EXT_CHECKPOINT_KEY`` when set, else no signing."""

    async_save: bool = False
    """GPU only: write checkpoints in the background."""

    exit_on_signal: bool = False
    """On SIGTERM / SIGINT to any rank, all ranks finish the current step, save a checkpoint
    (with checkpoint.save) and exit 16, "saved, not finished" (preemption; a signal during the
    last step: 0); otherwise such a signal ends the run at once."""


@dataclass
class LoraConfig:
    """Low-rank adapters (Hugging Face PEFT's LoRA) on a frozen model: docs/training.md#lora."""

    rank: int = 0
    """r, the adapters' inner dimension (PEFT's r); 0 = no LoRA (full fine-tuning)."""

    alpha: float = 16.0
    """PEFT's lora_alpha: the update (alpha / rank) B A is added to each targeted weight."""

    dropout: float = 0.0
    """PEFT's lora_dropout: dropout on the adapters' input, in [0, 1)."""

    targets: Union[str, list[str]] = "all-linear"
    """The adapted linears, PEFT's module names of transformers' Step-3.5 model: q_proj, k_proj,
    v_proj, g_proj (the head-wise gate), o_proj, gate_proj, up_proj, down_proj (dense MLPs and
    shared experts), as a list or one space-separated string; all-linear = every one of them
    (as PEFT's all-linear). The routed experts, each its own A and B, with experts.gate_up_proj /
    experts.down_proj (PEFT's target_parameters names), alone or beside all-linear."""

    init_from: Optional[str] = None
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, made by
    peft or ``hf export --adapter``) whose A and B the adapters start from instead of B = 0, when
    the run starts (not when it resumes its own checkpoint). Its r, lora_alpha and
    target_modules must be rank, alpha and targets."""


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

    gate_statistics: bool = False
    """Record the head-wise gate's values in training: per log window, the mean gate (sigmoid)
    over every token, head and layer, the fraction of closed gates (below 0.1), and the mean per
    layer (metrics file and TensorBoard; the log line shows the first two). Needs
    model.head_wise_attn_gate."""

    attention_probe: Optional[int] = None
    """Every this many steps and at the start (the weights a run starts from), measure attention sinks and massive
    activations on a fixed probe batch (the validation split's first micro-batch): per layer the
    mean attention share of the first token (and of each packed document's first token), the
    sink rate (share of heads above 0.3), the mean gate per head, the largest |activation| of the
    residual stream and of the attention output (metrics file as kind "probe", TensorBoard; the
    log line shows one short field); null = never. Gate on or off, every backend and layout
    (docs/training.md#attention-probe)."""


@dataclass
class PretrainConfig:
    """A whole run: the YAML sections, plus sizes derived from them and the world size."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    # Derived at validation; not part of the YAML.
    world_size: int = field(default=1, metadata={"derived": True})
    data_parallel_size: int = field(default=1, metadata={"derived": True})
    num_microbatches: int = field(default=1, metadata={"derived": True})

    def to_dict(self) -> dict:
        """The YAML-able sections (derived fields left out): what config.yaml holds."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in section_fields(self)}

    def to_yaml(self) -> str:
        """``to_dict`` as YAML, sections and keys in schema order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def section_fields(root=PretrainConfig) -> list[dataclasses.Field]:
    """The fields of ``root`` that are YAML sections (each a dataclass); derived ones left out."""
    return [f for f in dataclasses.fields(root) if not f.metadata.get("derived")]


