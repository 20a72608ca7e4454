"""A Megatron-Bridge bridge for HF ``Step3p5ForCausalLM`` in mcore_ext's exact layout.

Registered for the architecture name on ``import mcore_ext.bridge`` (Bridge's dispatcher keeps
the last registration for a key, so it replaces Bridge's own Step-3.5 bridge, whose fallback on
megatron-core <= 0.19 widens each scalar gate to head_dim rows and keeps only row 0 on export).

Config and weights go through ``mcore_ext.hf``: ``Step35Config`` reads config.json (refusing what
it cannot hold, naming the key) and gives the provider's fields; every megatron parameter's
mapping is the ``mcore_ext.hf.layout`` table entry's (per-rank ``[QKV_r ; Gate_r]`` with one
scalar gate row per head, ``[gate_r ; up_r]``, zero-centred norms as stored; the MTP depths'
layer and ``MTP_TABLE``), wrapped in Bridge's ``MegatronParamMapping`` for its TP scatter /
gather. MoE layers are refused when the config is read (``provider_bridge``), naming the key:
their stacked HF experts are not mapped here (``python -m mcore_ext.hf import`` converts them).
"""

from types import SimpleNamespace

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
from megatron.core.models.gpt import GPTModel

from mcore_ext import _mcore_compat
from mcore_ext.bridge.provider import GatedGPTModelProvider
from mcore_ext.hf import layout
from mcore_ext.hf.config import ARCHITECTURE, MODEL_TYPE, HFConfigError, Step35Config
from mcore_ext.hf.convert import resolve_mtp


class LayoutMapping(MegatronParamMapping[dict]):
    """One megatron parameter <-> its HF tensors through an ``mcore_ext.hf.layout.Mapping``.

    ``hf_param`` is ``{"0": name, "1": name, ...}`` in the table entry's order. Import: TP rank 0
    makes every rank's local tensor with ``Mapping.to_local`` and scatters them. Export: the
    owning pipeline stage's TP ranks all-gather their local tensors, ``Mapping.from_locals``
    rebuilds the HF tensors.
    """

    def __init__(self, megatron_param: str, hf_param: dict, make_mapping, replicated: bool):
        super().__init__(megatron_param, hf_param)
        self._make_mapping = make_mapping  # (captures, padded_rows or None) -> layout.Mapping
        self._replicated = replicated
        self._captures = ()

    def resolve(self, captures):
        megatron_param, hf_param = self._resolve_names(captures)
        resolved = type(self)(megatron_param, hf_param, self._make_mapping, self._replicated)
        resolved._captures = tuple(captures)
        return resolved

    def _hf_list(self, hf_weights) -> list:
        if isinstance(hf_weights, dict):
            return [hf_weights[str(i)] for i in range(len(hf_weights))]
        return [hf_weights]

    def hf_to_megatron(self, hf_weights, megatron_module) -> torch.Tensor:
        _, target = _module_param(megatron_module, self.megatron_param)
        padded = target.shape[0] * (1 if self._replicated else self.tp_size)
        mapping = self._make_mapping(self._captures, padded)
        if self.tp_size == 1 or self._replicated:
            local = mapping.to_local(self._hf_list(hf_weights), self.tp_rank, self.tp_size)
            return local.to(dtype=target.dtype, device=target.device)
        splits = None
        if self.tp_rank == 0:
            hf = self._hf_list(hf_weights)
            splits = [mapping.to_local(hf, r, self.tp_size) for r in range(self.tp_size)]
            for r, split in enumerate(splits):
                if split.shape != target.shape:
                    raise HFConfigError(
                        f"{self.megatron_param}: TP rank {r}'s slice of "
                        f"{list(self.hf_param.values())} has shape {tuple(split.shape)}, the "
                        f"parameter {tuple(target.shape)}"
                    )
        return self.scatter_to_tp_ranks(splits, target.shape, target.dtype, target.device)

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict:
        weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if weights is None:
            return {}
        if self._replicated:
            locals_ = [weights] * self.tp_size
        else:
            locals_ = self.gather_from_tp_ranks(weights.contiguous())
        mapping = self._make_mapping(self._captures, None)
        tensors = mapping.from_locals(locals_)
        return {self.hf_param[str(i)]: t for i, t in enumerate(tensors)}


def _module_param(module, name: str):
    """(module, parameter): Bridge passes the module that owns the parameter."""
    return module, getattr(module, name.rsplit(".", 1)[-1])


def _hf_dict(names) -> dict:
    return {str(i): n for i, n in enumerate(names)}


@MegatronModelBridge.register_bridge(
    source=ARCHITECTURE, target=GPTModel, provider=GatedGPTModelProvider, model_type=MODEL_TYPE
)
class GatedStep35Bridge(MegatronModelBridge):
    """HF Step-3.5 (dense and MTP layers; MoE layers refused) <-> mcore_ext's gated GPTModel."""

    def provider_bridge(self, hf_pretrained) -> GatedGPTModelProvider:
        """The provider of the HF config (``Step35Config`` -> ``GatedTransformerConfig`` fields,
        as ``mcore_ext.hf.load_pretrained`` builds it)."""
        hf_config = hf_pretrained.config
        spec = step35_spec(hf_config)
        refuse_moe(spec)
        try:  # MTP layers the config declares and the weights do not hold: the decoder alone
            spec = resolve_mtp(SimpleNamespace(names=hf_pretrained.state.keys()), spec)
        except AttributeError:  # a config-only provider (no weights to look at)
            pass
        dtype = self.dtype_from_hf(hf_config, default=torch.float32)
        fields = spec.transformer_config_fields()
        provider = GatedGPTModelProvider(
            **fields,
            vocab_size=spec.vocab_size,
            # mcore_ext.hf pads the vocabulary to a multiple of TP only.
            should_pad_vocab=True,
            make_vocab_size_divisible_by=1,
            seq_length=spec.max_position_embeddings,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            params_dtype=dtype,
            bf16=dtype is torch.bfloat16,
            fp16=dtype is torch.float16,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            cross_entropy_loss_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            mcore_ext_backend="auto",
        )
        provider.hf_model_id = getattr(hf_config, "_name_or_path", None) or None
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        """Every parameter of the dense model and its MTP depths, from ``mcore_ext.hf.layout``'s
        tables."""
        spec = self._spec()
        mappings = []
        for entry in layout.LAYER_TABLE:
            hf = _hf_dict(f"model.layers.*.{n}" for n in entry.hf)
            replicated = isinstance(layout.layer_mapping(entry, spec, 0), layout.Replicated)

            def make(captures, padded, entry=entry):
                return layout.layer_mapping(entry, self._spec(), int(captures[0]))

            for name in (entry.megatron, *entry.aliases):
                mappings.append(LayoutMapping(f"decoder.layers.*.{name}", hf, make, replicated))
        for depth in range(spec.num_mtp_layers):
            mappings.extend(self._mtp_mappings(spec, depth))

        def vocab(captures, padded):
            spec = self._spec()
            return layout.vocab_mapping(spec, padded if padded is not None else spec.vocab_size)

        for entry in (layout.EMBEDDING, layout.OUTPUT):
            mappings.append(LayoutMapping(entry.megatron, _hf_dict(entry.hf), vocab, False))
        mappings.append(LayoutMapping(layout.FINAL_NORM.megatron, _hf_dict(layout.FINAL_NORM.hf),
                                      lambda captures, padded: layout.Replicated(), True))
        return MegatronMappingRegistry(*mappings)

    def build_conversion_tasks(self, hf_pretrained, megatron_model, weight_dtype=None):
        """Bridge's tasks, refusing a model with parameters no mapping covers (Bridge only logs
        them, and an import would then leave them at their init values)."""
        tasks = super().build_conversion_tasks(hf_pretrained, megatron_model, weight_dtype)
        covered = {t.global_param_name for t in tasks if t is not None}
        names = self._megatron_global_param_names_all_pp_ranks(megatron_model)
        if self._share_embeddings_and_output_weights(megatron_model[0].config):
            names = [n for n in names if "output_layer" not in n]
        missing = [n for n in names if n not in covered]
        if missing:
            raise HFConfigError(
                f"{len(missing)} parameter(s) have no Step-3.5 mapping or no HF tensor, e.g. "
                f"{missing[:4]}"
            )
        return tasks

    def _mtp_mappings(self, spec: Step35Config, depth: int) -> list:
        """MTP depth ``depth``: its layer (``LAYER_TABLE`` under megatron's inner-layer name)
        and ``MTP_TABLE``, from HF layer ``num_layers + depth`` (names without wildcards: the
        HF layer index is not the depth)."""
        layer = spec.num_layers + depth
        local, hf_prefix = f"mtp.layers.{depth}.", layout.hf_layer_prefix(layer)
        inner = f"{local}{_mcore_compat.MTP_INNER_LAYER_FIELD}."
        mappings = []
        for entry in layout.LAYER_TABLE:
            mapping = layout.layer_mapping(entry, spec, layer)
            hf = _hf_dict(hf_prefix + n for n in entry.hf)
            for name in (entry.megatron, *entry.aliases):
                mappings.append(LayoutMapping(
                    inner + name, hf, lambda captures, padded, mapping=mapping: mapping,
                    isinstance(mapping, layout.Replicated)))
        for entry in layout.MTP_TABLE:
            def make(captures, padded, entry=entry):
                spec = self._spec()
                return layout.mtp_mapping(entry, spec, padded or spec.vocab_size)

            mappings.append(LayoutMapping(
                local + entry.megatron, _hf_dict(hf_prefix + n for n in entry.hf), make,
                isinstance(make((), None), layout.Replicated)))
        return mappings

    def _spec(self) -> Step35Config:
        return step35_spec(self.hf_config)


def step35_spec(hf_config) -> Step35Config:
    """``Step35Config`` of a transformers config object (or a config.json dict), as
    ``mcore_ext.hf`` reads it (``HFConfigError`` for whatever it cannot hold)."""
    raw = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return Step35Config.from_hf_dict(raw)


def refuse_moe(spec: Step35Config) -> None:
    """``HFConfigError`` naming the config keys that make layers MoE: this bridge maps dense and
    MTP layers only."""
    sparse = [layer for layer in range(spec.num_layers) if spec.is_sparse(layer)]
    if sparse:
        raise HFConfigError(
            f"config.json makes layers {sparse} MoE (mlp_layer_types / moe_layers_enum, "
            f"moe_num_experts={spec.num_experts}): mcore_ext's Megatron-Bridge bridge maps dense "
            "and MTP layers only; convert the checkpoint with `python -m mcore_ext.hf import` "
            "and load it with --load / checkpoint.load"
        )
