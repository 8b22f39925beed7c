"""The floor, and who holds a GPU: one definition for assess, plan, explain and the final scan.

In detail: docs/internals.md, section `gpuwatchd.decide.floor`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from gpuwatchd.core.model import CgroupInfo, HolderScan, ProcessInfo
from gpuwatchd.core.paths import NVML_LAUNCHER_FILE, NVML_WORKER_FILE
from gpuwatchd.decide.policy import FLOOR_NAME_UNITS, FLOOR_PROCESS_NAMES, FLOOR_UNIT_PATTERNS

COMM_LENGTH = 15  # the kernel cuts comm to 15 characters
MPS_SERVER_NAMES = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})
# Where systemd's system manager puts system services; nothing below them is a user's.
_SYSTEM_ROOTS = ("system.slice", "init.scope")


def _name_matches(name: str, names: frozenset[str]) -> bool:
    if name in names:
        return True
    # "nvidia-persiste" is the kernel's cut of "nvidia-persistenced".
    return len(name) == COMM_LENGTH and any(f.startswith(name) for f in names)


def claims_infrastructure(names: Iterable[str]) -> bool:
    """Whether any of these names (comm, argv[0], the executable's) is an infrastructure name:
    a claim, not an identity (collection reads the executable's ownership only for these)."""
    return any(_name_matches(name, FLOOR_PROCESS_NAMES) for name in names)


def _users_part(part: str) -> bool:
    """A user's subtree or a Slurm job's scope: what a user's work is placed in."""
    return (
        part in ("user.slice", "slurmstepd.scope")
        or part.endswith("_slurmstepd.scope")
        or (part.startswith("user-") and part.endswith(".slice"))
        or (part.startswith("user@") and part.endswith(".service"))
    )


def system_cgroup(cgroup: CgroupInfo | None) -> bool | None:
    """Whether only root places processes in ``cgroup`` (docs/internals.md says when). None
    when the cgroup or its delegation mark is unknown."""
    if cgroup is None:
        return None
    parts = [p for p in cgroup.path.split("/") if p]
    if not parts or parts[0] not in _SYSTEM_ROOTS or any(_users_part(p) for p in parts):
        return False
    if any(v is not None for v in (cgroup.container_id, cgroup.pod_uid, cgroup.slurm_job)):
        return False
    if cgroup.delegated is None:
        return None
    return not cgroup.delegated


def _top_unit(cgroup: CgroupInfo) -> str | None:
    """The unit systemd started for ``cgroup``: its first part after the slices. A name below
    it is the unit's own sub-cgroup, named by whoever runs in it, never systemd's word."""
    part = next((p for p in cgroup.path.split("/") if p and not p.endswith(".slice")), "")
    return part if part.endswith((".service", ".scope")) else None


def _in_unit(cgroup: CgroupInfo | None, patterns: Iterable[str]) -> bool | None:
    """Whether ``cgroup`` is (below) a unit matching ``patterns`` that only root places
    processes in (:func:`system_cgroup`). None when it names such a unit and whether root
    alone places processes there is unknown, or when the cgroup is unknown."""
    if cgroup is None:
        return None
    unit = _top_unit(cgroup)
    if unit is None or not any(fnmatch.fnmatchcase(unit, p) for p in patterns):
        return False
    return system_cgroup(cgroup)


_FLOOR_UNITS = (*FLOOR_UNIT_PATTERNS, *(p for units in FLOOR_NAME_UNITS.values() for p in units))


def names_infrastructure_unit(cgroup: CgroupInfo) -> bool:
    """Whether ``cgroup``'s unit is an infrastructure unit, or an infrastructure program's own:
    then the floor's answer depends on the cgroup's delegation mark, which collection reads
    for these few (``CgroupInfo.delegated``)."""
    return _in_unit(cgroup, _FLOOR_UNITS) is not False


def trusted_identity(proc: ProcessInfo) -> bool | None:
    """Whether ``proc`` may be believed to be the infrastructure program it runs ("By name" in
    docs/internals.md). None when a fact it needs is unknown."""
    if proc.exe_trusted is False:
        return False
    if proc.uid == 0:
        return proc.exe_trusted  # True, or None (unknown)
    own = _in_unit(proc.cgroup, FLOOR_NAME_UNITS.get(proc.exe_name or "", ()))
    if own is True:
        return proc.exe_trusted
    if proc.uid is not None and own is False:
        return False
    return None


def _trusted_name(proc: ProcessInfo, names: frozenset[str]) -> str | None:
    """The infrastructure name ``proc`` may be believed to go by, or None: the executable's
    for any trusted process, comm and argv[0] only for root's (root needs no disguise)."""
    if trusted_identity(proc) is not True:
        return None
    exe = proc.exe_name
    if exe is not None and exe in names:
        return exe
    if proc.uid != 0:
        return None
    return next((name for name in sorted(proc.names) if _name_matches(name, names)), None)


def _system_unit(proc: ProcessInfo) -> str | None:
    """The infrastructure unit ``proc`` runs in as root, placed there by root, or None ("By
    unit" in docs/internals.md)."""
    cgroup = proc.cgroup
    if proc.uid != 0 or cgroup is None or _in_unit(cgroup, FLOOR_UNIT_PATTERNS) is not True:
        return None
    return _top_unit(cgroup)


_MEMO = "_floor_infrastructure"  # the answer, kept on the (frozen) ProcessInfo it is about
_MPS_MEMO = "_floor_mps_server"
_T = TypeVar("_T")


def _memo(proc: ProcessInfo, key: str, answer: Callable[[ProcessInfo], _T]) -> _T:
    """``answer(proc)``, computed once per (frozen) ``ProcessInfo`` and kept on it under
    ``key``: the collector hands back the same object while nothing changed."""
    memo = proc.__dict__
    if key not in memo:
        memo[key] = answer(proc)
    found: _T = memo[key]
    return found


def infrastructure(proc: ProcessInfo) -> str | None:
    """Why ``proc`` is infrastructure that gpuwatchd never touches, or None (kept: _memo)."""
    return _memo(proc, _MEMO, _infrastructure)


def _infrastructure(proc: ProcessInfo) -> str | None:
    if proc.pid <= 2:
        return f"pid {proc.pid} is init or kthreadd"
    if proc.kernel_thread:
        return "kernel thread"
    if (name := _trusted_name(proc, FLOOR_PROCESS_NAMES)) is not None:
        return f"infrastructure process {name} (root-owned {proc.exe})"
    if (unit := _system_unit(proc)) is not None:
        return f"infrastructure unit {unit}"
    if gpuwatchd_worker(proc):
        return "the NVML worker of a gpuwatchd command run as root"
    return None


def gpuwatchd_worker(proc: ProcessInfo) -> bool:
    """Whether ``proc`` is the NVML worker of a gpuwatchd command run as root (``check-clean``,
    ``run --once``, ``scan``): uid 0, started from this installation's files. Otherwise each
    such command would be a hidden holder to the daemon while it ran."""
    cmdline = proc.cmdline
    return (
        proc.uid == 0
        and cmdline is not None
        and tuple(cmdline[1:4]) == ("-I", NVML_LAUNCHER_FILE, NVML_WORKER_FILE)
    )


def is_infrastructure(proc: ProcessInfo) -> bool:
    return infrastructure(proc) is not None


def unverified_infrastructure(proc: ProcessInfo) -> str | None:
    """Why ``proc`` may not be signalled although it is not known infrastructure: it claims an
    infrastructure name or unit, and whether that is true cannot be read. None otherwise."""
    if is_infrastructure(proc):
        return None
    claimed = sorted(n for n in proc.names if _name_matches(n, FLOOR_PROCESS_NAMES))
    if claimed and trusted_identity(proc) is None:
        return f"goes by {claimed[0]!r}, but whether it is that program cannot be read"
    cgroup = proc.cgroup
    placed = None if cgroup is None else _in_unit(cgroup, FLOOR_UNIT_PATTERNS)
    # Root's process in root's unit is infrastructure: unknown owner or placement is neither.
    if cgroup is not None and proc.uid in (0, None) and placed is not False:
        return (
            f"runs in {_top_unit(cgroup)}, but whether as root, placed there by root, "
            "cannot be read"
        )
    return None


def mps_server(proc: ProcessInfo) -> bool:
    """Whether ``proc`` is a trusted MPS control daemon or server (a user's, or one whose
    identity cannot be read, is not). Computed once per ``ProcessInfo``."""
    return _memo(proc, _MPS_MEMO, lambda p: _trusted_name(p, MPS_SERVER_NAMES) is not None)


def live_holder(
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    minor: int | None,
    self_pids: frozenset[int],
) -> str | None:
    """Why GPU ``minor`` has a live holder (infrastructure aside) or an unknown one, or None."""
    if minor is None:
        return "GPU minor number unknown, holders cannot be checked"
    if unreadable := holders.unreadable - self_pids:
        return f"fds/maps of {len(unreadable)} process(es) unreadable"
    for holding in holders.holders_of(minor):
        proc = processes.get(holding.pid)
        if holding.pid in self_pids or (proc is not None and is_infrastructure(proc)):
            continue
        return f"pid {holding.pid} holds the GPU" + (" (process unknown)" if proc is None else "")
    return None


def reset_blockers(
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    minor: int | None,
    self_pids: frozenset[int],
) -> list[str]:
    """Why GPU ``minor`` may not be reset now, from a fresh full holder scan (the final scan;
    docs/internals.md says who blocks it)."""
    if minor is None:
        return ["GPU minor number unknown: cannot tell who holds its device file"]
    reasons: list[str] = []
    for pid, holding in sorted(holders.holdings.items()):
        if pid in self_pids:
            continue
        proc = processes.get(pid)
        name = proc.comm if proc and proc.comm else "?"
        if minor in holding.gpu_minors:
            via = "+".join(holding.via(minor))
            reasons.append(f"pid {pid} ({name}) holds the GPU's device file via {via}")
        elif not holding.gpu_minors and (holding.ctl or holding.uvm):
            if proc is not None and is_infrastructure(proc):
                continue  # persistenced keeps nvidiactl open; it does not hold this GPU
            reasons.append(
                f"pid {pid} ({name}) holds nvidiactl/nvidia-uvm without a GPU node "
                "(cannot be attributed)"
            )
    reasons.extend(
        f"pid {pid}: fds/maps unreadable (unknown is not none)"
        for pid in sorted(holders.unreadable)
        if pid not in self_pids
    )
    return reasons


def driver_refusers(
    holders: HolderScan, minor: int | None, self_pids: frozenset[int]
) -> list[int] | None:
    """The PIDs whose open ``/dev/nvidiaN`` would make the driver refuse a reset of GPU ``minor``,
    infrastructure included; None when the minor, or some process's fds, could not be read."""
    if minor is None or holders.unreadable - self_pids:
        return None
    return sorted(h.pid for h in holders.holders_of(minor) if h.pid not in self_pids)
