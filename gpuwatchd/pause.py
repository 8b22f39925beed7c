"""The admin's switches, kept as small files in ``state_dir`` so they survive restarts.

``gpuwatchd pause`` / ``resume`` write and remove ``<state_dir>/paused``; ``resume
--clear-latches`` drops ``<state_dir>/clear-latches``, which the daemon consumes at its next poll
to lift the kill-cap dry-run latch and the reset circuit breaker. ``run --once --ended-job``
beside a running daemon hands the scheduler's word over in ``<state_dir>/ended-job-<hash>`` files
(one per job, so two epilogs never overwrite each other), each naming the epilog's waiting
process (PID and start ticks) and an expiry. A hand-over counts only while that process still
waits — so it is taken for the job it names and for that epilog alone, never by a later run for
another job (a requeued Slurm job keeps its id) — and the waiter withdraws it when its wait
ends; every scan reads them, and the daemon removes those whose waiter is gone or that expired.
This module only reads and writes those files; what pausing or an ended job means is the
planner's and assess's business.

The files are opened as :mod:`gpuwatchd.state` opens its own: relative to ``state_dir``,
never through a symbolic link, regular files only, size-capped. A switch that cannot be read
counts as *paused* (fail safe), and its content never reaches the log unless it is a real
pause file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable

from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.state import read_small, write_atomically

PAUSE_FILE = "paused"
CLEAR_LATCHES_FILE = "clear-latches"
MAX_REASON = 512  # characters of a pause reason kept
ENDED_JOB_PREFIX = "ended-job-"
MAX_ENDED_JOBS = 64  # hand-overs honoured at once; more files are ignored (and expire)
MAX_ENDED_JOB_FILE = 4096


def set_pause(state_dir: str, *, reason: str | None) -> None:
    """Pause (``reason`` a string, may be empty) or resume (``reason`` None)."""
    path = os.path.join(state_dir, PAUSE_FILE)
    if reason is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    body = json.dumps({"reason": reason, "since": time.time(), "by_uid": os.getuid()})
    write_atomically(state_dir, PAUSE_FILE, (body + "\n").encode("utf-8"))


def read_pause(state_dir: str) -> str | None:
    """The pause reason when paused (``""`` when none was given), else None."""
    try:
        raw = read_small(state_dir, PAUSE_FILE, 64 * 1024)
    except FileNotFoundError:
        return None
    except OSError:
        return "pause file unreadable"  # fail safe: an unreadable switch counts as paused
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw.decode("utf-8", "replace").strip()[:MAX_REASON]
    reason = data.get("reason") if isinstance(data, dict) else None
    return str(reason)[:MAX_REASON] if reason is not None else ""


def clear_latches(state_dir: str) -> None:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    write_atomically(state_dir, CLEAR_LATCHES_FILE, f"{time.time()}\n".encode("ascii"))


def take_clear_latches(state_dir: str) -> bool:
    """True once after ``resume --clear-latches`` (the request is consumed). Whatever the
    entry is (a file, a link), removing it is the request; one that cannot be removed is
    not taken (it would be taken again at every poll)."""
    try:
        os.unlink(os.path.join(state_dir, CLEAR_LATCHES_FILE))
    except OSError:
        return False
    return True


# --- the scheduler's word, handed to a running daemon --------------------------------------------


def _ended_job_file(job: str) -> str:
    return ENDED_JOB_PREFIX + hashlib.sha256(job.encode("utf-8")).hexdigest()[:32]


def hand_over_ended_jobs(
    state_dir: str, jobs: Iterable[str], *, until: float, waiter: tuple[int, int]
) -> None:
    """Tell the running daemon (and every scan) that ``jobs`` ended, while ``waiter`` (the
    epilog's own PID and start ticks) waits, and never past wall time ``until``.

    ``jobs`` are keys as :func:`gpuwatchd.collect.jobs.scheduler_ended_job` returns them. Each
    gets a file of its own, written atomically; a second hand-over of the same job takes it over.
    """
    pid, ticks = waiter
    for job in sorted(set(jobs))[:MAX_ENDED_JOBS]:
        body = json.dumps(
            {"job": job, "until": until, "by_uid": os.getuid(), "waiter": [pid, ticks]}
        )
        write_atomically(state_dir, _ended_job_file(job), (body + "\n").encode("utf-8"))


def withdraw_ended_jobs(state_dir: str, jobs: Iterable[str], *, waiter: tuple[int, int]) -> None:
    """The epilog's wait is over: remove its hand-overs (those that still name ``waiter``; a
    later epilog's hand-over of the same job is its own)."""
    for job in sorted(set(jobs))[:MAX_ENDED_JOBS]:
        name = _ended_job_file(job)
        try:
            data = json.loads(read_small(state_dir, name, MAX_ENDED_JOB_FILE).decode("utf-8"))
            if _waiter(data) != waiter:
                continue
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(state_dir, name))


def _waiter(data: object) -> tuple[int, int]:
    """The waiting epilog a hand-over names: (PID, start ticks); ValueError when malformed."""
    raw = data.get("waiter") if isinstance(data, dict) else None
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
        or not 0 < raw[0] < 1 << 31
        or not 0 <= raw[1] < 1 << 62
    ):
        raise ValueError("no waiting process named")
    return raw[0], raw[1]


def _ended_job_names(state_dir: str) -> list[str]:
    try:
        with os.scandir(state_dir) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(ENDED_JOB_PREFIX))
    except OSError:
        return []
    return names


def read_ended_jobs(
    state_dir: str,
    now: float,
    *,
    waiting: Callable[[int, int], bool],
    remove_stale: bool = False,
) -> tuple[frozenset[str], list[str]]:
    """The jobs handed over whose epilog still waits, not expired at wall time ``now``, and
    what was wrong.

    ``waiting(pid, start_ticks)`` says whether the epilog a hand-over names still runs (the
    same process: PID and start ticks). Hostile input: a file that is not a small regular file,
    not JSON of the written shape, names a job key that :func:`scheduler_ended_job` would not
    return or no waiting process, or has an expiry more than a day ahead is ignored and named
    in the problems. With ``remove_stale`` (the daemon) expired and bad files, and those whose
    epilog is gone, are removed, so nothing is honoured twice across restarts by mistake and
    nothing piles up. At most :data:`MAX_ENDED_JOBS` are honoured.
    """
    jobs: set[str] = set()
    problems: list[str] = []
    for name in _ended_job_names(state_dir)[: 4 * MAX_ENDED_JOBS]:
        stale = True
        try:
            data = json.loads(read_small(state_dir, name, MAX_ENDED_JOB_FILE).decode("utf-8"))
            job, until = data["job"], data["until"]
            if not isinstance(job, str) or scheduler_ended_job(job, {}) != job:
                raise ValueError(f"not a job key: {str(job)[:80]!r}")
            if not isinstance(until, (int, float)) or isinstance(until, bool):
                raise ValueError("no expiry")
            if until > now + 86400:
                raise ValueError("expiry more than a day ahead")
            if name != _ended_job_file(job):
                raise ValueError("file name does not match the job")
            waiter = _waiter(data)
            if until >= now and len(jobs) < MAX_ENDED_JOBS and waiting(*waiter):
                jobs.add(job)
                stale = False
        except FileNotFoundError:
            continue  # removed since the listing
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            problems.append(f"{name}: {err}")
        if stale and remove_stale:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(state_dir, name))
    return frozenset(jobs), problems
