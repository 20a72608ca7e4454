"""Tokenized conversations on disk, memory-mapped, built once for every node of a filesystem.

A store is one directory, ``<cache_dir>/chat-<file stem>-<key>/``:

- ``tokens.bin`` / ``tokens.idx``: megatron's ``IndexedDataset``, one sequence (and one
  document) per kept conversation, its token ids (uint16 below 65,500 ids, else int32:
  ``DType.optimal_dtype``, as megatron's ``preprocess_data.py``);
- ``loss.bin`` / ``loss.idx``: an ``IndexedDataset`` of uint8, the same sequences' loss flags
  (1: the token is a target that carries loss);
- ``side.bin`` / ``side.idx`` (only where some conversation has one): an ``IndexedDataset`` of
  uint8, each conversation's side record as UTF-8 JSON (empty for none): what a conversation
  carries besides its tokens (e.g. the images a vision-language conversation refers to);
- ``loss_counts.npy``: int32, each conversation's tokens that carry loss after the first
  (what a document of it trains on), so packing and its loss share read no token;
- ``line_numbers.npy``: int64, each conversation's line in the file (FILE:LINE in errors found
  when a row is read);
- ``meta.json``: the format, the source file (path, size, mtime, the SHA-256 of its bytes the
  writer computed while reading it), the settings, the file's counts (lines, truncated,
  dropped, conversations, tokens, loss tokens), how it was built (host, workers, seconds).

Opening a store reads ``meta.json`` and maps the ``.idx`` / ``.bin`` files (megatron's
``IndexedDataset``, ``mmap``): no token is read until a row asks for it, so a rank's resident
memory for the data does not grow with the number of conversations.

Built once: the writer holds a POSIX lock (``fcntl.lockf``) on ``<store>.lock`` beside it,
which NFS, GPFS and Lustre (mounted with ``flock``) share between nodes; every other process
that wants the same store waits for the lock, then finds the store and reads it. The writer
builds into ``<store>.<host>-<pid>.tmp/`` and renames the directory into place when every file
is written and synced: a store directory exists whole or not at all, so a writer killed halfway
leaves only its temporary directory, which no reader takes for a store; the kernel releases a
dead writer's lock, and the next writer removes such leftovers of the same key. Where the
filesystem refuses locks, every node's first rank builds (said once), and the renames still
leave one whole store.

The key (``store_name``) hashes the settings and the file: a file up to 64 MiB by its bytes (a
copied or touched file with the same bytes is the same store); a larger one by its size, mtime
and 64 samples of 64 KiB spread over it, so no rank reads a large file whole at a start.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from typing import Callable, Optional

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

STORE_FORMAT = "mcore_ext chat store 2"
FULL_HASH_BYTES = 64 << 20
SAMPLES, SAMPLE_BYTES = 64, 64 << 10
WAIT_REPORT_S = 60.0
_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_warned_unlocked: set = set()


def file_fingerprint(path: str) -> str:
    """What identifies the file's content in a store's key (see the module)."""
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if stat.st_size <= FULL_HASH_BYTES:
            digest.update(b"whole\0")
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f"sampled {stat.st_size} {stat.st_mtime_ns}\0".encode())
            for k in range(SAMPLES):
                f.seek((stat.st_size - SAMPLE_BYTES) * k // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def store_name(path: str, key: str) -> str:
    """``chat-<stem>-<key[:16]>``: the file's name (so a user sees whose cache it is), its key."""
    stem = os.path.basename(path)
    for suffix in (".jsonl", ".json"):
        stem = stem[:-len(suffix)] if stem.endswith(suffix) else stem
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:40] or "data"
    return f"chat-{stem}-{key[:16]}"


class ChatStore:
    """A built store, memory-mapped (``open_store``)."""

    def __init__(self, directory: str, meta: dict):
        self.directory, self.meta = directory, meta
        self.tokens = IndexedDataset(os.path.join(directory, "tokens"))
        self.loss = IndexedDataset(os.path.join(directory, "loss"))
        self.side = IndexedDataset(os.path.join(directory, "side")) if meta["side"] else None
        self.loss_counts = numpy.load(os.path.join(directory, "loss_counts.npy"), mmap_mode="r")
        self.line_numbers = numpy.load(os.path.join(directory, "line_numbers.npy"),
                                       mmap_mode="r")
        if not len(self.tokens) == len(self.loss) == len(self.loss_counts) == len(
                self.line_numbers) == meta["conversations"] or (
                self.side is not None and len(self.side) != len(self.tokens)):
            raise ValueError(f"{directory}: its parts disagree on the number of conversations")

    @property
    def name(self) -> str:
        return os.path.basename(self.directory)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> numpy.ndarray:
        """[n] int32: each conversation's tokens (the index, memory-mapped)."""
        return self.tokens.sequence_lengths

    def ids(self, i: int) -> numpy.ndarray:
        return self.tokens.get(int(i))

    def loss_flags(self, i: int) -> numpy.ndarray:
        return self.loss.get(int(i))

    def holding(self, token: int, block: int = 1 << 24) -> numpy.ndarray:
        """The conversations whose ids hold ``token``: one pass over ``tokens.bin``, memory-mapped,
        ``block`` tokens at a time (the memory it takes does not grow with the store)."""
        index = self.tokens.index
        flat = numpy.memmap(os.path.join(self.directory, "tokens.bin"), dtype=index.dtype,
                            mode="r")
        starts = index.sequence_pointers // numpy.dtype(index.dtype).itemsize
        found = []
        for at in range(0, len(flat), block):
            hits = numpy.flatnonzero(flat[at:at + block] == token) + at
            if len(hits):
                found.append(numpy.unique(numpy.searchsorted(starts, hits, side="right") - 1))
        return numpy.unique(numpy.concatenate(found)) if found else numpy.zeros(0, numpy.int64)

    def side_record(self, i: int):
        """Conversation i's side record (a JSON value), None if it has none."""
        if self.side is None:
            return None
        raw = self.side.get(int(i))
        return json.loads(raw.tobytes().decode("utf-8")) if len(raw) else None

    def size_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.directory, name))
                   for name in os.listdir(self.directory))


def open_store(directory: str) -> Optional[ChatStore]:
    """The store at ``directory``; None if there is none, or it is not a whole one of this
    format (a disk error, another version)."""
    try:
        with open(os.path.join(directory, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
        if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
            return None
        return ChatStore(directory, meta)
    except (OSError, ValueError, KeyError, AssertionError, TypeError):
        return None


class StoreWriter:
    """Writes conversations in order into a (temporary) store directory."""

    def __init__(self, directory: str, vocab_size: int):
        os.makedirs(directory)
        self.directory = directory
        self.dtype = DType.optimal_dtype(vocab_size)
        self.limit = numpy.iinfo(self.dtype).max
        self.tokens = IndexedDatasetBuilder(os.path.join(directory, "tokens.bin"), self.dtype)
        self.loss = IndexedDatasetBuilder(os.path.join(directory, "loss.bin"), numpy.uint8)
        self.side = None
        self.count = self.total_tokens = self.total_loss = 0
        self.loss_counts, self.line_numbers = [], []

    def add_chunk(self, ids: numpy.ndarray, loss: numpy.ndarray, lengths: numpy.ndarray,
                  loss_counts: numpy.ndarray, sides: Optional[list],
                  line_numbers: numpy.ndarray) -> None:
        """Conversations of one chunk: their ``ids`` and ``loss`` flags end to end, each's
        token count (``lengths``), loss count and line in the file; ``sides``: each's side
        record or None (None: none has one)."""
        if len(ids) and (ids.min() < 0 or ids.max() > self.limit):
            raise ValueError(f"token id {int(ids.max())} does not fit {self.dtype.__name__}")
        counts = lengths.tolist()
        _add_documents(self.tokens, numpy.ascontiguousarray(ids, dtype=self.dtype), counts)
        _add_documents(self.loss, numpy.ascontiguousarray(loss, dtype=numpy.uint8), counts)
        if self.side is None and sides is not None:  # the first side record: those before have none
            self.side = IndexedDatasetBuilder(os.path.join(self.directory, "side.bin"),
                                              numpy.uint8)
            _add_documents(self.side, numpy.zeros(0, numpy.uint8), [0] * self.count)
        if self.side is not None:
            raws = [b"" if record is None else json.dumps(record, separators=(",", ":")).encode()
                    for record in (sides if sides is not None else [None] * len(counts))]
            _add_documents(self.side, numpy.frombuffer(bytearray(b"".join(raws)), numpy.uint8),
                           [len(raw) for raw in raws])
        self.count += len(counts)
        self.total_tokens += int(lengths.sum())
        self.total_loss += int(loss_counts.sum())
        self.loss_counts.append(numpy.asarray(loss_counts, dtype=numpy.int32))
        self.line_numbers.append(numpy.asarray(line_numbers, dtype=numpy.int64))

    def close(self) -> None:
        """Closes the data files (after ``finalize``, or where the build stopped)."""
        for builder in (self.tokens, self.loss, self.side):
            if builder is not None:
                builder.data_file.close()

    def finalize(self, meta: dict) -> None:
        """The indexes, the loss counts and meta.json (last), every file synced."""
        for name, builder in (("tokens", self.tokens), ("loss", self.loss), ("side", self.side)):
            if builder is not None:
                builder.finalize(os.path.join(self.directory, name + ".idx"))
        for name, parts, dtype in (("loss_counts", self.loss_counts, numpy.int32),
                                   ("line_numbers", self.line_numbers, numpy.int64)):
            numpy.save(os.path.join(self.directory, f"{name}.npy"),
                       numpy.concatenate(parts) if parts else numpy.zeros(0, dtype))
        meta = dict(meta, format=STORE_FORMAT, conversations=self.count, tokens=self.total_tokens,
                    loss_tokens=self.total_loss, dtype=self.dtype.__name__,
                    side=self.side is not None)
        with open(os.path.join(self.directory, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        for name in os.listdir(self.directory):
            _fsync(os.path.join(self.directory, name))
        _fsync(self.directory)


def _add_documents(builder: IndexedDatasetBuilder, values: numpy.ndarray, lengths: list) -> None:
    """Each of ``lengths`` a sequence and a document of its own, as ``add_item`` and
    ``end_document`` for each would add them, in one write: megatron's ``add_document`` adds the
    sequences as one document, whose end is then replaced by each sequence's."""
    first = len(builder.sequence_lengths)
    builder.add_document(torch.from_numpy(values), lengths)
    builder.document_indices[-1:] = range(first + 1, first + len(lengths) + 1)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _exclusive(lock_path: str, what: str, log: Callable[[str], None]):
    """Holds the POSIX lock on ``lock_path`` (waiting for it, said once a minute); yields
    False without a lock where the filesystem has none."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        locked, waited, last = False, time.monotonic(), None
        while not locked:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as err:
                if err.errno in _LOCK_UNSUPPORTED:
                    if lock_path not in _warned_unlocked:
                        _warned_unlocked.add(lock_path)
                        log(f"[data] warning: {os.path.dirname(lock_path)} takes no file locks "
                            f"({err.strerror}): each node's first rank builds {what} itself")
                    break
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                now = time.monotonic()
                if last is None or now - last >= WAIT_REPORT_S:
                    owner = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "?"
                    log(f"[data] waiting for {owner} to finish {what} "
                        f"({now - waited:.0f} s so far; lock {lock_path})")
                    last = now
                time.sleep(0.2)
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
        yield locked
    finally:
        os.close(fd)  # releases the lock


def build_once(directory: str, build: Callable[[str], None], what: str,
               log: Callable[[str], None] = print) -> tuple[Optional[ChatStore], bool]:
    """The store at ``directory``, built by ``build(temporary_directory)`` if no process has
    built it yet (see the module). Returns (store, built here). ``build``'s exception leaves
    nothing behind and propagates."""
    parent = os.path.dirname(directory) or "."
    store = open_store(directory)
    if store is not None:
        return store, False
    made = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        return _build_locked(directory, parent, build, what, log)
    except BaseException:
        if made:  # nothing was stored: the folder this call made goes too
            try:
                os.rmdir(parent)
            except OSError:
                pass
        raise


def _build_locked(directory, parent, build, what, log):
    with _exclusive(directory + ".lock", what, log) as locked:
        store = open_store(directory)  # built while this process waited
        if store is not None:
            return store, False
        if locked:  # no other writer of this key is alive: its leftovers go
            prefix = os.path.basename(directory) + "."
            for name in os.listdir(parent):
                if name.startswith(prefix) and name.endswith(".tmp"):
                    remove_tree(os.path.join(parent, name))
            if os.path.exists(directory):  # not a store (a disk error): built again
                shutil.rmtree(directory)
        temporary = f"{directory}.{socket.gethostname()}-{os.getpid()}.tmp"
        try:
            build(temporary)
            try:
                os.rename(temporary, directory)
            except OSError as err:  # another node renamed its own first (no locks here)
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            _fsync(parent)
        finally:
            if os.path.exists(temporary):
                remove_tree(temporary)
            if locked:  # a waiter holds it open and finds the store (or builds); a later
                try:    # start finds the store before it looks for a lock
                    os.unlink(directory + ".lock")
                except OSError:
                    pass
    store = open_store(directory)
    if store is None:
        raise OSError(errno.EIO, f"{directory} is not a readable store after it was written")
    return store, True


def other_caches(directory: str, source: str) -> list[str]:
    """Stores in ``directory``'s folder of the same source file but another key (an older
    version of the file, other settings), and caches of the earlier ``.npz`` format."""
    parent, name = os.path.split(directory)
    found = []
    for other in sorted(os.listdir(parent or ".")):
        full = os.path.join(parent, other)
        if other.startswith("chat-") and other.endswith(".npz"):
            found.append(full)
        elif other != name and other.startswith("chat-") and os.path.isdir(full) and not (
                other.endswith(".tmp")):
            try:
                with open(os.path.join(full, "meta.json")) as f:
                    if json.load(f).get("source", {}).get("path") == source:
                        found.append(full)
            except (OSError, ValueError, AttributeError):
                pass
    return found


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def du(path: str) -> int:
    """Bytes of a file, or of a directory's files."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)
