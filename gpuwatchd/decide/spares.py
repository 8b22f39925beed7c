"""What an administrator's spares cover: which process ``gpuwatchd spare`` leaves alone, and
when a spare starts and ends (the events that journal both ends).

In detail: docs/internals.md, section `gpuwatchd.decide.spares`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from gpuwatchd.core.model import ProcessInfo, Snapshot, Spare, fields_of
from gpuwatchd.core.vocabulary import EventName, Level

SpareEvent = tuple[str, Level, dict[str, object]]  # (event name, level, fields)


def _in_force(spares: Iterable[Spare], wall: float) -> list[Spare]:
    return [spare for spare in spares if spare.until > wall]


# slurmstepd's process title, "slurmstepd: [42.batch]" (cut short: the job id and dot suffice).
_STEPD_TITLE = re.compile(r"slurmstepd: \[([0-9]{1,20})\.")
_MAX_TREE_DEPTH = 64


def stepd_job(process: ProcessInfo) -> str | None:
    """The Slurm job (``slurm:42``) a ``slurmstepd`` that root runs serves, by its title (only
    root can make a uid-0 process and write its title); None for anything else."""
    program = process.exe_name or ""
    if process.uid != 0 or process.exe_trusted is False:
        return None
    if program != "slurmstepd" and not program.startswith("slurmstepd-"):  # Debian: -wlm
        return None
    match = _STEPD_TITLE.match(" ".join(process.cmdline or ()))
    return None if match is None else f"slurm:{match.group(1)}"


def slurm_tree_job(process: ProcessInfo, processes: Mapping[int, ProcessInfo]) -> str | None:
    """The Slurm job whose ``slurmstepd`` is ``process``'s nearest such ancestor; None when the
    chain of parents ends, is unknown, or a parent is younger than its child (PID reuse)."""
    child = process
    for _ in range(_MAX_TREE_DEPTH):
        parent = processes.get(child.ppid) if child.ppid else None
        if parent is None or parent.start_ticks is None or child.start_ticks is None:
            return None
        if parent.start_ticks > child.start_ticks:
            return None
        job = stepd_job(parent)
        if job is not None:
            return job
        child = parent
    return None


def job_processes(job: str, processes: Mapping[int, ProcessInfo]) -> list[ProcessInfo]:
    """The processes of ``job`` (a job key): in its cgroup, its slurmstepds, or in one's tree."""
    return [
        p
        for p in processes.values()
        if (p.cgroup is not None and p.cgroup.job_key == job)
        or stepd_job(p) == job
        or (job.startswith("slurm:") and slurm_tree_job(p, processes) == job)
    ]


def spare_covering(process: ProcessInfo, snapshot: Snapshot) -> tuple[Spare, str | None] | None:
    """The spare of ``snapshot`` in force that covers ``process`` (or its Slurm step tree), with
    the unknown fact that makes it count as spared (None: it is the spared one), or None."""
    for spare in _in_force(snapshot.spares, snapshot.wall_time):
        if spare.pid is not None and spare.pid == process.pid:
            if process.start_ticks is None:
                return spare, "this process's start time is unknown"
            if process.start_ticks == spare.start_ticks:
                return spare, None
        if spare.job is not None:
            if slurm_tree_job(process, snapshot.processes) == spare.job:
                return spare, None
            if process.cgroup is None:
                return spare, "this process's job is unknown"
            if process.cgroup.job_key == spare.job:
                return spare, None
    return None


def spare_reason(process: ProcessInfo, snapshot: Snapshot) -> str | None:
    """Why a spare in force leaves ``process`` alone (``pid 123 (start ticks 456)`` or ``job
    slurm:42``, its reason, what is unknown), or None; the same text while the spare lasts."""
    found = spare_covering(process, snapshot)
    if found is None:
        return None
    spare, unknown = found
    if spare.job is not None:
        what = f"job {spare.job}"
    else:
        what = f"pid {spare.pid} (start ticks {spare.start_ticks})"
    reason = f" ({spare.reason})" if spare.reason else ""
    return f"{what} is spared{reason}" + (f"; {unknown}" if unknown else "")


_SPARE_FIELDS = ("target", "pid", "start_ticks", "job", "reason", "until", "by_uid")


def _same(a: Spare, b: Spare) -> bool:
    """The same spare read twice: told by everything but its wall end (which moves with the
    wall clock); a new spare of the target has a new ``since``."""
    return replace(a, until=0.0) == replace(b, until=0.0)


def spare_changes(before: Sequence[Spare], after: Sequence[Spare], wall: float) -> list[SpareEvent]:
    """The events between two readings of the spares: ``EventName.SPARE_STARTED`` for each new
    or changed one, ``EventName.SPARE_ENDED`` (with why) for each that is gone."""
    events: list[SpareEvent] = []
    old = {spare.target: spare for spare in before}
    new = {spare.target: spare for spare in _in_force(after, wall)}
    for target, spare in sorted(old.items()):
        replaced = new.get(target)
        if replaced is not None and _same(replaced, spare):
            continue
        if replaced is not None:
            why = "replaced by a new spare"
        elif spare.until <= wall:
            why = "its time was up"
        else:
            why = "cancelled"
        events.append(
            (EventName.SPARE_ENDED, Level.WARNING, {**fields_of(spare, _SPARE_FIELDS), "why": why})
        )
    for target, spare in sorted(new.items()):
        earlier = old.get(target)
        if earlier is None or not _same(earlier, spare):
            events.append((EventName.SPARE_STARTED, Level.WARNING, fields_of(spare, _SPARE_FIELDS)))
    return events
