"""Step-3.5 config.json <-> ``Step35Config`` <-> ``GatedTransformerConfig`` fields.

    model.py            Step35Config: the fields both sides need, their validation, per-layer
                        questions (heads, kv_heads, is_sparse, layer_type)
    read.py             a config.json in any dialect -> Step35Config's fields
    released.py         the released Step3p5ForCausalLM config: its own keys, and the writer
    step3p7.py          transformers' Step3p7TextConfig / Step3p7Config spellings
    megatron_config.py  Step35Config <-> megatron's GatedTransformerConfig fields
    base.py             the names they share and HFConfigError

``Step35Config.from_hf_dict`` / ``to_hf_dict`` / ``transformer_config_fields`` /
``from_transformer_config`` are the entry points.
"""

from mcore_ext.hf.config.base import (
    ARCHITECTURE,
    DENSE,
    FULL,
    MODEL_TYPE,
    SLIDING,
    SPARSE,
    HFConfigError,
)
from mcore_ext.hf.config.megatron_config import megatron_moe_layers
from mcore_ext.hf.config.model import Step35Config

__all__ = [
    "ARCHITECTURE",
    "DENSE",
    "FULL",
    "MODEL_TYPE",
    "SLIDING",
    "SPARSE",
    "HFConfigError",
    "Step35Config",
    "megatron_moe_layers",
]
