"""The admin's switches, kept as small files in ``state_dir`` so they survive restarts.

``gpuwatchd pause`` / ``resume`` write and remove ``<state_dir>/paused``; ``resume
--clear-latches`` drops ``<state_dir>/clear-latches``, which the daemon consumes at its next poll
to lift the kill-cap dry-run latch and the reset circuit breaker. This module only reads and
writes those files; what pausing means is the planner's business.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

PAUSE_FILE = "paused"
CLEAR_LATCHES_FILE = "clear-latches"


def set_pause(state_dir: str, *, reason: str | None) -> None:
    """Pause (``reason`` a string, may be empty) or resume (``reason`` None)."""
    path = os.path.join(state_dir, PAUSE_FILE)
    if reason is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    body = json.dumps({"reason": reason, "since": time.time(), "by_uid": os.getuid()})
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(body + "\n")
    os.replace(tmp, path)


def read_pause(state_dir: str) -> str | None:
    """The pause reason when paused (``""`` when none was given), else None."""
    try:
        with open(os.path.join(state_dir, PAUSE_FILE), encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    except OSError:
        return "pause file unreadable"  # fail safe: an unreadable switch counts as paused
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()
    reason = data.get("reason") if isinstance(data, dict) else None
    return str(reason) if reason is not None else ""


def clear_latches(state_dir: str) -> None:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(state_dir, CLEAR_LATCHES_FILE), "w", encoding="utf-8") as handle:
        handle.write(f"{time.time()}\n")


def take_clear_latches(state_dir: str) -> bool:
    """True once after ``resume --clear-latches`` (the request file is consumed)."""
    try:
        os.unlink(os.path.join(state_dir, CLEAR_LATCHES_FILE))
    except FileNotFoundError:
        return False
    return True
