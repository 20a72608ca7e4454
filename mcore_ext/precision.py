"""The precisions a model's parameters and compute can have: one table for the launcher's
``training.precision``, the HF import / export and the command lines."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(precision: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (ValueError naming the value otherwise)."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r} is not one of {sorted(DTYPES)}") from None


def precision_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (ValueError naming the dtype otherwise)."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPES)} ({list(DTYPES.values())})")
