"""Durations and sizes as the policy spells them (``500ms``, ``30s``, ``1h30m``; ``256MiB``):
parsed, and written back so that what is written parses to the same value. Which key takes
which unit, between which limits, is the key table's (``gpuwatchd.config.keys``). Pure.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

from gpuwatchd.config.yamlsrc import ConfigError, describe_value, did_you_mean, shown

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
SIZE_UNITS = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)")


def parse_duration(value: object, *, where: str) -> float:
    """A duration in seconds from ``30s``, ``500ms``, ``5m``, ``2h``, ``1d``, ``1h30m`` or a
    bare number; ConfigError (``key=where``) for a negative, non-finite, boolean or unit-less
    string value."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(
            f"expected a duration such as '30s', got {describe_value(value)}", key=where
        )
    if isinstance(value, str):
        text = value.strip()
        if not text or _DURATION_PART.sub("", text) != "":
            raise ConfigError(
                f"invalid duration {shown(value)} (use a number with a unit: ms, s, m, h, d; "
                "e.g. '500ms', '30s', '1h30m')",
                key=where,
            )
        # float() of a long digit string is inf, never an exception: refused below.
        parts = _DURATION_PART.findall(text)
        seconds = sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)
    else:
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"duration must be a finite value >= 0, got {shown(value)}", key=where)
    return seconds


def parse_size(value: object, *, where: str) -> int:
    """A size in bytes from ``256MiB``, ``1GiB``, ``100MB`` or a bare integer: a whole number
    of bytes, >= 0, and exactly computable (ConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(
            f"expected a size such as '256MiB', got {describe_value(value)}", key=where
        )
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value.strip())
        unit = match.group(2) if match else ""
        if match is None or unit not in SIZE_UNITS:
            hint = did_you_mean(unit, list(SIZE_UNITS)) if unit else ""
            raise ConfigError(
                f"invalid size {shown(value)}{hint} (units: B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)",
                key=where,
            )
        digits, _, decimals = match.group(1).partition(".")
        digits, decimals = digits.lstrip("0"), decimals.rstrip("0")
        # Exact, as a float is not (1.001kB), and never a long digit string read as an int:
        # 17 digits are past 2**53, and no unit (each divides 10**40) makes 41 decimals whole.
        exact = Fraction(f"{digits[:17] or 0}.{decimals[:40]}") * SIZE_UNITS[unit]
        if exact >= 2**53:
            raise ConfigError(f"size {shown(value)} is too large", key=where)
        if exact.denominator != 1 or len(decimals) > 40:
            raise ConfigError(f"size {shown(value)} is not a whole number of bytes", key=where)
        size = int(exact)
    if size < 0:
        raise ConfigError(f"size must be >= 0, got {shown(value)}", key=where)
    return size


def format_duration(seconds: float) -> str:
    """The shortest unit spelling that parses back to exactly ``seconds``; else its shortest
    decimal (never an exponent: ``1e-05s`` does not parse) in seconds."""
    for unit in ("d", "h", "m", "s", "ms"):
        count = seconds / DURATION_UNITS[unit]
        if count == int(count) and parse_duration(f"{int(count)}{unit}", where="") == seconds:
            return f"{int(count)}{unit}"
    return f"{Decimal(repr(seconds)):f}s"


def format_size(size: int) -> str:
    """The largest binary unit that writes ``size`` exactly (``256MiB``), else bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % SIZE_UNITS[unit] == 0:
            return f"{size // SIZE_UNITS[unit]}{unit}"
    return f"{size}B"
