"""Which jobs have ended: the evidence behind the ``abandoned`` finding, read from cgroupfs.

This module reads a scheduler's own bookkeeping (what a cgroup path means is
:mod:`gpuwatchd.collect.cgroups`'); it decides nothing. In detail: docs/internals.md,
section `gpuwatchd.collect.jobs`.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.collect.cgroups import parse_cgroup2_mount
from gpuwatchd.collect.procfs import root_only
from gpuwatchd.collect.statfiles import read_proc_file
from gpuwatchd.core.model import ProcessInfo

_MOUNTINFO_LIMIT = 4 * 1024 * 1024  # far above any real mount table; bounds a hostile one

# ``run --once --ended-job KIND:ID``: the job keys (as ``CgroupInfo.job_key``) and the
# environment variable an epilog finds its job's id in.
_ENDED_JOB_ID = {
    "slurm": re.compile(r"[0-9]{1,20}"),
    "pod": re.compile(r"[0-9a-fA-F_-]{1,64}"),
    "container": re.compile(r"[0-9a-zA-Z]{1,128}"),
    "unit": re.compile(r"[A-Za-z0-9:_.@\\-]{1,255}\.(?:service|scope)"),
}
_ENDED_JOB_ENV = {"slurm": "SLURM_JOB_ID"}


def scheduler_ended_job(spec: str, environ: Mapping[str, str]) -> str:
    """The job key named by ``--ended-job`` (``slurm:42``, ``pod:UID``, ``container:ID``,
    ``unit:NAME.service``, or a bare ``slurm`` with ``SLURM_JOB_ID`` in ``environ``); ValueError
    naming the value otherwise. Pure."""
    kind, sep, ident = spec.partition(":")
    source = ""
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
    if _ENDED_JOB_ID[kind].fullmatch(ident) is None:
        raise ValueError(f"--ended-job {spec!r}{source}: {ident[:40]!r} is not a valid {kind} id")
    return f"{kind}:{ident}"


def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    try:
        return parse_cgroup2_mount(os.fsdecode(read_proc_file(mountinfo, _MOUNTINFO_LIMIT)))
    except OSError:
        return None


_MAX_STEPD_PIDS = 64  # processes of a step's slurm cgroup looked at; slurmstepd is one
_PROCS_LIMIT = 64 * 1024
_DELEGATED = re.compile(r"user\.slice|user-\d+\.slice|user@\d+\.service")

# (pid) -> (start ticks, whether it is root's trusted program: True, False or None = unknown)
StepdIdentity = Callable[[int], "tuple[int | None, bool | None] | None"]


def boot_ticks_now() -> int:
    """Now, in the unit of ``/proc/PID/stat``'s start time: clock ticks since boot."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class JobEvidence:
    """``ended_dirs``: job cgroup directories (as ``/proc/PID/cgroup`` spells them) judged
    ended; ``stepds``: job key -> start ticks of the youngest live ``slurmstepd`` serving it
    in a trusted directory (one not known to be anything else)."""

    ended_dirs: frozenset[str] = frozenset()
    stepds: Mapping[str, int] = field(default_factory=dict)


def trusted_job_dir(cgroup_root: str, job_dir: str) -> bool:
    """Whether ``job_dir`` (a cgroup path) is where the scheduler, as root, made it (the rule:
    docs/internals.md, `gpuwatchd.collect.jobs`); no symlink on the way either."""
    parts = [p for p in job_dir.split("/") if p]
    if not parts or any(_DELEGATED.fullmatch(p) for p in parts):
        return False
    path = cgroup_root.rstrip("/")
    for part in parts:
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not (stat.S_ISDIR(st.st_mode) and root_only(st)):
            return False
    return True


def _step_procs(job_path: str) -> list[int] | None:
    """The PIDs in the job's steps' ``slurm`` cgroups; None when the job has no step or its
    directory cannot be read (a job only starting has no step yet: unknown, not ended)."""
    try:
        steps = [entry.path for entry in os.scandir(job_path) if entry.name.startswith("step_")]
    except OSError:
        return None
    if not steps:
        return None
    pids: list[int] = []
    for step in steps:
        try:
            with open(os.path.join(step, "slurm", "cgroup.procs"), "rb") as handle:
                text = handle.read(_PROCS_LIMIT).decode("ascii", "replace")
        except FileNotFoundError:
            continue
        except OSError:
            return None
        pids.extend(int(n) for n in text.split()[:_MAX_STEPD_PIDS] if n.isdigit())
    return pids


def judge_jobs(
    processes: Iterable[ProcessInfo],
    cgroup_root: str | None,
    identify: StepdIdentity,
) -> JobEvidence:
    """The job directories of these processes that have ended, and the jobs' live stepds;
    ``identify``: a PID's start ticks and whether it runs root's trusted program."""
    if cgroup_root is None:
        return JobEvidence()
    candidates: dict[str, str] = {}  # ended-looking job dir -> job key
    served: set[str] = set()  # job keys with a live slurmstepd in a trusted directory
    stepds: dict[str, int] = {}
    judged: set[str] = set()
    for proc in processes:
        cgroup = proc.cgroup
        if cgroup is None or cgroup.slurm_job is None:
            continue
        job_dir = cgroup.slurm_job_dir
        if job_dir is None or not job_dir.endswith(f"/job_{cgroup.slurm_job}") or job_dir in judged:
            continue
        judged.add(job_dir)
        if not trusted_job_dir(cgroup_root, job_dir):
            continue  # a directory a user could have made: it says nothing
        key = f"slurm:{cgroup.slurm_job}"
        pids = _step_procs(cgroup_root.rstrip("/") + job_dir)
        if pids is None:
            continue
        for pid in pids:
            known = identify(pid)
            if known is None:
                continue  # gone since the listing
            ticks, trusted = known
            if trusted is False:
                continue  # root's directory, but not root's program: not a slurmstepd
            served.add(key)
            if ticks is not None:
                stepds[key] = max(stepds.get(key, ticks), ticks)
        if not pids:
            candidates[job_dir] = key
    ended = frozenset(d for d, key in candidates.items() if key not in served)
    return JobEvidence(ended_dirs=ended, stepds=stepds)
