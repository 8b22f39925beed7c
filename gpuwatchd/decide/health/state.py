"""GPU health's carried state per GPU and its checked JSON form (a damaged state file is a
ValueError naming the entry, never a wrong decision). What the values mean and every change
to them belong to ``judge.py``; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, astuple, dataclass, field, replace

from gpuwatchd.core.checked import decimal, number, obj, opt_number
from gpuwatchd.core.model import as_int

MAX_XID_KINDS = 64  # distinct Xid numbers remembered per GPU; more is a storm of garbage
MAX_COUNT = 2**31  # occurrences of one Xid per GPU: counted (judge.py) or held (xid_sources.py)
MAX_JOB = 300  # a job key: its kind and one cgroup path component (at most 255 bytes)
XID_DIGITS = 5  # of an Xid kept (a key or a sighting's): the kernel log's have at most as many


@dataclass(frozen=True)
class XidRecord:
    """How often one Xid was seen on one GPU, and when first and last (wall seconds)."""

    count: int
    first: float
    last: float


@dataclass(frozen=True)
class Sighting:
    """An Xid one source saw (``nvml`` or ``kernel``) and the other has not yet matched."""

    xid: int
    wall: float
    source: str


@dataclass(frozen=True)
class XidDetail:
    """The kernel log's latest line of an Xid: the process the driver named (its job when it
    still lived), the driver's text, whether it predates the daemon, when (wall seconds)."""

    pid: int | None
    process: str | None
    job: str | None
    text: str
    before_start: bool
    wall: float


@dataclass(frozen=True)
class XidLog:
    """When an Xid was last said (``EventName.HEALTH_XID``); the count held since, ``first``
    to ``last``."""

    logged_at: float
    held: int
    first: float
    last: float


@dataclass(frozen=True)
class GpuHealthState:
    """One GPU's health history (``since``: finding kind → wall seconds). ``assumed_reset``
    and ``assumed_cured``: a dry run's would-be reset; ``checked_reset`` and ``unhealed``: the
    health check after a real one (docs/internals.md, ``gpuwatchd.decide.health.judge``)."""

    xids: Mapping[int, XidRecord] = field(default_factory=dict)
    last_reset: float | None = None
    since: Mapping[str, float] = field(default_factory=dict)
    assumed_reset: float | None = None
    assumed_cured: tuple[str, ...] = ()
    fabric_since: float | None = None
    checked_reset: float | None = None  # the last_reset whose health check was read
    unhealed: tuple[str, ...] = ()  # what that check found the reset had not applied
    # The kernel log (decide/health/xid_sources.py): klog_pos is the last record counted
    # (microseconds since boot).
    klog_pos: int | None = None
    sightings: tuple[Sighting, ...] = ()
    details: Mapping[int, XidDetail] = field(default_factory=dict)
    xid_log: Mapping[int, XidLog] = field(default_factory=dict)

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
                "xids": {str(xid): list(astuple(rec)) for xid, rec in sorted(gpu.xids.items())},
                "last_reset": gpu.last_reset,
                "since": dict(sorted(gpu.since.items())),
                "assumed_reset": gpu.assumed_reset,
                "assumed_cured": list(gpu.assumed_cured),
                "fabric_since": gpu.fabric_since,
                "checked_reset": gpu.checked_reset,
                "unhealed": list(gpu.unhealed),
                "klog_pos": gpu.klog_pos,
                "sightings": [list(astuple(s)) for s in gpu.sightings],
                "details": {str(x): asdict(d) for x, d in sorted(gpu.details.items())},
                "xid_log": {str(x): list(astuple(r)) for x, r in sorted(gpu.xid_log.items())},
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
            xids: dict[int, XidRecord] = {}
            for xid, triple, where in _by_xid(entry, what, "xids"):
                values = triple if isinstance(triple, list) and len(triple) == 3 else None
                count = as_int(values[0]) if values else None
                if values is None or count is None or not 0 <= count <= MAX_COUNT:
                    raise ValueError(f"{where}: expected [count, first, last]")
                xids[xid] = XidRecord(count, number(values[1], what), number(values[2], what))
            since = obj(entry.get("since", {}), f"{what}.since")
            cured = _signatures(entry.get("assumed_cured", []), f"{what}.assumed_cured")
            unhealed = _signatures(entry.get("unhealed", []), f"{what}.unhealed")
            gpus[uuid] = replace(
                _kernel_log_state(entry, what),
                xids=xids,
                last_reset=opt_number(entry.get("last_reset"), what),
                since={k: number(v, what) for k, v in since.items()},
                assumed_reset=opt_number(entry.get("assumed_reset"), what),
                assumed_cured=cured,
                fabric_since=opt_number(entry.get("fabric_since"), what),
                checked_reset=opt_number(entry.get("checked_reset"), what),
                unhealed=unhealed,
            )
        return cls(gpus=gpus)


def _signatures(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 8:
        raise ValueError(f"{what}: expected a list of at most 8")
    if not all(isinstance(c, str) and 0 < len(c) <= 32 for c in value):
        raise ValueError(f"{what}: expected short strings")
    return tuple(value)


def _by_xid(entry: Mapping[str, object], what: str, name: str) -> Iterator[tuple[int, object, str]]:
    """The Xid-keyed object ``entry[name]``: each Xid, its value, and where it is (for errors)."""
    found = entry.get(name, {})
    if not isinstance(found, dict) or len(found) > MAX_XID_KINDS:
        raise ValueError(f"{what}.{name}: expected an object of at most {MAX_XID_KINDS}")
    for key, value in found.items():
        where = f"{what}.{name}.{key}"
        xid = decimal(key, XID_DIGITS) if isinstance(key, str) else None
        if xid is None:
            raise ValueError(f"{where}: expected Xid numbers as keys")
        yield xid, value, where


def _opt_str(value: object, what: str, limit: int = 200) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= limit):
        return value
    raise ValueError(f"{what}: expected a short string or null")


def _kernel_log_state(entry: Mapping[str, object], what: str) -> GpuHealthState:
    """The kernel-log fields of one GPU's entry (absent in older state files: defaults)."""
    pos = as_int(entry.get("klog_pos"))
    if (entry.get("klog_pos") is not None and pos is None) or (pos is not None and pos < 0):
        raise ValueError(f"{what}.klog_pos: expected a non-negative integer or null")
    raw_sightings = entry.get("sightings", [])
    if not isinstance(raw_sightings, list) or len(raw_sightings) > 64:
        raise ValueError(f"{what}.sightings: expected a list of at most 64")
    sightings = []
    for item in raw_sightings:
        xid = as_int(item[0]) if isinstance(item, list) and len(item) == 3 else None
        if xid is None or not 0 <= xid < 10**XID_DIGITS or item[2] not in ("nvml", "kernel"):
            raise ValueError(f"{what}.sightings: expected [xid, wall, source]")
        sightings.append(Sighting(xid, number(item[1], what), str(item[2])))
    details: dict[int, XidDetail] = {}
    for xid, raw, where in _by_xid(entry, what, "details"):
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object")
        pid = raw.get("pid")
        if pid is not None and as_int(pid) is None:
            raise ValueError(f"{where}.pid: expected an integer or null")
        details[xid] = XidDetail(
            pid=as_int(pid),
            process=_opt_str(raw.get("process"), where, 64),
            job=_opt_str(raw.get("job"), where, MAX_JOB),
            text=_opt_str(raw.get("text", ""), where) or "",
            before_start=raw.get("before_start") is True,
            wall=number(raw.get("wall"), where),
        )
    logs: dict[int, XidLog] = {}
    for xid, raw, where in _by_xid(entry, what, "xid_log"):
        held = as_int(raw[1]) if isinstance(raw, list) and len(raw) == 4 else None
        if not isinstance(raw, list) or held is None or not 0 <= held <= MAX_COUNT:
            raise ValueError(f"{where}: expected [logged_at, held, first, last]")
        logs[xid] = XidLog(
            number(raw[0], where), held, number(raw[2], where), number(raw[3], where)
        )
    return GpuHealthState(klog_pos=pos, sightings=tuple(sightings), details=details, xid_log=logs)
