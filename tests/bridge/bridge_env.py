"""Importing Megatron-Bridge 0.6.2 without Transformer Engine (test helper).

``import megatron.bridge`` imports TE unconditionally through exactly one module,
``megatron.bridge.peft.lora_layers`` (``import transformer_engine.pytorch as te``, reached via
``models/conversion`` -> ``peft_bridge`` -> ``peft/canonical_lora``). Without TE, that one module
is replaced by a stub whose LoRA classes raise when used; nothing else is patched, and
``transformer_engine`` itself is not faked (megatron-core would then believe TE is present).
LoRA / PEFT is the only thing the stub takes away, and these tests do not use it.
"""

import importlib.util
import sys
import types

STUBBED = "megatron.bridge.peft.lora_layers"
_LORA_CLASSES = ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear")


def bridge_installed() -> bool:
    """Whether megatron.bridge is installed (cheap: no import)."""
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        return False


def _stub_lora_layers() -> None:
    module = types.ModuleType(STUBBED)
    module.__doc__ = "Test stub: Megatron-Bridge's LoRA layers need Transformer Engine."

    def unavailable(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: {STUBBED} is a test stub (no Transformer "
                           "Engine); LoRA is not available")

    for name in _LORA_CLASSES:
        setattr(module, name, type(name, (), {"__init__": unavailable}))
    sys.modules[STUBBED] = module


def import_bridge():
    """``import megatron.bridge`` and ``mcore_ext.bridge`` (stubbing lora_layers without TE)."""
    if importlib.util.find_spec("transformer_engine") is None and STUBBED not in sys.modules:
        _stub_lora_layers()
    import megatron.bridge  # noqa: F401

    import mcore_ext.bridge

    return mcore_ext.bridge
