"""When a poll must scan all of ``/proc`` for device holders instead of the cheap targeted scan
(docs/design-notes.md §1, §4): the one rule, pure (the collector passes in what it read).

In detail: docs/internals.md, section `gpuwatchd.decide.full_scan`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.core.model import GpuInfo, MigDevice, NvmlReading, ProcessInfo
from gpuwatchd.decide.policy import Detection


class FullScanReason(str, enum.Enum):
    """Why a poll scans all of ``/proc`` (docs/internals.md says when each applies)."""

    FORCED = "forced"
    FIRST = "first"
    PERIODIC = "periodic"
    NEW_DEAD_PID = "new_dead_pid"
    UNOWNED_MEMORY = "unowned_memory"
    BACKSTOP = "backstop"
    DEVICE_OPENED = "device_opened"
    HOLDER_GONE = "holder_gone"


@dataclass(frozen=True)
class FullScanState:
    """What the rule carries between polls: the last full scan (monotonic seconds) and the
    PIDs NVML listed dead or zombie at the previous poll."""

    last_full: float | None = None
    dead_listed: frozenset[int] = frozenset()


def listed_pids(reading: NvmlReading) -> frozenset[int]:
    """Every PID any GPU's NVML process list names (valid or not)."""
    return frozenset(proc.pid for gpu in reading.gpus for proc in gpu.processes or ())


def dead_listed(reading: NvmlReading, live: Mapping[int, ProcessInfo]) -> frozenset[int]:
    """The listed PIDs that are not live processes (absent from ``live``) or are zombies."""
    return frozenset(pid for pid in listed_pids(reading) if pid not in live or live[pid].is_zombie)


def unowned_memory_threshold(detection: Detection) -> int:
    """Allocated bytes above which a GPU without a live listed owner needs a full scan."""
    return min(detection.default_baseline, detection.ghost_margin)


def has_unowned_memory(
    gpu: GpuInfo,
    live: Mapping[int, ProcessInfo],
    detection: Detection,
    held_minors: frozenset[int] = frozenset(),
) -> bool:
    """Whether ``gpu`` holds memory no live listed process can own and no known holder holds
    (rule 5); on a MIG GPU whose instances were read, each GPU instance on its own."""
    if gpu.lost or gpu.coherent_memory:
        return False
    if gpu.mig_enabled and gpu.mig_devices is not None:
        return _unowned_instance(gpu.mig_devices, live, detection)
    if gpu.memory is None or (gpu.minor is not None and gpu.minor in held_minors):
        return False
    allocated = gpu.memory.allocated
    if allocated is None or allocated <= unowned_memory_threshold(detection):
        return False
    return not any(proc.pid in live for proc in gpu.processes or ())


def _unowned_instance(
    devices: Iterable[MigDevice], live: Mapping[int, ProcessInfo], detection: Detection
) -> bool:
    """Whether a GPU instance among ``devices`` holds more than the threshold with no live
    process listed in any of its compute instances (an unreadable list lists none)."""
    by_gi: dict[int | None, list[MigDevice]] = {}
    for device in devices:
        by_gi.setdefault(device.gi, []).append(device)
    for group in by_gi.values():
        memory = group[0].memory
        allocated = None if memory is None else memory.allocated
        if allocated is None or allocated <= unowned_memory_threshold(detection):
            continue
        if not any(p.pid in live for d in group for p in d.processes or ()):
            return True
    return False


def full_scan_due(
    reading: NvmlReading,
    live: Mapping[int, ProcessInfo],
    state: FullScanState,
    now: float,
    *,
    interval: float,
    detection: Detection,
    forced: bool = False,
    held_minors: frozenset[int] = frozenset(),
    watching: bool = False,
    device_changed: bool = False,
    backstop: float | None = None,
) -> tuple[FullScanReason | None, FullScanState]:
    """(why this poll must scan all of /proc, or None; the state for the next poll). ``live``:
    the listed PIDs that exist, zombies included; ``held_minors``: the GPUs known holders held
    at the previous poll; ``watching``: device opens are watched (then ``backstop``)."""
    dead = dead_listed(reading, live)
    reason: FullScanReason | None = None
    period = backstop if watching and backstop is not None else interval
    if forced:
        reason = FullScanReason.FORCED
    elif state.last_full is None:
        reason = FullScanReason.FIRST
    elif now - state.last_full >= period:
        reason = FullScanReason.PERIODIC if period == interval else FullScanReason.BACKSTOP
    elif device_changed:
        reason = FullScanReason.DEVICE_OPENED
    elif dead - state.dead_listed:
        reason = FullScanReason.NEW_DEAD_PID
    elif any(has_unowned_memory(gpu, live, detection, held_minors) for gpu in reading.gpus):
        reason = FullScanReason.UNOWNED_MEMORY
    last_full = now if reason is not None else state.last_full
    return reason, FullScanState(last_full=last_full, dead_listed=dead)


def holder_gone(previous: frozenset[int], found: frozenset[int]) -> FullScanReason | None:
    """``holder_gone`` after a targeted scan, as docs/internals.md says, or None. Pure."""
    return FullScanReason.HOLDER_GONE if previous - found else None
