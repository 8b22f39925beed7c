"""The ``gpuwatchd scan --json`` document (every field in ``docs/scan.md``), built from a
snapshot and its assessment, each MIG GPU's instances under it; its text view is
``report_text.py``. Pure: it decides nothing, and an unknown value is ``null``."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.core.checked import as_flag, as_text
from gpuwatchd.core.model import (
    DeviceHolding,
    Finding,
    GpuHealth,
    GpuInfo,
    MigDevice,
    NvmlProcess,
    Snapshot,
    as_int,
    fields_of,
)
from gpuwatchd.decide.assess.shared import HolderRole
from gpuwatchd.decide.floor import driver_refusers
from gpuwatchd.decide.mig.instances import MigLayout, instance_gpu, instance_view, mig_layout
from gpuwatchd.decide.verdict import NodeVerdict

# What a GPU entry, a process entry, its cgroup and a finding copy as they are, in the document's
# order, each with the reader (or types) that report_read.py takes it back with; None: built here
# from more than the one attribute, or read back by hand, or not at all.
GPU_FIELDS: Mapping[str, Callable[[object], object] | None] = {
    "index": None,
    "uuid": None,
    "name": as_text,
    "pci_bus_id": as_text,
    "minor": as_int,
    "lost": None,
    "error": None,
    "mig_enabled": as_flag,
    "persistence_mode": None,
    "coherent_memory": None,
    "numa_node": None,
    "architecture": as_int,
    "nvlink_active": as_int,
    "reset_needs_nvlink_peers": None,
}
PROCESS_FACTS: Mapping[str, Callable[[object], object] | None] = {
    "alive": None,
    "user": as_text,
    "uid": as_int,
    "state": as_text,
    "start_ticks": as_int,
    "started": None,
    "ppid": as_int,
    "pgid": as_int,
    "sid": as_int,
    "comm": as_text,
    "exe": as_text,
    "exe_trusted": as_flag,
    "cmdline": None,
    "nspid": None,
    "cgroup": None,
}
PROCESS_COPIED = {key: read for key, read in PROCESS_FACTS.items() if read is not None}
_MEMORY = ("total", "used=allocated", "reserved", "free", "api", "used_v1")
CGROUP_FIELDS: Mapping[str, Callable[[object], object]] = {
    "path": as_text,
    "container_id": as_text,
    "container_runtime": as_text,
    "pod_uid": as_text,
    "slurm_job": as_text,
    "slurm_step": as_text,
    "systemd_unit": as_text,
    "delegated": as_flag,
}
_CGROUP = (*CGROUP_FIELDS, "job=job_key")
# The parts of a GPU entry a MIG instance's entry keeps (the rest is the parent's to say).
_KEPT = ("memory", "report_only", "notes", "processes_known", "processes", "holders")
FINDING_FIELDS: Mapping[str, tuple[type, ...] | None] = {
    "kind": None,
    "gpu": (str, type(None)),
    "pid": (int, type(None)),
    "start_ticks": (int, type(None)),
    "reason": (str,),
    "memory": (int, type(None)),
    "actionable": (bool,),
    "evidence": None,
    "key": None,
}


def build_report(
    snapshot: Snapshot,
    findings: Sequence[Finding],
    roles: Sequence[HolderRole],
    report_only: Mapping[str, str],
    baselines: Mapping[str, int],
    *,
    first_seen: Mapping[str, float] | None = None,
    version: str,
    hostname: str | None = None,
    boot_time: float | None = None,
    clock_ticks: int | None = None,
    notes: Mapping[str, Sequence[str]] | None = None,
    verdict: NodeVerdict | None = None,
) -> dict[str, object]:
    """The ``scan --json`` document for one snapshot and its assessment. Pure.

    ``report_only`` and ``notes``: per GPU UUID (or node key), why it is report-only and why a
    check could not conclude; ``baselines``: each GPU's learned idle allocation; ``first_seen``:
    the wall time each finding key was first seen; ``boot_time`` and ``clock_ticks`` together
    give start times; ``verdict`` (:func:`gpuwatchd.decide.verdict.judge`) adds the verdicts."""
    seen = first_seen or {}
    all_notes = notes or {}
    roles_by_key: dict[tuple[str, int], HolderRole] = {}
    for role in sorted(roles, key=lambda r: (r.gpu, r.pid)):
        roles_by_key.setdefault((role.gpu, role.pid), role)
    layout = mig_layout(snapshot)
    entries = _Entries(
        snapshot, roles_by_key, report_only, baselines, all_notes, boot_time, clock_ticks
    )
    return {
        "version": version,
        "time": snapshot.wall_time,
        "host": {
            "hostname": hostname,
            **fields_of(snapshot, ("boot_id", "host_namespaces", "mps_server_running")),
        },
        "nvml": fields_of(snapshot.nvml, ("available", "wedged", "error", "driver_version")),
        "scan_mode": snapshot.holders.mode,
        "gpus": entries.gpus(layout, verdict),
        "findings": [
            {
                **fields_of(finding, tuple(FINDING_FIELDS)),
                "kind": finding.kind.value,
                "evidence": _jsonable(finding.evidence),
                "first_seen": seen.get(finding.key),
            }
            for finding in sorted(findings, key=_finding_order(snapshot, layout))
        ],
        "node_holders": entries.node_holders(layout),
        "report_only": {key: report_only[key] for key in sorted(report_only)},
        "notes": {key: list(all_notes[key]) for key in sorted(all_notes)},
        "unreadable_pids": sorted(snapshot.holders.unreadable),
        "thread_tables_unread_pids": sorted(snapshot.holders.thread_tables_unread),
        **({} if verdict is None else {"verdict": _node_verdict(verdict)}),
    }


@dataclasses.dataclass(frozen=True)
class _Entries:
    """The report's GPU, MIG instance and holder entries, built from the same inputs."""

    snapshot: Snapshot
    roles: Mapping[tuple[str, int], HolderRole]
    report_only: Mapping[str, str]
    baselines: Mapping[str, int]
    notes: Mapping[str, Sequence[str]]
    boot_time: float | None
    clock_ticks: int | None

    def facts(self, pid: int, *, listed: bool) -> dict[str, object]:
        """Host facts of one process; every value None when not collected. Missing facts of a
        PID NVML ``listed`` mean it is not in /proc (``alive`` False); of a device holder (seen
        there), unknown."""
        facts = dict.fromkeys(PROCESS_FACTS)  # each key keeps its place in the document
        info = self.snapshot.processes.get(pid)
        if info is None:
            return {**facts, "alive": False if listed else None}
        started = None
        if info.start_ticks is not None and self.boot_time is not None and self.clock_ticks:
            started = self.boot_time + info.start_ticks / self.clock_ticks
        return {
            **facts,
            **fields_of(info, tuple(PROCESS_COPIED)),
            "alive": not info.is_zombie,
            "started": started,
            "cmdline": None if info.cmdline is None else list(info.cmdline),
            "nspid": None if info.nspid is None else list(info.nspid),
            "cgroup": None if info.cgroup is None else fields_of(info.cgroup, _CGROUP),
        }

    def gpus(self, layout: MigLayout, verdict: NodeVerdict | None) -> list[dict[str, object]]:
        view = instance_view(self.snapshot, layout)
        judged = {} if verdict is None else {g.uuid: g.to_json() for g in verdict.gpus}
        gpus = []
        for gpu in sorted(self.snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid)):
            entry = self.gpu(gpu, self.snapshot)
            entry["mig_instances"] = self.mig_instances(gpu, layout, view)
            if verdict is not None:
                entry["verdict"] = judged.get(gpu.uuid)
            gpus.append(entry)
        return gpus

    def gpu(self, gpu: GpuInfo, snapshot: Snapshot) -> dict[str, object]:
        listed = sorted(gpu.processes or (), key=lambda p: (p.pid, p.kind))
        held = () if gpu.minor is None else snapshot.holders.holders_of(gpu.minor)
        holdings = {h.pid: h for h in held}
        memory = dict.fromkeys(("total", "used", "reserved", "free", "baseline", "api", "used_v1"))
        if gpu.memory is not None:  # each key keeps its place in the document
            memory.update(fields_of(gpu.memory, _MEMORY))
        memory["baseline"] = self.baselines.get(gpu.uuid)
        return {
            **fields_of(gpu, tuple(GPU_FIELDS)),
            "health": _health_entry(gpu.health),
            "memory": memory,
            "report_only": self.report_only.get(gpu.uuid),
            "notes": list(self.notes.get(gpu.uuid, ())),
            "processes_known": gpu.processes is not None,
            "processes": [self.listed(gpu, p, holdings.get(p.pid)) for p in listed],
            "holders": self.holders(gpu, snapshot, holdings, listed),
            # Whose open device node would make the driver refuse a reset now (docs/reset.md).
            "reset_refused_by": driver_refusers(snapshot.holders, gpu.minor, snapshot.self_pids),
        }

    def mig_instances(
        self, gpu: GpuInfo, layout: MigLayout, view: Snapshot
    ) -> list[dict[str, object]] | None:
        """The ``mig_instances`` of ``gpu``'s entry: None unless MIG is on and its devices
        read; unjudged instances are listed from NVML alone (``judged`` false, no holders), a
        judged one's entry is built as a GPU's is, over ``view`` (:func:`instance_view`)."""
        if gpu.mig_enabled is not True or gpu.mig_devices is None:
            return None
        if gpu.uuid not in layout.judged:
            return [
                {
                    "gi": d.gi,
                    "ci": [] if d.ci is None else [d.ci],
                    "uuid": d.uuid,
                    "mig_uuids": [d.uuid],
                    "profile": d.profile,
                    **_placed(d),
                    "judged": False,
                }
                for d in gpu.mig_devices
            ]
        found: list[dict[str, object]] = []
        for instance in layout.instances_of(gpu.uuid):
            whole = self.gpu(instance_gpu(instance), view)
            found.append(
                {
                    "gi": instance.gi,
                    "ci": list(instance.cis),
                    "uuid": instance.uuid,
                    "mig_uuids": [d.uuid for d in instance.devices],
                    "profile": instance.profile,
                    **_placed(instance.memory_device),
                    **{key: whole.get(key) for key in _KEPT if key in whole},
                    "judged": True,
                }
            )
        return found

    def listed(
        self, gpu: GpuInfo, process: NvmlProcess, holding: DeviceHolding | None
    ) -> dict[str, object]:
        role = self.roles.get((gpu.uuid, process.pid))
        return {
            "pid": process.pid,
            "used_memory": process.used_memory,
            "type": process.kind,
            "role": None if role is None else role.role,
            "via": _via(gpu, holding, role),
            **self.facts(process.pid, listed=True),
        }

    def holders(
        self,
        gpu: GpuInfo,
        snapshot: Snapshot,
        holdings: Mapping[int, DeviceHolding],
        listed: Sequence[NvmlProcess],
    ) -> list[dict[str, object]]:
        """A GPU entry's ``holders``: every process the holder scan or a role puts on it (never
        the daemon's own), by PID, with what NVML listed of it."""
        used_by_pid: dict[int, list[int | None]] = {}
        for process in listed:
            used_by_pid.setdefault(process.pid, []).append(process.used_memory)
        pids = set(holdings) | {pid for (uuid, pid) in self.roles if uuid == gpu.uuid}
        holders: list[dict[str, object]] = []
        for pid in sorted(pids - set(snapshot.self_pids)):
            role, holding = self.roles.get((gpu.uuid, pid)), holdings.get(pid)
            used = used_by_pid.get(pid, [])
            known = [amount for amount in used if amount is not None]
            holders.append(
                {
                    "pid": pid,
                    **_role_fields(role),
                    "via": _via(gpu, holding, role),
                    "ctl": None if holding is None else holding.ctl,
                    "uvm": None if holding is None else holding.uvm,
                    "nvml_listed": bool(used),
                    "used_memory": sum(known) if used and len(known) == len(used) else None,
                    **self.facts(pid, listed=bool(used)),
                }
            )
        return holders

    def node_holders(self, layout: MigLayout) -> list[dict[str, object]]:
        """Holders no listed GPU accounts for (nvidiactl / nvidia-uvm only, or an unknown
        minor): they block resets, so they are listed rather than dropped."""
        snapshot = self.snapshot
        known_minors = {gpu.minor for gpu in snapshot.nvml.gpus if gpu.minor is not None}
        known_uuids = {gpu.uuid for gpu in snapshot.nvml.gpus} | set(layout.instances)
        pids = {
            pid
            for pid, holding in snapshot.holders.holdings.items()
            if not holding.gpu_minors & known_minors
            and (holding.ctl or holding.uvm or holding.gpu_minors)
        }
        node_roles = {
            pid: role for (uuid, pid), role in self.roles.items() if uuid not in known_uuids
        }
        entries: list[dict[str, object]] = []
        for pid in sorted((pids | set(node_roles)) - set(snapshot.self_pids)):
            holding = snapshot.holders.holdings.get(pid)
            devices: list[str] = []
            if holding is not None:
                devices.extend(f"nvidia{minor}" for minor in sorted(holding.gpu_minors))
                devices.extend(
                    name
                    for name, held in (("nvidiactl", holding.ctl), ("nvidia-uvm", holding.uvm))
                    if held
                )
            entries.append(
                {
                    "pid": pid,
                    **_role_fields(node_roles.get(pid)),
                    "devices": devices,
                    **self.facts(pid, listed=False),
                }
            )
        return entries


def _finding_order(
    snapshot: Snapshot, layout: MigLayout
) -> Callable[[Finding], tuple[int, str, int, int, str]]:
    """The findings' sort key: by GPU index (a MIG instance's by its GPU's; node findings
    last), then kind, PID, start ticks and key."""
    index_of = {gpu.uuid: gpu.index for gpu in snapshot.nvml.gpus}
    index_of.update({uuid: i.parent.index for uuid, i in layout.instances.items()})

    def finding_order(finding: Finding) -> tuple[int, str, int, int, str]:
        index = index_of.get(finding.gpu, 1 << 30) if finding.gpu is not None else 1 << 31
        pid = -1 if finding.pid is None else finding.pid
        ticks = -1 if finding.start_ticks is None else finding.start_ticks
        return (index, finding.kind.value, pid, ticks, finding.key)

    return finding_order


def _node_verdict(verdict: NodeVerdict) -> dict[str, object]:
    whole = verdict.to_json()
    judged = {key: whole[key] for key in ("checked", "error", "clean")}
    return {**judged, "not_clean": [g.uuid for g in verdict.gpus if not g.clean]}


def _role_fields(role: HolderRole | None) -> dict[str, object]:
    if role is None:
        return {"role": None, "owner_pid": None, "note": None}
    return {"role": role.role, "owner_pid": role.owner_pid, "note": role.note or None}


def _via(gpu: GpuInfo, holding: DeviceHolding | None, role: HolderRole | None) -> list[str]:
    """How a process holds this GPU: from the holder scan when it saw one, else the role."""
    if holding is not None and gpu.minor is not None:
        return list(holding.via(gpu.minor))
    return [] if role is None else list(role.via)


def _health_entry(health: GpuHealth | None) -> dict[str, object] | None:
    """GPU health as read this poll (docs/scan.md); Xid history is in the findings' evidence."""
    if health is None:
        return None

    def group(prefix: str, *names: str) -> dict[str, object]:
        """``{"support": <prefix>_support, name: <prefix>_<name>, ...}``."""
        support = getattr(health, f"{prefix}_support").value
        return {"support": support, **{name: getattr(health, f"{prefix}_{name}") for name in names}}

    return {
        "events": health.events.value,
        "xids": [{"xid": x.xid, "wall": x.wall} for x in health.xids],
        "recovery_action": health.recovery_action,
        "recovery_action_support": health.recovery_support.value,
        "remapped_rows": group("remap", "correctable", "uncorrectable", "pending", "failure"),
        "retired_pages": group("pages", "pending", "single_bit", "double_bit"),
        "fabric": group("fabric", "state", "status", "health_mask", "health_summary"),
    }


def _jsonable(value: object) -> object:
    """Plain JSON data for an evidence value: tuples become lists, sets sorted lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return [_jsonable(item) for item in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return str(value)


def _placed(device: MigDevice) -> dict[str, object]:
    placement = None if device.placement is None else list(device.placement)
    return {"gi_profile_id": device.gi_profile_id, "placement": placement}
