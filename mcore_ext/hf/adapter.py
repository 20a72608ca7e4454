"""A LoRA model's adapters in Hugging Face PEFT's format: what ``PeftModel.from_pretrained`` loads.

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules
    adapter_model.safetensors   base_model.model.model.layers.<L>.<module>.lora_A.weight [r, in]
                                                                     .lora_B.weight [out, r]

The module names are those of transformers' Step-3.5 model (``self_attn.q_proj`` ...
``g_proj``, ``o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, the shared expert's
``mlp.shared_experts.gate_proj`` ...), the layer numbers global (layer L of ``model.layers``;
of ``model.language_model.layers`` for a Step-3.7 import, the text model's path in
``Step3p7ForConditionalGeneration``: ``root``).
Each target's A and B are gathered over TP into the HF tensors, and the pipeline stages' layers
over PP, so every TP / PP layout writes the same files.

Routed experts are fused 3-D parameters in transformers (``mlp.experts.gate_up_proj`` [E, 2 f,
h], ``down_proj`` [E, h, f]); PEFT adapts them through ``target_parameters`` (its
``ParamWrapper``): one ``lora_A`` [r E, in] (expert e's A at rows e r .. e r + r) and one
``lora_B`` [out, r E] (expert e's B at columns e, E + e, ..., as PEFT reshapes it to
[out, r, E]) per parameter, the wrappers nested in the order of ``target_parameters``: the last
one's tensors are ``mlp.experts.lora_A``, the one before it's ``mlp.experts.base_layer.lora_A``.
The experts' A and B are gathered over EP. PEFT refuses ``lora_dropout`` with
``target_parameters``, so an export with routed experts writes ``lora_dropout`` 0 (dropout is
training-only; what the adapter computes is the same).

The MTP layers are adapted as the decoder's (``lora.apply_lora``) and have no module in
transformers' model (it drops MTP layers), so PEFT cannot hold their adapters: they are written
beside the PEFT files in ``mtp_adapter_model.safetensors`` (``MTP_ADAPTER_WEIGHTS``), under the
same PEFT key scheme with the released checkpoint's layer numbers (MTP depth k is
``model.layers.<num_layers + k>``). ``peft`` and vLLM read the folder's two PEFT files and
ignore it; ``load_adapter`` (``lora.init_from``) reads it back. A folder without it (one ``peft``
made) leaves a model's MTP adapters as new ones (B = 0).

``load_adapter`` reads such a directory, written by ``save_adapter`` or by ``peft`` itself
(``PeftModel.save_pretrained``), into a model's adapters at any TP: each rank takes its slice of
the HF tensors, each pipeline stage its layers'. What the project cannot place (other modules:
embeddings, lm_head, layers the model lacks; PEFT options that change the formula: DoRA,
rsLoRA, per-module ranks, biases, a ``modules_to_save``) is refused, named, before anything is
loaded.
"""

import contextlib
import json
import os
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mcore_ext import lora
from mcore_ext.hf.layout import hf_layer_prefix
from mcore_ext.userfiles import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The MTP layers' adapters, beside the PEFT files (no module of transformers' model holds them).
MTP_ADAPTER_WEIGHTS = "mtp_adapter_model.safetensors"
# Where each adapted megatron linear sits in transformers' layer.
_HF_MODULE = {"self_attention.linear_qkv_lora": "self_attn",
              "self_attention.linear_proj_lora": "self_attn",
              "mlp.linear_fc1_lora": "mlp", "mlp.linear_fc2_lora": "mlp",
              "mlp.shared_experts.linear_fc1_lora": "mlp.shared_experts",
              "mlp.shared_experts.linear_fc2_lora": "mlp.shared_experts"}
# Module names of transformers' Step-3.7 vision tower that are also targets of the text model's.
_TOWER_MODULES = {"q_proj", "k_proj", "v_proj"}
# adapter_config.json's exclude_modules of an adapter of a model whose text model is under
# ``root`` beside other modules (peft: re.fullmatch on the module's name): everything else.
TEXT_MODEL_ONLY = "(?!{root}).*"
# A routed expert's adapter (its LoraLinear's target) -> the PEFT target parameter.
_EXPERT_PARAMETER = {"gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj"}


# An MTP depth's layer: GPTModel's (megatron's mtp_model_layer, or transformer_layer) or
# HybridModel's two layers of the depth (mtp_model_layer.layers.0 / .1).
_MTP_LAYER = re.compile(
    r"mtp\.layers\.(\d+)\.(?:mtp_model_layer|transformer_layer)(?:\.layers\.[01])?")


def _layer_prefix(root: str, layer: int) -> str:
    """``root``: the text model's module path in transformers' class (``model.`` for
    Step-3.5's text model, ``model.language_model.`` in Step3p7ForConditionalGeneration)."""
    return hf_layer_prefix(layer).replace("model.", root, 1)


def _peft_prefixes(model, root: str = "model.") -> dict:
    """{PEFT module prefix: LoraLinear} of ``model``'s adapters (a GPTModel or HybridModel),
    the MTP layers' under their released layer numbers (``num_layers + k``), routed experts'
    left out (``_expert_adapters``)."""
    prefixes = {}
    for name, adapter in lora.lora_adapters(model).items():
        if ".experts.local_experts." in name:
            continue
        layer_name, _, local = name.partition(".self_attention.")
        if not local:
            layer_name, _, local = name.partition(".mlp.")
            local = "mlp." + local
        else:
            local = "self_attention." + local
        depth = _MTP_LAYER.fullmatch(layer_name)
        if local not in _HF_MODULE or not (layer_name.startswith("decoder.layers.") or depth):
            raise NotImplementedError(f"the PEFT name of the adapter {name}")
        layer = (model.config.num_layers + int(depth[1]) if depth
                 else _hf_layer(model.get_submodule(layer_name)))
        prefix = f"base_model.model.{_layer_prefix(root, layer)}{_HF_MODULE[local]}"
        for target_name in adapter.targets:
            prefixes[f"{prefix}.{target_name}"] = adapter
    return prefixes


def _is_mtp_key(key: str, num_layers: int) -> bool:
    """Whether a PEFT key (``base_model.model.model.layers.<L>....``, or under
    ``model.language_model.`` for a Step-3.7 import: ``_layer_prefix``) is an MTP layer's."""
    match = re.match(r"base_model\.model\.model\.(?:language_model\.)?layers\.(\d+)\.", key)
    return match is not None and int(match[1]) >= num_layers


def _hf_layer(layer) -> int:
    """The HF (global, 0-based) layer of a model's decoder layer: a GPTModel's layer number, a
    HybridModel layer's GPT layer (its attention and its MLP / MoE layer are one HF layer)."""
    return getattr(layer, "gpt_layer_number", layer.layer_number) - 1


def _expert_adapters(model) -> dict:
    """{(global layer, PEFT target parameter): [this rank's local experts' LoraTargets]}."""
    found = {}
    for name, adapter in lora.lora_adapters(model).items():
        layer_name, _, local = name.partition(".mlp.experts.local_experts.")
        if not local:
            continue
        layer = _hf_layer(model.get_submodule(layer_name))
        for target_name, target in adapter.targets.items():
            found.setdefault((layer, _EXPERT_PARAMETER[target_name]), []).append(target)
    return found


def _expert_prefix(layer: int, parameter: str, parameters: list, root: str = "model.") -> str:
    """PEFT's module prefix of ``parameter``'s wrapper: nested in ``parameters``' order, the
    last one outermost."""
    nesting = ".base_layer" * (len(parameters) - 1 - parameters.index(parameter))
    return f"base_model.model.{_layer_prefix(root, layer)}mlp.experts{nesting}"


def _expert_parameters(cfg: "lora.LoraConfig") -> list:
    return [t for t in cfg.targets if t in lora.EXPERT_TARGETS]


def adapter_tensors(model, cfg: "lora.LoraConfig", root: str = "model.") -> dict:
    """{PEFT key: global fp32 tensor} of every adapter of ``model`` (a GPTModel, this pipeline
    stage's layers), on every rank: every stage's under PP. ``root``: see ``_layer_prefix``."""
    tensors = {}
    prefixes = _peft_prefixes(model, root)
    parameters = _expert_parameters(cfg)
    ep_group = ps.get_expert_model_parallel_group()
    for (layer, parameter), targets in sorted(_expert_adapters(model).items()):
        a = _gather(torch.stack([t.lora_A.detach().float() for t in targets]), 0, ep_group)
        b = _gather(torch.stack([t.lora_B.detach().float() for t in targets]), 0, ep_group)
        experts, rank = a.shape[0], a.shape[1]
        prefix = _expert_prefix(layer, parameter, parameters, root)
        tensors[f"{prefix}.lora_A.weight"] = a.reshape(experts * rank, -1).cpu()  # [E r, in]
        tensors[f"{prefix}.lora_B.weight"] = b.permute(1, 2, 0).reshape(-1, experts * rank).cpu()
    for prefix, adapter in prefixes.items():
        target = adapter.targets[prefix.rpartition(".")[2]]
        a, b = target.lora_A.detach().float(), target.lora_B.detach().float()
        if adapter.parallel == "row":
            a = _gather(a, dim=1, group=adapter.tp_group)
        elif target.rows is None:
            b = _gather(b, dim=0, group=adapter.tp_group)
        tensors[f"{prefix}.lora_A.weight"] = a.cpu()
        tensors[f"{prefix}.lora_B.weight"] = b.cpu()
    return _union_over_stages(tensors)


def _union_over_stages(items):
    """The union of every pipeline stage's ``items`` (a dict or a set), on every rank."""
    group = ps.get_pipeline_model_parallel_group()
    if group.size() == 1:
        return items
    stages = [None] * group.size()
    dist.all_gather_object(stages, items, group=group)
    union = type(items)()
    for stage in stages:
        union.update(stage)
    return union


def _gather(tensor, dim, group):
    if group.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def save_adapter(model, directory: str, cfg: "lora.LoraConfig", root: str = "model.") -> None:
    """Write ``model``'s adapters to ``directory`` in PEFT's format, the MTP layers' (if any)
    beside them in ``MTP_ADAPTER_WEIGHTS`` (global rank 0 writes; every rank must call it).
    ``root``: the text model's path in the transformers class the adapter is for
    (``_layer_prefix``)."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(model, cfg, root)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    os.makedirs(directory, exist_ok=True)
    num_layers = model.config.num_layers
    mtp = {k: v.contiguous() for k, v in tensors.items() if _is_mtp_key(k, num_layers)}
    save_file({k: v.contiguous() for k, v in tensors.items() if k not in mtp},
              os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if mtp:  # beside the PEFT files: peft loads the decoder's, load_adapter both
        save_file(mtp, os.path.join(directory, MTP_ADAPTER_WEIGHTS), metadata={"format": "pt"})
    parameters = _expert_parameters(cfg)
    modules = sorted(t for t in cfg.targets if t not in parameters)
    config = dict(peft_type="LORA", r=cfg.rank, lora_alpha=cfg.alpha,
                  lora_dropout=0.0 if parameters else cfg.dropout,
                  target_modules=modules,
                  target_parameters=parameters or None, bias="none", fan_in_fan_out=False,
                  use_rslora=False, init_lora_weights=True, inference_mode=True,
                  modules_to_save=None, task_type=None)
    if root != "model." and set(modules) & _TOWER_MODULES:
        # peft matches target_modules by the modules' last names anywhere in the model: in
        # Step3p7ForConditionalGeneration also the vision tower's q/k/v_proj, where it would add
        # adapters of its own (B = 0; "missing adapter keys"). Only the text model is adapted.
        config["exclude_modules"] = TEXT_MODEL_ONLY.format(root=re.escape(root))
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    if dist.is_initialized():
        dist.barrier()


class AdapterError(ValueError):
    """A PEFT adapter this model cannot take: one line naming the file, the field and value."""


# adapter_config.json fields whose non-default values change what the adapter computes.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "lora_bias": False}


def read_adapter_config(directory: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter; AdapterError when it is not one or asks for
    what ``load_adapter`` cannot compute."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS)):
        raise AdapterError(f"{directory} is not a PEFT adapter (no {ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS} in it)")
    config = read_json(path, AdapterError)  # an object, or one line naming the file
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type={config.get('peft_type')!r}, only LORA loads")
    for field, default in _UNSUPPORTED.items():
        value = config.get(field, default)
        if value != default and not (default in (None, {}) and not value):
            raise AdapterError(f"{path}: {field}={value!r} is not supported (only {default!r})")
    return config


def load_adapter(model, directory: str, cfg: "lora.LoraConfig") -> int:
    """Set ``model``'s adapters (``apply_lora(model, cfg)`` done) from the PEFT adapter in
    ``directory``, each rank its slice, the MTP layers' from ``MTP_ADAPTER_WEIGHTS`` beside it.
    Its r, lora_alpha and target modules must be ``cfg``'s; AdapterError names what differs, and
    the modules the model has no adapter for. Returns how many MTP adapter targets were left new
    (B = 0) because the folder has no MTP file (one ``peft`` made); 0 otherwise."""
    from safetensors import safe_open

    config = read_adapter_config(directory)
    path = os.path.join(directory, ADAPTER_CONFIG)
    targets = config.get("target_modules")
    parameters = config.get("target_parameters") or []
    if not isinstance(targets, (list, tuple)) or not isinstance(parameters, (list, tuple)):
        raise AdapterError(f"{path}: target_modules={targets!r}, target_parameters="
                           f"{parameters!r}: lists of names load (of {', '.join(lora.TARGETS)})")
    for field, names, known in (("target_modules", targets,
                                 lora.ATTENTION_TARGETS + lora.MLP_TARGETS),
                                ("target_parameters", parameters, lora.EXPERT_TARGETS)):
        unknown = sorted(t for t in set(names) if t not in known)
        if unknown:
            raise AdapterError(f"{path}: {field} {', '.join(unknown)}: the project cannot place "
                               f"them (it adapts {', '.join(lora.TARGETS)})")
    targets = sorted(set(targets) | set(parameters))
    for field, theirs, ours in (("r", config.get("r"), cfg.rank),
                                ("lora_alpha", config.get("lora_alpha"), cfg.alpha),
                                ("target_modules", targets, sorted(cfg.targets))):
        if theirs != ours:
            what = {"r": "lora.rank", "lora_alpha": "lora.alpha",
                    "target_modules": "lora.targets"}[field]
            raise AdapterError(f"{path}: {field}={theirs!r} but {what}={ours!r}: set {what} "
                               "to the adapter's")
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    mtp_weights = os.path.join(directory, MTP_ADAPTER_WEIGHTS)
    files = [weights] + ([mtp_weights] if os.path.isfile(mtp_weights) else [])
    with safe_open(weights, framework="pt") as f:
        # An adapter of Step3p7ForConditionalGeneration holds the text model's layers under
        # model.language_model. (every key: a mix is refused below as keys no adapter takes).
        root = ("model.language_model." if any(
            k.startswith("base_model.model.model.language_model.") for k in f.keys())
            else "model.")
    prefixes = _peft_prefixes(model, root)
    experts = {_expert_prefix(layer, parameter, list(parameters), root): targets
               for (layer, parameter), targets in _expert_adapters(model).items()}
    num_layers = model.config.num_layers
    # Every stage's adapters: a key another stage places is not this file's stray.
    wanted = _union_over_stages(
        {f"{p}.lora_{m}.weight" for p in [*prefixes, *experts] for m in "AB"})
    mtp_wanted = {k for k in wanted if _is_mtp_key(k, num_layers)}
    left_new = 0
    if len(files) == 1 and mtp_wanted:  # no MTP file (a peft-made adapter): theirs start new
        wanted -= mtp_wanted
        left_new = len(mtp_wanted) // 2
        prefixes = {p: a for p, a in prefixes.items()
                    if not _is_mtp_key(f"{p}.lora_A.weight", num_layers)}
    with contextlib.ExitStack() as stack:
        handles, where = [], {}
        for file in files:
            f = stack.enter_context(safe_open(file, framework="pt"))
            handles.append(f)
            for key in f.keys():
                where.setdefault(key, (file, f))
            # PEFT's keys of a named adapter carry its name (lora_A.<name>.weight) only in memory.
            # The MTP file holds MTP layers' keys alone, the PEFT file none of them.
            mtp_file = file == mtp_weights
            unplaced = sorted({k.rpartition(".lora_")[0] for k in f.keys()
                               if k not in wanted or (_is_mtp_key(k, num_layers) != mtp_file)})
            if unplaced:
                more = f" (and {len(unplaced) - 3} more)" if len(unplaced) > 3 else ""
                raise AdapterError(
                    f"{file}: no adapter of this model takes "
                    f"{', '.join(unplaced[:3])}{more}: the project places q/k/v/g/o_proj, the "
                    "dense MLPs' and shared experts' gate/up/down_proj and the routed experts' "
                    "gate_up_proj / down_proj of the main layers (in "
                    f"{ADAPTER_WEIGHTS}), the MTP layers' in {MTP_ADAPTER_WEIGHTS}")
        missing = sorted(wanted - set(where))
        if missing:
            home = mtp_weights if _is_mtp_key(missing[0], num_layers) else weights
            raise AdapterError(f"{home}: {missing[0]} is missing (and {len(missing) - 1} more)"
                               if len(missing) > 1 else f"{home}: {missing[0]} is missing")

        def get(key):
            return where[key][1].get_tensor(key)

        with torch.no_grad():
            for prefix, local in experts.items():
                _load_experts(get, weights, prefix, local, cfg.rank)
        with torch.no_grad():
            for prefix, adapter in prefixes.items():
                target = adapter.targets[prefix.rpartition(".")[2]]
                a = get(f"{prefix}.lora_A.weight")
                b = get(f"{prefix}.lora_B.weight")
                tp, rank = adapter.tp_group.size(), adapter.tp_group.rank()
                if adapter.parallel == "row":
                    a = a.chunk(tp, dim=1)[rank]
                elif target.rows is None:
                    b = b.chunk(tp, dim=0)[rank]
                for name, ours, theirs in (("lora_A", target.lora_A, a),
                                           ("lora_B", target.lora_B, b)):
                    if ours.shape != theirs.shape:
                        raise AdapterError(f"{where[f'{prefix}.{name}.weight'][0]}: {prefix}."
                                           f"{name}.weight has the shape "
                                           f"{tuple(theirs.shape)}, this model's rank slice "
                                           f"{tuple(ours.shape)} (another model?)")
                    ours.copy_(theirs.to(ours.dtype))
    return left_new


def _load_experts(get, weights, prefix, local, rank):
    """This EP rank's experts' A and B from PEFT's [E r, in] / [out, r E] tensors (``get``: a
    key's tensor)."""
    a = get(f"{prefix}.lora_A.weight")
    b = get(f"{prefix}.lora_B.weight")
    experts = a.shape[0] // rank
    if a.shape[0] != experts * rank or b.shape[1] != experts * rank or \
            experts != len(local) * ps.get_expert_model_parallel_world_size():
        raise AdapterError(f"{weights}: {prefix}.lora_A.weight {tuple(a.shape)} / lora_B "
                           f"{tuple(b.shape)} do not hold r {rank} for each of this model's "
                           f"{len(local) * ps.get_expert_model_parallel_world_size()} experts")
    a = a.reshape(experts, rank, -1)
    b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
    first = ps.get_expert_model_parallel_rank() * len(local)
    for j, target in enumerate(local):
        for name, ours, theirs in (("lora_A", target.lora_A, a[first + j]),
                                   ("lora_B", target.lora_B, b[first + j])):
            if ours.shape != theirs.shape:
                raise AdapterError(f"{weights}: {prefix}.{name}.weight holds experts' "
                                   f"{tuple(theirs.shape)}, this model's {tuple(ours.shape)} "
                                   "(another model?)")
            ours.copy_(theirs.to(ours.dtype))
