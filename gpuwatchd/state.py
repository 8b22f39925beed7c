"""The daemon's persistent state file and its single-instance lock, under ``state_dir``.

This module owns the bytes on disk: ``state.json`` written atomically (temp file in the same
folder, fsync, rename, fsync of the folder; mode 0600), a corrupt or unreadable file moved
aside so the daemon starts clean, and ``lock`` (an exclusive ``flock``) that lets only one of
``run``, ``run --once`` and a reset work at a time. It does not know what the state *means*:
the caller composes the dict (``{"version": 1, "boot_id": …, "plan": PlanState.to_json(), …}``)
and validates it when reading it back.

``state_dir`` is trusted only after :func:`check_state_dir`: a directory (created 0700 when
missing), and when running as root, owned by root and writable by nobody else — as the
config files are checked. Every file in it is opened relative to the directory and without
following a symbolic link (``O_NOFOLLOW``): a link planted there never makes the daemon
truncate, read or overwrite another file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping

from gpuwatchd import lazylog
from gpuwatchd.vocabulary import EventName

STATE_FILE = "state.json"
MAX_STATE_BYTES = 16 << 20  # a state file larger than this is not ours: moved aside
LOCK_FILE = "lock"

log = lazylog.get_logger("gpuwatchd.state")


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class StateDirError(Exception):
    """``state_dir`` cannot be used safely: not a directory, or writable by others."""


def check_state_dir(path: str, *, euid: int | None = None) -> None:
    """Create ``path`` (mode 0700) when missing; raise StateDirError unless it is safe to use.

    Safe: a directory; and when running as root (``euid`` 0, default: ours), owned by root and
    not writable by group or others, since whoever can write there can plant files the daemon
    reads as root. A PermissionError creating it is left to the caller (exit 77).
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise StateDirError(f"state_dir {path}: exists and is not a directory") from None
    except NotADirectoryError:
        raise StateDirError(f"state_dir {path}: a parent is not a directory") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"state_dir {path}: not a directory")
    if (os.geteuid() if euid is None else euid) != 0:
        return
    if st.st_uid != 0:
        raise StateDirError(f"state_dir {path}: owned by uid {st.st_uid}, not root")
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        raise StateDirError(f"state_dir {path}: mode {mode:04o} is writable by group or others")


def open_in(directory: str, name: str, flags: int, mode: int = 0o600) -> int:
    """Open ``directory/name`` without following a link at ``name`` (ELOOP if it is one)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_small(directory: str, name: str, limit: int = 1 << 20) -> bytes:
    """At most ``limit`` bytes of a regular file ``directory/name``; OSError otherwise."""
    fd = open_in(directory, name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def write_atomically(directory: str, name: str, data: bytes) -> None:
    """Replace ``directory/name`` with ``data``: a fresh temporary file (never a planted one),
    fsync, rename over the old name (a link there is replaced, not followed), fsync the folder."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class AlreadyRunning(Exception):
    """Another gpuwatchd instance holds the lock in ``state_dir``."""

    def __init__(self, path: str, holder: str | None) -> None:
        self.path = path
        self.holder = holder
        who = f" (held by {holder})" if holder else ""
        super().__init__(f"another gpuwatchd holds {path}{who}")


class StateStore:
    """Reads and writes ``<state_dir>/state.json``; hands out the instance lock."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        self.lock_path = os.path.join(state_dir, LOCK_FILE)

    def _ensure_dir(self) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)

    def load(self) -> dict[str, object]:
        """The saved dict; {} when there is none. A corrupt file is moved aside and logged."""
        try:
            raw = read_small(self.state_dir, STATE_FILE, MAX_STATE_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return self._move_aside(f"unreadable: {exc.strerror or exc}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            return self._move_aside(f"not valid JSON: {exc}")
        if not isinstance(data, dict):
            return self._move_aside("not a JSON object")
        return data

    def peek(self) -> dict[str, object]:
        """The saved dict for a reader that must change nothing (``scan``): {} when absent,
        unreadable or malformed, and a corrupt file is left where it is for the daemon."""
        try:
            data = json.loads(read_small(self.state_dir, STATE_FILE, MAX_STATE_BYTES))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def discard_corrupt(self, why: str) -> None:
        """For callers that found the content malformed (e.g. PlanState.from_json failed)."""
        self._move_aside(why)

    def _move_aside(self, why: str) -> dict[str, object]:
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            log.error(
                EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=None, error=str(exc)
            )
            return {}
        log.error(EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=aside)
        return {}

    def save(self, data: Mapping[str, object]) -> None:
        """Write ``data`` atomically: a reader sees the old file or the new one, never half."""
        self._ensure_dir()
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
        write_atomically(self.state_dir, STATE_FILE, text.encode("utf-8"))

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the instance lock for the ``with`` block; AlreadyRunning when it is taken.

        ``flock`` is released by the kernel when the holder dies, so a crash never leaves a
        stale lock. The holder writes its PID into the file for the error message.
        """
        self._ensure_dir()
        fd = open_in(self.state_dir, LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{self.lock_path} is not a regular file")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or None
                    raise AlreadyRunning(
                        self.lock_path, f"pid {holder}" if holder else None
                    ) from None
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
