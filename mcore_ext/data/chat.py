"""Chat / instruction data for fine-tuning: JSONL conversations, tokenized with the model's chat
template, loss on the answers, packed several to a ``seq_length`` row.

Each line of the file is one conversation: ``{"messages": [{"role": ..., "content": ...}, ...]}``
(system / user / assistant / tool, multi-turn, as megatron's ``SFTDataset`` reads them) or
``{"prompt": ..., "completion": ...}`` (one user turn and its answer). Lines are rendered with the
tokenizer's own chat template (``apply_chat_template``), so the model sees its released format.
A message's content may also be transformers' list of parts, with images
(``{"type": "image", "path": "cat.png"}``, relative to the file): such a conversation is rendered
by the model's processor, its images go with it into its row, and their tokens carry no loss
(``chat_images``).

Which tokens carry loss is found from the template itself: assistant turn i spans from the end of
the rendering of messages[:i] with the generation prompt to the end of the rendering of
messages[:i + 1] (the answer and the template's end-of-turn tokens); a template whose renderings
are not prefixes of one another cannot be split so and is an error. ``loss_on``: ``assistant``
(every answer), ``last_turn`` (the last answer only) or ``all`` (every token).

A conversation of n tokens is a document of n - 1 positions (tokens[:-1] predict tokens[1:]); a
longer one than seq_length is truncated to seq_length positions or dropped (``overlong``); a cut
never splits an image's tokens (it moves before the image, which is left out).

Packing (``pack_documents``) is best-fit in file order: each document goes to the open row with
the least room that holds it, a new row when none does; the same documents always give the same
rows. The rest of a row is padding, a document of its own without loss. Under context
parallelism every document takes a multiple of ``pad_to_multiple`` (2 x CP) slots, megatron's
convention for a THD batch split per document (``cu_seqlens_*_padded``): its real tokens, then
slots without loss that attention ignores; packing counts the padded lengths, so a row still
holds ``seq_length`` slots.

Tokenized conversations are stored once per file and settings (``load_chat_file`` with
``cache_dir``; ``mcore_ext.data.chat_store``): megatron ``IndexedDataset``s of the token ids
and loss flags, memory-mapped, built by worker processes in file order (the same tokens as
``read_chat_file``, the one-process path), by one writer for every node that shares the
filesystem. A conversation's images (``chat_images.ImageRef``: path, size, SHA-256, crops and
token span, never pixels) are its side record, stored beside its tokens; pixels are read at use.
``ChatDataset`` keeps its rows and sample order in memory-mapped ``.npy`` files beside the
store, so a start reads the indexes only.

``ChatDataset`` is a megatron ``MegatronDataset``: megatron's ``BlendedMegatronDatasetBuilder``
splits the conversations (``data.split``), blends files and sizes the splits; each split packs its
own conversations and repeats them in a new seeded order each epoch. megatron's own
``megatron.training.datasets.sft_dataset`` is not used: it needs the ``datasets`` package, renders
with megatron's prompt formats (``tokenize_conversation``) rather than the model's chat template,
and packs only conversations that one JSONL line already groups.
"""

import bisect
import hashlib
import heapq
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Callable, Optional

import numpy

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset

from mcore_ext.data import chat_images, chat_store
from mcore_ext.userfiles import parse_json_line

ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("assistant", "last_turn", "all")


class ChatDataError(ValueError):
    """A conversation that cannot be trained on: the message names the file and line."""


def data_error_line(err: ChatDataError) -> str:
    """The error's own line, also when a DataLoader worker raised it (torch re-raises it in the
    main process with the worker's traceback in the message: ``Caught ChatDataError in
    DataLoader worker process 0. Original Traceback ... ChatDataError: FILE:LINE: ...``)."""
    text = str(err)
    marker = f"{ChatDataError.__name__}: "
    lines = [line for line in text.splitlines() if marker in line]
    return lines[-1].split(marker, 1)[1] if lines and "Traceback" in text else text


@dataclass
class Conversation:
    """One tokenized conversation: ``ids`` [n] int64 and ``loss`` [n] bool (whether token i is a
    target that carries loss), its ``images`` (``chat_images.ImageRef``, in placeholder order) and
    ``where`` it is (FILE:LINE: its line is kept in the store, so errors found when a row is read
    can name it)."""

    ids: numpy.ndarray
    loss: numpy.ndarray
    images: tuple = ()
    where: str = ""


class ChatFile:
    """A file's conversations, and how many were truncated or dropped for length.

    ``conversations``: a list of ``Conversation`` (in memory), or for a file read from its
    store (``ChatFile.from_store``) a sequence that reads each from the memory-mapped store
    when asked. ``ids(i)`` / ``loss(i)`` / ``images(i)`` give conversation i's parts without
    making a ``Conversation`` (the store's own dtypes: uint16 or int32 ids, uint8 flags)."""

    def __init__(self, path: str, conversations, lines: int, truncated: int, dropped: int,
                 store: Optional[chat_store.ChatStore] = None):
        self.path, self.lines, self.truncated, self.dropped = path, lines, truncated, dropped
        self.store = store
        self.conversations = (conversations if store is None
                              else _StoredConversations(self))

    @classmethod
    def from_store(cls, path: str, store: chat_store.ChatStore) -> "ChatFile":
        meta = store.meta
        return cls(path, None, meta["lines"], meta["truncated"], meta["dropped"], store=store)

    def __len__(self):
        return len(self.conversations)

    def lengths(self) -> numpy.ndarray:
        """[n]: each conversation's tokens."""
        if self.store is not None:
            return self.store.lengths
        return numpy.fromiter((len(c.ids) for c in self.conversations), numpy.int64,
                              count=len(self.conversations))

    def loss_counts(self) -> numpy.ndarray:
        """[n]: each conversation's loss tokens after its first (what its document trains on)."""
        if self.store is not None:
            return self.store.loss_counts
        return numpy.fromiter((int(c.loss[1:].sum()) for c in self.conversations), numpy.int64,
                              count=len(self.conversations))

    def ids(self, i: int) -> numpy.ndarray:
        return self.store.ids(i) if self.store is not None else self.conversations[i].ids

    def loss(self, i: int) -> numpy.ndarray:
        return self.store.loss_flags(i) if self.store is not None else self.conversations[i].loss

    def images(self, i: int) -> tuple:
        """Conversation i's images (``chat_images.ImageRef``, in placeholder order)."""
        if self.store is not None:
            record = self.store.side_record(i)  # resolved against the file's folder
            return chat_images.images_from_record(record, os.path.dirname(self.path),
                                                  self.where(i)) if record else ()
        return self.conversations[i].images

    def with_images(self) -> numpy.ndarray:
        """The indices of the conversations that have images (a store's: from its side index,
        reading no record)."""
        if self.store is not None:
            if self.store.side is None:
                return numpy.zeros(0, numpy.int64)
            return numpy.flatnonzero(self.store.side.sequence_lengths)
        return numpy.asarray([i for i, c in enumerate(self.conversations) if c.images],
                             numpy.int64)

    def image_count(self) -> int:
        if self.store is not None:
            return int(self.store.meta.get("images", 0))
        return sum(len(c.images) for c in self.conversations)

    def holding(self, token: int) -> numpy.ndarray:
        """The indices of the conversations whose ids hold ``token`` (a store's: one vectorised
        pass over its memory-mapped tokens)."""
        if self.store is not None:
            return self.store.holding(token)
        return numpy.asarray([i for i, c in enumerate(self.conversations)
                              if (c.ids == token).any()], numpy.int64)

    def where(self, i: int) -> str:
        """FILE:LINE of conversation i."""
        if self.store is not None:
            return f"{self.path}:{int(self.store.line_numbers[i])}"
        return self.conversations[i].where

    def summary(self, seq_length: int) -> str:
        """One line: conversations, loss tokens, images, and the over-long ones (said once per
        file)."""
        if self.store is not None:
            tokens, loss = self.store.meta["tokens"], self.store.meta["loss_tokens"]
        else:
            tokens = sum(len(c.ids) for c in self.conversations)
            loss = sum(int(c.loss[1:].sum()) for c in self.conversations)
        images = self.image_count()
        line = (f"[data] {self.path}: {len(self)} conversations, {tokens} tokens, "
                f"{loss} loss tokens" + (f", {images} images" if images else ""))
        if self.truncated or self.dropped:
            line += (f"; longer than seq_length {seq_length}: {self.truncated} truncated, "
                     f"{self.dropped} dropped")
        return line


class _StoredConversations(Sequence):
    """A store's conversations as ``Conversation``s (int64 ids, bool flags), read when asked."""

    def __init__(self, chat: ChatFile):
        self.chat = chat

    def __len__(self):
        return len(self.chat.store)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        chat = self.chat
        return Conversation(chat.ids(i).astype(numpy.int64), chat.loss(i).astype(bool),
                            chat.images(i), chat.where(i))


def messages_of(record, where: str) -> list:
    """The conversation of one JSONL record as a list of messages, checked."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatDataError(f"{where}: 'messages' must be a non-empty list")
    elif "prompt" in record and "completion" in record:
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}]
    else:
        raise ChatDataError(
            f"{where}: no 'messages' (nor 'prompt' and 'completion'); keys: {sorted(record)}")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatDataError(f"{where}: message {number} has no 'role'")
        if message["role"] not in ROLES:
            raise ChatDataError(f"{where}: message {number} has unknown role "
                                f"{message['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(message.get("content"), (str, list)):
            raise ChatDataError(f"{where}: message {number} has no string 'content' (nor a list "
                                "of text and image parts)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant turn (nothing to train on)")
    return messages


def tokenize_conversation(messages, hf_tokenizer, loss_on: str, where: str,
                          images: Optional[tuple] = None) -> Conversation:
    """Token ids of the rendered conversation and which of them carry loss (see the module).

    ``images``: (image paths in order, their base folder, the processor) for a conversation
    with images: the processor renders and tokenizes it (``chat_images.encode``), and the images'
    tokens carry no loss."""
    renderer = images[2] if images else hf_tokenizer

    def render(prefix, generation_prompt):
        try:
            return renderer.apply_chat_template(
                prefix, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja's errors and the template's own raise_exception
            raise ChatDataError(f"{where}: the chat template does not render it: "
                                f"{type(err).__name__}: {err}") from None

    text = render(messages, False)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_turn":
        answers = answers[-1:]
    spans = []
    if loss_on != "all":
        for i in answers:
            begin, end = render(messages[:i], True), render(messages[:i + 1], False)
            if not (end.startswith(begin) and text.startswith(end)):
                raise ChatDataError(
                    f"{where}: the chat template does not render message {i + 1} (assistant) "
                    "after the conversation before it, so its answer cannot be told apart; "
                    "use data.loss_on=all")
            spans.append((len(begin), len(end)))
    refs = ()
    if images:
        sources, base_dir, processor = images
        ids, starts, refs = chat_images.encode(text, sources, base_dir, processor, where,
                                               ChatDataError)
    else:
        encoded = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = numpy.asarray(encoded["input_ids"], dtype=numpy.int64)
        starts = numpy.asarray([start for start, _ in encoded["offset_mapping"]])
    if loss_on == "all":
        loss = numpy.ones(len(ids), dtype=bool)
    else:
        loss = numpy.zeros(len(ids), dtype=bool)
        for begin, end in spans:
            loss |= (starts >= begin) & (starts < end)
    for image in refs:  # placeholders, crop and image start / end / newline tokens
        loss[image.start:image.end] = False
    return Conversation(ids, loss, refs, where)


def truncate(conversation: Conversation, seq_length: int) -> Conversation:
    """The first seq_length + 1 tokens (seq_length positions), cut before an image whose tokens
    would not all be inputs (the model fills an image's placeholders whole or not at all)."""
    keep = seq_length + 1
    cut = [image.start for image in conversation.images if image.end > seq_length]
    keep = min([keep] + cut[:1])
    return Conversation(conversation.ids[:keep], conversation.loss[:keep],
                        tuple(i for i in conversation.images if i.end <= seq_length),
                        conversation.where)


def conversation_of(record, hf_tokenizer, loss_on: str, where: str) -> Conversation:
    """One JSONL record's conversation, tokenized: the default ``render`` of ``read_chat_file``
    and the store's builder (``where`` is FILE:LINE; image paths are relative to FILE's folder,
    rendered by the processor of the tokenizer's folder, loaded once per process). Another
    ``render`` (same arguments, a module-level function so worker processes can call it) may
    return other conversations."""
    messages = messages_of(record, where)
    sources = chat_images.image_sources(messages, where, ChatDataError)
    images = None
    if sources:
        processor = chat_images.processor_for(hf_tokenizer.name_or_path, where, ChatDataError)
        images = (sources, os.path.dirname(where.rpartition(":")[0]), processor)
    return tokenize_conversation(messages, hf_tokenizer, loss_on, where, images)


def _fit(conversation: Conversation, seq_length: int, overlong: str):
    """(the conversation as kept or None, truncated 0/1, dropped 0/1): one longer than
    seq_length positions cut to it (``truncate``; dropped if nothing of an answer is left) or
    dropped; one without a target (e.g. an empty answer) left out without being counted."""
    truncated = 0
    if len(conversation.ids) - 1 > seq_length:
        if overlong == "drop":
            return None, 0, 1
        conversation = truncate(conversation, seq_length)
        if not conversation.loss[1:].any():  # nothing of the answer left
            return None, 0, 1
        truncated = 1
    if len(conversation.ids) < 2 or not conversation.loss[1:].any():
        return None, 0, 0
    return conversation, truncated, 0


def read_chat_file(path: str, hf_tokenizer, seq_length: int, loss_on: str = "assistant",
                   overlong: str = "truncate", render: Optional[Callable] = None) -> ChatFile:
    """Every conversation of a JSONL file, tokenized in this process and kept in memory; raises
    ``ChatDataError`` (file:line) at the first line that cannot be trained on. Conversations with
    images are rendered by the processor of the tokenizer's folder (``chat_images``), their paths
    relative to the file."""
    render = render or conversation_of
    conversations, truncated, dropped, number = [], 0, 0, 0
    try:
        f = open(path, "rb")  # bytes: a line that is not UTF-8 is named by its number
    except OSError as err:
        raise ChatDataError(f"{path}: cannot be read ({err.strerror})") from None
    with f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            record = parse_json_line(raw, where, ChatDataError)
            if record is None:
                continue
            conversation = render(record, hf_tokenizer, loss_on, where)
            conversation.where = conversation.where or where
            conversation, cut, drop = _fit(conversation, seq_length, overlong)
            truncated, dropped = truncated + cut, dropped + drop
            if conversation is not None:
                conversations.append(conversation)
    if not conversations:
        raise ChatDataError(f"{path}: no conversation to train on ({number} lines)")
    chat = ChatFile(path, conversations, number, truncated, dropped)
    _refuse_stray_placeholders(chat, hf_tokenizer)
    return chat


def _refuse_stray_placeholders(chat: ChatFile, hf_tokenizer) -> None:
    """In a file with images, a conversation without any whose text holds the processor's
    placeholder is an error naming its line (the launcher checks every file so for a
    vision-language model: ``training.config.validation``)."""
    with_images = chat.with_images()
    if len(with_images):
        processor = chat_images.processor_for(hf_tokenizer.name_or_path,
                                              chat.where(int(with_images[0])), ChatDataError)
        chat_images.stray_placeholders(chat, processor.image_token_id, ChatDataError)


# ------------------------------------------------------------------ building a store in parallel

CHUNK_BYTES = 1 << 20
"""The store's builder hands the file to its workers in chunks of about this many bytes of whole
lines, and writes their results in file order."""
PROGRESS_S = 30.0
SMALL_FILE_BYTES = 16 << 20
"""A file up to this size is tokenized in the building process itself (``default_workers``)."""
MAX_WORKERS = 8
_WORKER: dict = {}  # in a worker process: its tokenizer and the settings (_start_worker)


def default_workers(path: str) -> int:
    """Processes that tokenize ``path`` when none are asked for: 1 (this process) for a file up
    to ``SMALL_FILE_BYTES``, else as many as this process may use, up to ``MAX_WORKERS``."""
    if os.path.getsize(path) <= SMALL_FILE_BYTES:
        return 1
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def _tokenize_chunk(first_line: int, data: bytes, *, path: str, hf_tokenizer, seq_length: int,
                    loss_on: str, overlong: str, render: Optional[Callable], dtype) -> dict:
    """The conversations of ``data`` (whole lines of the file, the first of them its line
    ``first_line``) as ``read_chat_file`` keeps them, end to end: ``ids`` (``dtype``), ``loss``
    (uint8), each one's ``lengths`` and ``loss_counts``, ``sides`` (None if none has one), the
    chunk's ``lines`` / ``truncated`` / ``dropped``; ``error``: the first line that cannot be
    trained on (the chunk stops there)."""
    render = render or conversation_of
    ids, loss, lengths, counts, sides, numbers = [], [], [], [], [], []
    truncated = dropped = 0
    error = None
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the chunk ends with a newline; else the file's last line
    raws = [line + b"\n" for line in lines] + ([last] if last else [])
    try:
        for number, raw in enumerate(raws, start=first_line):
            where = f"{path}:{number}"
            record = parse_json_line(raw, where, ChatDataError)
            if record is None:
                continue
            conversation, cut, drop = _fit(render(record, hf_tokenizer, loss_on, where),
                                           seq_length, overlong)
            truncated, dropped = truncated + cut, dropped + drop
            if conversation is None:
                continue
            numbers.append(number)
            ids.append(conversation.ids)
            loss.append(conversation.loss)
            lengths.append(len(conversation.ids))
            counts.append(int(conversation.loss[1:].sum()))
            sides.append(chat_images.image_records(conversation.images)
                         if conversation.images else None)
    except ChatDataError as err:
        error = str(err)
    ids = numpy.concatenate(ids) if ids else numpy.zeros(0, numpy.int64)
    limit = numpy.iinfo(dtype).max
    if len(ids) and (ids.min() < 0 or ids.max() > limit) and error is None:
        error = (f"{path}: token id {int(ids.max())} of its tokenizer does not fit the store's "
                 f"{numpy.dtype(dtype).name} (the tokenizer has more ids than it says)")
    return {"ids": ids.astype(dtype), "lengths": numpy.asarray(lengths, numpy.int32),
            "loss": (numpy.concatenate(loss) if loss else numpy.zeros(0, bool)).astype(
                numpy.uint8),
            "loss_counts": numpy.asarray(counts, numpy.int32),
            "line_numbers": numpy.asarray(numbers, numpy.int64),
            "sides": sides if any(s is not None for s in sides) else None,
            "images": sum(len(side) for side in sides if side is not None),
            "lines": len(raws), "truncated": truncated, "dropped": dropped, "error": error}


def _start_worker(hf_tokenizer, settings: dict) -> None:
    _WORKER.update(hf_tokenizer=hf_tokenizer, settings=settings)


def _work(task) -> dict:
    return _tokenize_chunk(*task, hf_tokenizer=_WORKER["hf_tokenizer"], **_WORKER["settings"])


def _chunks(path: str, chunk_bytes: int, digest):
    """(first line number, bytes) of the file's whole lines, about ``chunk_bytes`` at a time, in
    order; ``digest`` takes every byte."""
    first_line, rest = 1, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                if rest:  # a last line without a newline
                    yield first_line, rest
                return
            digest.update(block)
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a chunk: read on
                rest = data
                continue
            chunk, rest = data[:cut], data[cut:]
            yield first_line, chunk
            first_line += chunk.count(b"\n")


def _results(tasks, hf_tokenizer, settings: dict, workers: int):
    """(result, bytes) of each chunk in order: in this process, or in ``workers`` processes
    (started by a fork server, so they share its imports; at most 2 chunks per worker are in
    flight, so the file is never read ahead of them)."""
    if workers <= 1:
        for first_line, data in tasks:
            yield _tokenize_chunk(first_line, data, hf_tokenizer=hf_tokenizer, **settings), len(data)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, type(hf_tokenizer).__module__])
    with context.Pool(workers, initializer=_start_worker, initargs=(hf_tokenizer, settings)) as pool:
        pending = deque()
        for task in tasks:
            pending.append((pool.apply_async(_work, (task,)), len(task[1])))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


def build_store(path: str, directory: str, hf_tokenizer, seq_length: int, loss_on: str,
                overlong: str, workers: int = 1, render: Optional[Callable] = None,
                chunk_bytes: int = CHUNK_BYTES, log: Callable[[str], None] = print) -> None:
    """Tokenizes ``path`` into a new store directory ``directory`` (``chat_store``): chunks of
    lines tokenized by ``workers`` processes (1: this one), written in file order, so the store
    holds what ``read_chat_file`` returns; a progress line every ``PROGRESS_S`` seconds. Raises
    ``ChatDataError`` (file:line) at the first line that cannot be trained on."""
    start = last = time.monotonic()
    try:
        before = os.stat(path)
    except OSError as err:
        raise ChatDataError(f"{path}: cannot be read ({err.strerror})") from None
    writer = chat_store.StoreWriter(directory, len(hf_tokenizer))
    settings = dict(path=path, seq_length=seq_length, loss_on=loss_on, overlong=overlong,
                    render=render, dtype=writer.dtype)
    digest = hashlib.sha256()
    lines = truncated = dropped = done = images = 0
    try:
        with closing(_results(_chunks(path, chunk_bytes, digest), hf_tokenizer, settings,
                              workers)) as results:
            for result, size in results:
                if result["error"]:
                    raise ChatDataError(result["error"])
                writer.add_chunk(result["ids"], result["loss"], result["lengths"],
                                 result["loss_counts"], result["sides"], result["line_numbers"])
                lines += result["lines"]
                images += result["images"]
                truncated, dropped = truncated + result["truncated"], dropped + result["dropped"]
                done += size
                if time.monotonic() - last >= PROGRESS_S:
                    last = time.monotonic()
                    log(f"[data] tokenizing {path}: {done / 2**20:.0f} of "
                        f"{before.st_size / 2**20:.0f} MiB, {writer.count} conversations, "
                        f"{writer.count / (last - start):.0f} a second ({workers} "
                        f"worker{'s' if workers > 1 else ''})")
        if writer.count == 0:
            raise ChatDataError(f"{path}: no conversation to train on ({lines} lines)")
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise ChatDataError(f"{path}: the file changed while it was tokenized")
        writer.finalize({
            "source": {"path": os.path.abspath(path), "size": before.st_size,
                       "mtime_ns": before.st_mtime_ns, "sha256": digest.hexdigest()},
            "settings": {"seq_length": seq_length, "loss_on": loss_on, "overlong": overlong,
                         "tokenizer": os.path.abspath(str(hf_tokenizer.name_or_path)),
                         "render": _render_name(render)},
            "lines": lines, "truncated": truncated, "dropped": dropped, "images": images,
            "built": {"host": os.uname().nodename, "pid": os.getpid(), "workers": workers,
                      "seconds": round(time.monotonic() - start, 3),
                      "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}})
    finally:
        writer.close()
    if images:  # before the store is renamed into place: a refused file leaves no store
        _refuse_stray_placeholders(ChatFile.from_store(path, chat_store.open_store(directory)),
                                   hf_tokenizer)


def _render_name(render: Optional[Callable]) -> str:
    render = render or conversation_of
    return f"{render.__module__}.{render.__qualname__}"


# ------------------------------------------------------------------------------------- packing

def pack_rows(lengths, seq_length: int, pack: bool = True) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Rows of documents as two arrays: row r holds documents ``members[offsets[r]:offsets[r +
    1]]`` (in order). Best fit in order (see the module): each document goes to the open row with
    the least room that holds it, the first such row of equal room; one per row if not pack.
    ``lengths``: the slots each document takes (padded to ``pad_to_multiple``)."""
    lengths = numpy.asarray(lengths, dtype=numpy.int64)
    if not pack:
        return numpy.arange(len(lengths) + 1, dtype=numpy.int64), numpy.arange(
            len(lengths), dtype=numpy.int64)
    row_of = numpy.empty(len(lengths), dtype=numpy.int64)
    rooms = []  # the free rooms some open row has, sorted (at most seq_length of them)
    rows_with = {}  # free room -> min-heap of the rows that have it
    count = 0
    for i, length in enumerate(lengths.tolist()):
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):  # no open row holds it: a new one
            row, free = count, seq_length - length
            count += 1
        else:
            free = rooms[at]
            heap = rows_with[free]
            row = heapq.heappop(heap)
            if not heap:
                del rows_with[free], rooms[at]
            free -= length
        row_of[i] = row
        if free > 0:  # a full row takes nothing more
            heap = rows_with.get(free)
            if heap is None:
                rows_with[free] = [row]
                bisect.insort(rooms, free)
            else:
                heapq.heappush(heap, row)
    members = numpy.argsort(row_of, kind="stable")
    offsets = numpy.zeros(count + 1, dtype=numpy.int64)
    numpy.cumsum(numpy.bincount(row_of, minlength=count), out=offsets[1:])
    return offsets, members


def pack_documents(lengths, seq_length: int, pack: bool = True) -> list:
    """Rows of document indices (``pack_rows`` as lists)."""
    offsets, members = pack_rows(lengths, seq_length, pack)
    return [members[offsets[r]:offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]


@dataclass(kw_only=True)
class ChatDatasetConfig(BlendedMegatronDatasetConfig):
    """megatron's dataset config plus how conversations become rows."""

    loss_on: str = "assistant"
    overlong: str = "truncate"
    pack: bool = True
    pad_to_multiple: int = 1
    """Every document takes a multiple of this many slots (2 x CP: split per document)."""
    hf_tokenizer: Optional[object] = None
    """The Hugging Face tokenizer (with its chat template) that renders conversations."""
    images: bool = True
    """Rows carry their images' pixels; False on a pipeline stage that runs no vision tower."""
    render: Optional[Callable] = None
    """What turns a JSONL record into a ``Conversation`` (None: ``conversation_of``)."""
# A tokenizer directory may be a whole Hugging Face model folder: its weights are not hashed.
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_FILES: dict = {}


def _hash_file(digest, path: str) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def chat_cache_path(path: str, hf_tokenizer, seq_length: int, loss_on: str, overlong: str,
                    cache_dir: str, render: Optional[Callable] = None) -> str:
    """The store of ``path`` tokenized so: ``cache_dir/chat-<stem>-<key>``, the key a SHA-256
    over the store format, the file (``chat_store.file_fingerprint``: its bytes up to 64 MiB,
    else its size, mtime and samples), the tokenizer directory's files (not model weights) and
    chat template, transformers' version (its tokenizers and templates render), seq_length,
    loss_on, overlong and the render function."""
    import transformers

    digest = hashlib.sha256()
    for part in (chat_store.STORE_FORMAT, type(hf_tokenizer).__name__,
                 str(hf_tokenizer.chat_template), transformers.__version__, seq_length, loss_on,
                 overlong, _render_name(render)):
        digest.update(repr(part).encode() + b"\0")
    try:
        digest.update(chat_store.file_fingerprint(path).encode())
    except OSError as err:
        raise ChatDataError(f"{path}: cannot be read ({err.strerror})") from None
    tokenizer_dir = str(hf_tokenizer.name_or_path)
    if os.path.isdir(tokenizer_dir):
        for name in sorted(os.listdir(tokenizer_dir)):
            if os.path.isfile(os.path.join(tokenizer_dir, name)) and not name.endswith(
                    WEIGHT_FILES):
                digest.update(name.encode() + b"\0")
                _hash_file(digest, os.path.join(tokenizer_dir, name))
    return os.path.join(cache_dir, chat_store.store_name(path, digest.hexdigest()))


def load_chat_file(path: str, hf_tokenizer, seq_length: int, loss_on: str, overlong: str,
                   cache_dir: Optional[str] = None, write_cache: bool = False,
                   tokenize: bool = True, workers: Optional[int] = None,
                   render: Optional[Callable] = None,
                   chunk_bytes: int = CHUNK_BYTES) -> Optional[ChatFile]:
    """The conversations of ``path``, once per process for the same file and settings
    (validation reads it before training, the dataset builder again). With ``cache_dir``: from
    its store (memory-mapped) if one is built; else, if ``write_cache``, the store is built
    (``workers`` processes, None: ``default_workers``; one writer for every process that
    shares the cache directory, the others wait and read it); else tokenized in memory (None if
    not ``tokenize``). A store that cannot be written is said and the file is tokenized in
    memory (the next start tries again)."""
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size,
           os.path.abspath(str(hf_tokenizer.name_or_path)), seq_length, loss_on, overlong,
           _render_name(render), os.path.abspath(cache_dir) if cache_dir else None)
    if key in _FILES:
        return _FILES[key]
    directory = (chat_cache_path(path, hf_tokenizer, seq_length, loss_on, overlong, cache_dir,
                                 render) if cache_dir else None)
    store = chat_store.open_store(directory) if directory else None
    built = False
    if store is None and directory and write_cache:
        workers = workers or default_workers(path)
        try:
            store, built = chat_store.build_once(directory, lambda into: build_store(
                path, into, hf_tokenizer, seq_length, loss_on, overlong, workers, render,
                chunk_bytes), f"tokenizing {path}")
            if built:
                _said_built(path, store)
        except OSError as err:
            print(f"[data] warning: the tokenized conversations of {path} cannot be cached in "
                  f"{cache_dir} ({err.strerror or err}); tokenized in memory, the next start "
                  "tries again", flush=True)
    if store is not None:
        chat = ChatFile.from_store(path, store)
        if not built:  # its images as tokenized (a stat each; one built here just read them)
            chat_images.check_unchanged(chat, ChatDataError)
    elif directory and not tokenize:
        return None
    else:
        chat = read_chat_file(path, hf_tokenizer, seq_length, loss_on, overlong, render)
    _FILES[key] = chat
    return chat


def _said_built(path: str, store: chat_store.ChatStore) -> None:
    built = store.meta["built"]
    print(f"[data] {path}: tokenized conversations cached in {store.directory} "
          f"({store.size_bytes() / 2**20:.1f} MiB, built in {built['seconds']:.0f} s by "
          f"{built['workers']} worker{'s' if built['workers'] > 1 else ''})", flush=True)
    others = chat_store.other_caches(store.directory, store.meta["source"]["path"])
    if others:
        size = sum(chat_store.du(o) for o in others) / 2**20
        print(f"[data] {len(others)} older cache(s) of this file or of an earlier format lie "
              f"beside it ({size:.1f} MiB), e.g. {others[0]}: remove them when no run needs "
              "them", flush=True)


# -------------------------------------------------------------------------------- the dataset

ROWS_FORMAT = "mcore_ext chat rows 1"
_warned_rows: set = set()


class ChatDataset(MegatronDataset):
    """Packed rows of one split of a chat JSONL file, repeated in a new seeded order per epoch.

    ``self[i]``: ``tokens``, ``labels`` (int64), ``loss_mask`` (float32), ``position_ids``
    (restarting at 0 in every document), each [seq_length], ``lengths`` (int64: the row's
    documents, then its padding if any) and ``padded_lengths`` (the slots each takes, a multiple
    of ``pad_to_multiple``; they sum to seq_length). A row with images also has their pixels
    (``chat_images.row_images``): its documents' images in order (unless ``config.images`` is
    False).

    The rows (``row_offsets``, ``row_documents``: the conversations of row r are
    ``row_documents[row_offsets[r]:row_offsets[r + 1]]``) and the sample order (``order``) of a
    file read from its store are saved in ``path_to_cache`` (``<store>-rows-<hash>/``, three
    ``.npy`` files, written once by the first rank that builds them) and memory-mapped, so they
    take no memory of their own; for a file in memory they are computed in memory.
    """

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatFile) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: ChatDatasetConfig) -> ChatFile:
        return load_chat_file(dataset_path, config.hf_tokenizer, config.sequence_length,
                              config.loss_on, config.overlong, cache_dir=config.path_to_cache,
                              render=config.render)

    @staticmethod
    def _key_config_attributes() -> list:
        return super(ChatDataset, ChatDataset)._key_config_attributes() + [
            "loss_on", "overlong", "pack", "pad_to_multiple"]

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        folder = self._rows_folder(indices)
        rows = self._read_rows(folder) if folder else None
        if rows is None:
            rows = self._build_rows(numpy.asarray(indices, dtype=numpy.int64))
            if folder:
                rows = self._write_rows(folder, rows)
        self.row_offsets, self.row_documents, self.order, self._loss_share = rows

    def _rows_folder(self, indices) -> Optional[str]:
        """Where this split's rows are saved: beside the store (None for a file in memory)."""
        store, cache = getattr(self.dataset, "store", None), self.config.path_to_cache
        if store is None or not cache:
            return None
        digest = hashlib.md5(usedforsecurity=False)
        for part in (ROWS_FORMAT, self.unique_description, store.name):
            digest.update(part.encode() + b"\0")
        digest.update(numpy.ascontiguousarray(indices))  # no copy of megatron's indices
        return os.path.join(cache, f"{store.name}-rows-{digest.hexdigest()[:16]}")

    def _build_rows(self, indices):
        """(row offsets, row documents, order, loss share) of this split (see the class)."""
        s = self.config.sequence_length
        offsets, members = pack_rows(self._padded(self.dataset.lengths()[indices] - 1), s,
                                     self.config.pack)
        documents = indices[members]
        rows = len(offsets) - 1
        count = self.num_samples if self.num_samples is not None else rows
        epochs = -(-count // rows) if rows else 0
        rng = numpy.random.RandomState(self.config.random_seed)
        order = [rng.permutation(rows) for _ in range(epochs)]
        order = (numpy.concatenate(order)[:count].copy() if order
                 else numpy.zeros(0, dtype=numpy.int64))
        loss = int(numpy.asarray(self.dataset.loss_counts())[indices].sum())
        return offsets, documents, order, loss / max(1, rows * s)

    @staticmethod
    def _read_rows(folder: str):
        try:
            with open(os.path.join(folder, "meta.json")) as f:
                meta = json.load(f)
            if meta.get("format") != ROWS_FORMAT:
                return None
            arrays = [numpy.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r")
                      for name in ("offsets", "documents", "order")]
        except (OSError, ValueError, KeyError):
            return None
        return (*arrays, meta["loss_share"])

    def _write_rows(self, folder: str, rows):
        """Saves ``rows`` in ``folder`` (a temporary folder renamed into place) and maps them
        back; where it cannot be written, said once, they stay in memory."""
        temporary = f"{folder}.{os.uname().nodename}-{os.getpid()}.tmp"
        try:
            os.makedirs(temporary)
            for name, array in zip(("offsets", "documents", "order"), rows[:3]):
                numpy.save(os.path.join(temporary, f"{name}.npy"), array)
            with open(os.path.join(temporary, "meta.json"), "w") as f:
                json.dump({"format": ROWS_FORMAT, "rows": len(rows[0]) - 1,
                           "samples": len(rows[2]), "loss_share": rows[3],
                           "dataset": json.loads(self.unique_description)}, f, indent=1)
            try:
                os.rename(temporary, folder)
            except OSError:  # another rank's is there (no shared lock needed: the same rows)
                if self._read_rows(folder) is None:
                    raise
        except OSError as err:
            if folder not in _warned_rows:
                _warned_rows.add(folder)
                print(f"[data] warning: the rows of {self.dataset.path} cannot be saved in "
                      f"{self.config.path_to_cache} ({err.strerror or err}); kept in memory",
                      flush=True)
            return rows
        finally:
            if os.path.isdir(temporary):
                chat_store.remove_tree(temporary)
        return self._read_rows(folder) or rows

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def rows(self) -> "_Rows":
        """Row r's conversations (``Conversation``s), read when asked."""
        return _Rows(self)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        return self.row(int(self.order[idx]))

    def row(self, r: int) -> dict:
        """Row ``r`` as a sample (see the class)."""
        s = self.config.sequence_length
        tokens, labels = numpy.zeros(s, dtype=numpy.int64), numpy.zeros(s, dtype=numpy.int64)
        loss_mask, position_ids = numpy.zeros(s, dtype=numpy.float32), numpy.zeros(s, numpy.int64)
        lengths, padded, at = [], [], 0
        for doc in self.row_documents[self.row_offsets[r]:self.row_offsets[r + 1]]:
            ids, loss = self.dataset.ids(doc), self.dataset.loss(doc)
            n = len(ids) - 1
            slots = int(self._padded(n))
            tokens[at:at + n], labels[at:at + n] = ids[:-1], ids[1:]
            loss_mask[at:at + n] = loss[1:]
            position_ids[at:at + slots] = numpy.arange(slots)
            lengths.append(n)
            padded.append(slots)
            at += slots
        if at < s:  # padding: a document of its own, no loss
            position_ids[at:] = numpy.arange(s - at)
            lengths.append(s - at)
            padded.append(s - at)
        row = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
               "position_ids": position_ids, "lengths": numpy.asarray(lengths),
               "padded_lengths": numpy.asarray(padded)}
        if not self.config.images:  # a pipeline stage that runs no vision tower
            return row
        images = [image for doc in self.row_documents[self.row_offsets[r]:self.row_offsets[r + 1]]
                  for image in self.dataset.images(int(doc))]
        if images:  # read, checked, processed in the DataLoader's workers
            processor = chat_images.processor_for(self.config.hf_tokenizer.name_or_path,
                                                  images[0].where, ChatDataError)
            row.update(chat_images.row_images(images, tokens, processor, ChatDataError))
        return row

    def _padded(self, length):
        """The slots a document of ``length`` positions takes: a multiple of pad_to_multiple."""
        multiple = self.config.pad_to_multiple
        return -(-length // multiple) * multiple

    def loss_token_share(self) -> float:
        """Loss tokens over all slots of the split's rows (what packing raises)."""
        return self._loss_share


class _Rows(Sequence):
    def __init__(self, dataset: ChatDataset):
        self.dataset = dataset

    def __len__(self):
        return self.dataset.num_rows

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[k] for k in range(*r.indices(len(self)))]
        d = self.dataset
        return [d.dataset.conversations[int(doc)]
                for doc in d.row_documents[d.row_offsets[r]:d.row_offsets[r + 1]]]
