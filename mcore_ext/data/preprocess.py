"""Turn text into megatron's indexed dataset (<prefix>.bin + <prefix>.idx) for GPT pretraining,
or chat data into the launcher's stores of tokenized conversations.

    python -m mcore_ext.data.preprocess --input a.jsonl b.txt ... --output-prefix data/mytext \
        [--tokenizer byte|/path/to/hf_tokenizer_dir] [--json-key text]

A ``.jsonl`` / ``.json`` input holds one document per line in its ``text`` field; any other file
is one document. Every document ends with the tokenizer's end-of-document id. A sidecar
``<prefix>.json`` records the tokenizer so the launcher can check it matches its config. The files
are written under temporary names and renamed at the end, the ``.idx`` last: a prefix whose
``.idx`` exists is complete.

    python -m mcore_ext.data.preprocess --chat conversations.jsonl ... --tokenizer DIR \
        --seq-length N [--loss-on assistant] [--overlong truncate] [--cache-dir runs/data/cache] \
        [--workers N]

builds the store of each chat file (``mcore_ext.data.chat``: megatron indexed datasets of the
tokens and loss flags, memory-mapped) in the cache directory, as a run with the same
``data.tokenizer``, ``model.seq_length``, ``data.loss_on``, ``data.overlong`` and
``data.cache_dir`` would build it on its first start, which then finds it: prepare a large set
once, with as many worker processes as the machine has, before the job starts.
"""

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from mcore_ext.data.tokenizers import load_tokenizer
from mcore_ext.userfiles import parse_json_line


def preprocess(inputs, output_prefix: str, tokenizer: str = "byte", json_key: str = "text") -> dict:
    """Tokenize ``inputs`` into ``output_prefix``.bin/.idx; returns document and token counts."""
    tok = load_tokenizer(tokenizer)
    dtype = DType.optimal_dtype(tok.vocab_size)  # uint16 below 65500 ids
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    documents = tokens = 0
    complete = False
    try:
        for text in _documents(inputs, json_key):
            ids = tok.tokenize(text)
            if not ids:
                continue
            ids.append(tok.eod)
            builder.add_document(torch.from_numpy(np.asarray(ids, dtype=dtype)), [len(ids)])
            documents += 1
            tokens += len(ids)
        if documents == 0:
            raise ValueError(f"no text found in {len(inputs)} input file(s)")
        complete = True
    finally:
        builder.finalize(tmp + ".idx")
        if not complete:
            for suffix in (".bin", ".idx"):
                os.remove(tmp + suffix)

    name = tokenizer if tokenizer == "byte" else os.path.abspath(tokenizer)
    meta = {"tokenizer": name, "vocab_size": tok.vocab_size, "eod": tok.eod,
            "documents": documents, "tokens": tokens}
    with open(output_prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")
    return meta


def stdlib_sources() -> list[Path]:
    """The top-level .py files of this Python's standard library (a few MB on every machine)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _documents(inputs, json_key: str):
    for path in inputs:
        if str(path).endswith((".jsonl", ".json")):
            with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by number
                for number, raw in enumerate(f, 1):
                    # ValueError naming path:number if not UTF-8, not JSON or nested too deeply
                    record = parse_json_line(raw, f"{path}:{number}", ValueError)
                    if record is None:
                        continue
                    if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                        raise ValueError(
                            f"{path}:{number}: not a JSON object with a {json_key!r} field")
                    yield record[json_key]
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_ext.data.preprocess", description=__doc__.split("\n\n")[0]
    )
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input", nargs="+",
        help="JSONL files (one document per line) or text files (one document each)",
    )
    inputs.add_argument(
        "--chat", nargs="+", metavar="FILE",
        help="chat JSONL files (one conversation per line, data.source=chat): build their stores",
    )
    parser.add_argument("--output-prefix", help="--input: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--tokenizer", default="byte",
        help="'byte' (default: 256 bytes + EOD) or a local Hugging Face tokenizer directory "
             "(--chat: the model's, with its chat template; the run's data.tokenizer)",
    )
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL inputs")
    parser.add_argument("--seq-length", type=int, help="--chat: the run's model.seq_length")
    parser.add_argument("--loss-on", default="assistant", choices=("assistant", "last_turn", "all"),
                        help="--chat: the run's data.loss_on (default assistant)")
    parser.add_argument("--overlong", default="truncate", choices=("truncate", "drop"),
                        help="--chat: the run's data.overlong (default truncate)")
    parser.add_argument("--cache-dir", default=os.path.join("runs", "data", "cache"),
                        help="--chat: the run's data.cache_dir (default runs/data/cache)")
    parser.add_argument("--workers", type=int,
                        help="--chat: tokenizing processes (default: 1 for a file up to 16 MiB, "
                             "else the CPUs this process may use, up to 8)")
    args = parser.parse_args(argv)
    from mcore_ext.cli import quiet_known_noise

    quiet_known_noise()
    if args.chat:
        return _main_chat(args)
    if not args.output_prefix:
        print("error: --input needs --output-prefix", file=sys.stderr)
        return 2

    missing = [p for p in args.input if not os.path.isfile(p)]
    if missing:
        print(f"error: input file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        meta = preprocess(args.input, args.output_prefix, args.tokenizer, args.json_key)
    except ValueError as err:  # the input (a bad line names its file:line) or the tokenizer
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # a Hugging Face tokenizer without transformers: what to install
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output_prefix}.bin/.idx: {meta['documents']} documents, {meta['tokens']} "
        f"tokens (tokenizer {args.tokenizer}, vocab {meta['vocab_size']})"
    )
    return 0


def _main_chat(args) -> int:
    """--chat: each file's store, built (or found) as the launcher builds it."""
    from mcore_ext.data.chat import ChatDataError, load_chat_file

    for flag, value in (("--seq-length", args.seq_length), ("--workers", args.workers)):
        if value is not None and value < 1 or (flag == "--seq-length" and value is None):
            print(f"error: --chat needs {flag} of at least 1, got {value}", file=sys.stderr)
            return 2
    missing = [p for p in args.chat if not os.path.isfile(p)]
    if missing:
        print(f"error: chat file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.tokenizer == "byte" or not os.path.isdir(args.tokenizer):
        print(f"error: --chat needs --tokenizer, a Hugging Face tokenizer directory with a chat "
              f"template, got {args.tokenizer!r}", file=sys.stderr)
        return 2
    try:
        hf = load_tokenizer(args.tokenizer).hf
    except (OSError, ValueError, ImportError) as err:
        print(f"error: --tokenizer {args.tokenizer!r} cannot be loaded: {err}", file=sys.stderr)
        return 2
    if not getattr(hf, "chat_template", None):
        print(f"error: --tokenizer {args.tokenizer!r} has no chat template", file=sys.stderr)
        return 2
    for path in args.chat:
        try:
            chat = load_chat_file(path, hf, args.seq_length, args.loss_on, args.overlong,
                                  cache_dir=args.cache_dir, write_cache=True,
                                  workers=args.workers)
        except ChatDataError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if chat.store is None:  # said why (the cache directory cannot be written)
            print(f"error: {path}: no store written in {args.cache_dir}", file=sys.stderr)
            return 1
        print(chat.summary(args.seq_length))
        print(f"store {chat.store.directory}: {chat.store.size_bytes() / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
