"""The floor, and who holds a GPU: one definition for assess, plan, explain and the final scan.

This module owns two questions every layer asks and must answer the same way:

* **Is this process infrastructure?** (:func:`infrastructure`) — init and kthreadd, kernel
  threads, and the NVIDIA and display services, recognised only by facts a user cannot forge
  (docs/design-notes.md, section 10): the *resolved* executable (``/proc/PID/exe``, not comm
  or argv[0]) is owned by root in a root-owned directory that neither group nor others may
  write (``ProcessInfo.exe_trusted``), and the process runs as root or inside a system
  service's cgroup (below ``system.slice``, not delegated to a user, not a container); or it
  runs inside one of the infrastructure's systemd units in such a system cgroup. A user's
  look-alike — a program named ``nvidia-cuda-mps-server``, a process that renamed itself, a
  ``user@…/nvidia-dcgm.service`` of its own — is an ordinary process. Infrastructure is never
  a finding, never a signal target, and does not count as a live holder when plan weighs a
  reset; the reset procedure deals with it (persistence mode off, ``before`` hooks), and its
  final scan still refuses while anything holds the GPU. No configuration lowers this floor.
  A process that *claims* an infrastructure name whose identity cannot be read
  (:func:`unverified_infrastructure`) is never signalled (unknown never leads to a kill) but
  is otherwise an ordinary process: it counts as a holder and grants nothing.
  :func:`mps_server` is the same test for the MPS server, whose presence makes the node
  report-only.
* **Who holds this GPU right now?** (:func:`live_holder` for plan's gate over a poll's
  snapshot, :func:`reset_blockers` for the final scan right before ``nvidia-smi --gpu-reset``,
  :func:`driver_refusers` for the report): any holder of the GPU's device file, a non-floor
  holder of ``nvidiactl``/``nvidia-uvm`` that cannot be attributed to a GPU, and any process
  whose fds or maps could not be read — unknown is not none (docs/design-notes.md, section 7).

Pure: no I/O, no clock, no logging.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from gpuwatchd.decide.policy import FLOOR_PROCESS_NAMES, FLOOR_UNIT_PATTERNS
from gpuwatchd.model import CgroupInfo, HolderScan, ProcessInfo

__all__ = [
    "COMM_LENGTH",
    "MPS_SERVER_NAMES",
    "claims_infrastructure",
    "driver_refusers",
    "infrastructure",
    "is_infrastructure",
    "live_holder",
    "mps_server",
    "reset_blockers",
    "system_cgroup",
    "trusted_identity",
    "unverified_infrastructure",
]

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
    """Whether any of these names (comm, argv[0], the executable's) is an infrastructure name.

    A claim is not an identity: collection reads the executable's ownership only for processes
    that make one (the check costs two ``stat`` calls).
    """
    return any(_name_matches(name, FLOOR_PROCESS_NAMES) for name in names)


def system_cgroup(cgroup: CgroupInfo | None) -> bool | None:
    """Whether ``cgroup`` is a system service's: below ``system.slice`` or ``init.scope``, with
    no user's delegated subtree (``user@UID.service``, ``user.slice``, ``user-UID.slice``) and
    no container or pod on the way. Only root (systemd, a root daemon) can place a process
    there. None when the cgroup is unknown."""
    if cgroup is None:
        return None
    parts = [p for p in cgroup.path.split("/") if p]
    if not parts or parts[0] not in _SYSTEM_ROOTS:
        return False
    if cgroup.container_id is not None or cgroup.pod_uid is not None:
        return False
    return not any(
        part == "user.slice"
        or (part.startswith("user-") and part.endswith(".slice"))
        or (part.startswith("user@") and part.endswith(".service"))
        for part in parts
    )


def trusted_identity(proc: ProcessInfo) -> bool | None:
    """Whether ``proc`` is something only root can have started as it is: a root-owned
    executable in a root-owned directory (``exe_trusted``), run as root (uid 0) or inside a
    system service's cgroup (:func:`system_cgroup`). None when a fact it needs is unknown."""
    if proc.exe_trusted is False:
        return False
    system = system_cgroup(proc.cgroup)
    if proc.uid == 0 or system is True:
        return proc.exe_trusted  # True, or None (unknown)
    if proc.uid is not None and system is False:
        return False
    return None


def _trusted_name(proc: ProcessInfo, names: frozenset[str]) -> str | None:
    """The infrastructure name ``proc`` may be believed to go by, or None.

    The executable's basename counts for any trusted process; the other names (comm, argv[0])
    only for root's: a service account may rename itself, root needs no disguise.
    """
    if trusted_identity(proc) is not True:
        return None
    exe = proc.exe_name
    if exe is not None and exe in names:
        return exe
    if proc.uid == 0:
        for name in sorted(proc.names):
            if _name_matches(name, names):
                return name
    return None


def _system_unit(proc: ProcessInfo) -> str | None:
    """The infrastructure unit whose system cgroup ``proc`` runs in, or None."""
    cgroup = proc.cgroup
    if cgroup is None or system_cgroup(cgroup) is not True:
        return None
    parts = [p for p in cgroup.path.split("/") if p]
    for part in parts:
        for pattern in FLOOR_UNIT_PATTERNS:
            if fnmatch.fnmatchcase(part, pattern):
                return part
    return None


_MEMO = "_floor_infrastructure"  # the answer, kept on the (frozen) ProcessInfo it is about
_MPS_MEMO = "_floor_mps_server"


def infrastructure(proc: ProcessInfo) -> str | None:
    """Why ``proc`` is infrastructure that gpuwatchd never touches, or None.

    By PID (init, kthreadd), kernel-thread flag, a trusted identity that goes by an
    infrastructure name (see the module docstring), or an infrastructure systemd unit in a
    system cgroup (``/system.slice/nvidia-dcgm.service`` and friends).

    The answer depends on ``proc``'s fields alone, and a ``ProcessInfo`` is frozen: it is
    computed once per object (as ``model``'s cached properties are) — the collector hands back
    the same object while a process's facts are unchanged, so a steady poll asks it once.
    """
    memo = proc.__dict__
    if _MEMO in memo:
        answer: str | None = memo[_MEMO]
        return answer
    answer = _infrastructure(proc)
    memo[_MEMO] = answer
    return answer


def _infrastructure(proc: ProcessInfo) -> str | None:
    if proc.pid <= 2:
        return f"pid {proc.pid} is init or kthreadd"
    if proc.kernel_thread:
        return "kernel thread"
    name = _trusted_name(proc, FLOOR_PROCESS_NAMES)
    if name is not None:
        return f"infrastructure process {name} (root-owned {proc.exe})"
    unit = _system_unit(proc)
    if unit is not None:
        return f"infrastructure unit {unit}"
    return None


def is_infrastructure(proc: ProcessInfo) -> bool:
    """:func:`infrastructure` as a predicate."""
    return infrastructure(proc) is not None


def unverified_infrastructure(proc: ProcessInfo) -> str | None:
    """Why ``proc`` may not be signalled although it is not known infrastructure: it goes by an
    infrastructure name and its identity cannot be read (no executable link, its owner
    unknown). None for infrastructure itself and for a look-alike known to be one."""
    if is_infrastructure(proc) or not claims_infrastructure(proc.names):
        return None
    if trusted_identity(proc) is not None:
        return None
    claimed = sorted(n for n in proc.names if _name_matches(n, FLOOR_PROCESS_NAMES))
    return f"goes by {claimed[0]!r}, but whether it is that program cannot be read"


def mps_server(proc: ProcessInfo) -> bool:
    """Whether ``proc`` is a trusted MPS control daemon or server (see the module docstring).
    A user's process of that name, or one whose identity cannot be read, is not. Computed once
    per ``ProcessInfo`` object, as :func:`infrastructure` is."""
    memo = proc.__dict__
    if _MPS_MEMO in memo:
        known: bool = memo[_MPS_MEMO]
        return known
    answer = _trusted_name(proc, MPS_SERVER_NAMES) is not None
    memo[_MPS_MEMO] = answer
    return answer


def live_holder(
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    minor: int | None,
    self_pids: frozenset[int],
) -> str | None:
    """Why GPU ``minor`` has a live holder in this snapshot (plan's reset gate), or None.

    Infrastructure does not count (the reset procedure turns persistence off and runs the
    ``before`` hooks that stop it); an unknown minor, unreadable fds/maps or a holder whose
    process is unknown do.
    """
    if minor is None:
        return "GPU minor number unknown, holders cannot be checked"
    if holders.unreadable - self_pids:
        return f"fds/maps of {len(holders.unreadable - self_pids)} process(es) unreadable"
    for holding in holders.holders_of(minor):
        if holding.pid in self_pids:
            continue
        proc = processes.get(holding.pid)
        if proc is None:
            return f"pid {holding.pid} holds the GPU (process unknown)"
        if is_infrastructure(proc):
            continue
        return f"pid {holding.pid} holds the GPU"
    return None


def reset_blockers(
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    minor: int | None,
    self_pids: frozenset[int],
) -> list[str]:
    """Why GPU ``minor`` may not be reset now, from a fresh full holder scan (the final scan).

    Blocks: any holder of the GPU's node other than ourselves, infrastructure included (by now
    the procedure has turned persistence off and run the ``before`` hooks, so whatever still
    holds the GPU would make the reset fail or hang: these are the holders the driver itself
    refuses, see :func:`driver_refusers`); a non-floor holder of nvidiactl or nvidia-uvm
    without any per-GPU node (it cannot be attributed to a GPU: gpuwatchd's caution, not the
    driver's); any process whose fds or maps could not be read (unknown is not none). A floor
    process holding only nvidiactl or nvidia-uvm does not block: nvidia-persistenced keeps
    nvidiactl open after persistence mode is turned off, and the driver refuses a reset only
    while the GPU's own node is open. A holder of *other* GPUs only does not block either:
    resetting one GPU while others keep working is the point.
    """
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
    """The PIDs whose open ``/dev/nvidiaN`` would make the driver refuse a reset of GPU ``minor``.

    Without device isolation (``CUDA_VISIBLE_DEVICES``, a cgroup device rule, a container's
    device list) every CUDA process opens every GPU, so a job working on GPU 1 holds GPU 0's
    node too and blocks GPU 0's reset. Infrastructure is included: the reset procedure must
    stop it first. None when the minor, or some process's fds, could not be read.
    """
    if minor is None or holders.unreadable - self_pids:
        return None
    return sorted(h.pid for h in holders.holders_of(minor) if h.pid not in self_pids)
