"""The ``gpuwatchd scan`` report: one JSON document for machines, one text view for humans.

This module owns the shape of ``gpuwatchd scan --json`` (docs/architecture.md, public interfaces,
every field documented in
``docs/scan.md``) and the layout of the plain ``gpuwatchd scan`` view. ``build_report`` turns a
snapshot plus what the assessment concluded into plain JSON-able data; ``render_text`` turns that
data into aligned text. Both are pure: no I/O, no clock, no environment. They decide nothing —
roles and findings come from the assessment — and they never invent facts: an unknown value is
``null`` in JSON and ``?`` in text.

``render_text`` reads the report as plain data (it may come from a file or another version), so
it checks every value it uses and never raises on a missing or oddly typed one.

Both halves live in one module, long (about 830 lines), because they share every field name: a field
added to the document and to its text view is one change in one place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gpuwatchd.checked import as_map as _as_map
from gpuwatchd.checked import as_text as _as_str
from gpuwatchd.cli.mig_report import (
    instance_uuids,
    mig_instance_lines,
    mig_instances_json,
    mig_judged,
    parent_rows,
)
from gpuwatchd.cli.spared import spared_lines
from gpuwatchd.decide.floor import driver_refusers
from gpuwatchd.decide.mig import instance_view, mig_layout
from gpuwatchd.decide.verdict import NodeVerdict
from gpuwatchd.escape import escape
from gpuwatchd.model import (
    CgroupInfo,
    DeviceHolding,
    Finding,
    GpuHealth,
    GpuInfo,
    GpuMemory,
    NvmlProcess,
    ProcessInfo,
    Snapshot,
    as_int,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
COMMAND_WIDTH = 60  # characters of a command line shown in the text view


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

    gpus = [
        _gpu_entry(
            gpu,
            snapshot,
            roles_by_key=roles_by_key,
            report_only=report_only,
            baselines=baselines,
            notes=all_notes.get(gpu.uuid, ()),
            facts=facts,
        )
        for gpu in sorted(snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid))
    ]
    # MIG (cli/mig_report.py): each GPU instance under its GPU, built as a GPU's entry is.
    layout = mig_layout(snapshot)
    view = instance_view(snapshot, layout)

    def instance_entry(instance: GpuInfo) -> dict[str, object]:
        notes_of = all_notes.get(instance.uuid, ())
        return _gpu_entry(instance, view, roles_by_key=roles_by_key, report_only=report_only,
                          baselines=baselines, notes=notes_of, facts=facts)  # fmt: skip

    for gpu_info, entry in zip(
        sorted(snapshot.nvml.gpus, key=lambda g: (g.index, g.uuid)), gpus, strict=True
    ):
        entry["mig_instances"] = mig_instances_json(gpu_info, layout, instance_entry)
    index_of = {gpu.uuid: gpu.index for gpu in snapshot.nvml.gpus}
    index_of.update({uuid: i.parent.index for uuid, i in layout.instances.items()})
    if verdict is not None:
        judged = {g.uuid: g for g in verdict.gpus}
        for entry in gpus:
            one = judged.get(str(entry["uuid"]))
            entry["verdict"] = None if one is None else one.to_json()

    def finding_order(finding: Finding) -> tuple[int, str, int, int, str]:
        index = index_of.get(finding.gpu, 1 << 30) if finding.gpu is not None else 1 << 31
        pid = -1 if finding.pid is None else finding.pid
        ticks = -1 if finding.start_ticks is None else finding.start_ticks
        return (index, finding.kind.value, pid, ticks, finding.key)

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
        **({} if verdict is None else {"verdict": _node_verdict(verdict)}),
    }


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

    holder_pids = (set(holdings) | {pid for (uuid, pid) in roles_by_key if uuid == gpu.uuid}) - set(
        snapshot.self_pids
    )
    holders: list[dict[str, object]] = []
    for pid in sorted(holder_pids):
        role = roles_by_key.get((gpu.uuid, pid))
        holding = holdings.get(pid)
        entries = listed_by_pid.get(pid, [])
        entry = {
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


# --- rendering text ---------------------------------------------------------------------------

_ROLE_LABELS = {
    "context_owner": "context owner",
    "management": "management client",
    "self": "gpuwatchd",
    "hidden": "hidden holder",
    "stuck": "stuck (D state)",
    "unknown": "unknown",
}
_ALARM_ROLES = frozenset({"orphaned", "stuck"})

_BOLD, _RED, _YELLOW, _DIM = "1", "31", "33", "2"


def render_text(
    report: Mapping[str, object], *, color: bool = False, command_width: int = COMMAND_WIDTH
) -> str:
    """The human view of a ``build_report`` document, ending with a newline. Pure.

    Per GPU: a header (index, name, UUID, PCI bus id), a memory line, a table of every process
    that NVML lists or that holds the GPU's device file, then that GPU's findings. Then the
    node: notes (NVML trouble, report-only reasons, unreadable processes), processes holding
    only nvidiactl / nvidia-uvm, and findings tied to no listed GPU. ANSI colours only
    when ``color`` is True. Unknown values print as ``?``, absent ones as ``-``.
    """
    paint = _painter(color)
    now = _as_float(report.get("time"))
    lines = [_title_line(report)]
    gpu_uuids: set[str] = set()
    findings = [_as_map(f) for f in _as_list(report.get("findings"))]
    for gpu in (_as_map(g) for g in _as_list(report.get("gpus"))):
        uuid = _as_str(gpu.get("uuid"))
        if uuid is not None:
            gpu_uuids.add(uuid)
        lines.append("")
        lines.extend(_gpu_lines(gpu, findings, now, paint, command_width))
    gpu_uuids |= instance_uuids(report)
    node_findings = [f for f in findings if _as_str(f.get("gpu")) not in gpu_uuids]
    notes = _node_notes(report, gpu_uuids)
    holders = [_as_map(h) for h in _as_list(report.get("node_holders"))]
    if notes or node_findings or holders:
        lines.append("")
        lines.append(paint("node", _BOLD))
        lines.extend(f"  {paint(note, _YELLOW)}" for note in notes)
        if holders:
            lines.append("  holding NVIDIA device files of no listed GPU:")
            lines.extend(_node_holder_lines(holders, now, paint, command_width))
        lines.extend(_finding_lines(node_findings, now, paint))
    return "\n".join(lines) + "\n"


class _Paint(Protocol):
    def __call__(self, text: str, code: str, /) -> str: ...


def _painter(color: bool) -> _Paint:
    def paint(text: str, code: str, /) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if color and text else text

    return paint


def _title_line(report: Mapping[str, object]) -> str:
    host = _as_map(report.get("host"))
    nvml = _as_map(report.get("nvml"))
    findings = _as_list(report.get("findings"))
    parts = [
        f"gpuwatchd {_text(report.get('version'))} scan",
        f"host {_text(host.get('hostname'))}",
        f"driver {_text(nvml.get('driver_version'))}",
        f"{len(_as_list(report.get('gpus')))} GPUs",
        f"{len(findings)} findings",
        f"{_text(report.get('scan_mode'))} holder scan",
    ]
    view = _as_map(report.get("daemon_view"))
    if view.get("used") is True:
        age = view.get("age")
        old = f", {age:.1f}s old" if isinstance(age, (int, float)) else ""
        parts.append(f"on the daemon's holder view{old}")
    elif view.get("clean") is False:
        parts.append("(the daemon's view was not current: walked)")
    return "  ".join(parts)


def _gpu_lines(
    gpu: Mapping[str, object],
    findings: Sequence[Mapping[str, object]],
    now: float | None,
    paint: _Paint,
    command_width: int,
) -> list[str]:
    uuid = _as_str(gpu.get("uuid"))
    header = "  ".join(
        [
            f"GPU {_text(gpu.get('index'))}",
            _text(gpu.get("name")),
            _text(uuid),
            _text(gpu.get("pci_bus_id")),
        ]
    )
    lines = [paint(header, _BOLD)]
    memory = _as_map(gpu.get("memory"))
    allocated = f"allocated {_bytes(memory.get('used'))}"
    if memory.get("api") == "v1":
        allocated += f" (v1 query: used {_bytes(memory.get('used_v1'))} incl. reservation)"
    memory_parts = [
        f"total {_bytes(memory.get('total'))}",
        allocated,
        f"reserved {_bytes(memory.get('reserved'))}",
        f"baseline {_bytes(memory.get('baseline'), unknown='not learned')}",
    ]
    lines.append("  memory  " + "  ".join(memory_parts))
    flags = _gpu_flags(gpu)
    if flags:
        lines.append("  " + paint("; ".join(flags), _YELLOW))

    judged_mig = mig_judged(gpu)
    rows, alarms = _holder_rows(parent_rows(gpu) if judged_mig else gpu, now, command_width)
    if rows:
        header_row = ["PID", "USER", "S", "ROLE", "MEMORY", "VIA", "JOB", "AGE", "COMMAND"]
        table = _table([header_row, *rows])
        lines.append("  " + paint(table[0], _DIM))
        for line, alarm in zip(table[1:], alarms, strict=True):
            lines.append("  " + (paint(line, _RED) if alarm else line))
    if judged_mig:
        lines.append("  processes and holders: by MIG instance, below")
    elif not rows:
        lines.append(_no_rows_line(gpu))

    own = [f for f in findings if uuid is not None and _as_str(f.get("gpu")) == uuid]
    noted = {f.get("pid") for f in own}  # a spared finding says so itself
    holders = [h for h in map(_as_map, _as_list(gpu.get("holders"))) if h.get("pid") not in noted]
    lines.extend(f"  holder {line}" for line in spared_lines(holders, now))
    lines.extend(_finding_lines(own, now, paint))
    refusers = [p for p in _as_list(gpu.get("reset_refused_by")) if isinstance(p, int)]
    if own and refusers:
        lines.append(
            f"  a reset now would be refused by the driver while PID "
            f"{', '.join(str(p) for p in refusers)} hold(s) its device file (without device "
            "isolation every CUDA process opens every GPU)"
        )
    lines.extend(_verdict_lines(_as_map(gpu.get("verdict")), paint))
    lines.extend(
        mig_instance_lines(
            gpu,
            findings,
            holder_lines=lambda inst: _holder_table(inst, now, paint, command_width),
            finding_lines=lambda own: _finding_lines(own, now, paint),
            memory_line=_memory_line,
        )
    )
    return lines


def _holder_table(
    gpu: Mapping[str, object], now: float | None, paint: _Paint, command_width: int
) -> list[str]:
    rows, alarms = _holder_rows(gpu, now, command_width)
    if not rows:
        return []
    header_row = ["PID", "USER", "S", "ROLE", "MEMORY", "VIA", "JOB", "AGE", "COMMAND"]
    table = _table([header_row, *rows])
    lines = ["  " + paint(table[0], _DIM)]
    for line, alarm in zip(table[1:], alarms, strict=True):
        lines.append("  " + (paint(line, _RED) if alarm else line))
    return lines


def _memory_line(gpu: Mapping[str, object]) -> str:
    memory = _as_map(gpu.get("memory"))
    return "  memory  " + "  ".join(
        [
            f"total {_bytes(memory.get('total'))}",
            f"allocated {_bytes(memory.get('used'))}",
            f"baseline {_bytes(memory.get('baseline'), unknown='not learned')}",
        ]
    )


def _no_rows_line(gpu: Mapping[str, object]) -> str:
    if gpu.get("lost") is True:
        return "  processes: ? (the GPU is lost)"
    if gpu.get("processes_known") is False:
        return "  processes: ? (NVML could not list them)"
    if as_int(gpu.get("minor")) is None:
        return "  no process listed by NVML; device-file holders ? (minor number unknown)"
    return "  no process holds this GPU"


def _verdict_lines(verdict: Mapping[str, object], paint: _Paint) -> list[str]:
    """``verdict  clean`` or ``verdict  NOT CLEAN (dirty): <kind> <why>``, then what would
    block a reset (decide/verdict.py)."""
    state = _as_str(verdict.get("state"))
    if state is None:
        return []
    reasons = [_as_map(r) for r in _as_list(verdict.get("reasons"))]
    if state == "clean":
        lines = ["  verdict  clean: a new job may have it"]
    else:
        lines = [paint(f"  verdict  NOT CLEAN ({_clean(state)})", _RED)]
        lines.extend(
            f"    {_text(r.get('kind'))} {_text(r.get('reason'))}".rstrip() for r in reasons
        )
    blockers = [_as_map(r) for r in _as_list(verdict.get("reset_blockers"))]
    if blockers:
        lines.append("  would block a reset (not dirt):")
        lines.extend(f"    {_text(b.get('reason'))}" for b in blockers)
    return lines


def _node_holder_lines(
    holders: Sequence[Mapping[str, object]], now: float | None, paint: _Paint, command_width: int
) -> list[str]:
    rows = []
    for holder in holders:
        row = _row(
            {**holder, "via": holder.get("devices")},
            _role_label(_as_str(holder.get("role")), holder.get("owner_pid")),
            "-",
            now,
        )
        rows.append(row[:4] + row[5:])  # no memory column: nothing here is charged to a GPU
        rows[-1][-1] = _truncate(rows[-1][-1], command_width)
    header = ["PID", "USER", "S", "ROLE", "HOLDS", "JOB", "AGE", "COMMAND"]
    table = _table([header, *rows])
    return ["    " + paint(table[0], _DIM), *("    " + line for line in table[1:])]


def _gpu_flags(gpu: Mapping[str, object]) -> list[str]:
    flags: list[str] = []
    if gpu.get("lost") is True:
        flags.append("LOST: the GPU stopped answering")
    error = _as_str(gpu.get("error"))
    if error:
        flags.append(f"error: {_clean(error)}")
    if gpu.get("mig_enabled") is True:
        flags.append("MIG enabled")
    if gpu.get("coherent_memory") is True:
        flags.append("coherent memory (memory-based detection off)")
    persistence = gpu.get("persistence_mode")
    if isinstance(persistence, bool):
        flags.append(f"persistence mode {'on' if persistence else 'off'}")
    health = _as_map(gpu.get("health"))
    action = health.get("recovery_action")
    if isinstance(action, int) and not isinstance(action, bool) and action != 0:
        flags.append(f"recovery action {action} (the driver asks for recovery)")
    support = health.get("recovery_action_support")
    if support == "not_supported":
        flags.append("recovery action unknown (this driver has no such field)")
    elif support == "unknown":
        flags.append("recovery action unknown (could not be read)")
    fabric = _as_map(health.get("fabric"))
    state = fabric.get("state")
    if fabric.get("support") == "ok" and state in (1, 2):
        flags.append(f"NVLink fabric {'NOT_STARTED' if state == 1 else 'IN_PROGRESS'}")
    rows = _as_map(health.get("remapped_rows"))
    if rows.get("pending") is True:
        flags.append("row remap pending (a reset applies it)")
    if rows.get("failure") is True:
        flags.append("row remapping failed")
    reason = _as_str(gpu.get("report_only"))
    if reason:
        flags.append(f"report-only: {_clean(reason)}")
    flags.extend(f"note: {_text(note)}" for note in _as_list(gpu.get("notes")))
    return flags


def _holder_rows(
    gpu: Mapping[str, object], now: float | None, command_width: int
) -> tuple[list[list[str]], list[bool]]:
    """One row per holder, then one per NVML-listed process that holds nothing (dead ones)."""
    holders = [_as_map(h) for h in _as_list(gpu.get("holders"))]
    holder_pids = {as_int(h.get("pid")) for h in holders}
    listed = [_as_map(p) for p in _as_list(gpu.get("processes"))]
    rows: list[tuple[int, list[str], bool]] = []
    for holder in holders:
        memory = holder.get("used_memory")
        memory_text = _bytes(memory) if holder.get("nvml_listed") is True else "-"
        role = _as_str(holder.get("role"))
        rows.append(
            (
                as_int(holder.get("pid")) or 0,
                _row(holder, _role_label(role, holder.get("owner_pid")), memory_text, now),
                role in _ALARM_ROLES,
            )
        )
    for process in listed:
        pid = as_int(process.get("pid"))
        if pid in holder_pids:
            continue
        label = _role_label(_as_str(process.get("role")), None)
        if process.get("role") is None:
            label = _nvml_only_label(process)
        rows.append(
            (
                pid or 0,
                _row(process, label, _bytes(process.get("used_memory")), now),
                process.get("alive") is False,
            )
        )
    rows.sort(key=lambda row: row[0])
    table = [row for _, row, _ in rows]
    for row in table:
        row[-1] = _truncate(row[-1], command_width)
    return table, [alarm for _, _, alarm in rows]


def _row(entry: Mapping[str, object], role: str, memory: str, now: float | None) -> list[str]:
    via = [v for v in _as_list(entry.get("via")) if isinstance(v, str)]
    gone = entry.get("alive") is False and entry.get("state") is None
    return [
        _text(entry.get("pid")),
        "-" if gone else _user(entry),
        "-" if gone else _text(entry.get("state")),
        role,
        memory,
        _clean(",".join(via)) or "-",
        _job(entry.get("cgroup"), known=not gone),
        "-" if gone else _age(now, _as_float(entry.get("started"))),
        _command(entry),
    ]


def _role_label(role: str | None, owner: object) -> str:
    owner_pid = as_int(owner)
    if role is None:
        return "-"
    if role == "worker":
        return f"worker of {owner_pid}" if owner_pid is not None else "worker"
    if role == "orphaned":
        return f"orphaned from {owner_pid}" if owner_pid is not None else "orphaned"
    return _ROLE_LABELS.get(role, _clean(role.replace("_", " ")))


def _nvml_only_label(process: Mapping[str, object]) -> str:
    if process.get("alive") is False:
        return "zombie (NVML)" if process.get("state") == "Z" else "dead (NVML)"
    return "listed by NVML"


def _user(entry: Mapping[str, object]) -> str:
    user = _as_str(entry.get("user"))
    if user:
        return _clean(user)
    uid = as_int(entry.get("uid"))
    return str(uid) if uid is not None else "?"


def _job(cgroup: object, *, known: bool) -> str:
    """A short name for the job a process belongs to; "-" when its cgroup names none."""
    if not isinstance(cgroup, Mapping):
        return "?" if known else "-"
    slurm = _as_str(cgroup.get("slurm_job"))
    if slurm:
        return _clean(f"slurm:{slurm}")
    pod = _as_str(cgroup.get("pod_uid"))
    if pod:
        return _clean(f"pod:{pod[:8]}")
    container = _as_str(cgroup.get("container_id"))
    if container:
        runtime = _as_str(cgroup.get("container_runtime")) or "container"
        return _clean(f"{runtime}:{container[:12]}")
    unit = _as_str(cgroup.get("systemd_unit"))
    return _clean(unit) if unit else "-"


def _command(entry: Mapping[str, object]) -> str:
    cmdline = entry.get("cmdline")
    if isinstance(cmdline, list) and cmdline:
        return _clean(" ".join(str(arg) for arg in cmdline))
    comm = _as_str(entry.get("comm"))
    if comm:
        return _clean(f"[{comm}]")
    return "-" if entry.get("alive") is False else "?"


def _finding_lines(
    findings: Sequence[Mapping[str, object]], now: float | None, paint: _Paint
) -> list[str]:
    if not findings:
        return []
    rows: list[list[str]] = []
    actionable: list[bool] = []
    for finding in findings:
        pid = as_int(finding.get("pid"))
        since = _age(now, _as_float(finding.get("first_seen")), unknown="")
        status = "actionable" if finding.get("actionable") is True else "report only"
        rows.append(
            [
                _text(finding.get("kind")),
                f"pid {pid}" if pid is not None else "gpu",
                _bytes(finding.get("memory"), unknown="-"),
                f"{status}, for {since}" if since else status,
                _text(finding.get("reason")),
            ]
        )
        actionable.append(finding.get("actionable") is True)
    lines = ["  findings"]
    for line, act in zip(_table(rows), actionable, strict=True):
        lines.append("    " + (paint(line, _RED) if act else line))
    lines.extend(f"    {line}" for line in spared_lines(findings, now))  # gpuwatchd spare
    lines.extend(_likely_heir_advice(findings, paint))
    lines.extend(_unseen_note(findings))
    return lines


def _unseen_note(findings: Sequence[Mapping[str, object]]) -> list[str]:
    """Ghost memory means no holder *that /proc shows*: say what no walk can see."""
    if not any(_as_str(f.get("kind")) == "ghost_memory" for f in findings):
        return []
    return [
        "  nobody that /proc shows holds it: a file descriptor in flight in a unix-socket",
        "    message (SCM_RIGHTS) or a holder in another PID namespace is invisible to any walk;",
        "    the driver would refuse the reset then (docs/scan.md, what a walk cannot see)",
    ]


def _likely_heir_advice(findings: Sequence[Mapping[str, object]], paint: _Paint) -> list[str]:
    """What to do about a leak from before gpuwatchd watched (docs/policy.md)."""
    heirs = [
        as_int(f.get("pid"))
        for f in findings
        if _as_map(f.get("evidence")).get("likely_heir") is True
    ]
    shown = ", ".join(str(pid) for pid in heirs if pid is not None)
    if not shown:
        return []
    return [
        paint(f"  likely heir(s) of memory leaked before gpuwatchd watched: PID {shown}", _YELLOW),
        f"    check with `ps -o pid,lstart,args -p {shown.replace(', ', ',')}`; kill it by hand,",
        "    or set detection.orphans_without_history: true and run `gpuwatchd run --once`",
    ]


def _node_notes(report: Mapping[str, object], gpu_uuids: set[str]) -> list[str]:
    notes: list[str] = []
    nvml = _as_map(report.get("nvml"))
    if nvml.get("available") is False:
        notes.append(f"NVML unavailable: {_text(nvml.get('error'))}")
    if nvml.get("wedged") is True:
        notes.append(
            "driver wedged: an NVML call missed its deadline "
            f"({_text(nvml.get('error'))}); no destructive action until it answers again"
        )
    node_reasons = {
        key: reason
        for key, reason in _as_map(report.get("report_only")).items()
        if key not in gpu_uuids
    }
    for key in sorted(node_reasons):
        notes.append(f"report-only ({_clean(key)}): {_text(node_reasons[key])}")
    host = _as_map(report.get("host"))
    if host.get("host_namespaces") is False and not node_reasons:
        notes.append("report-only: gpuwatchd does not see the host PID and cgroup namespaces")
    if host.get("mps_server_running") is True and not node_reasons:
        notes.append("an MPS server is running: its clients' GPUs are report-only")
    for key, values in sorted(_as_map(report.get("notes")).items()):
        if key not in gpu_uuids:
            notes.extend(f"note ({_clean(key)}): {_text(value)}" for value in _as_list(values))
    unreadable = [p for p in _as_list(report.get("unreadable_pids")) if isinstance(p, int)]
    if unreadable:
        shown = ", ".join(str(pid) for pid in unreadable[:10])
        more = f" and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        notes.append(
            f"{len(unreadable)} processes could not be inspected (fds/maps unreadable: "
            f"{shown}{more}); what they hold is unknown"
        )
    return notes


# --- small formatting helpers -----------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart; the last column is not padded."""
    if not rows:
        return []
    widths = [0] * max(len(row) for row in rows)
    for row in rows:
        for column, cell in enumerate(row[:-1]):
            widths[column] = max(widths[column], len(cell))
    return [
        "  ".join(cell.ljust(widths[column]) for column, cell in enumerate(row)).rstrip()
        for row in rows
    ]


def _bytes(value: object, *, unknown: str = "?") -> str:
    amount = as_int(value)
    if amount is None:
        return unknown
    if abs(amount) >= GIB:
        return f"{amount / GIB:.1f} GiB"
    return f"{round(amount / MIB)} MiB"


def _age(now: float | None, then: float | None, *, unknown: str = "?") -> str:
    """Elapsed time as a compact, ps-like string: 45s, 12m, 3h04m, 2d03h."""
    if now is None or then is None:
        return unknown
    seconds = max(0, int(now - then))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _truncate(text: str, width: int) -> str:
    if width < 4 or len(text) <= width:
        return text
    return text[: width - 3] + "..."


def _text(value: object) -> str:
    """A scalar as display text; "?" when unknown, control characters escaped."""
    if value is None or isinstance(value, (Mapping, list)):
        return "?"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return _clean(str(value))


def _clean(text: str) -> str:
    """Escape control characters, which a hostile command line could use to forge lines."""
    return escape(text)


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _as_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
