"""Whole models built from megatron-core's parts with mcore_ext's layers."""

from mcore_ext.models.gpt import build_gpt_model, padded_vocab_size
from mcore_ext.models.hybrid import build_hybrid_model
from mcore_ext.models.mtp_model import MTPGPTModel, mtp_logits

__all__ = ["MTPGPTModel", "build_gpt_model", "build_hybrid_model", "mtp_logits",
           "padded_vocab_size"]
