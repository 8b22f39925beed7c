"""The admin's switches, kept as small files in ``state_dir`` so they survive restarts.

In detail: docs/internals.md, section `gpuwatchd.state.pause`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.core.checked import MAX_REASON, as_number
from gpuwatchd.core.codec import Format
from gpuwatchd.core.model import Pause, as_int
from gpuwatchd.state.directory import StateDir, hashed_name

PAUSE_FILE = "paused"
CLEAR_LATCHES_FILE = "clear-latches"
ENDED_JOB_PREFIX = "ended-job-"
MAX_ENDED_JOBS = 64  # hand-overs honoured at once; more wait (kept, reported) until some expire
MAX_ENDED_JOB_FILE = 4096
MAX_HAND_OVER = 86400.0  # seconds ahead a hand-over's expiry may be
RESUMED_FILE = "resumed"  # ``resume --reason``: why, for the daemon's ``EventName.DAEMON_RESUMED``
MAX_PAUSE_FILE = 64 * 1024
PAUSE = Format(PAUSE_FILE, MAX_PAUSE_FILE, newline=True)  # read leniently: a bad one still pauses
RESUMED = Format(RESUMED_FILE, MAX_PAUSE_FILE, newline=True)
TIME_UP = "the pause ended by itself (its time was up)"  # a resume's reason (simulate's too)


@dataclass(frozen=True)
class PauseSwitch:
    """The pause file as read: its reason (``""``: none given), when it was set and ends (wall
    times; None: unknown), its stamp on the boot clock (the file, for :meth:`BootTime.left`)
    and its bytes."""

    reason: str
    since: float | None = None
    until: float | None = None
    stamp: Mapping[str, object] | None = None
    raw: bytes = b""


def set_pause(
    state_dir: StateDir,
    *,
    reason: str | None,
    clock: BootTime | None = None,
    seconds: float | None = None,
    note: str = "",
    clear: bool = False,
) -> None:
    """Pause (``reason`` a string, may be empty) for ``seconds`` from ``clock`` (now), the
    note of a resume the daemon has not seen discarded; or resume (``reason`` None), first
    leaving its ``note`` and the request to ``clear`` the latches. Both hold the switches'
    lock (nothing is written without it), so the daemon's cut or end of a pause never undoes
    them."""
    with state_dir.switch_lock():
        if reason is None:  # the pause is removed last: a write that fails before leaves it
            try:
                if note:
                    note_resume(state_dir, note)
                if clear:
                    clear_latches(state_dir)
                state_dir.discard(PAUSE_FILE)
            except OSError:  # nor a request of this resume left to act later
                for name, wrote in ((RESUMED_FILE, note), (CLEAR_LATCHES_FILE, clear)):
                    if wrote:
                        state_dir.remove(name)
                raise
            return
        stamp: dict[str, object] = {"since": time.time(), "until": None}
        if clock is not None and seconds is not None:
            stamp = clock.stamp(seconds)
        body = {"reason": reason[:MAX_REASON], **stamp, "by_uid": os.getuid()}
        state_dir.write(PAUSE_FILE, PAUSE.encode(body))
        state_dir.remove(RESUMED_FILE)  # it would explain the next resume, which may have none


def read_pause_switch(state_dir: StateDir) -> PauseSwitch | None:
    """The pause file, or None when there is none. Unreadable or malformed counts as a pause
    without an end (fail safe); its content is kept only as a reason, cut short."""
    try:
        raw = state_dir.read(PAUSE_FILE, MAX_PAUSE_FILE)
    except FileNotFoundError:
        return None
    except OSError:
        return PauseSwitch("pause file unreadable")
    try:
        data = PAUSE.load(raw)
    except ValueError as err:  # not JSON: its text is the reason; JSON but no object: none
        text = raw.decode("utf-8", "replace").strip() if "valid JSON" in str(err) else ""
        return PauseSwitch(text[:MAX_REASON])
    reason = data.get("reason")
    return PauseSwitch(
        str(reason)[:MAX_REASON] if reason is not None else "",
        since=as_number(data.get("since")),
        until=as_number(data.get("until")),
        stamp=data,
        raw=raw,
    )


def note_resume(state_dir: StateDir, reason: str) -> None:
    """``resume --reason``: leave the reason for the daemon's ``EventName.DAEMON_RESUMED`` event."""
    body = {"reason": reason[:MAX_REASON], "at": time.time(), "by_uid": os.getuid()}
    state_dir.write(RESUMED_FILE, RESUMED.encode(body))


def _take(state_dir: StateDir, name: str, limit: int) -> bytes | None:
    """The switch file ``name`` (``b""``: untrusted or unreadable), read and removed under the
    switches' lock (a newer one landing in between is never removed unread); None when there
    is none or it was not removed (the lock held 2 s by another: left for the next poll)."""
    try:
        state_dir.read(name, 0)  # none, as at nearly every poll: no lock taken
    except FileNotFoundError:
        return None
    except OSError:
        pass  # removed below
    raw = None
    with contextlib.suppress(OSError), state_dir.switch_lock():
        try:
            raw = state_dir.read(name, limit)
        except FileNotFoundError:
            return None
        except OSError:
            raw = b""  # not a trusted file: taken all the same, its bytes unused
        if not state_dir.remove(name):
            raw = None
    return raw


def _take_resume_note(state_dir: StateDir) -> str | None:
    """The note's reason, taken (:func:`_take`); None when there is none or it says none."""
    try:
        reason = RESUMED.load(_take(state_dir, RESUMED_FILE, MAX_PAUSE_FILE) or b"").get("reason")
    except ValueError:
        return None
    return reason[:MAX_REASON] if isinstance(reason, str) and reason else None


def pause_in_force(state_dir: StateDir, clock: BootTime, *, max_pause: float) -> Pause:
    """The pause in force at ``clock``, read only (one whose end is unknown holds); its end is
    its own ``until`` while the clocks agree within a second (an unchanged pause reads the
    same at every poll). Not paused: ``reason`` None, ``resumed`` set when the time is up."""
    return _in_force(read_pause_switch(state_dir), clock, max_pause)


def _own_left(switch: PauseSwitch, clock: BootTime, max_pause: float) -> float | None:
    """Seconds left to its own end, else (a pause from before pauses had one) to ``max_pause``
    after it was set; None: neither is known."""
    left = None if switch.stamp is None else clock.left(switch.stamp)
    if left is None and switch.since is not None:
        left = switch.since + max_pause - clock.wall
    return left


def _in_force(switch: PauseSwitch | None, clock: BootTime, max_pause: float) -> Pause:
    if switch is None:
        return Pause(None)
    # Never more than ``max_pause`` from now (docs/internals.md).
    left = _own_left(switch, clock, max_pause)
    if left is None:
        return Pause(switch.reason)
    left = min(left, max_pause)
    if left <= 0:
        return Pause(None, resumed=TIME_UP)
    ends = clock.wall + left
    if switch.until is not None and abs(switch.until - ends) < 1.0:
        ends = switch.until
    return Pause(switch.reason, until=ends)


def poll_pause(state_dir: StateDir, clock: BootTime, *, max_pause: float) -> Pause:
    """:func:`pause_in_force` for the daemon, once a poll: a pause whose time is up removed, a
    cut written into its file; with no pause file, the resume note consumed as ``resumed``."""
    switch = read_pause_switch(state_dir)
    now = _in_force(switch, clock, max_pause)
    if now.resumed is not None and switch is not None:  # unless a new pause replaced it
        state_dir.rewrite(PAUSE_FILE, switch.raw, None, MAX_PAUSE_FILE)
    elif now.reason is None:
        note = _take_resume_note(state_dir)
        return Pause(None, resumed=f"gpuwatchd resume: {note}" if note else "gpuwatchd resume")
    elif switch is not None and now.until is not None:
        own = _own_left(switch, clock, max_pause)
        if own is not None and own > now.until - clock.wall + 1.0:  # cut: into its file
            end = clock.stamp(now.until - clock.wall)
            body = {**(switch.stamp or {}), "until": end["until"], "until_boot": end["until_boot"]}
            state_dir.rewrite(PAUSE_FILE, switch.raw, PAUSE.encode(body), MAX_PAUSE_FILE)
    return now


def clear_latches(state_dir: StateDir) -> None:
    state_dir.write(CLEAR_LATCHES_FILE, f"{time.time()}\n".encode("ascii"))


def take_clear_latches(state_dir: StateDir) -> float | None:
    """When ``resume --clear-latches`` asked (wall time; ``math.inf``: unknown, every latch
    lifted), once (the request is consumed); None: no request. Whatever the entry is (a file,
    a link), removing it is the request (:func:`_take`); one that cannot be removed is not
    taken (it would be taken again at every poll)."""
    if (raw := _take(state_dir, CLEAR_LATCHES_FILE, 64)) is None:
        return None
    try:
        made = as_number(float(raw))
    except ValueError:  # no time: a hand-made request (``touch``), or an unreadable one
        made = None
    return math.inf if made is None else made


# --- the scheduler's word, handed to a running daemon --------------------------------------------


def hand_over_ended_jobs(
    state_dir: StateDir,
    jobs: Iterable[str],
    *,
    clock: BootTime,
    seconds: float,
    waiter: tuple[int, int],
    said_at: int | None = None,
) -> None:
    """Tell the daemon (and every scan) that ``jobs`` (at most :data:`MAX_ENDED_JOBS`) ended,
    while ``waiter`` (the epilog's PID and start ticks) waits, never past ``seconds`` from
    ``clock`` (now); ``said_at``: when, in clock ticks of this boot. One file per job and
    waiter."""
    chosen = sorted(set(jobs))
    if len(chosen) > MAX_ENDED_JOBS:
        raise ValueError(f"at most {MAX_ENDED_JOBS} jobs are handed over at once")
    end = clock.stamp(seconds)
    for job in chosen:
        body = {
            "job": job,
            "until": end["until"],
            "by_uid": os.getuid(),
            "waiter": list(waiter),
            "said_at_ticks": said_at,
            "boot_id": clock.boot_id,
            "until_boot": end["until_boot"],
        }
        state_dir.write(_hand_over_name(job, waiter), ENDED_JOB.encode(body))


def withdraw_ended_jobs(
    state_dir: StateDir, jobs: Iterable[str], *, waiter: tuple[int, int]
) -> None:
    """The epilog's wait is over: remove its hand-overs (another epilog's of the same job, a
    requeued run's beside the first's, is a file of its own, still honoured)."""
    for job in sorted(set(jobs))[:MAX_ENDED_JOBS]:
        with contextlib.suppress(OSError):
            state_dir.remove(_hand_over_name(job, waiter))


def _hand_over_name(job: str, waiter: tuple[int, int]) -> str:
    return hashed_name(ENDED_JOB_PREFIX, f"{job} {waiter[0]} {waiter[1]}")


def _waiter(raw: object) -> tuple[int, int]:
    """The waiting epilog a hand-over names: (PID, start ticks); ValueError when malformed."""
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
        or not 0 < raw[0] < 1 << 31
        or not 0 <= raw[1] < 1 << 62
    ):
        raise ValueError("no waiting process named")
    return raw[0], raw[1]


def _job_key(value: object, key: str) -> str:
    if not isinstance(value, str) or scheduler_ended_job(value, {}) != value:
        raise ValueError(f"not a job key: {str(value)[:80]!r}")
    return value


def _expiry(value: object, key: str) -> float:
    found = as_number(value)  # NaN and Infinity (json.loads reads them) are no time either
    if found is None:
        raise ValueError("no expiry")
    return found


# The waiter is read after the job and the expiry (read_ended_jobs): the file name covers it.
ENDED_JOB = Format(
    ENDED_JOB_PREFIX, MAX_ENDED_JOB_FILE, newline=True, fields={"job": _job_key, "until": _expiry}
)


@dataclass(frozen=True)
class HandOvers:
    """What :func:`read_ended_jobs` found: the jobs honoured now (job key -> when it was said,
    in clock ticks of this boot, else None: it covers no process), the files that were wrong,
    and how many valid hand-overs (or files past the listing bound) wait beyond the limit."""

    jobs: Mapping[str, int | None]
    problems: tuple[str, ...]
    over_limit: int


def _said_at(data: dict[str, object], boot_id: str | None) -> int | None:
    """When a hand-over was said, in ticks of boot ``boot_id``; None (covers nothing) when
    unknown or in another boot."""
    said = as_int(data.get("said_at_ticks"))
    same_boot = boot_id is not None and data.get("boot_id") == boot_id
    return said if said is not None and 0 <= said < 1 << 62 and same_boot else None


def read_ended_jobs(
    state_dir: StateDir,
    clock: BootTime,
    *,
    waiting: Callable[[int, int], bool | None],
    remove_stale: bool = False,
) -> HandOvers:
    """The jobs handed over whose epilog still waits (``waiting(pid, start_ticks)``; None:
    unknown, then not honoured but kept), neither expired at ``clock`` (on the boot clock in
    its boot: a wall clock step moves no end) nor more than a day ahead. ``remove_stale`` (the
    daemon): expired and bad files, and those whose epilog is gone, are removed."""
    try:
        names = state_dir.names(ENDED_JOB_PREFIX)
    except OSError:
        return HandOvers({}, (), 0)
    examined = names[: 4 * MAX_ENDED_JOBS]
    valid: dict[str, int | None] = {}
    problems: list[str] = []
    for name in examined:
        try:
            data = ENDED_JOB.decode(state_dir.read(name, MAX_ENDED_JOB_FILE))
            job, left = data["job"], clock.left(data) or 0.0  # "until" is checked: never None
            if left > MAX_HAND_OVER:
                raise ValueError("expiry more than a day ahead")
            waiter = _waiter(data.get("waiter"))
            # An older version's run --once (still waiting through an upgrade) names the job only.
            if name not in (_hand_over_name(job, waiter), hashed_name(ENDED_JOB_PREFIX, job)):
                raise ValueError("file name does not match the job")
        except FileNotFoundError:
            continue  # removed since the listing
        except (OSError, ValueError) as err:
            problems.append(f"{name}: {err}")
        else:
            waits = left >= 0 and waiting(*waiter)
            if waits:  # two epilogs of one job: the later word (it covers more processes)
                said = _said_at(data, clock.boot_id)
                valid[job] = max(said, valid.get(job, said), key=lambda t: -1 if t is None else t)
            if waits is not False:
                continue
        if remove_stale:
            state_dir.remove(name)
    over = max(0, len(valid) - MAX_ENDED_JOBS) + (len(names) - len(examined))
    return HandOvers(dict(list(valid.items())[:MAX_ENDED_JOBS]), tuple(problems), over)
