"""Reading the shipped systemd unit's settings: its key values and memory sizes."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "gpuwatchd.service"


def unit_entries() -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment in the unit, in file order."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def values(key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_entries() if s == section and k == key]


def memory_bytes(value: str) -> int:
    found = re.fullmatch(r"(\d+)([KMG]?)", value)
    assert found is not None, value
    number, unit = found.groups()
    return int(number) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit]
