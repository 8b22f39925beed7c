"""Findings: what one snapshot, plus what earlier polls remembered, says about the host.

This module owns the decision "who holds this GPU, why, and is anything wrong": PID validation
and PID trust (DESIGN.md §2.3), the orphan rule with its positive evidence (§2.4), zombies and
D state (§2.5), ghost and unaccounted memory with the learned idle baseline (§2.6), report-only
conditions (§2.11), and the per-process lineage recorded when a process is first seen.

It is pure: no I/O, no clock reads (time is ``snapshot.monotonic``), no signals, no policy rules.
It must never turn an unknown value into an actionable finding: every ``None`` on the path to
``orphaned`` or ``ghost_memory`` yields a weaker, informational result instead, and the reason is
written down. Deciding what to *do* about a finding is ``plan.py``'s job. The kinds and their
evidence fields are documented in ``docs/findings.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.policy import Detection
from gpuwatchd.model import (
    MIB,
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    NvmlProcess,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)

NODE = "node"  # key of node-wide entries in ``Assessment.report_only`` and ``HolderRole.gpu``
V1_BASELINE_SUFFIX = "@v1"  # baselines of v1 "used" memory (reservation included) live apart
V1_MAX_RESERVATION = 1024 * MIB  # the most v1 "used" may include for the driver's reservation
STATE_VERSION = 1


# --- carried state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Lineage:
    """What a process looked like when first seen (DESIGN.md §2.4); ``first_seen`` is monotonic."""

    ppid: int | None
    pgid: int | None
    sid: int | None
    job: str | None
    first_seen: float


@dataclass(frozen=True)
class AssessState:
    """What assessment carries from one poll to the next.

    ``baselines`` maps a GPU UUID to the smallest allocated memory seen while nothing held the
    GPU (v1-only GPUs use the key ``UUID@v1`` and v1's "used" figure, which includes the driver
    reservation, so the two never mix). ``lineage`` is keyed by process identity, so a new process
    that reuses a PID never inherits the story of the old one. ``unaccounted_since`` maps a GPU
    UUID to when (monotonic) it began to hold memory above baseline + margin with no live
    context owner. ``owners`` are the processes seen as live context owners, kept while they live
    or while a recorded lineage still names their PID: what ties memory that no live owner holds
    to an heir. Lineage, ``unaccounted_since`` and ``owners`` are dropped when the boot id
    changes.
    """

    baselines: Mapping[str, int] = field(default_factory=dict)
    lineage: Mapping[ProcessIdentity, Lineage] = field(default_factory=dict)
    boot_id: str | None = None
    unaccounted_since: Mapping[str, float] = field(default_factory=dict)
    owners: frozenset[ProcessIdentity] = frozenset()

    def to_json(self) -> dict[str, object]:
        return {
            "version": STATE_VERSION,
            "boot_id": self.boot_id,
            "baselines": dict(sorted(self.baselines.items())),
            "unaccounted_since": dict(sorted(self.unaccounted_since.items())),
            "owners": [[ident.pid, ident.start_ticks] for ident in sorted(self.owners)],
            "lineage": [
                {
                    "pid": ident.pid,
                    "start_ticks": ident.start_ticks,
                    "ppid": lin.ppid,
                    "pgid": lin.pgid,
                    "sid": lin.sid,
                    "job": lin.job,
                    "first_seen": lin.first_seen,
                }
                for ident, lin in sorted(self.lineage.items())
            ],
        }

    @classmethod
    def from_json(cls, data: object) -> AssessState:
        """Rebuild the state written by :meth:`to_json`; raise ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("assess state must be an object")
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported assess state version: {data.get('version')!r}")
        boot_id = data.get("boot_id")
        if boot_id is not None and not isinstance(boot_id, str):
            raise ValueError("boot_id must be a string or null")
        raw_baselines = data.get("baselines", {})
        if not isinstance(raw_baselines, dict):
            raise ValueError("baselines must be an object")
        baselines: dict[str, int] = {}
        for uuid, value in raw_baselines.items():
            if not isinstance(uuid, str) or not _is_int(value) or value < 0:
                raise ValueError(f"bad baseline entry: {uuid!r}: {value!r}")
            baselines[uuid] = value
        raw_since = data.get("unaccounted_since", {})
        if not isinstance(raw_since, dict):
            raise ValueError("unaccounted_since must be an object")
        since: dict[str, float] = {}
        for uuid, value in raw_since.items():
            if not isinstance(uuid, str) or isinstance(value, bool):
                raise ValueError(f"bad unaccounted_since entry: {uuid!r}: {value!r}")
            if not isinstance(value, (int, float)):
                raise ValueError(f"bad unaccounted_since entry: {uuid!r}: {value!r}")
            since[uuid] = float(value)
        raw_lineage = data.get("lineage", [])
        if not isinstance(raw_lineage, list):
            raise ValueError("lineage must be a list")
        lineage: dict[ProcessIdentity, Lineage] = {}
        for entry in raw_lineage:
            if not isinstance(entry, dict):
                raise ValueError(f"bad lineage entry: {entry!r}")
            pid, start = entry.get("pid"), entry.get("start_ticks")
            first_seen = entry.get("first_seen")
            job = entry.get("job")
            if not _is_int(pid) or not _is_int(start):
                raise ValueError(f"lineage entry needs integer pid and start_ticks: {entry!r}")
            if isinstance(first_seen, bool) or not isinstance(first_seen, (int, float)):
                raise ValueError(f"lineage entry needs a numeric first_seen: {entry!r}")
            if job is not None and not isinstance(job, str):
                raise ValueError(f"lineage job must be a string or null: {entry!r}")
            ids = [entry.get(name) for name in ("ppid", "pgid", "sid")]
            if any(value is not None and not _is_int(value) for value in ids):
                raise ValueError(f"lineage ppid/pgid/sid must be integers or null: {entry!r}")
            lineage[ProcessIdentity(_int(pid), _int(start))] = Lineage(
                ppid=_opt_int(ids[0]),
                pgid=_opt_int(ids[1]),
                sid=_opt_int(ids[2]),
                job=job,
                first_seen=float(first_seen),
            )
        raw_owners = data.get("owners", [])
        if not isinstance(raw_owners, list):
            raise ValueError("owners must be a list")
        owners: set[ProcessIdentity] = set()
        for entry in raw_owners:
            if not (isinstance(entry, list) and len(entry) == 2 and all(map(_is_int, entry))):
                raise ValueError(f"bad owners entry: {entry!r}")
            owners.add(ProcessIdentity(_int(entry[0]), _int(entry[1])))
        return cls(
            baselines=baselines,
            lineage=lineage,
            boot_id=boot_id,
            unaccounted_since=since,
            owners=frozenset(owners),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HolderRole:
    """How one holder (or NVML-listed PID) of one GPU is explained, for ``scan`` output.

    ``role`` is one of "context_owner", "worker" (of ``owner_pid``), "management" (an NVML-only
    client or infrastructure), "orphaned", "hidden", "stuck" or "unknown". ``gpu`` is the GPU's
    UUID, or "node" for a process that holds only nvidiactl / nvidia-uvm. ``via`` says how the
    GPU's device file is held ("fd", "map"). The daemon's own processes never appear.
    """

    pid: int
    gpu: str
    role: str
    owner_pid: int | None
    via: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Assessment:
    """The outcome of one assessment.

    ``report_only`` maps a GPU UUID, or "node", to why nothing may be acted on there; findings
    under such a condition carry ``actionable=False``. ``notes`` maps a GPU UUID to why a check
    could not conclude (an unreadable process, a targeted scan, the v1 memory API...).
    """

    findings: tuple[Finding, ...]
    roles: tuple[HolderRole, ...]
    report_only: Mapping[str, str]
    state: AssessState
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


# --- the host as seen in one snapshot ---------------------------------------------------------


@dataclass(frozen=True)
class _Listing:
    """One PID an NVML process list named on one GPU, and what /proc says about it."""

    gpu: GpuInfo
    entry: NvmlProcess
    status: str  # "dead", "zombie" or "alive" (invalid PIDs never become listings)
    proc: ProcessInfo | None


class _Host:
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
        self.listings: dict[str, list[_Listing]] = {}
        for gpu in self.gpus:
            seen: set[int] = set()
            rows: list[_Listing] = []
            for entry in gpu.processes or ():
                if entry.pid in own or entry.pid in seen:
                    continue
                seen.add(entry.pid)
                if entry.pid <= 0 or entry.pid > snapshot.pid_max:
                    self.invalid.append((gpu.uuid, entry.pid))
                    continue
                proc = self.procs.get(entry.pid)
                status = "dead" if proc is None else "zombie" if proc.is_zombie else "alive"
                rows.append(_Listing(gpu, entry, status, proc))
            self.listings[gpu.uuid] = rows
        # Every PID NVML lists alive on some GPU: they own a context somewhere, and they (and
        # their relatives) are never orphans. A listed zombie that still holds device files has
        # live threads, so it counts as alive here too.
        self.listed_alive: dict[int, ProcessInfo] = {}
        for rows in self.listings.values():
            for row in rows:
                if row.proc is None:
                    continue
                if row.status == "alive" or self.holds_anything(row.proc.pid):
                    self.listed_alive[row.proc.pid] = row.proc

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
        if pid in self.unreadable:
            return None
        return False

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

    def held_gpus(self, holding: DeviceHolding) -> list[GpuInfo]:
        return [g for g in self.gpus if g.minor is not None and g.minor in holding.gpu_minors]

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


def _relation(host: _Host, a: ProcessInfo, b: ProcessInfo) -> tuple[bool | None, str]:
    """Whether ``a`` belongs with ``b``: same tree, session, process group or job.

    True with the link that proves it; False when every column is known and none links them;
    None when some column is unknown (unknown never proves two processes unrelated).
    """
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


# --- PID trust and report-only conditions -----------------------------------------------------


def _dead_pid_explained(host: _Host, pid: int, lineage: Mapping[ProcessIdentity, Lineage]) -> bool:
    """A dead listed PID is explained when we saw it alive or a live process descends from it."""
    if any(ident.pid == pid for ident in lineage):
        return True
    for proc in host.procs.values():
        if pid in (proc.ppid, proc.pgid, proc.sid):
            return True
        if proc.identity is not None:
            recorded = lineage.get(proc.identity)
            if recorded is not None and pid in (recorded.ppid, recorded.pgid, recorded.sid):
                return True
    return False


def _pid_trust_problem(
    host: _Host, detection: Detection, lineage: Mapping[ProcessIdentity, Lineage]
) -> str | None:
    """Why NVML's process lists cannot be trusted this poll, or None (DESIGN.md §2.3).

    One PID outside 1..pid_max is proof the list was decoded wrong (a struct layout mismatch
    yields 0 and 4294967295), so any such PID loses trust. Dead PIDs are normal after a crash,
    so they lose trust only when ``pid_trust_min_unresolved`` of them are unexplained: never
    seen alive by us and not the parent, group or session of any live process.
    """
    if host.invalid:
        shown = ", ".join(f"{pid} on {uuid}" for uuid, pid in host.invalid[:5])
        return f"NVML listed impossible PIDs ({shown}); process lists are not trusted"
    dead = sorted(
        {row.entry.pid for rows in host.listings.values() for row in rows if row.status == "dead"}
    )
    unexplained = [pid for pid in dead if not _dead_pid_explained(host, pid, lineage)]
    if len(unexplained) >= detection.pid_trust_min_unresolved:
        shown = ", ".join(str(pid) for pid in unexplained[:8])
        return (
            f"{len(unexplained)} PIDs listed by NVML do not resolve and nothing explains them "
            f"({shown}); process lists are not trusted"
        )
    return None


def _report_only(host: _Host, trust_problem: str | None) -> dict[str, str]:
    snapshot = host.snapshot
    node: list[str] = []
    if not snapshot.nvml.available:
        node.append(f"NVML unavailable: {snapshot.nvml.error or 'no driver'}")
    if snapshot.nvml.wedged:
        node.append("NVML is wedged (a call missed its deadline): no destructive action")
    if snapshot.mps_server_running:
        node.append("an MPS server is running: clients' contexts live in the server")
    if snapshot.host_namespaces is False:
        node.append("not in the host PID/cgroup namespaces: NVML's PIDs point elsewhere")
    elif snapshot.host_namespaces is None:
        node.append("cannot tell whether the host PID/cgroup namespaces are visible")
    if trust_problem is not None:
        node.append(trust_problem)
    result: dict[str, str] = {}
    if node:
        result[NODE] = "; ".join(node)
    for gpu in host.gpus:
        if gpu.lost:
            result[gpu.uuid] = f"GPU lost: {gpu.error or 'not answering'}"
        elif gpu.mig_enabled:
            result[gpu.uuid] = "MIG enabled: processes and memory live in MIG instances"
        elif gpu.processes is None:
            result[gpu.uuid] = "its process list could not be read"
    return result


# --- lineage and baselines --------------------------------------------------------------------


def _update_lineage(
    host: _Host, previous: AssessState, tracked: Iterable[ProcessInfo]
) -> dict[ProcessIdentity, Lineage]:
    """Keep what is still true, record newcomers as they look now.

    An entry survives while its process is present with the same start time, while NVML still
    lists its PID dead (that proves we saw it alive), or, after a targeted scan, while its PID
    was simply not looked at. It is dropped when the PID now belongs to another process or a
    full scan no longer sees it, and everything is dropped when the boot id changes or is unknown.
    """
    snapshot = host.snapshot
    same_boot = snapshot.boot_id is not None and snapshot.boot_id == previous.boot_id
    listed_dead = {
        row.entry.pid for rows in host.listings.values() for row in rows if row.status == "dead"
    }
    kept: dict[ProcessIdentity, Lineage] = {}
    if same_boot:
        for ident, lin in previous.lineage.items():
            proc = host.procs.get(ident.pid)
            if proc is not None:
                if proc.start_ticks is None or proc.start_ticks == ident.start_ticks:
                    kept[ident] = lin
            elif ident.pid in listed_dead or not host.full_scan:
                kept[ident] = lin
    for proc in tracked:
        new = proc.identity
        if new is None or new in kept:
            continue
        job = proc.cgroup.job_key if proc.cgroup is not None else None
        kept[new] = Lineage(proc.ppid, proc.pgid, proc.sid, job, snapshot.monotonic)
    return kept


def _update_owners(
    host: _Host, previous: frozenset[ProcessIdentity], lineage: Mapping[ProcessIdentity, Lineage]
) -> frozenset[ProcessIdentity]:
    """Context owners seen so far: this poll's, plus earlier ones still alive or still named.

    An owner is forgotten once its PID is gone (or belongs to another process) and no recorded
    lineage names it as parent, process group or session any more, so the set stays small.
    """
    current = {p.identity for p in host.listed_alive.values() if p.identity is not None}
    named = {v for lin in lineage.values() for v in (lin.ppid, lin.pgid, lin.sid) if v}
    kept = set(current)
    for ident in previous:
        proc = host.procs.get(ident.pid)
        alive = proc is not None and proc.start_ticks == ident.start_ticks
        if alive or ident.pid in named:
            kept.add(ident)
    return frozenset(kept)


def _memory_figure(gpu: GpuInfo, baselines: Mapping[str, int]) -> tuple[str, int] | None:
    """The baseline key and current memory figure to learn from or compare, if any."""
    memory = gpu.memory
    if memory is None:
        return None
    if memory.allocated is not None:
        return gpu.uuid, memory.allocated
    if memory.api == "v1" and memory.used_v1 is not None:
        return gpu.uuid + V1_BASELINE_SUFFIX, memory.used_v1
    return None


def _learn_baselines(
    host: _Host, previous: Mapping[str, int], detection: Detection
) -> dict[str, int]:
    """Learn each GPU's idle memory from moments when nothing could be holding it.

    Nothing may hold the GPU except NVML-only infrastructure (persistenced, DCGM: they keep the
    GPU open but allocate nothing that a job could have left); NVML lists no process; the scan
    was full and could read every process. The minimum ever seen is kept. A v2 figure above
    the default baseline plus the ghost margin is never learned: an idle-looking GPU holding that
    much is exactly what ghost memory looks like, and learning it would hide the leak for good.
    v1 figures include the driver's reservation, so their ceiling allows for it.
    """
    learned = dict(previous)
    if not host.full_scan or host.unreadable_suspects():
        return learned
    for gpu in host.gpus:
        if gpu.lost or gpu.mig_enabled or gpu.coherent_memory or gpu.minor is None:
            continue
        if gpu.processes is None or gpu.processes:
            continue
        holders = host.holders_of(gpu)
        if any(h.uvm or not host.is_floor(h.pid) for h in holders):
            continue
        figure = _memory_figure(gpu, learned)
        if figure is None:
            continue
        key, value = figure
        ceiling = detection.default_baseline + detection.ghost_margin
        if key.endswith(V1_BASELINE_SUFFIX):
            ceiling += V1_MAX_RESERVATION
        if key not in learned and value > ceiling:
            continue
        learned[key] = min(value, learned.get(key, value))
    return learned


# --- the assessment ---------------------------------------------------------------------------


@dataclass
class _Outcome:
    """The classification of one process that holds device files."""

    role: str
    note: str
    owner_pid: int | None = None
    kind: FindingKind | None = None
    gpu: GpuInfo | None = None  # the GPU the finding is about; None = first held GPU
    evidence: dict[str, object] = field(default_factory=dict)


class _Assessor:
    def __init__(
        self,
        snapshot: Snapshot,
        previous: AssessState,
        detection: Detection,
        ended_jobs: frozenset[str],
    ) -> None:
        self.host = _Host(snapshot)
        self.detection = detection
        self.ended_jobs = ended_jobs
        host = self.host
        tracked = [host.procs[pid] for pid in host.holdings if pid in host.procs]
        tracked += [
            row.proc for rows in host.listings.values() for row in rows if row.proc is not None
        ]
        self.lineage = _update_lineage(host, previous, tracked)
        self.baselines = _learn_baselines(host, previous.baselines, detection)
        same_boot = snapshot.boot_id is not None and snapshot.boot_id == previous.boot_id
        self.owners = _update_owners(
            host, previous.owners if same_boot else frozenset(), self.lineage
        )
        self.unaccounted_since: dict[str, float] = {}
        for gpu in host.gpus:
            if self.memory_without_owner(gpu) is not None:
                since = previous.unaccounted_since.get(gpu.uuid) if same_boot else None
                self.unaccounted_since[gpu.uuid] = (
                    since if since is not None else snapshot.monotonic
                )
        self.report_only = _report_only(host, _pid_trust_problem(host, detection, self.lineage))
        self.findings: list[Finding] = []
        self.roles: list[HolderRole] = []
        self.notes: dict[str, list[str]] = {}
        self.stuck_done: set[int] = set()

    # -- helpers --

    def note(self, gpu: GpuInfo, text: str) -> None:
        self.notes.setdefault(gpu.uuid, []).append(text)

    def baseline(self, gpu: GpuInfo) -> tuple[int | None, int | None, bool]:
        """(figure, baseline, learned) for ghost-style comparisons; figure None = no check."""
        figure = _memory_figure(gpu, self.baselines)
        if figure is None:
            return None, None, False
        key, value = figure
        if key in self.baselines:
            return value, self.baselines[key], True
        if key.endswith(V1_BASELINE_SUFFIX):
            return None, None, False  # v1 "used" includes the reservation: learn first
        return value, self.detection.default_baseline, False

    def blocked(self, gpus: Iterable[GpuInfo]) -> bool:
        if NODE in self.report_only:
            return True
        return any(g.uuid in self.report_only for g in gpus)

    def add(
        self,
        kind: FindingKind,
        gpu: GpuInfo | None,
        proc_pid: int | None,
        start_ticks: int | None,
        reason: str,
        *,
        memory: int | None = None,
        informational: bool = False,
        gpus: Iterable[GpuInfo] = (),
        evidence: Mapping[str, object] | None = None,
    ) -> None:
        scope = list(gpus) or ([gpu] if gpu is not None else [])
        self.findings.append(
            Finding(
                kind=kind,
                gpu=gpu.uuid if gpu is not None else None,
                pid=proc_pid,
                start_ticks=start_ticks,
                reason=reason,
                memory=memory,
                actionable=not informational and not self.blocked(scope),
                evidence=dict(evidence or {}),
            )
        )

    def unaccounted_without_owner(
        self, gpu: GpuInfo, proc: ProcessInfo
    ) -> dict[str, object] | None:
        """Evidence that ``proc`` may be the heir of memory on ``gpu`` that no live owner holds.

        The memory must be above baseline + margin with no live context owner at all, and the
        process must have been seen no later than the moment that state began: a process that
        arrived afterwards (a new job's process that opened every GPU but has no context yet)
        cannot have inherited it.
        """
        tie = self.memory_without_owner(gpu)
        since = self.unaccounted_since.get(gpu.uuid)
        recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
        if tie is None or since is None or recorded is None or recorded.first_seen > since:
            return None
        # Positive evidence: when first seen, its parent, group or session was a process this
        # daemon saw owning a context (and which owns none now). A process that merely
        # initialised CUDA before the leak (a notebook that asked for the device count) has no
        # such link and stays a hidden holder.
        live = set(self.host.listed_alive)
        former = {o.pid for o in self.owners if o.pid not in live}
        for link, value in (
            ("recorded parent", recorded.ppid),
            ("recorded process group", recorded.pgid),
            ("recorded session", recorded.sid),
        ):
            if value is not None and value in former and value != proc.pid:
                return {
                    **tie,
                    "unaccounted_since": since,
                    "first_seen": recorded.first_seen,
                    "former_owner": value,
                    "link": link,
                }
        return None

    def memory_without_owner(self, gpu: GpuInfo) -> dict[str, object] | None:
        """Evidence that ``gpu`` holds memory above baseline+margin with no live owner at all."""
        if gpu.coherent_memory or gpu.processes is None or gpu.lost:
            return None
        rows = self.host.listings[gpu.uuid]
        if any(r.status == "alive" or r.entry.pid in self.host.listed_alive for r in rows):
            return None
        figure, baseline, learned = self.baseline(gpu)
        if figure is None or baseline is None:
            return None
        if figure <= baseline + self.detection.ghost_margin:
            return None
        return {
            "tie": "unaccounted_memory",
            "allocated": figure,
            "baseline": baseline,
            "baseline_learned": learned,
            "margin": self.detection.ghost_margin,
            "memory": figure - baseline,
        }

    # -- NVML listings --

    def assess_listings(self) -> None:
        host = self.host
        for gpu in host.gpus:
            for row in host.listings[gpu.uuid]:
                pid, used = row.entry.pid, row.entry.used_memory
                if row.status == "dead":
                    heirs = self.heirs_of(pid)
                    self.add(
                        FindingKind.DEAD_PROCESS,
                        gpu,
                        pid,
                        None,
                        f"NVML lists PID {pid} on GPU {gpu.index}, but no such process exists"
                        + (f"; {len(heirs)} live process(es) descend from it" if heirs else ""),
                        memory=used,
                        evidence={
                            "used_memory": used,
                            "process_kind": row.entry.kind,
                            "heirs": heirs,
                            "seen_alive": any(i.pid == pid for i in self.lineage),
                        },
                    )
                    continue
                proc = row.proc
                if proc is None:  # never: only dead rows lack their process
                    continue
                if row.status == "zombie":
                    holding = host.holds_anything(pid)
                    self.add(
                        FindingKind.ZOMBIE,
                        gpu,
                        pid,
                        proc.start_ticks,
                        f"NVML lists zombie PID {pid} on GPU {gpu.index}; its parent "
                        f"{proc.ppid if proc.ppid is not None else '(unknown)'} must reap it",
                        memory=used,
                        evidence={
                            "used_memory": used,
                            "ppid": proc.ppid,
                            "parent_cmdline": self.cmdline_of(proc.ppid),
                            "holds_device_files": holding,
                        },
                    )
                    if holding:
                        self.role(pid, gpu, "context_owner", None, "zombie leader; live threads")
                    continue
                if proc.is_uninterruptible:
                    self.add_stuck(proc, gpu, [gpu])
                holds = host.holds_gpu(pid, gpu)
                if holds is None:
                    self.role(
                        pid, gpu, "unknown", None, "listed; whether it holds the GPU is unknown"
                    )
                elif not holds:
                    self.role(
                        pid,
                        gpu,
                        "unknown",
                        None,
                        "listed by NVML but holds no device file of this GPU (PID reused?)",
                    )

    def heirs_of(self, dead_pid: int) -> list[int]:
        heirs = []
        for pid, proc in sorted(self.host.procs.items()):
            recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
            ids = {proc.ppid, proc.pgid, proc.sid}
            if recorded is not None:
                ids.add(recorded.ppid)
            if dead_pid in ids and not proc.is_zombie:
                heirs.append(pid)
        return heirs

    def cmdline_of(self, pid: int | None) -> str | None:
        proc = self.host.procs.get(pid) if pid is not None else None
        if proc is None or proc.cmdline is None:
            return None
        return " ".join(proc.cmdline)

    def role(self, pid: int, gpu: GpuInfo | None, role: str, owner: int | None, note: str) -> None:
        via: tuple[str, ...] = ()
        holding = self.host.holdings.get(pid)
        if gpu is not None and gpu.minor is not None and holding is not None:
            via = holding.via(gpu.minor)
        self.roles.append(
            HolderRole(pid, gpu.uuid if gpu is not None else NODE, role, owner, via, note)
        )

    def add_stuck(self, proc: ProcessInfo, gpu: GpuInfo | None, gpus: list[GpuInfo]) -> None:
        if proc.pid in self.stuck_done:
            return
        self.stuck_done.add(proc.pid)
        self.add(
            FindingKind.STUCK,
            gpu,
            proc.pid,
            proc.start_ticks,
            f"PID {proc.pid} is in uninterruptible sleep (D) while holding the GPU: "
            "it cannot be killed; drain or reboot",
            gpus=gpus,
            evidence={"state": proc.state, "gpus": [g.uuid for g in gpus]},
        )

    # -- holders --

    def assess_holders(self) -> None:
        host = self.host
        for pid, holding in sorted(host.holdings.items()):
            held = host.held_gpus(holding)
            proc = host.procs.get(pid)
            outcome = self.classify(pid, proc, holding, held)
            if proc is not None and outcome.kind is not None:
                target = outcome.gpu or (held[0] if held else None)
                memory = _int_or_none(outcome.evidence.get("memory"))
                self.add(
                    outcome.kind,
                    target,
                    pid,
                    proc.start_ticks,
                    outcome.note,
                    memory=memory,
                    informational=outcome.kind is FindingKind.HIDDEN_HOLDER,
                    gpus=held,
                    evidence={
                        **outcome.evidence,
                        "gpus": [g.uuid for g in held],
                        "uvm": holding.uvm,
                        "ctl": holding.ctl,
                        **_process_evidence(proc, self.lineage),
                    },
                )
            if outcome.role == "stuck" and proc is not None:
                self.add_stuck(proc, held[0] if held else None, held)
            targets: list[GpuInfo | None] = list(held) or [None]
            for gpu in targets:
                role, owner, note = outcome.role, outcome.owner_pid, outcome.note
                listed_here = gpu is not None and pid in _listed_pids(host.listings[gpu.uuid])
                if role == "context_owner" and gpu is not None and not listed_here:
                    note = "owns a context on another GPU; CUDA opens every visible GPU"
                self.role(pid, gpu, role, owner, note)

    def classify(
        self,
        pid: int,
        proc: ProcessInfo | None,
        holding: DeviceHolding,
        held: list[GpuInfo],
    ) -> _Outcome:
        host = self.host
        if proc is None:
            return _Outcome("unknown", "no process facts (exited during the scan?)")
        if is_infrastructure(proc):
            return _Outcome("management", "infrastructure (never a target)")
        if proc.is_zombie:
            if pid in host.listed_alive:
                return _Outcome("context_owner", "zombie leader; live threads")
            return _Outcome("unknown", "zombie that still holds device files (live threads?)")
        if proc.is_uninterruptible:
            return _Outcome("stuck", "uninterruptible sleep (D)")
        job = proc.cgroup.job_key if proc.cgroup is not None else None
        job_ended = job is not None and job in self.ended_jobs
        abandoned = _Outcome(
            "hidden",
            f"its job {job} has ended while it still holds the GPU",
            kind=FindingKind.ABANDONED,
            evidence={"job": job},
        )
        if pid in host.listed_alive:
            if job_ended:
                abandoned.role = "context_owner"
                return abandoned
            return _Outcome("context_owner", "owns a context (listed by NVML)")
        unknown_links: list[str] = []
        for owner in sorted(host.listed_alive.values(), key=lambda p: p.pid):
            related, link = _relation(host, proc, owner)
            if related:
                return _Outcome("worker", f"worker of PID {owner.pid} ({link})", owner.pid)
            if related is None:
                unknown_links.append(f"PID {owner.pid}: {link}")
        if job_ended:
            return abandoned
        if not holding.uvm:
            return _Outcome(
                "management",
                "NVML-only client (no nvidia-uvm): not a kill target, but it blocks a reset",
                kind=FindingKind.HIDDEN_HOLDER if held else None,
                evidence={"nvml_only": True},
            )
        if not held:
            return _Outcome(
                "hidden",
                "holds nvidiactl/nvidia-uvm but no GPU's device file: cannot be attributed",
                kind=FindingKind.HIDDEN_HOLDER,
                evidence={"unattributed": True},
            )
        hidden = "holds the GPU without a context; not explained by a live context owner"
        if unknown_links:
            return self.hidden(
                f"{hidden}; its relation to live owners is unknown ({'; '.join(unknown_links)})"
            )
        if proc.identity is None:
            return self.hidden(f"{hidden}; its start time is unknown")
        unseen = [g for g in host.gpus if g.lost or g.processes is None]
        if unseen:
            return self.hidden(
                f"{hidden}; GPU(s) {', '.join(str(g.index) for g in unseen)} could not say "
                "whether it owns a context there"
            )
        for gpu in held:
            tie = self.dead_owner_tie(proc, gpu) or self.unaccounted_without_owner(gpu, proc)
            if tie is None:
                continue
            if tie["tie"] == "dead_owner":
                why = (
                    f"inherited GPU {gpu.index} from dead owner PID {tie['dead_pid']} "
                    f"({tie['link']}); owns no context and no live owner explains it"
                )
            else:
                why = (
                    f"holds GPU {gpu.index}, whose {_mib(_int(tie['allocated']))} allocated "
                    f"no live context owner accounts for; owns no context anywhere"
                )
            return _Outcome("orphaned", why, kind=FindingKind.ORPHANED, gpu=gpu, evidence=tie)
        return self.hidden(f"{hidden}; nothing ties it to a dead owner")

    def hidden(self, note: str) -> _Outcome:
        return _Outcome("hidden", note, kind=FindingKind.HIDDEN_HOLDER)

    def dead_owner_tie(self, proc: ProcessInfo, gpu: GpuInfo) -> dict[str, object] | None:
        """A dead or zombie PID listed on ``gpu`` that is its parent, group or session."""
        recorded = self.lineage.get(proc.identity) if proc.identity is not None else None
        links = [
            ("recorded parent", recorded.ppid if recorded is not None else None),
            ("parent", proc.ppid),
            ("process group", proc.pgid),
            ("session", proc.sid),
        ]
        for row in self.host.listings[gpu.uuid]:
            if row.status == "alive" or row.entry.pid in self.host.listed_alive:
                continue
            for link, value in links:
                if value is not None and value == row.entry.pid:
                    return {
                        "tie": "dead_owner",
                        "dead_pid": row.entry.pid,
                        "dead_status": row.status,
                        "link": link,
                        "memory": row.entry.used_memory,
                    }
        return None

    # -- GPU-level memory findings --

    def assess_memory(self) -> None:
        for gpu in self.host.gpus:
            if gpu.lost:
                continue
            if gpu.coherent_memory:
                self.note(gpu, "coherent memory (NUMA node set): memory-based detection is off")
                continue
            if gpu.mig_enabled:
                self.note(gpu, "MIG enabled: memory-based detection is off")
                continue
            self.check_ghost(gpu)
            self.check_unaccounted(gpu)

    def check_ghost(self, gpu: GpuInfo) -> None:
        host, detection = self.host, self.detection
        figure, baseline, learned = self.baseline(gpu)
        if figure is None or baseline is None:
            memory = gpu.memory
            if memory is not None and memory.api == "v1":
                self.note(
                    gpu, "v1 memory API: no ghost detection until an idle baseline is learned"
                )
            elif memory is None or memory.allocated is None:
                self.note(gpu, "allocated memory unknown: no ghost detection")
            return
        if figure <= baseline + detection.ghost_margin:
            return
        excess = figure - baseline
        why_not: list[str] = []
        if gpu.minor is None:
            why_not.append("its minor number is unknown, so its holders cannot be found")
        if gpu.processes is None:
            why_not.append("its process list could not be read")
        live = [row.entry.pid for row in host.listings[gpu.uuid] if row.status != "dead"]
        if live:
            why_not.append(f"NVML lists live PID(s) {_pids(live)}")
        holders = [h.pid for h in host.holders_of(gpu) if not host.is_floor(h.pid)]
        if holders:
            why_not.append(f"held by PID(s) {_pids(holders)}")
        if not host.full_scan:
            why_not.append("the holder scan was targeted, not full")
        suspects = host.unreadable_suspects()
        if suspects:
            why_not.append(f"PID(s) {_pids(suspects)} could not be read (unknown is not none)")
        if why_not:
            self.note(gpu, f"{_mib(excess)} above baseline but not ghost: " + "; ".join(why_not))
            return
        dead = [row.entry.pid for row in host.listings[gpu.uuid]]
        self.add(
            FindingKind.GHOST_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {_mib(figure)} allocated, {_mib(excess)} above its "
            f"{'learned' if learned else 'default'} idle baseline, and no live process holds it",
            memory=excess,
            evidence={
                "allocated": figure,
                "baseline": baseline,
                "baseline_learned": learned,
                "margin": detection.ghost_margin,
                "memory_api": gpu.memory.api if gpu.memory is not None else None,
                "dead_pids": dead,
            },
        )

    def check_unaccounted(self, gpu: GpuInfo) -> None:
        host = self.host
        memory = gpu.memory
        if memory is None or memory.allocated is None or gpu.processes is None:
            return
        holders = [h.pid for h in host.holders_of(gpu) if not host.is_floor(h.pid)]
        if not holders:
            return
        baseline = self.baselines.get(gpu.uuid, self.detection.default_baseline)
        live = [row for row in host.listings[gpu.uuid] if row.status != "dead"]
        figures = [row.entry.used_memory for row in live]
        if any(value is None for value in figures):
            self.note(gpu, "a live owner's memory figure is unknown: unaccounted memory unchecked")
            return
        accounted = sum(value for value in figures if value is not None)
        excess = memory.allocated - accounted - baseline
        if excess <= self.detection.unaccounted_margin:
            return
        self.add(
            FindingKind.UNACCOUNTED_MEMORY,
            gpu,
            None,
            None,
            f"GPU {gpu.index} has {_mib(memory.allocated)} allocated but its live context owners "
            f"account for {_mib(accounted)}; {_mib(excess)} is unexplained",
            memory=excess,
            informational=True,
            evidence={
                "allocated": memory.allocated,
                "accounted": accounted,
                "baseline": baseline,
                "margin": self.detection.unaccounted_margin,
                "live_owners": [row.entry.pid for row in live],
                "holders": holders,
            },
        )

    def result(self) -> Assessment:
        order = {gpu.uuid: gpu.index for gpu in self.host.gpus}
        findings = sorted(
            self.findings,
            key=lambda f: (order.get(f.gpu or "", -1), f.kind.value, f.pid or 0),
        )
        roles = sorted(self.roles, key=lambda r: (order.get(r.gpu, -1), r.pid))
        return Assessment(
            findings=tuple(findings),
            roles=tuple(roles),
            report_only=self.report_only,
            state=AssessState(
                baselines=self.baselines,
                lineage=self.lineage,
                boot_id=self.host.snapshot.boot_id,
                unaccounted_since=self.unaccounted_since,
                owners=self.owners,
            ),
            notes={uuid: tuple(lines) for uuid, lines in self.notes.items()},
        )


def back_to_baseline(
    uuid: str, allocated: int | None, state: AssessState, detection: Detection
) -> bool | None:
    """After a reset: is this GPU's allocated memory back within the margin of its idle baseline?

    The baseline is the learned one, else the default; None when the memory is unknown.
    """
    if allocated is None:
        return None
    baseline = state.baselines.get(uuid, detection.default_baseline)
    return allocated <= baseline + detection.ghost_margin


def assess(
    snapshot: Snapshot,
    previous: AssessState,
    detection: Detection,
    ended_jobs: frozenset[str] | None = None,
) -> Assessment:
    """Judge one snapshot: findings with evidence, each holder's role, and the new state.

    Pure: reads only its arguments. ``ended_jobs`` holds job keys (``CgroupInfo.job_key``) that
    collection knows to have ended (default: ``snapshot.ended_jobs``); processes still living
    in them are ``abandoned``.
    """
    ended = snapshot.ended_jobs if ended_jobs is None else ended_jobs
    assessor = _Assessor(snapshot, previous, detection, ended)
    assessor.assess_listings()
    assessor.assess_holders()
    assessor.assess_memory()
    return assessor.result()


def needs_full_scan(snapshot: Snapshot, state: AssessState, detection: Detection) -> bool:
    """Whether a targeted scan left a question only a full scan can answer.

    True when some GPU has memory above its baseline plus the ghost margin that the live
    context owners NVML lists do not account for: the holder may be outside their trees.
    """
    if snapshot.holders.mode == "full":
        return False
    for gpu in snapshot.nvml.gpus:
        if gpu.lost or gpu.coherent_memory or gpu.memory is None or gpu.processes is None:
            continue
        figure = _memory_figure(gpu, state.baselines)
        if figure is None:
            continue
        key, value = figure
        baseline = state.baselines.get(key)
        if baseline is None:
            if key.endswith(V1_BASELINE_SUFFIX):
                continue
            baseline = detection.default_baseline
        used = [p.used_memory for p in gpu.processes]
        accounted = sum(u for u in used if u is not None)
        if value - accounted > baseline + detection.ghost_margin:
            return True
    return False


# --- small formatting helpers -----------------------------------------------------------------


def _process_evidence(
    proc: ProcessInfo, lineage: Mapping[ProcessIdentity, Lineage]
) -> dict[str, object]:
    recorded = lineage.get(proc.identity) if proc.identity is not None else None
    return {
        "ppid": proc.ppid,
        "pgid": proc.pgid,
        "sid": proc.sid,
        "user": proc.user,
        "cmdline": " ".join(proc.cmdline) if proc.cmdline is not None else None,
        "cgroup": proc.cgroup.path if proc.cgroup is not None else None,
        "job": proc.cgroup.job_key if proc.cgroup is not None else None,
        "recorded_ppid": recorded.ppid if recorded is not None else None,
        "first_seen": recorded.first_seen if recorded is not None else None,
    }


def _listed_pids(rows: Iterable[_Listing]) -> set[int]:
    return {row.entry.pid for row in rows}


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _mib(value: int) -> str:
    return f"{value // MIB} MiB"


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(str(pid) for pid in pids)
