"""A process that SIGKILL cannot end, for tests: a file on a FUSE mount whose FLUSH never returns.

Owns a minimal FUSE file system served from a thread of the test process, straight over
``/dev/fuse`` (no libfuse): one regular file, ``hang``. Any process that has it open and is then
killed gets stuck while exiting: closing the file sends FUSE_FLUSH, which the kernel sends as a
*forced* request and waits for without any signal ending the wait (``request_wait_answer``
in fs/fuse/dev.c), and this server never answers it. The process shows state ``D`` and
``waitpid`` does not see it exit — the way an NVML worker stuck in the GPU driver behaves.
:meth:`HangingFuse.release` closes ``/dev/fuse``, which aborts the connection: the pending FLUSH
fails and the process finishes dying.

Needs root (``mount``), ``/dev/fuse`` and a kernel with FUSE; :func:`HangingFuse.start` raises
:class:`Unavailable` otherwise, so tests can skip visibly. Test-only code.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import stat
import struct
import threading
from pathlib import Path

FUSE_LOOKUP = 1
FUSE_GETATTR = 3
FUSE_OPEN = 14
FUSE_RELEASE = 18
FUSE_FLUSH = 25
FUSE_INIT = 26
FUSE_INTERRUPT = 36
FUSE_DESTROY = 38
NO_REPLY = frozenset({2, 42, FUSE_INTERRUPT})  # FORGET, BATCH_FORGET, INTERRUPT: never answered

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks a/m/ctime, nsecs, mode nlink ...
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsec nsec
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("<QII")  # fh open_flags backing_id
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes, the rest unused
ROOT, FILE = 1, 2
FILE_NAME = "hang"
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


class Unavailable(Exception):
    """FUSE cannot be used here (not root, no /dev/fuse, mount refused)."""


def _attr(node: int) -> bytes:
    mode = (stat.S_IFDIR | 0o755) if node == ROOT else (stat.S_IFREG | 0o644)
    return ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class HangingFuse:
    """A FUSE mount at ``mountpoint`` whose file ``hang`` pins whoever closes it."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.file = mountpoint / FILE_NAME
        self.flushes = 0
        self.hang_getattr = False  # True: a stat of the file (FUSE_GETATTR) never returns either
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    def start(self) -> HangingFuse:
        if os.geteuid() != 0:
            raise Unavailable("needs root to mount a FUSE file system")
        try:
            self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as err:
            raise Unavailable(f"cannot open /dev/fuse: {err.strerror}") from None
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0".encode()
        result = self._libc.mount(
            b"gpuwatchd-test",
            os.fsencode(self.mountpoint),
            b"fuse.gpuwatchd-test",
            MS_NOSUID | MS_NODEV,
            options,
        )
        if result != 0:
            code = ctypes.get_errno()
            os.close(self._fd)
            self._fd = None
            raise Unavailable(f"mount -t fuse refused: {os.strerror(code)}")
        self._thread = threading.Thread(target=self._serve, name="hanging-fuse", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Abort the connection: every process stuck on the file finishes at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._fd is not None:  # the thread did not get to it
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self.release()
        self._libc.umount2(os.fsencode(self.mountpoint), MNT_DETACH)

    # --- the server ---------------------------------------------------------------------------

    def _serve(self) -> None:
        fd = self._fd
        assert fd is not None
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                try:
                    request = os.read(fd, 1 << 20 | 4096)
                except OSError as err:
                    if err.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was interrupted before we read it
                    return  # ENODEV: unmounted
                self._answer(fd, request)
        finally:
            os.close(fd)  # the last reference: the kernel aborts the connection
            self._fd = None

    def _answer(self, fd: int, request: bytes) -> None:
        _, opcode, unique, node, *_ = IN_HEADER.unpack_from(request)
        body = request[IN_HEADER.size :]
        if opcode in NO_REPLY:
            return
        if opcode == FUSE_FLUSH:
            self.flushes += 1
            return  # the point: a forced request that never completes
        if opcode == FUSE_GETATTR and node == FILE and self.hang_getattr:
            return
        reply, error = b"", 0
        if opcode == FUSE_INIT:
            _, minor, readahead, _ = INIT_IN.unpack_from(body)
            reply = INIT_OUT.pack(7, min(minor, 31), readahead, 0, 0, 0, 1 << 17, 1, 0, 0, 0, 0)
        elif opcode == FUSE_LOOKUP and node == ROOT and body.rstrip(b"\0") == FILE_NAME.encode():
            reply = ENTRY_OUT.pack(FILE, 0, 0, 0, 0, 0) + _attr(FILE)
        elif opcode == FUSE_LOOKUP:
            error = -errno.ENOENT
        elif opcode == FUSE_GETATTR:
            reply = ATTR_OUT.pack(0, 0, 0) + _attr(node)
        elif opcode == FUSE_OPEN:
            reply = OPEN_OUT.pack(1, 0, 0)
        elif opcode in (FUSE_RELEASE, FUSE_DESTROY):
            pass
        else:
            error = -errno.ENOSYS
        with contextlib.suppress(OSError):  # the requester may have been interrupted
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(reply), error, unique) + reply)
