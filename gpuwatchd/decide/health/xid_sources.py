"""Xids from two sources, counted once; a flood said once per window (docs/findings.md#kernel-log):
how one GPU's NVML events and kernel-log lines of one poll become what ``judge.py`` counts and
what the ``EventName.HEALTH_XID`` event says. In detail: docs/internals.md, section
`gpuwatchd.decide.health.xid_sources`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.core.model import KernelXid, XidEvent
from gpuwatchd.core.vocabulary import Level
from gpuwatchd.decide.health.state import (
    MAX_COUNT,
    MAX_JOB,
    MAX_XID_KINDS,
    Sighting,
    XidDetail,
    XidLog,
)
from gpuwatchd.decide.health.xid_catalogue import XID_CATALOGUE, XidAction, xid_action

DEDUP_WINDOW = 30.0  # seconds: NVML's event is stamped when the worker read it, a poll later
LOG_WINDOW = 60.0  # seconds between two EventName.HEALTH_XID events of one GPU's Xid
MAX_SIGHTINGS = 64
NVML = "nvml"
KERNEL = "kernel"


@dataclass(frozen=True)
class Occurrence:
    """``count`` new occurrences of ``xid`` between ``first`` and ``last`` (wall seconds)."""

    xid: int
    count: int
    first: float
    last: float


@dataclass(frozen=True)
class XidNotice:
    """What one ``EventName.HEALTH_XID`` event says about one GPU's Xid."""

    gpu: str
    xid: int
    count: int
    first: float
    last: float
    sources: tuple[str, ...]
    repeated: bool  # a held count, said once the window has passed
    detail: XidDetail | None

    @property
    def level(self) -> Level:
        """Warning when the catalogue asks for a reset or a reboot, else info."""
        serious = xid_action(self.xid) in (XidAction.RESET, XidAction.REBOOT)
        return Level.WARNING if serious else Level.INFO

    def fields(self) -> dict[str, object]:
        """The ``EventName.HEALTH_XID`` event's fields (docs/events.md)."""
        entry = XID_CATALOGUE.get(self.xid)
        detail = self.detail
        return {
            "gpu": self.gpu,
            "xid": self.xid,
            "xid_name": None if entry is None else entry.name,
            "xid_action": str(xid_action(self.xid)),
            "count": self.count,
            "first": self.first,
            "last": self.last,
            "sources": list(self.sources),
            "repeated": self.repeated,
            "before_start": None if detail is None else detail.before_start,
            "pid": None if detail is None else detail.pid,
            "process": None if detail is None else detail.process,
            "job": None if detail is None else detail.job,
            "driver_text": None if detail is None else detail.text,
        }


@dataclass(frozen=True)
class Merged:
    """One GPU's poll of Xids, merged: what to count, and what to carry."""

    occurrences: tuple[Occurrence, ...]
    sightings: tuple[Sighting, ...]
    klog_pos: int | None
    details: Mapping[int, XidDetail]
    sources: Mapping[int, tuple[str, ...]]  # per Xid: the sources that saw it this poll


def _take(pending: list[Sighting], source: str, xid: int, low: float, high: float) -> bool:
    """Remove the first sighting of ``xid`` by ``source`` within [low, high]; found?"""
    for i, seen in enumerate(pending):
        if seen.source == source and seen.xid == xid and low <= seen.wall <= high:
            del pending[i]
            return True
    return False


def merge_sources(
    nvml: Sequence[XidEvent],
    kernel: Sequence[KernelXid],
    *,
    sightings: Iterable[Sighting],
    klog_pos: int | None,
    details: Mapping[int, XidDetail],
    wall: float,
) -> Merged:
    """Merge one GPU's NVML events and kernel-log records of one poll. Pure."""
    pending = [s for s in sightings if wall - s.wall <= DEDUP_WINDOW]
    counted: list[Occurrence] = []
    seen_by: dict[int, set[str]] = {}
    new_details = dict(details)
    position = klog_pos
    for run in kernel:
        if klog_pos is not None and run.position <= klog_pos:
            continue  # counted by an earlier run of the daemon
        position = run.position if position is None else max(position, run.position)
        seen_by.setdefault(run.xid, set()).add(KERNEL)
        low, high = run.first - DEDUP_WINDOW, run.last + DEDUP_WINDOW
        matched = 0
        while matched < run.count and _take(pending, NVML, run.xid, low, high):
            matched += 1
        if matched:
            seen_by[run.xid].add(NVML)
        if run.count > matched:
            counted.append(Occurrence(run.xid, run.count - matched, run.first, run.last))
            fresh = min(run.count - matched, MAX_SIGHTINGS)
            pending.extend(Sighting(run.xid, run.last, KERNEL) for _ in range(fresh))
            if len(pending) > 2 * MAX_SIGHTINGS:  # bounded while merging, not only after
                del pending[:-MAX_SIGHTINGS]
        if run.xid in new_details or len(new_details) < MAX_XID_KINDS:
            job = run.job if run.job is None or len(run.job) <= MAX_JOB else None  # as read back
            detail = (run.pid, run.process, job, run.text, run.before_start)
            new_details[run.xid] = XidDetail(*detail, wall=run.last)
    for event in nvml:
        seen_by.setdefault(event.xid, set()).add(NVML)
        window = (event.wall - DEDUP_WINDOW, event.wall + DEDUP_WINDOW)
        if _take(pending, KERNEL, event.xid, *window):
            seen_by[event.xid].add(KERNEL)
            continue
        counted.append(Occurrence(event.xid, 1, event.wall, event.wall))
        pending.append(Sighting(event.xid, event.wall, NVML))
    return Merged(
        occurrences=tuple(counted),
        sightings=tuple(pending[-MAX_SIGHTINGS:]),
        klog_pos=position,
        details=new_details,
        sources={xid: tuple(sorted(s)) for xid, s in seen_by.items()},
    )


def notices(
    gpu: str, merged: Merged, logs: Mapping[int, XidLog], wall: float
) -> tuple[tuple[XidNotice, ...], dict[int, XidLog]]:
    """The ``EventName.HEALTH_XID`` notices of this poll, and the carried log state. Pure."""
    new: dict[int, list[Occurrence]] = {}
    for occurrence in merged.occurrences:
        new.setdefault(occurrence.xid, []).append(occurrence)
    carried = dict(logs)
    said: list[XidNotice] = []
    for xid in sorted(set(new) | {x for x, rec in logs.items() if rec.held}):
        fresh = new.get(xid, [])
        rec = carried.get(xid)
        count = min(sum(o.count for o in fresh) + (rec.held if rec else 0), MAX_COUNT)
        firsts = [o.first for o in fresh] + ([rec.first] if rec and rec.held else [])
        lasts = [o.last for o in fresh] + ([rec.last] if rec and rec.held else [])
        if rec is not None and wall - rec.logged_at < LOG_WINDOW:
            carried[xid] = XidLog(rec.logged_at, count, min(firsts), max(lasts))
            continue
        if rec is None and len(carried) >= MAX_XID_KINDS:
            continue
        said.append(
            XidNotice(
                gpu=gpu,
                xid=xid,
                count=count,
                first=min(firsts),
                last=max(lasts),
                sources=merged.sources.get(xid, ()),
                repeated=not fresh,
                detail=merged.details.get(xid) if KERNEL in merged.sources.get(xid, ()) else None,
            )
        )
        carried[xid] = XidLog(wall, 0, wall, wall)
    quiet = [x for x, r in carried.items() if not r.held and wall - r.logged_at >= LOG_WINDOW]
    for xid in quiet:  # nothing held and the window over: as if never said
        del carried[xid]
    return tuple(said), carried
