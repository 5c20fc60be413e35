"""Command-line flags derived from a config dataclass, so each setting is declared once.

Every field of the dataclass becomes a flag (`--field-name`, or the name its `Flag` metadata gives) whose
help is the field's docstring and whose default is the field's default. `bool` fields get `--x/--no-x`;
`tuple[X, ...]` fields a repeatable flag whose values replace the default (an empty value: none at
all); any other type needs a `Flag.parse` that turns the command-line text into the value (a JSON file,
a token file). `config_from(cls, args)` builds the dataclass back from the parsed flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field appears on the command line, where the defaults do not fit."""

    name: str = ""
    """The flag (default: `--` + the field name with dashes)."""
    parse: Callable[[str], Any] | None = None
    """Command-line text -> the field's value (for tuples: one item's value)."""
    metavar: str | None = None
    help: str = ""
    """Added to the field's docstring (what the flag takes, where it differs from the field)."""


def flag(
    name: str = "", parse: Callable[[str], Any] | None = None, metavar: str | None = None, help: str = ""
) -> dict[str, Flag]:
    """Field metadata: `field(default=..., metadata=flag("--engine"))`."""
    return {"flag": Flag(name, parse, metavar, help)}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after its annotation), from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _spec(f: dataclasses.Field[Any]) -> Flag:
    spec = f.metadata.get("flag", Flag())
    assert isinstance(spec, Flag)
    return spec


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(getattr(v, "name", str(v)) for v in value) or "none"
    return repr(value) if isinstance(value, str) else str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls` (module docstring)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        spec = _spec(f)
        name = spec.name or "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        default = _default(f)
        text = " ".join(x for x in (docs.get(f.name, ""), spec.help) if x)
        kw: dict[str, Any] = {"dest": f.name, "metavar": spec.metavar}
        if default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = None  # None: the field's default (config_from)
        origin = typing.get_origin(tp)
        if tp is bool:
            kw.pop("metavar")
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is tuple:
            item = typing.get_args(tp)[0]
            kw["action"] = "append"
            kw["type"] = empty_or(spec.parse or item)
            text += " Repeatable; replaces the default (an empty value: none)."
        elif tp in (int, float, str):
            kw["type"] = spec.parse or tp
        elif spec.parse is not None:
            kw["type"] = spec.parse
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for {tp}; give it a Flag(parse=...)")
        if default is not dataclasses.MISSING and not isinstance(default, dict | typing.Mapping):
            text += f" (default: {_shown(default)})"
        parser.add_argument(name, help=text.replace("%", "%%"), **kw)


def _tuple_value(values: list[Any]) -> tuple[Any, ...]:
    return tuple(v for v in values if v != "")


def config_from[T](cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass `cls` from flags added by `add_flags` (unset flags keep the field's default)."""
    assert dataclasses.is_dataclass(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name)
        if value is None:
            continue
        kw[f.name] = _tuple_value(value) if isinstance(value, list) else value
    return cls(**kw)


def empty_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, except that an empty value stays "" (for repeatable flags: "none at all")."""

    def wrapped(text: str) -> Any:
        return "" if text == "" else parse(text)

    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped
