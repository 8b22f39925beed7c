"""The one verdict: may this GPU be handed to a new job? And what ``run --once`` makes of it.

``check-clean``, ``run --once``, ``scan`` and the daemon's status all call :func:`judge`, none
looks at findings itself, so a prolog, an epilog and an admin are told the same.

In detail: docs/internals.md, section `gpuwatchd.decide.verdict`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpuwatchd.core.model import DeviceHolding, Finding, FindingKind, GpuInfo, Snapshot
from gpuwatchd.core.vocabulary import Cleanliness, HolderRoleName, LeftoverName
from gpuwatchd.decide import kinds
from gpuwatchd.decide.assess.baselines import compared_figure
from gpuwatchd.decide.assess.shared import NODE, Assessment, HolderRole, mib
from gpuwatchd.decide.floor import is_infrastructure
from gpuwatchd.decide.mig.instances import parent_of
from gpuwatchd.decide.plan.state import PlanState
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.targets import protect_match

_MANAGEMENT = HolderRoleName.MANAGEMENT.value  # reset blockers that are not dirt, by why
_PROTECTED = "protected"
_UNKNOWN_KINDS = frozenset(
    {
        LeftoverName.UNKNOWN_HOLDER.value,
        LeftoverName.UNREADABLE.value,
        LeftoverName.PROCESSES_UNKNOWN.value,
    }
)
_UNLISTED = "NVML could not list its processes"
_NO_MINOR = "its minor number is unknown: who holds its device file cannot be told"
_MIG_UNKNOWN = "its MIG mode could not be read: processes may live in MIG instances not listed"
_MIG_UNREAD = "its MIG instances could not all be read: processes may live in those not listed"
_MIG_UNJUDGED = "its MIG instances could not be judged, nor the memory left in them: "
# What the GPU itself says: dirt even while the host's processes are not seen.
_GPU_FACTS = frozenset(
    {kind.value for kind in kinds.HEALTH}
    | {LeftoverName.LOST.value, LeftoverName.MIG_UNFINISHED.value}
)
_UNSEEN = "not in the host PID/cgroup namespaces, or cannot tell: its holders may not be seen"
# What may go away without anyone acting (a dead context torn down, a zombie reaped).
SETTLING = frozenset(
    {kind.value for kind in kinds.SETTLING}
    | {LeftoverName.LEFTOVER_MEMORY.value, LeftoverName.UNKNOWN_HOLDER.value}
)


@dataclass(frozen=True)
class Reason:
    """One thing said about a GPU. ``kind``: a finding kind or a :class:`LeftoverName` for
    what makes it not clean; the holder's role, ``management`` or ``protected`` for a reset
    blocker."""

    kind: str
    pid: int | None
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", str(self.kind))  # a plain string, never an enum

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "pid": self.pid, "reason": self.text}


@dataclass(frozen=True)
class GpuVerdict:
    """The verdict on one GPU. ``reasons`` say why it is not clean (dirt first, then what is
    unknown); ``reset_blockers`` name processes that are not dirt but hold its device file
    (a reset would wait for them); ``notes`` say what could not be judged (memory)."""

    uuid: str
    index: int
    pci_bus_id: str | None
    state: Cleanliness
    reasons: tuple[Reason, ...] = ()
    reset_blockers: tuple[Reason, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return self.state is Cleanliness.CLEAN

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "reasons": [r.to_json() for r in self.reasons],
            "reset_blockers": [r.to_json() for r in self.reset_blockers],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class NodeVerdict:
    """The verdict on every GPU NVML reported; ``unavailable`` says why none could be judged."""

    gpus: tuple[GpuVerdict, ...]
    unavailable: str | None = None

    @property
    def clean(self) -> bool | None:
        """Every GPU clean; None when NVML could not be asked."""
        return None if self.unavailable is not None else all(g.clean for g in self.gpus)

    def to_json(self) -> dict[str, object]:
        return {
            "checked": self.unavailable is None,
            "error": self.unavailable,
            "clean": self.clean,
            "gpus": [
                {"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, **g.to_json()}
                for g in self.gpus
            ],
        }


# --- the verdict ------------------------------------------------------------------------------


class _Judge:
    def __init__(self, snapshot: Snapshot, assessment: Assessment, policy: Policy) -> None:
        self.snapshot = snapshot
        self.assessment = assessment
        self.policy = policy
        self.processes = snapshot.processes
        self.gpus = sorted(snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid))
        # By whole GPU: a MIG instance's holders are its GPU's, as its findings are.
        self.gpu_roles = [(self.whole(role.gpu), role) for role in assessment.roles]
        self.roles: dict[tuple[str, int], HolderRole] = {}
        for uuid, role in self.gpu_roles:
            self.roles.setdefault((uuid, role.pid), role)
        self.reasons: dict[str, list[Reason]] = {g.uuid: [] for g in self.gpus}
        self.excused: dict[tuple[str, int], Reason] = {}
        self.notes: dict[str, list[str]] = {g.uuid: [] for g in self.gpus}
        # The holdings by GPU minor, and those of nvidiactl/nvidia-uvm only (None), indexed once.
        self.holdings: dict[int | None, list[tuple[int, DeviceHolding]]] = {}
        for pid, holding in sorted(snapshot.holders.holdings.items()):
            for key in holding.gpu_minors or ((None,) if holding.ctl or holding.uvm else ()):
                self.holdings.setdefault(key, []).append((pid, holding))

    def role(self, uuid: str, pid: int) -> HolderRole | None:
        return self.roles.get((uuid, pid)) or self.roles.get((NODE, pid))

    def excuse(self, finding: Finding, uuid: str) -> Reason | None:
        """Why ``finding`` is not dirt on GPU ``uuid`` (a management client or infrastructure,
        or a process ``protect`` names), as the reset blocker it still is. None: it is dirt."""
        pid = finding.pid
        if pid is None:  # about the GPU itself: no process to excuse, so it is dirt
            return None
        role = self.role(uuid, pid)
        proc = self.processes.get(pid)
        name = proc.comm if proc is not None and proc.comm else "?"
        if (role is not None and role.role is HolderRoleName.MANAGEMENT) or (
            finding.evidence.get("nvml_only") is True
        ):
            note = role.note if role is not None else "NVML-only client"
            return Reason(_MANAGEMENT, pid, f"pid {pid} ({name}): management client: {note}")
        if proc is not None and is_infrastructure(proc):
            return Reason(_MANAGEMENT, pid, f"pid {pid} ({name}): infrastructure")
        matched = None if proc is None else protect_match(proc, self.policy)
        if matched is not None:
            why = f"{finding.kind.value}: {finding.reason}"
            return Reason(_PROTECTED, pid, f"pid {pid} ({name}): protected, {matched} ({why})")
        evidence = finding.evidence
        if (
            finding.kind is FindingKind.HIDDEN_HOLDER
            and evidence.get("likely_heir") is not True
            and evidence.get("undecided") is not True
        ):
            # Holds the device, nothing ties it to memory left behind: it only blocks a reset.
            return Reason(HolderRoleName.HIDDEN.value, pid, f"pid {pid} ({name}): {finding.reason}")
        return None

    def gpus_of(self, finding: Finding) -> list[str]:
        """The GPUs ``finding`` is about, each once (a MIG instance's as its GPU)."""
        named: list[object] = [finding.gpu]
        held = finding.evidence.get("gpus")
        if finding.kind in kinds.HOLDING_DEVICE and isinstance(held, list):
            named += held  # dirt on every GPU whose file it holds
        wholes = dict.fromkeys(self.whole(u) for u in named if isinstance(u, str))
        return [u for u in wholes if u in self.reasons]

    def whole(self, uuid: str) -> str:
        """The GPU's UUID for a MIG instance's (its finding is about its GPU), any other as is."""
        mig = parent_of(self.snapshot, uuid)
        return uuid if mig is None else mig[0].uuid

    def add_findings(self) -> None:
        for finding in self.assessment.findings:
            uuids = self.gpus_of(finding)
            if not uuids and finding.gpu is None and finding.pid is not None:
                continue  # holds only nvidiactl/nvidia-uvm: a reset blocker everywhere, below
            if not uuids:  # about no GPU this poll read (assess names none such): dirt on all
                uuids = list(self.reasons)
            for uuid in uuids:
                excused = self.excuse(finding, uuid)
                if excused is not None and finding.pid is not None:
                    self.excused.setdefault((uuid, finding.pid), excused)
                    continue
                kind = finding.kind.value
                if finding.evidence.get("undecided") is True:
                    kind = LeftoverName.UNKNOWN_HOLDER.value  # the orphan rule could not decide
                self.reasons[uuid].append(Reason(kind, finding.pid, finding.reason))

    def add_unknowns(self) -> None:
        unread = self.unreadable()
        for gpu in self.gpus:
            reasons = self.reasons[gpu.uuid]
            if gpu.lost:
                lost = gpu.error or "NVML reports the GPU lost"
                reasons.insert(0, Reason(LeftoverName.LOST, None, lost))
                continue
            if gpu.processes is None:
                reasons.append(Reason(LeftoverName.PROCESSES_UNKNOWN, None, _UNLISTED))
            elif gpu.mig_enabled is None:
                reasons.append(Reason(LeftoverName.PROCESSES_UNKNOWN, None, _MIG_UNKNOWN))
            elif gpu.mig_enabled and (
                gpu.mig_devices is None
                or any(d.gi is None or d.processes is None for d in gpu.mig_devices)
            ):
                reasons.append(Reason(LeftoverName.PROCESSES_UNKNOWN, None, _MIG_UNREAD))
            elif gpu.mig_enabled and self.snapshot.mig_caps is None:  # who uses which instance
                why = _MIG_UNJUDGED + (self.snapshot.mig_caps_error or "mig-minors not read")
                reasons.append(Reason(LeftoverName.PROCESSES_UNKNOWN, None, why))
            if gpu.minor is None:
                reasons.append(Reason(LeftoverName.UNKNOWN_HOLDER, None, _NO_MINOR))
            reasons += dict.fromkeys(  # once, if unknown in several of a MIG GPU's instances
                Reason(LeftoverName.UNKNOWN_HOLDER, role.pid, role.note)
                for uuid, role in self.gpu_roles
                if uuid == gpu.uuid and role.role is HolderRoleName.UNKNOWN
            )
            if unread is not None:
                reasons.append(unread)

    def unreadable(self) -> Reason | None:
        """The processes (infrastructure aside) whose fds or maps could not be read, if any."""
        holders = self.snapshot.holders
        pids = sorted(
            pid
            for pid in holders.unreadable - self.snapshot.self_pids
            if (proc := self.processes.get(pid)) is None or not is_infrastructure(proc)
        )
        if not pids:
            return None
        shown = ", ".join(str(pid) for pid in pids[:8])
        more = f" and {len(pids) - 8} more" if len(pids) > 8 else ""
        capped = len(holders.thread_tables_unread.intersection(pids))
        why = f" ({capped} with more threads' own fd tables than a scan reads)" if capped else ""
        text = f"the fds/maps of PID(s) {shown}{more} could not be read{why}"
        return Reason(LeftoverName.UNREADABLE, pids[0], f"{text}: what they hold is unknown")

    def add_memory(self, gpu: GpuInfo) -> str | None:
        """Adds ``leftover_memory``: allocated memory above the idle baseline plus the margin
        that no live process accounts for. Returns why memory could not be judged, or None."""
        found = {r.kind for r in self.reasons[gpu.uuid]}
        said = {k.value for k in kinds.MEMORY | kinds.LISTING}
        if gpu.lost or gpu.processes is None or found & said:
            return None
        coherent = gpu.coherent_memory
        if coherent is None:
            return "coherent memory unknown (its NUMA node could not be read)"
        if coherent or gpu.mig_enabled:
            return "coherent memory" if coherent else "MIG enabled"
        detection = self.policy.detection
        compared = compared_figure(gpu, self.assessment.state.baselines, detection.default_baseline)
        if isinstance(compared, str):
            return compared
        value, baseline, learned = compared
        live = [
            entry
            for entry in gpu.processes
            if entry.pid not in self.snapshot.self_pids
            and (proc := self.processes.get(entry.pid)) is not None
            and not proc.is_zombie
        ]
        figures = [entry.used_memory for entry in live]
        if any(f is None for f in figures):
            return "a live owner's memory figure is unknown"
        accounted = sum(f for f in figures if f is not None)
        margin = detection.unaccounted_margin if live else detection.ghost_margin
        excess = value - accounted - baseline
        if excess <= margin:
            return None
        owners = f", {mib(accounted)} of it live processes'" if live else ""
        which = "learned" if learned else "default"
        text = f"{mib(value)} allocated{owners}: {mib(excess)} above its {which} idle baseline"
        text += " that no live process accounts for"
        self.reasons[gpu.uuid].append(Reason(LeftoverName.LEFTOVER_MEMORY, None, text))
        return None

    def reset_blockers(self, gpu: GpuInfo) -> list[Reason]:
        """Holders of the GPU's device file (and of nvidiactl/nvidia-uvm only) that are not dirt
        here, infrastructure aside (the reset procedure itself stops it)."""
        dirty = {r.pid for r in self.reasons[gpu.uuid] if r.pid is not None}
        found: list[Reason] = []
        for pid, holding in self._holders_of(gpu.minor):
            node_only = not holding.gpu_minors  # _holders_of lists those of nvidiactl/-uvm only
            if pid in self.snapshot.self_pids or pid in dirty:
                continue
            proc = self.processes.get(pid)
            if proc is not None and is_infrastructure(proc):
                continue
            excused = self.excused.get((gpu.uuid, pid))
            if excused is None and node_only:  # excused on any GPU: it holds none of them
                excused = next((r for (_, p), r in sorted(self.excused.items()) if p == pid), None)
            if excused is not None:
                found.append(excused)
                continue
            role = self.role(gpu.uuid, pid)
            name = proc.comm if proc is not None and proc.comm else "?"
            kind = role.role.value if role is not None else "holder"
            label = _role_label(role, node_only)
            found.append(Reason(kind, pid, f"pid {pid} ({name}): {label}"))
        return found

    def _holders_of(self, minor: int | None) -> list[tuple[int, DeviceHolding]]:
        """The holdings on GPU ``minor`` and those of nvidiactl/nvidia-uvm only, by PID."""
        node_only = self.holdings.get(None, [])
        if minor is None:
            return node_only
        return sorted(self.holdings.get(minor, []) + node_only, key=lambda item: item[0])

    def verdict(self, unfinished: Mapping[str, str]) -> NodeVerdict:
        reading = self.snapshot.nvml
        if not reading.available:
            return NodeVerdict((), reading.error or "NVIDIA driver/NVML not available")
        if reading.wedged:
            return NodeVerdict((), "NVML did not answer within nvml_timeout (driver wedged?)")
        self.add_findings()
        # A MIG GPU instance whose re-creation stopped halfway (plan's ``mig_unfinished``): the
        # GPU is not as its users left it, whatever its findings say now.
        for uuid, why in sorted(unfinished.items()):
            if uuid in self.reasons:
                self.reasons[uuid].append(Reason(LeftoverName.MIG_UNFINISHED.value, None, why))
        self.add_unknowns()
        for gpu in self.gpus:
            if (unjudged := self.add_memory(gpu)) is not None:
                self.notes[gpu.uuid].append(f"memory not judged: {unjudged}")
        result = []
        blind = self.snapshot.host_namespaces is not True
        for gpu in self.gpus:
            reasons = self.reasons[gpu.uuid]
            dirt = [r for r in reasons if r.kind not in _UNKNOWN_KINDS]
            unknown = [r for r in reasons if r.kind in _UNKNOWN_KINDS]
            unseen = [r for r in dirt if blind and r.kind not in _GPU_FACTS]
            if unseen:  # about processes (or memory) this scan may not see: unknown, not dirt
                dirt = [r for r in dirt if r.kind in _GPU_FACTS]
                unknown = [Reason(LeftoverName.UNKNOWN_HOLDER, None, _UNSEEN), *unseen, *unknown]
            state = (
                Cleanliness.DIRTY if dirt else Cleanliness.UNKNOWN if unknown else Cleanliness.CLEAN
            )
            result.append(
                GpuVerdict(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    pci_bus_id=gpu.pci_bus_id,
                    state=state,
                    reasons=tuple(dirt + unknown),
                    reset_blockers=tuple(self.reset_blockers(gpu)),
                    notes=tuple(self.notes[gpu.uuid]),
                )
            )
        return NodeVerdict(tuple(result))


def judge(
    snapshot: Snapshot,
    assessment: Assessment,
    policy: Policy,
    *,
    unfinished: Mapping[str, str] | None = None,
) -> NodeVerdict:
    """Whether each GPU of ``snapshot`` may be handed to a new job, given its ``assessment``;
    ``unfinished`` maps a GPU UUID to why a MIG recovery on it was left half done: dirt. Pure."""
    return _Judge(snapshot, assessment, policy).verdict(unfinished or {})


# --- run --once: done, wait, or nothing more will change ---------------------------------------


class OnceStep(enum.Enum):
    """Where ``run --once`` stands after a poll (:func:`once_progress`)."""

    DONE = "done"  # nothing under way, every GPU clean: exit 0
    WAIT = "wait"  # something is under way, or may still settle: poll again (until --timeout)
    STUCK = "stuck"  # nothing under way, and what is left will not change by waiting: exit 75


def once_progress(
    verdict: NodeVerdict, busy: Sequence[str], unread: str | None = None
) -> tuple[OnceStep, list[str]]:
    """Whether ``run --once`` is done, and what is left (``busy``, what the acting side has
    under way, first; then each GPU that is not clean). STUCK at once when nothing is under way
    and every such GPU has a reason that does not settle by itself; ``verdict`` was judged.
    Never done while the daemon's saved state is unknown (``unread``: why): waiting will not
    tell what it held."""
    dirty = [g for g in verdict.gpus if not g.clean]
    left = [*busy, *(_summary(g) for g in dirty)]
    if busy or (dirty and not all(any(r.kind not in SETTLING for r in g.reasons) for g in dirty)):
        return OnceStep.WAIT, left
    if unread is not None:
        return OnceStep.STUCK, [*left, cannot_tell(unread)]
    return (OnceStep.STUCK if dirty else OnceStep.DONE), left


def describe(gpu: GpuVerdict) -> str:
    """``GPU 1 GPU-…: orphaned <why> (and 2 more)``: the GPU and its first reason."""
    if not gpu.reasons:
        return f"GPU {gpu.index} {gpu.uuid}: {gpu.state.value}"
    first = gpu.reasons[0]
    more = f" (and {len(gpu.reasons) - 1} more)" if len(gpu.reasons) > 1 else ""
    return f"GPU {gpu.index} {gpu.uuid}: {first.kind} {first.text}".rstrip() + more


def _summary(gpu: GpuVerdict) -> str:
    """``GPU 0 GPU-…: dead_process pid 4241, orphaned pid 4242``: every reason, briefly."""
    reasons = ", ".join(
        r.kind + (f" pid {r.pid}" if r.pid is not None else "") for r in gpu.reasons
    )
    return f"GPU {gpu.index} {gpu.uuid}: {reasons or gpu.state.value}"


def _role_label(role: HolderRole | None, node_only: bool) -> str:
    if role is None:
        return "holds nvidiactl/nvidia-uvm only" if node_only else "holds its device file"
    if role.role is HolderRoleName.WORKER and role.owner_pid is not None:
        return f"worker of PID {role.owner_pid} (a live job)"
    if role.role is HolderRoleName.CONTEXT_OWNER:
        return f"context owner (a live job): {role.note}"
    if role.role is HolderRoleName.MANAGEMENT:
        return f"management client: {role.note}"
    return f"{role.role.value}: {role.note}"


# How the daemon's latched dry run after a saved state it could not use begins its reason.
UNREADABLE = "the saved state could not be read"
STATE_UNREAD = "state_unread"  # the reason a GPU is not called clean while that state is unknown


def cannot_tell(unread: str) -> str:
    """Why no GPU may be called clean when the daemon's saved state (``unread``: why it could not
    be read) is unknown: ``check-clean``, ``scan`` and ``run --once`` say it alike."""
    return (
        f"cannot tell whether the GPUs are clean: {unread} (a MIG recovery or reset the daemon "
        "left half done would not be seen)"
    )


def lost_state(plan: PlanState) -> str | None:
    """Why the daemon's saved state is unknown while ``plan`` is latched on one it could not read
    and moved aside (the latch's reason); None otherwise."""
    reason = plan.forced_reason or ""
    return reason if plan.forced_dry_run and reason.startswith(UNREADABLE) else None


def unread_verdict(verdict: NodeVerdict, unread: str) -> NodeVerdict:
    """``verdict`` with each GPU judged clean made unknown (``state_unread``): the daemon's saved
    state (``unread``: why it is unknown) may hold work left half done on it."""
    reason = Reason(STATE_UNREAD, None, cannot_tell(unread))
    gpus = tuple(
        replace(g, state=Cleanliness.UNKNOWN, reasons=(reason,)) if g.clean else g
        for g in verdict.gpus
    )
    return replace(verdict, gpus=gpus)
