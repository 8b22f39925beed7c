"""The host as one snapshot shows it, indexed for the assessment (:class:`HostView`: the
daemon's own processes removed, impossible PIDs NVML lists set aside), and :func:`relation`,
whether two processes belong together. Pure; it decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.core.model import DeviceHolding, GpuInfo, NvmlProcess, ProcessInfo, Snapshot
from gpuwatchd.decide.floor import is_infrastructure


@dataclass(frozen=True)
class Listing:
    """One PID an NVML process list named on one GPU, and what /proc says about it."""

    entry: NvmlProcess
    status: str  # "dead", "zombie" or "alive" (invalid PIDs never become listings)
    proc: ProcessInfo | None


class HostView:
    """Indexes over one snapshot with the daemon's own processes removed."""

    def __init__(self, snapshot: Snapshot) -> None:
        own = snapshot.self_pids
        self.snapshot = snapshot
        self.gpus = tuple(sorted(snapshot.nvml.gpus, key=lambda g: g.index))
        self.procs = {pid: p for pid, p in snapshot.processes.items() if pid not in own}
        self.holdings = {
            pid: h
            for pid, h in snapshot.holders.holdings.items()
            if pid not in own and (h.gpu_minors or h.ctl or h.uvm)
        }
        self.unreadable = frozenset(snapshot.holders.unreadable - own)
        self.full_scan = snapshot.holders.mode == "full"
        self._by_minor: dict[int, list[DeviceHolding]] | None = None
        self._floor: dict[int, bool] = {}
        self.invalid: list[tuple[str, int]] = []
        self.listings: dict[str, list[Listing]] = {}
        for gpu in self.gpus:
            seen: set[int] = set()
            rows: list[Listing] = []
            for entry in gpu.processes or ():
                if entry.pid in own or entry.pid in seen:
                    continue
                seen.add(entry.pid)
                if entry.pid <= 0 or entry.pid > snapshot.pid_max:
                    self.invalid.append((gpu.uuid, entry.pid))
                    continue
                proc = self.procs.get(entry.pid)
                status = "dead" if proc is None else "zombie" if proc.is_zombie else "alive"
                rows.append(Listing(entry, status, proc))
            self.listings[gpu.uuid] = rows
        # Every PID NVML lists alive on some GPU (a listed zombie that still holds device files
        # has live threads): they own a context somewhere, and are never orphans.
        self.listed_alive: dict[int, ProcessInfo] = {
            row.proc.pid: row.proc
            for rows in self.listings.values()
            for row in rows
            if row.proc is not None and (row.status == "alive" or self.holds_anything(row.proc.pid))
        }
        self.listed_dead = frozenset(
            row.entry.pid for rows in self.listings.values() for row in rows if row.status == "dead"
        )

    def holds_anything(self, pid: int) -> bool:
        holding = self.holdings.get(pid)
        return holding is not None and bool(holding.gpu_minors)

    def holds_gpu(self, pid: int, gpu: GpuInfo) -> bool | None:
        """Whether ``pid`` holds ``gpu``'s device file; None when that cannot be known."""
        if gpu.minor is None:
            return None
        holding = self.holdings.get(pid)
        if holding is not None and gpu.minor in holding.gpu_minors:
            return True
        return None if pid in self.unreadable else False

    def holders_of(self, gpu: GpuInfo) -> list[DeviceHolding]:
        if gpu.minor is None:
            return []
        if self._by_minor is None:  # indexed once per snapshot, asked for per GPU many times
            index: dict[int, list[DeviceHolding]] = {}
            for _pid, holding in sorted(self.holdings.items()):
                for minor in holding.gpu_minors:
                    index.setdefault(minor, []).append(holding)
            self._by_minor = index
        return list(self._by_minor.get(gpu.minor, ()))

    def is_floor(self, pid: int) -> bool:
        if pid not in self._floor:
            proc = self.procs.get(pid)
            self._floor[pid] = proc is not None and is_infrastructure(proc)
        return self._floor[pid]

    def unreadable_suspects(self) -> list[int]:
        """Unreadable processes that might hold anything (infrastructure excluded)."""
        return sorted(pid for pid in self.unreadable if not self.is_floor(pid))

    def ancestors(self, proc: ProcessInfo) -> tuple[frozenset[int], bool]:
        """The PIDs above ``proc`` via ppid, and whether the chain is complete up to init."""
        found: set[int] = set()
        current = proc.ppid
        while True:
            if current is None:
                return frozenset(found), False
            if current <= 2:
                return frozenset(found), True
            if current in found or current == proc.pid:
                return frozenset(found), False  # a cycle: the data is inconsistent
            found.add(current)
            parent = self.procs.get(current)
            if parent is None:
                return frozenset(found), False
            current = parent.ppid


def relation(host: HostView, a: ProcessInfo, b: ProcessInfo) -> tuple[bool | None, str]:
    """Whether ``a`` belongs with ``b`` (same tree, session, process group or job), with the
    link that proves it; None when some column is unknown (it never proves them unrelated)."""
    if a.pid == b.pid:
        return True, "same process"
    unknown: list[str] = []
    for column in ("sid", "pgid"):
        left, right = getattr(a, column), getattr(b, column)
        if left is None or right is None:
            unknown.append(column)
        elif left == right:
            return True, f"same {column} {left}"
    if a.cgroup is None or b.cgroup is None:
        unknown.append("cgroup")
    else:
        job = a.cgroup.job_key
        if job is not None and job == b.cgroup.job_key:
            return True, f"same job {job}"
    above_a, complete_a = host.ancestors(a)
    if b.pid in above_a:
        return True, f"descendant of {b.pid}"
    above_b, complete_b = host.ancestors(b)
    if a.pid in above_b:
        return True, f"ancestor of {b.pid}"
    if not (complete_a and complete_b):
        unknown.append("process tree")
    if unknown:
        return None, "unknown " + ", ".join(unknown)
    return False, "unrelated"
