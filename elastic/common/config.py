"""Typed config loading: plain dicts (from YAML) into nested dataclasses.

Each component owns a small keyword-only dataclass for its settings (the agent,
the rendezvous, the checkpointer, the trainer, diagnostics...).  This module
turns a nested mapping into those dataclasses and rejects anything it does not
understand: an unknown key, a value of the wrong type, or a value that the
dataclass's ``__post_init__`` refuses.  Every error is a :class:`ConfigError`
whose message names the dotted path of the offending field, so the CLI can
print one line and exit instead of a traceback.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``,
``X | None``, ``list[X]``, ``dict[str, X]`` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value was rejected; ``str(err)`` is one line naming the field path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        text = f"{path}: {message}" if path else message
        # One line even when a key or value from the input holds a line break.
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping, got {_describe(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(_join(path, str(unknown[0])), f"unknown key (known keys: {known})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ raised with a path relative to this dataclass.
        raise ConfigError(_join(path, exc.path), exc.message) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(path, str(exc)) from None


def to_dict(obj: Any) -> Any:
    """Inverse of :func:`from_dict` (for fingerprints and run records)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def override(cfg: T, dotted: str, raw: Any) -> T:
    """Return a copy of ``cfg`` with one field (``a.b.c``) set, validated like YAML input."""
    data = to_dict(cfg)
    node = data
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, dict):
            raise ConfigError(".".join(parts[:i]), "is not a section")
        node = node.setdefault(part, {})
    if not isinstance(node, dict):
        raise ConfigError(".".join(parts[:-1]), "is not a section")
    # Unknown keys are then refused by from_dict, with the list of known keys.
    node[parts[-1]] = raw
    return from_dict(type(cfg), data)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc.message)
        raise ConfigError(path, "; ".join(errors))
    if origin is typing.Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {_describe(value)}")
        (item,) = get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
        _, item = get_args(tp)
        return {str(k): _convert(item, v, _join(path, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_describe(value)}")
        return value
    raise ConfigError(path, f"unsupported field type {tp!r}")
