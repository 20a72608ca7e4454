"""The generic half of the config: YAML file + ``section.key=value`` overrides -> typed dataclasses.

Nothing here knows the launcher's keys: ``build`` works on any dataclass of section dataclasses.
Values are checked against the fields' annotations (int, float, bool, str, Optional, Literal,
list, and a dataclass: a mapping of its own keys, ``section.key.subkey=value`` on the command
line, e.g. ``model.vision.freeze=false``);
an unknown section or key, or a value of the wrong type, is a ``ConfigError`` naming the key and
value, with a "did you mean" when a close name exists.
"""

import dataclasses
import difflib
import types
import typing
from typing import Literal

import yaml

from mcore_ext.run_config.schema import ConfigError, section_fields
from mcore_ext.userfiles import decode_utf8, too_deep


def read_yaml(path: str) -> dict:
    """The mapping of sections in the YAML file at ``path`` (empty file -> {})."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as err:  # a directory, no permission
        raise ConfigError(f"config file {path} cannot be read ({err.strerror})") from None
    text = decode_utf8(data, path, ConfigError)  # PATH:LINE of a byte that is not UTF-8
    try:
        raw = yaml.safe_load(text)
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise ConfigError(f"config file {path} is not valid YAML: {too_deep()}") from None
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of sections, got {type(raw).__name__}"
        )
    return raw


def apply_overrides(raw: dict, overrides) -> dict:
    """``raw`` with each ``section.key=value`` (or ``section.key.subkey=value``) of
    ``overrides`` set (values parsed as YAML)."""
    for item in overrides:
        path, value = _parse_override(item)
        mapping = raw
        for depth, name in enumerate(path[:-1]):
            if mapping.get(name) is None:
                mapping[name] = {}
            if not isinstance(mapping[name], dict):
                what = "section" if depth == 0 else "key"
                raise ConfigError(f"{what} {'.'.join(path[:depth + 1])!r} in the YAML is not a "
                                  "mapping")
            mapping = mapping[name]
        mapping[path[-1]] = value
    return raw


def _parse_override(item: str) -> tuple[tuple, object]:
    key, sep, text = item.partition("=")
    path = tuple(part.strip() for part in key.split("."))
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(
            f"override {item!r} is not of the form section.key=value (e.g. training.train_iters=20)"
        )
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        value = text  # e.g. a path with a colon: keep the text as it is
    return path, value


def build(root: type, raw: dict):
    """``root(**sections)`` from ``raw`` {section: {key: value}}, each value type-checked.

    ``root`` is a dataclass whose (non-derived) fields are section dataclasses; keys missing from
    ``raw`` keep their defaults. Unknown sections and keys are errors with a "did you mean".
    """
    sections_of_root = section_fields(root)
    all_keys = [
        f"{s.name}.{f.name}"
        for s in sections_of_root
        for f in dataclasses.fields(s.default_factory)
    ]
    sections = {}
    for section_field in sections_of_root:
        cls = section_field.default_factory
        given = raw.get(section_field.name) or {}
        if not isinstance(given, dict):
            raise ConfigError(
                f"section {section_field.name!r} must be a mapping of keys, got {given!r}"
            )
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in given.items():
            if key not in hints:
                raise ConfigError(_unknown(f"{section_field.name}.{key}", all_keys))
            values[key] = _check_type(f"{section_field.name}.{key}", value, hints[key])
        sections[section_field.name] = cls(**values)
    for name in raw:
        if name not in sections:
            raise ConfigError(
                _unknown(str(name), [s.name for s in sections_of_root], kind="section")
            )
    return root(**sections)


def _unknown(key: str, valid: list[str], kind: str = "key") -> str:
    """Unknown ``key``: suggest the same name in another section, else the closest valid key."""
    message = f"unknown config {kind} {key!r}"
    close = []
    if kind == "key":
        section, name = key.split(".", 1)
        close = [k for k in valid if k.split(".", 1)[1] == name]  # right key, wrong section
        if not close:
            in_section = [k.split(".", 1)[1] for k in valid if k.startswith(section + ".")]
            close = [f"{section}.{n}" for n in difflib.get_close_matches(name, in_section, n=1)]
    if not close:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"{message}; did you mean {close[0]!r}?"
    return f"{message}; valid {kind}s: {', '.join(valid)}" if kind == "section" else message


def _build_nested(key: str, value, cls):
    """A dataclass-typed key: ``cls(**value)`` from a mapping of its keys, each type-checked
    (unknown keys and ``cls``'s own validation errors name the key)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected a mapping "
                          f"of keys ({', '.join(f.name for f in dataclasses.fields(cls))})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, item in value.items():
        if name not in hints:
            close = difflib.get_close_matches(str(name), list(hints), n=1)
            raise ConfigError(f"unknown config key {key}.{name!r}"
                              + (f"; did you mean {key + '.' + close[0]!r}?" if close else
                                 f"; valid keys: {', '.join(hints)}"))
        values[name] = _check_type(f"{key}.{name}", item, hints[name])
    try:
        return cls(**values)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_type(key: str, value, hint):
    """``value`` if it fits ``hint`` (int, float, bool, str, Optional, Literal, list, a
    dataclass), else an error."""
    if dataclasses.is_dataclass(hint):
        return _build_nested(key, value, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(
                f"{key}={value!r} has type {type(value).__name__}, expected a list"
            )
        return [_check_type(f"{key}[{i}]", item, args[0]) for i, item in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hints = [a for a in args if a is not type(None)]
        for hint in hints[:-1]:  # e.g. int or list[int]: the first that fits
            try:
                return _check_type(key, value, hint)
            except ConfigError:
                pass
        return _check_type(key, value, hints[-1])
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint_text = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{key}={value!r} is not one of {', '.join(repr(a) for a in args)}{hint_text}"
        )
    if hint is float:
        # YAML reads 1e-3 (no dot) as a string: accept any number spelled as one.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # YAML reads data.split=100 or a numeric path as a number
    elif isinstance(value, hint):
        return value
    raise ConfigError(
        f"{key}={value!r} has type {type(value).__name__}, expected {_type_name(hint)}"
    )


def _type_name(hint) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
