"""The spare files in ``state_dir``: ``gpuwatchd spare`` writes one per spared process or job,
the daemon reads them every poll.

A spare leaves one process (named by PID *and* start ticks, in this boot) or every process of
one job (``slurm:42``, ``pod:UID``, ``container:ID``, ``unit:NAME.service``) alone until a wall
time. A process spare given before this boot names nobody now: that is told by its ``since``
against the boot's wall time (:func:`booted_at`), not by the boot id, which a container
manager may show differently to a sandboxed service and to a shell. Each spare lives in
``<state_dir>/spare-<hash of its target>``, so sparing the same target again replaces it and
two targets never overwrite each other. The files are reached the one checked way
(:class:`gpuwatchd.statedir.StateDir`: never through a link, trusted regular files only,
size-capped); a file that is not of the written shape is ignored and named. The daemon
(``remove_stale``) removes spares whose time is up, those of a process from another boot, and
bad files, so nothing piles up and a spare never outlives its time.

This module only reads and writes the files; what a spare covers is ``decide/spares.py``'s.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.model import Spare
from gpuwatchd.statedir import StateDir

__all__ = [
    "MAX_SPARES",
    "SPARE_PREFIX",
    "SpareFiles",
    "booted_at",
    "cancel_spare",
    "parse_target",
    "read_spares",
    "write_spare",
]

SPARE_PREFIX = "spare-"
MAX_SPARES = 64  # spares honoured at once; a node needs a handful
MAX_SPARE_FILE = 4096
MAX_REASON = 512


def parse_target(text: str) -> tuple[str, int | None, str | None]:
    """``PID`` or ``job:ID`` as the CLI takes it → (target key, pid, job key). ``job:42`` is
    Slurm job 42; ``job:KIND:ID`` names a pod, container or unit as ``--ended-job`` does.
    ValueError with a message naming the value otherwise."""
    text = text.strip()
    if text.isdigit():
        pid = int(text)
        if pid == 1:
            raise ValueError(
                "spare '1': PID 1 is the init process, which gpuwatchd never signals (the "
                "safety floor): there is nothing to spare"
            )
        if not 1 < pid < 1 << 22:
            raise ValueError(f"spare {text!r}: not a process id (1 < PID < {1 << 22})")
        return f"pid:{pid}", pid, None
    kind, sep, rest = text.partition(":")
    if kind != "job" or not sep or not rest:
        raise ValueError(f"spare {text[:80]!r}: expected a PID or job:ID (job:42 for Slurm job 42)")
    key = f"slurm:{rest}" if ":" not in rest else rest
    try:
        checked = scheduler_ended_job(key, {})
    except ValueError as exc:
        raise ValueError(str(exc).replace("--ended-job", "spare")) from exc
    return f"job:{checked}", None, checked


def _file(target: str) -> str:
    import hashlib  # here: loading OpenSSL costs every scan ~3 ms, and most never get here

    return SPARE_PREFIX + hashlib.sha256(target.encode("utf-8")).hexdigest()[:32]


def write_spare(
    state_dir: StateDir,
    target: str,
    *,
    until: float,
    reason: str,
    pid: int | None = None,
    start_ticks: int | None = None,
    boot_id: str | None = None,
    job: str | None = None,
) -> None:
    """Spare ``target`` (from :func:`parse_target`) until wall time ``until``; a process also
    by its start ticks in boot ``boot_id``. Replaces an earlier spare of the same target."""
    body = {
        "target": target,
        "pid": pid,
        "start_ticks": start_ticks,
        "boot_id": boot_id,
        "job": job,
        "until": until,
        "since": time.time(),
        "reason": reason[:MAX_REASON],
        "by_uid": os.getuid(),
    }
    state_dir.write(_file(target), (json.dumps(body) + "\n").encode("utf-8"))


def cancel_spare(state_dir: StateDir, target: str) -> bool:
    """End the spare of ``target`` now; False when there was none."""
    return state_dir.remove(_file(target))


@dataclass(frozen=True)
class SpareFiles:
    """What :func:`read_spares` found: the spares in force (at most :data:`MAX_SPARES`) and
    the files that were wrong, named."""

    spares: tuple[Spare, ...]
    problems: tuple[str, ...]


def _int(data: dict[str, object], key: str, low: int, high: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{key} is not a valid number")
    return value


def booted_at(now: float) -> float | None:
    """The wall time this boot began (``now`` less the time since boot), or None."""
    try:
        return now - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return None


BOOT_SLACK = 60.0  # seconds: clock adjustments between two readings of the boot's wall time


def _spare(data: object, name: str, boot_wall: float | None, max_spare: float, now: float) -> Spare:
    """One file's spare; ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    target = data.get("target")
    if not isinstance(target, str) or name != _file(target):
        raise ValueError("the file name does not match its target")
    key, pid, job = parse_target(target.split(":", 1)[1] if target.startswith("pid:") else target)
    if key != target:
        raise ValueError(f"not a target: {target[:80]!r}")
    until = data.get("until")
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until):
        raise ValueError("no end time")
    if until > now + max_spare + 60:
        raise ValueError("ends later than limits.max_spare allows")
    start_ticks = _int(data, "start_ticks", 0, 1 << 62)
    since = data.get("since")
    if pid is not None:
        if start_ticks is None:
            raise ValueError("a process spare without its start time")
        given = since if isinstance(since, (int, float)) and not isinstance(since, bool) else None
        if boot_wall is None or given is None or given < boot_wall - BOOT_SLACK:
            raise ValueError("a process of another boot")
    reason = data.get("reason")
    return Spare(
        target=target,
        until=float(until),
        reason=str(reason)[:MAX_REASON] if isinstance(reason, str) else "",
        pid=pid,
        start_ticks=start_ticks if pid is not None else None,
        job=job,
        since=float(since)
        if isinstance(since, (int, float)) and not isinstance(since, bool)
        else None,
        by_uid=_int(data, "by_uid", 0, 1 << 32),
    )


def read_spares(
    state_dir: StateDir,
    now: float,
    *,
    boot_wall: float | None,
    max_spare: float,
    remove_stale: bool = False,
) -> SpareFiles:
    """The spares in force at wall time ``now``, and the bad files. ``boot_wall`` is when this
    boot began (:func:`booted_at`): a process spare given before it is of another boot.

    With ``remove_stale`` (the daemon), spares whose time is up, those of a process from
    another boot (or when the boot's time is unknown), and bad files are removed. A spare that ends
    later than ``max_spare`` from now (a hand-made file, a clock set back) is bad.
    """
    try:
        names = state_dir.names(SPARE_PREFIX)
    except OSError:
        return SpareFiles((), ())
    found: list[Spare] = []
    problems: list[str] = []
    for name in names[: 4 * MAX_SPARES]:
        try:
            data = json.loads(state_dir.read(name, MAX_SPARE_FILE).decode("utf-8"))
            spare = _spare(data, name, boot_wall, max_spare, now)
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            problems.append(f"{name}: {err}")
        else:
            if spare.until > now:
                found.append(spare)
                continue
        if remove_stale:
            state_dir.remove(name)
    found.sort(key=lambda spare: (spare.until, spare.target))
    return SpareFiles(tuple(found[:MAX_SPARES]), tuple(problems))
