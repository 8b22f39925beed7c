"""Durations, times, counts and values as people read them (``9m53s``, ``in 25s``, ``3m ago``,
``1 finding``, ``yes``) in the text of ``scan``, ``status``, ``explain`` and ``spare``; and the
one reader of ``pause --for`` and ``spare --for``."""

from __future__ import annotations

import time
from collections.abc import Mapping

from gpuwatchd.core.checked import as_number
from gpuwatchd.core.escape import escape


def duration(seconds: object) -> str:
    """A span of time: ``0.5s``, ``42s``, ``9m53s``, ``10m``, ``1h02m``, ``1d``, ``2d03h`` (tenths
    under a minute, at most two units); ``?`` for anything but a finite, non-negative number."""
    value = as_number(seconds)
    if value is None or value < 0:
        return "?"
    if value < 60:
        return f"{round(value, 1):g}s"
    whole = int(value)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
    return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"


def for_seconds(text: str, *, command: str, limit: str, maximum: float) -> float:
    """``COMMAND --for TEXT`` in seconds, from 1s to ``maximum`` (the policy's ``limit``).
    Raises ConfigError when TEXT is no duration, ValueError when it is out of range."""
    # Imported here: the config reader brings PyYAML, which a scan never loads
    # (tests/system/test_scan_imports.py); only pause and spare read a duration.
    from gpuwatchd.config.units import parse_duration

    seconds = parse_duration(text, where="--for")
    if not 1 <= seconds <= maximum:
        raise ValueError(
            f"{command} --for {text.strip()}: must be between 1s and {limit} ({duration(maximum)})"
        )
    return seconds


def until(seconds: object) -> str:
    """How long until something: ``in 9m53s``; ``now`` when it is due (under a second left)."""
    value = as_number(seconds)
    if value is None:
        return "?"
    return "now" if value < 1 else f"in {duration(float(int(value)))}"


def ago(seconds: object) -> str:
    """How long since something: ``3m12s ago``; ``just now`` under a second. A negative age (a
    wall clock stepped back since) is shown as ``in the future`` rather than hidden."""
    value = as_number(seconds)
    if value is None:
        return "?"
    if value < -1:
        return f"{duration(float(int(-value)))} in the future (clock stepped?)"
    return "just now" if value < 1 else f"{duration(float(int(value)))} ago"


def stamp(wall: float, *, zone: bool = False) -> str:
    """A wall time as local time (``2026-01-02 03:04:05``, ``zone``: and its zone); ``?`` when
    it cannot be one."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S" + (" %Z" if zone else ""), time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return "?"


def counted(count: object, noun: str, unknown: str = "?") -> str:
    """``1 finding``, ``2 findings``, ``0 findings``; ``? findings`` (``unknown``): no count."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"{unknown} {noun}s"
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def shown(value: object, unknown: str = "?") -> str:
    """A scalar as display text, control characters escaped; ``unknown`` for None, an object
    or a list."""
    if value is None or isinstance(value, (Mapping, list)):
        return unknown
    if isinstance(value, bool):
        return "yes" if value else "no"
    return escape(str(value))
