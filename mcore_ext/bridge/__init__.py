"""Megatron-Bridge (0.6.x) integration: ``GatedGPTModelProvider`` / ``GatedHybridModelProvider``
(mcore_ext's GPTModel / HybridModel) and a ``Step3p5ForCausalLM``
bridge in mcore_ext's exact layout, registered on import (import this after ``megatron.bridge``
is importable; the registration replaces Bridge's own Step-3.5 bridge). Usage: docs/bridge.md.
"""

import importlib.util
import sys

# Bridge 0.6 imports Transformer Engine unconditionally in one module (its LoRA layers, reached
# from its model registry): without TE, say so here rather than in a traceback from inside Bridge.
# A process that has already provided that module (tests/bridge stubs it) imports as usual.
_TE_IMPORTING_MODULE = "megatron.bridge.peft.lora_layers"
if importlib.util.find_spec("megatron.bridge") is None:
    raise ImportError(
        "mcore_ext.bridge needs Megatron-Bridge 0.6 (pip install megatron-bridge==0.6.2, or "
        "bash scripts/setup_bridge.sh for the test environment)"
    )
if (importlib.util.find_spec("transformer_engine") is None
        and _TE_IMPORTING_MODULE not in sys.modules):
    raise ImportError(
        "mcore_ext.bridge imports Megatron-Bridge 0.6, which needs Transformer Engine (imported "
        f"unconditionally by {_TE_IMPORTING_MODULE}): pip install 'mcore_ext[te]' (a CUDA "
        "machine). mcore_ext without Bridge needs no TE: mcore_ext.hf converts Step-3.5 checkpoints"
    )

from mcore_ext.bridge.provider import (  # noqa: E402
    GatedGPTModelProvider,
    GatedHybridModelProvider,
    gated_block_spec,
)
from mcore_ext.bridge.step35 import GatedStep35Bridge, LayoutMapping  # noqa: E402

__all__ = ["GatedGPTModelProvider", "GatedHybridModelProvider", "GatedStep35Bridge",
           "LayoutMapping", "gated_block_spec"]
