"""Text -> megatron indexed datasets: tokenizers and the preprocessing command."""

from mcore_ext.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]
