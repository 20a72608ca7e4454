"""Whole models built from megatron-core's parts with mcore_ext's layers."""

from mcore_ext.models.gpt import build_gpt_model
from mcore_ext.models.mtp import MTPGPTModel, mtp_logits

__all__ = ["MTPGPTModel", "build_gpt_model", "mtp_logits"]
