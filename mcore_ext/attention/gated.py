"""Self-attention with a head-wise sigmoid output gate fused into ``linear_qkv``.

    out_h = sigmoid(x @ w_gate_h + b_gate_h) * attention_h(x)        (before linear_proj)

``linear_qkv`` is one column-parallel GEMM with ``num_attention_heads`` extra output rows.
ColumnParallelLinear splits its rows contiguously, so each TP rank holds ``[QKV_r ; Gate_r]``: its
usual QKV rows followed by the gate rows of the query heads it computes. The checkpoint layout is
global ``[QKV ; Gate]``, kept exact across TP sizes by ``mcore_ext.checkpoint.sharding``.

Shapes (megatron notation): sq sequence, b batch, h hidden, np query heads / ng query groups on
this rank, hn head dim; ``qkv_r`` / ``np_r`` are this rank's QKV / gate columns of linear_qkv.
"""

import contextvars
import copy
import dataclasses
import functools
import typing
import warnings

import torch
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_pg_rank
from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region

from mcore_ext._mcore_compat import self_attention_init_kwargs
from mcore_ext.checkpoint.sharding import qkv_gate_factory
from mcore_ext.config import GatedTransformerConfig


class HeadWiseGatedSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` with one learned sigmoid gate per attention head.

    With ``config.head_wise_attn_gate`` off it is exactly ``SelfAttention``: same parameters,
    forward and checkpoint keys.
    """

    def __init__(
        self,
        config: GatedTransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ):
        self.head_wise_attn_gate = getattr(config, "head_wise_attn_gate", False)
        if self.head_wise_attn_gate:
            submodules = dataclasses.replace(
                submodules,
                linear_qkv=_with_gate_rows(submodules.linear_qkv, config.num_attention_heads),
            )
        super().__init__(**self_attention_init_kwargs(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        ))
        # Running sums of this layer's gate values while training, when a GateStatistics is
        # attached (the launcher's logging.gate_statistics); None: nothing is computed.
        self.gate_statistics: GateStatistics | None = None
        if not self.head_wise_attn_gate:
            return

        self.qkv_rows_per_partition = config.qkv_rows // self.world_size
        self.gate_rows_per_partition = config.head_wise_gate_rows // self.world_size
        self.linear_qkv_out_dim = config.linear_qkv_rows
        # The QKV columns of linear_qkv's output are a view with a row stride of qkv_r + np_r.
        # Kernels that .view q, k or v (megatron's local attention, fused RoPE, ...) need them
        # copied out; a core attention that declares it takes strided q/k/v (mcore_ext's SDPA)
        # saves that full-size copy.
        self.copy_qkv_out = not (
            getattr(self.core_attention, "accepts_strided_qkv", False)
            and not config.apply_rope_fusion
        )

        # megatron's forward already carries an output gate as a return value, from
        # get_query_key_value_tensors to _apply_output_gate, whenever the module's config has
        # attention_output_gate set. This module reads a private copy of the config with that
        # flag on, so the head-wise gate travels the same path; both hooks are overridden below.
        # The model's config, and every other module, still sees attention_output_gate=False.
        self.config = copy.copy(config)
        self.config.attention_output_gate = True

        self._init_gate_rows()
        self._tag_gate_rows_for_muon()

    # ---------------------------------------------------------------------------------- forward

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """[sq, b, h] -> query [sq, b, np, hn], key / value [sq, b, ng, hn], gate logits [sq, b, np]."""
        if not self.head_wise_attn_gate:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
            )
        if not split_qkv:
            raise NotImplementedError("head_wise_attn_gate needs split_qkv=True")

        # [sq, b, qkv_r + np_r]: one GEMM for Q, K, V and the gates.
        mixed, _ = self.linear_qkv(hidden_states)
        query, key, value, gate = self._split_query_key_value_gate(mixed)

        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.config.test_mode:
            self.run_realtime_tests()
        return query, key, value, gate

    def _split_query_key_value_gate(self, mixed):
        """linear_qkv's output -> query [sq, b, np, hn], key / value [sq, b, ng, hn], gate logits.

        Megatron's interleaved [q.. k v] layout per query group, split as the ungated layer splits
        it. With ``copy_qkv_out`` q, k and v have the shapes and strides of the ungated layer's;
        without it, they are the same views of ``mixed``, with a longer row stride.
        """
        hn = self.hidden_size_per_attention_head
        groups, tp = self.config.num_query_groups, self.world_size
        # Query heads per group, on this rank (after the gather below when groups < tp).
        sizes = (self.num_attention_heads_per_partition // self.num_query_groups_per_partition * hn,
                 hn, hn)
        if groups >= tp:
            query, key, value, gate = _SplitQKVGate.apply(
                mixed, self.num_query_groups_per_partition, sizes, self.copy_qkv_out
            )
            # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
            return query.reshape(*query.shape[:2], -1, hn), key, value, gate

        # A rank's QKV rows cut through a query group: gather all groups, keep this rank's group.
        # Rank r then computes query heads [r * H/tp, (r+1) * H/tp), the same heads as its local
        # gate rows.
        mixed_qkv, gate = mixed.split(
            [self.qkv_rows_per_partition, self.gate_rows_per_partition], dim=-1
        )
        mixed_qkv = all_gather_last_dim_from_tensor_parallel_region(
            mixed_qkv.contiguous(), group=self.pg_collection.tp
        )
        rank = get_pg_rank(self.pg_collection.tp)
        width = mixed_qkv.size(-1) // groups
        group = rank // (tp // groups)
        mixed_qkv = mixed_qkv[..., group * width : (group + 1) * width]
        query, key, value = mixed_qkv.unflatten(-1, (1, -1)).split(sizes, dim=-1)
        query = query.reshape(*query.shape[:2], -1, hn)
        heads = self.config.num_attention_heads // tp
        first = (rank % (tp // groups)) * heads
        return query[:, :, first : first + heads], key, value, gate.contiguous()

    def forward(self, *args, **kwargs):
        """``SelfAttention.forward``, with the gated output recomputed in backward.

        linear_proj saves its input, the gated output, for its weight gradient. Without a gate
        that input is the core-attention output, which the gate saves anyway; the gated output
        would be one more [sq, b, np * hn] activation per layer. So while this forward runs, a
        tensor saved for backward that is exactly a gated output (see ``_pack_gated``) is packed
        as the (attn, sigmoid) pair the gate saved already, and recomputed by the same kernel,
        bit for bit, when backward needs it.

        Saved-tensor hooks do not nest: only the innermost set sees a saved tensor. So this steps
        aside when hooks are already active around the layer (torch's non-reentrant checkpoint,
        megatron's CPU offloading: they manage every saved tensor themselves) and when megatron's
        fine-grained offloading will install its own inside the layer.
        """
        if (
            not (self.head_wise_attn_gate and torch.is_grad_enabled())
            or self.config.cpu_offloading
            or self.config.fine_grained_activation_offloading
            or _saved_tensor_hooks_active()
        ):
            return super().forward(*args, **kwargs)
        recipes = {}  # storage of a gated output -> its recipe; this call's only
        token = _gated_outputs.set(recipes)
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(_pack_gated, recipes), _unpack_gated
            ):
                return super().forward(*args, **kwargs)
        finally:
            _gated_outputs.reset(token)

    def _apply_output_gate(self, core_attn_out, gate):
        """core_attn_out [sq, b, np * hn] scaled per head by sigmoid(gate [sq, b, np]) (fp32)."""
        if not self.head_wise_attn_gate:
            return super()._apply_output_gate(core_attn_out, gate)
        attn = core_attn_out.unflatten(-1, (gate.size(-1), -1))  # [sq, b, np, hn]
        scale = torch.sigmoid(gate.float())  # [sq, b, np]; saved by the sigmoid anyway
        if self.gate_statistics is not None and self.training:
            self.gate_statistics.add(scale)
        gated = _ScaleHeads.apply(attn, scale)
        recipes = _gated_outputs.get()
        if recipes is not None and gated.is_contiguous() and gated.storage_offset() == 0:
            recipes[gated.untyped_storage().data_ptr()] = _Recipe(
                attn.detach(), scale.detach(), gated.dtype
            )
        return gated.flatten(-2)

    # ------------------------------------------------------------------------------ checkpoint

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Save linear_qkv's QKV and gate rows as separate global tensors (TP-reshardable)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.head_wise_attn_gate:
            for name in ("weight", "bias"):
                key = f"{prefix}linear_qkv.{name}"
                if key in sharded:
                    sharded[key] = qkv_gate_factory(
                        sharded[key], self.qkv_rows_per_partition, sharded_offsets
                    )
        return sharded

    # ------------------------------------------------------------------------------------ init

    def _tag_gate_rows_for_muon(self):
        """Tell megatron's Muon where q, k, v and the gate rows of this rank's linear_qkv weight
        are (``_mcore_compat._install_gate_aware_muon``): (local query groups, megatron's (q, k, v)
        rows per group, gate rows); no groups when a rank's QKV rows cut through a query group."""
        hn = self.hidden_size_per_attention_head
        sizes = (self.config.num_attention_heads // self.config.num_query_groups * hn, hn, hn)
        groups = (self.num_query_groups_per_partition
                  if self.config.num_query_groups >= self.world_size else None)
        self.linear_qkv.weight.qkv_gate_split = (groups, sizes, self.gate_rows_per_partition)

    def _init_gate_rows(self):
        """Draw this rank's gate weight rows and set its gate bias rows.

        The gate rows come from a stream of their own (``_gate_row_generator``): the rows
        linear_qkv shares with the ungated layer, and every other weight of the model, are what
        the same seed gives without the gate (``_with_gate_rows``), so a gated and an ungated run
        start from the same weights. The rows are drawn like any QKV row (linear_qkv's
        ``init_method``), for every head at once, so a head's row is the same at every TP size,
        then scaled by ``head_wise_attn_gate_init_weight_scale``; the bias rows are set to
        ``head_wise_attn_gate_init_bias``. Nothing is drawn when weights are not initialised
        (``perform_initialization=False``: a checkpoint or HF import writes them).
        """
        weight = self.linear_qkv.weight
        if weight.device.type == "meta" or not self.config.perform_initialization:
            return
        gate_rows = slice(self.qkv_rows_per_partition, None)
        bias = getattr(self.linear_qkv, "bias", None)
        init_bias = self.config.effective_head_wise_attn_gate_init_bias
        every_head = torch.empty(self.config.num_attention_heads, weight.size(1),
                                 dtype=torch.float32)
        seed = _gate_row_seed(self.layer_number)
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: no CUDA stream moves
            torch.default_generator.manual_seed(seed)
            self._gate_init_method(every_head)
        first = get_pg_rank(self.pg_collection.tp) * self.gate_rows_per_partition
        mine = every_head[first : first + self.gate_rows_per_partition]
        with torch.no_grad():
            weight[gate_rows].copy_(mine * self.config.head_wise_attn_gate_init_weight_scale)
            if bias is not None and bias.numel():
                bias[gate_rows].fill_(init_bias)
        if init_bias != self.config.head_wise_attn_gate_init_bias:
            _warn_once(
                f"head_wise_attn_gate_init_bias={self.config.head_wise_attn_gate_init_bias} "
                "has no effect without a linear_qkv bias (add_qkv_bias or add_bias_linear): "
                "gates start near sigmoid(0) = 0.5"
            )

    @property
    def _gate_init_method(self):
        # SelfAttention builds linear_qkv with config.init_method (megatron's QKV init).
        return self.config.init_method


class GateStatistics:
    """Sums of one layer's gate values (its sigmoids) over the tokens and heads it gated on this
    rank: their mean and the fraction of closed gates (below ``CLOSED_BELOW``). Tensors on the
    gate's device, read (and so synchronised) only by ``take``."""

    CLOSED_BELOW = 0.1

    def __init__(self):
        self.total = self.closed = None
        self.count = 0

    def add(self, scale: torch.Tensor) -> None:
        scale = scale.detach()
        total, closed = scale.sum(), (scale < self.CLOSED_BELOW).sum()
        self.total = total if self.total is None else self.total + total
        self.closed = closed if self.closed is None else self.closed + closed
        self.count += scale.numel()

    def take(self) -> tuple[float, float, int]:
        """(sum of gate values, number closed, number of values) since the last take."""
        out = (0.0, 0.0, 0) if self.total is None else (
            float(self.total), float(self.closed), self.count)
        self.__init__()
        return out


class _SplitQKVGate(torch.autograd.Function):
    """mixed [sq, b, qkv_r + np_r] -> query [sq, b, ng, np/ng * hn], key / value [sq, b, ng, hn],
    gate logits [sq, b, np_r] (contiguous, so no view keeps ``mixed`` alive through it).

    q, k and v are views of ``mixed`` or, with ``copy_qkv``, of a contiguous copy of its QKV
    columns.
    """

    @staticmethod
    def forward(ctx, mixed, groups, sizes, copy_qkv):
        qkv_rows = groups * sum(sizes)
        qkv, gate = mixed.split([qkv_rows, mixed.size(-1) - qkv_rows], dim=-1)
        if copy_qkv:
            qkv = qkv.contiguous()
        ctx.set_materialize_grads(False)
        ctx.layout = (mixed.shape, mixed.dtype, mixed.device, groups, sizes)
        return (*qkv.unflatten(-1, (groups, -1)).split(sizes, dim=-1), gate.contiguous())

    @staticmethod
    def backward(ctx, *grads):
        """The q, k, v and gate gradients joined into one [sq, b, qkv_r + np_r] buffer.

        On a GPU one ``torch.cat`` of every group's q, k and v parts and the gate columns, in
        the buffer's column order: CUDA's batched cat kernel reads each strided part once and
        writes the buffer once, as the ungated layer's one cat does. Two cats (q, k, v per group,
        then the gate columns after them) wrote the QKV gradient twice: +105 us of the bf16
        layer's 7.6 ms at hidden 4096, seq 4096 on an H200 (profile of 2026-11-28). Copying each
        part into its strided place took CUDA's unvectorised copy kernel 285 us. A CPU keeps the
        two cats: one cat of many strided parts is no faster there.
        """
        shape, dtype, device, groups, sizes = ctx.layout
        lead = shape[:-1]
        qkv_rows = groups * sum(sizes)

        def given(grad, size):  # a part that got no gradient: zeros, not materialised
            if grad is not None:
                return grad
            return torch.zeros((), dtype=dtype, device=device).expand(*size)

        parts = [given(g, (*lead, groups, n)) for g, n in zip(grads[:3], sizes)]
        gate = given(grads[3], (*lead, shape[-1] - qkv_rows))
        return _join_gradients(parts, gate, one_cat=device.type == "cuda"), None, None, None


def _join_gradients(parts, gate, one_cat):
    """q, k, v gradients [..., ng, n_i] and the gate's [..., np_r] -> [..., ng * sum(n_i) + np_r]
    in linear_qkv's column order (per group q, k, v; then the gate columns)."""
    if one_cat:
        groups = parts[0].size(-2)
        return torch.cat([part[..., g, :] for g in range(groups) for part in parts] + [gate],
                         dim=-1)
    qkv = torch.cat(parts, dim=-1)
    return torch.cat([qkv.flatten(-2), gate], dim=-1)


class _ScaleHeads(torch.autograd.Function):
    """x [..., np, hn] * scale [..., np] (fp32 sigmoids): upstream megatron's gate arithmetic.

    The scale is rounded to x's dtype and the product taken in x's dtype, as upstream dev's
    native head-wise gate computes it (``core_attn_out * torch.sigmoid(gate.float()).to(dtype)``),
    so the two gates give the same outputs bit for bit. No kernel mixes dtypes: a CPU would first
    cast the whole of x to an fp32 copy. The fp32 scale is what the sigmoid saves anyway; the
    backward reduces <grad_h, x_h> per head in fp32.
    """

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return _scale_heads(x, scale)

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        if grad.is_cuda and all(ctx.needs_input_grad):
            # The scale rounded outside: the compiler would skip the rounding of an inner cast.
            return _fused_scale_heads_backward()(grad, x, scale.to(grad.dtype))
        grad_x = _scale_heads(grad, scale) if ctx.needs_input_grad[0] else None
        grad_scale = None
        if ctx.needs_input_grad[1]:
            grad_scale = _head_dots(grad, x)
        return grad_x, grad_scale


def _scale_heads(x, scale):
    """x [..., np, hn] * scale [..., np], the scale rounded to x's dtype first."""
    scale = scale.to(x.dtype)
    if x.is_cuda:
        return _compiled_product()(x, scale)
    return _product(x, scale)


def _product(x, scale):
    return x * scale.unsqueeze(-1)


@functools.cache
def _compiled_product():
    """``_product`` compiled for a GPU, the same product bit for bit. Eager, the scale broadcast
    over hn (stride 0) keeps CUDA's elementwise kernel from vectorising: 85 us a call for the
    bf16 layer at hidden 4096, seq 4096 on an H200, about twice a copy of x."""
    return torch.compile(_product)


def _head_dots(a, b):
    """<a_h, b_h> per head, [..., np, hn] x2 -> [..., np] as fp32, on every device: products
    in fp32 (exact for bf16 / fp16 inputs) summed in fp32. A bf16 GEMM would round each sum to
    bf16, a bf16 product each term. Slabs keep the fp32 temporaries small (on a CPU: in the
    core's cache; on a GPU: few kernel launches)."""
    out = a.new_empty(a.shape[:-1], dtype=torch.float32)
    slab = (1 << 24) if a.is_cuda else (1 << 16)
    rows = max(1, slab // max(1, a[0].numel()))
    for start in range(0, a.size(0), rows):
        part = slice(start, start + rows)
        torch.sum(a[part].float() * b[part].float(), dim=-1, out=out[part])
    return out


def _scale_heads_backward(grad, x, scale):
    """_ScaleHeads' two gradients from the formulas, ``scale`` already in grad's dtype: grad *
    scale (the forward's product) and <grad_h, x_h> per head (fp32 products and sum)."""
    return _product(grad, scale), (grad.float() * x.float()).sum(-1)


@functools.cache
def _fused_scale_heads_backward():
    """``_scale_heads_backward`` compiled for a GPU: one read of grad and x. Eager, the fp32
    dots write fp32 copies of both and of their product and read them back. grad_x is the same
    bf16 / fp16 product bit for bit; the dots are fp32 sums in another order. Built on first use:
    importing the compiler costs a CPU process seconds it never needs."""
    return torch.compile(_scale_heads_backward)


# The gated outputs of the HeadWiseGatedSelfAttention.forward in flight, by storage. A context
# variable, not module state: it lives for one forward call and is read only by that call.
_gated_outputs: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "gated_outputs", default=None
)


class _Recipe(typing.NamedTuple):
    """How to rebuild a gated output (a contiguous tensor): what the gate saved, and its dtype."""

    attn: torch.Tensor  # [sq, b, np, hn]
    scale: torch.Tensor  # [sq, b, np], fp32
    dtype: torch.dtype


class _Packed(typing.NamedTuple):
    recipe: _Recipe
    shape: torch.Size  # of the saved view


def _pack_gated(recipes, saved):
    """A saved tensor that is the whole gated output, as any contiguous view, becomes a recipe.

    A contiguous tensor is determined by its storage, offset, dtype and shape, so such a view (a
    linear layer may save its input folded to 2-D) is rebuilt exactly. Any other view of it (an
    offset, a slice, other strides or dtype) is kept as it is.
    """
    if type(saved) is not torch.Tensor:  # parameters, tensor subclasses: never a gated output
        return saved
    recipe = recipes.get(saved.untyped_storage().data_ptr())
    if (
        recipe is None
        or saved.storage_offset() != 0
        or saved.dtype != recipe.dtype
        or saved.numel() != recipe.attn.numel()
        or not saved.is_contiguous()
    ):
        return saved
    return _Packed(recipe, saved.shape)


def _unpack_gated(packed):
    if not isinstance(packed, _Packed):
        return packed
    recipe = packed.recipe
    return _scale_heads(recipe.attn, recipe.scale).view(packed.shape)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active in this thread (torch has no public query)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _with_gate_rows(build_linear, gate_rows: int):
    """A linear_qkv builder that appends ``gate_rows`` output rows to what it is asked for,
    without moving any random stream that the ungated layer's init would leave elsewhere.

    Drawing the gate rows in linear_qkv's own init would shift the stream every later weight is
    drawn from: a gated and an ungated model of the same seed would then differ in every weight
    after the first linear_qkv (on a CPU's sequential stream) and no run could tell the gate
    from its init. So the ungated linear is built first, drawing exactly what the ungated layer
    draws, its rows (and every other parameter it has, such as a fused norm) are copied into the
    gated linear, which is built without drawing, and the gate rows are drawn from a stream of
    their own by ``HeadWiseGatedSelfAttention._init_gate_rows``.
    """

    def build(input_size, output_size, *, config, **kwargs):
        if not config.perform_initialization:
            return build_linear(input_size, output_size + gate_rows, config=config, **kwargs)
        ungated = build_linear(input_size, output_size, config=config, **kwargs)
        quiet = copy.copy(config)
        quiet.perform_initialization = False
        gated = build_linear(input_size, output_size + gate_rows, config=quiet, **kwargs)
        if getattr(gated, "config", None) is quiet:
            gated.config = config
        _copy_shared_rows(ungated, gated)
        return gated

    return build


def _copy_shared_rows(ungated: torch.nn.Module, gated: torch.nn.Module) -> None:
    """Every parameter and buffer of ``ungated`` into ``gated``'s leading rows (its QKV rows;
    the gate rows after them stay for ``_init_gate_rows``)."""
    theirs = dict(ungated.named_parameters())
    theirs.update(ungated.named_buffers())
    with torch.no_grad():
        for name, tensor in (*gated.named_parameters(), *gated.named_buffers()):
            source = theirs.get(name)
            if source is None or source.dim() != tensor.dim() or source.dim() == 0:
                continue
            if source.shape[1:] != tensor.shape[1:] or source.size(0) > tensor.size(0):
                raise RuntimeError(
                    f"linear_qkv's {name} {tuple(tensor.shape)} does not extend the ungated "
                    f"layer's {tuple(source.shape)} by gate rows"
                )
            tensor[: source.size(0)].copy_(source)
            if source.size(0) < tensor.size(0):
                tensor[source.size(0):].zero_()  # gate rows: set by _init_gate_rows


def _gate_row_seed(layer_number: int) -> int:
    """The seed of a layer's gate rows: the process's torch seed (the run's seed, megatron's
    per-pipeline-stage offset included) and the layer's number, apart from every stream the
    ungated model draws from."""
    return (torch.initial_seed() * 1_000_003 + 7919 * int(layer_number) + 0x6A7E) % (1 << 63)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
