"""Inheritance evidence: whose device files a holder holds, and whether its leaders still exist.

In detail: docs/findings.md ("ties") and docs/internals.md, `gpuwatchd.collect.inherit`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping

from gpuwatchd.collect.holders import HolderScanner
from gpuwatchd.collect.kcmp import Kcmp
from gpuwatchd.collect.statfiles import GONE_ERRNOS, stat_cached
from gpuwatchd.core.model import FileSharing, HolderScan, ProcessIdentity, ProcessInfo
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.events import lazylog

log = lazylog.get_logger()  # structlog only if it logs: scan's start-up

_MAX_DEVICE_FDS = 64  # device fds compared per process; a CUDA process holds a few dozen
_MAX_NEW_PAIRS = 64  # new holder/owner pairs compared per poll; the rest wait for the next
_MAX_CACHE = 8192  # remembered answers; cleared when full (they are recomputed cheaply)
_MAX_ANCESTORS = 64
_RETRY_UNKNOWN_POLLS = 12  # an unknown answer (mappings only, a race) is asked again this late
# (holder, owner) and where each one's program lay (exec marks) when they were compared
_Pair = tuple[ProcessIdentity, ProcessIdentity, object, object]


class InheritanceProbe:
    """Compares each holder with the live context owners above it in the process tree;
    ``scanner`` says how device files are recognised (by path in tests, else by number)."""

    def __init__(self, scanner: HolderScanner, root: str, kcmp: Kcmp | None = None) -> None:
        self.scanner = scanner
        self.root = root.rstrip("/") or "/"
        self.kcmp = kcmp if kcmp is not None else Kcmp()
        self._known: dict[_Pair, bool] = {}
        self._unknown_until: dict[_Pair, int] = {}
        self._polls = 0
        self._reported = False
        self._walk_left = scanner.thread_table_budget  # fd entries this poll may still read
        self._cut: int | None = None  # the process whose fds this poll stopped reading
        self._said: set[int] = set()

    def compare(
        self,
        processes: Mapping[int, ProcessInfo],
        holders: HolderScan,
        owners: Iterable[int],
        exec_marks: Mapping[int, object],
    ) -> tuple[FileSharing, ...]:
        """One :class:`FileSharing` per (holder, live owner above it) pair; unknown included.
        An answer is remembered while neither process has exec'd since (``exec_marks``: PID ->
        :attr:`gpuwatchd.core.procstat.StatFields.exec_mark`): an exec closes the device files
        opened close-on-exec, as CUDA opens them, while PID and start time stay."""
        live_owners = {
            pid: processes[pid]
            for pid in owners
            if pid in processes and not processes[pid].is_zombie and pid in holders.holdings
        }
        self._polls += 1
        self._walk_left, self._cut = self.scanner.thread_table_budget, None
        if self.kcmp.unavailable is not None and not self._reported:
            self._reported = True
            log.warning(EventName.COLLECT_KCMP_UNAVAILABLE, reason=self.kcmp.unavailable)
        if not live_owners:
            return ()
        found: list[FileSharing] = []
        budget = _MAX_NEW_PAIRS
        read: dict[int, list[int] | None] = {}  # each process's device fds, read once
        for pid in sorted(holders.holdings):
            holder = processes.get(pid)
            if holder is None or pid in live_owners or holder.identity is None:
                continue
            for owner in _owners_above(holder, processes, live_owners):
                if owner.identity is None:
                    continue
                marks = (exec_marks.get(pid), exec_marks.get(owner.pid))
                key = (holder.identity, owner.identity, *marks)
                shared = self._known.get(key)
                retry = self._unknown_until.get(key, 0) <= self._polls
                walk = budget > 0 and self._walk_left > 0 and self.kcmp.unavailable is None
                if asked := shared is None and retry and walk:
                    budget -= 1
                    shared = self._shares(pid, owner.pid, read)
                    if len(self._known) + len(self._unknown_until) >= _MAX_CACHE:
                        self._known.clear()
                        self._unknown_until.clear()
                    if shared is not None:
                        self._known[key] = shared
                        self._unknown_until.pop(key, None)
                    else:
                        self._unknown_until[key] = self._polls + _RETRY_UNKNOWN_POLLS
                cut = asked and self._cut is not None  # no pair is asked after a cut
                found.append(FileSharing(holder=pid, owner=owner.pid, shared=shared, cut=cut))
        self._say_cut(processes)
        return tuple(found)

    def _say_cut(self, processes: Mapping[int, ProcessInfo]) -> None:
        """``EventName.COLLECT_INHERITANCE_UNREAD`` once per process whose fds were cut short."""
        self._said &= processes.keys()  # while it is among the processes
        cut = None if self._cut is None else processes.get(self._cut)
        if cut is not None and cut.pid not in self._said:
            self._said.add(cut.pid)
            budget = self.scanner.thread_table_budget
            log.warning(
                EventName.COLLECT_INHERITANCE_UNREAD, pid=cut.pid, comm=cut.comm, budget=budget
            )

    def _shares(self, holder: int, owner: int, read: dict[int, list[int] | None]) -> bool | None:
        for pid in (holder, owner):
            if pid not in read:
                read[pid] = self.device_fds(pid)
            if not read[pid]:
                return None  # mappings only, unreadable or cut short: nothing to compare
        mine, theirs = read[holder] or [], read[owner] or []
        unknown = False
        # A forked child keeps the parent's fd numbers: try those pairs first.
        pairs = [(fd, fd) for fd in mine if fd in set(theirs)]
        pairs += [(a, b) for a in mine for b in theirs if a != b]
        for a, b in pairs:
            same = self.kcmp.same_file(holder, a, owner, b)
            if same:
                return True
            if same is None:
                unknown = True
                if self.kcmp.unavailable is not None:
                    return None
        return None if unknown else False

    def device_fds(self, pid: int) -> list[int] | None:
        """The fd numbers of ``pid`` that are NVIDIA device files, the first
        :data:`_MAX_DEVICE_FDS` in the listing's order (the kernel's: by number); None when
        unreadable, or cut short: any user may open half a million fds, and a poll reads the
        scanner's ``thread_table_budget`` entries in all (docs/internals.md). An entry at a time."""
        found: list[int] = []
        try:
            with os.scandir(f"{self.root}/{pid}/fd") as entries:
                for entry in entries:
                    if self._walk_left <= 0:
                        self._cut = pid
                        return None
                    self._walk_left -= 1
                    name = entry.name
                    if name.isascii() and name.isdigit() and self._is_device(entry.path):
                        found.append(int(name))
                        if len(found) == _MAX_DEVICE_FDS:
                            break
        except OSError:
            return None
        return sorted(found)

    def _is_device(self, fd_path: str) -> bool:
        """Whether the fd at ``fd_path`` is an NVIDIA device file (False when it closed)."""
        devices = self.scanner.devices
        try:
            target = os.readlink(fd_path)
            if devices.match_by_path:
                return devices.match_path(target) is not None
            if "/dev/" not in target and "nvidia" not in target:
                return False
            st = stat_cached(fd_path)
        except OSError:
            return False
        majors = {devices.device_major, devices.major("nvidia-uvm")}
        return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors


def _owners_above(
    holder: ProcessInfo, processes: Mapping[int, ProcessInfo], owners: Mapping[int, ProcessInfo]
) -> list[ProcessInfo]:
    """The live owners among ``holder``'s ancestors (fork-inherited files come from there)."""
    found: list[ProcessInfo] = []
    current = holder.ppid
    seen: set[int] = set()
    for _ in range(_MAX_ANCESTORS):
        if current is None or current <= 1 or current in seen:
            break
        seen.add(current)
        if current in owners:
            found.append(owners[current])
        parent = processes.get(current)
        if parent is None:
            break
        current = parent.ppid
    return found


def absent_leaders(
    root: str, processes: Mapping[int, ProcessInfo], holders: Iterable[int]
) -> frozenset[int]:
    """Session and process-group leaders of ``holders`` whose ``/proc/PID`` is missing now (one
    present, even unreadable, is not lost; those among ``processes`` exist)."""
    base = root.rstrip("/") or "/"
    wanted: set[int] = set()
    for pid in holders:
        proc = processes.get(pid)
        if proc is None:
            continue
        for leader in (proc.sid, proc.pgid):
            if leader is not None and leader > 1 and leader != pid and leader not in processes:
                wanted.add(leader)
    return frozenset(pid for pid in wanted if _missing(f"{base}/{pid}"))


def _missing(path: str) -> bool:
    """Whether nothing is at ``path`` (ENOENT): an error that leaves it unread (ENOMEM) is no
    evidence of a loss, where os.path.lexists would say False."""
    try:
        os.lstat(path)
    except OSError as err:
        return err.errno in GONE_ERRNOS
    return False
