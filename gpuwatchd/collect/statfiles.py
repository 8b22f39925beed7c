"""The bottom of the ``/proc`` readers (``procfs`` and ``holders`` build on it): a file read
whole, whether a folder is a real ``proc``, and ``/proc/PID/stat`` of the processes a steady poll
looks at, read through descriptors kept open.

Each known process's identity and state check is one ``pread`` of a kept descriptor (the kernel
renders the file anew on every read from offset 0) instead of a path walk, an open, two reads
and a close (docs/performance.md). In detail: docs/internals.md, `gpuwatchd.collect.statfiles`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
from collections.abc import Iterable, Iterator

from gpuwatchd.core.procstat import StatFields, parse_stat

MAX_OPEN = 256
_SIZE = 4096  # a stat line is a few hundred bytes; a comm is at most 64
_FLAGS = os.O_RDONLY | os.O_CLOEXEC
PROC_SUPER_MAGIC = 0x9FA0
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
# statx(2): the attributes the kernel has, never asking the file's own file system (FUSE, NFS)
_AT_FDCWD, _AT_STATX_DONT_SYNC, _STATX_BASIC_STATS = -100, 0x4000, 0x7FF
_STATX = struct.Struct("<8xQI2IH2xQ")  # attributes..mode, then ino; rdev and dev at 128
_statx = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)


def read_proc_file(path: str, limit: int | None = None) -> bytes:
    """The whole file (its first ``limit`` bytes), read in chunks (``/proc`` files report size
    0, so no single read)."""
    fd = os.open(path, _FLAGS)
    try:
        chunks, size = [], 0
        while chunk := os.read(fd, 65536 if limit is None else min(65536, limit - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_proc_blocks(path: str) -> Iterator[bytes]:
    """The file a block of whole ``\n``-separated lines at a time, for one too large to hold:
    the maps of a process with 65,530 mappings of a 4 KiB path are 270 MB."""
    fd = os.open(path, _FLAGS)
    try:
        rest = b""
        while chunk := os.read(fd, 65536):
            block, newline, rest = (rest + chunk).rpartition(b"\n")
            if newline:
                yield block
        if rest:
            yield rest
    finally:
        os.close(fd)


def is_procfs(path: str) -> bool:
    """Whether ``path`` is on a ``proc`` file system (False when that cannot be told)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    f_type: int = ctypes.c_long.from_buffer(buf).value
    return f_type == PROC_SUPER_MAGIC


def stat_cached(path: str, *, dir_fd: int | None = None) -> os.stat_result:
    """``os.stat(path)`` from the attributes the kernel holds (``AT_STATX_DONT_SYNC``): a file
    an fd or a mapping names may be on a file system that never answers (a user's FUSE server,
    a hung NFS home), and its type and device number never change. ``os.stat`` where the C
    library has no ``statx``."""
    if _statx is None:
        return os.stat(path, dir_fd=dir_fd)
    buf = ctypes.create_string_buffer(256)  # struct statx
    where = _AT_FDCWD if dir_fd is None else dir_fd
    if _statx(where, os.fsencode(path), _AT_STATX_DONT_SYNC, _STATX_BASIC_STATS, buf) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    _, nlink, uid, gid, mode, ino = _STATX.unpack_from(buf)
    rdev_major, rdev_minor, dev_major, dev_minor = struct.unpack_from("<4I", buf, 128)
    return os.stat_result(
        (mode, ino, os.makedev(dev_major, dev_minor), nlink, uid, gid, 0, 0, 0, 0),
        {"st_rdev": os.makedev(rdev_major, rdev_minor)},
    )


class StatFiles:
    """Kept-open ``/proc/PID/stat`` descriptors under ``root`` (module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.keeping = is_procfs(root)  # else every read opens afresh
        self._fds: dict[int, int] = {}
        self._last: dict[int, tuple[bytes, StatFields | None]] = {}  # what the fd read last
        self._threads: dict[int, int] = {}  # threads of each PID read since the last retain
        self._children: dict[int, int] = {}  # PID -> its task/PID/children, kept open

    def read(self, pid: int) -> StatFields | None:
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                raw = os.pread(fd, _SIZE, 0)
            except OSError:
                raw = b""  # that process was reaped: the PID is looked up afresh below
            if raw and len(raw) < _SIZE:
                return self._parsed(pid, raw, keep=True)
            self._close(pid)
        try:
            fd = os.open(f"{self.root}/{pid}/stat", _FLAGS)
        except OSError:
            return None
        try:
            raw = os.pread(fd, _SIZE, 0)
        except OSError:
            os.close(fd)
            return None
        if raw and len(raw) < _SIZE and len(self._fds) < MAX_OPEN and self.keeping:
            self._fds[pid] = fd
            return self._parsed(pid, raw, keep=True)
        os.close(fd)
        if len(raw) >= _SIZE:  # longer than any stat line: read it whole, as procfs does
            try:
                raw = read_proc_file(f"{self.root}/{pid}/stat")
            except OSError:
                return None
        return self._parsed(pid, raw, keep=False) if raw else None

    def _parsed(self, pid: int, raw: bytes, *, keep: bool) -> StatFields | None:
        """``raw`` parsed (the same bytes as the kept fd's last read parse the same: a sleeping
        process), its thread count noted."""
        last = self._last.get(pid) if keep else None
        if last is None or last[0] != raw:
            last = (raw, parse_stat(raw.decode("utf-8", "replace")))
            if keep:
                self._last[pid] = last
        if last[1] is not None:
            self._threads[pid] = last[1].num_threads
        return last[1]

    def children(self, pid: int) -> list[int] | None:
        """The children of ``pid`` when it was read single-threaded since the last :meth:`retain`
        (its one thread's ``children`` file through a kept descriptor, no listing of ``task``);
        None when not known that way (the caller reads them the usual way)."""
        if not self.keeping or self._threads.get(pid) != 1:
            return None
        fd = self._children.get(pid)
        if fd is None:
            if len(self._children) >= MAX_OPEN:
                return None
            try:
                fd = os.open(f"{self.root}/{pid}/task/{pid}/children", _FLAGS)
            except OSError:
                return None
            self._children[pid] = fd
        try:
            raw = os.pread(fd, _SIZE, 0)
        except OSError:
            self._close_kept(self._children, pid)  # reaped since: ask the usual way
            return None
        if len(raw) >= _SIZE:
            return None  # a long list: the usual way reads it whole
        try:
            return sorted(int(n) for n in raw.split())
        except ValueError:
            return None

    def retain(self, pids: Iterable[int]) -> None:
        """Close the descriptors of processes not in ``pids``; forget the thread counts read
        (the next poll reads them again)."""
        keep = set(pids)
        for pid in [p for p in self._fds if p not in keep]:
            self._close(pid)
        for pid in [p for p in self._children if p not in keep]:
            self._close_kept(self._children, pid)
        self._threads.clear()

    def __len__(self) -> int:
        return len(self._fds)

    @staticmethod
    def _close_kept(kept: dict[int, int], pid: int) -> None:
        fd = kept.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _close(self, pid: int) -> None:
        self._last.pop(pid, None)
        self._threads.pop(pid, None)
        self._close_kept(self._children, pid)
        self._close_kept(self._fds, pid)
