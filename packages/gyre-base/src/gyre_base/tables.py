"""Strict loading of one TOML/JSON/YAML table into a dataclass, shared by gyre-sched's workloads and
`gyre run`'s configuration.

`dataclass_from_table(cls, section, raw)` builds `cls` from the keys of `raw` and leaves every other field
at its default. The type a key must have is the type of its field's default: an int where a float is
expected becomes that float, a bool is never an int or a float, a field annotated `tuple[X, ...]` takes
a list (or tuple) whose items are each checked as an X, and anything else of the wrong type, an unknown
key or a `raw` that is not a table is a `ConfigError` naming the section and the key:

    [run] unknown key 'stepz'; known: cells, seed, steps
    [run] steps must be int, got 'two'
    [run] must be a table, got list
    [cell] widths[1] must be float, got 'x'
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration (a workload, a `gyre run` config) that cannot be used, with the offending section
    and key in the message."""


def dataclass_from_table[T](
    cls: type[T], section: str, raw: object, *, error: type[ConfigError] = ConfigError
) -> T:
    """`cls(**raw)`, checked key by key (see the module docstring); `error` is the `ConfigError` subclass
    to raise, for a caller whose users catch their own. Every field of `cls` must have a default."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(raw, dict):
        raise error(f"[{section}] must be a table, got {type(raw).__name__}")
    defaults = {f.name: _default(cls, f) for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in defaults:
            raise error(f"[{section}] unknown key {key!r}; known: {', '.join(sorted(defaults))}")
        item = _tuple_item(cls, key) if isinstance(defaults[key], tuple) else None
        if item is not None and isinstance(value, list | tuple):
            kwargs[key] = tuple(
                _scalar(item, v, f"[{section}] {key}[{i}]", error) for i, v in enumerate(value)
            )
        else:
            kwargs[key] = _scalar(type(defaults[key]), value, f"[{section}] {key}", error)
    return cls(**kwargs)


def _scalar(want: type, value: object, where: str, error: type[ConfigError]) -> Any:
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise error(f"{where} must be {want.__name__}, got {value!r}")
    return value


def _tuple_item(cls: type, name: str) -> type | None:
    """X for a field annotated `tuple[X, ...]`; else None."""
    hint = typing.get_type_hints(cls).get(name)
    args = typing.get_args(hint)
    if (
        typing.get_origin(hint) is tuple
        and len(args) == 2
        and args[1] is Ellipsis
        and isinstance(args[0], type)
    ):
        return args[0]
    return None


def _default(cls: type, f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{cls.__name__}.{f.name} has no default; a table cannot leave it out")
