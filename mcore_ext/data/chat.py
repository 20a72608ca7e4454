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

Tokenizing is cached (``load_chat_file`` with ``cache_dir``): one ``.npz`` per file and settings,
named by a fingerprint of the file's bytes, the tokenizer (its files and chat template),
transformers' version, seq_length, loss_on and overlong; it holds every kept conversation's ids,
loss flags, line and images (path, size, SHA-256, token layout: pixels are read at use) and the
file's counts, so a cached file gives the same ``ChatFile``. It is written to a temporary name
beside it and renamed, so a killed write leaves no file that is read; it is written only after
the whole file tokenized (a bad line writes nothing), and never beside the data file.

``ChatDataset`` is a megatron ``MegatronDataset``: megatron's ``BlendedMegatronDatasetBuilder``
splits the conversations (``data.split``), blends files and sizes the splits; each split packs its
own conversations and repeats them in a new seeded order each epoch. megatron's own
``megatron.training.datasets.sft_dataset`` is not used: it needs the ``datasets`` package, renders
with megatron's prompt formats (``tokenize_conversation``) rather than the model's chat template,
and packs only conversations that one JSONL line already groups.
"""

import bisect
import hashlib
import json
import os
import socket
import zipfile
from dataclasses import dataclass
from typing import Optional

import numpy

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset

from mcore_ext.data import chat_images
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
    ``where`` it is (FILE:LINE)."""

    ids: numpy.ndarray
    loss: numpy.ndarray
    images: tuple = ()
    where: str = ""


@dataclass
class ChatFile:
    """A file's conversations, and how many were truncated or dropped for length."""

    path: str
    conversations: list
    lines: int
    truncated: int
    dropped: int

    def __len__(self):
        return len(self.conversations)

    def summary(self, seq_length: int) -> str:
        """One line: conversations, loss tokens, images, and the over-long ones (said once per
        file)."""
        tokens = sum(len(c.ids) for c in self.conversations)
        loss = sum(int(c.loss[1:].sum()) for c in self.conversations)
        images = sum(len(c.images) for c in self.conversations)
        line = (f"[data] {self.path}: {len(self.conversations)} conversations, {tokens} tokens, "
                f"{loss} loss tokens" + (f", {images} images" if images else ""))
        if self.truncated or self.dropped:
            line += (f"; longer than seq_length {seq_length}: {self.truncated} truncated, "
                     f"{self.dropped} dropped")
        return line


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


def read_chat_file(path: str, hf_tokenizer, seq_length: int, loss_on: str = "assistant",
                   overlong: str = "truncate") -> ChatFile:
    """Every conversation of a JSONL file, tokenized; raises ``ChatDataError`` (file:line) at the
    first line that cannot be trained on. Conversations with images are rendered by the
    processor of the tokenizer's folder (``chat_images``), their paths relative to the file."""
    conversations, truncated, dropped, number = [], 0, 0, 0
    processor = None
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
            messages = messages_of(record, where)
            sources = chat_images.image_sources(messages, where, ChatDataError)
            images = None
            if sources:
                processor = processor or chat_images.processor_for(
                    hf_tokenizer.name_or_path, where, ChatDataError)
                images = (sources, os.path.dirname(path), processor)
            conversation = tokenize_conversation(messages, hf_tokenizer, loss_on, where, images)
            if len(conversation.ids) - 1 > seq_length:
                if overlong == "drop":
                    dropped += 1
                    continue
                conversation = truncate(conversation, seq_length)
                truncated += 1
                if not conversation.loss[1:].any():  # nothing of the answer left
                    dropped, truncated = dropped + 1, truncated - 1
                    continue
            if len(conversation.ids) < 2 or not conversation.loss[1:].any():
                continue  # e.g. an empty answer: no target
            conversations.append(conversation)
    if not conversations:
        raise ChatDataError(f"{path}: no conversation to train on ({number} lines)")
    if processor is not None:
        chat_images.stray_placeholders(conversations, processor.image_token_id, ChatDataError)
    return ChatFile(path, conversations, number, truncated, dropped)


def pack_documents(lengths, seq_length: int, pack: bool = True) -> list:
    """Rows of document indices: best fit in order (see the module); one per row if not pack.
    ``lengths``: the slots each document takes (padded to ``pad_to_multiple``)."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    rows, room = [], []  # room: sorted (free slots, row)
    for i, length in enumerate(lengths):
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            rows.append([i])
            bisect.insort(room, (seq_length - length, len(rows) - 1))
            continue
        free, row = room.pop(at)
        rows[row].append(i)
        bisect.insort(room, (free - length, row))
    return rows


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
    """Rows carry their images' pixels; False where nothing runs the vision tower (pipeline
    stages after the first): the images are then not read."""


CACHE_FORMAT = "mcore_ext chat cache 2"  # 2: line numbers, images, transformers' version
# A tokenizer directory may be a whole Hugging Face model folder: its weights are not hashed.
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_FILES: dict = {}


def _hash_file(digest, path: str) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def chat_cache_path(path: str, hf_tokenizer, seq_length: int, loss_on: str, overlong: str,
                    cache_dir: str) -> str:
    """The cache file of ``path`` tokenized so: ``cache_dir/chat-<sha256>.npz``, the hash over
    the file's bytes, the tokenizer directory's files (not model weights; its processor's config
    too) and chat template, transformers' version (its processors expand images), seq_length,
    loss_on, overlong. Not over the images' bytes: the cache records each image's SHA-256, checked
    when the image is read for a batch (``chat_images``)."""
    import transformers

    digest = hashlib.sha256()
    for part in (CACHE_FORMAT, type(hf_tokenizer).__name__, str(hf_tokenizer.chat_template),
                 transformers.__version__, seq_length, loss_on, overlong):
        digest.update(repr(part).encode() + b"\0")
    try:
        _hash_file(digest, path)
    except OSError as err:
        raise ChatDataError(f"{path}: cannot be read ({err.strerror})") from None
    tokenizer_dir = hf_tokenizer.name_or_path
    if os.path.isdir(tokenizer_dir):
        for name in sorted(os.listdir(tokenizer_dir)):
            if os.path.isfile(os.path.join(tokenizer_dir, name)) and not name.endswith(
                    WEIGHT_FILES):
                digest.update(name.encode() + b"\0")
                _hash_file(digest, os.path.join(tokenizer_dir, name))
    return os.path.join(cache_dir, f"chat-{digest.hexdigest()}.npz")


def read_chat_cache(cache_path: str, path: str) -> Optional[ChatFile]:
    """The ``ChatFile`` of a cache file; None if there is none (or it is not one)."""
    try:
        with numpy.load(cache_path, allow_pickle=False) as cached:
            meta = json.loads(str(cached["meta"]))
            ids, loss, offsets = cached["ids"], cached["loss"], cached["offsets"]
            wheres = [f"{path}:{line}" for line in cached["line_numbers"]]
            images = chat_images.images_from_cache(cached, wheres, os.path.dirname(path))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # absent, or not one
        return None
    if (meta.get("format") != CACHE_FORMAT or offsets[-1] != len(ids) or len(loss) != len(ids)
            or len(wheres) != len(offsets) - 1):
        return None
    conversations = [Conversation(ids[begin:end], loss[begin:end], refs, where)
                     for begin, end, refs, where in zip(offsets[:-1], offsets[1:], images,
                                                        wheres)]
    return ChatFile(path, conversations, meta["lines"], meta["truncated"], meta["dropped"])


def write_chat_cache(chat: ChatFile, cache_path: str) -> None:
    """Writes ``chat`` to a temporary file beside ``cache_path`` and renames it into place (the
    rename is atomic: a reader finds the whole file or none; writers on several nodes of a shared
    filesystem each write their own temporary file)."""
    os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
    temporary = f"{cache_path}.{socket.gethostname()}-{os.getpid()}.tmp"
    lengths = [len(c.ids) for c in chat.conversations]
    meta = {"format": CACHE_FORMAT, "path": os.path.abspath(chat.path), "lines": chat.lines,
            "truncated": chat.truncated, "dropped": chat.dropped}
    try:
        with open(temporary, "wb") as f:
            numpy.savez(f, meta=numpy.asarray(json.dumps(meta)),
                        ids=numpy.concatenate([c.ids for c in chat.conversations]),
                        loss=numpy.concatenate([c.loss for c in chat.conversations]),
                        offsets=numpy.concatenate([[0], numpy.cumsum(lengths)]),
                        line_numbers=numpy.asarray(
                            [int(c.where.rpartition(":")[2] or 0) for c in chat.conversations]),
                        **chat_images.cache_arrays(chat.conversations))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, cache_path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def load_chat_file(path: str, hf_tokenizer, seq_length: int, loss_on: str, overlong: str,
                   cache_dir: Optional[str] = None, write_cache: bool = False,
                   tokenize: bool = True) -> Optional[ChatFile]:
    """``read_chat_file`` once per process for the same file and settings (validation reads it
    before training, the dataset builder again). With ``cache_dir``: read from its cache file if
    there is one, else tokenized (None if not ``tokenize``) and, if ``write_cache``, cached; a
    cache that cannot be written is said and skipped (the next start tokenizes again)."""
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size,
           os.path.abspath(hf_tokenizer.name_or_path), seq_length, loss_on, overlong)
    if key in _FILES:
        return _FILES[key]
    cache_path = (chat_cache_path(path, hf_tokenizer, seq_length, loss_on, overlong, cache_dir)
                  if cache_dir else None)
    chat = read_chat_cache(cache_path, path) if cache_path else None
    if chat is not None:  # its images still there as they were tokenized (a stat each)
        chat_images.check_unchanged(chat.conversations, ChatDataError)
    if chat is None:
        if not tokenize:
            return None
        chat = read_chat_file(path, hf_tokenizer, seq_length, loss_on, overlong)
        if cache_path and write_cache:
            try:
                write_chat_cache(chat, cache_path)
                print(f"[data] {path}: tokenized conversations cached in {cache_path}",
                      flush=True)
            except OSError as err:
                print(f"[data] warning: the tokenized conversations of {path} cannot be cached "
                      f"in {cache_dir} ({err.strerror}); the next start tokenizes again",
                      flush=True)
    _FILES[key] = chat
    return chat


class ChatDataset(MegatronDataset):
    """Packed rows of one split of a chat JSONL file, repeated in a new seeded order per epoch.

    ``self[i]``: ``tokens``, ``labels`` (int64), ``loss_mask`` (float32), ``position_ids``
    (restarting at 0 in every document), each [seq_length], ``lengths`` (int64: the row's
    documents, then its padding if any) and ``padded_lengths`` (the slots each takes, a multiple
    of ``pad_to_multiple``; they sum to seq_length). A row with images also has their pixels
    (``chat_images.row_images``): its documents' images in order (unless ``config.images`` is
    False)."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatFile) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: ChatDatasetConfig) -> ChatFile:
        return load_chat_file(dataset_path, config.hf_tokenizer, config.sequence_length,
                              config.loss_on, config.overlong, cache_dir=config.path_to_cache)

    @staticmethod
    def _key_config_attributes() -> list:
        return super(ChatDataset, ChatDataset)._key_config_attributes() + [
            "loss_on", "overlong", "pack", "pad_to_multiple"]

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        s = config.sequence_length
        documents = [dataset.conversations[i] for i in indices]
        self.rows = [[documents[i] for i in row] for row in pack_documents(
            [self._padded(len(d.ids) - 1) for d in documents], s, config.pack)]
        count = num_samples if num_samples is not None else len(self.rows)
        epochs = -(-count // len(self.rows)) if self.rows else 0
        rng = numpy.random.RandomState(config.random_seed)
        order = [rng.permutation(len(self.rows)) for _ in range(epochs)]
        self.order = numpy.concatenate(order)[:count] if order else numpy.zeros(0, dtype=int)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        s = self.config.sequence_length
        tokens, labels = numpy.zeros(s, dtype=numpy.int64), numpy.zeros(s, dtype=numpy.int64)
        loss_mask, position_ids = numpy.zeros(s, dtype=numpy.float32), numpy.zeros(s, numpy.int64)
        lengths, padded, at = [], [], 0
        for doc in self.rows[self.order[idx]]:
            n, slots = len(doc.ids) - 1, self._padded(len(doc.ids) - 1)
            tokens[at:at + n], labels[at:at + n] = doc.ids[:-1], doc.ids[1:]
            loss_mask[at:at + n] = doc.loss[1:]
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
        images = [image for doc in self.rows[self.order[idx]] for image in doc.images]
        if images and self.config.images:  # read, checked, processed in the DataLoader's workers
            processor = chat_images.processor_for(self.config.hf_tokenizer.name_or_path,
                                                  images[0].where, ChatDataError)
            row.update(chat_images.row_images(images, tokens, processor, ChatDataError))
        return row

    def _padded(self, length: int) -> int:
        """The slots a document of ``length`` positions takes: a multiple of pad_to_multiple."""
        multiple = self.config.pad_to_multiple
        return -(-length // multiple) * multiple

    def loss_token_share(self) -> float:
        """Loss tokens over all slots of the split's rows (what packing raises)."""
        loss = sum(int(d.loss[1:].sum()) for row in self.rows for d in row)
        return loss / max(1, len(self.rows) * self.config.sequence_length)
