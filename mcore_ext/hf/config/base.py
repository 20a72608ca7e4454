"""What every module of ``mcore_ext.hf.config`` shares: the model's names and HFConfigError."""

FULL, SLIDING = "full_attention", "sliding_attention"  # attention kinds (layer_types)
DENSE, SPARSE = "dense", "sparse"  # MLP kinds (mlp_layer_types)
MODEL_TYPE = "step3p5"
ARCHITECTURE = "Step3p5ForCausalLM"


class HFConfigError(ValueError):
    """A Hugging Face config (or a megatron model) the Step-3.5 conversion cannot represent."""
