"""The daemon's persistent state file and its single-instance lock, under ``state_dir``.

This module owns the bytes of ``state.json``: written atomically (mode 0600) through
:class:`gpuwatchd.statedir.StateDir`, a corrupt or untrusted file moved aside so the daemon
starts clean, and the lock (an exclusive ``flock``) that lets only one of ``run``, ``run
--once`` and a reset work at a time. It does not know what the state *means*: the caller
composes the dict (``{"version": 1, "boot_id": …, "plan": PlanState.to_json(), …}``) and
validates it when reading it back.

``state_dir`` is reached and trusted only through :mod:`gpuwatchd.statedir`: no symbolic link
anywhere on its path, owned by root (or the user running the command) and writable by nobody
else, every file opened relative to the directory without following a link. Readers
(``scan``, ``status``) never create it and never change anything in it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

from gpuwatchd import lazylog
from gpuwatchd.statedir import LOCK_FILE, AlreadyRunning, StateDir, StateDirError
from gpuwatchd.vocabulary import EventName

__all__ = [
    "LOCK_FILE",
    "MAX_STATE_BYTES",
    "STATE_FILE",
    "AlreadyRunning",
    "StateDirError",
    "StateStore",
    "check_state_dir",
]

STATE_FILE = "state.json"
MAX_STATE_BYTES = 16 << 20  # a state file larger than this is not ours: moved aside

log = lazylog.get_logger("gpuwatchd.state")


def check_state_dir(path: str, *, euid: int | None = None) -> None:
    """Create ``path`` (mode 0700) when missing; raise StateDirError unless it can be trusted
    (:meth:`gpuwatchd.statedir.StateDir.open`). A PermissionError is left to the caller."""
    StateDir.open(path, create=True, euid=euid).close()


class StateStore:
    """Reads and writes ``<state_dir>/state.json``; hands out the instance lock.

    Built on a path, the directory is opened (and created, for a writer) on first use, and
    kept open; built on an open :class:`StateDir`, that one is used.
    """

    def __init__(self, state_dir: str | StateDir) -> None:
        if isinstance(state_dir, StateDir):
            self._dir: StateDir | None = state_dir
            self.state_dir = state_dir.path
        else:
            self._dir = None
            self.state_dir = state_dir
        self.path = os.path.join(self.state_dir, STATE_FILE)
        self.lock_path = os.path.join(self.state_dir, LOCK_FILE)

    def directory(self) -> StateDir:
        """The state directory, opened and checked (created when missing) on first use.
        Raises StateDirError, PermissionError or OSError."""
        if self._dir is None:
            self._dir = StateDir.open(self.state_dir, create=True)
        return self._dir

    def close(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None

    def load(self) -> dict[str, object]:
        """The saved dict; {} when there is none. A corrupt or untrusted file is moved aside
        and logged."""
        saved = self.directory().read_json(STATE_FILE, MAX_STATE_BYTES)
        if saved.problem is not None:
            return self._move_aside(saved.problem)
        return dict(saved.data)

    def peek(self) -> dict[str, object]:
        """The saved dict for a reader that must change nothing (``scan``): {} when absent,
        unreadable, untrusted or malformed; nothing is created, a corrupt file is left where
        it is for the daemon."""
        if self._dir is not None:
            return dict(self._dir.read_json(STATE_FILE, MAX_STATE_BYTES).data)
        try:
            with StateDir.open(self.state_dir) as directory:
                return dict(directory.read_json(STATE_FILE, MAX_STATE_BYTES).data)
        except OSError:
            return {}

    def discard_corrupt(self, why: str) -> None:
        """For callers that found the content malformed (e.g. PlanState.from_json failed)."""
        self._move_aside(why)

    def _move_aside(self, why: str) -> dict[str, object]:
        aside = f"{STATE_FILE}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        moved_to = os.path.join(self.state_dir, aside)
        try:
            self.directory().rename(STATE_FILE, aside)
        except OSError as exc:
            log.error(
                EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=None, error=str(exc)
            )
            return {}
        log.error(EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=moved_to)
        return {}

    def save(self, data: Mapping[str, object]) -> None:
        """Write ``data`` atomically: a reader sees the old file or the new one, never half.
        Raises OSError (a full disk: ENOSPC), the old file left as it was."""
        self.directory().write_json(STATE_FILE, data)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the instance lock for the ``with`` block; AlreadyRunning when it is taken
        (:meth:`gpuwatchd.statedir.StateDir.lock`)."""
        with self.directory().lock():
            yield
