"""The admin's switches, kept as small files in ``state_dir`` so they survive restarts.

``gpuwatchd pause`` / ``resume`` write and remove ``<state_dir>/paused``; ``resume
--clear-latches`` drops ``<state_dir>/clear-latches``, which the daemon consumes at its next poll
to lift the kill-cap dry-run latch and the reset circuit breaker. This module only reads and
writes those files; what pausing means is the planner's business.

The files are opened as :mod:`gpuwatchd.state` opens its own: relative to ``state_dir``,
never through a symbolic link, regular files only, size-capped. A switch that cannot be read
counts as *paused* (fail safe), and its content never reaches the log unless it is a real
pause file.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from gpuwatchd.state import read_small, write_atomically

PAUSE_FILE = "paused"
CLEAR_LATCHES_FILE = "clear-latches"
MAX_REASON = 512  # characters of a pause reason kept


def set_pause(state_dir: str, *, reason: str | None) -> None:
    """Pause (``reason`` a string, may be empty) or resume (``reason`` None)."""
    path = os.path.join(state_dir, PAUSE_FILE)
    if reason is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    body = json.dumps({"reason": reason, "since": time.time(), "by_uid": os.getuid()})
    write_atomically(state_dir, PAUSE_FILE, (body + "\n").encode("utf-8"))


def read_pause(state_dir: str) -> str | None:
    """The pause reason when paused (``""`` when none was given), else None."""
    try:
        raw = read_small(state_dir, PAUSE_FILE, 64 * 1024)
    except FileNotFoundError:
        return None
    except OSError:
        return "pause file unreadable"  # fail safe: an unreadable switch counts as paused
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw.decode("utf-8", "replace").strip()[:MAX_REASON]
    reason = data.get("reason") if isinstance(data, dict) else None
    return str(reason)[:MAX_REASON] if reason is not None else ""


def clear_latches(state_dir: str) -> None:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    write_atomically(state_dir, CLEAR_LATCHES_FILE, f"{time.time()}\n".encode("ascii"))


def take_clear_latches(state_dir: str) -> bool:
    """True once after ``resume --clear-latches`` (the request is consumed). Whatever the
    entry is (a file, a link), removing it is the request; one that cannot be removed is
    not taken (it would be taken again at every poll)."""
    try:
        os.unlink(os.path.join(state_dir, CLEAR_LATCHES_FILE))
    except OSError:
        return False
    return True
