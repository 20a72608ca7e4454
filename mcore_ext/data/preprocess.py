"""Turn text into megatron's indexed dataset (<prefix>.bin + <prefix>.idx) for GPT pretraining.

    python -m mcore_ext.data.preprocess --input a.jsonl b.txt ... --output-prefix data/mytext \
        [--tokenizer byte|/path/to/hf_tokenizer_dir] [--json-key text]

A ``.jsonl`` / ``.json`` input holds one document per line in its ``text`` field; any other file
is one document. Every document ends with the tokenizer's end-of-document id. A sidecar
``<prefix>.json`` records the tokenizer so the launcher can check it matches its config. The files
are written under temporary names and renamed at the end, the ``.idx`` last: a prefix whose
``.idx`` exists is complete.
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
    parser.add_argument(
        "--input", nargs="+", required=True,
        help="JSONL files (one document per line) or text files (one document each)",
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--tokenizer", default="byte",
        help="'byte' (default: 256 bytes + EOD) or a local Hugging Face tokenizer directory",
    )
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL inputs")
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
