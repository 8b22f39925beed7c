"""Which jobs have ended: the evidence behind the ``abandoned`` finding (docs/architecture.md).

This module owns *reading* a scheduler's own bookkeeping from cgroupfs to tell whether a job is
over while some of its processes live on. What a cgroup path means (which part is the job) is
:mod:`gpuwatchd.collect.cgroups`' pure parsing; this module only does the I/O around it. It
decides nothing about processes; ``assess`` does.

Judged today: **Slurm on cgroup v2**. Slurm places each step's ``slurmstepd`` in
``…/slurmstepd.scope/job_<ID>/step_<S>/slurm`` and the user's tasks beside it in
``…/step_<S>/user/task_<N>``. While any step of the job has a live ``slurmstepd``, the job is
running; when none has one, Slurm is done with the job and whatever still sits in its task
cgroups is left behind. Every other kind of job (Slurm on cgroup v1, pods, containers, systemd
units) is never judged ended here: their runtimes either kill stragglers themselves (a
container's processes die with its PID namespace) or keep the job's state where a daemon
cannot read it cheaply, and unknown never triggers an action.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from gpuwatchd.collect.cgroups import parse_cgroup2_mount, slurm_job_dir
from gpuwatchd.model import ProcessInfo

_MOUNTINFO_LIMIT = 4 * 1024 * 1024  # far above any real mount table; bounds a hostile one

# The scheduler's word (``run --once --ended-job KIND:ID``): job keys as ``CgroupInfo.job_key``
# spells them, and the environment variable an epilog finds its job's id in.
_ENDED_JOB_ID = {
    "slurm": re.compile(r"[0-9]{1,20}"),
    "pod": re.compile(r"[0-9a-fA-F_-]{1,64}"),
    "container": re.compile(r"[0-9a-zA-Z]{1,128}"),
    "unit": re.compile(r"[A-Za-z0-9:_.@\\-]{1,255}\.(?:service|scope)"),
}
_ENDED_JOB_ENV = {"slurm": "SLURM_JOB_ID"}


def scheduler_ended_job(spec: str, environ: Mapping[str, str]) -> str:
    """The job key named by ``--ended-job``: ``slurm:42``, ``pod:UID``, ``container:ID``,
    ``unit:NAME.service``; a bare ``slurm`` reads ``SLURM_JOB_ID`` from ``environ`` (an epilog's
    environment). Raises ValueError with a message naming the value. Pure.
    """
    kind, sep, ident = spec.partition(":")
    if kind not in _ENDED_JOB_ID:
        raise ValueError(
            f"--ended-job {spec!r}: expected KIND:ID with KIND one of "
            f"{', '.join(_ENDED_JOB_ID)} (e.g. slurm:42), or a bare slurm to read SLURM_JOB_ID"
        )
    if not sep:
        variable = _ENDED_JOB_ENV.get(kind)
        if variable is None:
            raise ValueError(f"--ended-job {spec!r}: {kind} needs an id ({kind}:ID)")
        ident = environ.get(variable, "")
        if not ident:
            raise ValueError(f"--ended-job {spec!r}: {variable} is not set in the environment")
        source = f" (from {variable}={ident[:40]!r})"
    else:
        source = ""
    if _ENDED_JOB_ID[kind].fullmatch(ident) is None:
        raise ValueError(f"--ended-job {spec!r}{source}: {ident[:40]!r} is not a valid {kind} id")
    return f"{kind}:{ident}"


def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Where the unified (v2) cgroup hierarchy is mounted, or None without one (or unreadable)."""
    try:
        with open(mountinfo, "rb") as handle:
            raw = handle.read(_MOUNTINFO_LIMIT)
    except OSError:
        return None
    return parse_cgroup2_mount(os.fsdecode(raw))


def slurm_job_ended(job_dir: str) -> bool | None:
    """True when no step of the Slurm job at ``job_dir`` has a live slurmstepd.

    None (unknown) when the job's cgroup cannot be read or has no step at all: a job that is
    only starting has no step yet, and a missing directory is not proof of anything.
    """
    try:
        steps = [entry.path for entry in os.scandir(job_dir) if entry.name.startswith("step_")]
    except OSError:
        return None
    if not steps:
        return None
    for step in steps:
        try:
            with open(os.path.join(step, "slurm", "cgroup.procs"), encoding="ascii") as handle:
                if handle.read().strip():
                    return False
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return True


def ended_jobs(processes: Iterable[ProcessInfo], cgroup_root: str | None) -> frozenset[str]:
    """Job keys (``CgroupInfo.job_key``) of these processes whose job is known to have ended."""
    if cgroup_root is None:
        return frozenset()
    ended: set[str] = set()
    judged: set[str] = set()
    for proc in processes:
        cgroup = proc.cgroup
        if cgroup is None or cgroup.slurm_job is None:
            continue
        job_dir = slurm_job_dir(cgroup.path)
        if job_dir is None or not job_dir.endswith(f"/job_{cgroup.slurm_job}"):
            continue
        key = f"slurm:{cgroup.slurm_job}"
        if key in judged:
            continue
        judged.add(key)
        if slurm_job_ended(cgroup_root.rstrip("/") + job_dir):
            ended.add(key)
    return frozenset(ended)
