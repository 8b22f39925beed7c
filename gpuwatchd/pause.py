"""The admin's switches, kept as small files in ``state_dir`` so they survive restarts.

``gpuwatchd pause`` / ``resume`` write and remove ``<state_dir>/paused``; ``resume
--clear-latches`` drops ``<state_dir>/clear-latches``, which the daemon consumes at its next poll
to lift the kill-cap dry-run latch and the reset circuit breaker. ``run --once --ended-job``
beside a running daemon hands the scheduler's word over in ``<state_dir>/ended-job-<hash>`` files
(one per job, so two epilogs never overwrite each other), each with an expiry; every scan reads
them, and the daemon removes them once expired. This module only reads and writes those files;
what pausing or an ended job means is the planner's and assess's business.

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
from collections.abc import Iterable

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
    state_dir: str,
    jobs: Iterable[str],
    *,
    until: float,
    said_at: int | None = None,
    boot_id: str | None = None,
) -> None:
    """Tell the running daemon (and every scan) that ``jobs`` ended, until wall time ``until``.

    ``jobs`` are keys as :func:`gpuwatchd.collect.jobs.scheduler_ended_job` returns them. Each
    gets a file of its own, written atomically; a second hand-over of the same job extends it.
    ``said_at`` is when, in clock ticks since boot ``boot_id`` (the unit of a process's start
    time): the word covers only processes that started before it.
    """
    for job in sorted(set(jobs))[:MAX_ENDED_JOBS]:
        body = json.dumps(
            {
                "job": job,
                "until": until,
                "by_uid": os.getuid(),
                "said_at_ticks": said_at,
                "boot_id": boot_id,
            }
        )
        write_atomically(state_dir, _ended_job_file(job), (body + "\n").encode("utf-8"))


def _ended_job_names(state_dir: str) -> list[str]:
    try:
        with os.scandir(state_dir) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(ENDED_JOB_PREFIX))
    except OSError:
        return []
    return names


def read_ended_jobs(
    state_dir: str, now: float, *, remove_stale: bool = False, boot_id: str | None = None
) -> tuple[dict[str, int | None], list[str]]:
    """The jobs handed over and not yet expired at wall time ``now`` (job key -> when it was
    said, in clock ticks since boot; None when that is unknown, or was said in another boot
    than ``boot_id``: such a word covers no process), and what was wrong.

    Hostile input: a file that is not a small regular file, not JSON of the written shape,
    names a job key that :func:`scheduler_ended_job` would not return, or has an expiry more
    than a day ahead is ignored and named in the problems. With ``remove_stale`` (the daemon)
    expired and bad files are removed, so nothing is honoured twice across restarts by mistake
    and nothing piles up. At most :data:`MAX_ENDED_JOBS` are honoured.
    """
    jobs: dict[str, int | None] = {}
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
            if until >= now and len(jobs) < MAX_ENDED_JOBS:
                said = data.get("said_at_ticks")
                valid = isinstance(said, int) and not isinstance(said, bool) and said >= 0
                same_boot = boot_id is not None and data.get("boot_id") == boot_id
                jobs[job] = said if valid and same_boot else None
                stale = False
        except FileNotFoundError:
            continue  # removed since the listing
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            problems.append(f"{name}: {err}")
        if stale and remove_stale:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(state_dir, name))
    return jobs, problems
