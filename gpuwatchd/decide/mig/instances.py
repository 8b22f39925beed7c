"""MIG in decisions: which GPU instance each holder uses (by its capability files, never by
the parent device node every user holds), and the per-instance view assess judges.

In detail: docs/internals.md, section `gpuwatchd.decide.mig.instances`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd.core.model import (
    DeviceHolding,
    Finding,
    FindingKind,
    GpuInfo,
    MigCapability,
    MigDevice,
    NvmlProcess,
    Snapshot,
)

# Device "minors" of GPU instances in the view: past MINORBITS (20), so never a real node's.
INSTANCE_MINOR_BASE = 1 << 21

WHOLE_GPU = (
    "MIG enabled: the GPU as a whole is report-only; its GPU instances are judged one by one"
)
NOT_JUDGED = "MIG enabled: processes and memory live in MIG instances"


@dataclass(frozen=True)
class MigInstance:
    """One GPU instance of a judged MIG GPU, named by its first compute instance's MIG UUID
    (``MIG-GPU-<uuid>/<gi>/<ci>`` when unknown); ``devices``: one per CI, in CI order."""

    parent: GpuInfo
    gi: int
    uuid: str
    devices: tuple[MigDevice, ...]
    minor: int  # its device minor in the view

    @property
    def cis(self) -> tuple[int, ...]:
        return tuple(d.ci for d in self.devices if d.ci is not None)

    @property
    def profile(self) -> str | None:
        """The first MIG device's profile, less its CI part when the GI has several CIs."""
        names = [d.profile for d in self.devices if d.profile is not None]
        if not names:
            return None
        if len(self.devices) > 1 and names[0].count(".") == 2:
            return names[0].split(".", 1)[1]
        return names[0]

    @property
    def memory_device(self) -> MigDevice:
        return self.devices[0]

    def describe(self) -> str:
        profile = f" ({self.profile})" if self.profile else ""
        return f"MIG GPU instance {self.gi}{profile} of GPU {self.parent.index}"

    def evidence(self) -> dict[str, object]:
        return {
            "gpu": self.parent.uuid,
            "gpu_index": self.parent.index,
            "gi": self.gi,
            "ci": list(self.cis),
            "profile": self.profile,
            "mig_uuids": [d.uuid for d in self.devices],
        }


@dataclass(frozen=True)
class MigLayout:
    """What one snapshot says about its MIG GPUs: the judged instances by UUID, which parents
    are judged (or why not), PID → instance UUID → routes ("fd", "map") its capabilities
    name, PID → the judged parents it holds with no capability of theirs (``parent_only``)."""

    instances: Mapping[str, MigInstance] = field(default_factory=dict)
    judged: frozenset[str] = frozenset()
    unjudged: Mapping[str, str] = field(default_factory=dict)
    attributed: Mapping[int, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    parent_only: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    parent_minors: frozenset[int] = frozenset()

    def instance_of(self, uuid: str | None) -> MigInstance | None:
        return None if uuid is None else self.instances.get(uuid)

    def instances_of(self, parent_uuid: str) -> list[MigInstance]:
        return [i for i in self.instances.values() if i.parent.uuid == parent_uuid]


def _why_not_judged(gpu: GpuInfo, snapshot: Snapshot) -> str | None:
    """Why the instances of MIG GPU ``gpu`` cannot be judged one by one, or None."""
    if gpu.mig_devices is None:
        return "its MIG devices could not be read"
    if gpu.minor is None:
        return "its minor number is unknown"
    if snapshot.mig_caps is None:
        return snapshot.mig_caps_error or "the MIG capability minors were not read"
    if any(d.gi is None for d in gpu.mig_devices):
        return "a MIG device's GPU instance id could not be read"
    return None


def _instances(gpu: GpuInfo) -> list[MigInstance]:
    by_gi: dict[int, list[MigDevice]] = {}
    for device in gpu.mig_devices or ():
        if device.gi is not None:
            by_gi.setdefault(device.gi, []).append(device)
    found = []
    for gi, devices in sorted(by_gi.items()):
        devices.sort(key=lambda d: (d.ci is None, d.ci or 0, d.index))
        first = devices[0]
        uuid = first.uuid or f"MIG-{gpu.uuid}/{gi}/{first.ci if first.ci is not None else 0}"
        minor = INSTANCE_MINOR_BASE + (gpu.minor or 0) * 256 + gi
        found.append(MigInstance(gpu, gi, uuid, tuple(devices), minor))
    return found


def _capabilities(
    holding: DeviceHolding, table: Mapping[int, MigCapability]
) -> list[tuple[MigCapability | None, str]]:
    """Each capability a holder holds, with its route; None for a minor the table lacks."""
    held: list[tuple[MigCapability | None, str]] = []
    for minors, route in ((holding.cap_minors_fd, "fd"), (holding.cap_minors_map, "map")):
        held += [(table.get(minor), route) for minor in sorted(minors)]
    held += [(cap, "fd") for cap in sorted(holding.cap_files, key=lambda c: c.order)]
    return held


def mig_layout(snapshot: Snapshot) -> MigLayout:
    """The MIG GPUs of ``snapshot``, their GPU instances, and who holds which. Pure."""
    instances: dict[str, MigInstance] = {}
    by_place: dict[tuple[int, int], MigInstance] = {}
    judged: set[str] = set()
    unjudged: dict[str, str] = {}
    parents: dict[int, GpuInfo] = {}
    for gpu in snapshot.nvml.gpus:
        if gpu.mig_enabled is not True or gpu.lost:
            continue
        why = _why_not_judged(gpu, snapshot)
        if why is not None:
            unjudged[gpu.uuid] = why
            continue
        judged.add(gpu.uuid)
        parents[gpu.minor or 0] = gpu
        for instance in _instances(gpu):
            instances[instance.uuid] = instance
            by_place[(gpu.minor or 0, instance.gi)] = instance
    table = snapshot.mig_caps or {}
    attributed: dict[int, dict[str, tuple[str, ...]]] = {}
    parent_only: dict[int, tuple[str, ...]] = {}
    for pid, holding in sorted(snapshot.holders.holdings.items()):
        mine: dict[str, tuple[str, ...]] = {}
        for cap, route in _capabilities(holding, table):
            # A minor the table does not name, or an instance NVML does not list: nothing.
            named = None if cap is None else by_place.get((cap.gpu_minor, cap.gi))
            if cap is None or named is None or (cap.ci is not None and cap.ci not in named.cis):
                continue
            routes = mine.get(named.uuid, ())
            if route not in routes:
                mine[named.uuid] = (*routes, route)
        if mine:
            attributed[pid] = mine
        used = {instances[u].parent.minor for u in mine}
        lonely = [
            parents[m].uuid for m in sorted(holding.gpu_minors) if m in parents and m not in used
        ]
        if lonely:
            parent_only[pid] = tuple(lonely)
    return MigLayout(
        instances, frozenset(judged), unjudged, attributed, parent_only, frozenset(parents)
    )


def _merge_processes(devices: Iterable[MigDevice]) -> tuple[NvmlProcess, ...] | None:
    found: dict[int, NvmlProcess] = {}  # a PID's first entry, in order
    for device in devices:
        if device.processes is None:
            return None
        for entry in device.processes:
            found.setdefault(entry.pid, entry)
    return tuple(found.values())


def instance_gpu(instance: MigInstance) -> GpuInfo:
    """A GPU instance as a GPU of its own, for the assessment."""
    errors = [d.error for d in instance.devices if d.error]
    return replace(
        instance.parent,  # never lost: a lost GPU is not judged
        uuid=instance.uuid,
        name=instance.memory_device.name,
        minor=instance.minor,
        memory=instance.memory_device.memory,
        processes=_merge_processes(instance.devices),
        mig_enabled=False,
        error="; ".join(errors) or None,
        health=None,
        mig_devices=None,
    )


def instance_view(snapshot: Snapshot, layout: MigLayout) -> Snapshot:
    """``snapshot`` with each judged MIG GPU's instances as GPUs of their own. Pure."""
    if not layout.judged:
        return snapshot
    gpus: list[GpuInfo] = []
    for gpu in snapshot.nvml.gpus:
        if gpu.uuid not in layout.judged:
            gpus.append(gpu)
            continue
        gpus.append(replace(gpu, minor=None, processes=()))
        gpus += [instance_gpu(i) for i in layout.instances_of(gpu.uuid)]
    parent_minors = layout.parent_minors
    holdings: dict[int, DeviceHolding] = {}
    for pid, holding in snapshot.holders.holdings.items():
        named = layout.attributed.get(pid, {}).items()
        via_fd = {layout.instances[uuid].minor for uuid, routes in named if "fd" in routes}
        via_map = {layout.instances[uuid].minor for uuid, routes in named if "map" in routes}
        holdings[pid] = replace(
            holding,
            gpu_minors_fd=holding.gpu_minors_fd - parent_minors | via_fd,
            gpu_minors_map=holding.gpu_minors_map - parent_minors | via_map,
        )
    holders = replace(snapshot.holders, holdings=holdings)
    return replace(snapshot, nvml=replace(snapshot.nvml, gpus=tuple(gpus)), holders=holders)


# --- the assessment, readable again -----------------------------------------------------------


def _parent_only_finding(finding: Finding, parents: tuple[str, ...], snapshot: Snapshot) -> Finding:
    """A holder that holds only judged MIG parents' nodes (no GPU of the view): say so, under
    its GPU (a stuck or abandoned one is dirt there, as on a whole GPU), never a target."""
    indexes = [g.index for g in snapshot.nvml.gpus if g.uuid in parents]
    shown = ", ".join(str(i) for i in indexes)
    said = (
        f"holds the device node of MIG GPU(s) {shown} but the capability of none of their "
        "instances: which instance it uses cannot be told, so it is never a target (it "
        "blocks a reset of the whole GPU)"
    )
    if finding.evidence.get("unattributed") is not True:
        said = f"{finding.reason}; {said}"  # stuck, abandoned: what it is, then this
    return replace(
        finding,
        gpu=parents[0],
        actionable=False,
        reason=said,
        evidence={**finding.evidence, "mig_parent_only": True, "gpus": list(parents)},
    )


def annotate_findings(
    findings: Iterable[Finding], layout: MigLayout, snapshot: Snapshot
) -> list[Finding]:
    """Name the instance in each finding about one; say what parent-only holders are. Ghost
    memory beside a parent-only CUDA holder (it may be its) is only ``unaccounted_memory``."""
    result: list[Finding] = []
    for finding in (_with_parents(f, layout) for f in findings):
        instance = layout.instance_of(finding.gpu)
        if instance is not None:
            evidence = {**finding.evidence, "mig": instance.evidence()}
            reason = f"{finding.reason} [{instance.describe()}]"
            kind, actionable = finding.kind, finding.actionable
            if kind is FindingKind.GHOST_MEMORY:
                suspects = _parent_only_cuda(layout, snapshot, instance.parent.uuid)
                if suspects:
                    evidence["parent_only_holders"] = suspects
                    kind, actionable = FindingKind.UNACCOUNTED_MEMORY, False
                    reason += (
                        f"; not ghost: PID(s) {', '.join(map(str, suspects))} hold the GPU's "
                        "node and nvidia-uvm with no instance capability (which instance they "
                        "use cannot be told)"
                    )
            result.append(
                replace(finding, kind=kind, actionable=actionable, reason=reason, evidence=evidence)
            )
        elif finding.gpu is None and finding.pid is not None and finding.pid in layout.parent_only:
            result.append(_parent_only_finding(finding, layout.parent_only[finding.pid], snapshot))
        else:
            result.append(finding)
    return result


def _with_parents(finding: Finding, layout: MigLayout) -> Finding:
    """A finding about a holder of a GPU of the view that holds judged parents' nodes too (no
    capability of theirs): about those GPUs as well, as about every GPU whose file it holds."""
    parents = () if finding.pid is None else layout.parent_only.get(finding.pid, ())
    held = finding.evidence.get("gpus")
    if finding.gpu is None or not parents or not isinstance(held, list):
        return finding
    return replace(finding, evidence={**finding.evidence, "gpus": [*held, *parents]})


def _parent_only_cuda(layout: MigLayout, snapshot: Snapshot, parent_uuid: str) -> list[int]:
    holdings = snapshot.holders.holdings
    return [
        pid
        for pid, parents in sorted(layout.parent_only.items())
        if parent_uuid in parents
        and pid not in snapshot.self_pids
        and (holding := holdings.get(pid)) is not None
        and holding.uvm
    ]


def annotate_report_only(report_only: Mapping[str, str], layout: MigLayout) -> dict[str, str]:
    """The parents' report-only reasons: judged instance by instance, or why not."""
    result = {**report_only, **dict.fromkeys(layout.judged, WHOLE_GPU)}
    for uuid, why in layout.unjudged.items():
        if uuid in result and why != "its MIG devices could not be read":
            result[uuid] = f"{NOT_JUDGED}; its instances cannot be judged: {why}"
    return result


def parent_of(snapshot: Snapshot, uuid: str | None) -> tuple[GpuInfo, MigDevice] | None:
    """The MIG GPU and MIG device a finding's ``gpu`` names, when it names an instance."""
    if uuid is None:
        return None  # a device whose UUID is unknown is named by no finding
    for gpu in snapshot.nvml.gpus:
        for device in gpu.mig_devices or ():
            ci = device.ci if device.ci is not None else 0
            if uuid in (device.uuid, f"MIG-{gpu.uuid}/{device.gi}/{ci}"):
                return gpu, device
    return None


def busy_instances(snapshot: Snapshot, gpu: GpuInfo) -> str | None:
    """Why MIG GPU ``gpu`` is not idle in every GPU instance (docs/internals.md), or None."""
    if gpu.mig_enabled is False:
        return None
    if gpu.mig_enabled is None:
        return "its MIG instances cannot be told idle: its MIG mode could not be read"
    layout = mig_layout(snapshot)
    if gpu.uuid in layout.unjudged:
        return f"its MIG instances cannot be told idle: {layout.unjudged[gpu.uuid]}"
    busy: list[str] = []
    for instance in layout.instances_of(gpu.uuid):
        listed, holders, unknown = instance_users(snapshot, layout, instance)
        busy += unknown
        if users := listed | holders:
            busy.append(f"GPU instance {instance.gi} is in use (PID {shown_pids(users)})")
    return "; ".join(busy) or None


def instance_users(
    snapshot: Snapshot, layout: MigLayout, instance: MigInstance
) -> tuple[set[int], set[int], list[str]]:
    """The live PIDs NVML lists in ``instance``, the holders of its capabilities (the daemon's
    own left out of both), and one line for each of its process lists that is unknown."""
    listed: set[int] = set()
    unknown: list[str] = []
    for device in instance.devices:
        if device.processes is None:
            unknown.append(f"GPU instance {instance.gi}: its process list is unknown")
        for entry in device.processes or ():
            proc = snapshot.processes.get(entry.pid)
            if proc is not None and not proc.is_zombie:
                listed.add(entry.pid)
    holders = {pid for pid, named in layout.attributed.items() if instance.uuid in named}
    own = snapshot.self_pids
    return listed - own, holders - own, unknown


def shown_pids(pids: Iterable[int]) -> str:
    """The first five of ``pids``, in order, for a message."""
    return ", ".join(str(pid) for pid in sorted(pids)[:5])
