"""Waiting on what a daemon under test publishes in its ``state_dir`` (its holder view), for
end-to-end tests: the document as read (empty when missing or mid-write), whether it is
clean, and a bounded wait for a condition. It only reads files; it never signals."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["doc", "view_clean", "view_served", "wait_for"]


def wait_for(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    """Return once ``predicate()`` is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def doc(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when it is missing or not (yet) whole."""
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded


def view_clean(view: Path) -> bool:
    """The daemon published a clean view (no device file opened since its walk)."""
    return doc(view).get("clean") is True


def view_served(view: Path) -> bool:
    """The daemon published a clean view whose holders all still run (their start ticks): one
    it can answer a ``scan`` from. A holder that has exited since (a ``scan`` that walked by
    itself and its NVML worker, which opened the device files) is a walk due (``holder_gone``):
    the daemon declines until its next poll has walked."""
    found = doc(view)
    holders = found.get("holders", [])
    return found.get("clean") is True and all(_runs(pid, ticks) for pid, ticks in holders)


def _runs(pid: int, ticks: int | None) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    # After the comm: the state (field 3), ..., the start ticks (field 22).
    return fields[0] not in ("Z", "X") and ticks in (None, int(fields[19]))
