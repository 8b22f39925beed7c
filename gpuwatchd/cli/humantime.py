"""Durations, times and counts as people read them (``9m53s``, ``in 25s``, ``3m ago``,
``1 finding``) in the text of ``status``, ``explain`` and ``spare``; and the one reader of
``pause --for`` and ``spare --for``."""

from __future__ import annotations

import math
import time


def duration(seconds: object) -> str:
    """A span of time: ``0.5s``, ``42s``, ``9m53s``, ``10m``, ``1h02m``, ``1d``, ``2d03h`` (tenths
    under a minute, at most two units); ``?`` for anything but a finite, non-negative number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{round(seconds, 1):g}s"
    whole = int(seconds)
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
            f"{command} --for {text}: must be between 1s and {limit} ({duration(maximum)})"
        )
    return seconds


def until(seconds: object) -> str:
    """How long until something: ``in 9m53s``; ``now`` when it is due (under a second left)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    if not math.isfinite(seconds):
        return "?"
    if seconds < 1:
        return "now"
    return f"in {duration(float(int(seconds)))}"


def ago(seconds: object) -> str:
    """How long since something: ``3m12s ago``; ``just now`` under a second. A negative age (a
    wall clock stepped back since) is shown as ``in the future`` rather than hidden."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    if not math.isfinite(seconds):
        return "?"
    if seconds < -1:
        return f"{duration(float(int(-seconds)))} in the future (clock stepped?)"
    if seconds < 1:
        return "just now"
    return f"{duration(float(int(seconds)))} ago"


def stamp(wall: float, *, zone: bool = False) -> str:
    """A wall time as local time (``2026-01-02 03:04:05``, ``zone``: and its zone); ``?`` when
    it cannot be one."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S" + (" %Z" if zone else ""), time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return "?"


def counted(count: object, noun: str, unknown: str = "?") -> str:
    """``1 finding``, ``2 findings``, ``0 findings``; ``? findings`` (``unknown``) when not a
    count."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"{unknown} {noun}s"
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
