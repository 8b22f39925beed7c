"""Collection: one poll of the host, turned into a frozen :class:`~gpuwatchd.model.Snapshot`.

This module owns *what* is read each poll and in which scan mode; ``nvml`` and ``procfs`` own
*how*. It decides nothing about findings and never acts. The cheap targeted holder scan (NVML's
PIDs, their descendants and the holders seen before) runs every poll; the full scan of all of
``/proc`` runs when asked (``scan``), periodically, and whenever the targeted view cannot
explain what NVML shows: a listed PID that is dead or a zombie, or allocated memory with no
live listed owner (DESIGN.md §2.1, §2.4).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.jobs import ended_jobs
from gpuwatchd.model import NvmlReading, ProcessInfo, Snapshot
from gpuwatchd.nvml import NvmlClient
from gpuwatchd.procfs import ProcFS

MPS_SERVER_NAMES = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})
_MAX_ANCESTRY = 64


@dataclass
class Collector:
    """Reads NVML and ``/proc`` into snapshots; remembers only what keeps the next poll cheap."""

    procfs: ProcFS
    nvml: NvmlClient
    full_scan_interval: float = 60.0
    namespace_check: bool = True
    cgroup_root: str | None = None  # the cgroup v2 mount, for jobs.ended_jobs
    idle_memory_hint: int = 64 * 1024 * 1024
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    _last_full: float | None = None
    _known_holders: frozenset[int] = field(default_factory=frozenset)

    def collect(self, *, full: bool = False) -> Snapshot:
        """Take one snapshot. ``full=True`` forces a scan of every process."""
        reading = self.nvml.read()
        now = self.clock()
        listed = listed_pids(reading)
        live_listed = self.procfs.read_processes(listed)
        self_pids = frozenset({os.getpid()}) | self.nvml.worker_pids

        if full or self._full_scan_needed(reading, listed, live_listed, now):
            holders = self.procfs.scan_holders(None)
            self._last_full = now
        else:
            targets = set(listed) | set(self._known_holders)
            targets |= self.procfs.descendants(listed)
            holders = self.procfs.scan_holders(sorted(targets - self_pids))
        holding_pids = {pid for pid in holders.holdings if pid not in self_pids}
        self._known_holders = frozenset(holding_pids)

        processes = dict(live_listed)
        wanted = (holding_pids | set(holders.unreadable)) - processes.keys() - self_pids
        processes.update(self.procfs.read_processes(wanted))
        self._add_ancestry(processes)
        for pid in self_pids:
            processes.pop(pid, None)

        return Snapshot(
            monotonic=now,
            wall_time=self.wall_clock(),
            boot_id=self.procfs.boot_id(),
            nvml=reading,
            processes=processes,
            holders=holders,
            self_pids=self_pids,
            pid_max=self.procfs.pid_max(),
            host_namespaces=self.procfs.sees_host_namespaces() if self.namespace_check else True,
            mps_server_running=any(p.names & MPS_SERVER_NAMES for p in processes.values()),
            nvidia_uvm_major=self.procfs.uvm_major(),
            ended_jobs=ended_jobs(
                (processes[pid] for pid in holding_pids if pid in processes), self.cgroup_root
            ),
        )

    def _full_scan_needed(
        self,
        reading: NvmlReading,
        listed: frozenset[int],
        live_listed: dict[int, ProcessInfo],
        now: float,
    ) -> bool:
        if self._last_full is None or now - self._last_full >= self.full_scan_interval:
            return True
        if any(pid not in live_listed or live_listed[pid].is_zombie for pid in listed):
            return True
        for gpu in reading.gpus:
            allocated = gpu.memory.allocated if gpu.memory else None
            if allocated is not None and allocated > self.idle_memory_hint and not gpu.processes:
                return True
        return False

    def _add_ancestry(self, processes: dict[int, ProcessInfo]) -> None:
        """Read each known process's ancestors so process-tree questions can be answered."""
        frontier = [p.ppid for p in processes.values() if p.ppid]
        for _ in range(_MAX_ANCESTRY):
            wanted = {pid for pid in frontier if pid and pid > 0 and pid not in processes}
            if not wanted:
                return
            found = self.procfs.read_processes(wanted)
            processes.update(found)
            frontier = [p.ppid for p in found.values() if p.ppid]


def listed_pids(reading: NvmlReading) -> frozenset[int]:
    """Every PID any GPU's NVML process list names (valid or not)."""
    return frozenset(proc.pid for gpu in reading.gpus for proc in gpu.processes or ())
