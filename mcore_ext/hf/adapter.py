"""A LoRA model's adapters in Hugging Face PEFT's format: what ``PeftModel.from_pretrained`` loads.

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules
    adapter_model.safetensors   base_model.model.model.layers.<L>.<module>.lora_A.weight [r, in]
                                                                     .lora_B.weight [out, r]

The module names are those of transformers' Step-3.5 model (``self_attn.q_proj`` ...
``g_proj``, ``o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``), the layer numbers global
(layer L of ``model.layers``). Each target's A and B are gathered over TP into the HF tensors,
so every TP layout writes the same files. Pipeline parallelism is not supported here yet.
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


def adapter_tensors(model) -> dict:
    """{PEFT key: global fp32 tensor} of every adapter of ``model`` (a GPTModel), on every rank."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("exporting a LoRA adapter under pipeline parallelism")
    tensors = {}
    for name, adapter in lora.lora_adapters(model).items():
        layer_name, _, local = name.partition(".self_attention.")
        if not local:
            layer_name, _, local = name.partition(".mlp.")
            local = "mlp." + local
        else:
            local = "self_attention." + local
        if local not in _HF_MODULE or not layer_name.startswith("decoder.layers."):
            raise NotImplementedError(f"exporting the adapter of {name}")
        layer = model.get_submodule(layer_name).layer_number - 1  # global, 0-based
        prefix = f"base_model.model.{hf_layer_prefix(layer)}{_HF_MODULE[local]}"
        for target_name, target in adapter.targets.items():
            a, b = target.lora_A.detach().float(), target.lora_B.detach().float()
            if adapter.parallel == "row":
                a = _gather(a, dim=1, group=adapter.tp_group)
            elif target.rows is None:
                b = _gather(b, dim=0, group=adapter.tp_group)
            tensors[f"{prefix}.{target_name}.lora_A.weight"] = a.cpu()
            tensors[f"{prefix}.{target_name}.lora_B.weight"] = b.cpu()
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
