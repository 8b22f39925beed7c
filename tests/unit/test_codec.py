"""The one codec (gpuwatchd/core/codec.py): a Format's version, size bound, layout and checked
fields; errors name the format or the key; pick reads a table leniently."""

from __future__ import annotations

import json

import pytest

from gpuwatchd.core import checked
from gpuwatchd.core.codec import Format, pick

DOC = Format(
    "thing",
    64,
    version=3,
    fields={"name": checked.text, "count": checked.opt_integer},
    newline=True,
)


def test_a_document_is_its_version_first_then_its_values_in_json_dumps_layout() -> None:
    doc = DOC.envelope({"name": "a", "count": None})
    assert list(doc) == ["version", "name", "count"]
    assert DOC.encode(doc) == b'{"version": 3, "name": "a", "count": null}\n'
    assert DOC.decode(DOC.encode(doc)) == doc


def test_a_compact_format_sorts_its_keys_and_refuses_nan() -> None:
    compact = Format("state", 1 << 10, compact=True)
    assert compact.encode({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
    with pytest.raises(ValueError, match="JSON"):
        compact.encode({"a": float("nan")})


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"x" * 65, "larger than 64 bytes"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1]", "not a JSON object"),
        (b"[" * 60 + b"]" * 4, "not valid JSON"),
        (b'{"version": 2, "name": "a"}', "unsupported thing version 2"),
        (b'{"name": "a"}', "unsupported thing version None"),
        (b'{"version": 3, "name": 7}', "name: expected a string"),
        (b'{"version": 3, "name": "a", "count": true}', "count: expected an integer"),
    ],
)
def test_decode_refuses_with_a_value_error_naming_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        DOC.decode(raw)


@pytest.mark.parametrize("found", [True, 1.0])
def test_a_version_is_the_integer_itself(found: object) -> None:
    """``true`` and ``1.0`` equal 1 in Python but are no version 1: refused as another version
    (the daemon moves such a state aside and latches; a reader does not use it)."""
    one = Format("one", 64, version=1)
    assert one.check({"version": 1}) == {"version": 1}
    with pytest.raises(ValueError, match=f"unsupported one version {found!r}"):
        one.check({"version": found})


def test_load_takes_any_version_for_a_lenient_reader() -> None:
    assert DOC.load(b'{"version": 1, "old": true}') == {"version": 1, "old": True}


def test_check_keeps_keys_it_does_not_know_and_reads_missing_fields_as_none() -> None:
    assert DOC.check({"version": 3, "name": "a", "extra": [1]}) == {
        "version": 3,
        "name": "a",
        "extra": [1],
        "count": None,
    }


def test_an_unversioned_format_writes_what_it_is_given() -> None:
    plain = Format("paused", 100, newline=True)
    assert plain.envelope({"reason": "r"}) == {"reason": "r"}
    assert plain.encode({"reason": "r"}) == (json.dumps({"reason": "r"}) + "\n").encode()
    assert plain.check({"any": 1}) == {"any": 1}


def test_pick_reads_each_key_of_its_table_leniently() -> None:
    table = {"at": checked.as_number, "gpu": checked.as_text}
    assert pick({"at": 1, "gpu": 5, "other": 0}, table) == {"at": 1.0, "gpu": None}
    assert pick(["not", "an", "object"], table) == {"at": None, "gpu": None}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (0, 0), (9, 9), (10, "out of range"), (-1, "out of range"), (True, "integer")],
)
def test_opt_integer_is_none_or_an_integer_in_its_half_open_range(
    value: object, expected: object
) -> None:
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"what: .*{expected}"):
            checked.opt_integer(value, "what", 0, 10)
    else:
        assert checked.opt_integer(value, "what", 0, 10) == expected


def test_an_integer_out_of_range_is_said_cut_short() -> None:
    """A document's integer is as long as JSON lets it be (4300 digits): the message refusing
    it (a spare's start_ticks, said in ``EventName.SPARE_ENDED``) shows it cut, as other
    messages show a hostile value."""
    with pytest.raises(ValueError, match=r"what: 9999.*out of range") as refused:
        checked.opt_integer(int("9" * 4000), "what", 0, 10)
    assert len(str(refused.value)) < 120
