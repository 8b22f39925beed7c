"""Collection: one poll of the host, turned into a frozen :class:`~gpuwatchd.core.model.Snapshot`.

In detail: docs/internals.md, section `gpuwatchd.collect.collector`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.collect.devwatch import DeviceWatch, WatchNews
from gpuwatchd.collect.inherit import InheritanceProbe, absent_leaders
from gpuwatchd.collect.jobs import judge_jobs
from gpuwatchd.collect.kernel_log import KernelLog
from gpuwatchd.collect.mig import DEFAULT_MIG_MINORS_FILE, read_mig_minors
from gpuwatchd.collect.nvml import NvmlSource
from gpuwatchd.collect.procfs import ProcFS
from gpuwatchd.collect.statfiles import StatFiles
from gpuwatchd.collect.subids import SubUidFile
from gpuwatchd.core.model import (
    DeviceHolding,
    HolderScan,
    NvmlReading,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.core.procstat import StatFields
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.floor import mps_server
from gpuwatchd.decide.full_scan import (
    FullScanReason,
    FullScanState,
    full_scan_due,
    holder_gone,
    listed_pids,
)
from gpuwatchd.decide.policy import Detection
from gpuwatchd.events import lazylog

_MAX_ANCESTRY = 64

log = lazylog.get_logger()

_Signature = tuple[int | None, int | None, int | None, int | None, str | None]


class WalkDue(Exception):
    """The full-scan rule asks for a walk of all of ``/proc`` (``reason``) of a collector that
    may not walk (:attr:`Collector.may_walk` False: a scan the daemon answers declines)."""

    def __init__(self, reason: FullScanReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


def _signature_of_info(info: ProcessInfo) -> _Signature:
    return (info.start_ticks, info.ppid, info.pgid, info.sid, info.comm)


# What protect, the floor and spares judge of a process, by the name a refusal gives it.
_JUDGED: dict[str, Callable[[ProcessInfo], object]] = {
    "user": lambda info: info.uid,
    "comm": lambda info: info.comm,
    "command line": lambda info: info.cmdline,
    "exe": lambda info: info.exe,
    "cgroup": lambda info: None if info.cgroup is None else info.cgroup.path,
}


@dataclass(frozen=True)
class _Held:
    """A listed process's holdings, with what made them reusable."""

    signature: _Signature
    gpus: frozenset[str]
    holding: DeviceHolding | None


@dataclass(frozen=True)
class _Poll:
    """What one :meth:`Collector.collect` read first and every later step uses."""

    reading: NvmlReading
    now: float
    listed: frozenset[int]
    self_pids: frozenset[int]
    news: WatchNews | None  # the device watch's, drained after the NVML read


@dataclass
class Collector:
    """Reads NVML and ``/proc`` into snapshots; remembers only what keeps the next poll cheap.

    ``detection``: the policy's, whose memory threshold the full-scan rule uses;
    ``last_scan_reason``: why the last poll scanned all of ``/proc`` (None: targeted)."""

    procfs: ProcFS
    nvml: NvmlSource
    full_scan_interval: float = 60.0
    namespace_check: bool = True
    cgroup_root: str | None = None  # the cgroup v2 mount, for jobs.ended_jobs
    detection: Detection = field(default_factory=Detection)
    # The daemon's inotify watch on the device files (None: not watched, e.g. `scan`); while it
    # works, the periodic walk waits for `backstop` seconds (None: full_scan_interval).
    watch: DeviceWatch | None = None
    backstop: float | None = None
    # Processes of a running daemon that a one-shot command (scan, check-clean) must count as
    # its own, as the daemon does: its NVML worker holds every GPU's device file.
    daemon_pids: frozenset[int] = frozenset()
    # The PIDs the daemon's ladders name: described, holders or not, so a ladder's target is
    # gone when /proc says so, not when it merely holds nothing (docs/escalation.md).
    watched: Callable[[], Iterable[int]] = tuple
    # False: where the full-scan rule asks for a walk, collect raises WalkDue instead (a scan
    # the daemon answers walks nothing in the daemon's loop: it declines).
    may_walk: bool = True
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    last_scan_reason: FullScanReason | None = None
    _scan_state: FullScanState = field(default_factory=FullScanState)
    _known_holders: frozenset[int] = field(default_factory=frozenset)
    _unknown_holders: frozenset[int] = field(default_factory=frozenset)  # unreadable last poll
    # The GPU minors whose memory the last poll's holders own for the full-scan rule (exempt
    # from ``unowned_memory``: _note_holders)
    held_minors: frozenset[int] = field(default_factory=frozenset)
    _said_unread: frozenset[int] = field(default_factory=frozenset)  # thread_tables_unread
    _facts: dict[int, ProcessInfo] = field(default_factory=dict)
    _facts_seen: dict[int, ProcessInfo] = field(default_factory=dict)
    # PID -> the stat read (the same object while its bytes are) that confirmed a remembered fact
    _confirmed: dict[int, tuple[StatFields, ProcessInfo]] = field(default_factory=dict)
    _held: dict[int, _Held] = field(default_factory=dict)
    _inheritance: InheritanceProbe | None = None
    _stat_files: StatFiles | None = None  # identity re-checks through kept descriptors
    # run --once --ended-job (jobs.py): job key -> when the scheduler said it ended (boot ticks)
    ended_by_scheduler: Mapping[str, int | None] = field(default_factory=dict)
    # MIG (collect/mig.py): read each poll in which a GPU has MIG on
    mig_minors_file: str = DEFAULT_MIG_MINORS_FILE
    # Sub-uid ranges for the kill cap (collect/subids.py); path None: not read
    subuids: SubUidFile = field(default_factory=SubUidFile)
    # Xids of the kernel log (collect/kernel_log.py); None: not read (one-shot commands)
    kernel_log: KernelLog | None = None

    def collect(self, *, full: bool = False) -> Snapshot:
        reading = _distinct_minors(self.nvml.read())
        # After the NVML read: a worker (re)started by it opens the device files, and the
        # events are consumed here, not walked on next poll. Nothing is lost either way: an
        # open after this drain is seen by the next one.
        news = self.watch.drain() if self.watch is not None else None
        now = self.clock()
        listed = listed_pids(reading)
        self._facts_seen = {}
        live_listed = self._read_processes(listed)
        self_pids = frozenset({os.getpid()}) | self.nvml.worker_pids | self.daemon_pids
        poll = _Poll(reading, now, listed, self_pids, news)
        holders, live_listed = _scan_holders(self, poll, live_listed, full=full)
        holding_pids = _note_holders(self, poll, holders)
        wanted = holding_pids | holders.unreadable | set(self.watched())
        processes = _processes_of(self, poll, live_listed, wanted)
        return _snapshot(
            self, poll, holders, live_listed, processes=processes, holding_pids=holding_pids
        )

    def _stepd_identity(self, pid: int) -> tuple[int | None, bool | None] | None:
        """(start ticks, root's trusted program?) of a process in a job's slurm cgroup."""
        info = self.procfs.read_process(pid)
        if info is None:
            return None
        if info.uid is not None and info.uid != 0:
            return info.start_ticks, False
        trusted = self.procfs.exe_trusted(pid, info.exe)
        if info.uid is None:  # root's directory, owner unread: not known to be anything else
            return info.start_ticks, False if trusted is False else None
        return info.start_ticks, trusted

    def as_judged(self, identity: ProcessIdentity) -> str | None:
        """Which facts the rules judge (:data:`_JUDGED`) of a process about to be signalled read
        otherwise now than in the last snapshot (docs/internals.md), or None (also without facts
        of it). A change drops the remembered facts: the next poll judges the process afresh."""
        judged = self._facts.get(identity.pid)
        if judged is None or judged.start_ticks != identity.start_ticks:
            return None
        now = self.procfs.read_process(identity.pid)
        if now is None or now.start_ticks != identity.start_ticks:
            return None  # gone or another process: the signaller's identity check says so
        changed = [name for name, fact in _JUDGED.items() if fact(now) != fact(judged)]
        if not changed:
            return None
        self._facts.pop(identity.pid, None)
        self._confirmed.pop(identity.pid, None)
        return ", ".join(changed)

    @property
    def dead_listed(self) -> frozenset[int]:
        """The PIDs NVML listed dead or zombie at the last poll (the full-scan rule's memory)."""
        return self._scan_state.dead_listed

    def seed(
        self,
        holders: frozenset[int],
        dead_listed: frozenset[int],
        *,
        unknown: frozenset[int] = frozenset(),
        held_minors: frozenset[int] = frozenset(),
    ) -> None:
        """Start from another collector's view of a poll that just happened (``scan`` beside a
        running daemon) instead of a first full scan: the next :meth:`collect` is targeted
        unless the full-scan rule says otherwise. ``unknown``: the PIDs that poll could not
        read (rescanned as the holders are); ``held_minors``: its :attr:`held_minors`."""
        self._known_holders = holders
        self._unknown_holders = unknown
        self.held_minors = held_minors
        self._scan_state = FullScanState(last_full=self.clock(), dead_listed=dead_listed)

    def _full_scan(
        self, poll: _Poll, read_now: dict[int, ProcessInfo] | None = None
    ) -> tuple[HolderScan, dict[int, ProcessInfo]]:
        """Scan all of /proc with no remembered fact or holding kept; ``read_now``: the listed
        processes' facts when this poll read them all afresh (else they are read again)."""
        self._facts, self._facts_seen, self._held = {}, {}, {}
        listed = poll.listed
        live_listed = self.procfs.read_processes(listed) if read_now is None else dict(read_now)
        self._facts_seen.update(live_listed)
        holders = self.procfs.holders.scan(None)
        self._remember_holdings(holders, listed_gpus(poll.reading), live_listed)
        return holders, live_listed

    def _read_processes(self, pids: Iterable[int]) -> dict[int, ProcessInfo]:
        """Facts about ``pids``: ``stat`` read now; the rest reused while stat's identity holds."""
        found: dict[int, ProcessInfo] = {}
        for pid in pids:
            if pid not in found and (info := self._facts_seen.get(pid) or self._read_process(pid)):
                self._facts_seen[pid] = found[pid] = info
        return found

    def _read_process(self, pid: int) -> ProcessInfo | None:
        if self._stat_files is None:
            self._stat_files = StatFiles(self.procfs.root)
        fields = self._stat_files.read(pid)
        cached = self._facts.get(pid)
        confirmed = self._confirmed.get(pid)
        # Without a stat read (gone, or unreadable) read_process below tells which.
        if cached is not None and confirmed is not None and fields is not None:
            if confirmed[0] is fields and confirmed[1] is cached:
                return cached  # the very stat that confirmed this fact last time
            if (
                (fields.starttime, fields.ppid, fields.pgrp, fields.session, fields.comm)
                == _signature_of_info(cached)
                and fields.exec_mark == confirmed[0].exec_mark  # no exec since
            ):
                if fields.state != cached.state:
                    cached = dataclasses.replace(cached, state=fields.state)
                self._confirmed[pid] = (fields, cached)
                return cached
        info = self.procfs.read_process(pid)
        if info is not None and fields is not None:
            # Read before the facts: an exec between the two moves the mark, so they are read
            # again next time rather than trusted.
            self._confirmed[pid] = (fields, info)
        return info

    def _targeted_scan(
        self, poll: _Poll, targets: list[int], live_listed: dict[int, ProcessInfo]
    ) -> HolderScan:
        """Scan ``targets``, reusing the holdings of listed processes whose view is unchanged."""
        gpus_of = listed_gpus(poll.reading)
        reused: dict[int, DeviceHolding | None] = {}
        for pid in targets:
            held = self._held.get(pid)
            info = live_listed.get(pid)
            if (
                held is not None
                and info is not None
                and not info.is_zombie
                and held.gpus == gpus_of.get(pid)
                and held.signature == _signature_of_info(info)
            ):
                reused[pid] = held.holding
        scan = self.procfs.holders.scan([pid for pid in targets if pid not in reused])
        if reused:
            kept = {pid: h for pid, h in reused.items() if h is not None}
            scan = dataclasses.replace(scan, holdings={**scan.holdings, **kept})
        self._remember_holdings(scan, gpus_of, live_listed)
        return scan

    def _remember_holdings(
        self,
        scan: HolderScan,
        gpus_of: Mapping[int, frozenset[str]],
        live_listed: dict[int, ProcessInfo],
    ) -> None:
        """Keep the holdings of listed, fully readable processes for the next poll
        (``gpus_of``: :func:`listed_gpus` of the poll's reading)."""
        held: dict[int, _Held] = {}
        for pid, info in live_listed.items():
            unsure = pid in scan.unreadable or pid in scan.matched_by_name
            if unsure or info.is_zombie or info.start_ticks is None:
                continue
            held[pid] = _Held(_signature_of_info(info), gpus_of[pid], scan.holdings.get(pid))
        self._held = held


def _scan_holders(
    c: Collector, poll: _Poll, live_listed: dict[int, ProcessInfo], *, full: bool
) -> tuple[HolderScan, dict[int, ProcessInfo]]:
    """The device files' holders: all of /proc when the full-scan rule says so, else the
    targeted scan (and all of /proc after all when a known holder is gone)."""
    reason, c._scan_state = full_scan_due(
        poll.reading, live_listed, c._scan_state, poll.now,
        interval=c.full_scan_interval,
        detection=c.detection,
        forced=full,
        held_minors=c.held_minors,
        watching=poll.news is not None and poll.news.available,
        device_changed=poll.news is not None and poll.news.changed,
        backstop=c.backstop,
    )  # fmt: skip
    c.last_scan_reason = reason
    self_pids = poll.self_pids
    if reason is not None:
        if not c.may_walk:
            raise WalkDue(reason)
        # Nothing remembered (the first poll, a one-shot scan): every fact was read this poll,
        # so a full scan need not read the listed processes a second time.
        return c._full_scan(poll, None if c._facts else live_listed)
    # Descendants of every known holder, not only of listed ones: a holder's fork
    # inherits its files without opening anything (no inotify event).
    targets = set(poll.listed) | set(c._known_holders)
    files = c._stat_files
    targets |= c.procfs.descendants(targets, None if files is None else files.children)
    # What the last poll could not read is read again (unknown until it can be, or is gone);
    # not its descendants: an unknown PID 1 would make every poll a walk.
    targets |= c._unknown_holders
    holders = c._targeted_scan(poll, sorted(targets - self_pids), live_listed)
    found = frozenset(holders.holdings) - self_pids
    # One the last poll could not read may have held the files too: gone (or read now and
    # holding nothing), it is a holder gone; its children, not followed, may keep them.
    gone_from = c._known_holders | (c._unknown_holders - holders.unreadable)
    if (reason := holder_gone(gone_from - self_pids, found)) is not None:
        if not c.may_walk:
            raise WalkDue(reason)
        c.last_scan_reason = reason
        c._scan_state = dataclasses.replace(c._scan_state, last_full=poll.now)
        return c._full_scan(poll)
    return holders, live_listed


def _note_holders(c: Collector, poll: _Poll, holders: HolderScan) -> set[int]:
    """Remember this poll's holders for the next one; the holding PIDs (not our own).
    ``EventName.COLLECT_THREAD_TABLES_UNREAD`` said once per process the scan stopped reading."""
    holding_pids = {pid for pid in holders.holdings if pid not in poll.self_pids}
    c._known_holders = frozenset(holding_pids)
    c._unknown_holders = holders.unreadable - poll.self_pids
    said = {pid for pid in c._said_unread if os.path.exists(f"{c.procfs.root}/{pid}")}
    for pid in sorted(holders.thread_tables_unread - said):
        info = c._facts_seen.get(pid) or c.procfs.read_process(pid)
        log.warning(
            EventName.COLLECT_THREAD_TABLES_UNREAD,
            pid=pid,
            comm=None if info is None else info.comm,
            budget=c.procfs.holders.thread_table_budget,
        )
    c._said_unread = frozenset(said | holders.thread_tables_unread)
    # An NVML-only holder (no nvidia-uvm, not listed: a monitor) holds no memory, so
    # memory beside it still asks for a full scan (decide/plan/monitors.py).
    c.held_minors = frozenset(
        minor
        for pid in holding_pids
        if holders.holdings[pid].uvm or pid in poll.listed
        for minor in holders.holdings[pid].gpu_minors
    )
    return holding_pids


def _processes_of(
    c: Collector, poll: _Poll, live_listed: dict[int, ProcessInfo], wanted: set[int]
) -> dict[int, ProcessInfo]:
    """The snapshot's processes: the listed ones, ``wanted`` and their ancestors (for process
    trees), never our own; the facts read this poll are remembered for the next."""
    processes = {**live_listed, **c._read_processes(wanted - live_listed.keys() - poll.self_pids)}
    found = processes
    for _ in range(_MAX_ANCESTRY):
        frontier = [p.ppid for p in found.values() if p.ppid]
        parents = {pid for pid in frontier if pid and pid > 0 and pid not in processes}
        if not parents:
            break
        found = c._read_processes(parents)
        processes.update(found)
    c._facts = c._facts_seen
    c._confirmed = {pid: got for pid, got in c._confirmed.items() if pid in c._facts}
    if c._stat_files is not None:
        c._stat_files.retain(c._facts)
    for pid in poll.self_pids:
        processes.pop(pid, None)
    return processes


def _snapshot(
    c: Collector,
    poll: _Poll,
    holders: HolderScan,
    live_listed: dict[int, ProcessInfo],
    *,
    processes: dict[int, ProcessInfo],
    holding_pids: set[int],
) -> Snapshot:
    """The snapshot, with the evidence read last: inheritance, jobs, MIG minors, Xids."""
    reading = poll.reading
    # Inheritance evidence (collect/inherit.py): kcmp while owners live; lost leaders.
    if c._inheritance is None:
        c._inheritance = InheritanceProbe(c.procfs.holders, c.procfs.root)
    marks = {pid: fields.exec_mark for pid, (fields, _info) in c._confirmed.items()}
    file_sharing = c._inheritance.compare(processes, holders, live_listed, marks)
    lost_leaders = absent_leaders(c.procfs.root, processes, holding_pids)
    jobs = judge_jobs(
        (processes[pid] for pid in holding_pids if pid in processes),
        c.cgroup_root,
        c._stepd_identity,
    )

    mig_on = any(gpu.mig_enabled for gpu in reading.gpus)
    mig_caps, mig_caps_error = read_mig_minors(c.mig_minors_file) if mig_on else (None, None)

    # Read only while NVML names the GPUs: a line of a GPU not known yet stays unread.
    kernel_xids = () if c.kernel_log is None or not reading.gpus else c.kernel_log.read()

    return Snapshot(
        monotonic=poll.now,
        wall_time=c.wall_clock(),
        boot_id=c.procfs.boot_id(),
        nvml=reading,
        processes=processes,
        holders=holders,
        self_pids=poll.self_pids,
        pid_max=c.procfs.pid_max(),
        host_namespaces=c.procfs.sees_host_namespaces() if c.namespace_check else True,
        mps_server_running=any(mps_server(p) for p in processes.values()),
        ended_job_dirs=jobs.ended_dirs,
        handovers=dict(c.ended_by_scheduler),
        job_stepds=jobs.stepds,
        absent_pids=lost_leaders,
        file_sharing=file_sharing,
        mig_caps=mig_caps,
        mig_caps_error=mig_caps_error,
        subuid_ranges=c.subuids.ranges(),
        kernel_xids=kernel_xids,
    )


def _distinct_minors(reading: NvmlReading) -> NvmlReading:
    """``reading`` with the minor of each GPU that shares it with another one unknown (its
    ``error`` says why): ``/dev/nvidiaN`` is one GPU's, so the holders of that file cannot be
    told to be either's, and an unknown minor is reported, never acted on."""
    minors = [gpu.minor for gpu in reading.gpus if gpu.minor is not None]
    if len(set(minors)) == len(minors):
        return reading
    shared = {minor for minor in minors if minors.count(minor) > 1}
    gpus = tuple(
        dataclasses.replace(
            gpu,
            minor=None,
            error="; ".join(
                filter(None, (gpu.error, f"NVML reports minor {gpu.minor} for another GPU too"))
            ),
        )
        if gpu.minor in shared
        else gpu
        for gpu in reading.gpus
    )
    return dataclasses.replace(reading, gpus=gpus)


def listed_gpus(reading: NvmlReading) -> dict[int, frozenset[str]]:
    """PID -> the UUIDs of the GPUs whose NVML process list names it."""
    found: dict[int, set[str]] = {}
    for gpu in reading.gpus:
        for proc in gpu.processes or ():
            found.setdefault(proc.pid, set()).add(gpu.uuid)
    return {pid: frozenset(uuids) for pid, uuids in found.items()}
