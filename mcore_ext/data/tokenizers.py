"""Tokenizers for preprocessing and for megatron's GPT datasets.

megatron's ``GPTDatasetConfig`` needs from a tokenizer only ``vocab_size``, ``eod`` (the
end-of-document id it appends / masks around) and ``unique_identifiers`` (hashed into the names of
its cached sample indices).
"""

import os


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus one end-of-document id, 256: no files, no download."""

    vocab_size = 257
    eod = 256
    unique_identifiers = {"class": "mcore_ext.ByteTokenizer"}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (needs the optional ``transformers``)."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                f"tokenizer {path!r} is a Hugging Face tokenizer directory, which needs "
                "`pip install transformers`; or use the built-in 'byte' tokenizer"
            ) from None
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tokenizer)
        self.eod = self._tokenizer.eos_token_id
        if self.eod is None:
            raise ValueError(f"tokenizer {path!r} has no eos token to use as end-of-document")
        self.unique_identifiers = {"class": "mcore_ext.HFTokenizer", "path": os.path.abspath(path)}

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (its chat template renders conversations)."""
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(name: str):
    """``"byte"`` or the path of a Hugging Face tokenizer directory."""
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)
