"""The spare files in ``state_dir``: ``gpuwatchd spare`` writes one per spared process or job.

In detail: docs/internals.md, section `gpuwatchd.state.spares`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.jobs import scheduler_ended_job
from gpuwatchd.core.checked import MAX_REASON, as_number, decimal, opt_integer
from gpuwatchd.core.codec import Format
from gpuwatchd.core.model import Spare
from gpuwatchd.state.directory import StateDir, hashed_name

SPARE_PREFIX = "spare-"
MAX_SPARES = 64  # spares honoured at once; a node needs a handful
# The largest written is ~7.5 kB: a reason of MAX_REASON characters outside the BMP (12 bytes
# each as JSON) and the longest unit name, twice (target and job), each byte escaped.
MAX_SPARE_FILE = 8192
# The target, its end and its boot are checked against the file name and the clock (_spare).
SPARE = Format(
    SPARE_PREFIX,
    MAX_SPARE_FILE,
    newline=True,
    fields={
        "start_ticks": partial(opt_integer, low=0, high=1 << 62),
        "by_uid": partial(opt_integer, low=0, high=1 << 32),
    },
)


def parse_target(text: str) -> tuple[str, int | None, str | None]:
    """``PID`` or ``job:ID`` as the CLI takes it → (target key, pid, job key). ``job:42`` is
    Slurm job 42; ``job:KIND:ID`` names a pod, container or unit as ``--ended-job`` does.
    ValueError with a message naming the value otherwise."""
    text = text.strip()
    if text.isascii() and text.isdigit():  # in any length, said "not a process id" if long
        pid = decimal(text) or 0  # None past 20 digits: no PID, as 0 is
        if pid == 1:
            raise ValueError(
                "spare '1': PID 1 is the init process, which gpuwatchd never signals (the "
                "safety floor): there is nothing to spare"
            )
        if not 1 < pid < 1 << 22:
            raise ValueError(f"spare {text[:80]!r}: not a process id (1 < PID < {1 << 22})")
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


def write_spare(
    state_dir: StateDir,
    target: str,
    *,
    clock: BootTime,
    seconds: float,
    reason: str,
    pid: int | None = None,
    start_ticks: int | None = None,
    job: str | None = None,
) -> None:
    """Spare ``target`` (from :func:`parse_target`) for ``seconds`` from ``clock`` (now), a
    process also by its start ticks, replacing an earlier spare of the same target."""
    body = {
        "target": target,
        "pid": pid,
        "start_ticks": start_ticks,
        "job": job,
        **clock.stamp(seconds),
        "reason": reason[:MAX_REASON],
        "by_uid": os.getuid(),
    }
    with state_dir.switch_lock():  # never undone by the daemon's cut (StateDir.rewrite)
        state_dir.write(hashed_name(SPARE_PREFIX, target), SPARE.encode(body))


def cancel_spare(state_dir: StateDir, target: str) -> bool:
    """End the spare of ``target`` now; False when there was none."""
    with state_dir.switch_lock():
        return state_dir.remove(hashed_name(SPARE_PREFIX, target))


@dataclass(frozen=True)
class SpareFiles:
    """What :func:`read_spares` found: the spares in force, the files that were wrong, the
    spares cut to ``limits.max_spare`` (each with the wall time it would have ended at), and
    ``over``: the valid spares not honoured, past ``MAX_SPARES`` (kept, honoured as others end)."""

    spares: tuple[Spare, ...]
    problems: tuple[str, ...]
    cut: tuple[tuple[Spare, float], ...] = ()
    over: tuple[str, ...] = ()


def _spare(data: Mapping[str, Any], name: str, clock: BootTime) -> tuple[Spare, float]:
    """One file's spare and the seconds it has left; ValueError naming what is wrong."""
    target = data.get("target")
    if not isinstance(target, str) or name != hashed_name(SPARE_PREFIX, target):
        raise ValueError("the file name does not match its target")
    key, pid, job = parse_target(target.split(":", 1)[1] if target.startswith("pid:") else target)
    if key != target:
        raise ValueError(f"not a target: {target[:80]!r}")
    left = None if as_number(data.get("until")) is None else clock.left(data)
    if left is None:
        raise ValueError("no end time")
    start_ticks = data["start_ticks"]
    if pid is not None:
        if start_ticks is None:
            raise ValueError("a process spare without its start time")
        if not clock.same_boot(data):
            raise ValueError("a process of another boot")
    reason = data.get("reason")
    return Spare(
        target=target,
        until=clock.wall + left,
        reason=str(reason)[:MAX_REASON] if isinstance(reason, str) else "",
        pid=pid,
        start_ticks=start_ticks if pid is not None else None,
        job=job,
        since=as_number(data.get("since")),
        by_uid=data["by_uid"],
    ), left


def read_spares(
    state_dir: StateDir, clock: BootTime, *, max_spare: float, remove_stale: bool = False
) -> SpareFiles:
    """The spares in force at ``clock`` and the bad files, one with more than ``max_spare`` left
    cut to it. ``remove_stale``: the daemon's removals and cuts (docs/internals.md)."""
    try:
        names = state_dir.names(SPARE_PREFIX)
    except OSError:
        return SpareFiles((), ())
    found: list[Spare] = []
    problems: list[str] = []
    cut: list[tuple[Spare, float]] = []
    for name in names[: 4 * MAX_SPARES]:
        raw = None
        try:
            raw = state_dir.read(name, MAX_SPARE_FILE)
            data = SPARE.load(raw)
            spare, left = _spare(SPARE.check(data), name, clock)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            problems.append(f"{name}: {err}")
        else:
            if left > 0:
                if left > max_spare:
                    cut.append((replace(spare, until=clock.wall + max_spare), spare.until))
                    spare = cut[-1][0]
                    if remove_stale:
                        end = clock.stamp(max_spare)
                        body = {**data, "until": end["until"], "until_boot": end["until_boot"]}
                        state_dir.rewrite(name, raw, SPARE.encode(body), MAX_SPARE_FILE)
                found.append(spare)
                continue
        if remove_stale and raw is not None:  # unless a new spare replaced it since
            state_dir.rewrite(name, raw, None, MAX_SPARE_FILE)
        elif remove_stale:
            state_dir.remove(name)  # unreadable (a link, a FIFO): no spare of the admin's
    found.sort(key=lambda spare: (spare.until, spare.target))
    past = f"more than {MAX_SPARES} spares at once; honoured when one ends"
    over = [f"{spare.target}: {past}" for spare in found[MAX_SPARES:]]
    if len(names) > 4 * MAX_SPARES:
        over.append(
            f"{len(names) - 4 * MAX_SPARES} spare files past the first {4 * MAX_SPARES} not read"
        )
    return SpareFiles(tuple(found[:MAX_SPARES]), tuple(problems), tuple(cut), tuple(over))
