"""How ``scan`` and ``explain`` show an administrator's spares: the report's ``spares`` list,
each finding's and holder's ``spared`` entry, and its line ("spared until … by root (uid 0):
why"). What a spare covers is :func:`gpuwatchd.decide.spares.spare_covering`'s."""

from __future__ import annotations

import dataclasses
import pwd
from collections.abc import Mapping, Sequence

from gpuwatchd.cli.humantime import stamp, until
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.checked import as_list, as_map, as_number, as_text
from gpuwatchd.core.codec import pick
from gpuwatchd.core.model import ProcessInfo, Snapshot, Spare, as_int, fields_of
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.spares import spare_covering, spare_reason
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.spares import read_spares


def spares_in_force(state_dir: StateDir | None, policy: Policy, now: float) -> tuple[Spare, ...]:
    """The spares in force at wall time ``now`` in ``state_dir`` (none without one)."""
    if state_dir is None:
        return ()
    clock = BootTime.read(now, ProcFS(policy.proc_root).boot_id())
    return read_spares(state_dir, clock, max_spare=policy.limits.max_spare).spares


def spare_row(spare: Spare, unknown: str | None = None) -> dict[str, object]:
    """A spare as ``scan --json`` carries it; ``unknown`` says why a process counts as spared
    without being the spared one (its start time or job cannot be read)."""
    row = fields_of(spare, ("target", "until", "reason", "by_uid", "pid", "start_ticks", "job"))
    if unknown is not None:
        row["unknown"] = unknown
    return row


_SPARE = {"pid": as_int, "start_ticks": as_int, "job": as_text, "by_uid": as_int}


def spares_from_report(report: Mapping[str, object]) -> tuple[Spare, ...]:
    """The spares a ``scan --json`` report carries (``explain`` judges with them); a
    malformed entry is left out."""
    out: list[Spare] = []
    for item in as_list(report.get("spares"))[:64]:
        row = as_map(item)
        target, ends = as_text(row.get("target")), as_number(row.get("until"))
        if target is None or ends is None:
            continue
        reason = as_text(row.get("reason")) or ""
        out.append(Spare(target=target, until=ends, reason=reason, **pick(row, _SPARE)))
    return tuple(out)


def _spared(snapshot: Snapshot, process: ProcessInfo | None) -> dict[str, object] | None:
    """The ``spared`` entry of ``process``: the spare covering it now; None when none does."""
    if process is None:
        return None
    found = spare_covering(process, snapshot.spares, snapshot.wall_time, snapshot.processes)
    return None if found is None else spare_row(*found)


def mark_spared(report: dict[str, object], snapshot: Snapshot, spares: Sequence[Spare]) -> None:
    """Add the spares in force (``spares``) and, to each finding and holder whose process one
    of them covers at the snapshot's time, its ``spared`` entry (null for the others)."""
    snapshot = dataclasses.replace(snapshot, spares=tuple(spares))
    report["spares"] = [spare_row(spare) for spare in snapshot.spares]
    entries = [*as_list(report.get("findings")), *as_list(report.get("node_holders"))]
    for gpu in as_list(report.get("gpus")):
        if isinstance(gpu, dict):
            entries += as_list(gpu.get("holders"))
    for entry in entries:
        if isinstance(entry, dict):
            pid = entry.get("pid")
            process = snapshot.processes.get(pid) if isinstance(pid, int) else None
            entry["spared"] = _spared(snapshot, process)


def _who(uid: object) -> str:
    if not isinstance(uid, int) or isinstance(uid, bool):
        return "an unknown user"
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def spared_text(row: Mapping[str, object], now: float | None) -> str:
    """``spared until 2026-12-04 14:00:00 (in 50m) by root (uid 0): why`` for a ``spared``
    entry, with what is unknown about the process when that is why it counts."""
    ends = as_number(row.get("until"))
    when = "?"
    if ends is not None:
        when = stamp(ends)
        if now is not None:
            when += f" ({until(ends - now)})"
    reason = as_text(row.get("reason"))
    unknown = as_text(row.get("unknown"))
    text = f"spared until {when} by {_who(row.get('by_uid'))}"
    text += f": {reason}" if reason else ""
    return text + (f" ({as_text(row.get('target'))}; {unknown})" if unknown else "")


def spared_lines(entries: Sequence[Mapping[str, object]], now: float | None) -> list[str]:
    """One line per spared entry: ``pid 4242 spared until …``."""
    return [
        f"pid {entry.get('pid')} {spared_text(as_map(entry.get('spared')), now)}"
        for entry in entries
        if isinstance(entry.get("spared"), Mapping)
    ]


def spare_stops(
    process: ProcessInfo | None, snapshot: Snapshot, refused: str | None
) -> tuple[dict[str, object] | None, list[str]]:
    """For ``explain``: the ``spared`` entry of ``process`` (None when no spare covers it) and
    what stops a signal: the spare's line, then ``refused`` (``targets.refusal``'s reason)
    unless it is the spare's own, already said."""
    row = _spared(snapshot, process)
    if row is None or process is None:
        return None, [] if refused is None else [refused]
    stops = [spared_text(row, snapshot.wall_time)]
    own = f"spare: {spare_reason(process, snapshot.spares, snapshot.wall_time, snapshot.processes)}"
    if refused is not None and refused != own:  # targets.refusal's words for the same spare
        stops.append(refused)
    return row, stops
