"""The state directory, opened one safe way by every command: the walk, the trust rule, the files.

This module owns how ``state_dir`` is reached and which of its files are believed.

In detail: docs/internals.md, section `gpuwatchd.state.directory`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

LOCK_FILE = "lock"
SWITCH_LOCK_FILE = "switches.lock"  # held a moment by pause, resume and the daemon's rewrite
_SWITCH_TRIES = 200  # tries at it, 10 ms apart: about 2 s
_PATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
# /proc/locks is read whole, a line at a time: the kernel lists newer locks first, so a cap
# on the whole would let any user's own flocks push the daemon's long-held lock past it.
_MAX_LOCK_LINE = 4096  # bytes of one line of it looked at (a line is under 100)
_MAX_FDS = 4096  # fds of a lock holder looked at


class StateDirError(OSError):
    """``state_dir`` cannot be trusted or used: a link on its path, not a directory, an owner
    other than root (or this user), writable by others. The message names the path."""


class UntrustedFile(OSError):
    """A file in the state directory that is not a regular file owned by a trusted user and
    writable by nobody else: never read."""


class AlreadyRunning(Exception):
    """Another gpuwatchd instance holds the lock in ``state_dir``."""

    def __init__(self, path: str, holder: str | None) -> None:
        self.holder = holder
        who = f" (held by {holder})" if holder else ""
        super().__init__(f"another gpuwatchd holds {path}{who}")


def _overflow_uid() -> int | None:
    """The uid owners outside our user namespace show as, when we run in one; else None."""
    try:
        with open("/proc/self/uid_map", "rb") as handle:
            mapping = handle.read(4096).split()
        if mapping == [b"0", b"0", b"4294967295"]:
            return None  # the initial namespace: every owner is who it says
        with open("/proc/sys/kernel/overflowuid", "rb") as handle:
            return int(handle.read(32))
    except (OSError, ValueError):
        return None


def _check(
    st: os.stat_result, where: str, owners: frozenset[int] | None, *, ancestor: bool
) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"{where}: not a directory")
    if owners is None:
        return
    if st.st_uid not in owners and not (ancestor and st.st_uid == _overflow_uid()):
        who = " or ".join("root" if uid == 0 else f"uid {uid}" for uid in sorted(owners))
        raise StateDirError(f"{where}: owned by uid {st.st_uid}, not {who}")
    if st.st_mode & 0o022 and not (ancestor and st.st_mode & stat.S_ISVTX):
        raise StateDirError(
            f"{where}: mode {stat.S_IMODE(st.st_mode):04o} is writable by group or others"
        )


def open_directory(
    path: str, *, owners: frozenset[int] | None, create: bool = False, readable: bool = True
) -> int:
    """A descriptor of directory ``path``, reached from ``/`` without following any link,
    each directory owned by one of ``owners`` (None: any) under the trust rule; ``create``
    makes missing ones (the last mode 0700, others 0755). Raises StateDirError (a link, not a
    directory, untrusted), FileNotFoundError, PermissionError or OSError."""
    if not os.path.isabs(path):
        raise StateDirError(f"{path}: not an absolute path")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise StateDirError(f"{path}: '..' is not allowed in the path")
    fd = os.open("/", _PATH if parts else _DIR)
    where = "/"
    try:
        _check(os.fstat(fd), where, owners, ancestor=bool(parts))
        for index, name in enumerate(parts):
            last = index == len(parts) - 1
            flags = _DIR if last and readable else _PATH
            here = os.path.join(where, name)
            try:
                child = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), here) from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700 if last else 0o755, dir_fd=fd)
                child = os.open(name, flags, dir_fd=fd)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                try:
                    is_link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                except OSError:
                    is_link = False
                what = "a symbolic link (not followed)" if is_link else "not a directory"
                raise StateDirError(f"{here}: {what}") from None
            os.close(fd)
            fd, where = child, here
            _check(os.fstat(fd), where, owners, ancestor=not last)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hashed_name(prefix: str, key: str) -> str:
    """The file of ``key`` among the files named ``prefix`` and a hash: one file a key."""
    import hashlib  # here: loading OpenSSL costs every scan ~3 ms, and most never get here

    return prefix + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def replace_file(dir_fd: int, name: str, data: bytes, *, mode: int, sync: bool) -> None:
    """Replace ``name`` in the folder ``dir_fd`` with ``data`` atomically: a fresh hidden
    temporary file, fsync when ``sync``, renamed over ``name`` (a link there is replaced, not
    followed), fsync of the folder. Raises OSError; the temporary file is removed then."""
    tmp = f".{name}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if sync:
        os.fsync(dir_fd)


# --- the directory ------------------------------------------------------------------------------


class StateDir:
    """An open, checked state directory (:meth:`open`); every file operation goes through its
    descriptor."""

    def __init__(self, path: str, fd: int, owners: frozenset[int]) -> None:
        self.path = path
        self.fd = fd
        self.owners = owners

    @classmethod
    def open(cls, path: str, *, create: bool = False, euid: int | None = None) -> StateDir:
        """Open ``path`` by :func:`open_directory` under the trust rule; ``create`` (writers:
        the daemon, ``pause``) makes it when missing."""
        owners = frozenset({0, os.geteuid() if euid is None else euid})  # root, and this user
        try:
            fd = open_directory(path, owners=owners, create=create)
        except StateDirError as err:
            raise StateDirError(f"state_dir {path}: {err}") from None
        return cls(path, fd, owners)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    # -- files ---------------------------------------------------------------------------------

    def _trusted(self, fd: int, name: str) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(errno.EINVAL, "not a regular file", self.join(name))
        if st.st_uid not in self.owners:
            raise UntrustedFile(errno.EPERM, f"owned by uid {st.st_uid}", self.join(name))
        if st.st_mode & 0o022:
            why = f"mode {stat.S_IMODE(st.st_mode):04o} is writable by group or others"
            raise UntrustedFile(errno.EPERM, why, self.join(name))
        return st

    def read(self, name: str, limit: int) -> bytes:
        """At most ``limit`` bytes of the trusted regular file ``name`` (never blocking on a
        FIFO, never through a link). FileNotFoundError, UntrustedFile or OSError otherwise."""
        return self.read_with_stat(name, limit)[0]

    def read_with_stat(self, name: str, limit: int) -> tuple[bytes, os.stat_result]:
        """:meth:`read`, and the file's status as checked (its ``st_mtime``, say)."""
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _FILE, dir_fd=self.fd)
        try:
            st = self._trusted(fd, name)
            chunks: list[bytes] = []
            while limit > 0 and (chunk := os.read(fd, min(1 << 20, limit))):
                chunks.append(chunk)
                limit -= len(chunk)
            return b"".join(chunks), st
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, *, mode: int = 0o600, sync: bool = True) -> None:
        """Replace ``name`` with ``data`` atomically (:func:`replace_file`; OSError); ``sync``
        False for a file only other processes read while this one runs."""
        replace_file(self.fd, name, data, mode=mode, sync=sync)

    def rewrite(self, name: str, raw: bytes, data: bytes | None, limit: int) -> None:
        """Replace ``name`` with ``data`` (None: remove it) unless it changed since it was read
        (``limit`` bytes) as ``raw`` (a new file is the administrator's), holding the switches'
        lock (:meth:`switch_lock`); on OSError (a full disk, the lock taken) nothing changes."""
        with contextlib.suppress(OSError), self.switch_lock():
            if self.read(name, limit) != raw:
                return
            if data is None:
                self.discard(name)
            else:
                self.write(name, data)

    def remove(self, name: str) -> bool:
        """Remove the entry ``name`` (not a directory); False when it was not removed."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            return False
        return True

    def discard(self, name: str) -> None:
        """Remove ``name`` if it is there; OSError when it is there and cannot be removed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in os.listdir(self.fd) if name.startswith(prefix))

    # -- the locks -----------------------------------------------------------------------------

    sleep: Callable[[float], None] = time.sleep  # between tries at the switches' lock

    def _lock_file(self, name: str) -> int:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _FILE, 0o600, dir_fd=self.fd)
        try:
            self._trusted(fd, name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def switch_lock(self) -> Iterator[None]:
        """Hold the switches' lock for the ``with`` block, so a read-compare-write of a switch
        never undoes another's change in between (docs/internals.md); BlockingIOError when
        it stays taken for 2 s."""
        fd = self._lock_file(SWITCH_LOCK_FILE)
        try:
            for _ in range(_SWITCH_TRIES):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.sleep(0.01)
            else:
                why = f"{SWITCH_LOCK_FILE} is held by another command or the daemon"
                raise BlockingIOError(errno.EWOULDBLOCK, why, self.join(SWITCH_LOCK_FILE))
            yield
        finally:
            os.close(fd)  # the lock with it

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the instance lock for the ``with`` block; AlreadyRunning when it is taken."""
        fd = self._lock_file(LOCK_FILE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
                    shown = f"pid {holder}" if holder.isdigit() else None
                    raise AlreadyRunning(self.join(LOCK_FILE), shown) from None
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def lock_holder(self, proc_root: str = "/proc") -> int | None:
        """The PID that holds the instance lock now, as the kernel says (docs/internals.md);
        None when nobody does or it cannot be told."""
        try:
            st = os.stat(LOCK_FILE, dir_fd=self.fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return None
            with open(os.path.join(proc_root, "locks"), "rb") as handle:
                for line in _lines(handle, _MAX_LOCK_LINE):
                    found = _parse_lock_line(line.decode("ascii", "replace"))
                    if found is None or found[1] != st.st_ino or found[0] <= 0:
                        continue
                    if _holds_flock(proc_root, found[0], st):
                        return found[0]
        except OSError:
            return None
        return None


def _lines(handle: BinaryIO, most: int) -> Iterator[bytes]:
    """The lines of ``handle`` one at a time, each cut at ``most`` bytes (the rest of a longer
    one skipped): time in proportion to the file, memory bounded."""
    while line := handle.readline(most):
        rest = line
        while not rest.endswith(b"\n") and (rest := handle.readline(most)):
            pass  # the rest of a line longer than most
        yield line


def _parse_lock_line(text: str) -> tuple[int, int] | None:
    """(pid, inode) of an exclusive ``flock`` line of /proc/locks or fdinfo; else None."""
    fields = text.split()
    if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
        return None
    dev_ino = fields[5].rsplit(":", 1)
    if len(dev_ino) != 2 or not fields[4].isdigit() or not dev_ino[1].isdigit():
        return None
    return int(fields[4]), int(dev_ino[1])


def _holds_flock(proc_root: str, pid: int, lock: os.stat_result) -> bool:
    base = os.path.join(proc_root, str(pid))
    try:
        fds = os.listdir(os.path.join(base, "fd"))[:_MAX_FDS]
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(os.path.join(base, "fd", fd))
            if (st.st_dev, st.st_ino) != (lock.st_dev, lock.st_ino):
                continue
            with open(os.path.join(base, "fdinfo", fd), "rb") as handle:
                info = handle.read(16384).decode("ascii", "replace")
        except OSError:
            continue
        locks = [line[5:] for line in info.splitlines() if line.startswith("lock:")]
        if any(_parse_lock_line(line) == (pid, lock.st_ino) for line in locks):
            return True
    return False
