"""``gpuwatchd spare``: leave one process (by PID and start time, so a reused PID is not
spared) or one job's processes alone for a while; ``--list`` shows them, ``--cancel`` ends one.
The daemon reads them (:mod:`gpuwatchd.state.spares`) at its next poll."""

from __future__ import annotations

import json
import time
from typing import IO

from gpuwatchd.cli.humantime import duration, for_seconds, stamp, until
from gpuwatchd.collect.boottime import BootTime
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.escape import escape
from gpuwatchd.core.model import fields_of
from gpuwatchd.core.vocabulary import ExitCode
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.spares import job_processes
from gpuwatchd.state.directory import StateDir
from gpuwatchd.state.spares import (
    SpareFiles,
    cancel_spare,
    parse_target,
    read_spares,
    write_spare,
)


class SpareError(Exception):
    """A refused ``spare`` (one line, an exit code); nothing was changed."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _length(text: str | None, max_spare: float) -> float:
    if text is None:
        raise SpareError("spare needs --for DURATION (how long to leave it alone)", ExitCode.CONFIG)
    try:
        return for_seconds(text, command="spare", limit="limits.max_spare", maximum=max_spare)
    except (ConfigError, ValueError) as exc:
        raise SpareError(f"{exc}; nothing is spared", ExitCode.CONFIG) from exc


def spare_command(
    policy: Policy,
    *,
    target: str | None,
    for_: str | None,
    reason: str | None,
    cancel: bool,
    listing: bool,
    as_json: bool,
    out: IO[str],
) -> int:
    """Run ``gpuwatchd spare``; raises :class:`SpareError`, ``OSError`` (the state directory)."""
    procfs = ProcFS(policy.proc_root)
    now = time.time()
    if listing or target is None:
        if target is not None or cancel:
            raise SpareError("spare --list takes no target and no --cancel", ExitCode.CONFIG)
        return _list(policy, procfs, now, as_json=as_json, out=out)
    try:
        key, pid, job = parse_target(target)
    except ValueError as exc:
        raise SpareError(f"{exc}; nothing is spared", ExitCode.CONFIG) from exc
    if cancel:
        return _cancel(policy, key, out)
    seconds = _length(for_, policy.limits.max_spare)
    if not reason:
        raise SpareError("spare needs --reason TEXT (it is logged and shown)", ExitCode.CONFIG)
    boot_id = procfs.boot_id()
    caveat = "" if job is None else _job_found(procfs, job, target)
    start_ticks = None if pid is None else _start_ticks(procfs, pid, boot_id, target)
    with StateDir.open(policy.state_dir, create=True) as state_dir:
        write_spare(
            state_dir,
            key,
            clock=BootTime.read(now, boot_id),
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
        file=out,
    )
    return ExitCode.OK


def _cancel(policy: Policy, key: str, out: IO[str]) -> int:
    """``spare --cancel``: the spare of ``key`` ended now, and whether there was one, said."""
    with StateDir.open(policy.state_dir, create=True) as state_dir:
        gone = cancel_spare(state_dir, key)
    print(f"gpuwatchd: {key}: " + ("spare cancelled" if gone else "was not spared"), file=out)
    return ExitCode.OK


def _start_ticks(procfs: ProcFS, pid: int, boot_id: str | None, target: str) -> int:
    """The start time (clock ticks) of the process to spare, which ties the spare to it and
    not to a later process that reuses its PID; refused when it cannot be read, or the boot
    it counts from is unknown."""
    stat = procfs.read_stat(pid)
    if stat is None or boot_id is None:
        raise SpareError(
            f"spare {target}: no such process (or its start time cannot be read); "
            "nothing is spared",
            ExitCode.CONFIG,
        )
    return stat.starttime


def _job_found(procfs: ProcFS, job: str, target: str) -> str:
    """Refuse a job spare when no process of the job can be found now (the daemon could tie
    none to it either); else what the spare will not cover, for the message ("" when the
    job's cgroup ties its processes to it)."""
    processes = procfs.read_processes(procfs.list_pids())
    found = job_processes(job, processes)
    if not found:
        raise SpareError(
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


def _list(policy: Policy, procfs: ProcFS, now: float, *, as_json: bool, out: IO[str]) -> int:
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
        json.dump({"spares": rows, "problems": list(problems)}, out, indent=2)
        out.write("\n")
        return ExitCode.OK
    if not spares:
        print("no spares", file=out)
    for s in spares:
        line = f"{s.target}  until {stamp(s.until, zone=True)} ({until(s.until - now)})  {s.reason}"
        print(escape(line), file=out)
    for problem in problems:
        print(escape(f"ignored: {problem}"), file=out)
    return ExitCode.OK
