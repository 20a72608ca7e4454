"""Reading a checkpoint never runs code from it: every pickle a load reads is restricted.

A distributed checkpoint holds two kinds of pickle besides its tensors (which torch reads with
``torch.load(weights_only=True)`` already):

- ``.metadata``: torch's ``FileSystemReader.read_metadata`` does ``pickle.load`` on it, and
  megatron's ``torch_dist`` loader, ``load_tensors_metadata`` and every DCP load go through it.
  ``MetadataUnpickler`` reads it instead, admitting only what a checkpoint's metadata holds:
  torch's checkpoint-metadata classes (``torch.distributed.checkpoint.metadata`` / ``planner``,
  ``filesystem._StorageInfo``), ``torch.Size``, dtypes, layouts and memory formats, the path a
  DCP save names (``pathlib.PosixPath``), plain containers, numbers and strings.
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

Some of what those reads return is itself a pickle, decoded later by whoever receives it: a
Transformer Engine module's ``_extra_state`` (its FP8 scaling state) is a ``uint8`` tensor of
``pickle.dumps(state)`` that TE's ``set_extra_state`` decodes with plain ``pickle.loads`` (an
``io.BytesIO`` of ``torch.save`` in older TE releases, decoded with ``torch.load``). Every such
value is decoded here first, by ``ExtraStateUnpickler`` (only what TE's extra state holds: tensors,
dtypes, containers, TE's recipe classes), in the same read that returns it (``load_object``,
``load_file``: the key names it) and again by every model mcore_ext builds before any of its
modules sees its state dict (``guard_extra_states``): refused, naming the key and the type, before
anything of it runs. ``check_objects`` (``inspect --verify``) reports it as a load does.

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
import weakref

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
    # StorageMeta.checkpoint_id: the path torch's FileSystemWriter saved to (DCP's own saves,
    # Megatron-LM's torch_dcp)
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
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


def load_object(value, path: str, map_location=None, key: str | None = None):
    """A byte object of a checkpoint (``torch.save`` d), read from ``value`` (a stream, or the
    file ``path`` itself): ``torch.load(weights_only=True)`` with megatron's safe globals, unless
    trusted. Said explicitly, which torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` does not
    override. ``key``: the object's name in the checkpoint (a DCP key); every Transformer Engine
    extra state in what it holds (``check_extra_states``) is decoded restricted before it is
    returned."""
    if _trusted(path):
        loaded = torch.load(value, weights_only=False, map_location=map_location)
        _trust_extra_states(loaded, key or "")
        return loaded
    try:
        loaded = torch.load(value, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as err:
        # torch names the global it refused: "Unsupported global: GLOBAL posix.system was not ..."
        # (builtins without their module).
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = found.group(1) if found else f"object torch refuses ({str(err).splitlines()[0]})"
        what = what if not found or "." in what else f"builtins.{what}"
        raise PickleRefused(_refusal(path, what, key)) from None
    check_extra_states(loaded, path, key or "")
    return loaded


def load_file(path, map_location="cpu"):
    """A pickle file of a checkpoint (megatron's legacy ``common.pt``, Megatron-LM's
    ``--ckpt-format torch`` ``model_optim_rng.pt``), read as ``load_object`` reads a byte object,
    onto the CPU as megatron reads them. With a signing key, only from a checkpoint verified and
    unchanged from its verification until after the read (``manifest.check_unchanged``)."""
    from mcore_ext.checkpoint import manifest

    path = os.fspath(path)
    loaded = load_object(path, path, map_location=map_location)
    folder = os.path.dirname(os.path.abspath(path))
    manifest.check_unchanged(folder, os.path.dirname(folder))  # iter_N/ or iter_N/mp_rank_*/
    return loaded


# ------------------------------------------------------------------------ nested pickles
# A Transformer Engine module's extra state: ``<module>._extra_state`` in a state dict,
# ``..._extra_state/shard_<offsets>`` as a DCP key of megatron's sharded objects, and
# ``_extra_state<i>`` for the i-th GEMM of megatron's TEGroupedLinear.
_EXTRA_STATE = re.compile(r"(?:^|\.)_extra_state\d*(?:/|$)")
# What TE's get_extra_state pickles besides containers and numbers: CPU tensors (rebuilt from a
# storage that is itself a torch.save, which torch's _load_from_bytes reads; megatron-core
# replaces that by its weights_only safe_load_from_bytes, under whose name it is then pickled),
# dtypes, and its FP8 recipe (a dataclass of TE's recipe module with enums and dataclasses of that
# module; megatron's own subclass).
_EXTRA_STATE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}
_STORAGE_READERS = {
    ("torch.storage", "_load_from_bytes"),
    ("megatron.core.safe_globals", "safe_load_from_bytes"),
}
_RECIPE_MODULE = "transformer_engine.common.recipe"
_RECIPE_CLASSES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling")}


class _AbsentClass:
    """What a TE recipe class decodes to in a process without Transformer Engine (no module of
    this process can decode the state then): a placeholder that takes any arguments and state."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class ExtraStateUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that admits only what a Transformer Engine extra state holds; a
    nested ``torch.save`` (a tensor's storage) is read by ``load_object``."""

    def __init__(self, file, path: str, key: str):
        super().__init__(file)
        self.path, self.key = path, key

    def find_class(self, module: str, name: str):
        if (module, name) in _EXTRA_STATE_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _STORAGE_READERS:
            return self._read_storage
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        if module == _RECIPE_MODULE or (module, name) in _RECIPE_CLASSES:
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                return _AbsentClass  # no Transformer Engine here: nothing can use it
            if isinstance(found, type) and found.__module__ == module:  # its own classes only
                return found
        raise PickleRefused(_refusal(self.path, f"{module}.{name}", self.key))

    def _read_storage(self, data):
        return load_object(io.BytesIO(data), self.path, key=self.key)


def decode_extra_state(value, path: str, key: str):
    """What a Transformer Engine module decodes from its extra state ``value`` (None when it
    decodes nothing), read restricted: a tensor's bytes as a pickle (TE's ``pickle.loads``), an
    ``io.BytesIO`` as a ``torch.save`` (older TE's ``torch.load``). ``PickleRefused`` naming
    ``key`` and the type when it holds anything else, or is no pickle at all."""
    if isinstance(value, io.BytesIO):
        position = value.tell()
        value.seek(0)
        try:
            return load_object(value, path, key=key)
        finally:
            value.seek(position)
    if not torch.is_tensor(value) or value.numel() == 0:
        return None  # TE: "no FP8" (an empty tensor), or nothing it decodes
    # TE decodes any tensor: its bytes (numpy's, in C order) as a pickle.
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    try:
        return ExtraStateUnpickler(io.BytesIO(data), path, key).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError, IndexError, KeyError, RuntimeError) as err:
        where = f"checkpoint file {path}: " if path else "the state dict loaded into the model: "
        raise PickleRefused(
            f"{where}the Transformer Engine extra state {key} is not one "
            f"({type(err).__name__}: {' '.join(str(err).split())}): refused, nothing of it "
            "was run") from None


def check_extra_states(value, path: str, key: str = "") -> int:
    """Decode every Transformer Engine extra state in ``value`` (the object ``key`` of the
    checkpoint file ``path``: itself when ``key`` names an extra state, and every entry of its
    dicts and lists whose key does) restricted, and drop what they hold: ``PickleRefused`` on
    the first that holds another type. The number of extra states decoded."""
    if isinstance(value, dict):
        return sum(check_extra_states(item, path, f"{key}.{name}" if key else str(name))
                   for name, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(check_extra_states(item, path, key) for item in value)
    if _EXTRA_STATE.search(key) and (torch.is_tensor(value) or isinstance(value, io.BytesIO)):
        decode_extra_state(value, path, key)
        return 1
    return 0


def _trust_extra_states(value, key: str) -> None:
    """Remember the extra states of a trusted checkpoint's object (``TRUST_ENV``), which
    ``guard_extra_states`` then hands to the model undecoded (the opt-in covers them too)."""
    if isinstance(value, dict):
        for name, item in value.items():
            _trust_extra_states(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _trust_extra_states(item, key)
    elif _EXTRA_STATE.search(key) and (torch.is_tensor(value) or isinstance(value, io.BytesIO)):
        _trusted_values[id(value)] = value


# id -> value (by identity: a tensor's == compares elements)
_trusted_values = weakref.WeakValueDictionary()


def guard_extra_states(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.load_state_dict`` decode every extra state of the state dict restricted
    (``check_extra_states``) before any of its modules sees it (a pre-hook on the root runs
    before its submodules load), whatever read the state dict: a tensor stored as a tensor
    (Megatron-LM's ``torch_dcp``), a state built in memory. Returns ``model``."""

    def check(module, state_dict, prefix, *_):
        for name, value in state_dict.items():
            if (name.startswith(prefix) and _EXTRA_STATE.search(name)
                    and _trusted_values.get(id(value)) is not value):
                check_extra_states(value, None, name)

    model.register_load_state_dict_pre_hook(check)
    return model


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


def _refusal(path: str | None, what: str, key: str | None = None) -> str:
    """The refusal of the pickled type ``what`` in the file ``path`` (None: a state dict handed
    to a model, ``guard_extra_states``), in its object ``key``."""
    where = ""
    if key and _EXTRA_STATE.search(key):
        where = f" in {key} (a Transformer Engine extra state, which its module unpickles)"
    elif key:
        where = f" in {key}"
    if path is None:
        return (f"the state dict loaded into the model holds a pickled {what}{where}, which no "
                "checkpoint holds: refused, nothing of it was run")
    return (f"checkpoint file {path} holds a pickled {what}{where}, which no checkpoint holds: "
            f"refused, nothing of it was run (a checkpoint can run code only through such a "
            f"pickle; set {TRUST_ENV}={_checkpoint_of(path)} to load a legacy checkpoint you "
            "trust)")


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

    from mcore_ext.checkpoint import manifest

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = unpickle_metadata(stream, str(path))
        manifest.check_unchanged(str(self.path))  # with a key: read as verified
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = filesystem.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    original_read_data = reader.read_data

    def read_data(self, plan, planner):
        token = _reading.set(self)
        try:
            done = original_read_data(self, plan, planner)
        finally:
            _reading.reset(token)
        manifest.check_unchanged(str(self.path))  # with a key: what was read is what verified
        return done

    def load_bytes(self, read_item, value):
        current = _reading.get()
        path = "(a checkpoint)"
        if current is not None:
            info = current.storage_data.get(read_item.storage_index)
            path = os.path.join(str(current.path), info.relative_path if info else "")
        loaded = load_object(value, path, key=read_item.dest_index.fqn)
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
    ``common.pt``, every byte object, and the Transformer Engine extra states they hold) the
    restricted way, as a load would, and drop them: the number of objects read.
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
            load_object(io.BytesIO(f.read(info.length)), path, key=index.fqn)
        count += 1
    return count
