"""The ``gpuwatchd scan`` report as plain data: the JSON document for machines.

This module owns the shape of ``gpuwatchd scan --json`` (every field in ``docs/scan.md``):
``build_report`` turns a snapshot plus what the assessment concluded into JSON-able data. Its
text view is ``report_text.py`` (``render_text``, re-exported here); MIG parts are
``mig_report.py``. Pure: no I/O, no clock; it decides nothing and never invents a fact: an
unknown value is ``null``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from gpuwatchd.cli.mig_report import (
    mig_instances_json,
)
from gpuwatchd.core.model import (
    CgroupInfo,
    DeviceHolding,
    Finding,
    GpuHealth,
    GpuInfo,
    GpuMemory,
    NvmlProcess,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.decide.floor import driver_refusers
from gpuwatchd.decide.mig.instances import MigLayout, instance_view, mig_layout
from gpuwatchd.decide.verdict import NodeVerdict


class RoleLike(Protocol):
    """What the report needs to know about one holder's role (``assess.HolderRole`` fits).

    ``role`` is one of "context_owner", "worker", "management", "self", "orphaned", "hidden",
    "stuck", "unknown"; ``owner_pid`` is the context owner a worker belongs to (or the dead
    owner an orphan inherited from); ``via`` is ("fd",), ("map",) or both.
    """

    @property
    def pid(self) -> int: ...
    @property
    def gpu(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def owner_pid(self) -> int | None: ...
    @property
    def via(self) -> tuple[str, ...]: ...
    @property
    def note(self) -> str: ...


# --- building the JSON document ---------------------------------------------------------------


def build_report(
    snapshot: Snapshot,
    findings: Sequence[Finding],
    roles: Sequence[RoleLike],
    report_only: Mapping[str, str],
    baselines: Mapping[str, int],
    *,
    first_seen: Mapping[str, float] | None = None,
    now_wall: float | None = None,
    version: str,
    hostname: str | None = None,
    boot_time: float | None = None,
    clock_ticks: int | None = None,
    notes: Mapping[str, Sequence[str]] | None = None,
    verdict: NodeVerdict | None = None,
) -> dict[str, object]:
    """The ``scan --json`` document for one snapshot and its assessment. Pure.

    ``report_only`` maps a GPU UUID (or a node-level key) to why that scope is report-only;
    ``baselines`` maps a GPU UUID to its learned idle allocation in bytes; ``first_seen`` maps a
    finding key to the wall time it was first seen. ``boot_time`` (wall seconds) and
    ``clock_ticks`` (``SC_CLK_TCK``) turn start ticks into start times when both are given.
    ``notes`` maps a GPU UUID (or "node") to why a check could not conclude there.
    ``verdict`` is :func:`gpuwatchd.decide.verdict.judge` of the same snapshot and assessment
    (each GPU's ``verdict``, and the node's); None leaves them out.
    The daemon's own processes (``snapshot.self_pids``) are never listed as holders.
    """
    seen = first_seen or {}
    all_notes = notes or {}
    roles_by_key: dict[tuple[str, int], RoleLike] = {}
    for role in sorted(roles, key=lambda r: (r.gpu, r.pid)):
        roles_by_key.setdefault((role.gpu, role.pid), role)

    def facts(pid: int, *, listed: bool) -> dict[str, object]:
        info = snapshot.processes.get(pid)
        return _process_facts(info, boot_time, clock_ticks, missing_means_dead=listed)

    gpus, layout = _gpu_entries(snapshot, roles_by_key=roles_by_key, report_only=report_only,
                                baselines=baselines, notes=all_notes, facts=facts,
                                verdict=verdict)  # fmt: skip
    finding_order = _finding_order(snapshot, layout)
    return {
        "version": version,
        "time": snapshot.wall_time if now_wall is None else now_wall,
        "host": {
            "hostname": hostname,
            "boot_id": snapshot.boot_id,
            "host_namespaces": snapshot.host_namespaces,
            "mps_server_running": snapshot.mps_server_running,
        },
        "nvml": {
            "available": snapshot.nvml.available,
            "wedged": snapshot.nvml.wedged,
            "error": snapshot.nvml.error,
            "driver_version": snapshot.nvml.driver_version,
        },
        "scan_mode": snapshot.holders.mode,
        "gpus": gpus,
        "findings": [
            _finding_entry(finding, seen.get(finding.key))
            for finding in sorted(findings, key=finding_order)
        ],
        "node_holders": _node_holders(snapshot, roles_by_key, facts),
        "report_only": {key: report_only[key] for key in sorted(report_only)},
        "notes": {key: list(all_notes[key]) for key in sorted(all_notes)},
        "unreadable_pids": sorted(snapshot.holders.unreadable),
        "thread_tables_unread_pids": sorted(snapshot.holders.thread_tables_unread),
        **({} if verdict is None else {"verdict": _node_verdict(verdict)}),
    }


def _gpu_entries(
    snapshot: Snapshot,
    *,
    roles_by_key: Mapping[tuple[str, int], RoleLike],
    report_only: Mapping[str, str],
    baselines: Mapping[str, int],
    notes: Mapping[str, Sequence[str]],
    facts: _Facts,
    verdict: NodeVerdict | None,
) -> tuple[list[dict[str, object]], MigLayout]:
    """Each GPU's entry (:func:`_gpu_entry`) in index order, its MIG instances under it and its
    verdict (when judged), and the MIG layout the instances were placed by."""
    gpus = [
        _gpu_entry(
            gpu,
            snapshot,
            roles_by_key=roles_by_key,
            report_only=report_only,
            baselines=baselines,
            notes=notes.get(gpu.uuid, ()),
            facts=facts,
        )
        for gpu in sorted(snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid))
    ]
    # MIG (cli/mig_report.py): each GPU instance under its GPU, built as a GPU's entry is.
    layout = mig_layout(snapshot)
    view = instance_view(snapshot, layout)

    def instance_entry(instance: GpuInfo) -> dict[str, object]:
        notes_of = notes.get(instance.uuid, ())
        return _gpu_entry(instance, view, roles_by_key=roles_by_key, report_only=report_only,
                          baselines=baselines, notes=notes_of, facts=facts)  # fmt: skip

    for gpu_info, entry in zip(
        sorted(snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid)), gpus, strict=True
    ):
        entry["mig_instances"] = mig_instances_json(gpu_info, layout, instance_entry)
    if verdict is not None:
        judged = {g.uuid: g for g in verdict.gpus}
        for entry in gpus:
            one = judged.get(str(entry["uuid"]))
            entry["verdict"] = None if one is None else one.to_json()
    return gpus, layout


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
    return {
        "checked": whole["checked"],
        "error": whole["error"],
        "clean": whole["clean"],
        "not_clean": [g.uuid for g in verdict.gpus if not g.clean],
    }


def _node_holders(
    snapshot: Snapshot, roles_by_key: Mapping[tuple[str, int], RoleLike], facts: _Facts
) -> list[dict[str, object]]:
    """Holders no listed GPU accounts for: nvidiactl / nvidia-uvm only, or an unknown minor.

    They cannot be attributed to one GPU, yet they matter (they block resets), so they are
    listed rather than dropped.
    """
    known_minors = {gpu.minor for gpu in snapshot.nvml.gpus if gpu.minor is not None}
    known_uuids = {gpu.uuid for gpu in snapshot.nvml.gpus} | set(mig_layout(snapshot).instances)
    pids = {
        pid
        for pid, holding in snapshot.holders.holdings.items()
        if not holding.gpu_minors & known_minors
        and (holding.ctl or holding.uvm or holding.gpu_minors)
    }
    node_roles = {
        pid: role for (uuid, pid), role in roles_by_key.items() if uuid not in known_uuids
    }
    pids |= set(node_roles)
    entries: list[dict[str, object]] = []
    for pid in sorted(pids - set(snapshot.self_pids)):
        holding = snapshot.holders.holdings.get(pid)
        role = node_roles.get(pid)
        devices: list[str] = []
        if holding is not None:
            devices.extend(f"nvidia{minor}" for minor in sorted(holding.gpu_minors))
            if holding.ctl:
                devices.append("nvidiactl")
            if holding.uvm:
                devices.append("nvidia-uvm")
        entry: dict[str, object] = {
            "pid": pid,
            "role": None if role is None else role.role,
            "owner_pid": None if role is None else role.owner_pid,
            "note": None if role is None or not role.note else role.note,
            "devices": devices,
        }
        entry.update(facts(pid, listed=False))
        entries.append(entry)
    return entries


def _gpu_entry(
    gpu: GpuInfo,
    snapshot: Snapshot,
    *,
    roles_by_key: Mapping[tuple[str, int], RoleLike],
    report_only: Mapping[str, str],
    baselines: Mapping[str, int],
    notes: Sequence[str],
    facts: _Facts,
) -> dict[str, object]:
    listed = sorted(gpu.processes or (), key=lambda p: (p.pid, p.kind))
    listed_by_pid: dict[int, list[NvmlProcess]] = {}
    for process in listed:
        listed_by_pid.setdefault(process.pid, []).append(process)
    holdings: dict[int, DeviceHolding] = {}
    if gpu.minor is not None:
        holdings = {h.pid: h for h in snapshot.holders.holders_of(gpu.minor)}

    processes = _listed_entries(gpu, listed, holdings, roles_by_key, facts)
    holders = _holder_entries(
        gpu, snapshot, holdings, listed_by_pid, roles_by_key=roles_by_key, facts=facts
    )
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "pci_bus_id": gpu.pci_bus_id,
        "minor": gpu.minor,
        "lost": gpu.lost,
        "error": gpu.error,
        "mig_enabled": gpu.mig_enabled,
        "persistence_mode": gpu.persistence_mode,
        "coherent_memory": gpu.coherent_memory,
        "numa_node": gpu.numa_node,
        "architecture": gpu.architecture,
        "nvlink_active": gpu.nvlink_active,
        "reset_needs_nvlink_peers": gpu.reset_needs_nvlink_peers,
        "health": _health_entry(gpu.health),
        "memory": _memory_entry(gpu.memory, baselines.get(gpu.uuid)),
        "report_only": report_only.get(gpu.uuid),
        "notes": list(notes),
        "processes_known": gpu.processes is not None,
        "processes": processes,
        "holders": holders,
        # Whose open device node would make the driver refuse a reset now (docs/reset.md).
        "reset_refused_by": driver_refusers(snapshot.holders, gpu.minor, snapshot.self_pids),
    }


def _listed_entries(
    gpu: GpuInfo,
    listed: Sequence[NvmlProcess],
    holdings: Mapping[int, DeviceHolding],
    roles_by_key: Mapping[tuple[str, int], RoleLike],
    facts: _Facts,
) -> list[dict[str, object]]:
    """A GPU entry's ``processes``: what NVML listed on it, each with its role and facts."""
    processes: list[dict[str, object]] = []
    for process in listed:
        role = roles_by_key.get((gpu.uuid, process.pid))
        holding = holdings.get(process.pid)
        entry: dict[str, object] = {
            "pid": process.pid,
            "used_memory": process.used_memory,
            "type": process.kind,
            "role": None if role is None else role.role,
            "via": _via(gpu, holding, role),
        }
        entry.update(facts(process.pid, listed=True))
        processes.append(entry)
    return processes


def _holder_entries(
    gpu: GpuInfo,
    snapshot: Snapshot,
    holdings: Mapping[int, DeviceHolding],
    listed_by_pid: Mapping[int, list[NvmlProcess]],
    *,
    roles_by_key: Mapping[tuple[str, int], RoleLike],
    facts: _Facts,
) -> list[dict[str, object]]:
    """A GPU entry's ``holders``: every process the holder scan or a role puts on it (never
    the daemon's own), by PID, with what NVML listed of it."""
    holder_pids = (set(holdings) | {pid for (uuid, pid) in roles_by_key if uuid == gpu.uuid}) - set(
        snapshot.self_pids
    )
    holders: list[dict[str, object]] = []
    for pid in sorted(holder_pids):
        role = roles_by_key.get((gpu.uuid, pid))
        holding = holdings.get(pid)
        entries = listed_by_pid.get(pid, [])
        entry: dict[str, object] = {
            "pid": pid,
            "role": None if role is None else role.role,
            "owner_pid": None if role is None else role.owner_pid,
            "note": None if role is None or not role.note else role.note,
            "via": _via(gpu, holding, role),
            "ctl": None if holding is None else holding.ctl,
            "uvm": None if holding is None else holding.uvm,
            "nvml_listed": bool(entries),
            "used_memory": _sum_known([e.used_memory for e in entries]) if entries else None,
        }
        entry.update(facts(pid, listed=bool(entries)))
        holders.append(entry)
    return holders


class _Facts(Protocol):
    def __call__(self, pid: int, /, *, listed: bool) -> dict[str, object]: ...


def _via(gpu: GpuInfo, holding: DeviceHolding | None, role: RoleLike | None) -> list[str]:
    """How a process holds this GPU: from the holder scan when it saw one, else the role."""
    if holding is not None and gpu.minor is not None:
        return list(holding.via(gpu.minor))
    if role is not None:
        return list(role.via)
    return []


def _sum_known(values: Iterable[int | None]) -> int | None:
    """The sum of the values, or None when any of them is unknown."""
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def _health_entry(health: GpuHealth | None) -> dict[str, object] | None:
    """GPU health as read this poll (docs/scan.md); Xid history is in the findings' evidence."""
    if health is None:
        return None
    return {
        "events": health.events.value,
        "xids": [{"xid": x.xid, "wall": x.wall} for x in health.xids],
        "recovery_action": health.recovery_action,
        "recovery_action_support": health.recovery_support.value,
        "remapped_rows": {
            "support": health.remap_support.value,
            "correctable": health.remap_correctable,
            "uncorrectable": health.remap_uncorrectable,
            "pending": health.remap_pending,
            "failure": health.remap_failure,
        },
        "retired_pages": {
            "support": health.pages_support.value,
            "pending": health.pages_pending,
            "single_bit": health.pages_single_bit,
            "double_bit": health.pages_double_bit,
        },
        "fabric": {
            "support": health.fabric_support.value,
            "state": health.fabric_state,
            "status": health.fabric_status,
            "health_mask": health.fabric_health_mask,
            "health_summary": health.fabric_health_summary,
        },
    }


def _memory_entry(memory: GpuMemory | None, baseline: int | None) -> dict[str, object]:
    if memory is None:
        return {
            "total": None,
            "used": None,
            "reserved": None,
            "free": None,
            "baseline": baseline,
            "api": None,
            "used_v1": None,
        }
    return {
        "total": memory.total,
        "used": memory.allocated,
        "reserved": memory.reserved,
        "free": memory.free,
        "baseline": baseline,
        "api": memory.api,
        "used_v1": memory.used_v1,
    }


def _process_facts(
    info: ProcessInfo | None,
    boot_time: float | None,
    clock_ticks: int | None,
    *,
    missing_means_dead: bool,
) -> dict[str, object]:
    """Host facts of one process; every value None when they were not collected.

    A PID that NVML lists is always looked up, so missing facts mean it is not in /proc
    (``alive`` False). A device holder was seen in /proc by the holder scan, so missing facts
    for it mean only that they are unknown (``alive`` None).
    """
    if info is None:
        return {
            "alive": False if missing_means_dead else None,
            "user": None,
            "uid": None,
            "state": None,
            "start_ticks": None,
            "started": None,
            "ppid": None,
            "pgid": None,
            "sid": None,
            "comm": None,
            "exe": None,
            "exe_trusted": None,
            "cmdline": None,
            "nspid": None,
            "cgroup": None,
        }
    started = None
    if info.start_ticks is not None and boot_time is not None and clock_ticks:
        started = boot_time + info.start_ticks / clock_ticks
    return {
        "alive": not info.is_zombie,
        "user": info.user,
        "uid": info.uid,
        "state": info.state,
        "start_ticks": info.start_ticks,
        "started": started,
        "ppid": info.ppid,
        "pgid": info.pgid,
        "sid": info.sid,
        "comm": info.comm,
        "exe": info.exe,
        "exe_trusted": info.exe_trusted,
        "cmdline": None if info.cmdline is None else list(info.cmdline),
        "nspid": None if info.nspid is None else list(info.nspid),
        "cgroup": _cgroup_entry(info.cgroup),
    }


def _cgroup_entry(cgroup: CgroupInfo | None) -> dict[str, object] | None:
    if cgroup is None:
        return None
    return {
        "path": cgroup.path,
        "container_id": cgroup.container_id,
        "container_runtime": cgroup.container_runtime,
        "pod_uid": cgroup.pod_uid,
        "slurm_job": cgroup.slurm_job,
        "slurm_step": cgroup.slurm_step,
        "systemd_unit": cgroup.systemd_unit,
        "delegated": cgroup.delegated,
        "job": cgroup.job_key,
    }


def _finding_entry(finding: Finding, first_seen: float | None) -> dict[str, object]:
    return {
        "kind": finding.kind.value,
        "gpu": finding.gpu,
        "pid": finding.pid,
        "start_ticks": finding.start_ticks,
        "reason": finding.reason,
        "memory": finding.memory,
        "actionable": finding.actionable,
        "evidence": _jsonable(finding.evidence),
        "key": finding.key,
        "first_seen": first_seen,
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
