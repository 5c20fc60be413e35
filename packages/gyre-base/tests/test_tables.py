"""dataclass_from_table: the strict table -> dataclass loading that gyre-sched's workloads and `gyre run`'s
configuration share."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from gyre_base.tables import ConfigError, dataclass_from_table


@dataclass(frozen=True)
class Section:
    steps: int = 2
    rate: float = 0.5
    name: str = "x"
    streaming: bool = False
    tags: list[str] = field(default_factory=list)
    widths: tuple[float, ...] = ()


def test_defaults_and_given_keys() -> None:
    assert dataclass_from_table(Section, "s", {}) == Section()
    got = dataclass_from_table(Section, "s", {"steps": 3, "name": "y", "streaming": True, "tags": ["a"]})
    assert got == Section(steps=3, name="y", streaming=True, tags=["a"])


def test_int_becomes_float() -> None:
    got = dataclass_from_table(Section, "s", {"rate": 2})
    assert got.rate == 2.0 and type(got.rate) is float


def test_a_list_fills_a_tuple_field_item_by_item() -> None:
    """TOML and JSON arrays arrive as lists; a `tuple[float, ...]` field keeps a tuple of floats."""
    got = dataclass_from_table(Section, "s", {"widths": [1, 2.5]})
    assert got.widths == (1.0, 2.5) and all(type(w) is float for w in got.widths)
    assert dataclass_from_table(Section, "s", {"widths": []}).widths == ()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stepz": 1}, "[s] unknown key 'stepz'; known: name, rate, steps, streaming, tags, widths"),
        ({"rate": "abc"}, "[s] rate must be float, got 'abc'"),
        ({"steps": 2.0}, "[s] steps must be int, got 2.0"),
        ({"steps": True}, "[s] steps must be int, got True"),  # a bool is not an int ...
        ({"rate": False}, "[s] rate must be float, got False"),  # ... nor a float
        ({"streaming": 1}, "[s] streaming must be bool, got 1"),
        ({"tags": "a"}, "[s] tags must be list, got 'a'"),
        ({"widths": 1.0}, "[s] widths must be tuple, got 1.0"),
        ({"widths": [1.0, "x"]}, "[s] widths[1] must be float, got 'x'"),
        ({"widths": [True]}, "[s] widths[0] must be float, got True"),
    ],
)
def test_bad_keys(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        dataclass_from_table(Section, "s", raw)
    assert str(err.value) == message


@pytest.mark.parametrize(("raw", "kind"), [([1, 2], "list"), (3, "int"), ("x", "str"), (None, "NoneType")])
def test_not_a_table(raw: object, kind: str) -> None:
    with pytest.raises(ConfigError) as err:
        dataclass_from_table(Section, "s", raw)
    assert str(err.value) == f"[s] must be a table, got {kind}"


def test_caller_chooses_the_error_class() -> None:
    class MyError(ConfigError):
        pass

    with pytest.raises(MyError, match=r"\[s\] unknown key 'x'"):
        dataclass_from_table(Section, "s", {"x": 1}, error=MyError)
    assert issubclass(ConfigError, ValueError)


def test_programming_errors_are_type_errors() -> None:
    @dataclass
    class NoDefault:
        steps: int

    with pytest.raises(TypeError, match="no default"):
        dataclass_from_table(NoDefault, "s", {})
    with pytest.raises(TypeError, match="not a dataclass"):
        dataclass_from_table(dict, "s", {})
