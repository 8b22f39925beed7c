"""Whether the daemon's holder view is current: the guard on its device watch, which makes a
``scan`` answered from the view as right as a walk (docs/scan.md, "Answered by the daemon").

In detail: docs/internals.md, section `gpuwatchd.served.guard`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.collect.devwatch import CAPS_FOLDER, IN_OPEN, DeviceWatch, WatchNews
from gpuwatchd.collect.holders import match_device_name
from gpuwatchd.served.holders import REFRESH, VIEW_FILE, HolderView
from gpuwatchd.state.directory import StateDir

FIONREAD = 0x541B
EARLY_GAP = 1.0  # seconds: an open wakes the daemon, but it walks at most once a second
_MAX_FDINFO = 1 << 20


def queued_bytes(fd: int) -> int:
    """Bytes of events queued on the inotify descriptor ``fd``; -1 when it cannot be asked."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, FIONREAD, buf)
    except OSError:
        return -1
    return int(struct.unpack("i", buf)[0])


def early_poll_at(last_poll: float | None, now: float, interval: float) -> float:
    """When a daemon woken by a device event polls: now, but no sooner than
    :data:`EARLY_GAP` (bounded by ``interval``) after the start of its previous poll."""
    if last_poll is None:
        return now
    return max(now, last_poll + min(EARLY_GAP, interval))


class ViewPublisher:
    """Writes ``holders.json`` for the daemon: a clean view after a poll, and the dirty mark
    before the watch's events are read (module docstring)."""

    def __init__(
        self,
        state_dir: Callable[[], StateDir | None],
        on_error: Callable[[str], None],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._state_dir = state_dir
        self._on_error = on_error
        self._wall_clock = wall_clock
        self._doc: dict[str, object] | None = None  # the clean view last written
        self._content: dict[str, object] | None = None  # ... without its "polled"
        self._polled = 0.0
        self.dirty = False  # what is on disk says dirty (or is gone)

    def publish(self, view: dict[str, object]) -> bool:
        """Write the clean ``view`` when it changed, when the file says dirty, or every
        :data:`REFRESH` seconds; True when it was written now."""
        content = {key: value for key, value in view.items() if key != "polled"}
        polled = view.get("polled")
        wall = float(polled) if isinstance(polled, (int, float)) else self._wall_clock()
        # A poll dated before the one written (the wall clock set back) rewrites it too.
        if not self.dirty and content == self._content and 0 <= wall - self._polled < REFRESH:
            return False
        state_dir = self._state_dir()
        if state_dir is None or not self._write(state_dir, view):
            return False
        self._doc, self._content, self._polled, self.dirty = view, content, wall, False
        return True

    def mark_dirty(self) -> bool:
        """Say on disk that the view may be stale, before any watch event is read; False when
        neither the dirty view could be written nor the file removed (serving must stop)."""
        if self.dirty or self._doc is None:
            return True
        state_dir = self._state_dir()
        if state_dir is not None:
            doc = {**self._doc, "clean": False, "dirty_since": self._wall_clock()}
            written = self._write(state_dir, doc)
            with contextlib.suppress(OSError):
                if not written:
                    state_dir.discard(VIEW_FILE)
                self.dirty = True
        return self.dirty

    def _write(self, state_dir: StateDir, doc: dict[str, object]) -> bool:
        """Write ``doc`` as the view; False (said) when it failed. No fsync: other processes
        see the rename at once, and the view describes this daemon's running poll, refused
        once the daemon or the boot is gone (after a crash too): a flush would stall the poll."""
        try:
            state_dir.write(VIEW_FILE, json.dumps(doc).encode(), sync=False)
        except OSError as exc:
            self._on_error(str(exc))
            return False
        return True


class GuardedWatch(DeviceWatch):
    """:class:`DeviceWatch` whose events are read only after ``on_pending`` marked the
    published view dirty (module docstring); its descriptor is waited on by the daemon."""

    def __init__(self, devices_dir: str, on_pending: Callable[[], bool]) -> None:
        super().__init__(devices_dir)
        self._on_pending = on_pending

    def fileno(self) -> int | None:
        return self._fd

    def mark_if_pending(self) -> bool:
        """Mark the view dirty when events are queued; False when the watch had to close."""
        if self._fd is None or queued_bytes(self._fd) == 0:
            return True
        if self._on_pending():
            return True
        self.error = "the published holder view could not be marked stale"
        self.close()
        return False

    def drain(self) -> WatchNews:
        if self._fd is None:
            return super().drain()
        if queued_bytes(self._fd) == 0:
            # Nothing queued: read nothing (an event arriving now stays queued, unread, until
            # the next drain marks the view first); only files still to be watched are added.
            rewatched = self._watch_present() if self._stale else 0
            return WatchNews(
                available=not self._incomplete, changed=bool(rewatched), rewatched=rewatched
            )
        if not self.mark_if_pending():
            return WatchNews(available=False, changed=True)
        return super().drain()


def _watched(proc_root: str, fd: int) -> set[tuple[int, int]] | None:
    """(inode, kernel device number) of each ``IN_OPEN`` watch of our inotify ``fd``."""
    try:
        if os.readlink(f"{proc_root}/self/fd/{fd}") != "anon_inode:inotify":
            return None
        with open(f"{proc_root}/self/fdinfo/{fd}", "rb") as handle:
            text = handle.read(_MAX_FDINFO).decode("ascii", "replace")
    except OSError:
        return None
    found: set[tuple[int, int]] = set()
    for line in text.splitlines():
        if not line.startswith("inotify wd:"):
            continue
        fields = dict(part.split(":", 1) for part in line.split()[1:] if ":" in part)
        try:
            if int(fields["mask"], 16) & IN_OPEN:
                found.add((int(fields["ino"], 16), int(fields["sdev"], 16)))
        except (KeyError, ValueError):
            continue
    return found


def _device_files(devices_dir: str) -> set[tuple[int, int]] | None:
    """(inode, kernel device number) of every device file in ``devices_dir`` and its
    ``nvidia-caps/`` (MIG capability files)."""
    found: set[tuple[int, int]] = set()
    try:
        names = os.listdir(devices_dir)
        if CAPS_FOLDER in names:
            names += [f"{CAPS_FOLDER}/{n}" for n in os.listdir(f"{devices_dir}/{CAPS_FOLDER}")]
    except OSError:
        return None
    for name in names:
        if match_device_name(name) is None:
            continue
        try:
            st = os.stat(f"{devices_dir}/{name}", follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        # The kernel shows the file system's device as MAJOR << 20 | MINOR in fdinfo.
        found.add((st.st_ino, os.major(st.st_dev) << 20 | os.minor(st.st_dev)))
    return found


@dataclass(frozen=True)
class ServedPoll:
    """What the daemon answers a ``scan`` from: its last poll's holder view and NVML reading
    (None: that read failed), with the watch and publisher that say whether it is current."""

    view: HolderView
    reading: Mapping[str, Any] | None
    watch: DeviceWatch
    publisher: ViewPublisher

    def stale_because(self, proc_root: str, devices_dir: str) -> str | None:
        """Why the view's walk may miss an open of a watched device file now (None: it
        cannot; why that holds: docs/internals.md, section ``gpuwatchd.served.guard``)."""
        fd = self.view.watch_fd
        if fd is None or not self.watch.available:
            return "the daemon's device watch is not working"
        watched = _watched(proc_root, fd)
        devices = _device_files(devices_dir)
        if watched is None or devices is None or not devices <= watched:
            return "the daemon's device watch does not cover every device file"
        if queued_bytes(fd) != 0:
            return "a device file was opened since the daemon's last walk"
        if self.publisher.dirty:
            return "the daemon's holder view is dirty (a device file was opened; it is walking)"
        return None
