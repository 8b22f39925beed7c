"""The one checked-JSON reader (gpuwatchd/core/checked.py): strict readers name where a value is
wrong; lenient readers make a malformed value unknown, never an exception."""

from __future__ import annotations

import math

import pytest

from gpuwatchd.core import checked, model


@pytest.mark.parametrize(
    ("reader", "value", "message"),
    [
        (checked.obj, [1], "x: expected an object"),
        (checked.obj, {1: 2}, "x: expected an object"),
        (checked.items, {}, "x: expected a list"),
        (checked.text, 3, "x: expected a string"),
        (checked.integer, True, "x: expected an integer"),
        (checked.integer, 1.0, "x: expected an integer"),
        (checked.number, "1", "x: expected a number"),
        (checked.number, False, "x: expected a number"),
        (checked.number, math.inf, "x: expected a finite number"),
        (checked.number, math.nan, "x: expected a finite number"),
        pytest.param(checked.number, 10**400, "x: expected a finite number", id="huge-int"),
        (checked.flag, 0, "x: expected true or false"),
        (checked.numbers, {"a": None}, "x.a: expected a number"),
        (checked.pairs, [["a"]], r"x\[0\]: expected \[name, time\]"),
        (checked.pairs, [[1, 2.0]], r"x\[0\]: expected a string"),
    ],
)
def test_a_strict_reader_names_where_the_value_is_wrong(
    reader: object, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        reader(value, "x")  # type: ignore[operator]


def test_strict_readers_return_what_is_well_formed() -> None:
    assert checked.obj({"a": 1}, "x") == {"a": 1}
    assert checked.integer(7, "x") == 7
    assert checked.number(2, "x") == 2.0
    assert checked.opt_number(None, "x") is None
    assert checked.opt_text(None, "x") is None
    assert checked.pairs([["a", 1]], "x") == (("a", 1.0),)
    assert checked.numbers({"a": 1}, "x") == {"a": 1.0}


def test_a_list_longer_than_its_limit_is_refused() -> None:
    assert checked.items([1, 2], "x", limit=2) == [1, 2]
    with pytest.raises(ValueError, match="x: expected a list"):
        checked.items([1, 2, 3], "x", limit=2)
    with pytest.raises(ValueError, match="x: expected a list"):
        checked.pairs([["a", 1], ["b", 2]], "x", limit=1)


@pytest.mark.parametrize(
    "value",
    [None, True, "5", math.nan, math.inf, pytest.param(10**400, id="huge-int"), [], {}],
)
def test_a_lenient_number_is_unknown_unless_finite(value: object) -> None:
    assert checked.as_number(value) is None


def test_lenient_readers_never_raise_and_keep_what_is_well_formed() -> None:
    assert model.as_int(True) is None
    assert checked.as_count(-1) is None
    assert checked.as_count(3) == 3
    assert checked.as_text(3) is None
    assert checked.as_flag(1) is None
    assert checked.as_map({"a": 1, 2: 3}) == {"a": 1}
    assert checked.as_map([1]) == {}
    assert checked.as_list({"a": 1}) == []
