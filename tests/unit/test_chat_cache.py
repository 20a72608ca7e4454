"""The tokenization cache of chat data (``mcore_ext.data.chat.load_chat_file`` with a cache
directory; issue 33): a second start reads the cache without calling the tokenizer and packs the
same rows; a changed byte of the file or a changed loss_on is another cache; a temporary file
left by a killed writer is never read; a bad line raises file:line and writes nothing. On 2 gloo
ranks through the launcher's config validation: the first rank tokenizes and caches, the other
tokenizes nothing, and a later start tokenizes nothing on either rank.

The file is the first 24 conversations of the tiny recipe's configs/sft_tiny/chat.jsonl, the
tokenizer its byte-level ChatML one. The reference is the file tokenized without a cache
(``read_chat_file``).
"""

import os
from pathlib import Path

import numpy
import pytest

from mcore_ext.data import chat

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "configs" / "sft_tiny" / "tokenizer"
RECIPE = ROOT / "configs" / "step35_sft_tiny_cpu.yaml"
SEQ = 128


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


def _write_data(folder: Path, count: int = 24) -> Path:
    lines = (ROOT / "configs" / "sft_tiny" / "chat.jsonl").read_text().splitlines(True)[:count]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "chat.jsonl"
    path.write_text("".join(lines))
    return path


@pytest.fixture
def calls(monkeypatch):
    """Counts ``tokenize_conversation`` calls; a fresh per-process memo (``_FILES``)."""
    counted = {"n": 0}
    tokenize = chat.tokenize_conversation

    def counting(*args, **kwargs):
        counted["n"] += 1
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(chat, "tokenize_conversation", counting)
    monkeypatch.setattr(chat, "_FILES", {})
    return counted


def _load(path, tokenizer, cache, loss_on="assistant", **kwargs):
    chat._FILES.clear()  # a new process: only the cache carries over
    return chat.load_chat_file(str(path), tokenizer, SEQ, loss_on, "truncate",
                               cache_dir=str(cache), **kwargs)


def _rows(source: chat.ChatFile) -> list:
    from megatron.core.datasets.utils import Split

    config = chat.ChatDatasetConfig(random_seed=1, sequence_length=SEQ, split="1,0,0",
                                    tokenizer=None, hf_tokenizer=None, pad_to_multiple=2)
    dataset = chat.ChatDataset(source, "x", numpy.arange(len(source)), None, Split.train, config)
    return [dataset[i] for i in range(len(dataset))]


def _same_file(a: chat.ChatFile, b: chat.ChatFile) -> None:
    assert (a.lines, a.truncated, a.dropped, len(a)) == (b.lines, b.truncated, b.dropped, len(b))
    for x, y in zip(a.conversations, b.conversations):
        assert x.ids.dtype == y.ids.dtype and numpy.array_equal(x.ids, y.ids)
        assert x.loss.dtype == y.loss.dtype and numpy.array_equal(x.loss, y.loss)


def test_second_start_reads_the_cache_and_packs_the_same_rows(tokenizer, tmp_path, calls):
    path = _write_data(tmp_path / "data", 24)
    # one conversation longer than seq_length: the counts line must come back from the cache
    reference = chat.read_chat_file(str(path), tokenizer, 64)
    assert reference.truncated + reference.dropped > 0
    reference = chat.read_chat_file(str(path), tokenizer, SEQ)
    calls["n"] = 0
    first = _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert calls["n"] == 24
    (cached,) = os.listdir(tmp_path / "cache")
    assert cached.startswith("chat-") and cached.endswith(".npz")
    assert os.listdir(tmp_path / "data") == ["chat.jsonl"]  # nothing beside the user's file
    second = _load(path, tokenizer, tmp_path / "cache")
    assert calls["n"] == 24  # read from the cache: the tokenizer is not called
    _same_file(second, reference)
    _same_file(first, reference)
    assert second.summary(SEQ) == reference.summary(SEQ)
    for got, want in zip(_rows(second), _rows(reference), strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and numpy.array_equal(got[key], want[key])
    # at seq_length 64 some are cut or dropped: the counts line comes back from the cache
    for _ in range(2):
        chat._FILES.clear()
        before = calls["n"]
        cut = chat.load_chat_file(str(path), tokenizer, 64, "assistant", "truncate",
                                  cache_dir=str(tmp_path / "cache"), write_cache=True)
    assert calls["n"] == before  # the second read
    assert cut.summary(64) == chat.read_chat_file(str(path), tokenizer, 64).summary(64)
    assert "longer than seq_length 64" in cut.summary(64)


def test_a_changed_byte_or_loss_on_is_another_cache(tokenizer, tmp_path, calls):
    path = _write_data(tmp_path / "data", 8)
    first = _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert calls["n"] == 8
    text = path.read_text()
    at = text.index('"content": "') + len('"content": "')
    stat = path.stat()
    path.write_text(text[:at] + ("X" if text[at] != "X" else "Y") + text[at + 1:])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: the bytes
    changed = _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert calls["n"] == 16  # tokenized again
    _same_file(changed, chat.read_chat_file(str(path), tokenizer, SEQ))
    assert [c.ids.tolist() for c in changed.conversations] != [
        c.ids.tolist() for c in first.conversations]
    calls["n"] = 0
    last = _load(path, tokenizer, tmp_path / "cache", loss_on="last_turn", write_cache=True)
    assert calls["n"] == 8
    _same_file(last, chat.read_chat_file(str(path), tokenizer, SEQ, loss_on="last_turn"))
    assert len(os.listdir(tmp_path / "cache")) == 3
    calls["n"] = 0
    _load(path, tokenizer, tmp_path / "cache")  # each of them is read back
    _load(path, tokenizer, tmp_path / "cache", loss_on="last_turn")
    assert calls["n"] == 0


def test_a_changed_tokenizer_file_is_another_cache_its_weights_are_not_read(tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = shutil.copytree(TOKENIZER, tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    path = _write_data(tmp_path / "data", 2)

    def cache_path():
        return chat.chat_cache_path(str(path), tokenizer, SEQ, "assistant", "truncate", "c")

    before = cache_path()
    (folder / "model.safetensors").write_bytes(b"weights")  # a model folder's weights
    assert cache_path() == before
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert cache_path() != before


def test_a_killed_writers_temporary_file_is_never_read(tokenizer, tmp_path, calls, monkeypatch):
    path, cache = _write_data(tmp_path / "data", 8), tmp_path / "cache"
    final = chat.chat_cache_path(str(path), tokenizer, SEQ, "assistant", "truncate", str(cache))
    cache.mkdir()
    leftover = Path(f"{final}.otherhost-12345.tmp")  # a writer killed before its rename
    leftover.write_bytes(b"PK\x03\x04 half a zip")
    # a write that fails midway (disk full) leaves neither its temporary file nor the cache
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(numpy, "savez", fail)
    _load(path, tokenizer, cache, write_cache=True)
    assert sorted(os.listdir(cache)) == [leftover.name]
    monkeypatch.undo()
    monkeypatch.setattr(chat, "tokenize_conversation", lambda *a, **k: pytest.fail("tokenized"))
    assert _load(path, tokenizer, cache, tokenize=False) is None  # the leftover is not a cache
    Path(final).write_bytes(leftover.read_bytes())  # not a cache file (a disk error): ignored
    assert _load(path, tokenizer, cache, tokenize=False) is None
    monkeypatch.undo()
    loaded = _load(path, tokenizer, cache, write_cache=True)  # and written over
    assert sorted(os.listdir(cache)) == sorted([leftover.name, os.path.basename(final)])
    _same_file(_load(path, tokenizer, cache, tokenize=False), loaded)


def test_a_bad_line_raises_file_and_line_and_caches_nothing(tokenizer, tmp_path, calls):
    path = _write_data(tmp_path / "data", 4)
    path.write_text(path.read_text() + "{'role': 'user'}\n")
    with pytest.raises(chat.ChatDataError, match=f"^{path}:5: not JSON"):
        _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


def _validate_twice(data: str, cache: str) -> dict:
    """On every rank: the recipe's config validated for 2 ranks as two starts in a row, the
    tokenizer calls of each (a start is a new process: the memo is cleared)."""
    from mcore_ext.training.config import ConfigError, load_config

    calls, tokenize = [], chat.tokenize_conversation
    chat.tokenize_conversation = lambda *a, **k: (calls.append(1), tokenize(*a, **k))[1]
    try:
        counts = []
        for _ in range(2):
            chat._FILES.clear()
            before = len(calls)
            try:
                load_config(str(RECIPE), [f"data.path={data}", f"data.cache_dir={cache}"],
                            world_size=2)
                error = None
            except ConfigError as err:
                error = str(err)
            counts.append((len(calls) - before, error))
        return {"counts": counts, "cache": sorted(os.listdir(cache)) if os.path.isdir(cache)
                else []}
    finally:
        chat.tokenize_conversation = tokenize
        chat._FILES.clear()


def test_first_rank_caches_and_the_other_tokenizes_nothing_on_gloo(tmp_path, run_distributed):
    path = _write_data(tmp_path / "data", 24)
    first, second = run_distributed(_validate_twice, str(path), str(tmp_path / "cache"),
                                    world_size=2)
    assert first["counts"] == [(24, None), (0, None)], first
    assert second["counts"] == [(0, None), (0, None)], second
    assert len(first["cache"]) == 1 and first["cache"] == second["cache"]
    # a bad line: the same file:line error on both ranks, and no cache
    bad = _write_data(tmp_path / "bad", 4)
    bad.write_text(bad.read_text() + "{'role': 'user'}\n")
    for result in run_distributed(_validate_twice, str(bad), str(tmp_path / "bad_cache"),
                                  world_size=2):
        errors = [error for _, error in result["counts"]]
        assert all(e and e.startswith(f"{bad}:5: not JSON (") for e in errors), result
        assert result["cache"] == []
