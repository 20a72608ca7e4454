"""Hugging Face Step-3.5 (``Step3p5ForCausalLM``, model_type ``step3p5``) <-> megatron, exactly.

    load_pretrained(HF_DIR)          -> this rank's GPTModel (after init_parallel, any TP/PP/EP;
                                        architecture="hybrid": its HybridModel, built alone)
    save_pretrained(model, HF_DIR)   <- any TP / PP / EP; written by global rank 0
    python -m mcore_ext.hf import HF_DIR CKPT_DIR   /   export CKPT_DIR HF_DIR
    python -m mcore_ext.hf plan HF_DIR --tp --pp --ep --dp   (parameters and memory per rank)

Dense and MoE layers and the MTP layers of the released Step-3.5-Flash checkpoint; of a
Step-3.7-Flash folder (``Step3p7ForConditionalGeneration``) the text model, its vision tower and
projector kept as they are (``step37``).

Modules: ``config`` (config.json <-> megatron config fields), ``layout`` (the name table and the
fused linear_qkv / linear_fc1 row layouts), ``safetensors_io`` (streaming reader and sharded
writer), ``convert`` (load / save at any parallel layout), ``checkpoint`` (the launcher's
distributed checkpoints), ``plan`` (per-rank memory), ``__main__`` (the command line).
"""

from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.hf.convert import load_pretrained, save_pretrained
from mcore_ext.hf.safetensors_io import SafetensorsError

__all__ = [
    "HFConfigError",
    "SafetensorsError",
    "Step35Config",
    "export_checkpoint",
    "import_checkpoint",
    "load_pretrained",
    "save_pretrained",
]


def import_checkpoint(*args, **kwargs):
    """See ``mcore_ext.hf.checkpoint.import_checkpoint``."""
    from mcore_ext.hf.checkpoint import import_checkpoint as run

    return run(*args, **kwargs)


def export_checkpoint(*args, **kwargs):
    """See ``mcore_ext.hf.checkpoint.export_checkpoint``."""
    from mcore_ext.hf.checkpoint import export_checkpoint as run

    return run(*args, **kwargs)
