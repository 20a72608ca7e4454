"""``load_pretrained`` / ``save_pretrained``: HF Step-3.5 weights <-> a megatron GPTModel (or
HybridModel) at any TP/PP.

Loading: every rank reads, one megatron parameter at a time, the full HF tensors that parameter is
made of (``layout``), keeps its own TP slice and drops the rest, so a rank holds its model shard
plus at most one layer's full tensors. Everything is checked before a model is built: the config,
that TP divides the head counts, and every tensor's presence and shape. A HybridModel is built and
filled directly (its parameters named as the GPTModel's of the same layers,
``models.hybrid.gpt_parameter_name``): one model per rank, the folder's config and safetensors
headers read once (``HFFolder``).

Saving: for each unit (embedding, each layer, final norm, lm_head) in order, the TP ranks of the
pipeline stage that holds it gather their local tensors; its TP rank 0 (data-parallel rank 0)
rebuilds the HF tensors and sends them to global rank 0, which streams them into the safetensors
shards. Rank 0 holds one unit's tensors at a time besides its own shard of the model.
"""

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mcore_ext._cpu_compat import cuda_to_cpu
from mcore_ext.hf import layout, vision_layout
from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.hf.safetensors_io import SafetensorsReader, ShardedSafetensorsWriter
from mcore_ext.runtime import cpu_group, raise_unless_all_ok
from mcore_ext.runtime import device as runtime_device
from mcore_ext.userfiles import read_json

CONFIG_NAME = "config.json"
# The HF config an import started from; export reads it back for what megatron does not keep
# (the exact vocabulary size, special token ids).
PROVENANCE_NAME = "hf_config.json"


def open_weights(hf_dir: str, raw: dict):
    """The folder's safetensors as the Step-3.5 text model's: a Step-3.7 folder's text model
    alone, under Step-3.5's names (``step37.TextView``); any other folder as it is."""
    from mcore_ext.hf import step37

    reader = SafetensorsReader(hf_dir)
    return step37.TextView(reader) if step37.is_step37(raw) else reader


def read_hf_config(hf_dir: str) -> tuple[dict, Step35Config]:
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.exists(path):
        raise HFConfigError(f"{path}: missing (a Hugging Face model directory has config.json)")
    raw = read_json(path, HFConfigError)  # an object, or one line naming the file
    return raw, Step35Config.from_hf_dict(raw)


def check_weights(reader: SafetensorsReader, spec: Step35Config) -> torch.dtype:
    """Every tensor present with its config's shape, nothing unexpected; returns their dtype
    (the fp32 router bias aside). MTP layers (``model.layers.<n>`` for n >= num_hidden_layers,
    as the released checkpoint appends them) are part of the model when the config declares
    them (``resolve_mtp`` drops a declaration the weights do not back)."""
    if not isinstance(reader, HFSource):
        reader = HFSource(reader, spec)
    expected = layout.hf_shapes(spec)
    if spec.tie_word_embeddings and "lm_head.weight" not in reader.names:
        del expected["lm_head.weight"]
    missing = [n for n in expected if n not in reader.names]
    if missing:
        raise HFConfigError(
            f"{reader.directory}: {len(missing)} tensor(s) the config needs are missing, e.g. "
            f"{missing[:4]}"
        )
    unexpected = [n for n in reader.names if n not in expected]
    if unexpected:
        raise HFConfigError(
            f"{reader.directory}: {len(unexpected)} tensor(s) not part of the Step-3.5 model "
            f"its config.json describes, e.g. {unexpected[:4]}"
        )
    dtypes = set()
    for name, shape in expected.items():
        dtype, found = reader.info(name)
        if tuple(found) != tuple(shape):
            raise HFConfigError(
                f"{name}: shape {tuple(found)} in the weights, {tuple(shape)} from config.json "
                "(config and weights do not match)"
            )
        if not name.endswith(layout.FP32_NAMES):  # the router bias is fp32 in any checkpoint
            dtypes.add(dtype)
    if len(dtypes) != 1:
        raise HFConfigError(f"{reader.directory}: mixed dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _is_mtp(name: str, spec: Step35Config) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= spec.num_layers


def resolve_mtp(reader, spec: Step35Config) -> Step35Config:
    """``spec`` without its MTP layers when the weights hold none of them (a checkpoint whose
    config declares ``num_nextn_predict_layers`` but that was saved without them, as
    transformers does): the decoder is converted alone."""
    if spec.num_mtp_layers and not any(_is_mtp(n, spec) for n in reader.names):
        return spec.replace(num_mtp_layers=0, mtp_layer_types=None, mtp_swiglu_limits=None)
    return spec


class HFSource:
    """A checkpoint's tensors under their released names, whether it is stored in the released
    layout or in transformers' (``layout.TRANSFORMERS_NAMES``, the fused ``gate_up_proj``).
    ``expert(name, e)`` reads expert e's rows of a stacked tensor alone."""

    def __init__(self, reader: SafetensorsReader, spec: Step35Config):
        self.reader = reader
        self.directory = reader.directory
        stored = set(reader.names)
        where = {name: (name, None) for name in reader.names}  # released -> (stored, half)
        for layer in range(spec.num_layers):
            p = layout.hf_layer_prefix(layer)
            for released, theirs in layout.TRANSFORMERS_NAMES.items():
                if p + theirs in stored:
                    where[p + released] = where.pop(p + theirs)
            fused, halves = layout.TRANSFORMERS_GATE_UP
            if p + fused in stored:
                del where[p + fused]
                for i, half in enumerate(halves):
                    where[p + half] = (p + fused, i)
        self._where = where

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str):
        stored, half = self._where[name]
        dtype, shape = self.reader.info(stored)
        if half is not None:
            shape = (shape[0], shape[1] // 2, *shape[2:])
        return dtype, shape

    def get(self, name: str) -> torch.Tensor:
        stored, half = self._where[name]
        if half is None:
            return self.reader.get(stored)
        return self.reader.get(stored).chunk(2, dim=1)[half].clone()

    def expert(self, name: str, index: int) -> torch.Tensor:
        stored, half = self._where[name]
        if half is None:
            return self.reader.get_slice(stored, index)
        rows = self.reader.info(stored)[1][1] // 2
        return self.reader.get_slice(stored, (index, slice(half * rows, (half + 1) * rows)))

    def close(self):
        self.reader.close()


class HFFolder:
    """An HF directory read once and checked: ``raw`` config.json, its ``spec``, the tensors
    (``source``, an ``HFSource`` over the safetensors headers, a Step-3.7 folder's text model
    alone: ``open_weights``) and their ``dtype``. ``close()`` releases the open shard (its
    mapped pages); a later read opens it again."""

    def __init__(self, hf_dir: str):
        self.directory = hf_dir
        self.raw, spec = read_hf_config(hf_dir)
        reader = open_weights(hf_dir, self.raw)  # a Step-3.7 folder: its text model's tensors
        try:
            self.spec = resolve_mtp(reader, spec)
            self.source = HFSource(reader, self.spec)
            self.dtype = check_weights(self.source, self.spec)
        except BaseException:
            reader.close()
            raise

    @property
    def vision_reader(self) -> SafetensorsReader:
        """All of the folder's tensors (a Step-3.7 folder's vision side among them)."""
        text = self.source.reader
        return getattr(text, "reader", text)

    def close(self):
        self.source.close()


def check_parallel(spec: Step35Config, tp: int) -> None:
    """TP must divide both layer kinds' query heads (HFConfigError naming the key)."""
    for key, value in (("num_attention_heads", spec.num_heads),
                       ("num_sliding_attention_heads", spec.num_sliding_heads)):
        if value and value % tp:
            raise HFConfigError(
                f"{key}={value} is not divisible by tensor_model_parallel_size={tp}"
            )
    for key, value in (("num_attention_groups", spec.num_kv_heads),
                       ("attention_other_setting.num_attention_groups",
                        spec.num_sliding_kv_heads)):
        if value and value % tp and tp % value:
            raise HFConfigError(
                f"{key}={value}: tensor_model_parallel_size={tp} must divide it or be a multiple "
                "of it"
            )


def check_expert_parallel(spec: Step35Config, ep: int, etp: int, tp: int) -> None:
    """EP must divide the experts, ETP the expert width, TP the shared expert's width."""
    if not spec.is_moe:
        return
    for key, value, size, what in (
            ("moe_num_experts", spec.num_experts, ep, "expert_model_parallel_size"),
            ("moe_intermediate_size", spec.moe_intermediate_size, etp,
             "expert_tensor_parallel_size"),
            ("share_expert_dim", spec.share_expert_dim, tp, "tensor_model_parallel_size")):
        if value % size:
            raise HFConfigError(f"{key}={value} is not divisible by {what}={size}")


def build_config(spec: Step35Config, dtype: torch.dtype, **overrides):
    """The ``GatedTransformerConfig`` of ``spec`` on this rank's parallel layout."""
    from mcore_ext.config import GatedTransformerConfig

    fields = spec.transformer_config_fields()
    fields.update(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten by the checkpoint
    )
    if spec.is_moe:
        fields.update(
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
    fields.update(overrides)
    return GatedTransformerConfig(**fields)


def load_pretrained(
    hf_dir: "str | HFFolder",
    *,
    architecture: str = "gpt",
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    make_vocab_size_divisible_by: int = 1,
    max_sequence_length: int | None = None,
    device: torch.device | str | None = None,
    vision=False,
    **config_overrides,
):
    """A megatron ``GPTModel`` (``architecture`` ``hybrid``: megatron's ``HybridModel`` of
    ``build_hybrid_model``, the pattern derived from the GPT layers) with this rank's shards of
    the HF Step-3.5 model in ``hf_dir`` (a directory, or an ``HFFolder`` already read). One model
    is built and filled, whichever the class.

    Call after ``mcore_ext.init_parallel`` (any TP / PP). The vocabulary is padded to a multiple
    of lcm(``make_vocab_size_divisible_by``, TP) with zero rows: logits ``[..., :vocab_size]``
    are the model's. ``dtype`` defaults to the weights' dtype. ``config_overrides`` go to
    ``GatedTransformerConfig`` (e.g. ``sequence_parallel=True``, recompute settings).
    The model is built and filled on the CPU, then moved to ``device`` (default:
    ``mcore_ext.device()``, this rank's GPU where CUDA exists, else the CPU).
    Raises ``HFConfigError`` / ``SafetensorsError`` before building anything when the directory
    is incomplete or does not match its config.

    ``vision`` (a Step-3.7 folder): True builds the vision-language model
    (``mcore_ext.models.vision_language``: the tower and projector on the first stage, filled
    from the folder, ``vision_layout``) with the folder's ``VisionConfig``; a ``VisionConfig``
    is used as given (its ``freeze``, say), checked against the folder's shapes. False: the text
    model alone, the vision tensors left in the folder.
    """
    from mcore_ext.models import build_gpt_model, build_hybrid_model, padded_vocab_size

    builders = {"gpt": build_gpt_model, "hybrid": build_hybrid_model}
    if architecture not in builders:
        raise HFConfigError(f"architecture={architecture!r}: expected gpt or hybrid")
    folder = hf_dir if isinstance(hf_dir, HFFolder) else HFFolder(hf_dir)
    spec, reader, file_dtype = folder.spec, folder.source, folder.dtype
    try:
        vision = _vision_config(folder, vision)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        check_parallel(spec, tp)
        check_expert_parallel(spec, parallel_state.get_expert_model_parallel_world_size(),
                              _expert_tp_rank()[1], tp)
        dtype = dtype or file_dtype
        config = build_config(spec, dtype, **config_overrides)
        vocab = padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp)
        # cuda_to_cpu: megatron moves tied output weights with .cuda() (a no-op context on GPUs).
        with cuda_to_cpu():
            model = builders[architecture](
                config,
                vocab_size=vocab,
                max_sequence_length=max_sequence_length or spec.max_position_embeddings,
                backend=backend,
                share_embeddings_and_output_weights=spec.tie_word_embeddings,
                **({"vision": vision} if vision is not None else {}),
            )
        model.to(dtype)  # torch norms are built in fp32; the launcher's Float16Module casts too
        load_into(model, reader, spec, vocab)
        if vision is not None:
            load_vision_into(model, folder.vision_reader, vision)
    finally:
        # The open shard's mapped pages go now, not after the caller's save (an HFFolder keeps
        # its headers and reopens a shard if read again).
        folder.close()
    model.to(device if device is not None else runtime_device())
    model.hf_config = spec  # what save_pretrained writes back (vocab size, token ids)
    return model


def _vision_config(folder: "HFFolder", vision):
    """The ``VisionConfig`` to build (None: the text model alone), checked against the folder:
    every vision tensor present (``vision_layout``)."""
    from mcore_ext.hf import step37
    from mcore_ext.hf.config import step3p7
    from mcore_ext.vision import VisionConfig

    if vision is False or vision is None:
        return None
    if not step37.is_step37(folder.raw):
        raise HFConfigError(f"{folder.directory}: vision=True needs a Step-3.7 folder (model_type "
                            f"{step3p7.WRAPPER_MODEL_TYPE!r}), its model_type is "
                            f"{folder.raw.get('model_type')!r}")
    config = vision if isinstance(vision, VisionConfig) else step3p7.vision_config(folder.raw)
    names = set(folder.vision_reader.names)
    missing = sorted(set(vision_layout.hf_names(config, names)) - names)
    if missing:
        raise HFConfigError(f"{folder.directory}: {len(missing)} vision tensor(s) its config needs "
                            f"are missing, e.g. {missing[:4]}")
    return config


def load_vision_into(model, reader, vision) -> None:
    """Copy this rank's slices of the folder's vision tensors into the tower and projector (on
    the first pipeline stage; nothing elsewhere), in the model's dtype."""

    params = {n: p for n, p in model.named_parameters() if vision_layout.is_vision_parameter(n)}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    units = list(vision_layout.units(vision, reader.names, params))
    unmapped = sorted(set(params) - {name for name, *_ in units})
    if unmapped:
        raise HFConfigError(f"{len(unmapped)} vision parameter(s) have no place in the Step-3.7 "
                            f"layout: {unmapped[:4]}")
    with torch.no_grad():
        for name, mapping, hf_names in units:
            param = params[name]
            local = mapping.to_local([reader.get(n) for n in hf_names], rank, tp)
            if tuple(local.shape) != tuple(param.shape):
                raise HFConfigError(f"{name}: this rank's slice of {list(hf_names)} has shape "
                                    f"{tuple(local.shape)}, the model's parameter "
                                    f"{tuple(param.shape)}")
            param.copy_(local)


def load_into(model, reader, spec: Step35Config, vocab: int) -> None:
    """Copy this rank's slices of the HF tensors into ``model``'s parameters, one at a time
    (routed experts: only this rank's experts' rows of the stacked tensors)."""
    if not isinstance(reader, HFSource):
        reader = HFSource(reader, spec)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    params = _named_params(model, vision=False)
    # Parameters start uninitialised (perform_initialization=False): every one must be written.
    units = _mapped_units(model, spec, vocab, params, "load")
    with torch.no_grad():
        for name, entry, mapping, hf_names in units:
            if entry is layout.OUTPUT and spec.tie_word_embeddings:
                hf_names = ("model.embed_tokens.weight",)
            param = params[name]
            if isinstance(mapping, layout.Expert):
                local = mapping.to_local([reader.expert(n, mapping.index) for n in hf_names],
                                         *_expert_tp_rank())
            else:
                local = mapping.to_local([reader.get(n) for n in hf_names], rank, tp)
            if name.endswith(layout.MEGATRON_FP32_NAMES) and param.dtype != torch.float32:
                param.data = param.data.float()  # megatron keeps the expert bias in fp32
            if tuple(local.shape) != tuple(param.shape):
                raise HFConfigError(
                    f"{name}: this rank's slice of {list(hf_names)} has shape "
                    f"{tuple(local.shape)}, the model's parameter {tuple(param.shape)}"
                )
            param.copy_(local)
            del local


def _is_hybrid(model) -> bool:
    return getattr(model, "hybrid_layer_pattern", None) is not None


def _named_params(model, vision: bool = True) -> dict:
    """{name: tensor} of ``model``'s parameters and expert-bias buffers, under GPTModel's names
    (a HybridModel's translated: the layout tables name GPT layers). ``vision=False`` leaves out
    a vision-language model's tower and projector (``load_vision_into`` fills them)."""
    params = {n: p for n, p in model.named_parameters()
              if vision or not vision_layout.is_vision_parameter(n)}
    params.update((n, b) for n, b in model.named_buffers()
                  if n.endswith(layout.MEGATRON_FP32_NAMES))  # the router's expert bias
    if not _is_hybrid(model):
        return params
    from mcore_ext.models.hybrid import gpt_parameter_name, hybrid_parameter_name

    renamed = {}
    for name, tensor in params.items():
        gpt = gpt_parameter_name(name)
        if hybrid_parameter_name(gpt) != name or gpt in renamed:
            raise HFConfigError(f"{name}: the HybridModel's layer is not half of a GPT layer "
                                f"(pattern {model.hybrid_layer_pattern!r}; the Step-3.5 layout "
                                "needs the pattern build_hybrid_model derives)")
        renamed[gpt] = tensor
    return renamed


def _gpt_layers(model) -> list:
    """(local GPT index, global 0-based GPT layer) of this stage's decoder: a GPTModel's layers,
    a HybridModel's (attention, MLP / MoE) pairs as the GPT layer each stands for."""
    layers = model.decoder.layers
    if not _is_hybrid(model):
        return [(i, layer.layer_number - 1) for i, layer in enumerate(layers)]
    pairs = {}
    for i, layer in enumerate(layers):
        if pairs.setdefault(i // 2, layer.gpt_layer_number - 1) != layer.gpt_layer_number - 1:
            raise HFConfigError(f"decoder.layers.{i}: hybrid layers {i - 1} and {i} stand for "
                                "different GPT layers (not the pattern build_hybrid_model "
                                "derives)")
    return sorted(pairs.items())


def _expert_tp_rank() -> tuple[int, int]:
    """(rank, size) of this rank in the expert-tensor-parallel group (ETP)."""
    return (parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size())


def _layer_units(params: dict, local: str, spec: Step35Config, g: int, hf_prefix: str,
                 vocab: int):
    """The items of one transformer layer (global index g; ``local``: its megatron prefix)."""
    table = layout.LAYER_TABLE
    if spec.is_sparse(g):
        table = [e for e in table if not e.megatron.startswith("mlp.")] + list(layout.MOE_TABLE)
    for entry in table:
        name = next((local + n for n in (entry.megatron, *entry.aliases) if local + n in params),
                    None)
        if name is None:
            raise HFConfigError(f"the model has no {local}{entry.megatron} (its layer spec is "
                                "not the Step-3.5 layout)")
        hf = tuple(hf_prefix + n for n in entry.hf)
        yield name, entry, layout.layer_mapping(entry, spec, g), hf
    if spec.is_sparse(g):
        experts = spec.num_experts // parallel_state.get_expert_model_parallel_world_size()
        first = parallel_state.get_expert_model_parallel_rank() * experts
        for j in range(experts):
            for entry in layout.EXPERT_TABLE:
                name = local + entry.megatron.format(j=j)
                if name not in params:
                    raise HFConfigError(f"the model has no {name} (routed experts are read into "
                                        "megatron's SequentialMLP)")
                hf = tuple(hf_prefix + n for n in entry.hf)
                yield name, entry, layout.expert_mapping(entry, first + j), hf


def _mapped_units(model, spec: Step35Config, vocab: int, params: dict, action: str,
                  kept=None) -> list:
    """``_units`` of this rank, after checking (on every rank together) that they map every
    parameter: one left out would stay uninitialised on load, or be dropped on save. ``kept``
    (saving a vision-language model): the tower's and projector's units too, in the spelling
    of ``kept``'s folder, each tensor's shape checked against the folder's."""
    failure = None
    try:
        units = list(_units(model, spec, vocab))
        if kept is not None:
            units += _vision_units(model, params, kept)
        unmapped = sorted(set(params) - {name for name, *_ in units})
        if unmapped:
            what = ("would stay uninitialised" if action == "load"
                    else "would be dropped from the export")
            raise HFConfigError(
                f"{len(unmapped)} parameter(s) have no place in the Step-3.5 layout and {what}: "
                f"{unmapped[:4]} (the model is not the Step-3.5 architecture)"
            )
    except HFConfigError as err:
        failure = err
    if dist.is_initialized():
        raise_unless_all_ok(failure, f"{action} of the Step-3.5 layout", HFConfigError)
    elif failure is not None:
        raise failure
    return units


def _units(model, spec: Step35Config, vocab: int):
    """(megatron name, entry, mapping, HF names) of every parameter on this rank, in HF order."""
    params = _named_params(model)
    if "embedding.word_embeddings.weight" in params:
        yield (layout.EMBEDDING.megatron, layout.EMBEDDING, layout.vocab_mapping(spec, vocab),
               layout.EMBEDDING.hf)
    for index, g in _gpt_layers(model):  # g: the global layer index
        yield from _layer_units(params, f"decoder.layers.{index}.", spec, g,
                                layout.hf_layer_prefix(g), vocab)
    mtp = getattr(model, "mtp", None)
    for k in range(len(mtp.layers) if mtp is not None and spec.num_mtp_layers else 0):
        g = spec.num_layers + k
        local, hf_prefix = f"mtp.layers.{k}.", layout.hf_layer_prefix(g)
        inner = next((local + p for p in layout.MTP_LAYER_PREFIXES
                      if any(n.startswith(local + p) for n in params)), None)
        if inner is None:
            raise HFConfigError(f"the model has no {local}mtp_model_layer (MTP depth {k})")
        yield from _layer_units(params, inner, spec, g, hf_prefix, vocab)
        for entry in layout.MTP_TABLE:
            if local + entry.megatron not in params:
                raise HFConfigError(f"the model has no {local}{entry.megatron} (Step-3.5's MTP "
                                    "depths have their own norm and output head)")
            yield (local + entry.megatron, entry, layout.mtp_mapping(entry, spec, vocab),
                   tuple(hf_prefix + n for n in entry.hf))
    if layout.FINAL_NORM.megatron in params:
        yield (layout.FINAL_NORM.megatron, layout.FINAL_NORM, layout.Replicated(),
               layout.FINAL_NORM.hf)
    if layout.OUTPUT.megatron in params:
        yield (layout.OUTPUT.megatron, layout.OUTPUT, layout.vocab_mapping(spec, vocab),
               layout.OUTPUT.hf)


def _vision_units(model, params: dict, kept) -> list:
    """(megatron name, None, mapping, HF names) of this rank's vision parameters for saving
    (none off the first stage), under the names of ``kept``'s folder; HFConfigError when a
    tensor they make is not the shape the folder's is (``kept.model_shapes``)."""

    tp = parallel_state.get_tensor_model_parallel_world_size()
    vision = {n: p for n, p in params.items() if vision_layout.is_vision_parameter(n)}
    items = []
    for name, mapping, hf_names in vision_layout.units(model.vision, kept.names, vision):
        param = params[name]
        local = torch.empty(param.shape, device="meta")
        split = tp > 1 and getattr(param, "tensor_model_parallel", False)
        for hf, full in zip(hf_names, mapping.from_locals([local] * (tp if split else 1))):
            if tuple(full.shape) != kept.model_shapes.get(hf):
                raise HFConfigError(
                    f"{name} makes {hf} of shape {tuple(full.shape)}, the Step-3.7 folder's is "
                    f"{kept.model_shapes.get(hf)} (its vision tower is not this model's)")
        items.append((name, None, mapping, hf_names))
    return items


# ------------------------------------------------------------------------------------- saving


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def spec_of(model, vocab_size: int | None = None, extra: dict | None = None) -> Step35Config:
    """The Step-3.5 description of ``model`` (HFConfigError naming what it cannot hold)."""
    model = unwrap(model)
    known = getattr(model, "hf_config", None)
    spec = Step35Config.from_transformer_config(
        model.config,
        vocab_size=vocab_size or (known.vocab_size if known else model.vocab_size),
        max_position_embeddings=(known.max_position_embeddings if known
                                 else model.max_sequence_length),
        share_embeddings=model.share_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        extra=dict(known.extra) if known else {},
        rope_scaling=bool(getattr(model, "rotary_scaling", False)),
        seq_len_interpolation_factor=getattr(getattr(model, "rotary_pos_emb", None),
                                             "seq_len_interpolation_factor", None),
    )
    if extra:
        spec.extra.update(extra)
    return spec


def save_pretrained(model, hf_dir: str, *, vocab_size: int | None = None,
                    max_shard_bytes: int = 2 * 1024**3, extra_config: dict | None = None,
                    dtype: torch.dtype | None = None, extra_files: dict | None = None,
                    kept=None) -> None:
    """Write ``model`` (any TP / PP; called on every rank) to ``hf_dir`` in the released
    Step-3.5 layout: config.json and size-sharded safetensors with their index, written by global
    rank 0. ``vocab_size`` strips megatron's padded rows (default: the size ``load_pretrained``
    read, else the model's). Tied embeddings are written as an lm_head copy (the layout has an
    untied lm_head). Raises ``HFConfigError`` on every rank, before anything is written, when the
    model does not fit the layout. ``dtype``: of every written tensor (default: the first
    stage's first parameter's, e.g. the embedding's). ``extra_files`` ({name: text or bytes},
    rank 0's): written beside them in the same export (e.g. the tokenizer's files). ``kept``
    (a ``step37.KeptTensors`` of a checked Step-3.7 folder): the text model is written under
    that folder's text prefix, its kept tensors after it as they are stored, its config.json
    and other files beside them (``extra_files`` win over its files, its config.json over
    the text model's). A vision-language model (``load_pretrained(..., vision=...)``) needs
    ``kept`` (its config.json describes the tower): its tower and projector are written from
    the model after the text model, under the folder's names (``vision_layout``), in place of
    the folder's (``KeptTensors(source, written=vision_layout.hf_names(...))``)."""
    model = unwrap(model)
    spec = spec_of(model, vocab_size, extra_config)
    vision = getattr(model, "vision", None)  # on every stage of a vision-language model
    vision_names = {}  # vision unit -> its HF tensors, on every rank
    if vision is not None:
        names = vision_layout.hf_names(vision, kept.names) if kept is not None else []
        missing = [n for n in names if n not in kept.model_shapes] if kept is not None else []
        if kept is None or missing or not names:
            raise HFConfigError(
                "a vision-language model is written into the layout of the Step-3.7 folder it "
                "came from (its config.json describes the tower): pass kept=step37.KeptTensors("
                "source, written=vision_layout.hf_names(...))" if kept is None else
                f"the Step-3.7 folder's tensors {missing[:4]} are kept, not written from the "
                "model's vision tower")
        vision_names = vision_layout.unit_names(vision, kept.names)
    world_rank = dist.get_rank() if dist.is_initialized() else 0
    # The tensors travel on the CPU (rank 0 writes them from there): in gloo groups, beside
    # megatron's NCCL groups on a GPU machine.
    tp_group = cpu_group(parallel_state.get_tensor_model_parallel_group())
    world_group = cpu_group() if dist.is_initialized() else None
    tp = parallel_state.get_tensor_model_parallel_world_size()
    is_writer_stage = parallel_state.get_data_parallel_rank() == 0
    owner = is_writer_stage and parallel_state.get_tensor_model_parallel_rank() == 0

    # Which global rank sends each unit: TP rank 0 / DP rank 0 of the stage that holds it.
    params = _named_params(model)
    units = {}  # unit name -> list of (megatron name, entry, mapping, hf names)
    # Routed experts go one at a time from their expert-data-parallel rank 0 (ETP rank 0).
    experts = {}  # (stacked HF name, global expert) -> item, on expert-DP rank 0
    expert_writer = _expert_dp_rank() == 0
    for item in _mapped_units(model, spec, model.vocab_size, params, "save",
                              kept if vision is not None else None):
        if isinstance(item[2], layout.Expert):
            if expert_writer:
                experts.update({(n, item[2].index): item for n in item[3]})
        elif item[1] is None:  # the vision tower's and projector's
            units.setdefault(vision_layout.unit_of(item[0]), []).append(item)
        else:
            units.setdefault(_unit_of(item[3]), []).append(item)
    mine = {unit: world_rank for unit in units} if owner else {}
    if _expert_tp_rank()[0] == 0:
        mine.update({key: world_rank for key in experts})
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (mine, next(model.parameters()).dtype),
                               group=world_group)
    else:
        gathered = [(mine, next(model.parameters()).dtype)]
    # One dtype for the whole file: rank 0's first parameter's (the embedding's); the router
    # bias stays fp32 (layout.hf_dtype).
    dtype = dtype or gathered[0][1]
    sender = {}
    for table, _ in gathered:
        sender.update(table)
    order = _unit_order(spec) + list(vision_names)
    absent = [u for u in order if u not in sender and not (u == "lm_head" and "embed" in sender)]
    absent += sorted({n for n in layout.hf_shapes(spec) if n.endswith(layout.STACKED_EXPERT_NAMES)
                      and any((n, e) not in sender for e in range(spec.num_experts))})
    if absent:
        raise HFConfigError(f"no rank holds {absent[:6]} (is this the whole model?)")

    plan = [(name, layout.hf_dtype(name, dtype), shape)
            for name, shape in layout.hf_shapes(spec).items()]
    files = {**(extra_files or {}), CONFIG_NAME: json.dumps(spec.to_hf_dict(), indent=2) + "\n"}
    if kept is not None:
        from mcore_ext.hf.step37 import stored_name

        plan = [(stored_name(n, kept.prefix), d, s) for n, d, s in plan]
        plan += [(n, dtype, kept.model_shapes[n]) for unit in vision_names
                 for n in vision_names[unit]]
        plan += kept.plan
        failure = None
        if world_rank == 0:  # the writer's: each file checked as read (kept.files)
            try:
                files = {**kept.files(), **(extra_files or {})}
            except HFConfigError as err:
                failure = err
        _raise_on_every_rank(failure, world_group)
    writer, failure = None, None
    if world_rank == 0:
        writer = ShardedSafetensorsWriter(hf_dir, plan, max_shard_bytes, extra_files=files)
        if kept is not None:
            writer = _RenamingWriter(writer, kept.prefix)
    shapes = layout.hf_shapes(spec)
    tied = "lm_head" not in sender  # tied embeddings: lm_head is the embedding's copy
    try:
        for unit in order:
            source = sender["embed" if unit == "lm_head" and tied else unit]
            tensors = {}
            if unit in units and is_writer_stage:
                tensors = _gather_unit(units[unit], params, tp_group, tp)
            if unit == "lm_head" and tied:
                tensors = {"lm_head.weight": kept_embedding} if world_rank == source else {}
            if unit == "embed" and tied and world_rank == source:
                kept_embedding = tensors["model.embed_tokens.weight"]
            stored = unit in vision_names  # written under the folder's own names
            for name in vision_names[unit] if stored else _unit_names(unit, shapes):
                out_dtype = dtype if stored else layout.hf_dtype(name, dtype)
                shape = kept.model_shapes[name] if stored else shapes[name]
                if not stored and name.endswith(layout.STACKED_EXPERT_NAMES):
                    _write_experts(name, spec.num_experts, experts, sender, params, writer,
                                   (1, *shape[1:]), out_dtype)
                elif world_rank == 0 and source == 0:
                    _write(writer, name, tensors[name].to(out_dtype), stored)
                elif world_rank == source:
                    dist.send(tensors[name].to(out_dtype).contiguous(), dst=0,
                              group=world_group)
                elif world_rank == 0:
                    tensor = torch.empty(shape, dtype=out_dtype)
                    dist.recv(tensor, src=source, group=world_group)
                    _write(writer, name, tensor, stored)
            del tensors
        if writer is not None and kept is not None:  # the kept tensors, bit for bit
            try:
                for name, _, _ in kept.plan:  # each checked as read, then written (kept.get)
                    writer.write(name, kept.get(name), stored=True)
            except HFConfigError as err:
                failure = err
            kept.close()
        if writer is not None and failure is None:
            writer.close()
        elif writer is not None:
            writer.abort()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    # Every rank waits for the writer, and raises its refusal of a kept tensor with it.
    _raise_on_every_rank(failure, world_group)


def _write(writer, name: str, tensor: torch.Tensor, stored: bool) -> None:
    if stored:
        writer.write(name, tensor, stored=True)
    else:
        writer.write(name, tensor)


def _raise_on_every_rank(failure: HFConfigError | None, group) -> None:
    """Collective (with torch.distributed): the first rank's ``failure`` raised on every rank,
    said once (``on_every_rank``); a barrier when there is none."""
    failures = [failure]
    if dist.is_initialized():
        failures = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, None if failure is None else str(failure), group=group)
    found = next((f for f in failures if f is not None), None)
    if found is not None:
        error = HFConfigError(str(found))
        error.on_every_rank = True
        raise error


class _RenamingWriter:
    """A writer taking the Step-3.5 text names (``stored=True``: names as the folder stores
    them) for a Step-3.7 folder whose text model is under ``prefix``."""

    def __init__(self, writer, prefix: str):
        from mcore_ext.hf.step37 import stored_name

        self.writer, self.prefix, self._name = writer, prefix, stored_name

    def write(self, name, tensor, stored=False):
        self.writer.write(name if stored else self._name(name, self.prefix), tensor)

    def write_rows(self, name, rows):
        self.writer.write_rows(self._name(name, self.prefix), rows)

    def close(self):
        self.writer.close()

    def abort(self):
        self.writer.abort()


def _unit_of(hf_names) -> str:
    first = hf_names[0]
    if first.startswith("model.layers."):
        return f"layer{first.split('.')[2]}"
    return {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
            "lm_head.weight": "lm_head"}[first]


def _unit_order(spec: Step35Config) -> list[str]:
    layers = spec.num_layers + spec.num_mtp_layers
    return ["embed", *(f"layer{i}" for i in range(layers)), "norm", "lm_head"]


def _expert_dp_rank() -> int:
    return parallel_state.get_expert_data_parallel_rank()


def _write_experts(name: str, num_experts: int, experts: dict, sender: dict, params: dict,
                   writer, row_shape: tuple, dtype: torch.dtype) -> None:
    """Stream stacked tensor ``name`` expert by expert: the ETP ranks holding expert e gather
    it, their rank 0 sends its rows for ``name`` to global rank 0, which appends them."""
    world_rank = dist.get_rank() if dist.is_initialized() else 0
    etp_rank, etp = _expert_tp_rank()
    group = cpu_group(parallel_state.get_expert_tensor_parallel_group()) if etp > 1 else None
    world_group = cpu_group() if dist.is_initialized() else None
    for e in range(num_experts):
        source = sender[(name, e)]
        rows = None
        item = experts.get((name, e))
        if item is not None:
            full = _gather_unit([item], params, group, etp)
            rows = full[name].unsqueeze(0).to(dtype)
        if world_rank == 0 and source == 0:
            writer.write_rows(name, rows)
        elif world_rank == source:
            dist.send(rows.contiguous(), dst=0, group=world_group)
        elif world_rank == 0:
            rows = torch.empty(row_shape, dtype=dtype)
            dist.recv(rows, src=source, group=world_group)
            writer.write_rows(name, rows)
        del rows


def _unit_names(unit: str, shapes: dict) -> list[str]:
    if unit.startswith("layer"):
        prefix = layout.hf_layer_prefix(int(unit[5:]))
        return [n for n in shapes if n.startswith(prefix)]
    return [{"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}[unit]]


def _gather_unit(items, params: dict, tp_group, tp: int) -> dict:
    """{HF name: full tensor} of one unit, on every TP rank of its stage."""
    out = {}
    for name, _, mapping, hf_names in items:
        param = params[name]
        local = param.detach().to("cpu").contiguous()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            locals_ = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(locals_, local, group=tp_group)
        else:
            locals_ = [local] * tp
        out.update(zip(hf_names, mapping.from_locals(locals_)))
    return out
