"""Megatron-Bridge (0.6.x) integration: ``GatedGPTModelProvider`` and a ``Step3p5ForCausalLM``
bridge in mcore_ext's exact layout, registered on import (import this after ``megatron.bridge``
is importable; the registration replaces Bridge's own Step-3.5 bridge).

    import mcore_ext.bridge
    from megatron.bridge import AutoBridge
    bridge = AutoBridge.from_hf_pretrained(HF_DIR)
    provider = bridge.to_megatron_provider(load_weights=True)
"""

from mcore_ext.bridge.provider import GatedGPTModelProvider, gated_block_spec
from mcore_ext.bridge.step35 import GatedStep35Bridge, LayoutMapping

__all__ = ["GatedGPTModelProvider", "GatedStep35Bridge", "LayoutMapping", "gated_block_spec"]
