"""The daemon's persistent state file and its single-instance lock, under ``state_dir``.

This module owns the bytes on disk: ``state.json`` written atomically (temp file in the same
folder, fsync, rename, fsync of the folder; mode 0600), a corrupt or unreadable file moved
aside so the daemon starts clean, and ``lock`` (an exclusive ``flock``) that lets only one of
``run``, ``run --once`` and a reset work at a time. It does not know what the state *means*:
the caller composes the dict (``{"version": 1, "boot_id": …, "plan": PlanState.to_json(), …}``)
and validates it when reading it back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping

import structlog

from gpuwatchd.vocabulary import EventName

STATE_FILE = "state.json"
LOCK_FILE = "lock"

log = structlog.get_logger("gpuwatchd.state")


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
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return self._move_aside(f"unreadable: {exc.strerror or exc}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return self._move_aside(f"not valid JSON: {exc}")
        if not isinstance(data, dict):
            return self._move_aside("not a JSON object")
        return data

    def peek(self) -> dict[str, object]:
        """The saved dict for a reader that must change nothing (``scan``): {} when absent,
        unreadable or malformed, and a corrupt file is left where it is for the daemon."""
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
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
        fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=self.state_dir)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the instance lock for the ``with`` block; AlreadyRunning when it is taken.

        ``flock`` is released by the kernel when the holder dies, so a crash never leaves a
        stale lock. The holder writes its PID into the file for the error message.
        """
        self._ensure_dir()
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
