"""GPU health's carried state: per GPU, the Xids seen, the last reset, a dry run's assumed
reset, since when each health finding and a registering NVLink fabric hold; its JSON form.

This module owns the shape of that state and the checks applied when it is read back (a
damaged state file is a ValueError naming the entry, never a wrong decision). What the values
mean and every change to them belong to ``health.py``; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.checked import number as _time
from gpuwatchd.checked import opt_number as _opt_time
from gpuwatchd.model import as_int

__all__ = ["MAX_XID_KINDS", "GpuHealthState", "HealthState", "XidRecord"]

MAX_XID_KINDS = 64  # distinct Xid numbers remembered per GPU; more is a storm of garbage


@dataclass(frozen=True)
class XidRecord:
    """How often one Xid was seen on one GPU, and when first and last (wall seconds)."""

    count: int
    first: float
    last: float


@dataclass(frozen=True)
class GpuHealthState:
    """One GPU's health history: Xids seen, its last successful reset, since when the
    current health finding holds (``since``: kind → wall seconds), since when its NVLink
    fabric has been registering (``fabric_since``).

    ``assumed_reset`` is a dry run's would-be reset, assumed to have succeeded for the
    decisions that follow (Xids before it no longer count; ``assumed_cured`` names what the
    reset would have applied — ``recovery:N``, ``remap`` — which the unchanged reading may
    still show). It is dropped as soon as the daemon acts for real (:func:`drop_assumed`).

    The first reading after a real reset is its health check (``checked_reset``): what the
    reset should have applied and is still there (``unhealed``) means a reboot, for as long
    as the reading shows it; the same signal appearing later is a new incident.
    """

    xids: Mapping[int, XidRecord] = field(default_factory=dict)
    last_reset: float | None = None
    since: Mapping[str, float] = field(default_factory=dict)
    assumed_reset: float | None = None
    assumed_cured: tuple[str, ...] = ()
    fabric_since: float | None = None
    checked_reset: float | None = None  # the last_reset whose health check was read
    unhealed: tuple[str, ...] = ()  # what that check found the reset had not applied

    @property
    def reset_at(self) -> float | None:
        """The latest reset, real or assumed."""
        times = [t for t in (self.last_reset, self.assumed_reset) if t is not None]
        return max(times) if times else None


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
                "assumed_reset": gpu.assumed_reset,
                "assumed_cured": list(gpu.assumed_cured),
                "fabric_since": gpu.fabric_since,
                "checked_reset": gpu.checked_reset,
                "unhealed": list(gpu.unhealed),
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
            since = entry.get("since", {})
            if not isinstance(since, dict):
                raise ValueError(f"{what}.since: expected an object")
            cured = _signatures(entry.get("assumed_cured", []), f"{what}.assumed_cured")
            unhealed = _signatures(entry.get("unhealed", []), f"{what}.unhealed")
            gpus[uuid] = GpuHealthState(
                xids=xids,
                last_reset=_opt_time(entry.get("last_reset"), what),
                since={str(k): _time(v, what) for k, v in since.items()},
                assumed_reset=_opt_time(entry.get("assumed_reset"), what),
                assumed_cured=cured,
                fabric_since=_opt_time(entry.get("fabric_since"), what),
                checked_reset=_opt_time(entry.get("checked_reset"), what),
                unhealed=unhealed,
            )
        return cls(gpus=gpus)


def _signatures(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 8:
        raise ValueError(f"{what}: expected a list of at most 8")
    if not all(isinstance(c, str) and 0 < len(c) <= 32 for c in value):
        raise ValueError(f"{what}: expected short strings")
    return tuple(value)
