"""Multi-token prediction (MTP) layers: megatron-core's, and Step-3.5-Flash's variant of them.

megatron's MTP depth k (``MultiTokenPredictionLayer``, DeepSeek-V3's design) computes

    h_k = layer_k(eh_proj(cat[enorm(emb(x_{t+k+1})), hnorm(h_{k-1})]))
    logits_k = output_layer(final_layernorm_k(h_k))

with ``h_{-1}`` the decoder's output AFTER its final norm, ``final_layernorm_k(h_k)`` passed on as
the next depth's ``h_k``, and the model's one output layer for every depth. Step-3.5-Flash (its
checkpoint, vLLM's ``step3p5_mtp.py``) differs in three ways, all kept here:

1. each depth has its own output head (``mtp.layers.{k}.output_layer``, vocab-parallel like the
   main one; HF ``model.layers.{L}.transformer.shared_head.output``) next to its own norm
   (``final_layernorm``, HF ``shared_head.norm``);
2. ``h_{-1}`` is the decoder's output BEFORE the final norm;
3. depth k passes its pre-norm ``h_k`` to depth k + 1.

Everything else is megatron's: enorm / hnorm / eh_proj, the rolled tokens, the MTP loss and its
logging. Each depth's layer is a ``KindTransformerLayer`` of global layer ``num_layers + k + 1``
(Step: dense, sliding window, the sliding kind's heads and RoPE, its own clamp). The model side
(the pre-norm input, per-depth heads in the loss) is ``mcore_ext.models.mtp_model.MTPGPTModel``.
"""

from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import make_viewless_tensor

from mcore_ext import _mcore_compat
from mcore_ext.layer_kinds import kind_layer_spec


class Step35MultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer with Step-3.5's head: its own vocab-parallel ``output_layer`` after its
    ``final_layernorm``, and its pre-norm output as what it hands on (see the module docstring).

    ``forward`` returns the pre-norm ``h_k`` (megatron's returns ``final_layernorm(h_k)``);
    ``compute_logits`` turns it into this depth's logits.
    """

    def __init__(self, config, submodules, *args, vocab_size: int, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        # Same construction as GPTModel's output_layer: [v / TP, h] rows per TP rank.
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
            **_mcore_compat.tp_group_kwargs(getattr(self, "tp_group", None)),
        )
        # An output layer, as GPTModel tags its own: Adam's under Muon, decoupled_lr's.
        self.output_layer.weight.is_embedding_or_output_parameter = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """megatron's, with the head loaded like GPTModel's output layer: ``allow_shape_mismatch``,
        so a checkpoint of another vocabulary padding (another make_vocab_size_divisible_by,
        Megatron-LM's 128 x TP rule) loads its rows and leaves the others at zero."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state[f"{prefix}output_layer.weight"].allow_shape_mismatch = True
        return state

    def _postprocess(self, hidden_states):
        # megatron normalises here; Step chains the pre-norm state and normalises in the head.
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

    def compute_logits(self, hidden_states, runtime_gather_output: Optional[bool] = None):
        """[s, b, h] pre-norm output of this depth -> ([s, b, v / TP] logits, None)."""
        normed = self.final_layernorm(hidden_states)
        return self.output_layer(normed, runtime_gather_output=runtime_gather_output)


def get_mtp_block_spec(
    config, layer_spec_for, norm, eh_proj, vocab_size: int
) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """The MTP block spec of ``config`` (None without ``mtp_num_layers``).

    ``layer_spec_for(layer_config)`` gives the TransformerLayer spec of a layer config on the
    model's backend; ``norm`` and ``eh_proj`` are the backend's norm and column-parallel linear.
    Depth k's layer is global layer ``num_layers + k + 1`` of ``config`` (its kind, its clamp).
    """
    if not config.mtp_num_layers:
        return None
    step = config.mtp_step35_heads
    specs = []
    for depth in range(config.mtp_num_layers):
        number = config.num_layers + depth + 1
        inner = kind_layer_spec(layer_spec_for(config.get_config_for_layer(number)), config, number)
        submodules = MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=eh_proj, layer_norm=norm,
            **{_mcore_compat.MTP_INNER_LAYER_FIELD: inner},
        )
        specs.append(ModuleSpec(
            module=Step35MultiTokenPredictionLayer if step else MultiTokenPredictionLayer,
            submodules=submodules,
            params={"vocab_size": vocab_size} if step else {},
        ))
    return MultiTokenPredictionBlockSubmodules(layer_specs=specs)


def mtp_layer_numbers(config) -> list:
    """The global layer numbers (1-based) of the MTP depths."""
    return [config.num_layers + k + 1 for k in range(config.mtp_num_layers or 0)]


__all__ = [
    "Step35MultiTokenPredictionLayer",
    "get_mtp_block_spec",
    "mtp_layer_numbers",
]
