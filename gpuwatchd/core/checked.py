"""Checked access to decoded JSON: the one reader of every saved or published document.

This module owns how a value that came out of ``json.loads`` is believed, in two manners.

In detail: docs/internals.md, section `gpuwatchd.core.checked`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.core.model import MAX_XID, XidEvent, as_int

# --- strict: the expected type, or ValueError naming where ---------------------------------------


def obj(value: object, what: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{what}: expected an object")
    return value


def items(value: object, what: str, limit: int | None = None) -> list[object]:
    if not isinstance(value, list) or (limit is not None and len(value) > limit):
        raise ValueError(f"{what}: expected a list")
    return value


def text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a string")
    return value


def opt_text(value: object, what: str) -> str | None:
    return None if value is None else text(value, what)


MAX_REASON = 512  # characters of a saved free-text reason kept (a pause's and a spare's too)


def reason(value: object, what: str) -> str:
    """A saved reason cut at :data:`MAX_REASON` characters: it only says why, and refusing it
    would move the whole file around it aside."""
    return text(value, what)[:MAX_REASON]


def opt_reason(value: object, what: str) -> str | None:
    return None if value is None else reason(value, what)


MAX_STRING = 4096  # PATH_MAX; no name, glob or argument of a policy is longer (config/keys.py)


def name(value: object, what: str) -> str:
    """A saved name that events carry whole (a rule's, a user's, a kill-cap scope): refused
    past :data:`MAX_STRING` characters, a policy string's most (cut, it would name another)."""
    found = text(value, what)
    if len(found) > MAX_STRING:
        raise ValueError(f"{what}: {shown(found)} is longer than {MAX_STRING} characters")
    return found


def opt_name(value: object, what: str) -> str | None:
    return None if value is None else name(value, what)


def by_name(value: object, what: str, limit: int | None = None) -> Mapping[str, object]:
    """An object keyed by names (at most ``limit``, when given), each key read as :func:`name`."""
    found = obj(value, what)
    if limit is not None and len(found) > limit:
        raise ValueError(f"{what}: expected an object of at most {limit}")
    for key in found:
        name(key, what)
    return found


def integer(value: object, what: str) -> int:
    if (number := as_int(value)) is None:
        raise ValueError(f"{what}: expected an integer")
    return number


def opt_integer(value: object, what: str, low: int = -(1 << 63), high: int = 1 << 63) -> int | None:
    """None, or an integer in ``[low, high)``."""
    if value is None:
        return None
    found = integer(value, what)
    if not low <= found < high:
        raise ValueError(f"{what}: {shown(found)} is out of range")
    return found


def number(value: object, what: str) -> float:
    """A finite number (an integer or a float, never a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: expected a number")
    if (found := as_number(value)) is None:
        raise ValueError(f"{what}: expected a finite number")
    return found


def opt_number(value: object, what: str) -> float | None:
    return None if value is None else number(value, what)


def flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected true or false")
    return value


def numbers(value: object, what: str) -> dict[str, float]:
    return {k: number(v, f"{what}.{k}") for k, v in obj(value, what).items()}


def pairs(value: object, what: str, limit: int | None = None) -> tuple[tuple[str, float], ...]:
    """A list of ``[name, time]`` pairs (at most ``limit``, when given)."""
    out = []
    for i, item in enumerate(items(value, what, limit)):
        pair = items(item, f"{what}[{i}]")
        if len(pair) != 2:
            raise ValueError(f"{what}[{i}]: expected [name, time]")
        out.append((text(pair[0], f"{what}[{i}]"), number(pair[1], f"{what}[{i}]")))
    return tuple(out)


# --- lenient: a malformed value is None (unknown) or empty, never an exception --------------------


def decimal(text: str, digits: int = 20) -> int | None:
    """``text`` as a whole number when it is 1 to ``digits`` ASCII digits, else None (Python's
    digits include ``'²'``, which int() refuses, and other scripts' decimals, which it reads:
    none of the files and arguments read this way writes either)."""
    return int(text) if text.isascii() and text.isdecimal() and len(text) <= digits else None


def shown(value: object, most: int = 80) -> str:
    """``repr(value)`` for a message, cut to ``most`` characters: a value read from a file
    may be as large as the file."""
    said = repr(value)
    return said if len(said) <= most else f"{said[: most - 3]}..."


def is_version(found: object, *versions: int) -> bool:
    """Whether ``found`` is one of ``versions`` itself: ``true`` and ``1.0`` equal 1 in Python
    but are another version."""
    return type(found) is int and found in versions


def as_number(value: object) -> float | None:
    """A finite number as a float; None otherwise (a bool is not a number, nor an integer
    beyond every float: JSON reads 400 digits as an int, and float() of it overflows)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        found = float(value)
    except OverflowError:
        return None
    return found if math.isfinite(found) else None


def as_count(value: object) -> int | None:
    """A non-negative integer; None otherwise."""
    found = as_int(value)
    return found if found is not None and found >= 0 else None


def as_xid_event(xid: object, wall: object) -> XidEvent | None:
    """An NVML Xid event: an Xid from 0 to ``MAX_XID`` and a finite wall time from 1970 on;
    None otherwise (the collector drops it, the state file's reader refuses it)."""
    found, at = as_int(xid), as_number(wall)
    if found is None or not 0 <= found <= MAX_XID or at is None or at < 0:
        return None
    return XidEvent(found, at)


def as_text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def as_flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def as_one_of(*allowed: str) -> Callable[[object], str | None]:
    """A reader of one of the strings ``allowed``; None for anything else."""
    return lambda value: value if isinstance(value, str) and value in allowed else None


def as_map(value: object) -> Mapping[str, object]:
    """An object's string-keyed entries; {} for anything else."""
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if isinstance(k, str)}
    return {}


def as_list(value: object) -> Sequence[object]:
    return value if isinstance(value, list) else []
