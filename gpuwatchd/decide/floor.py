"""The floor, and who holds a GPU: one definition for assess, plan, explain and the final scan.

This module owns two questions every layer asks and must answer the same way:

* **Is this process infrastructure?** (:func:`infrastructure`) — init and kthreadd, kernel
  threads, the NVIDIA and display services by name (``comm`` — which the kernel cuts to 15
  characters — the executable's and argv[0]'s basenames) or by systemd unit / cgroup path
  component. Infrastructure is never a finding, never a signal target, and does not count as a
  live holder when plan weighs a reset; the reset procedure itself deals with it (persistence
  mode off, ``before`` hooks), and its final scan still refuses while anything holds the GPU.
  No configuration lowers this floor (docs/design-notes.md, section 10).
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
from gpuwatchd.model import HolderScan, ProcessInfo

__all__ = [
    "COMM_LENGTH",
    "driver_refusers",
    "infrastructure",
    "is_infrastructure",
    "live_holder",
    "reset_blockers",
]

COMM_LENGTH = 15  # the kernel cuts comm to 15 characters


def _floor_name(name: str) -> bool:
    if name in FLOOR_PROCESS_NAMES:
        return True
    # "nvidia-persiste" is the kernel's cut of "nvidia-persistenced".
    return len(name) == COMM_LENGTH and any(f.startswith(name) for f in FLOOR_PROCESS_NAMES)


def _unit_parts(proc: ProcessInfo) -> Iterable[str]:
    cgroup = proc.cgroup
    if cgroup is None:
        return ()
    parts = [p for p in cgroup.path.split("/") if p]
    if cgroup.systemd_unit is not None:
        parts.append(cgroup.systemd_unit)
    return parts


def infrastructure(proc: ProcessInfo) -> str | None:
    """Why ``proc`` is infrastructure that gpuwatchd never touches, or None.

    By PID (init, kthreadd), kernel-thread flag, name (comm, exe and argv[0] basenames; a
    15-character comm matches the longer name it is the kernel's cut of) or systemd unit /
    cgroup path component (``nvidia-dcgm.service`` and friends).
    """
    if proc.pid <= 2:
        return f"pid {proc.pid} is init or kthreadd"
    if proc.kernel_thread:
        return "kernel thread"
    for name in sorted(proc.names):
        if _floor_name(name):
            return f"infrastructure process {name}"
    for part in _unit_parts(proc):
        for pattern in FLOOR_UNIT_PATTERNS:
            if fnmatch.fnmatchcase(part, pattern):
                return f"infrastructure unit {part}"
    return None


def is_infrastructure(proc: ProcessInfo) -> bool:
    """:func:`infrastructure` as a predicate."""
    return infrastructure(proc) is not None


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
