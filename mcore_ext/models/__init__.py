"""Whole models built from megatron-core's parts with mcore_ext's layers."""

from mcore_ext.models.gpt import build_gpt_model, padded_vocab_size

__all__ = ["build_gpt_model", "padded_vocab_size"]
