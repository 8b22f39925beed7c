"""What an administrator's spares cover: which process ``gpuwatchd spare`` leaves alone, and
when a spare starts and ends (the events that journal both ends).

A spare (:class:`gpuwatchd.model.Spare`) names a process by PID *and* start ticks, or a job by
its key (``slurm:42``, as ``CgroupInfo.job_key`` spells it). :func:`spare_reason` says why a
process may not be signalled now; ``targets.refusal`` and the planner's ladders call it, so
every decision that could signal a process honours it. Unknown never excuses a signal: a
process whose start ticks (for a PID spare of its PID) or whose cgroup (while a job is spared)
cannot be read counts as spared.

It is pure: no I/O, no clock (wall time is passed in), no logging (changes come back as
:class:`gpuwatchd.decide.plan.Event`). Reading and writing the spare files is
``gpuwatchd/spares.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gpuwatchd.model import ProcessInfo, Spare
from gpuwatchd.vocabulary import EventName, Level

__all__ = ["SpareEvent", "spare_changes", "spare_covering", "spare_reason", "spare_text"]

SpareEvent = tuple[str, Level, dict[str, object]]  # (event name, level, fields)


def _in_force(spares: Iterable[Spare], wall: float) -> list[Spare]:
    return [spare for spare in spares if spare.until > wall]


def spare_text(spare: Spare) -> str:
    """How a spare is named in refusals and events: ``pid 123 (start 456)`` or ``job
    slurm:42``, with its reason."""
    if spare.job is not None:
        what = f"job {spare.job}"
    else:
        what = f"pid {spare.pid} (start ticks {spare.start_ticks})"
    return f"{what} is spared" + (f" ({spare.reason})" if spare.reason else "")


def spare_covering(
    process: ProcessInfo, spares: Sequence[Spare], wall: float
) -> tuple[Spare, str | None] | None:
    """The spare in force at wall time ``wall`` that covers ``process``, with what is unknown
    about the process that makes it count as spared (None: it is the spared one), or None."""
    for spare in _in_force(spares, wall):
        if spare.pid is not None and spare.pid == process.pid:
            if process.start_ticks is None:
                return spare, "this process's start time is unknown"
            if process.start_ticks == spare.start_ticks:
                return spare, None
        if spare.job is not None:
            if process.cgroup is None:
                return spare, "this process's job is unknown"
            if process.cgroup.job_key == spare.job:
                return spare, None
    return None


def spare_reason(process: ProcessInfo, spares: Sequence[Spare], wall: float) -> str | None:
    """Why ``process`` is left alone at wall time ``wall`` because of a spare in force, or
    None. The text names the spare, not how long it has left, so it stays the same while the
    spare lasts (a hold is said once)."""
    found = spare_covering(process, spares, wall)
    if found is None:
        return None
    spare, unknown = found
    return spare_text(spare) + (f"; {unknown}" if unknown else "")


def _fields(spare: Spare) -> dict[str, object]:
    return {
        "target": spare.target,
        "pid": spare.pid,
        "start_ticks": spare.start_ticks,
        "job": spare.job,
        "reason": spare.reason,
        "until": spare.until,
        "by_uid": spare.by_uid,
    }


def _same(a: Spare, b: Spare) -> bool:
    """The same spare read twice: its wall end moves with the wall clock (and a cut has its
    own event), so it is told by everything else; a new spare of the target has a new
    ``since``."""
    return replace(a, until=0.0) == replace(b, until=0.0)


def spare_changes(before: Sequence[Spare], after: Sequence[Spare], wall: float) -> list[SpareEvent]:
    """The events between two readings of the spares: ``spare.started`` for each new (or
    changed) spare, ``spare.ended`` for each that is gone, with why: its time was up, or it was
    cancelled (``gpuwatchd spare --cancel``) or replaced."""
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
        events.append((EventName.SPARE_ENDED, Level.WARNING, {**_fields(spare), "why": why}))
    for target, spare in sorted(new.items()):
        earlier = old.get(target)
        if earlier is None or not _same(earlier, spare):
            events.append((EventName.SPARE_STARTED, Level.WARNING, _fields(spare)))
    return events
