"""Chat data with images (``mcore_ext.data.chat_images`` through ``mcore_ext.data.chat``; issue 55).

The processor is the repository's tiny Step-3.7 one (configs/vl_tiny/processor: Step3p7Processor,
a 112 px global view of 4 placeholders, 56 px local crops of 1, a ChatML template over content
lists whose assistant turns are ``{% generation %}`` blocks). The independent reference is
transformers' own processor called directly on the same conversation,
``processor.apply_chat_template(..., tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)``: its input_ids and pixel tensors, and its assistant mask
less the image tokens (named here: placeholders, crop and image starts / ends / newlines) as the
loss flags. The pictures: a 112 x 112 one (global view only), a 112 x 56 one (2 crops side by
side) and a 56 x 112 one (2 crops stacked: a newline token between them).
"""

import json
import os
import shutil
import types
from pathlib import Path

import numpy
import pytest
import torch

from mcore_ext.data import chat, chat_images, shapes

pytest.importorskip("torchvision", reason="the Step-3.7 image processor needs torchvision")
pytest.importorskip("PIL", reason="images are decoded with Pillow")

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR = ROOT / "configs" / "vl_tiny" / "processor"
IMAGE_TOKENS = ("<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>",
                "<im_end>")
PLACEHOLDER = 259  # <im_patch> in the tiny tokenizer


def _picture(folder: Path, name: str, width: int, height: int, colour="red") -> None:
    image = shapes.draw("circle", shapes.COLOURS[colour], shapes.BACKGROUNDS["white"], width,
                        height, min(width, height) / 4, width / 2, height / 2)
    (folder / name).write_bytes(shapes.png_bytes(image))


def _user(*parts):
    return {"role": "user", "content": [{"type": "image", "path": p} if p.endswith(".png")
                                        else {"type": "text", "text": p} for p in parts]}


def _answer(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


# 0, 1 and 2 images; the images in a first and a later user turn, answers after each.
CONVERSATIONS = [
    [_user("Say hi."), _answer("Hi."), _user("Again?"), _answer("Hi again.")],
    [_user("tall.png", "What is it?"), _answer("A red circle."), _user("Sure?"),
     _answer("Yes.")],
    [_user("What is this?", "wide.png"), _answer("A wide one."), _user("square.png", "And?"),
     _answer("A square one.")],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vl")
    _picture(folder, "square.png", 112, 112, "blue")
    _picture(folder, "wide.png", 112, 56, "green")
    _picture(folder, "tall.png", 56, 112)
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PROCESSOR, local_files_only=True)


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(PROCESSOR, local_files_only=True)


def _write(folder: Path, conversations, name="chat.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def _reference(processor, folder: Path, messages) -> dict:
    """transformers' processor on the conversation, image paths made absolute."""
    absolute = json.loads(json.dumps(messages))
    for message in absolute:
        for part in message["content"]:
            if part["type"] == "image":
                part["path"] = str(folder / part["path"])
    out = processor.apply_chat_template(absolute, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, return_tensors="pt")
    image_ids = processor.tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    ids = out["input_ids"][0].numpy()
    out["loss"] = out["assistant_masks"][0].numpy().astype(bool) & ~numpy.isin(ids, image_ids)
    return out


def test_ids_loss_and_pixels_equal_the_processors_with_0_1_2_images(folder, tokenizer,
                                                                      processor):
    chat_file = chat.read_chat_file(str(_write(folder, CONVERSATIONS)), tokenizer, 512)
    assert len(chat_file) == 3
    for number, (messages, got) in enumerate(zip(CONVERSATIONS, chat_file.conversations), 1):
        expected = _reference(processor, folder, messages)
        assert got.ids.tolist() == expected["input_ids"][0].tolist(), number
        assert got.loss.tolist() == expected["loss"].tolist(), number
        assert got.where == f"{folder / 'chat.jsonl'}:{number}"
        assert [i.source for i in got.images] == [p["path"] for m in messages
                                                  for p in m["content"] if p["type"] == "image"]
        if not got.images:
            assert "pixel_values" not in expected
            continue
        ref_crops = expected["num_local_patches"].tolist()
        assert [i.num_local_patches for i in got.images] == ref_crops
        # the row's pixels, as the DataLoader builds them, are the processor's
        row = chat_images_row(got, processor)
        assert torch.equal(row["pixel_values"], expected["pixel_values"])
        assert torch.equal(row["num_local_patches"], torch.tensor(ref_crops))
        assert torch.equal(row["pixel_values_local"], expected["pixel_values_local"])
    # the 2-crop pictures: side by side without, stacked with a newline between the crops
    tall, wide = chat_file.conversations[1].images[0], chat_file.conversations[2].images[0]
    newline = tokenizer.convert_tokens_to_ids("<patch_newline>")
    assert (chat_file.conversations[1].ids[tall.start:tall.end] == newline).sum() == 1
    assert (chat_file.conversations[2].ids[wide.start:wide.end] == newline).sum() == 0
    assert tall.placeholders == wide.placeholders == 2 * 1 + 4
    # loss on every token (loss_on=all) but the images'
    every = chat.read_chat_file(str(folder / "chat.jsonl"), tokenizer, 512, loss_on="all")
    image_ids = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    for conversation in every.conversations:
        assert conversation.loss.tolist() == (~numpy.isin(conversation.ids, image_ids)).tolist()


def chat_images_row(conversation, processor) -> dict:
    from mcore_ext.data import chat_images

    return chat_images.row_images(list(conversation.images), conversation.ids[:-1], processor,
                                  chat.ChatDataError)


def _dataset(chat_file, seq_length, tokenizer, pad_to_multiple=1, samples=None, images=True):
    from megatron.core.datasets.utils import Split

    config = chat.ChatDatasetConfig(random_seed=1, sequence_length=seq_length, split="1,0,0",
                                    tokenizer=None, hf_tokenizer=tokenizer,
                                    pad_to_multiple=pad_to_multiple, images=images)
    return chat.ChatDataset(chat_file, chat_file.path, numpy.arange(len(chat_file)),
                            samples or len(chat_file), Split.train, config)


def _features_per_image(processor, crops) -> list:
    return [int(c) * processor.num_patch_feature_size + processor.num_image_feature_size
            for c in crops]


def _feature_index(tokens) -> numpy.ndarray:
    """The feature row each slot's placeholder takes (-1 elsewhere), by the model's own rule
    (``placement.placeholder_order``: the n-th placeholder read row-major takes feature n)."""
    from mcore_ext.vision import placement

    order, _ = placement.placeholder_order(torch.as_tensor(tokens)[None], PLACEHOLDER)
    return order[0].numpy()


def test_packed_rows_keep_each_conversations_images_and_a_micro_batch_of_two_counts_on(
        folder, tokenizer, processor):
    """Best fit packs conversations out of file order; in every row, the placeholders of each
    document take (by the model's numbering of the placeholders) the features of that document's
    own images (the pixels transformers' processor gives for it alone), and a micro-batch of two
    rows carries the second row's images after the first's."""
    from mcore_ext.training.data import collate_packed

    order = [CONVERSATIONS[2], CONVERSATIONS[0], CONVERSATIONS[1], CONVERSATIONS[2][2:]]
    chat_file = chat.read_chat_file(str(_write(folder, order, "packed.jsonl")), tokenizer, 160)
    dataset = _dataset(chat_file, 160, tokenizer)
    lines = [[int(d.where.rpartition(":")[2]) for d in row] for row in dataset.rows]
    assert lines == [[1, 4], [2, 3]]  # line 4 joins line 1's row: images from 2 documents
    rows = [dataset[i] for i in range(len(dataset))]
    for row_docs, row in zip([dataset.rows[i] for i in dataset.order], rows):
        with_images = [d for d in row_docs if d.images]
        if not with_images:
            assert "pixel_values" not in row
            continue
        per_image = _features_per_image(processor, row["num_local_patches"])
        image_of_feature = numpy.repeat(numpy.arange(len(per_image)), per_image)
        at, image_rows, row_index = 0, [], _feature_index(row["tokens"])
        for doc in row_docs:
            n = len(doc.ids) - 1
            index = row_index[at:at + n]
            assert ((index >= 0) == (row["tokens"][at:at + n] == PLACEHOLDER)).all()
            images = sorted(set(image_of_feature[index[index >= 0]].tolist()))
            assert len(images) == len(doc.images)
            image_rows += images
            if doc.images:
                messages = order[int(doc.where.rpartition(":")[2]) - 1]
                expected = _reference(processor, folder, messages)
                assert torch.equal(row["pixel_values"][images], expected["pixel_values"])
            at += n
        assert image_rows == list(range(len(per_image)))  # in reading order, each once
    batch = collate_packed(rows[:2])
    first = [r for r in rows[:2] if "pixel_values" in r]
    assert torch.equal(batch["pixel_values"], torch.cat([r["pixel_values"] for r in first]))
    assert torch.equal(batch["num_local_patches"],
                       torch.cat([r["num_local_patches"] for r in first]))
    assert int((batch["tokens"] == PLACEHOLDER).sum()) == sum(
        _features_per_image(processor, batch["num_local_patches"]))
    assert "image_feature_index" not in batch  # the model numbers the placeholders itself


def test_rows_of_a_later_pipeline_stage_read_no_image(folder, tokenizer, tmp_path):
    """``ChatDatasetConfig.images=False`` (pipeline stages after the first, which run no tower):
    the same rows, tokens and loss, without pixels, and no image is read (the pictures are
    gone here: the first stage's rows would fail to read them)."""
    for name in ("square.png", "wide.png", "tall.png"):
        shutil.copyfile(folder / name, tmp_path / name)
    chat_file = chat.read_chat_file(str(_write(tmp_path, CONVERSATIONS)), tokenizer, 160)
    first = _dataset(chat_file, 160, tokenizer)
    later = _dataset(chat_file, 160, tokenizer, images=False)
    rows = [first[i] for i in range(len(first))]
    assert any("pixel_values" in row for row in rows)
    for name in ("square.png", "wide.png", "tall.png"):
        os.remove(tmp_path / name)
    for i, row in enumerate(rows):
        without = later[i]
        assert sorted(without) == sorted(k for k in row if k not in chat_images.IMAGE_KEYS)
        assert all(numpy.array_equal(without[k], row[k]) for k in without)


def test_truncation_cuts_before_an_image_it_would_split(folder, tokenizer):
    """A cut inside an image's tokens moves to the image's start: the image is left out whole
    (the model fills an image's placeholders whole or not at all); the first answer stays."""
    messages = [_user("Hi."), _answer("Hello there, how can I help?"),
                _user("tall.png", "What is it?"), _answer("A circle.")]
    path = _write(folder, [messages], "long.jsonl")
    full = chat.read_chat_file(str(path), tokenizer, 512).conversations[0]
    (image,) = full.images
    seq = image.start + 3  # 3 of its tokens would be inputs
    cut = chat.read_chat_file(str(path), tokenizer, seq)
    (conversation,) = cut.conversations
    assert cut.truncated == 1 and conversation.images == ()
    assert conversation.ids.tolist() == full.ids[:image.start].tolist()
    assert conversation.loss.tolist() == full.loss[:image.start].tolist()
    assert conversation.loss.any()


def _error(path, tokenizer, seq=512) -> str:
    with pytest.raises(chat.ChatDataError) as raised:
        chat.read_chat_file(str(path), tokenizer, seq)
    return str(raised.value)


@pytest.mark.parametrize("case, expected", [
    ("missing", "image 'gone.png' cannot be read (No such file or directory"),
    ("not_an_image", "image 'text.png' is not an image file that can be read"),
    ("truncated", "image 'cut.png' is truncated or corrupt"),
    ("two_placeholders", "the chat template renders 2 image placeholder(s) (<im_patch>) for 1 "
                         "image(s)"),
    ("stray_placeholder", "the conversation has no image but its text holds the image "
                          f"placeholder (token {PLACEHOLDER})"),
    ("url", "message 1 part 1 (image) has no 'path' (a local file, relative to the JSONL file); "
            "'url' is not read here"),
    ("no_processor", "the conversation has images, but data.tokenizer="),
    ("too_large", "image 'square.png' is larger than Pillow decodes"),
])
def test_bad_images_are_one_error_naming_file_and_line(folder, tokenizer, tmp_path, monkeypatch,
                                                       case, expected):
    good = [_user("square.png", "What?"), _answer("A circle.")]
    bad = {
        "missing": [_user("gone.png", "What?"), _answer("A circle.")],
        "not_an_image": [_user("text.png", "What?"), _answer("A circle.")],
        "truncated": [_user("cut.png", "What?"), _answer("A circle.")],
        "two_placeholders": [_user("square.png", "What is <im_patch>?"), _answer("A circle.")],
        "stray_placeholder": [_user("What is <im_patch>?"), _answer("A circle.")],
        "url": [{"role": "user", "content": [{"type": "image", "url": "https://x/a.png"}]},
                _answer("A circle.")],
        "no_processor": good,
        "too_large": good,
    }[case]
    (tmp_path / "square.png").write_bytes((folder / "square.png").read_bytes())
    (tmp_path / "text.png").write_text("not a picture\n")
    whole = (folder / "tall.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) * 2 // 3])
    path = _write(tmp_path, [good, bad, good])
    line = 1 if bad is good else 2  # the first line when every line is refused
    if case == "too_large":  # Pillow refuses past twice its limit: 112 x 112 > 2 x 1000
        from PIL import Image

        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    if case == "no_processor":  # the text model's tokenizer folder: no processor beside it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs" / "sft_tiny" / "tokenizer")
    message = _error(path, tokenizer)
    assert message.startswith(f"{path}:{line}: "), message
    assert expected in message, message
    if case == "stray_placeholder":  # the store's build refuses it too and leaves no store
        chat._FILES.clear()
        with pytest.raises(chat.ChatDataError) as raised:
            chat.load_chat_file(str(path), tokenizer, 512, "assistant", "truncate",
                                cache_dir=str(tmp_path / "cache"), write_cache=True)
        assert str(raised.value) == message
        cache = tmp_path / "cache"
        assert not cache.exists() or not [p for p in cache.iterdir() if p.suffix != ".lock"]


def test_launcher_refuses_a_truncated_image_in_one_line_and_writes_nothing(folder, tmp_path,
                                                                            capsys):
    from mcore_ext.training import main

    whole = (folder / "tall.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])
    path = _write(tmp_path, [[_user("cut.png", "What?"), _answer("A circle.")]] * 3)
    code = main(["--config", str(ROOT / "configs" / "step35_sft_tiny_cpu.yaml"), "--check",
                 "--world-size", "2", f"data.path={path}", f"data.tokenizer={PROCESSOR}",
                 f"checkpoint.save={tmp_path / 'ckpt'}", f"checkpoint.load={tmp_path / 'ckpt'}",
                 f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}:1: image 'cut.png' is "
                                                   "truncated or corrupt"), err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "cache").exists()


def test_the_cache_keeps_the_images_and_their_bytes_are_checked_at_start_and_at_use(
        folder, tokenizer, tmp_path):
    """A second start reads the cache (the same conversations and image records, nothing
    tokenized); an image resized or removed since is refused at start (a stat), one rewritten to
    the same size when its row is built (its SHA-256), each naming file and line (in a
    DataLoader worker too: the launcher says the worker's error alone)."""
    for name in ("square.png", "tall.png"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    path = _write(tmp_path, CONVERSATIONS[1:2] + [[_user("square.png", "?"), _answer("A.")]])
    cache = tmp_path / "cache"

    def load(**kwargs):
        chat._FILES.clear()  # a new process: only the cache carries over
        return chat.load_chat_file(str(path), tokenizer, 256, "assistant", "truncate",
                                   cache_dir=str(cache), **kwargs)

    # built by 2 worker processes, a line a chunk: the one-process path's conversations, images
    # included (their records are the store's side records)
    first = load(write_cache=True, workers=2, chunk_bytes=64)
    second = load(tokenize=False)  # None unless read from the cache
    assert second is not None and second.store is not None  # the memory-mapped store
    assert second.with_images().tolist() == [0, 1] and second.image_count() == 2
    reference = chat.read_chat_file(str(path), tokenizer, 256)
    for a, b, c in zip(reference.conversations, first.conversations, second.conversations):
        for x in (b, c):
            assert a.ids.tolist() == x.ids.tolist() and a.loss.tolist() == x.loss.tolist()
            assert a.images == x.images and a.where == x.where
    # the same size, other bytes: a start passes, the row that reads it does not
    original = (tmp_path / "square.png").read_bytes()
    other = bytearray(original)
    other[-20] ^= 0xFF  # inside IEND's CRC field's neighbourhood: same length
    (tmp_path / "square.png").write_bytes(bytes(other))
    dataset = _dataset(load(tokenize=False), 256, tokenizer)
    with pytest.raises(chat.ChatDataError) as raised:
        for i in range(len(dataset)):
            dataset[i]
    said = str(raised.value)
    assert said.startswith(f"{path}:2: image 'square.png' changed since the conversations "
                           "were tokenized (SHA-256"), said
    # raised in a DataLoader worker: the launcher's one line is the same error's
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    with pytest.raises(chat.ChatDataError) as raised:
        list(loader)
    assert "Traceback" in str(raised.value) and chat.data_error_line(raised.value) == said
    # another size: refused at start
    (tmp_path / "square.png").write_bytes(original + b"\0")
    with pytest.raises(chat.ChatDataError) as raised:
        load(tokenize=False)
    assert str(raised.value).startswith(f"{path}:2: image 'square.png' changed since the "
                                        f"conversations were tokenized ({len(original) + 1} "
                                        f"bytes, was {len(original)})"), raised.value
    os.remove(tmp_path / "square.png")
    with pytest.raises(chat.ChatDataError, match="image 'square.png' cannot be read"):
        load(tokenize=False)


def _delivered(path, seq_length):
    """This rank's micro-batch after cp_shard, at TP 2 x CP 2 (every rank builds the dataset and
    reads its micro-batch itself, as the launcher does)."""
    import mcore_ext
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from mcore_ext.training.data import batch_iterator, cp_shard, packed_seq_params
    from mcore_ext.vision import placement

    mcore_ext.init_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    tokenizer = AutoTokenizer.from_pretrained(PROCESSOR, local_files_only=True)
    chat_file = chat.read_chat_file(path, tokenizer, seq_length)
    dataset = _dataset(chat_file, seq_length, tokenizer, pad_to_multiple=4, samples=4)
    cfg = types.SimpleNamespace(
        training=types.SimpleNamespace(micro_batch_size=2),
        data=types.SimpleNamespace(num_workers=0, source="chat", document_masking=False),
        parallelism=types.SimpleNamespace(context_parallel_size=2, tensor_model_parallel_size=2))
    whole = next(batch_iterator(dataset, cfg))
    batch = cp_shard(whole)
    # the model's numbering of this rank's placeholders among the whole micro-batch's (one
    # all-gather over the CP group), and the unsplit micro-batch's numbering cut as the tokens
    batch["order"], batch["total"] = placement.placeholder_order(
        batch["tokens"], PLACEHOLDER, packed_seq_params(batch, "cpu"),
        ps.get_context_parallel_group())
    batch["unsplit"] = cp_shard(dict(whole, tokens=placement.placeholder_order(
        whole["tokens"], PLACEHOLDER)[0]))["tokens"]
    keep = ("tokens", "order", "unsplit", "pixel_values", "pixel_values_local",
            "num_local_patches")
    return (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
            {key: batch[key].numpy() for key in keep} | {"total": batch["total"]})


def test_tp2_cp2_ranks_get_the_same_images_and_their_share_of_the_placeholders(
        folder, run_distributed):
    """4 gloo ranks, TP 2 x CP 2 (one DP replica): the two TP ranks of a CP rank hold the same
    micro-batch, pixels included, bit for bit; both CP ranks hold every image of the micro-batch
    whole, and their shards of the tokens split its placeholders between them, which the
    model's numbering (``placement.placeholder_order`` over the CP group) gives each feature
    row exactly once, at placeholder tokens only, in the order of the unsplit micro-batch."""
    path = str(_write(folder, CONVERSATIONS * 2, "ranks.jsonl"))
    results = run_distributed(_delivered, path, 192, world_size=4)
    by_rank = {(tp, cp): batch for tp, cp, batch in results}
    assert sorted(by_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for cp in (0, 1):
        a, b = by_rank[(0, cp)], by_rank[(1, cp)]
        assert all(numpy.array_equal(a[key], b[key]) for key in a)
        assert numpy.array_equal(a["order"], a["unsplit"])
    a, b = by_rank[(0, 0)], by_rank[(0, 1)]
    for key in ("pixel_values", "pixel_values_local", "num_local_patches"):
        assert numpy.array_equal(a[key], b[key])
    assert len(a["num_local_patches"]) >= 2
    index = numpy.concatenate([a["order"][0], b["order"][0]])
    tokens = numpy.concatenate([a["tokens"][0], b["tokens"][0]])
    assert ((index >= 0) == (tokens == PLACEHOLDER)).all()
    assert a["order"].max() >= 0 and b["order"].max() >= 0
    crops = a["num_local_patches"]
    features = int(crops.sum()) * 1 + 4 * len(crops)
    assert sorted(index[index >= 0].tolist()) == list(range(features))
    assert a["total"] == b["total"] == features
