"""Files a user gives (a YAML config, an adapter's or a Hugging Face model's JSON, a JSONL line):
whatever way one fails to decode is one line naming the file (and line), never a traceback.

The parsers fail in more ways than their documented error: bytes that are not UTF-8 raise
``UnicodeDecodeError`` (a ValueError that names a byte position, not the file or line); nesting
deeper than Python's recursion limit raises ``RecursionError`` in both json's scanner and PyYAML's
composer (100,000 ``[`` is a short line); and a top-level value of another type than the caller
reads (a list where an object is expected) fails later as an ``AttributeError`` far from the file.
Each reader here turns all of them into ``error`` (the caller's own ValueError subclass, so its
entry point's one-line report applies) with the file's name.
"""

import json
import sys

import yaml


class UserFileError(ValueError):
    """A file that cannot be read as what it should hold: the message names the file."""


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean"}.get(type(value), f"a {type(value).__name__}")


def too_deep() -> str:
    """What a RecursionError of a parser means, said to a user."""
    return f"nested more deeply than Python's recursion limit, {sys.getrecursionlimit()}"


def decode_utf8(raw: bytes, path: str, error=UserFileError) -> str:
    """``raw`` (the bytes of the file ``path``) as text; ``error`` names its first byte that is
    not UTF-8 as ``PATH:LINE: ... column C``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - raw.rfind(b"\n", 0, err.start)  # rfind: -1 on the first line
        raise error(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{column})") from None


def _read(path: str, error) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    return decode_utf8(raw, path, error)


def _expect(value, expect, where: str, error, mapping="an object"):
    if expect is not None and not isinstance(value, expect):
        wanted = mapping if expect is dict else _kind(expect())
        raise error(f"{where}: expected {wanted} at the top level, got {_kind(value)}")
    return value


def read_json(path: str, error=UserFileError, expect=dict):
    """The JSON value of the file ``path``, of type ``expect`` (None: any); ``error`` names the
    file on an unreadable, non-UTF-8, invalid or too deeply nested file, or another type."""
    text = _read(path, error)
    try:
        value = json.loads(text)
    except ValueError as err:
        raise error(f"{path}: not JSON ({err})") from None
    except RecursionError:
        raise error(f"{path}: not JSON that can be read ({too_deep()})") from None
    return _expect(value, expect, path, error)


def parse_json_line(raw: bytes, where: str, error=UserFileError):
    """The JSON value of one line of a JSONL file, None for a blank line; ``where`` is
    ``FILE:LINE``, which ``error`` names for a line that is not UTF-8, not JSON or too deeply
    nested (the caller checks the value's type: what a line holds is its own rule)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1})") from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except ValueError as err:
        raise error(f"{where}: not JSON ({err})") from None
    except RecursionError:
        raise error(f"{where}: not JSON that can be read ({too_deep()})") from None


def read_yaml(path: str, error=UserFileError, expect=dict):
    """The YAML value of the file ``path`` (an empty file is None, allowed whatever ``expect``);
    ``error`` names the file as ``read_json`` does, and YAML's own errors with their line."""
    text = _read(path, error)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        said = " ".join(str(err).replace('in "<unicode string>", ', "").split())
        raise error(f"{path}: not YAML ({said})") from None
    except RecursionError:
        raise error(f"{path}: not YAML that can be read ({too_deep()})") from None
    return None if value is None else _expect(value, expect, path, error,
                                              "a mapping (key: value)")
