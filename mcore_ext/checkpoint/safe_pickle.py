"""Reading a checkpoint never runs code from it: every pickle a load reads is restricted.

A distributed checkpoint holds two kinds of pickle besides its tensors (which torch reads with
``torch.load(weights_only=True)`` already):

- ``.metadata``: torch's ``FileSystemReader.read_metadata`` does ``pickle.load`` on it, and
  megatron's ``torch_dist`` loader, ``load_tensors_metadata`` and every DCP load go through it.
  ``MetadataUnpickler`` reads it instead, admitting only what a checkpoint's metadata holds:
  torch's checkpoint-metadata classes (``torch.distributed.checkpoint.metadata`` / ``planner``,
  ``filesystem._StorageInfo``), ``torch.Size``, dtypes, layouts and memory formats, plain
  containers, numbers and strings.
- the byte objects (megatron's common state with Megatron-LM's ``args``, sharded objects such as
  the RNG states, the optimizer's parameter groups and step of some layouts): torch's
  ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load(weights_only=False)``. Here they
  are read with ``weights_only=True``: torch's own allowlist plus the types megatron registers with
  ``torch.serialization.add_safe_globals`` (``megatron.core.safe_globals``: ``argparse.Namespace``,
  numpy's arrays and dtypes, its enums), registered here too where the release does not.

- a legacy ``common.pt``, which megatron's ``load_common_state_dict`` prefers whenever one is in
  the folder (its ``load_common``: ``torch.load`` with torch's defaults, plain pickle under
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``): read by ``load_file``, the byte objects' read
  (``_mcore_compat.guard_checkpoint_loads`` puts it in megatron's place).
- Megatron-LM's ``--ckpt-format torch`` files (``mp_rank_*/model_optim_rng.pt``, read by
  ``megatron.training.checkpointing`` with torch's defaults): the Megatron-LM entry gives that
  module ``TorchWithRestrictedLoad`` for ``torch``, so they are read by ``load_file`` too.

``weights_only=True`` is passed explicitly, which torch's environment does not override.
``install()`` (run when ``mcore_ext.checkpoint`` is imported, so by every entry point) puts the
first two in place. Anything else is refused, naming the file and the type, before any of the pickle runs
(the unpickler refuses the type before it would call it): ``PickleRefused`` inside torch's and
megatron's code, ``CheckpointUnsafeError`` where an entry point wraps its loads in ``refusals()``.

One explicit opt-in for a legacy checkpoint with other pickled types, that one path only:
``MCORE_EXT_TRUST_CHECKPOINT=DIR`` (a checkpoint directory, or a save directory and every
checkpoint below it) reads the pickles under DIR with plain ``pickle`` / ``weights_only=False``,
with a warning on stderr each time. Nothing falls back to it silently.
"""

import contextlib
import contextvars
import io
import os
import pickle
import re
import sys
import types

import torch

from mcore_ext.checkpoint.errors import CheckpointUnsafeError, PickleRefused, refusal_in

TRUST_ENV = "MCORE_EXT_TRUST_CHECKPOINT"

# torch's checkpoint-metadata modules: their classes (dataclasses and enums) are what
# ``Metadata`` is made of; no function of them is admitted.
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: by its name
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytearray"),
    ("collections", "OrderedDict"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

# The reader and file a DCP read is on, for the byte objects' messages and the opt-in.
_reading = contextvars.ContextVar("mcore_ext_checkpoint_reading", default=None)


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that admits only the globals a checkpoint's ``.metadata`` holds."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module in _METADATA_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:  # its own classes only
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise PickleRefused(_refusal(self.path, f"{module}.{name}"))


def unpickle_metadata(stream, path: str):
    """The ``Metadata`` pickled in ``stream`` (the file ``path``), restricted unless trusted."""
    if _trusted(path):
        return pickle.load(stream)
    try:
        return MetadataUnpickler(stream, path).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError) as err:
        raise PickleRefused(
            f"checkpoint metadata {path} is not a checkpoint's metadata ({type(err).__name__}: "
            f"{' '.join(str(err).split())})") from None


def load_object(value, path: str, map_location=None):
    """A byte object of a checkpoint (``torch.save`` d), read from ``value`` (a stream, or the
    file ``path`` itself): ``torch.load(weights_only=True)`` with megatron's safe globals, unless
    trusted. Said explicitly, which torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` does not
    override."""
    if _trusted(path):
        return torch.load(value, weights_only=False, map_location=map_location)
    try:
        return torch.load(value, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as err:
        # torch names the global it refused: "Unsupported global: GLOBAL posix.system was not ..."
        # (builtins without their module).
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = found.group(1) if found else f"object torch refuses ({str(err).splitlines()[0]})"
        what = what if not found or "." in what else f"builtins.{what}"
        raise PickleRefused(_refusal(path, what)) from None


def load_file(path, map_location="cpu"):
    """A pickle file of a checkpoint (megatron's legacy ``common.pt``, Megatron-LM's
    ``--ckpt-format torch`` ``model_optim_rng.pt``), read as ``load_object`` reads a byte object,
    onto the CPU as megatron reads them."""
    return load_object(os.fspath(path), os.fspath(path), map_location=map_location)


class TorchWithRestrictedLoad(types.ModuleType):
    """``torch`` for a module of megatron's that reads whole checkpoint files with ``torch.load``
    (``megatron.training.checkpointing``, Megatron-LM's ``--ckpt-format torch``): everything is
    torch's but ``load``, which is ``load_file``."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, map_location=None, **_):
        return load_file(f, map_location=map_location)


def _refusal(path: str, what: str) -> str:
    return (f"checkpoint file {path} holds a pickled {what}, which no checkpoint holds: refused, "
            f"nothing of it was run (a checkpoint can run code only through such a pickle; set "
            f"{TRUST_ENV}={_checkpoint_of(path)} to load a legacy checkpoint you trust)")


def _checkpoint_of(path: str) -> str:
    return os.path.dirname(path) or "."


def _trusted(path: str) -> bool:
    """Whether ``path`` lies under the directory ``MCORE_EXT_TRUST_CHECKPOINT`` names; says so."""
    trusted = os.environ.get(TRUST_ENV)
    if not trusted:
        return False
    root, real = os.path.realpath(trusted), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        return False
    print(f"warning: reading {path} with plain pickle ({TRUST_ENV}={trusted}): it can run any "
          "code it holds", file=sys.stderr, flush=True)
    return True


@contextlib.contextmanager
def refusals():
    """Re-raise a refusal found inside whatever the block raises as a ``CheckpointUnsafeError``
    alone (torch's ``CheckpointException`` is a BaseException holding every rank's traceback).
    A context manager, or a decorator of an entry point's load."""
    try:
        yield
    except BaseException as err:  # noqa: BLE001  (only re-raised differently when it is a refusal)
        found = refusal_in(err)
        if found is None or isinstance(err, CheckpointUnsafeError):
            raise
        raise CheckpointUnsafeError(str(found)) from None


def install() -> None:
    """Route torch's DCP reads of ``.metadata`` and of byte objects through this module, and
    register megatron's checkpoint types with torch's ``weights_only`` loader. Idempotent."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = filesystem.FileSystemReader
    if getattr(reader.read_metadata, "_mcore_ext_safe", False):
        return
    _register_megatron_safe_globals()

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = unpickle_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = filesystem.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    original_read_data = reader.read_data

    def read_data(self, plan, planner):
        token = _reading.set(self)
        try:
            return original_read_data(self, plan, planner)
        finally:
            _reading.reset(token)

    def load_bytes(self, read_item, value):
        current = _reading.get()
        path = "(a checkpoint)"
        if current is not None:
            info = current.storage_data.get(read_item.storage_index)
            path = os.path.join(str(current.path), info.relative_path if info else "")
        loaded = load_object(value, path)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    for function in (read_metadata, read_data, load_bytes):
        function._mcore_ext_safe = True
    reader.read_metadata = read_metadata
    reader.read_data = read_data
    DefaultLoadPlanner.load_bytes = load_bytes


def _register_megatron_safe_globals() -> None:
    """What megatron puts into byte objects, for ``weights_only``: megatron-core registers it at
    import from 0.19 (``megatron.core.safe_globals``); the same core list for earlier releases."""
    try:
        from megatron.core.safe_globals import register_safe_globals
    except ImportError:
        import argparse
        import pathlib
        import types

        import numpy

        core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 / 1
        torch.serialization.add_safe_globals([
            argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, numpy.ndarray,
            numpy.dtype, numpy.dtypes.UInt32DType, core.multiarray._reconstruct])
        return
    register_safe_globals()


def check_objects(directory: str) -> int:
    """Read every pickle of the checkpoint ``directory`` (its ``.metadata``, a legacy
    ``common.pt`` and every byte object) the restricted way, as a load would, and drop them: the number of objects read.
    ``PickleRefused`` on the first that holds another type (nothing of it runs)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(directory).read_metadata()
    count = 0
    legacy = os.path.join(directory, "common.pt")  # megatron reads it before the common state
    if os.path.isfile(legacy):
        load_file(legacy)
        count += 1
    for index, info in sorted(metadata.storage_data.items(),
                              key=lambda item: (item[1].relative_path, item[1].offset)):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = os.path.join(directory, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            load_object(io.BytesIO(f.read(info.length)), path)
        count += 1
    return count
