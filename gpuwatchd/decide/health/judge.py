"""GPU health: what Xid events, the recovery action, row remapping, retired pages and the
NVLink fabric *mean* → findings (docs/findings.md#gpu-health). In detail: docs/internals.md,
section `gpuwatchd.decide.health.judge`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from gpuwatchd.core.model import (
    Finding,
    FindingKind,
    GpuHealth,
    GpuInfo,
    KernelXid,
    Snapshot,
    Support,
)
from gpuwatchd.decide.gpu_ids import DeviceKey, pci_device
from gpuwatchd.decide.health import fabric
from gpuwatchd.decide.health.state import (
    MAX_COUNT,
    MAX_XID_KINDS,
    GpuHealthState,
    HealthState,
    XidDetail,
    XidRecord,
)
from gpuwatchd.decide.health.xid_catalogue import XID_CATALOGUE, Bucket, XidAction, xid_action
from gpuwatchd.decide.health.xid_sources import Occurrence, XidNotice, merge_sources, notices
from gpuwatchd.decide.policy import HealthPolicy

# Xids this close together (seconds, by when the worker read them) co-occur: the catalogue's
# "solo" rules are judged over it.
XID_WINDOW = 60.0
# An NVLink error (Xid 74) on another GPU this close to one of our resets (real or assumed) is
# what resetting an NVLink peer causes: expected, not an incident.
PEER_XID_WINDOW = 300.0
_NVLINK_XID = 74
_FABRIC_MANAGER = (
    "check Fabric Manager (nvidia-fabricmanager); gpuwatchd never stops or restarts it: a "
    "restart without resetting every GPU breaks NVLink SHARP (NCCL) on the GPUs still running"
)


class RecoveryAction(enum.IntEnum):
    """``nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)`` values (nvml.h)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4  # R570
    RECOVER_IMEX_DOMAIN = 5  # R595
    BUS_RESET = 6  # R615
    SYSTEM_REBOOT = 7  # R615


# What each value asks for, and NVIDIA's text in our words (docs/internals.md).
_RECOVERY: Mapping[int, tuple[FindingKind, str]] = {
    RecoveryAction.GPU_RESET: (
        FindingKind.RESET_REQUIRED,
        "NVIDIA: end the GPU's processes and reset it",
    ),
    RecoveryAction.NODE_REBOOT: (
        FindingKind.REBOOT_REQUIRED,
        "NVIDIA: the fault may have left the operating system inconsistent; reboot",
    ),
    RecoveryAction.DRAIN_P2P: (
        FindingKind.DRAIN_REQUIRED,
        "NVIDIA: quiesce peer-to-peer traffic (end the processes using it, turn UVM "
        "persistence mode off), then read the field again; re-read every poll until it "
        "settles on another action",
    ),
    RecoveryAction.DRAIN_AND_RESET: (
        FindingKind.RESET_REQUIRED,
        "NVIDIA: schedule no new work on this GPU and reset it once existing work has drained",
    ),
    RecoveryAction.RECOVER_IMEX_DOMAIN: (
        FindingKind.DRAIN_REQUIRED,
        "the IMEX domain must be recovered, which is outside gpuwatchd; never a reset",
    ),
    RecoveryAction.BUS_RESET: (
        FindingKind.REBOOT_REQUIRED,
        "a reset of the GPU's PCIe bus, which gpuwatchd never does; a reboot does it",
    ),
    RecoveryAction.SYSTEM_REBOOT: (FindingKind.REBOOT_REQUIRED, "reboot the system"),
}
_STRENGTH = (FindingKind.REBOOT_REQUIRED, FindingKind.RESET_REQUIRED, FindingKind.DRAIN_REQUIRED)
# The recovery actions a reset applies (signature ``recovery:N``; a pending remap: ``remap``).
_RESET_ACTIONS = (RecoveryAction.GPU_RESET, RecoveryAction.DRAIN_AND_RESET)


def recovery_name(value: int | None) -> str | None:
    if value is None:
        return None
    try:
        return f"{RecoveryAction(value).name} ({value})"
    except ValueError:
        return f"unknown ({value})"


def _cured_by_reset(health: GpuHealth) -> tuple[str, ...]:
    """Signatures of what a reset applies that this reading shows."""
    cured = []
    if health.recovery_support is Support.OK and health.recovery_action in _RESET_ACTIONS:
        cured.append(f"recovery:{health.recovery_action}")
    if health.remap_support is Support.OK and health.remap_pending is True:
        cured.append("remap")
    return tuple(cured)


def note_reset(
    state: HealthState, uuid: str, wall: float, *, assumed_from: GpuHealth | None = None
) -> HealthState:
    """A reset of ``uuid`` succeeded at ``wall``; with ``assumed_from`` (the reading it was
    decided on) a dry run's would-be reset, assumed to have succeeded (docs/internals.md)."""
    gpus = dict(state.gpus)
    old = gpus.get(uuid, GpuHealthState())
    if assumed_from is None:
        gpus[uuid] = replace(old, last_reset=wall)
    else:
        gpus[uuid] = replace(old, assumed_reset=wall, assumed_cured=_cured_by_reset(assumed_from))
    return HealthState(gpus=gpus)


def rebase_wall(state: HealthState, step: float) -> HealthState:
    """Every wall time moved ``step`` seconds back: the wall clock stepped back that far, and
    the step counts as no time passed (as the plan's wall times, docs/internals.md)."""
    if step <= 0:
        return state
    return HealthState(gpus={uuid: _moved_back(g, step) for uuid, g in state.gpus.items()})


def _moved_back(gpu: GpuHealthState, step: float) -> GpuHealthState:
    def back(wall: float | None) -> float | None:
        return None if wall is None else wall - step

    return replace(
        gpu,
        xids={x: replace(r, first=r.first - step, last=r.last - step) for x, r in gpu.xids.items()},
        last_reset=back(gpu.last_reset),
        since={kind: wall - step for kind, wall in gpu.since.items()},
        assumed_reset=back(gpu.assumed_reset),
        fabric_since=back(gpu.fabric_since),
        checked_reset=back(gpu.checked_reset),
        sightings=tuple(replace(s, wall=s.wall - step) for s in gpu.sightings),
        details={x: replace(d, wall=d.wall - step) for x, d in gpu.details.items()},
        xid_log={
            x: replace(
                log, logged_at=log.logged_at - step, first=log.first - step, last=log.last - step
            )
            for x, log in gpu.xid_log.items()
        },
    )


def drop_assumed(state: HealthState) -> HealthState:
    """Forget every dry-run assumption (the daemon acts for real now)."""
    if not any(g.assumed_reset is not None or g.assumed_cured for g in state.gpus.values()):
        return state
    return HealthState(
        gpus={
            uuid: replace(g, assumed_reset=None, assumed_cured=()) for uuid, g in state.gpus.items()
        }
    )


# --- findings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthAssessment:
    findings: tuple[Finding, ...]
    state: HealthState
    xid_notices: tuple[XidNotice, ...] = ()  # HEALTH_XID events (decide/health/xid_sources.py)


@dataclass(frozen=True)
class _Reason:
    text: str
    actionable: bool = True
    cured: str | None = None  # a reset applies it: the signature of _cured_by_reset


def _merge_xids(
    old: Mapping[int, XidRecord], occurrences: Iterable[Occurrence]
) -> dict[int, XidRecord]:
    xids = dict(old)
    for new in occurrences:
        if new.xid not in xids and len(xids) >= MAX_XID_KINDS:
            continue
        rec = xids.get(new.xid, XidRecord(0, new.first, new.last))
        xids[new.xid] = XidRecord(
            min(rec.count + new.count, MAX_COUNT),
            min(rec.first, new.first),
            max(rec.last, new.last),
        )
    return xids


def _kernel_xids_by_gpu(snapshot: Snapshot) -> dict[str, list[KernelXid]]:
    """The kernel log's Xids by GPU UUID (its ``0000:17:00`` and NVML's ``00000000:17:00.0``
    compared as numbers); a record naming no GPU NVML reports is dropped."""
    uuid_of: dict[DeviceKey | None, str] = {}  # None (no bus id) names no GPU: never a key
    for gpu in snapshot.nvml.gpus:
        key = pci_device(gpu.pci_bus_id)
        if key is not None and gpu.uuid:
            uuid_of[key] = gpu.uuid
    found: dict[str, list[KernelXid]] = {}
    for record in snapshot.kernel_xids:
        uuid = uuid_of.get(pci_device(record.pci, kernel_log=True))
        if uuid is not None:
            found.setdefault(uuid, []).append(record)
    return found


def _co_occurring(xid: int, xids: Mapping[int, XidRecord]) -> list[int]:
    """The other Xids seen within :data:`XID_WINDOW` of ``xid``'s occurrences."""
    rec = xids[xid]
    return sorted(
        other
        for other, r in xids.items()
        if other != xid and r.last >= rec.first - XID_WINDOW and r.first <= rec.last + XID_WINDOW
    )


def _label(xid: int) -> str:
    entry = XID_CATALOGUE.get(xid)
    return f"Xid {xid}" + (f" ({entry.name})" if entry is not None else "")


@dataclass(frozen=True)
class _Context:
    wall: float
    policy: HealthPolicy
    peer_resets: tuple[float, ...]  # resets (real or assumed) of the node's other GPUs
    fabric_stuck: bool  # the fabric has been registering for longer than allowed


def _judge_xids(
    xids: Mapping[int, XidRecord],
    since_reset: float | None,
    ctx: _Context,
    fabric_faults: list[str],
) -> tuple[dict[FindingKind, list[_Reason]], dict[int, str]]:
    """The reasons the Xid history gives, and how each Xid was judged."""
    found: dict[FindingKind, list[_Reason]] = {kind: [] for kind in _STRENGTH}
    notes: dict[int, str] = {}
    for xid, rec in sorted(xids.items()):
        if since_reset is not None and rec.last <= since_reset:
            notes[xid] = "before the last reset: dealt with"
            continue
        action = xid_action(xid)
        seen = f"{_label(xid)} seen {rec.count} time(s)"
        if xid == _NVLINK_XID and any(
            abs(rec.first - t) <= PEER_XID_WINDOW and rec.last <= t + PEER_XID_WINDOW
            for t in ctx.peer_resets
        ):
            notes[xid] = "expected: an NVLink peer was reset by gpuwatchd just then"
            continue
        if action is XidAction.RESET:
            bucket = XID_CATALOGUE[xid].immediate
            if bucket is Bucket.WORKFLOW_XID_48:
                with_remap = [x for x in _co_occurring(xid, xids) if x in (63, 64)]
                why = notes[xid] = (
                    f"with Xid {', '.join(map(str, with_remap))}: NVIDIA: drain and reset"
                    if with_remap
                    else "solo: NVIDIA: reset the GPU"
                )
            elif bucket is Bucket.WORKFLOW_NVLINK_ERR:
                why = "NVIDIA: reset the GPU (a reboot if that does not help)"
            else:
                why = "NVIDIA: reset the GPU"
            found[FindingKind.RESET_REQUIRED].append(_Reason(f"{seen} ({why})"))
        elif action is XidAction.REBOOT:
            what = "power-cycle" if XID_CATALOGUE[xid].immediate is Bucket.RESTART_BM else "reboot"
            found[FindingKind.REBOOT_REQUIRED].append(_Reason(f"{seen} (NVIDIA: {what})"))
        elif action is XidAction.FABRIC_MANAGER:
            others = _co_occurring(xid, xids)
            if others:
                notes[xid] = f"not solo (with Xid {', '.join(map(str, others))}): follow them"
            elif ctx.wall - rec.last < XID_WINDOW:
                notes[xid] = "solo so far: judged once the window has passed"
            elif fabric_faults:
                found[FindingKind.DRAIN_REQUIRED].append(
                    _Reason(f"{seen}, solo (NVIDIA: restart Fabric Manager)")
                )
                notes[xid] = "solo, and the NVLink fabric is unhealthy: Fabric Manager"
            else:
                notes[xid] = (
                    "solo; no unhealthy NVLink fabric here, so a process was torn down "
                    "(not Fabric Manager)"
                )
        elif {63: ctx.policy.xid_63, 94: ctx.policy.xid_94}.get(xid) == "drain":
            nvidia = "ignore" if xid == 63 else "restart the application"
            why = f"health.xid_{xid}: drain; NVIDIA: {nvidia}"
            found[FindingKind.DRAIN_REQUIRED].append(_Reason(f"{seen} ({why})"))
    return found, notes


def _reasons(
    health: GpuHealth, xids: Mapping[int, XidRecord], carried: GpuHealthState, ctx: _Context
) -> tuple[dict[FindingKind, list[_Reason]], dict[int, str]]:
    """Every reason this reading gives, by the finding kind it asks for; notes per Xid."""
    fabric_faults = fabric.problems(health)
    if ctx.fabric_stuck:
        fabric_faults.append(
            f"NVLink fabric registration not completed after "
            f"{ctx.policy.fabric_stuck_after:g}s (state {fabric.evidence(health)['state']})"
        )
    found, notes = _judge_xids(xids, carried.reset_at, ctx, fabric_faults)
    action = health.recovery_action if health.recovery_support is Support.OK else None
    if action is not None and action != RecoveryAction.NONE:
        said = f"the driver's recovery action is {recovery_name(action)}"
        known = _RECOVERY.get(action)
        if known is None:
            found[FindingKind.DRAIN_REQUIRED].append(
                _Reason(
                    f"{said}: a value gpuwatchd does not know; reported, never acted on",
                    actionable=False,
                )
            )
        else:
            kind, meaning = known
            cured = f"recovery:{action}" if action in _RESET_ACTIONS else None
            found[kind].append(_Reason(f"{said}: {meaning}", cured=cured))
    if health.remap_support is Support.OK:
        if health.remap_failure is True:
            found[FindingKind.REBOOT_REQUIRED].append(_Reason("row remapping failed"))
        if health.remap_pending is True:
            found[FindingKind.RESET_REQUIRED].append(
                _Reason("a row remap is pending (applied by a reset)", cured="remap")
            )
    if health.pages_support is Support.OK and health.pages_pending is True:
        found[FindingKind.REBOOT_REQUIRED].append(
            _Reason("retired pages are pending (applied at reboot)")
        )
    if fabric_faults:
        found[FindingKind.DRAIN_REQUIRED].append(
            _Reason(f"{'; '.join(fabric_faults)}: {_FABRIC_MANAGER}")
        )
    # What a reset applies: taken as applied after an assumed reset; a reboot after a real one.
    for kind in _STRENGTH:
        found[kind] = [r for r in found[kind] if r.cured not in carried.assumed_cured]
    still = [r for r in found[FindingKind.RESET_REQUIRED] if r.cured in carried.unhealed]
    if still:
        found[FindingKind.REBOOT_REQUIRED].append(
            _Reason("still unhealthy after the GPU reset: " + "; ".join(r.text for r in still))
        )
    return found, notes


def _evidence(
    gpu: GpuInfo,
    health: GpuHealth,
    xids: Mapping[int, XidRecord],
    carried: GpuHealthState,
    notes: Mapping[int, str],
    *,
    details: Mapping[int, XidDetail],
) -> dict[str, object]:
    xid_entries: dict[str, object] = {}
    for xid, r in sorted(xids.items()):
        entry = XID_CATALOGUE.get(xid)
        detail = details.get(xid)
        xid_entries[str(xid)] = {
            "count": r.count,
            "first": r.first,
            "last": r.last,
            "action": str(xid_action(xid)),
            "bucket": None if entry is None else str(entry.immediate),
            **({"note": notes[xid]} if xid in notes else {}),
            # The kernel log's latest line of it: the process, its job, before the start?
            **({"kernel_log": asdict(detail)} if detail is not None else {}),
        }
    recovery = (
        recovery_name(health.recovery_action)
        if health.recovery_support is Support.OK
        else f"unknown ({health.recovery_support}: the driver does not offer it)"
        if health.recovery_support is Support.NOT_SUPPORTED
        else "unknown (could not be read)"
    )
    return {
        "xids": xid_entries,
        "recovery_action": recovery,
        "recovery_action_support": str(health.recovery_support),
        "remapped_rows": {
            "support": str(health.remap_support),
            "correctable": health.remap_correctable,
            "uncorrectable": health.remap_uncorrectable,
            "pending": health.remap_pending,
            "failure": health.remap_failure,
        },
        "retired_pages_pending": health.pages_pending,
        "retired_pages_support": str(health.pages_support),
        "fabric": dict(fabric.evidence(health)),
        "last_reset": carried.last_reset,
        "assumed_reset": carried.assumed_reset,
        "pci_bus_id": gpu.pci_bus_id,
    }


def _carry_cures(carried: GpuHealthState, health: GpuHealth) -> GpuHealthState:
    """The reset bookkeeping brought up to this reading (docs/internals.md)."""
    showing = _cured_by_reset(health)
    unread = carried.last_reset is not None and carried.checked_reset != carried.last_reset
    return replace(
        carried,
        checked_reset=carried.last_reset if unread else carried.checked_reset,
        unhealed=showing if unread else tuple(c for c in carried.unhealed if c in showing),
        assumed_cured=tuple(c for c in carried.assumed_cured if c in showing),
    )


def assess_health(
    snapshot: Snapshot,
    previous: HealthState,
    *,
    boot_changed: bool,
    policy: HealthPolicy | None = None,
) -> HealthAssessment:
    """Merge this poll's Xids into the history and judge every GPU's health: one finding per
    GPU at most, the strongest kind (docs/internals.md). Pure."""
    options = policy if policy is not None else HealthPolicy()
    old = {} if boot_changed else dict(previous.gpus)
    gpus: dict[str, GpuHealthState] = dict(old)
    findings: list[Finding] = []
    said: list[XidNotice] = []
    wall = snapshot.wall_time
    kernel = _kernel_xids_by_gpu(snapshot)
    for gpu in sorted(snapshot.nvml.gpus, key=lambda g: g.index):
        health = gpu.health
        if not gpu.uuid or health is None or gpu.lost:
            continue
        carried = _carry_cures(old.get(gpu.uuid, GpuHealthState()), health)
        merged = merge_sources(
            health.xids,
            kernel.get(gpu.uuid, ()),
            sightings=carried.sightings,
            klog_pos=carried.klog_pos,
            details=carried.details,
            wall=wall,
        )
        xids = _merge_xids(carried.xids, merged.occurrences)
        notes_now, xid_log = notices(gpu.uuid, merged, carried.xid_log, wall)
        said.extend(notes_now)
        carried = replace(
            carried,
            klog_pos=merged.klog_pos,
            sightings=merged.sightings,
            details=merged.details,
            xid_log=xid_log,
        )
        fabric_since, stuck = _fabric_clock(health, carried.fabric_since, wall, options)
        peers = tuple(
            t
            for uuid, state in old.items()
            if uuid != gpu.uuid and (t := state.reset_at) is not None
        )
        ctx = _Context(wall, options, peers, stuck)
        reasons, notes = _reasons(health, xids, carried, ctx)
        kind = next((k for k in _STRENGTH if reasons[k]), None)
        since = {} if kind is None else {kind.value: carried.since.get(kind.value, wall)}
        gpus[gpu.uuid] = replace(carried, xids=xids, since=since, fabric_since=fabric_since)
        if kind is None:
            continue
        evidence = _evidence(gpu, health, xids, carried, notes, details=merged.details)
        findings.append(_finding(gpu.uuid, kind, reasons, evidence, since[kind.value]))
    return HealthAssessment(tuple(findings), HealthState(gpus=gpus), tuple(said))


def _fabric_clock(
    health: GpuHealth, since: float | None, wall: float, options: HealthPolicy
) -> tuple[float | None, bool]:
    """Since when the GPU's fabric has been registering, and whether it is stuck."""
    registering = fabric.registering(health)
    fabric_since = since  # not read this poll: unknown keeps the clock as it was
    if registering is not None:
        fabric_since = (since or wall) if registering else None
    stuck = (
        registering is True
        and fabric_since is not None
        and wall - fabric_since >= options.fabric_stuck_after
        and not fabric.waiting_for_partition(health)
    )
    return fabric_since, stuck


def _finding(
    uuid: str,
    kind: FindingKind,
    reasons: Mapping[FindingKind, Sequence[_Reason]],
    evidence: dict[str, object],
    since: float,
) -> Finding:
    """The GPU's one finding, of the strongest ``kind``."""
    evidence["since"] = since
    evidence["reasons"] = [r.text for r in reasons[kind]]
    # What a weaker kind would also ask for (e.g. a stuck fabric under a reset_required).
    evidence["other_reasons"] = [r.text for k in _STRENGTH if k is not kind for r in reasons[k]]
    return Finding(
        kind=kind,
        gpu=uuid,
        pid=None,
        start_ticks=None,
        reason="; ".join(r.text for r in reasons[kind]),
        actionable=any(r.actionable for r in reasons[kind]),
        evidence=evidence,
    )


# --- what keeps a health reset waiting --------------------------------------------------------


def drain_blockers(gpu: GpuInfo, snapshot: Snapshot, *, device_isolation: bool) -> list[str]:
    """Live processes NVML lists that keep a health reset of ``gpu`` waiting (docs/internals.md)."""
    found: list[str] = []
    for other in sorted(snapshot.nvml.gpus, key=lambda g: g.index):
        same = other.uuid == gpu.uuid
        if not same and device_isolation:
            continue
        if other.processes is None:
            found.append(f"the process list of GPU {other.index} is unknown")
            continue
        for listed in other.processes:
            if listed.pid in snapshot.self_pids:
                continue
            proc = snapshot.processes.get(listed.pid)
            if proc is not None and proc.is_zombie:
                continue
            if proc is None and listed.pid not in _known_pids(snapshot):
                continue  # NVML lists a dead PID: it holds nothing
            where = "on this GPU" if same else f"on GPU {other.index} (no device isolation)"
            found.append(f"pid {listed.pid} {where}")
    return found


def _known_pids(snapshot: Snapshot) -> Iterable[int]:
    return snapshot.holders.holdings.keys() | snapshot.holders.unreadable
