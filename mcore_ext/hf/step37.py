"""A Step-3.7-Flash folder (``Step3p7ForConditionalGeneration``, model_type ``step3p7``): its text
model converted like Step-3.5's, everything else kept as it is.

The text decoder of Step-3.7 is Step-3.5's (``text_config``, model_type ``step3p5``). Its tensors
sit under one of two prefixes:

- ``model.`` (``model.embed_tokens`` / ``layers`` / ``norm``) and ``lm_head``: the hub's layout,
  and what transformers' ``save_pretrained`` writes (it reverts its conversion mapping), beside
  ``vision_model.*`` and ``vit_large_projector.*``;
- ``model.language_model.``: transformers' own module names (``save_original_format=False``),
  beside ``model.vision_model.*`` and ``model.multi_modal_projector.*``.

``TextView`` shows the text tensors under Step-3.5's names (``model.*``), so the name table and
the checks of ``convert`` read them unchanged. The project trains the text model only: every
other tensor (vision tower, projector, anything else) is "kept". ``describe_source`` records, at
import, the folder, its text prefix and a fingerprint of each kept tensor (dtype, shape, sha256
of its bytes) and of each other file (tokenizer, processor, generation config: sha256); export
refuses in one line a folder that is gone or whose tensors changed shape (``check_source``, from
the headers), then copies them bit for bit beside the trained text weights, with the folder's own
config.json, checking each tensor's and file's bytes against its fingerprint as it reads them to
write them (``KeptTensors``): what is checked is what is written, whatever changes in between.
"""

import hashlib
import json
import os

import torch

from mcore_ext.hf.config import HFConfigError
from mcore_ext.hf.config.step3p7 import WRAPPER_MODEL_TYPE
from mcore_ext.hf.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsReader

SOURCE_NAME = "hf_source.json"  # beside hf_config.json in an imported checkpoint
NATIVE_PREFIX = "model.language_model."
HUB_PREFIX = "model."
_TEXT_PARTS = ("embed_tokens.", "layers.", "norm.")
LM_HEAD = "lm_head.weight"
# Files of the folder that are not carried over as they are: the export writes its own.
_WRITTEN = {"config.json", SINGLE_NAME, INDEX_NAME}


def is_step37(raw: dict) -> bool:
    return raw.get("model_type") == WRAPPER_MODEL_TYPE


def text_prefix(names) -> str:
    """Where the text model's tensors are: transformers' module names or the hub's."""
    return NATIVE_PREFIX if any(n.startswith(NATIVE_PREFIX) for n in names) else HUB_PREFIX


def is_text(name: str, prefix: str) -> bool:
    return name == LM_HEAD or any(name.startswith(prefix + p) for p in _TEXT_PARTS)


class TextView:
    """A ``SafetensorsReader`` of a Step-3.7 folder showing only its text model, under Step-3.5's
    names (``model.layers.L...``, ``lm_head.weight``)."""

    def __init__(self, reader: SafetensorsReader):
        self.reader = reader
        self.directory = reader.directory
        self.prefix = text_prefix(reader.names)
        self._stored = {self.to_step35(n): n for n in reader.names if is_text(n, self.prefix)}
        self.kept = [n for n in reader.names if not is_text(n, self.prefix)]

    def to_step35(self, name: str) -> str:
        return name if name == LM_HEAD else HUB_PREFIX + name[len(self.prefix):]

    @property
    def names(self) -> list[str]:
        return list(self._stored)

    def info(self, name):
        return self.reader.info(self._stored[name])

    def get(self, name):
        return self.reader.get(self._stored[name])

    def get_slice(self, name, index):
        return self.reader.get_slice(self._stored[name], index)

    def close(self):
        self.reader.close()


def stored_name(name: str, prefix: str) -> str:
    """A Step-3.5 text tensor's name in a Step-3.7 folder whose text is under ``prefix``."""
    return name if name == LM_HEAD else prefix + name[len(HUB_PREFIX):]


def _tensor_digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _carried_files(hf_dir: str) -> list[str]:
    """The folder's files that travel to the export as they are (not its weights or config)."""
    return sorted(n for n in os.listdir(hf_dir) if os.path.isfile(os.path.join(hf_dir, n))
                  and n not in _WRITTEN and not n.endswith(".safetensors"))


def describe_source(hf_dir: str, view: "TextView | None" = None) -> dict:
    """What export needs to rebuild the folder around the text weights: its path, text prefix,
    config.json, and the fingerprints of the kept tensors and other files. ``view``: the
    folder's ``TextView`` already open (an import's ``HFFolder``: its headers are not read
    again); closed here either way (a later read reopens its shard)."""
    view = view if view is not None else TextView(SafetensorsReader(hf_dir))
    try:
        tensors = {}
        for name in view.kept:
            dtype, shape = view.reader.info(name)
            tensors[name] = {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                             "sha256": _tensor_digest(view.reader.get(name))}
    finally:
        view.close()
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = f.read()
    return {"path": os.path.abspath(hf_dir), "text_prefix": view.prefix, "config": config,
            "tensors": tensors,
            "files": {n: _file_digest(os.path.join(hf_dir, n)) for n in _carried_files(hf_dir)}}


def _where(source: dict) -> str:
    return f"the Step-3.7 folder this checkpoint was imported from ({source['path']})"


def check_source(source: dict, written=()) -> str | None:
    """Why the folder an import came from cannot give its kept tensors and files back (gone, a
    tensor or file missing, a tensor of another dtype or shape); None when it can. Reads only
    headers: the bytes are checked as the export reads them to write them (``KeptTensors``), so
    what is checked is what is written. ``written``: the tensors the export writes from the
    model instead (a vision-language model's tower and projector), not read from the folder."""
    path = source["path"]
    written = set(written)
    where = _where(source)
    if not os.path.isdir(path):
        return f"{where} is gone: its vision tower and other untrained tensors are copied from it"
    try:
        reader = SafetensorsReader(path)
    except (OSError, ValueError) as err:
        return f"{where} no longer reads: {err}"
    try:
        for name, fingerprint in source["tensors"].items():
            if name in written:
                continue
            if name not in reader.names:
                return f"{where} has changed: {name} is missing"
            dtype, shape = reader.info(name)
            if (str(dtype).removeprefix("torch."), list(shape)) != (fingerprint["dtype"],
                                                                     fingerprint["shape"]):
                return f"{where} has changed: {name} is not the tensor it was at import"
    finally:
        reader.close()
    for name in source["files"]:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{where} has changed: {name} is gone"
    return None


class KeptTensors:
    """The kept tensors of a checked source folder, for ``save_pretrained``: their plan entries,
    written after the text model's, and their bytes as stored, each checked against its
    fingerprint as it is read for writing (HFConfigError naming it when it differs: the folder
    changed since the import, or since ``check_source``).

    ``written``: tensors of the folder that the model writes instead (a vision-language
    model's tower and projector, ``vision_layout.hf_names``): left out of ``plan``, their
    shapes in ``model_shapes`` (the folder's, which the model's must be) and the folder's names
    in ``names`` (their spelling)."""

    def __init__(self, source: dict, written=()):
        self.source = source
        self.prefix = source["text_prefix"]
        self.names = list(source["tensors"])
        written = [n for n in written if n in source["tensors"]]
        self.model_shapes = {n: tuple(source["tensors"][n]["shape"]) for n in written}
        self.plan = [(name, getattr(torch, f["dtype"]), tuple(f["shape"]))
                     for name, f in source["tensors"].items() if name not in self.model_shapes]
        self._reader = None

    def get(self, name: str) -> torch.Tensor:
        if self._reader is None:
            self._reader = SafetensorsReader(self.source["path"])
        tensor = self._reader.get(name)
        fingerprint = self.source["tensors"][name]
        if (str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) != (
                fingerprint["dtype"], fingerprint["shape"]) or \
                _tensor_digest(tensor) != fingerprint["sha256"]:
            raise HFConfigError(f"{_where(self.source)} has changed: {name} is not the tensor it "
                                "was at import")
        return tensor

    def files(self) -> dict:
        """{name: bytes} of the folder's other files, its config.json among them, each checked
        against its fingerprint as read."""
        out = {"config.json": self.source["config"]}
        for name, digest in self.source["files"].items():
            try:
                with open(os.path.join(self.source["path"], name), "rb") as f:
                    data = f.read()
            except OSError:
                raise HFConfigError(f"{_where(self.source)} has changed: {name} is gone") from None
            if hashlib.sha256(data).hexdigest() != digest:
                raise HFConfigError(f"{_where(self.source)} has changed: {name} is not the file "
                                    "it was at import")
            out[name] = data
        return out

    def close(self):
        if self._reader is not None:
            self._reader.close()


def write_source(source: dict) -> str:
    return json.dumps(source, indent=1)
