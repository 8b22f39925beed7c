"""GPU health: Xid events, the recovery action, row remapping and retired pages → findings.

This module owns what the driver's health signals *mean* (docs/findings.md#gpu-health):

- the Xid table (:data:`XID_ACTIONS`): which Xids ask for a GPU reset, a reboot, the recovery
  action, or nothing from us; application Xids (13, 31, 43, 45, 68, 109) are the job's fault,
  counted but never a reason to act — 45 is also what our own kills produce;
- the recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, R570 and later) and what each
  value asks for; when the driver does not offer it, the Xid and row-remapping rules decide;
- the three GPU-level findings, one per GPU at most, the strongest winning: ``reboot_required``
  (recovery action NODE_REBOOT, Xid 79, a row-remapping failure, retired pages pending, or a GPU
  still unhealthy after a reset), ``reset_required`` (recovery action GPU_RESET or
  DRAIN_AND_RESET, a pending row remap, a reset-class Xid since the last reset) and
  ``drain_required`` (recovery action DRAIN_P2P);
- :class:`HealthState`, what is carried between polls (Xid counts per GPU, the last reset, since
  when each finding holds) with its checked JSON form;
- :func:`drain_blockers`: which live processes keep a health reset waiting (any live GPU
  process on the node without device isolation).

Whether and when to act (report, drain, reset; the gates and the drain wait) is ``plan.py``'s.
Pure: no I/O, no clock; ``None`` and ``Support.UNKNOWN`` never lead to a finding that acts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpuwatchd.model import Finding, FindingKind, GpuHealth, GpuInfo, Snapshot, Support, as_int

HEALTH_KINDS = frozenset(
    {FindingKind.RESET_REQUIRED, FindingKind.REBOOT_REQUIRED, FindingKind.DRAIN_REQUIRED}
)
MAX_XID_KINDS = 64  # distinct Xid numbers remembered per GPU; more is a storm of garbage
MAX_COUNT = 2**31


class XidAction(str, enum.Enum):
    """What NVIDIA's Xid catalogue says to do about one Xid (docs/findings.md#xid-table)."""

    APPLICATION = "application"  # the job's fault: restart the job; never a reset
    IGNORE = "ignore"  # informational
    RESTART_APP = "restart_app"  # contained error: restart the application
    RESET = "reset"  # reset the GPU
    REBOOT = "reboot"  # reboot the node
    RECOVERY_ACTION = "recovery_action"  # read the recovery action field
    MEMORY = "memory"  # ECC: row remapping / retired pages decide
    REPORT = "report"  # not in our table: counted and reported only

    def __str__(self) -> str:
        return self.value


XID_ACTIONS: Mapping[int, XidAction] = {
    13: XidAction.APPLICATION,  # graphics engine exception (out-of-range access, illegal insn)
    31: XidAction.APPLICATION,  # GPU memory page fault
    43: XidAction.APPLICATION,  # GPU stopped processing (the job's own fault)
    45: XidAction.APPLICATION,  # preemptive cleanup: a killed process (ours too)
    68: XidAction.APPLICATION,  # video processor exception
    109: XidAction.APPLICATION,  # context switch timeout
    63: XidAction.IGNORE,  # ECC page retirement / row remapping recorded
    92: XidAction.IGNORE,  # high single-bit ECC error rate
    94: XidAction.RESTART_APP,  # contained ECC error: the application must restart
    48: XidAction.MEMORY,  # double-bit ECC error
    64: XidAction.RESET,  # ECC page retirement or row remapping failure to record
    95: XidAction.RESET,  # uncontained ECC error
    119: XidAction.RESET,  # GSP RPC timeout
    120: XidAction.RESET,  # GSP error
    79: XidAction.REBOOT,  # the GPU fell off the bus
    154: XidAction.RECOVERY_ACTION,  # GPU recovery action changed: read the field
}


def xid_action(xid: int) -> XidAction:
    return XID_ACTIONS.get(xid, XidAction.REPORT)


class RecoveryAction(enum.IntEnum):
    """``nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)`` values (nvml.h)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5  # newer headers
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


_RECOVERY_KIND: Mapping[int, FindingKind] = {
    RecoveryAction.GPU_RESET: FindingKind.RESET_REQUIRED,
    RecoveryAction.DRAIN_AND_RESET: FindingKind.RESET_REQUIRED,
    RecoveryAction.NODE_REBOOT: FindingKind.REBOOT_REQUIRED,
    RecoveryAction.BUS_RESET: FindingKind.REBOOT_REQUIRED,  # not ours to do: a reboot does it
    RecoveryAction.SYSTEM_REBOOT: FindingKind.REBOOT_REQUIRED,
    RecoveryAction.DRAIN_P2P: FindingKind.DRAIN_REQUIRED,
    RecoveryAction.RECOVER_IMEX_DOMAIN: FindingKind.DRAIN_REQUIRED,
}
_STRENGTH = (FindingKind.REBOOT_REQUIRED, FindingKind.RESET_REQUIRED, FindingKind.DRAIN_REQUIRED)


def recovery_name(value: int | None) -> str | None:
    if value is None:
        return None
    try:
        return f"{RecoveryAction(value).name} ({value})"
    except ValueError:
        return f"unknown ({value})"


# --- carried state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class XidRecord:
    """How often one Xid was seen on one GPU, and when first and last (wall seconds)."""

    count: int
    first: float
    last: float


@dataclass(frozen=True)
class GpuHealthState:
    """One GPU's health history: Xids seen, its last successful reset, since when the
    current health finding holds (``since``: kind → wall seconds)."""

    xids: Mapping[int, XidRecord] = field(default_factory=dict)
    last_reset: float | None = None
    since: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthState:
    """Per GPU UUID; dropped when the boot id changes (a reboot re-initialises every GPU)."""

    gpus: Mapping[str, GpuHealthState] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            uuid: {
                "xids": {
                    str(xid): [rec.count, rec.first, rec.last]
                    for xid, rec in sorted(gpu.xids.items())
                },
                "last_reset": gpu.last_reset,
                "since": dict(sorted(gpu.since.items())),
            }
            for uuid, gpu in sorted(self.gpus.items())
        }

    @classmethod
    def from_json(cls, data: object) -> HealthState:
        """Rebuild :meth:`to_json`'s form; ValueError naming the bad entry otherwise."""
        if not isinstance(data, dict):
            raise ValueError("health must be an object")
        gpus: dict[str, GpuHealthState] = {}
        for uuid, entry in data.items():
            what = f"health.{uuid}"
            if not isinstance(uuid, str) or not isinstance(entry, dict):
                raise ValueError(f"{what}: expected an object")
            raw_xids = entry.get("xids", {})
            if not isinstance(raw_xids, dict) or len(raw_xids) > MAX_XID_KINDS:
                raise ValueError(f"{what}.xids: expected an object of at most {MAX_XID_KINDS}")
            xids: dict[int, XidRecord] = {}
            for key, triple in raw_xids.items():
                xid = int(key) if isinstance(key, str) and key.isdigit() else None
                values = triple if isinstance(triple, list) and len(triple) == 3 else None
                count = as_int(values[0]) if values else None
                if xid is None or values is None or count is None or count < 0:
                    raise ValueError(f"{what}.xids.{key}: expected [count, first, last]")
                xids[xid] = XidRecord(count, _time(values[1], what), _time(values[2], what))
            last_reset = entry.get("last_reset")
            since = entry.get("since", {})
            if not isinstance(since, dict):
                raise ValueError(f"{what}.since: expected an object")
            gpus[uuid] = GpuHealthState(
                xids=xids,
                last_reset=None if last_reset is None else _time(last_reset, what),
                since={str(k): _time(v, what) for k, v in since.items()},
            )
        return cls(gpus=gpus)


def _time(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite time, got {value!r}")
    return float(value)


def note_reset(state: HealthState, uuid: str, wall: float) -> HealthState:
    """A reset of ``uuid`` succeeded at ``wall``: Xids before it no longer ask for one, and the
    next reading is the health check after it (still unhealthy → ``reboot_required``)."""
    gpus = dict(state.gpus)
    gpus[uuid] = replace(gpus.get(uuid, GpuHealthState()), last_reset=wall)
    return HealthState(gpus=gpus)


# --- findings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthAssessment:
    findings: tuple[Finding, ...]
    state: HealthState


def _merge_xids(old: Mapping[int, XidRecord], health: GpuHealth) -> dict[int, XidRecord]:
    xids = dict(old)
    for event in health.xids:
        rec = xids.get(event.xid)
        if rec is None:
            if len(xids) >= MAX_XID_KINDS:
                continue
            xids[event.xid] = XidRecord(1, event.wall, event.wall)
        else:
            xids[event.xid] = XidRecord(
                min(rec.count + 1, MAX_COUNT), min(rec.first, event.wall), max(rec.last, event.wall)
            )
    return xids


def _reasons(
    health: GpuHealth, xids: Mapping[int, XidRecord], last_reset: float | None
) -> dict[FindingKind, list[str]]:
    """Every reason this reading gives, by the finding kind it asks for."""
    found: dict[FindingKind, list[str]] = {kind: [] for kind in _STRENGTH}
    cured_by_reset: list[str] = []  # what a reset applies: after one, it must be gone
    action = health.recovery_action if health.recovery_support is Support.OK else None
    if action is not None and action != RecoveryAction.NONE:
        kind = _RECOVERY_KIND.get(action)
        if kind is not None:
            text = f"the driver's recovery action is {recovery_name(action)}"
            found[kind].append(text)
            if kind is FindingKind.RESET_REQUIRED:
                cured_by_reset.append(text)
    if health.remap_support is Support.OK:
        if health.remap_failure is True:
            found[FindingKind.REBOOT_REQUIRED].append("row remapping failed")
        if health.remap_pending is True:
            text = "a row remap is pending (applied by a reset)"
            found[FindingKind.RESET_REQUIRED].append(text)
            cured_by_reset.append(text)
    if health.pages_support is Support.OK and health.pages_pending is True:
        found[FindingKind.REBOOT_REQUIRED].append("retired pages are pending (applied at reboot)")
    for xid, rec in sorted(xids.items()):
        if last_reset is not None and rec.last <= last_reset:
            continue  # seen before the last reset: that reset dealt with it
        what = xid_action(xid)
        seen = f"Xid {xid} seen {rec.count} time(s)"
        if what is XidAction.RESET:
            found[FindingKind.RESET_REQUIRED].append(f"{seen} (NVIDIA: reset the GPU)")
        elif what is XidAction.REBOOT:
            found[FindingKind.REBOOT_REQUIRED].append(f"{seen} (NVIDIA: the GPU fell off the bus)")
    if last_reset is not None and cured_by_reset:
        # The health check after a reset: what the reset should have applied is still there.
        found[FindingKind.REBOOT_REQUIRED].append(
            "still unhealthy after the GPU reset: " + "; ".join(cured_by_reset)
        )
    return found


def _evidence(
    gpu: GpuInfo, health: GpuHealth, xids: Mapping[int, XidRecord], last_reset: float | None
) -> dict[str, object]:
    return {
        "xids": {
            str(xid): {
                "count": r.count,
                "first": r.first,
                "last": r.last,
                "action": str(xid_action(xid)),
            }
            for xid, r in sorted(xids.items())
        },
        "recovery_action": recovery_name(health.recovery_action),
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
        "last_reset": last_reset,
        "pci_bus_id": gpu.pci_bus_id,
    }


def assess_health(
    snapshot: Snapshot, previous: HealthState, *, boot_changed: bool
) -> HealthAssessment:
    """Merge this poll's Xids into the history and judge every GPU's health. Pure.

    One finding per GPU at most, the strongest kind: reboot over reset over drain (a reboot
    makes a reset pointless). A lost GPU is left to the ``gpu.needs_reboot`` path, and a GPU
    whose health was not read keeps its history unchanged and gets no finding.
    """
    old = {} if boot_changed else dict(previous.gpus)
    gpus: dict[str, GpuHealthState] = dict(old)
    findings: list[Finding] = []
    wall = snapshot.wall_time
    for gpu in sorted(snapshot.nvml.gpus, key=lambda g: g.index):
        health = gpu.health
        if not gpu.uuid or health is None or gpu.lost:
            continue
        carried = old.get(gpu.uuid, GpuHealthState())
        xids = _merge_xids(carried.xids, health)
        reasons = _reasons(health, xids, carried.last_reset)
        kind = next((k for k in _STRENGTH if reasons[k]), None)
        since = {} if kind is None else {kind.value: carried.since.get(kind.value, wall)}
        gpus[gpu.uuid] = GpuHealthState(xids=xids, last_reset=carried.last_reset, since=since)
        if kind is None:
            continue
        evidence = _evidence(gpu, health, xids, carried.last_reset)
        evidence["since"] = since[kind.value]
        evidence["reasons"] = list(reasons[kind])
        findings.append(
            Finding(
                kind=kind,
                gpu=gpu.uuid,
                pid=None,
                start_ticks=None,
                reason="; ".join(reasons[kind]),
                actionable=True,
                evidence=evidence,
            )
        )
    return HealthAssessment(tuple(findings), HealthState(gpus=gpus))


# --- what keeps a health reset waiting --------------------------------------------------------


def drain_blockers(gpu: GpuInfo, snapshot: Snapshot, *, device_isolation: bool) -> list[str]:
    """Live processes NVML lists that keep a health reset of ``gpu`` waiting.

    A live context owner on the GPU itself always blocks (the holder scan's ``live_holder`` gate
    names the device-file holders besides). Without cgroup device isolation every CUDA process
    opens every GPU's device file, and the driver refuses to reset a GPU whose file is open: a
    live job on *any* GPU blocks (docs/reset.md#what-blocks-a-reset). A listed process is live
    unless ``/proc`` shows it gone or a zombie; an unreadable one counts as live (unknown is
    not none).
    """
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
