"""``/etc/subuid``: the ranges of subordinate uids each user owns, read for the kill cap.

A rootless container runs its users as host uids from its owner's range, so the kill cap counts
a process against that owner (``decide/plan/intents.py``). This module reads the file, bounded,
line by line (``name:first:count``; malformed lines skipped), once per change. It decides nothing.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable

from gpuwatchd.core.checked import decimal
from gpuwatchd.core.model import SubIdRange

DEFAULT_SUBUID_FILE = "/etc/subuid"
MAX_BYTES = 1 << 20
MAX_RANGES = 65_536
_MAX_UID = (1 << 32) - 1


def _uid_of_name(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, OSError):
        return None


def parse_subuid(
    text: str, uid_of: Callable[[str], int | None] = _uid_of_name
) -> tuple[SubIdRange, ...]:
    """The ranges of ``/etc/subuid``'s text; an owner written as digits is that uid. Pure but
    for ``uid_of`` (the user database)."""
    ranges: list[SubIdRange] = []
    for line in text.splitlines():
        fields = line.strip().split(":")
        # Numbers as shadow-utils reads them: ASCII digits, few enough (a uid has at most 10).
        first, count = (decimal(f) for f in fields[1:3]) if len(fields) == 3 else (None, None)
        if first is None or count is None:
            continue  # comments, blank and malformed lines
        owner = fields[0]
        if not owner or count == 0 or first + count - 1 > _MAX_UID:
            continue
        owner_uid = decimal(owner)
        owner_uid = uid_of(owner) if owner_uid is None else owner_uid
        ranges.append(SubIdRange(first, count, owner, owner_uid))
        if len(ranges) >= MAX_RANGES:
            break
    return tuple(ranges)


class SubUidFile:
    """``path`` (None: not read), re-read only when its size, time or inode changed."""

    def __init__(self, path: str | None = DEFAULT_SUBUID_FILE) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._ranges: tuple[SubIdRange, ...] = ()

    def ranges(self) -> tuple[SubIdRange, ...]:
        if self.path is None:
            return ()
        try:
            st = os.stat(self.path)
        except OSError:
            self._key, self._ranges = None, ()
            return ()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            try:  # not blocking on a FIFO; only a regular file is read
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    regular = stat.S_ISREG(os.fstat(fd).st_mode)
                    raw = os.read(fd, MAX_BYTES + 1) if regular else b""
                finally:
                    os.close(fd)
            except OSError:
                return self._ranges
            if len(raw) > MAX_BYTES:  # a line cut at the bound is no range: up to the last whole
                raw = raw[: raw.rfind(b"\n", 0, MAX_BYTES) + 1]
            self._key, self._ranges = key, parse_subuid(raw.decode("utf-8", errors="replace"))
        return self._ranges
