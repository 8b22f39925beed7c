"""``gpuwatchd spare``: leave one process (by PID and start time, so a reused PID is not
spared) or one job's processes alone for a while; ``--list`` shows them, ``--cancel`` ends one.
The daemon reads them (:mod:`gpuwatchd.state.spares`) at its next poll. And how ``scan`` and
``explain`` show them: the report's ``spares`` list, each finding's and holder's ``spared``
entry, and its line ("spared until … by root (uid 0): why"). What a spare covers is
:func:`gpuwatchd.decide.spares.spare_covering`'s."""

from __future__ import annotations

import dataclasses
import json
import pwd
import time
from collections.abc import Mapping, Sequence

from gpuwatchd.cli import CliError
from gpuwatchd.cli.humantime import duration, for_seconds, stamp, until
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.core.checked import as_list, as_map, as_number, as_text
from gpuwatchd.core.codec import pick
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import ProcessInfo, Snapshot, Spare, as_int, fields_of
from gpuwatchd.core.vocabulary import ExitCode
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.spares import job_processes, spare_covering, spare_reason
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.spares import (
    MAX_SPARES,
    SpareFiles,
    cancel_spare,
    parse_target,
    read_spares,
    write_spare,
)


def _length(text: str | None, max_spare: float) -> float:
    from gpuwatchd.config.yamlsrc import ConfigError  # only here: a scan never loads YAML

    if text is None:
        raise CliError("spare needs --for DURATION (how long to leave it alone)", ExitCode.CONFIG)
    try:
        return for_seconds(text, command="spare", limit="limits.max_spare", maximum=max_spare)
    except (ConfigError, ValueError) as exc:
        raise CliError(f"{exc}; nothing is spared", ExitCode.CONFIG) from exc


def spare_command(
    policy: Policy,
    *,
    target: str | None,
    for_: str | None,
    reason: str | None,
    cancel: bool,
    listing: bool,
    as_json: bool,
) -> int:
    """Run ``gpuwatchd spare``; raises :class:`CliError` (refused: nothing was changed),
    ``OSError`` (the state directory)."""
    procfs = ProcFS(policy.proc_root)
    now = time.time()
    if listing or (target, for_, reason, cancel) == (None, None, None, False):
        if target is not None or cancel:
            raise CliError("spare --list takes no target and no --cancel", ExitCode.CONFIG)
        return _list(policy, procfs, now, as_json=as_json)
    if target is None:
        raise _no_target(cancel=cancel)
    try:
        key, pid, job = parse_target(target)
    except ValueError as exc:
        raise CliError(f"{exc}; nothing is {_left(cancel)}", ExitCode.CONFIG) from exc
    _refuse_a_pid_not_the_hosts(policy, procfs, target, pid=pid, cancel=cancel)
    if cancel:  # the spare of key ended now, and whether there was one said
        with StateDir.open(policy.state_dir, create=True) as state_dir:
            gone = cancel_spare(state_dir, key)
        print(f"gpuwatchd: {key}: " + ("spare cancelled" if gone else "was not spared"))
        return ExitCode.OK
    seconds = _length(for_, policy.limits.max_spare)
    if not reason:
        raise CliError("spare needs --reason TEXT (it is logged and shown)", ExitCode.CONFIG)
    boot_id = procfs.boot_id()
    caveat = "" if job is None else _job_found(procfs, job, target)
    start_ticks = None if pid is None else _start_ticks(procfs, pid, boot_id, target)
    clock = BootTime.read(now, boot_id)
    with StateDir.open(policy.state_dir, create=True) as state_dir:
        in_force = read_spares(state_dir, clock, max_spare=policy.limits.max_spare).spares
        if len(in_force) >= MAX_SPARES and key not in {spare.target for spare in in_force}:
            raise CliError(
                f"spare {target}: {MAX_SPARES} spares are in force, the most the daemon "
                "honours at once: nothing is spared (cancel one first)",
                ExitCode.CONFIG,
            )
        write_spare(
            state_dir,
            key,
            clock=clock,
            seconds=seconds,
            reason=reason,
            pid=pid,
            start_ticks=start_ticks,
            job=job,
        )
    what = f"pid {pid} (start ticks {start_ticks})" if pid is not None else f"job {job}"
    ends = stamp(now + seconds, zone=True)
    print(
        f"gpuwatchd: {what} is spared for {duration(seconds)}, until {ends}: "
        f"never signalled until then (the daemon reads it at its next poll){caveat}",
    )
    return ExitCode.OK


def _no_target(*, cancel: bool) -> CliError:
    """What is missing when --for, --reason or --cancel came without a target: that is never
    a listing (only --list, or spare alone, is)."""
    if cancel:
        what = "--cancel needs a target (PID or job:ID): nothing is changed"
    else:
        what = "needs a target (PID or job:ID): nothing is spared"
    return CliError(f"spare {what}", ExitCode.CONFIG)


def _left(cancel: bool) -> str:
    """What a refused ``spare`` says it left as it was: a ``--cancel``, the spares."""
    return "changed" if cancel else "spared"


def _refuse_a_pid_not_the_hosts(
    policy: Policy, procfs: ProcFS, target: str, *, pid: int | None, cancel: bool
) -> None:
    """The daemon reads a spare's PID as a host PID: one given in another PID namespace (a
    container without hostPID) names another process there, so a PID target is refused where
    this process is not known to see the host's PIDs, unless ``namespace_check`` is off."""
    if pid is not None and policy.namespace_check and procfs.sees_host_pids() is not True:
        raise CliError(
            f"spare {target}: not run in the host PID namespace (or cannot tell), where the "
            "daemon reads PIDs: the PID may name another process there; nothing is "
            f"{_left(cancel)}",
            ExitCode.CONFIG,
        )


def _start_ticks(procfs: ProcFS, pid: int, boot_id: str | None, target: str) -> int:
    """The start time (clock ticks) of the process to spare, which ties the spare to it and
    not to a later process that reuses its PID; refused when it cannot be read, or the boot
    it counts from is unknown, or ``pid`` is a thread (the spare covers a process's PID)."""
    stat = procfs.read_stat(pid)
    if stat is None or boot_id is None:
        raise CliError(
            f"spare {target}: no such process (or its start time cannot be read); "
            "nothing is spared",
            ExitCode.CONFIG,
        )
    process = procfs.thread_group(pid)
    if process != pid:
        said = "which process it belongs to cannot be read (its status)"
        if process is not None:
            said = f"PID {pid} is a thread of process {process}: spare {process}"
        raise CliError(f"spare {target}: {said}; nothing is spared", ExitCode.CONFIG)
    return stat.starttime


def _job_found(procfs: ProcFS, job: str, target: str) -> str:
    """Refuse a job spare when no process of the job can be found now (the daemon could tie
    none to it either); else what the spare will not cover, for the message ("" when the
    job's cgroup ties its processes to it)."""
    processes = procfs.read_processes(procfs.list_pids())
    found = job_processes(job, processes)
    if not found:
        raise CliError(
            f"spare {target}: no process of job {job} found (none in its cgroup, no "
            "slurmstepd of root's serving it): nothing is spared; spare its processes by PID",
            ExitCode.CONFIG,
        )
    if any(p.cgroup is not None and p.cgroup.job_key == job for p in found):
        return ""
    return (
        f"; {len(found)} process(es) found by slurmstepd's process tree, as Slurm's "
        "proctrack/linuxproc tracks them: a process that leaves that tree (its parent died) "
        "is no longer the job's, spare it by PID"
    )


def _list(policy: Policy, procfs: ProcFS, now: float, *, as_json: bool) -> int:
    try:
        with StateDir.open(policy.state_dir) as state_dir:
            clock = BootTime.read(now, procfs.boot_id())
            found = read_spares(state_dir, clock, max_spare=policy.limits.max_spare)
    except FileNotFoundError:
        found = SpareFiles((), ())
    spares, problems = found.spares, found.problems
    if as_json:
        names = ("target", "pid", "start_ticks", "job", "until", "since", "reason", "by_uid")
        rows = [fields_of(s, names) for s in spares]
        print(json.dumps({"spares": rows, "problems": list(problems)}, indent=2))
        return ExitCode.OK
    if not spares:
        print("no spares")
    for s in spares:
        line = f"{s.target}  until {stamp(s.until, zone=True)} ({until(s.until - now)})  {s.reason}"
        print(escape(line))
    for problem in problems:
        print(escape(f"ignored: {problem}"))
    return ExitCode.OK


# --- how scan and explain show the spares in force --------------------------------------------


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
    if process is None:
        return None
    found = spare_covering(process, snapshot)
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
    left = "" if ends is None or now is None else f" ({until(ends - now)})"
    when = "?" if ends is None else stamp(ends) + left
    reason, unknown = as_text(row.get("reason")), as_text(row.get("unknown"))
    text = f"spared until {when} by {_who(row.get('by_uid'))}" + (f": {reason}" if reason else "")
    return text + (f" ({as_text(row.get('target'))}; {unknown})" if unknown else "")


def spared_lines(entries: Sequence[Mapping[str, object]], now: float | None) -> list[str]:
    """One line per spared entry: ``pid 4242 spared until …``, escaped (the reason is text)."""
    return [
        escape(f"pid {entry.get('pid')} {spared_text(as_map(entry.get('spared')), now)}")
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
    own = f"spare: {spare_reason(process, snapshot)}"
    if refused is not None and refused != own:  # targets.refusal's words for the same spare
        stops.append(refused)
    return row, stops
