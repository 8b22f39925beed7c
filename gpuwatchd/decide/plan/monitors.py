"""Monitors: NVML-only clients, which block a reset but never hide ghost memory.

In detail: docs/internals.md, section `gpuwatchd.decide.plan.monitors`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from gpuwatchd.core.model import HolderScan, ProcessIdentity, ProcessInfo, Snapshot
from gpuwatchd.decide.floor import is_infrastructure, system_cgroup, unverified_infrastructure
from gpuwatchd.decide.patterns import command_search
from gpuwatchd.decide.policy import Monitor, Policy
from gpuwatchd.decide.spares import spare_reason
from gpuwatchd.decide.targets import protect_refusal

MAX_MONITORS = 16  # reset.monitors: more on one GPU node is a mistake
# A unit entry's name: a system service, handed to ``systemctl stop`` as one argument (never
# an option: it starts with a letter, digit or underscore).
UNIT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9:_.\\@-]{0,246}\.service")


@dataclass(frozen=True)
class StoppableMonitor:
    """One holder of the GPU that the reset procedure may stop: who, and by which entry."""

    identity: ProcessIdentity
    entry: Monitor
    who: str  # :func:`describe_monitor`'s words


def monitor_entry(proc: ProcessInfo, monitors: Sequence[Monitor]) -> Monitor | None:
    """The first ``reset.monitors`` entry that names ``proc``, or None (docs/internals.md)."""
    cgroup = proc.cgroup
    if cgroup is None or cgroup.slurm_job is not None:
        return None
    for entry in monitors:
        if entry.unit is not None:
            if cgroup.systemd_unit == entry.unit and system_cgroup(cgroup) is True:
                return entry
        elif (
            entry.command is not None
            and proc.cmdline is not None
            and command_search(entry.command, " ".join(proc.cmdline)) is True
        ):
            return entry
    return None


def describe_monitor(pid: int, proc: ProcessInfo | None) -> str:
    """``pid 4100 (gpustat, unit gpustat.service)``: what a reset refusal names."""
    name = proc.comm if proc is not None and proc.comm else "?"
    unit = proc.cgroup.systemd_unit if proc is not None and proc.cgroup is not None else None
    return f"pid {pid} ({name}{f', unit {unit}' if unit else ''})"


def monitors_to_stop(
    holders: HolderScan,
    processes: Mapping[int, ProcessInfo],
    minor: int | None,
    *,
    self_pids: frozenset[int],
    context_owners: Collection[int],
    monitors: Sequence[Monitor],
    last: Snapshot,
    policy: Policy,
) -> list[StoppableMonitor]:
    """The holders of GPU ``minor`` in a fresh scan that the reset procedure stops (which:
    docs/internals.md); anything else is left for the final scan. Never one a kill target
    would be refused for by the floor, a spare (``last`` poll's) or ``protect``."""
    found: list[StoppableMonitor] = []
    if minor is None or not monitors:
        return found
    fresh = replace(last, holders=holders, processes=processes)
    for holding in holders.holders_of(minor):
        pid = holding.pid
        proc = processes.get(pid)
        if pid in self_pids or holding.uvm or pid in context_owners or proc is None:
            continue
        if proc.identity is None or proc.is_zombie or proc.is_uninterruptible:
            continue
        if is_infrastructure(proc) or unverified_infrastructure(proc) is not None:
            continue
        if spare_reason(proc, fresh) is not None or protect_refusal(proc, policy) is not None:
            continue
        entry = monitor_entry(proc, monitors)
        if entry is not None:
            found.append(StoppableMonitor(proc.identity, entry, describe_monitor(pid, proc)))
    return sorted(found, key=lambda m: m.identity.pid)
