"""What the passes of an assessment share: the results (``Assessment``, ``HolderRole``), PID
trust, the report-only conditions, and ``AssessorState``, one assessment's state while its
passes run with the helpers every pass uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.core.model import (
    MIB,
    Finding,
    FindingKind,
    GpuInfo,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.core.vocabulary import HolderRoleName
from gpuwatchd.decide.assess.baselines import compared_figure, learn_baselines
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.assess.state import (
    AssessState,
    Lineage,
    update_inheritance,
    update_lineage,
    update_owners,
)
from gpuwatchd.decide.health.xid_sources import XidNotice
from gpuwatchd.decide.mig.instances import NOT_JUDGED
from gpuwatchd.decide.policy import Detection

NODE = "node"  # key of node-wide entries in ``Assessment.report_only`` and ``HolderRole.gpu``


@dataclass(frozen=True)
class HolderRole:
    """How one holder (or NVML-listed PID) of one GPU is explained, for ``scan`` output.
    ``gpu`` is "node" for a process that holds only nvidiactl / nvidia-uvm; ``via`` says how
    the device file is held ("fd", "map"). The daemon's own processes never appear."""

    pid: int
    gpu: str
    role: HolderRoleName
    owner_pid: int | None
    via: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Assessment:
    """The outcome of one assessment. ``report_only``: a GPU UUID, or "node", to why nothing
    may be acted on there; ``notes``: a GPU UUID to why a check could not conclude."""

    findings: tuple[Finding, ...]
    roles: tuple[HolderRole, ...]
    report_only: Mapping[str, str]
    state: AssessState
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    xid_notices: tuple[XidNotice, ...] = ()


def _dead_pid_explained(
    host: HostView, pid: int, lineage: Mapping[ProcessIdentity, Lineage]
) -> bool:
    """We saw the dead listed PID alive, or a live process descends from it."""
    if any(ident.pid == pid for ident in lineage):
        return True
    for proc in host.procs.values():
        if pid in (proc.ppid, proc.pgid, proc.sid):
            return True
        recorded = lineage.get(proc.identity) if proc.identity is not None else None
        if recorded is not None and pid in (recorded.ppid, recorded.pgid, recorded.sid):
            return True
    return False


def _pid_trust_problem(
    host: HostView, detection: Detection, lineage: Mapping[ProcessIdentity, Lineage]
) -> str | None:
    """Why NVML's process lists cannot be trusted this poll, or None (docs/design-notes.md §3:
    one impossible PID, or ``pid_trust_min_unresolved`` unexplained dead ones)."""
    if host.invalid:
        shown = ", ".join(f"{pid} on {uuid}" for uuid, pid in host.invalid[:5])
        return f"NVML listed impossible PIDs ({shown}); process lists are not trusted"
    dead = sorted(host.listed_dead)
    unexplained = [pid for pid in dead if not _dead_pid_explained(host, pid, lineage)]
    if len(unexplained) >= detection.pid_trust_min_unresolved:
        shown = ", ".join(str(pid) for pid in unexplained[:8])
        return (
            f"{len(unexplained)} PIDs listed by NVML do not resolve and nothing explains them "
            f"({shown}); process lists are not trusted"
        )
    return None


def _report_only(host: HostView, trust_problem: str | None) -> dict[str, str]:
    snapshot, reading = host.snapshot, host.snapshot.nvml
    node: list[str] = []
    if not reading.available:
        node.append(f"NVML unavailable: {reading.error or 'no driver'}")
    if reading.wedged:
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
            result[gpu.uuid] = NOT_JUDGED
        elif gpu.processes is None:
            result[gpu.uuid] = "its process list could not be read"
        elif gpu.mig_enabled is None:
            result[gpu.uuid] = "its MIG mode could not be read: processes may live in MIG instances"
    return result


@dataclass
class Outcome:
    """The classification of one process that holds device files."""

    role: str
    note: str
    owner_pid: int | None = None
    kind: FindingKind | None = None
    gpu: GpuInfo | None = None  # the GPU the finding is about; None = first held GPU
    evidence: dict[str, object] = field(default_factory=dict)


class AssessorState:
    """One assessment's state while its passes run (``passes.py`` composes the passes)."""

    def __init__(self, snapshot: Snapshot, previous: AssessState, detection: Detection) -> None:
        self.host = HostView(snapshot)
        self.detection = detection
        host = self.host
        tracked = [host.procs[pid] for pid in host.holdings if pid in host.procs]
        tracked += [
            row.proc for rows in host.listings.values() for row in rows if row.proc is not None
        ]
        same_boot = snapshot.boot_id is not None and snapshot.boot_id == previous.boot_id
        # Identities and monotonic times of another boot mean nothing; baselines are kept.
        kept = previous if same_boot else AssessState()
        self.lineage = update_lineage(host, kept.lineage, tracked)
        self.inheritance = update_inheritance(host, kept.inheritance, self.lineage)
        self.baselines = learn_baselines(host, previous.baselines, detection)
        self.owners = update_owners(host, kept.owners, self.lineage)
        since = kept.unaccounted_since
        gpus = {gpu.uuid: gpu for gpu in host.gpus}
        unread = not snapshot.nvml.answered
        # A poll that cannot tell whether the memory is still unowned ends nothing.
        self.unaccounted_since = {
            uuid: at
            for uuid, at in since.items()
            if unread or (uuid in gpus and self.memory_untold(gpus[uuid]))
        }
        for gpu in host.gpus:
            if self.memory_without_owner(gpu) is not None:
                self.unaccounted_since[gpu.uuid] = since.get(gpu.uuid, snapshot.monotonic)
        self.report_only = _report_only(host, _pid_trust_problem(host, detection, self.lineage))
        self.findings: list[Finding] = []
        self.roles: list[HolderRole] = []
        self.notes: dict[str, list[str]] = {}
        self.stuck_done: set[int] = set()

    def note(self, gpu: GpuInfo, text: str) -> None:
        self.notes.setdefault(gpu.uuid, []).append(text)

    def blocked(self, gpus: Iterable[GpuInfo]) -> bool:
        return NODE in self.report_only or any(g.uuid in self.report_only for g in gpus)

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

    def memory_untold(self, gpu: GpuInfo) -> bool:
        """Whether this poll cannot tell if ``gpu`` holds memory without an owner (unread)."""
        figure = compared_figure(gpu, self.baselines, self.detection.default_baseline)
        unknown = gpu.lost or gpu.processes is None or gpu.coherent_memory is None
        return unknown or isinstance(figure, str)

    def memory_without_owner(self, gpu: GpuInfo) -> dict[str, object] | None:
        """Evidence that ``gpu`` holds memory above baseline+margin with no live owner at all."""
        if gpu.coherent_memory is not False or gpu.processes is None or gpu.lost:
            return None
        rows = self.host.listings[gpu.uuid]
        if any(r.status == "alive" or r.entry.pid in self.host.listed_alive for r in rows):
            return None
        compared = compared_figure(gpu, self.baselines, self.detection.default_baseline)
        if isinstance(compared, str):
            return None
        figure, baseline, learned = compared
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

    def role(self, pid: int, gpu: GpuInfo | None, role: str, owner: int | None, note: str) -> None:
        via: tuple[str, ...] = ()
        holding = self.host.holdings.get(pid)
        if gpu is not None and gpu.minor is not None and holding is not None:
            via = holding.via(gpu.minor)
        self.roles.append(
            HolderRole(
                pid, gpu.uuid if gpu is not None else NODE, HolderRoleName(role), owner, via, note
            )
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

    def result(self) -> Assessment:
        order = {gpu.uuid: gpu.index for gpu in self.host.gpus}
        findings = sorted(
            self.findings, key=lambda f: (order.get(f.gpu or "", -1), f.kind.value, f.pid or 0)
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
                inheritance=self.inheritance,
            ),
            notes={uuid: tuple(lines) for uuid, lines in self.notes.items()},
        )


def mib(value: int | None) -> str:
    """An amount of memory for a finding's text."""
    return "an unknown amount of" if value is None else f"{value // MIB} MiB"
