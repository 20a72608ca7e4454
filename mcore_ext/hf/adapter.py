"""A LoRA model's adapters in Hugging Face PEFT's format: what ``PeftModel.from_pretrained`` loads.

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules
    adapter_model.safetensors   base_model.model.model.layers.<L>.<module>.lora_A.weight [r, in]
                                                                     .lora_B.weight [out, r]

The module names are those of transformers' Step-3.5 model (``self_attn.q_proj`` ...
``g_proj``, ``o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``), the layer numbers global
(layer L of ``model.layers``). Each target's A and B are gathered over TP into the HF tensors,
so every TP layout writes the same files. Pipeline parallelism is not supported here yet.

``load_adapter`` reads such a directory, written by ``save_adapter`` or by ``peft`` itself
(``PeftModel.save_pretrained``), into a model's adapters at any TP: each rank takes its slice of
the HF tensors. What the project cannot place (other modules: embeddings, lm_head, experts, MTP
layers; PEFT options that change the formula: DoRA, rsLoRA, per-module ranks, biases, a
``modules_to_save``) is refused, named, before anything is loaded.
"""

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mcore_ext import lora
from mcore_ext.hf.layout import hf_layer_prefix

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where each adapted megatron linear sits in transformers' layer.
_HF_MODULE = {"self_attention.linear_qkv_lora": "self_attn",
              "self_attention.linear_proj_lora": "self_attn",
              "mlp.linear_fc1_lora": "mlp", "mlp.linear_fc2_lora": "mlp"}


def _peft_prefixes(model) -> dict:
    """{PEFT module prefix: LoraLinear} of ``model``'s adapters (a GPTModel)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("a LoRA adapter in PEFT's format under pipeline parallelism")
    prefixes = {}
    for name, adapter in lora.lora_adapters(model).items():
        layer_name, _, local = name.partition(".self_attention.")
        if not local:
            layer_name, _, local = name.partition(".mlp.")
            local = "mlp." + local
        else:
            local = "self_attention." + local
        if local not in _HF_MODULE or not layer_name.startswith("decoder.layers."):
            raise NotImplementedError(f"the PEFT name of the adapter {name}")
        layer = model.get_submodule(layer_name).layer_number - 1  # global, 0-based
        prefix = f"base_model.model.{hf_layer_prefix(layer)}{_HF_MODULE[local]}"
        for target_name in adapter.targets:
            prefixes[f"{prefix}.{target_name}"] = adapter
    return prefixes


def adapter_tensors(model) -> dict:
    """{PEFT key: global fp32 tensor} of every adapter of ``model`` (a GPTModel), on every rank."""
    tensors = {}
    for prefix, adapter in _peft_prefixes(model).items():
        target = adapter.targets[prefix.rpartition(".")[2]]
        a, b = target.lora_A.detach().float(), target.lora_B.detach().float()
        if adapter.parallel == "row":
            a = _gather(a, dim=1, group=adapter.tp_group)
        elif target.rows is None:
            b = _gather(b, dim=0, group=adapter.tp_group)
        tensors[f"{prefix}.lora_A.weight"] = a.cpu()
        tensors[f"{prefix}.lora_B.weight"] = b.cpu()
    return tensors


def _gather(tensor, dim, group):
    if group.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def save_adapter(model, directory: str, cfg: "lora.LoraConfig") -> None:
    """Write ``model``'s adapters to ``directory`` in PEFT's format (global rank 0 writes; every
    rank must call it)."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = dict(peft_type="LORA", r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                  target_modules=sorted(cfg.targets), bias="none", fan_in_fan_out=False,
                  use_rslora=False, init_lora_weights=True, inference_mode=True,
                  modules_to_save=None, task_type=None)
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
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise AdapterError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type={config.get('peft_type')!r}, only LORA loads")
    for field, default in _UNSUPPORTED.items():
        value = config.get(field, default)
        if value != default and not (default in (None, {}) and not value):
            raise AdapterError(f"{path}: {field}={value!r} is not supported (only {default!r})")
    return config


def load_adapter(model, directory: str, cfg: "lora.LoraConfig") -> None:
    """Set ``model``'s adapters (``apply_lora(model, cfg)`` done) from the PEFT adapter in
    ``directory``, each rank its slice. Its r, lora_alpha and target modules must be ``cfg``'s;
    AdapterError names what differs, and the modules the model has no adapter for."""
    from safetensors import safe_open

    config = read_adapter_config(directory)
    path = os.path.join(directory, ADAPTER_CONFIG)
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)):
        raise AdapterError(f"{path}: target_modules={targets!r}: a list of module names loads "
                           f"(of {', '.join(lora.TARGETS)})")
    unknown = sorted(t for t in set(targets) if t not in lora.TARGETS)
    if unknown:
        raise AdapterError(f"{path}: target_modules {', '.join(unknown)}: the project cannot "
                           f"place them (it adapts {', '.join(lora.TARGETS)})")
    targets = sorted(set(targets))
    for field, theirs, ours in (("r", config.get("r"), cfg.rank),
                                ("lora_alpha", config.get("lora_alpha"), cfg.alpha),
                                ("target_modules", targets, sorted(cfg.targets))):
        if theirs != ours:
            what = {"r": "lora.rank", "lora_alpha": "lora.alpha",
                    "target_modules": "lora.targets"}[field]
            raise AdapterError(f"{path}: {field}={theirs!r} but {what}={ours!r}: set {what} "
                               "to the adapter's")
    prefixes = _peft_prefixes(model)
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    with safe_open(weights, framework="pt") as f:
        keys = set(f.keys())
        wanted = {f"{p}.lora_{m}.weight" for p in prefixes for m in "AB"}
        # PEFT's keys of a named adapter carry its name (lora_A.<name>.weight) only in memory.
        unplaced = sorted({k.rpartition(".lora_")[0] for k in keys - wanted})
        if unplaced:
            more = f" (and {len(unplaced) - 3} more)" if len(unplaced) > 3 else ""
            raise AdapterError(f"{weights}: no adapter of this model takes "
                               f"{', '.join(unplaced[:3])}{more}: the project places q/k/v/g/o_proj "
                               "and the dense MLPs' gate/up/down_proj only")
        missing = sorted(wanted - keys)
        if missing:
            raise AdapterError(f"{weights}: {missing[0]} is missing (and {len(missing) - 1} more)"
                               if len(missing) > 1 else f"{weights}: {missing[0]} is missing")
        with torch.no_grad():
            for prefix, adapter in prefixes.items():
                target = adapter.targets[prefix.rpartition(".")[2]]
                a = f.get_tensor(f"{prefix}.lora_A.weight")
                b = f.get_tensor(f"{prefix}.lora_B.weight")
                tp, rank = adapter.tp_group.size(), adapter.tp_group.rank()
                if adapter.parallel == "row":
                    a = a.chunk(tp, dim=1)[rank]
                elif target.rows is None:
                    b = b.chunk(tp, dim=0)[rank]
                for name, ours, theirs in (("lora_A", target.lora_A, a),
                                           ("lora_B", target.lora_B, b)):
                    if ours.shape != theirs.shape:
                        raise AdapterError(f"{weights}: {prefix}.{name}.weight has the shape "
                                           f"{tuple(theirs.shape)}, this model's rank slice "
                                           f"{tuple(ours.shape)} (another model?)")
                    ours.copy_(theirs.to(ours.dtype))
