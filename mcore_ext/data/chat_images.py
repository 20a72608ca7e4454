"""Images in chat data (``data.source: chat``): conversations in transformers' content-list form,
rendered with the model's own processor (Step-3.7's ``Step3p7Processor``, or any processor of the
same kind), and the pixels of a packed row.

A message's ``content`` is a string or a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "path": "cat.png"}`` (a local file, relative to the JSONL file or absolute).
A conversation with an image is rendered by ``AutoProcessor.from_pretrained(data.tokenizer)``:
its chat template writes one placeholder (``processor.image_token``, ``<im_patch>``) per image,
then the processor itself expands each into the image's tokens (Step-3.7: per local crop
``<patch_start>`` + placeholders + ``<patch_end>`` (+ ``<patch_newline>``), then ``<im_start>`` +
the global view's placeholders + ``<im_end>``) and tokenizes the text, exactly as
``processor(text=..., images=...)`` does for a user. Which tokens carry loss is found as for text
(``chat.tokenize_conversation``: renderings of the conversation's prefixes); an image's tokens
never do.

Errors name the file and line (``error``: the caller's ValueError subclass, as
``mcore_ext.userfiles``): a missing or unreadable image, one that is not an image or is
truncated (decoded in full when the file is tokenized), a template that renders another number of
placeholders than the conversation has images (a text part that writes ``<im_patch>`` itself, a
template that leaves an image out), a placeholder the tokenizer does not keep whole.

What is stored and what is read at use: the tokenized conversations (``chat.load_chat_file``'s
store, a conversation's images its side record: ``image_records``) keep, per image, the path as
written, its size in bytes, the SHA-256 of its bytes and its layout (local crops, token span,
placeholders), never pixels: a row's images are read, hashed and
decoded when the row is built (``row_images``), so the bytes a step trains on are the bytes that
were checked, and an image changed since it was tokenized is an error there
(``FILE:LINE: image ... changed``), not other pixels under the old tokens. A start that reads the
store checks every image's size on disk (a ``stat``, not a read: ``check_unchanged``), so a
missing or resized image stops the run before training; an image rewritten to the same size is
found when its row is first built.
"""

import contextlib
import functools
import hashlib
import importlib.util
import io
import os
from dataclasses import dataclass

import numpy
import torch

# The files that make a folder a processor's (transformers writes one or the other).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# A micro-batch's images: transformers' names, which are the vision-language model's keywords.
IMAGE_KEYS = ("pixel_values", "pixel_values_local", "num_local_patches")
# Keys of an image part that transformers reads but this reader does not (no download here).
_OTHER_SOURCES = ("url", "image", "base64")


@dataclass(frozen=True)
class ImageRef:
    """One image of a tokenized conversation: ``source`` as the JSONL line gives it, ``path``
    resolved, its ``nbytes`` and ``sha256`` when tokenized, ``num_local_patches`` (local crops),
    its tokens ``ids[start:end]`` in the conversation (every image token: starts, ends, newlines,
    placeholders), ``placeholders`` of them the image's features replace, ``where`` FILE:LINE."""

    source: str
    path: str
    nbytes: int
    sha256: str
    num_local_patches: int
    start: int
    end: int
    placeholders: int
    where: str


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while a processor works on a few small tensors: its intra-op threads
    only cost there (x1000 a tensor op on a loaded 2-core machine), and in the DataLoader's
    workers torch runs on one anyway. Restored after: training's own thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def image_sources(messages: list, where: str, error) -> list:
    """The image paths of a conversation in the order its parts give them (message by message);
    checks every list ``content``'s parts."""
    sources = []
    for number, message in enumerate(messages, start=1):
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise error(f"{where}: message {number} has no string 'content' nor a list of parts")
        for index, part in enumerate(content, start=1):
            label = f"{where}: message {number} part {index}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise error(f"{label} (text) has no string 'text'")
            elif kind == "image":
                path = part.get("path")
                if not isinstance(path, str) or not path:
                    other = [key for key in _OTHER_SOURCES if key in part]
                    raise error(f"{label} (image) has no 'path' (a local file, relative to the "
                                "JSONL file)" + (f"; {other[0]!r} is not read here"
                                                 if other else ""))
                sources.append(path)
            else:
                raise error(f"{label} is not {{'type': 'text', 'text': ...}} nor "
                            "{'type': 'image', 'path': ...}")
    return sources


def has_processor(folder: str) -> bool:
    """Whether ``folder`` holds a processor's config (an image processor beside the tokenizer)."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in PROCESSOR_FILES)


@functools.lru_cache(maxsize=None)
def _load_processor(folder: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder, local_files_only=True)


def processor_for(folder: str, where: str, error):
    """The processor of the tokenizer folder ``folder`` (loaded once per process); ``error``
    names ``where`` when there is none, or it cannot be loaded or has no image token."""
    if not has_processor(folder):
        raise error(f"{where}: the conversation has images, but data.tokenizer={folder!r} has no "
                    f"image processor ({' or '.join(PROCESSOR_FILES)}): name the model's folder")
    missing = [name for name, module in (("torchvision", "torchvision"), ("Pillow", "PIL"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise error(f"{where}: the conversation has images, which the model's image processor "
                    f"reads with {' and '.join(missing)}: pip install {' '.join(missing)}")
    try:
        processor = _load_processor(os.path.abspath(folder))
    except Exception as err:  # transformers fails in many ways on a broken folder
        raise error(f"{where}: the image processor of data.tokenizer={folder!r} cannot be loaded "
                    f"({type(err).__name__}: {' '.join(str(err).split())})") from None
    if (getattr(processor, "image_processor", None) is None
            or getattr(processor, "image_token", None) is None
            or getattr(processor, "image_token_id", None) is None):
        raise error(f"{where}: data.tokenizer={folder!r}: {type(processor).__name__} has no image "
                    "processor and image token")
    return processor


def read_image(path: str, source: str, where: str, error, sha256: str = None):
    """(the image as transformers' ``load_image`` gives it, its bytes' size, their SHA-256),
    decoded in full from the bytes read once; ``sha256``: the digest they must have."""
    from PIL import Image, UnidentifiedImageError
    from transformers.image_utils import load_image

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise error(f"{where}: image {source!r} cannot be read ({err.strerror}: {path})") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise error(f"{where}: image {source!r} changed since the conversations were tokenized "
                    f"(SHA-256 {digest[:16]}..., was {sha256[:16]}...): restore it, or delete the "
                    "cached tokenization (data.cache_dir) to tokenize the file again")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # every byte decoded: a truncated file fails here, not in a worker later
        image = load_image(image)  # transformers' own: EXIF orientation, RGB
    except UnidentifiedImageError:
        raise error(f"{where}: image {source!r} is not an image file that can be read "
                    f"({path})") from None
    except Image.DecompressionBombError as err:  # Pillow's limit against decompression bombs
        raise error(f"{where}: image {source!r} is larger than Pillow decodes ({path}: "
                    f"{' '.join(str(err).split())})") from None
    except Exception as err:  # PIL's truncated / corrupt data: OSError, SyntaxError, zlib...
        raise error(f"{where}: image {source!r} is truncated or corrupt ({path}: "
                    f"{type(err).__name__}: {' '.join(str(err).split())})") from None
    return image, len(data), digest


def encode(text: str, sources: list, base_dir: str, processor, where: str, error):
    """The rendered conversation ``text`` (one placeholder per image) and its images -> (ids,
    each token's start in ``text``, ``ImageRef``s) through ``processor(text=..., images=...)``.

    A token inside an image's expansion starts, in ``text``, where the image's placeholder does
    (so the loss spans found on ``text`` apply)."""
    token = processor.image_token
    rendered = text.count(token)
    if rendered != len(sources):
        raise error(f"{where}: the chat template renders {rendered} image placeholder(s) "
                    f"({token}) for {len(sources)} image(s): a text part that writes {token} "
                    "itself, or a template that leaves an image out")
    paths = [os.path.normpath(os.path.join(base_dir, source)) for source in sources]
    read = [read_image(path, source, where, error) for path, source in zip(paths, sources)]
    try:
        with _one_thread():
            out = processor(text=[text], images=[image for image, _, _ in read],
                            return_offsets_mapping=True, return_text_replacement_offsets=True,
                            add_special_tokens=False)
    except Exception as err:
        raise error(f"{where}: the processor does not take it: {type(err).__name__}: "
                    f"{' '.join(str(err).split())}") from None
    ids = numpy.asarray(out["input_ids"][0], dtype=numpy.int64)
    expanded = numpy.asarray([start for start, _ in out["offset_mapping"][0]], dtype=numpy.int64)
    replacements = [r for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
    starts, images = expanded.copy(), []
    for number, (replacement, path, source, (_, nbytes, digest)) in enumerate(
            zip(replacements, paths, sources, read), start=1):
        (old_begin, old_end), (begin, end) = replacement["span"], replacement["new_span"]
        inside = (expanded >= begin) & (expanded < end)
        starts[inside] = old_begin
        starts[expanded >= end] -= (end - begin) - (old_end - old_begin)
        span = numpy.flatnonzero(inside)
        expected = replacement["replacement"].count(token)
        found = int((ids[span] == processor.image_token_id).sum()) if len(span) else 0
        if not len(span) or span[-1] - span[0] + 1 != len(span) or found != expected:
            raise error(f"{where}: image {number} ({source!r}) is {expected} placeholder(s) "
                        f"{token} in the text but {found} token(s) {processor.image_token_id} "
                        "after tokenizing: the tokenizer does not keep the placeholder whole")
        images.append(ImageRef(source, path, nbytes, digest,
                               int(out["num_local_patches"][number - 1]), int(span[0]),
                               int(span[-1]) + 1, expected, where))
    return ids, starts, tuple(images)


def check_unchanged(chat, error) -> None:
    """Every image of a stored ``chat`` (``data.chat.ChatFile``) is still there at the size it
    was tokenized at (a stat each; its bytes are checked when read: ``row_images``)."""
    for i in chat.with_images():
        for image in chat.images(int(i)):
            try:
                size = os.stat(image.path).st_size
            except OSError as err:
                raise error(f"{image.where}: image {image.source!r} cannot be read "
                            f"({err.strerror}: {image.path})") from None
            if size != image.nbytes or not os.access(image.path, os.R_OK):
                raise error(f"{image.where}: image {image.source!r} changed since the "
                            f"conversations were tokenized ({size} bytes, was {image.nbytes}): "
                            "restore it, or delete the cached tokenization (data.cache_dir) to "
                            "tokenize the file again")


def stray_placeholders(chat, image_token_id: int, error) -> None:
    """A conversation of ``chat`` (``data.chat.ChatFile``) without images whose tokens hold the
    image token (its text writes the placeholder): nothing would fill it, so it is an error
    naming its line."""
    stray = numpy.setdiff1d(chat.holding(image_token_id), chat.with_images())
    if len(stray):
        raise error(f"{chat.where(int(stray[0]))}: the conversation has no image but its text "
                    f"holds the image placeholder (token {image_token_id})")


def row_images(images: list, tokens: numpy.ndarray, processor, error) -> dict:
    """The pixels of one row's ``images`` (its documents' in order), as
    ``processor.image_processor`` makes them: ``pixel_values`` [n, 3, H, W], ``num_local_patches``
    [n] int64 and ``pixel_values_local`` [crops, 3, h, w] (when there are crops). Every image's
    bytes are checked against the digest it was tokenized with, and the row's placeholders in
    ``tokens`` against the features its images give. Which feature a placeholder takes is the
    model's to find (transformers' rule: the n-th placeholder of the micro-batch read row-major
    takes the n-th feature; ``mcore_ext.vision.placement``)."""
    decoded = [read_image(image.path, image.source, image.where, error, image.sha256)[0]
               for image in images]
    with _one_thread():
        out = processor.image_processor(decoded, return_tensors="pt")
    for image, crops in zip(images, out["num_local_patches"]):
        if int(crops) != image.num_local_patches:
            raise error(f"{image.where}: image {image.source!r} now gives {int(crops)} local "
                        f"crops, {image.num_local_patches} when tokenized: the processor changed; "
                        "delete the cached tokenization (data.cache_dir)")
    placeholders = int((tokens == processor.image_token_id).sum())
    if placeholders != sum(image.placeholders for image in images):
        raise error(f"{images[0].where}: a packed row holds {placeholders} image placeholders "
                    f"for {sum(image.placeholders for image in images)} image features")
    row = {"pixel_values": out["pixel_values"],
           "num_local_patches": torch.as_tensor(out["num_local_patches"], dtype=torch.int64)}
    if "pixel_values_local" in out:
        row["pixel_values_local"] = out["pixel_values_local"]
    return row


def collate(samples: list) -> dict:
    """The image keys of a micro-batch of rows (``row_images``' keys where a row has images):
    pixel tensors and crop counts concatenated in row order, which is the order of the rows'
    placeholders in the micro-batch."""
    rows = [x for x in samples if "pixel_values" in x]
    batch = {"pixel_values": torch.cat([x["pixel_values"] for x in rows]),
             "num_local_patches": torch.cat([x["num_local_patches"] for x in rows])}
    local = [x["pixel_values_local"] for x in rows if "pixel_values_local" in x]
    if local:
        batch["pixel_values_local"] = torch.cat(local)
    return batch


# ------------------------------------------------------------------------- the store's records

def image_records(images) -> list:
    """A conversation's ``ImageRef``s as the JSON its store keeps (its side record): per image
    the source as written, size, SHA-256, crops and token span; never pixels or the resolved
    path (the store may be read from another mount of the data)."""
    return [[i.source, i.nbytes, i.sha256, i.num_local_patches, i.start, i.end, i.placeholders]
            for i in images]


def images_from_record(record: list, base_dir: str, where: str) -> tuple:
    """``image_records``' JSON back as ``ImageRef``s, sources resolved against ``base_dir``."""
    return tuple(ImageRef(str(source), os.path.normpath(os.path.join(base_dir, str(source))),
                          int(nbytes), str(sha256), int(crops), int(start), int(end),
                          int(placeholders), where)
                 for source, nbytes, sha256, crops, start, end, placeholders in record)
