"""Low-rank adapters (LoRA) on megatron's tensor-parallel linears, gate rows included.

    y = W x + (alpha / r) B_t A_t dropout(x)        per target t (Hugging Face PEFT's formula)

Targets are named as PEFT names the modules of transformers' Step-3.5 model: ``q_proj``,
``k_proj``, ``v_proj``, ``g_proj`` (the head-wise gate) on the fused ``linear_qkv``; ``o_proj`` on
``linear_proj``; ``gate_proj`` / ``up_proj`` (the two halves of ``linear_fc1``) and ``down_proj``
(``linear_fc2``) on the dense MLPs and the MoE layers' shared experts; ``all-linear`` is all of
these, as PEFT's ``all-linear`` on transformers' model (whose routed experts are 3-D parameters,
not linears). Routed experts are adapted when ``experts.gate_up_proj`` / ``experts.down_proj``
(PEFT's ``target_parameters`` names of transformers' fused expert weights) are named: each
expert gets its own A and B on its ``linear_fc1`` (the whole ``[gate ; up]`` output, one
adapter as transformers' ``gate_up_proj``) and ``linear_fc2``, local experts under EP. The MTP
layers' attention and MLP are adapted as the decoder's. Each target has its own A [r, in] and B
[out_t, r].

Tensor parallelism follows the base linear:
- column-parallel (linear_qkv, linear_fc1): A replicated, B holds the rows of the target that this
  rank's slice of the fused output holds, added at those columns. On the gated ``linear_qkv`` a
  rank's output is ``[QKV_r ; Gate_r]`` (megatron's per-group interleaved q.. k v, then the gate
  rows of its query heads), so q, k, v and g_proj each land at their own columns. With at least as
  many query groups as ranks every target's rows on a rank are an even contiguous block of the
  HF ``*_proj`` rows, and B is sharded so; with fewer groups than ranks a rank's QKV rows cut
  through a group, so B of q / k / v is kept whole on every rank and each rank uses its rows.
- row-parallel (linear_proj, linear_fc2): A column-sharded with the base's input, the partial
  ``A x`` summed over the TP group; B replicated.
- sequence parallelism: the low-rank activation ``A x`` (r wide) is gathered / reduce-scattered
  with megatron's mappings where the base gathers / reduce-scatters its input / output, and the
  parameters whose gradient is then partial over the sequence (A of a column-parallel, B of a
  row-parallel linear, and a B kept whole) go through ``copy_to_tensor_model_parallel_region``,
  whose backward sums it over the TP group, so every replica gets the same full gradient.

The adapters hang beside their linear (``self_attention.linear_qkv_lora``, ...) and add to its
output through a forward hook, so the base weights keep their checkpoint keys. ``apply_lora``
freezes every base parameter. Routed experts' adapters need megatron's ``SequentialMLP`` (or
mcore_ext's grouped-GEMM form of it, which runs its loop while a linear has a hook) at expert
TP 1: the dispatcher, not the expert linears, does the expert-TP communication, which the
adapters' mappings here do not follow. Shapes: s sequence (s/tp under SP), b batch, r rank.
"""

import dataclasses
import math

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import get_pg_rank, get_pg_size

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Routed experts, as PEFT's target_parameters names transformers' fused [E, out, in] weights.
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS + EXPERT_TARGETS
ALL_LINEAR = "all-linear"  # the attention and MLP linears, not the routed experts (as PEFT's)
# In every adapter parameter's name (``...linear_qkv_lora.targets.q_proj.lora_A``), none other's.
ADAPTER_KEY = "_lora."


@dataclasses.dataclass
class LoraConfig:
    """What to adapt and how (PEFT's ``LoraConfig`` fields of the same meaning)."""

    rank: int = 0
    """r, the adapters' inner dimension; 0 = no LoRA."""

    alpha: float = 16.0
    """lora_alpha: the update is scaled by alpha / rank."""

    dropout: float = 0.0
    """lora_dropout: dropout on the adapter's input (training only)."""

    targets: tuple = ALL_LINEAR
    """PEFT module names (``TARGETS``); ``all-linear`` = every attention and MLP one (not the
    routed experts', which it may be named with)."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an integer >= 0, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not self.alpha > 0:
            raise ValueError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.targets
        if isinstance(targets, str):
            targets = (targets,) if targets == ALL_LINEAR else tuple(targets.split())
        targets = tuple(targets)
        if ALL_LINEAR in targets:
            others = [t for t in targets if t != ALL_LINEAR]
            if any(t not in EXPERT_TARGETS for t in others) or len(others) + 1 != len(targets):
                raise ValueError(f"lora.targets: {ALL_LINEAR} stands alone (or with "
                                 f"{' / '.join(EXPERT_TARGETS)}), got {list(targets)}")
            targets = ATTENTION_TARGETS + MLP_TARGETS + tuple(others)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise ValueError(f"lora.targets: unknown target(s) {unknown or list(targets)}; "
                             f"choose from {', '.join(TARGETS)} or {ALL_LINEAR}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"lora.targets: a target is named twice in {list(targets)}")
        self.targets = tuple(t for t in TARGETS if t in targets)  # a canonical order

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# --------------------------------------------------------------------------------- adapters


class LoraTarget(torch.nn.Module):
    """One target's A [r, in_r] and B [rows, r], and where B's rows land in the base output.

    ``cols``: this rank's output columns of the base linear that B's rows (or, with ``rows``, the
    selected rows of a whole B) add to; None = all columns, in order.
    """

    def __init__(self, a_shape, b_shape, base_weight, cols=None, rows=None):
        super().__init__()
        dtype = base_weight.dtype
        self.lora_A = torch.nn.Parameter(torch.empty(*a_shape, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(*b_shape, dtype=dtype))
        # PEFT's default init: A kaiming-uniform (a = sqrt(5)), B zero: a new adapter adds 0.
        # Drawn on the CPU (the same A on every device), then put beside the base weight: the
        # launcher has moved the model to its GPU already.
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.to(base_weight.device)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("rows", rows, persistent=False)


class LoraLinear(torch.nn.Module):
    """The adapters of one base linear: ``targets`` (name -> LoraTarget) and the TP plumbing.

    ``parallel`` is ``column`` or ``row``; ``b_axis`` / ``a_axis``: which adapter tensors are
    TP-sharded (and along which axis) in the checkpoint.
    """

    def __init__(self, base, parallel: str, targets: dict, scaling: float, dropout: float):
        super().__init__()
        self.parallel = parallel
        self.scaling = scaling
        self.dropout = torch.nn.Dropout(dropout) if dropout else None
        self.targets = torch.nn.ModuleDict(targets)
        self.tp_group = base.tp_group
        self.sequence_parallel = base.sequence_parallel
        self.out_features = (base.output_size_per_partition if parallel == "column"
                             else base.output_size)

    def delta(self, x):
        """The adapters' sum added to the base output, [s, b, out_r] (row-parallel under SP:
        [s/tp, b, out])."""
        if self.dropout is not None:
            x = self.dropout(x)
        tp = get_pg_size(self.tp_group)
        out = None
        for target in self.targets.values():
            a, b = target.lora_A, target.lora_B
            if self.parallel == "column":
                # u = A x over the whole sequence; its gradient summed over the ranks' B shards.
                if self.sequence_parallel and tp > 1:
                    a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
                    u = gather_from_sequence_parallel_region(x @ a.t(), group=self.tp_group)
                else:
                    u = copy_to_tensor_model_parallel_region(x @ a.t(), group=self.tp_group)
            else:
                partial = x @ a.t()
                if self.sequence_parallel and tp > 1:
                    u = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
                    b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
                else:
                    u = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
            if target.rows is not None:  # a whole B: this rank's rows; the gradient summed
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)[target.rows]
            d = (u @ b.t()) * self.scaling
            if target.cols is None:
                out = d if out is None else out + d
                continue
            if out is None:
                out = d.new_zeros(*d.shape[:-1], self.out_features)
            out = out.index_add(-1, target.cols, d)
        return out

    def merged_delta(self) -> dict:
        """{target: (scaling * B A) rows of this rank's base weight, and their columns}."""
        merged = {}
        for name, target in self.targets.items():
            b = target.lora_B if target.rows is None else target.lora_B[target.rows]
            merged[name] = (self.scaling * (b.float() @ target.lora_A.float()), target.cols)
        return merged

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """B sharded along its rows (column-parallel, an even block of the HF rows) or A along
        its columns (row-parallel); the rest replicated over TP. Replicas over data (and
        context) parallelism are told apart by their DP rank, so one of them writes."""
        state = {}
        axes = {}
        for name, target in self.targets.items():
            key = f"targets.{name}"  # state_dict's keys, as load_state_dict reads them
            state[f"{key}.lora_A"] = target.lora_A
            state[f"{key}.lora_B"] = target.lora_B
            if self.parallel == "row":
                axes[f"{key}.lora_A"] = 1
            elif target.rows is None:
                axes[f"{key}.lora_B"] = 0
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def _hook(adapter: LoraLinear):
    def add_delta(module, args, output):
        out, bias = output
        return out + adapter.delta(args[0]).to(out.dtype), bias

    return add_delta


# ---------------------------------------------------------------------------- row placement


def qkv_gate_rows(heads, groups, head_dim, tp, rank):
    """{target: (HF rows, local columns)} of this rank's ``[QKV_r ; Gate_r]`` of linear_qkv.

    Megatron's fused QKV is, per query group, its query heads, then its key, then its value;
    ColumnParallelLinear gives rank r the contiguous block r of those rows (which cuts through a
    group when groups < tp), followed by the g_proj rows of heads [r H/tp, (r+1) H/tp).
    """
    per_group = heads // groups
    width = (per_group + 2) * head_dim
    qkv_r = groups * width // tp
    found = {t: ([], []) for t in ("q_proj", "k_proj", "v_proj")}
    for col in range(rank * qkv_r, (rank + 1) * qkv_r):
        group, offset = divmod(col, width)
        if offset < per_group * head_dim:
            name, row = "q_proj", group * per_group * head_dim + offset
        elif offset < (per_group + 1) * head_dim:
            name, row = "k_proj", group * head_dim + offset - per_group * head_dim
        else:
            name, row = "v_proj", group * head_dim + offset - (per_group + 1) * head_dim
        found[name][0].append(row)
        found[name][1].append(col - rank * qkv_r)
    np_r = heads // tp
    found["g_proj"] = (list(range(rank * np_r, (rank + 1) * np_r)),
                       list(range(qkv_r, qkv_r + np_r)))
    return found


def glu_rows(ffn, tp, rank, gated: bool):
    """{target: (HF rows, local columns)} of this rank's linear_fc1: ``[gate_r ; up_r]`` (SwiGLU)
    or ``up_r`` alone."""
    f_r = ffn // tp
    rows = list(range(rank * f_r, (rank + 1) * f_r))
    if not gated:
        return {"up_proj": (rows, list(range(f_r)))}
    return {"gate_proj": (rows, list(range(f_r))), "up_proj": (rows, list(range(f_r, 2 * f_r)))}


def b_is_sharded(rows, total: int, tp: int, rank: int) -> bool:
    """Whether a column-parallel target's B holds only this rank's block of its ``total`` HF
    rows (``rows``: the HF rows this rank's output columns hold), else B is kept whole."""
    block = total // tp
    return total % tp == 0 and list(rows) == list(range(rank * block, (rank + 1) * block))


def _column_targets(base, placement: dict, totals: dict, wanted, cfg: LoraConfig, tp, rank):
    """LoraTargets of a column-parallel linear: B the even row block where a rank's rows are one,
    else whole (``rows`` selects)."""
    targets = {}
    for name in wanted:
        if name not in placement:
            continue
        rows, cols = placement[name]
        total = totals[name]
        cols_t = torch.tensor(cols, dtype=torch.long, device=base.weight.device)
        if b_is_sharded(rows, total, tp, rank):
            target = LoraTarget((cfg.rank, base.input_size), (len(rows), cfg.rank), base.weight,
                                cols_t)
            set_tensor_model_parallel_attributes(target.lora_B, True, 0, 1)
        else:
            rows_t = torch.tensor(rows, dtype=torch.long, device=base.weight.device)
            target = LoraTarget((cfg.rank, base.input_size), (total, cfg.rank), base.weight,
                                cols_t, rows_t)
        targets[name] = target
    return targets


# ------------------------------------------------------------------------------- the model


class LoraError(ValueError):
    """A LoRA request this model cannot take (one line naming the field and value)."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> list:
    """Freeze ``model``'s parameters and add ``cfg``'s adapters; returns the adapters' names.

    Adapted: every self-attention's ``linear_qkv`` (q / k / v / g_proj) and ``linear_proj``
    (o_proj), every dense MLP's and shared expert's ``linear_fc1`` (gate / up_proj) and
    ``linear_fc2`` (down_proj), the MTP layers' among them; with ``EXPERT_TARGETS`` every local
    routed expert's ``linear_fc1`` and ``linear_fc2``. Refused: routed-expert targets on a model
    without them, on experts other than ``SequentialMLP`` or at expert TP > 1, and Transformer
    Engine's layernorm-fused linears. A vision-language model's tower and projector
    (``vision_model``, ``vision_projection``) get no adapter: they stay frozen with the rest.
    """
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not cfg.enabled:
        return []
    for p in model.parameters():
        p.requires_grad_(False)
    config = _model_config(model)
    expert_targets = [t for t in cfg.targets if t in EXPERT_TARGETS]
    if expert_targets and not getattr(config, "num_moe_experts", None):
        raise LoraError(f"lora.targets: {' '.join(expert_targets)} adapt routed experts, and the "
                        "model has none (model.num_moe_experts is not set)")
    added = []
    for name, module in list(model.named_modules()):
        if VISION_MODULES & set(name.split(".")):
            continue
        if isinstance(module, SelfAttention):
            added += _adapt_attention(name, module, cfg)
        elif isinstance(module, MLP) and not _inside_experts(name):
            added += _adapt_mlp(name, module, cfg)
        elif isinstance(module, MoELayer) and expert_targets:
            added += _adapt_experts(f"{name}.experts", module.experts, expert_targets, cfg)
    return added


# The vision side of mcore_ext.models.vision_language: not part of the text model LoRA adapts.
VISION_MODULES = frozenset({"vision_model", "vision_projection"})


def _model_config(model):
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            return config
    raise LoraError("lora: the model has no megatron config")


def _inside_experts(name: str) -> bool:
    return "experts" in name.split(".")


def _check_linear(name, linear):
    if "LayerNorm" in type(linear).__name__:
        raise LoraError(f"lora: {name} is {type(linear).__name__} (a layernorm fused into the "
                        "linear); LoRA needs the sdpa / local backends' separate norm")


def _attach(parent, attr, adapter, added, prefix):
    setattr(parent, f"{attr}_lora", adapter)
    # A plain attribute, not a submodule: merge_lora(remove=True) takes the hook off.
    adapter.__dict__["hook"] = getattr(parent, attr).register_forward_hook(_hook(adapter))
    added += [f"{prefix}.{attr}_lora.{t}" for t in adapter.targets]


def _adapt_attention(name, attn, cfg: LoraConfig) -> list:
    config = attn.config
    added = []
    tp_group = attn.linear_qkv.tp_group
    tp, rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    qkv_targets = [t for t in cfg.targets if t in ("q_proj", "k_proj", "v_proj", "g_proj")]
    gated = getattr(attn, "head_wise_attn_gate", False)
    if "g_proj" in qkv_targets and not gated:
        qkv_targets.remove("g_proj")
    if qkv_targets:
        _check_linear(f"{name}.linear_qkv", attn.linear_qkv)
        heads, groups, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        placement = qkv_gate_rows(heads, groups, hn, tp, rank)
        if not gated:
            placement.pop("g_proj")
        totals = dict(q_proj=heads * hn, k_proj=groups * hn, v_proj=groups * hn, g_proj=heads)
        targets = _column_targets(attn.linear_qkv, placement, totals, qkv_targets, cfg, tp, rank)
        _attach(attn, "linear_qkv", LoraLinear(attn.linear_qkv, "column", targets, cfg.scaling,
                                               cfg.dropout), added, name)
    if "o_proj" in cfg.targets:
        _attach(attn, "linear_proj", _row_adapter(attn.linear_proj, "o_proj", cfg), added, name)
    return added


def _adapt_mlp(name, mlp, cfg: LoraConfig) -> list:
    config = mlp.config
    added = []
    tp_group = mlp.linear_fc1.tp_group
    tp, rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    fc1_targets = [t for t in cfg.targets if t in ("gate_proj", "up_proj")]
    if fc1_targets:
        _check_linear(f"{name}.linear_fc1", mlp.linear_fc1)
        ffn = mlp.linear_fc1.output_size // (2 if config.gated_linear_unit else 1)
        placement = glu_rows(ffn, tp, rank, config.gated_linear_unit)
        totals = dict(gate_proj=ffn, up_proj=ffn)
        targets = _column_targets(mlp.linear_fc1, placement, totals, fc1_targets, cfg, tp, rank)
        if targets:
            _attach(mlp, "linear_fc1", LoraLinear(mlp.linear_fc1, "column", targets, cfg.scaling,
                                                  cfg.dropout), added, name)
    if "down_proj" in cfg.targets:
        _attach(mlp, "linear_fc2", _row_adapter(mlp.linear_fc2, "down_proj", cfg), added, name)
    return added


def _adapt_experts(name, experts, targets, cfg: LoraConfig) -> list:
    """Each local routed expert's adapters: ``experts.gate_up_proj`` on its whole linear_fc1
    (``[gate ; up]``, one A and B as transformers' fused weight), ``experts.down_proj`` on its
    linear_fc2. Their parameters are marked expert-parallel (``allreduce=False``) as the experts'
    own, so megatron reduces their gradients over the expert-data-parallel group."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not isinstance(experts, SequentialMLP):
        raise LoraError(f"lora.targets: {' '.join(targets)} on {name} ({type(experts).__name__}): "
                        "routed experts' adapters need megatron's SequentialMLP experts (the sdpa "
                        "/ local backends)")
    etp = get_pg_size(experts.tp_group)
    if etp > 1:
        raise LoraError(f"lora.targets: {' '.join(targets)} with expert tensor parallelism "
                        f"{etp}: routed experts' adapters need "
                        "parallelism.expert_tensor_parallel_size=1")
    added = []
    for j, expert in enumerate(experts.local_experts):
        prefix = f"{name}.local_experts.{j}"
        if "experts.gate_up_proj" in targets:
            base = expert.linear_fc1
            _check_linear(f"{prefix}.linear_fc1", base)
            target = LoraTarget((cfg.rank, base.input_size), (base.output_size, cfg.rank),
                                base.weight)
            _attach(expert, "linear_fc1", LoraLinear(base, "column", {"gate_up_proj": target},
                                                     cfg.scaling, cfg.dropout), added, prefix)
        if "experts.down_proj" in targets:
            _attach(expert, "linear_fc2", _row_adapter(expert.linear_fc2, "down_proj", cfg),
                    added, prefix)
        for adapter in (getattr(expert, "linear_fc1_lora", None),
                        getattr(expert, "linear_fc2_lora", None)):
            for p in adapter.parameters() if adapter is not None else ():
                p.allreduce = False
    return added


def _row_adapter(base, target_name, cfg: LoraConfig) -> LoraLinear:
    target = LoraTarget((cfg.rank, base.input_size_per_partition), (base.output_size, cfg.rank),
                        base.weight)
    set_tensor_model_parallel_attributes(target.lora_A, True, 1, 1)
    return LoraLinear(base, "row", {target_name: target}, cfg.scaling, cfg.dropout)


def lora_adapters(model) -> dict:
    """{module name: LoraLinear} of ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


@torch.no_grad()
def merge_lora(model, remove: bool = False) -> None:
    """Fold every adapter into its base weight (W += scaling B A at the target's rows) and zero
    its B, so the model computes the same with the adapters still attached; with ``remove`` the
    adapters are taken off (the plain model, its parameters' names and checkpoint keys)."""
    for name, adapter in lora_adapters(model).items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, attr[: -len("_lora")])
        for target_name, (delta, cols) in adapter.merged_delta().items():
            if cols is None:
                base.weight.add_(delta.to(base.weight.dtype))
            else:
                base.weight.index_add_(0, cols, delta.to(base.weight.dtype))
            adapter.targets[target_name].lora_B.zero_()
        if remove:
            adapter.hook.remove()
            delattr(parent, attr)
