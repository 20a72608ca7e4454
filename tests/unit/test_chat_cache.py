"""The store of chat data's tokenized conversations (``mcore_ext.data.chat.load_chat_file`` with a
cache directory, ``mcore_ext.data.chat_store``; issues 33 and 56): a second start reads the store
without calling the tokenizer and packs the same rows; a changed byte of the file or a changed
loss_on is another store; a writer killed halfway (SIGKILL) leaves nothing a start takes for a
store, and the next start builds it whole; of two writers at once one builds, the other waits and
reads; worker processes build the same store as the one-process path, token for token; a bad line
raises file:line and writes nothing; a start reads the index only (its memory does not grow with
the conversations). On 2 gloo ranks through the launcher's config validation: the first rank
tokenizes and stores, the other tokenizes nothing, and a later start tokenizes nothing on either
rank; a blend of two files with weights and a validation file of its own.

The file is the first 24 conversations of the tiny recipe's configs/sft_tiny/chat.jsonl, the
tokenizer its byte-level ChatML one. The reference is the file tokenized without a cache in one
process (``read_chat_file``).
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
        assert x.where == y.where and x.where.startswith(f"{a.path}:")


def test_second_start_reads_the_cache_and_packs_the_same_rows(tokenizer, tmp_path, calls):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = _write_data(tmp_path / "data", 24)
    # one conversation longer than seq_length: the counts line must come back from the cache
    reference = chat.read_chat_file(str(path), tokenizer, 64)
    assert reference.truncated + reference.dropped > 0
    reference = chat.read_chat_file(str(path), tokenizer, SEQ)
    calls["n"] = 0
    first = _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert calls["n"] == 24
    (cached,) = os.listdir(tmp_path / "cache")  # one store, no lock or temporary left
    assert cached.startswith("chat-chat-")
    assert sorted(os.listdir(tmp_path / "cache" / cached)) == [
        "line_numbers.npy", "loss.bin", "loss.idx", "loss_counts.npy", "meta.json",
        "tokens.bin", "tokens.idx"]
    assert os.listdir(tmp_path / "data") == ["chat.jsonl"]  # nothing beside the user's file
    second = _load(path, tokenizer, tmp_path / "cache")
    assert calls["n"] == 24  # read from the store: the tokenizer is not called
    assert second.store is not None and second.ids(0).dtype == numpy.uint16  # megatron's dtype
    _same_file(second, reference)
    _same_file(first, reference)
    assert second.summary(SEQ) == reference.summary(SEQ)
    # megatron's own IndexedDataset reads the store's tokens and flags
    tokens = IndexedDataset(str(tmp_path / "cache" / cached / "tokens"))
    flags = IndexedDataset(str(tmp_path / "cache" / cached / "loss"))
    assert len(tokens) == len(flags) == 24
    for i, conversation in enumerate(reference.conversations):
        assert tokens[i].tolist() == conversation.ids.tolist()
        assert flags[i].astype(bool).tolist() == conversation.loss.tolist()
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


def test_a_leftover_temporary_store_and_a_failed_write_leave_nothing_that_is_read(
        tokenizer, tmp_path, calls, monkeypatch, capsys):
    path, cache = _write_data(tmp_path / "data", 8), tmp_path / "cache"
    final = Path(chat.chat_cache_path(str(path), tokenizer, SEQ, "assistant", "truncate",
                                      str(cache)))
    leftover = Path(f"{final}.otherhost-12345.tmp")  # a writer killed before its rename
    leftover.mkdir(parents=True)
    (leftover / "tokens.bin").write_bytes(b"\x01\x00" * 10)
    assert _load(path, tokenizer, cache, tokenize=False) is None  # the leftover is no store
    # a write that fails at its end (disk full) leaves neither its temporary store nor the
    # store, and the dead writer's leftover of the same key is cleared by the one that held
    # the lock after it; the conversations are tokenized in memory
    monkeypatch.setattr(chat.chat_store.StoreWriter, "finalize",
                        lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    _same_file(_load(path, tokenizer, cache, write_cache=True),
               chat.read_chat_file(str(path), tokenizer, SEQ))
    assert "cannot be cached" in capsys.readouterr().out
    assert os.listdir(cache) == []
    monkeypatch.undo()
    final.mkdir()  # a store's folder that is not one (a disk error): ignored, and built again
    (final / "meta.json").write_text("{")
    monkeypatch.setattr(chat, "tokenize_conversation", lambda *a, **k: pytest.fail("tokenized"))
    assert _load(path, tokenizer, cache, tokenize=False) is None
    monkeypatch.undo()
    loaded = _load(path, tokenizer, cache, write_cache=True)
    assert loaded.store is not None and os.listdir(cache) == [final.name]
    _same_file(_load(path, tokenizer, cache, tokenize=False), loaded)


def _write_store(path, cache, delay, out, render_calls=None):
    """In a forked process: the store of ``path`` written with ``delay`` seconds a
    conversation, in chunks of 3 lines or so; its tokenizer calls and output into ``out``."""
    import contextlib
    import io
    import json
    import time

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    chat._FILES.clear()
    calls, tokenize = [], chat.tokenize_conversation

    def slow(*args, **kwargs):
        calls.append(1)
        with open(f"{out}.calls", "a") as f:
            f.write("1")
        time.sleep(delay)
        return tokenize(*args, **kwargs)

    chat.tokenize_conversation = slow
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        loaded = chat.load_chat_file(str(path), tokenizer, SEQ, "assistant", "truncate",
                                     cache_dir=str(cache), write_cache=True, workers=1,
                                     chunk_bytes=300)
    Path(out).write_text(json.dumps({"calls": len(calls), "said": said.getvalue(),
                                     "ids": [c.ids.tolist() for c in loaded.conversations]}))


def _fork(*args):
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(target=_write_store, args=args)
    process.start()
    return process


def test_a_writer_killed_halfway_leaves_no_store_and_the_next_start_builds_it(tokenizer,
                                                                              tmp_path, calls):
    """A writer (a forked process) SIGKILLed once it has written part of its store: no store
    is taken from what it left; its lock died with it, so the next start does not wait, builds
    the store whole (the one-process reference's tokens) and clears the leftover."""
    import signal
    import time

    path, cache = _write_data(tmp_path / "data", 24), tmp_path / "cache"
    final = Path(chat.chat_cache_path(str(path), tokenizer, SEQ, "assistant", "truncate",
                                      str(cache)))
    out = tmp_path / "killed.json"
    writer = _fork(path, cache, 0.2, out)
    progress, deadline = Path(f"{out}.calls"), time.monotonic() + 120
    while time.monotonic() < deadline and writer.is_alive() and not (
            progress.is_file() and len(progress.read_text()) >= 8):  # a third of the file
        time.sleep(0.05)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    assert writer.exitcode == -signal.SIGKILL and not final.exists()
    assert 8 <= len(progress.read_text()) < 24 and not out.exists()  # it had not finished
    (partial,) = cache.glob("*.tmp")  # what it left
    assert (partial / "tokens.bin").is_file()
    assert _load(path, tokenizer, cache, tokenize=False) is None
    calls["n"] = 0
    start = time.monotonic()
    loaded = _load(path, tokenizer, cache, write_cache=True)
    assert time.monotonic() - start < 60 and calls["n"] == 24
    assert sorted(os.listdir(cache)) == [final.name]  # the leftover and the lock are gone
    _same_file(loaded, chat.read_chat_file(str(path), tokenizer, SEQ))


def test_of_two_writers_at_once_one_builds_and_the_other_waits_and_reads(tokenizer, tmp_path):
    """Two processes (as the first ranks of two nodes on one filesystem) ask for the same store
    at once: one tokenizes every conversation, the other none (it waits for the lock, says so,
    and reads the store); both read the reference's tokens."""
    import json

    path, cache = _write_data(tmp_path / "data", 24), tmp_path / "cache"
    writers = [_fork(path, cache, 0.05, tmp_path / f"{k}.json") for k in range(2)]
    for writer in writers:
        writer.join(timeout=300)
        assert writer.exitcode == 0
    results = [json.loads((tmp_path / f"{k}.json").read_text()) for k in range(2)]
    assert sorted(r["calls"] for r in results) == [0, 24], results
    waited = next(r for r in results if r["calls"] == 0)["said"]
    assert "[data] waiting for " in waited and "tokenizing" in waited, waited
    built = next(r for r in results if r["calls"] == 24)["said"]
    assert built.count("tokenized conversations cached in") == 1, built
    reference = [c.ids.tolist() for c in chat.read_chat_file(str(path), tokenizer,
                                                             SEQ).conversations]
    assert results[0]["ids"] == results[1]["ids"] == reference
    assert len(os.listdir(cache)) == 1


def test_worker_processes_build_the_one_process_tokens(tokenizer, tmp_path):
    """The recipe's 256 conversations with blank lines, a last line without its newline, half of
    them cut (seq_length 64), in chunks of about 2 KB over 2 worker processes: the store holds
    ``read_chat_file``'s conversations (ids, loss flags) in file order and its counts; a bad
    line deep in the file is its error, file:line, and nothing is stored."""
    lines = (ROOT / "configs" / "sft_tiny" / "chat.jsonl").read_text().splitlines(True)
    lines[10:10] = ["\n", "   \n"]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(lines).rstrip("\n"))
    chat._FILES.clear()
    stored = chat.load_chat_file(str(path), tokenizer, 64, "assistant", "truncate",
                                 cache_dir=str(tmp_path / "cache"), write_cache=True, workers=2,
                                 chunk_bytes=2048)
    reference = chat.read_chat_file(str(path), tokenizer, 64)
    assert stored.store is not None and stored.store.meta["built"]["workers"] == 2
    assert reference.truncated > 0 and reference.lines == 258
    _same_file(stored, reference)
    assert stored.summary(64) == reference.summary(64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:200]) + '{"prompt": "Q"}\n' + "".join(lines[200:]))
    with pytest.raises(chat.ChatDataError) as reference_error:
        chat.read_chat_file(str(bad), tokenizer, 64)
    assert str(reference_error.value).startswith(f"{bad}:201: ")
    with pytest.raises(chat.ChatDataError) as error:
        chat.load_chat_file(str(bad), tokenizer, 64, "assistant", "truncate",
                            cache_dir=str(tmp_path / "bad_cache"), write_cache=True, workers=2,
                            chunk_bytes=2048)
    assert str(error.value) == str(reference_error.value)
    assert not (tmp_path / "bad_cache").exists()


def test_a_start_reads_the_index_only_its_memory_does_not_grow_with_conversations(tmp_path):
    """Stores of 1,000 and 30,000 conversations (written directly: random ids, the same
    shape), each opened and packed once (the rows saved), then a second start measured with
    tracemalloc: opening the store, the split's ChatDataset (megatron's indices given) and its
    first sample. The memory it allocates differs by less than 64 KiB between the two (70 KB
    each measured; the old .npz cache read every conversation: about 2.2 KB each, 64 MB
    here)."""
    import tracemalloc

    from megatron.core.datasets.utils import Split

    from mcore_ext.data import chat_store

    rng = numpy.random.default_rng(0)
    peaks = []
    for count in (1_000, 30_000):
        directory = tmp_path / f"store{count}"
        writer = chat_store.StoreWriter(str(directory), 259)
        lengths = rng.integers(20, 120, count).astype(numpy.int32)
        ids = rng.integers(0, 259, int(lengths.sum()))
        loss = rng.random(len(ids)) < 0.4
        starts = numpy.concatenate([[0], lengths.cumsum()[:-1]])
        counts = numpy.add.reduceat(loss.astype(numpy.int32), starts) - loss[starts]
        writer.add_chunk(ids, loss, lengths, counts, None, numpy.arange(1, count + 1))
        writer.finalize({"lines": count, "truncated": 0, "dropped": 0})
        writer.close()
        config = chat.ChatDatasetConfig(random_seed=1, sequence_length=SEQ, split="1,0,0",
                                        tokenizer=None, hf_tokenizer=None,
                                        path_to_cache=str(tmp_path / "rows"))
        indices = numpy.arange(count, dtype=numpy.int32)

        def start():
            source = chat.ChatFile.from_store("x", chat_store.open_store(str(directory)))
            dataset = chat.ChatDataset(source, "x", indices, 4 * count, Split.train, config)
            return dataset[0]

        start()  # the rows are built and saved
        tracemalloc.start()
        first = start()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert first["tokens"].shape == (SEQ,)
    assert peaks[1] - peaks[0] < 64 << 10, peaks


def test_a_bad_line_raises_file_and_line_and_caches_nothing(tokenizer, tmp_path, calls):
    path = _write_data(tmp_path / "data", 4)
    path.write_text(path.read_text() + "{'role': 'user'}\n")
    with pytest.raises(chat.ChatDataError, match=f"^{path}:5: not JSON"):
        _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert not (tmp_path / "cache").exists()


def test_the_preprocess_command_builds_the_store_a_run_then_reads(tokenizer, tmp_path, capsys,
                                                                 calls):
    """``python -m mcore_ext.data.preprocess --chat`` with the run's tokenizer, seq_length and
    cache directory: the store the launcher's start then reads without tokenizing; a bad line is
    one error line naming file:line, exit 2, nothing stored."""
    from mcore_ext.data.preprocess import main

    path, cache = _write_data(tmp_path / "data", 8), tmp_path / "cache"
    assert main(["--chat", str(path), "--tokenizer", str(TOKENIZER), "--seq-length", str(SEQ),
                 "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"[data] {path}: 8 conversations" in out and f"store {cache}/chat-chat-" in out, out
    calls["n"] = 0
    _same_file(_load(path, tokenizer, cache, tokenize=False),
               chat.read_chat_file(str(path), tokenizer, SEQ))
    assert calls["n"] == 8  # the reference only
    bad = _write_data(tmp_path / "bad", 3)
    bad.write_text(bad.read_text() + "{'role': 'user'}\n")
    assert main(["--chat", str(bad), "--tokenizer", str(TOKENIZER), "--seq-length", str(SEQ),
                 "--cache-dir", str(tmp_path / "bad_cache")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:4: not JSON") and err.count("\n") == 1, err
    assert not (tmp_path / "bad_cache").exists()


def _every_token(record, hf_tokenizer, loss_on, where):
    """Another render (every token a target): a module-level function, as workers need."""
    return chat.conversation_of(record, hf_tokenizer, "all", where)


def test_the_render_is_part_of_the_stores_key(tokenizer, tmp_path):
    """A store built by another render is another store: neither is read for the other."""
    path = _write_data(tmp_path, 5)
    chat._FILES.clear()
    other = chat.load_chat_file(str(path), tokenizer, SEQ, "assistant", "truncate",
                                cache_dir=str(tmp_path / "cache"), write_cache=True,
                                render=_every_token)
    plain = _load(path, tokenizer, tmp_path / "cache", write_cache=True)
    assert other.store.directory != plain.store.directory
    assert other.loss_counts().sum() > plain.loss_counts().sum()


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


def _blend_datasets(folder: str) -> dict:
    """On every rank: the recipe with data.path a blend of a.jsonl and b.jsonl weighted 3 : 1
    and data.valid_path c.jsonl, validated (the stores built) and its datasets built as the
    launcher builds them; the text of every train and validation sample's documents."""
    from mcore_ext.data.tokenizers import load_tokenizer
    from mcore_ext.training.config import load_config
    from mcore_ext.training.data import build_datasets

    chat._FILES.clear()
    cfg = load_config(str(RECIPE), [
        f"data.path=[3, {folder}/a.jsonl, 1, {folder}/b.jsonl]",
        f"data.valid_path={folder}/c.jsonl", f"data.cache_dir={folder}/cache",
        "training.train_iters=10", "training.eval_iters=2"], world_size=2)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    train, valid = build_datasets(cfg, tokenizer)

    def texts(split):
        return [tokenizer.hf.decode(sample["tokens"][sample["loss_mask"] > 0])
                for sample in (split[i] for i in range(len(split)))]

    return {"train": texts(train), "valid": texts(valid)}


def test_a_blend_with_weights_and_a_validation_file_on_gloo(tmp_path, run_distributed):
    """megatron's blend form in data.path ([3, a, 1, b]) and data.valid_path: the 80 training
    samples (10 steps of 8) are rows of a and of b, 60 and 20 (megatron's BlendedDataset
    follows the weights exactly at this size), none of c; the 16 validation samples are rows of
    c only; both ranks see the same samples."""
    import json

    for name, answer in (("a", "AAAA"), ("b", "BBBB"), ("c", "CCCC")):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": f"Q{i}", "completion": answer}) + "\n" for i in range(40)))
    first, second = run_distributed(_blend_datasets, str(tmp_path), world_size=2)
    assert first == second
    train, valid = first["train"], first["valid"]
    assert len(train) == 80 and len(valid) == 16
    kinds = [tuple(a in t for a in ("AAAA", "BBBB", "CCCC")) for t in train]
    assert kinds.count((True, False, False)) == 60 and kinds.count((False, True, False)) == 20
    assert all("CCCC" in t and "AAAA" not in t and "BBBB" not in t for t in valid)
