"""The daemon's persistent state file and its single-instance lock, under ``state_dir``.

In detail: docs/internals.md, section `gpuwatchd.state.saved`.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.core.checked import as_map, as_number
from gpuwatchd.core.codec import Format
from gpuwatchd.core.model import as_int
from gpuwatchd.core.vocabulary import STATE_FILE_VERSION, EventName
from gpuwatchd.decide.plan.shadow import HOUR
from gpuwatchd.events import lazylog
from gpuwatchd.state.directory import StateDir, StateDirError, UntrustedFile

STATE_FILE = "state.json"
MAX_STATE_BYTES = 16 << 20  # a state file larger than this is not ours: moved aside
# The envelope: its parts are checked by their owners (PlanState.from_json, ...).
STATE = Format("state", MAX_STATE_BYTES, version=STATE_FILE_VERSION, compact=True)

log = lazylog.get_logger("gpuwatchd.state.saved")


def cannot_read(path: str, exc: OSError) -> str:
    """Why ``path`` (the state file, or ``state_dir`` itself) could not be read, for an admin."""
    why = "permission denied (run as root)" if isinstance(exc, PermissionError) else exc.strerror
    return f"cannot read {path}: {why or exc}"


@dataclass(frozen=True)
class SavedState:
    """``state.json`` as a reader that changes nothing sees it, every accessor lenient:
    ``data`` ({} when none or unusable), ``problem`` (why it is unusable, for an admin) and
    ``found`` (a usable state file was there)."""

    data: Mapping[str, object] = field(default_factory=dict)
    problem: str | None = None
    found: bool = False

    def same_boot(self, boot_id: str | None) -> bool:
        """Whether the state was written in the boot ``boot_id`` (its monotonic times hold)."""
        return self.data.get("boot_id") == boot_id

    @property
    def daemon_pid(self) -> int | None:
        pid = as_int(as_map(self.data.get("status")).get("pid"))
        return pid if pid is not None and pid > 0 else None


def read_saved_state(state_dir: str | StateDir) -> SavedState:
    """``<state_dir>/state.json``, read only: nothing is created, the lock and the folder are not
    touched, a corrupt file is left where it is for the daemon. Never raises."""
    path = os.path.join(state_dir if isinstance(state_dir, str) else state_dir.path, STATE_FILE)
    try:
        if isinstance(state_dir, str):
            with StateDir.open(state_dir) as directory:
                raw = directory.read(STATE_FILE, MAX_STATE_BYTES + 1)
        else:
            raw = state_dir.read(STATE_FILE, MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return SavedState()
    except StateDirError as exc:
        return SavedState(problem=f"{exc}: not read (only root may be able to write there)")
    except UntrustedFile as exc:
        return SavedState(problem=f"{path}: {exc.strerror}: not read")
    except OSError as exc:
        return SavedState(problem=cannot_read(path, exc))
    try:
        return SavedState(STATE.load(raw), found=True)
    except ValueError:
        why = "is not a state file (malformed); the daemon moves it aside at start"
        return SavedState(problem=f"{path} {why}")


class StateStore:
    """Reads and writes ``<state_dir>/state.json``; :meth:`directory` hands out the lock."""

    def __init__(self, state_dir: str) -> None:
        self._dir: StateDir | None = None
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        # Where the last load's unusable file went (or why it could not move); None: none.
        self.discarded: str | None = None

    def directory(self) -> StateDir:
        """The state directory, opened and checked (created when missing) on first use and
        kept open. Raises StateDirError, PermissionError or OSError."""
        if self._dir is None:
            self._dir = StateDir.open(self.state_dir, create=True)
        return self._dir

    def close(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None

    def load(self) -> dict[str, object]:
        """The saved dict; {} when there is none. A corrupt or untrusted file is moved aside
        and logged; one that cannot be read now (EIO, EMFILE, ENOMEM) stays: OSError naming it."""
        directory = self.directory()
        try:
            return STATE.load(directory.read(STATE_FILE, MAX_STATE_BYTES + 1))
        except FileNotFoundError:
            return {}
        except OSError as err:  # UntrustedFile, a link (ELOOP) or a socket (ENXIO): not ours
            if not isinstance(err, UntrustedFile) and err.errno not in (errno.ELOOP, errno.ENXIO):
                raise OSError(err.errno, cannot_read(self.path, err)) from err
            why = f"unreadable: {err.strerror or err}"
        except ValueError as err:
            why = str(err)
        self.discarded = self.discard_corrupt(why)
        return {}

    def discard_corrupt(self, why: str) -> str:
        """Move a file whose content is malformed (``why``) aside, and say so; where it went
        (or why it stayed), for an admin: the next save would overwrite it."""
        aside = f"{STATE_FILE}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            fd = self.directory().fd
            os.rename(STATE_FILE, aside, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            log.error(
                EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=None, error=str(exc)
            )
            return f"{self.path}, not moved aside: {exc.strerror or exc}"
        moved_to = os.path.join(self.state_dir, aside)
        log.error(EventName.STATE_CORRUPT, path=self.path, why=why, moved_to=moved_to)
        return f"moved to {moved_to}"

    def save(self, data: Mapping[str, object]) -> None:
        """Write ``data`` atomically: a reader sees the old file or the new one, never half.
        Raises OSError (a full disk: ENOSPC) or ValueError (a NaN), the old file left as it was."""
        self.directory().write(STATE_FILE, STATE.encode(data))


def signalled_last_hour(history: object, now: float | None) -> int | None:
    """How many kill-cap entries of ``history`` (``signal_history``: [target, monotonic time]
    pairs, saved or typed) lie within the hour before ``now`` (the same clock), as the planner
    keeps them; None when ``history``, ``now`` or a time in it is unknown."""
    if not isinstance(history, (list, tuple)) or now is None:
        return None
    times = [as_number(p[1]) for p in history if isinstance(p, (list, tuple)) and len(p) == 2]
    if None in times:
        return None
    return sum(1 for at in times if at is not None and now - at < HOUR)
