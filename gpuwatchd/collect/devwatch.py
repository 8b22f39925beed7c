"""An inotify watch on the NVIDIA device files: has anything opened one since we last looked?

In detail: docs/internals.md, section `gpuwatchd.collect.devwatch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass

from gpuwatchd.collect.holders import match_device_name

CAPS_FOLDER = "nvidia-caps"  # MIG capability device files: devices_dir/nvidia-caps/nvidia-capN

IN_OPEN = 0x00000020
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class WatchNews:
    """What the watch saw since the previous :meth:`DeviceWatch.drain`."""

    available: bool
    changed: bool = False
    opened: int = 0  # IN_OPEN events on device files
    overflow: bool = False
    rewatched: int = 0  # device files watched anew (created, or after IN_IGNORED)


class DeviceWatch:
    """``IN_OPEN`` watches on the device files in ``devices_dir`` (module docstring)."""

    def __init__(self, devices_dir: str) -> None:
        self.devices_dir = devices_dir.rstrip("/") or "/"
        self._fd: int | None = None
        self._libc: ctypes.CDLL | None = None
        self._files: dict[int, str] = {}  # watch descriptor -> device file name
        self._folder_wd: int | None = None
        self._caps_wd: int | None = None  # devices_dir/nvidia-caps, while it exists
        self._stale = True  # (re)watch every device file present at the next drain
        self._incomplete = False  # a device file present could not be watched
        self.error: str | None = None

    @property
    def available(self) -> bool:
        """Whether every device file present is watched (opens of all of them are seen)."""
        return self._fd is not None and not self._incomplete

    def start(self) -> bool:
        """Create the inotify instance, watch what is there; False (``error`` says why) if not."""
        if self._fd is not None:
            return True
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)  # IN_NONBLOCK | IN_CLOEXEC
        except (OSError, AttributeError) as err:
            self.error = f"inotify unavailable: {err}"
            return False
        if fd < 0:
            self.error = f"inotify_init1: {os.strerror(ctypes.get_errno())}"
            return False
        self._libc, self._fd = libc, fd
        self._watch_present()
        return True

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self._files, self._stale = None, {}, True
        self._folder_wd = self._caps_wd = None

    def drain(self) -> WatchNews:
        """Everything queued since the last call, without blocking."""
        if self._fd is None:
            return WatchNews(available=False)
        opened, overflow, rewatch = 0, False, False
        created: set[str] = set()  # device files created anew (watched again though named)
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                break
            except OSError as err:
                self.error = f"inotify read: {os.strerror(err.errno or errno.EIO)}"
                self.close()
                return WatchNews(available=False, changed=True)
            if not data:
                break
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
                at += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = rewatch = True
                elif mask & IN_IGNORED:
                    self._files.pop(wd, None)
                    if wd == self._folder_wd:
                        self._folder_wd = None
                    if wd == self._caps_wd:
                        self._caps_wd = None
                    rewatch = True
                elif wd in (self._folder_wd, self._caps_wd):
                    decoded = os.fsdecode(name)
                    if decoded == CAPS_FOLDER or match_device_name(decoded) is not None:
                        rewatch = True
                        created.add(f"{CAPS_FOLDER}/{decoded}" if wd == self._caps_wd else decoded)
                elif mask & IN_OPEN:
                    opened += 1
        # Lost events may have been a replaced file's IN_CREATE: watch each one again.
        rewatched = self._watch_present(created, again=overflow) if rewatch or self._stale else 0
        return WatchNews(
            available=not self._incomplete,
            changed=bool(opened or overflow or rewatched or rewatch),
            opened=opened,
            overflow=overflow,
            rewatched=rewatched,
        )

    def _add(self, path: str, mask: int) -> int:
        if self._libc is None or self._fd is None:
            return -1
        return int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))

    def _add_folder(self, path: str) -> int | None:
        wd = self._add(path, IN_CREATE | IN_MOVED_TO | IN_ONLYDIR)
        return wd if wd >= 0 else None

    def _watch_present(self, created: Collection[str] = (), *, again: bool = False) -> int:
        """Watch every device file in the folder not watched yet, and those ``created`` anew
        (a replaced file's name alone does not say it is watched), or with ``again`` every one
        (a file already watched keeps its watch); how many new watches were added."""
        self._stale = False
        if self._folder_wd is None:
            self._folder_wd = self._add_folder(self.devices_dir)
        try:
            names = os.listdir(self.devices_dir)
        except OSError:  # what is there is unknown: not complete until listed again
            self._stale = self._incomplete = True
            return 0
        # A folder not watched (the kernel refused it) would miss device files created in it.
        unwatched = self._folder_wd is None
        if CAPS_FOLDER in names:
            caps = f"{self.devices_dir}/{CAPS_FOLDER}"
            if self._caps_wd is None:
                self._caps_wd = self._add_folder(caps)
            try:
                names += [f"{CAPS_FOLDER}/{name}" for name in os.listdir(caps)]
            except OSError:
                unwatched = True  # tried again next time; until then, not complete
            unwatched |= self._caps_wd is None
        watched = set(self._files.values())
        added = 0
        self._incomplete = self._stale = unwatched
        for name in names:
            if match_device_name(name) is None:
                continue
            if name in watched and name not in created and not again:
                continue
            wd = self._add(f"{self.devices_dir}/{name}", IN_OPEN)
            if wd >= 0:
                # The kernel returns the same wd for a file already watched: keep one entry.
                added += wd not in self._files
                self._files[wd] = name
            else:
                # Gone again, or the watch limit: try next time; until then its opens go unseen.
                self._stale = self._incomplete = True
        return added
