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


def auto_tokenizer_class(path: str):
    """transformers' ``AutoTokenizer``, for the tokenizer directory ``path``; ImportError naming
    what to install when transformers (an optional dependency) cannot be imported."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:  # not installed, or installed without what it needs
        raise ImportError(
            f"tokenizer {path!r} is a Hugging Face tokenizer directory, which needs the "
            f"transformers package (pip install transformers), and it cannot be imported here "
            f"({type(err).__name__}: {err}); or use the built-in 'byte' tokenizer"
        ) from None
    return AutoTokenizer


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (needs the optional ``transformers``)."""

    def __init__(self, path: str):
        AutoTokenizer = auto_tokenizer_class(path)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ImportError):
            raise
        except Exception as err:  # a broken file fails in transformers in many ways
            raise ValueError(_broken_file(path) or f"tokenizer {path!r} cannot be loaded "
                             f"({type(err).__name__}: {err})") from None
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


# The JSON files of a Hugging Face tokenizer directory that transformers parses.
TOKENIZER_JSON = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "config.json")


def _broken_file(path: str) -> str | None:
    """What is wrong with the first of the tokenizer's JSON files that is not a readable JSON
    object (not UTF-8, invalid, nested too deeply, another top-level type), naming the file:
    transformers' own error names neither file nor line (AttributeError: 'list' object has no
    attribute 'get', RecursionError, UnicodeDecodeError). None when they all read."""
    from mcore_ext.userfiles import UserFileError, read_json

    for name in TOKENIZER_JSON:
        if os.path.isfile(os.path.join(path, name)):
            try:
                read_json(os.path.join(path, name))
            except UserFileError as err:
                return f"tokenizer {path!r}: {err}"
    return None


def load_tokenizer(name: str):
    """``"byte"`` or the path of a Hugging Face tokenizer directory. With a checkpoint signing
    key, a directory inside a signed checkpoint (an ``hf import``'s ``tokenizer/``) loads from
    its files as signed there: read once, each against its signed SHA-256, into a private copy
    that transformers reads (ValueError naming a file deleted, changed or added). The copy stays
    until the process exits: it is the tokenizer's ``name_or_path``, where a vision-language
    model's processor (its ``processor_config.json``, signed with the rest) is loaded from
    when chat data has images (``chat_images.processor_for``)."""
    if name == "byte":
        return ByteTokenizer()
    from mcore_ext.checkpoint import manifest

    from mcore_ext.checkpoint.errors import CheckpointCorruptError

    try:
        signed = manifest.read_signed_folder(name, lambda names: names) if os.path.isdir(name) \
            else None
    except CheckpointCorruptError as err:  # a tokenizer that does not load: its callers' error
        raise ValueError(f"tokenizer {name!r}: {err}") from None
    if signed is None:
        return HFTokenizer(name)
    import atexit
    import shutil
    import tempfile

    copy = tempfile.mkdtemp(prefix="mcore_ext_tokenizer-")
    try:
        for file, data in signed.items():
            with open(os.path.join(copy, file), "wb") as f:
                f.write(data)
        tokenizer = HFTokenizer(copy)
    except (OSError, ValueError) as err:  # named by the folder given, not the private copy
        shutil.rmtree(copy, ignore_errors=True)
        raise type(err)(str(err).replace(copy, name)) from None
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    tokenizer.unique_identifiers["path"] = os.path.abspath(name)  # the folder named, not the copy
    return tokenizer
