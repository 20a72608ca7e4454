"""Streaming safetensors: read one tensor at a time, write shards without buffering them.

Reading: ``SafetensorsReader`` parses every file's header up front (so a missing, truncated or
corrupt file is reported before anything is converted or written) and then reads one tensor at a
time through ``safetensors.safe_open``.

Writing: the names, shapes and dtypes of every tensor are known before any data exists (they follow
from the config), so ``ShardedSafetensorsWriter`` plans the shards and each file's header first and
then streams the tensors into the files in plan order: nothing but the tensor being written is
held. Files go to a staging directory beside the target (``.saving.<name>``) that takes the
target's place only when every tensor is written, by the same renames as a checkpoint
(``mcore_ext.checkpoint.directory.replace_dir``): a kill at any moment leaves the earlier export
or the new one, never a config without its weights.
"""

import json
import os
import shutil
import struct

import torch
from safetensors import safe_open

from mcore_ext.checkpoint.directory import partial_dir, recover_dir, replace_dir
from mcore_ext.userfiles import read_json, too_deep

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """Missing, truncated or malformed safetensors files."""


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise SafetensorsError(f"unsupported safetensors dtype {name!r}") from None


class SafetensorsReader:
    """All tensors of a Hugging Face model directory: ``names``, ``info(name)``, ``get(name)``."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_NAME)
        single = os.path.join(directory, SINGLE_NAME)
        if os.path.exists(index):
            weight_map = read_json(index, SafetensorsError).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise SafetensorsError(f"{index}: not a safetensors index (no 'weight_map' of "
                                       "tensor names to file names)")
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise SafetensorsError(
                f"{directory}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors weights are read)"
            )
        self._entries = {}  # name -> (file, dtype, shape)
        for file in files:
            for name, (dtype, shape) in _read_header(os.path.join(directory, file)).items():
                self._entries[name] = (file, dtype, shape)
        if weight_map is not None:
            for name, file in weight_map.items():
                if self._entries.get(name, (file,))[0] != file:
                    raise SafetensorsError(f"{index}: {name} is listed in {file} but is not in it")
                if name not in self._entries:
                    raise SafetensorsError(f"{index}: {name} is listed in {file} but is not in it")
        self._handles = {}

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[torch.dtype, tuple]:
        _, dtype, shape = self._entries[name]
        return dtype, shape

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str, index) -> torch.Tensor:
        """``tensor[index]`` read without the rest of the tensor (e.g. one expert's rows of a
        stacked [E, ...] tensor): only the pages of the slice are touched."""
        return self._handle(name).get_slice(name)[index]

    def _handle(self, name: str):
        file = self._entries[name][0]
        handle = self._handles.get(file)
        if handle is None:
            # One open file at a time: a shard's pages are released when the next one opens.
            self._handles.clear()
            handle = self._handles[file] = safe_open(
                os.path.join(self.directory, file), framework="pt"
            )
        return handle

    def close(self):
        self._handles.clear()


def _read_header(path: str) -> dict:
    """{name: (dtype, shape)} of one file, after checking the file holds all its data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                raise SafetensorsError(
                    f"{path}: truncated (header of {length} bytes, file of {size})"
                )
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: missing (listed in the index)") from None
    except (OSError, ValueError, RecursionError) as err:
        if isinstance(err, SafetensorsError):
            raise
        what = too_deep() if isinstance(err, RecursionError) else err
        raise SafetensorsError(f"{path}: not a safetensors file ({what})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    entries, end = {}, 0
    for name, meta in header.items():
        try:
            dtype = dtype_from_name(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            begin, stop = (int(o) for o in meta["data_offsets"])
        except (TypeError, KeyError, ValueError) as err:
            if isinstance(err, SafetensorsError):
                raise
            raise SafetensorsError(f"{path}: {name}'s header entry is not a tensor's "
                                   f"(dtype, shape, data_offsets): {meta!r:.200}") from None
        numel = 1
        for d in shape:
            numel *= d
        if stop - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise SafetensorsError(f"{path}: {name} has {stop - begin} bytes for shape {shape}")
        entries[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + length + end > size:
        raise SafetensorsError(
            f"{path}: truncated ({size} bytes, the header describes {8 + length + end})"
        )
    return entries


def _nbytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


class ShardedSafetensorsWriter:
    """Writes ``plan`` [(name, dtype, shape)] as size-sharded safetensors plus the index JSON.

    ``write(name, tensor)`` must be called in plan order. ``close()`` puts the files (and
    ``extra_files``, {file name: text or bytes}) in place of ``directory``: an earlier export there
    (config.json, model.safetensors, the index and the shards it lists) is replaced, every other
    file in it is kept. ``abort()`` (or an exception inside ``with``) removes everything written.
    Whether ``directory`` may hold files at all is the caller's decision (``hf export``
    refuses a folder with files unless ``--overwrite``). A ``directory`` that is a symbolic link
    is written where it points (the folder there is replaced; the link stays).
    """

    def __init__(self, directory: str, plan: list, max_shard_bytes: int = 2 * 1024**3,
                 extra_files: dict | None = None):
        # The link's target: renaming the link itself would put a folder in its place.
        self.directory = os.path.realpath(directory)
        self.plan = list(plan)
        self.extra_files = dict(extra_files or {})
        os.makedirs(os.path.dirname(os.path.abspath(self.directory)), exist_ok=True)
        recover_dir(self.directory)  # what an export killed while replacing it left
        self.staging = partial_dir(self.directory)
        os.makedirs(self.staging)
        self.shards = _plan_shards(self.plan, max_shard_bytes)
        self._next = 0  # index into plan
        self._file = None
        self._shard = -1
        self._total = sum(_nbytes(dtype, shape) for _, dtype, shape in self.plan)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape = self.plan[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise SafetensorsError(
                f"writer expected {expected} {dtype} {tuple(shape)}, got {name} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        if self._rows_written:
            raise SafetensorsError(f"{name}: write_rows started it, write() cannot finish it")
        self._write_bytes(tensor)
        self._next += 1

    _rows_written = 0  # rows of plan[_next] written so far by write_rows

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        """The next ``rows.shape[0]`` rows (dim 0) of tensor ``name``: a large tensor (the stacked
        experts) is written in pieces, in order, without ever being whole in memory."""
        expected, dtype, shape = self.plan[self._next]
        if (name != expected or rows.dtype != dtype or tuple(rows.shape[1:]) != tuple(shape[1:])
                or self._rows_written + rows.shape[0] > shape[0]):
            raise SafetensorsError(
                f"writer expected rows of {expected} {dtype} {tuple(shape)} (from row "
                f"{self._rows_written}), got {name} {rows.dtype} {tuple(rows.shape)}"
            )
        self._write_bytes(rows)
        self._rows_written += rows.shape[0]
        if self._rows_written == shape[0]:
            self._rows_written = 0
            self._next += 1

    def _write_bytes(self, tensor: torch.Tensor) -> None:
        shard = self._shard_of(self._next)
        if shard != self._shard:
            self._open_shard(shard)
        data = tensor.detach().contiguous().cpu()
        data.view(torch.uint8).numpy().tofile(self._file)  # no copy of the tensor's bytes

    def _shard_of(self, index: int) -> int:
        for shard, (first, last) in enumerate(self.shards):
            if first <= index < last:
                return shard
        raise IndexError(index)

    def _file_name(self, shard: int) -> str:
        if len(self.shards) == 1:
            return SINGLE_NAME
        return f"model-{shard + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def _open_shard(self, shard: int) -> None:
        if self._file is not None:
            self._file.close()
        first, last = self.shards[shard]
        header, offset = {}, 0
        for name, dtype, shape in self.plan[first:last]:
            nbytes = _nbytes(dtype, shape)
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file = open(os.path.join(self.staging, self._file_name(shard)), "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._shard = shard

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self.plan):
            missing = [name for name, _, _ in self.plan[self._next:]][:5]
            self.abort()
            raise SafetensorsError(f"export incomplete: {missing} ... not written")
        try:
            if len(self.shards) > 1:
                weight_map = {
                    name: self._file_name(shard)
                    for shard, (first, last) in enumerate(self.shards)
                    for name, _, _ in self.plan[first:last]
                }
                with open(os.path.join(self.staging, INDEX_NAME), "w") as f:
                    json.dump({"metadata": {"total_size": self._total}, "weight_map": weight_map},
                              f, indent=2)
            for name, content in self.extra_files.items():
                with open(os.path.join(self.staging, name),
                          "wb" if isinstance(content, bytes) else "w") as f:
                    f.write(content)
            if os.path.isdir(self.directory):
                self._keep_other_files()
        except BaseException:
            self.abort()
            raise
        replace_dir(self.staging, self.directory)

    def _keep_other_files(self) -> None:
        """Link (or copy) into the staging directory what ``directory`` holds besides an earlier
        export, so that it stays when the staging directory takes the folder's place."""
        export = {SINGLE_NAME, INDEX_NAME, *self.extra_files}
        try:
            with open(os.path.join(self.directory, INDEX_NAME)) as f:
                export.update(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no (readable) index: no shards listed
        for name in os.listdir(self.directory):
            source, target = os.path.join(self.directory, name), os.path.join(self.staging, name)
            if name in export or os.path.lexists(target):
                continue
            if os.path.isdir(source) and not os.path.islink(source):
                shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(source, target)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.staging, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    """A hard link (no bytes copied, nothing lost if either name goes), else a copy."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _plan_shards(plan: list, max_shard_bytes: int) -> list[tuple[int, int]]:
    """[first, last) plan indices per shard: in order, each under max_shard_bytes if it can be."""
    shards, first, size = [], 0, 0
    for i, (_, dtype, shape) in enumerate(plan):
        nbytes = _nbytes(dtype, shape)
        if i > first and size + nbytes > max_shard_bytes:
            shards.append((first, i))
            first, size = i, 0
        size += nbytes
    shards.append((first, len(plan)))
    return shards
