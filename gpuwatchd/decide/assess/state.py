"""What the assessment carries from poll to poll and across restarts: :class:`AssessState`,
its checked JSON form (a damaged file is a ValueError, never a wrong decision), and the rules
that carry it forward. Pure. In detail: docs/internals.md, section `gpuwatchd.decide.assess.state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from gpuwatchd.core.checked import as_number, is_version, shown
from gpuwatchd.core.model import ProcessIdentity, ProcessInfo, as_int
from gpuwatchd.core.vocabulary import ASSESS_STATE_VERSION, ASSESS_STATE_VERSIONS_READ
from gpuwatchd.decide.assess.host_view import HostView
from gpuwatchd.decide.health.state import HealthState

MAX_INHERITANCE_PER_HOLDER = 8
_C = TypeVar("_C", dict[object, object], list[object])

# One holder's kcmp answers, recorded while each owner lived: (owner identity, shared?); None:
# cut short by a poll's fd budget (FileSharing.cut), the holder is undecided until answered.
Inheritance = tuple[tuple[ProcessIdentity, bool | None], ...]


@dataclass(frozen=True)
class Lineage:
    """What a process looked like when first seen (docs/design-notes.md §4); monotonic."""

    ppid: int | None
    pgid: int | None
    sid: int | None
    job: str | None
    first_seen: float


@dataclass(frozen=True)
class AssessState:
    """What assessment carries from one poll to the next (docs/internals.md)."""

    baselines: Mapping[str, int] = field(default_factory=dict)
    lineage: Mapping[ProcessIdentity, Lineage] = field(default_factory=dict)
    boot_id: str | None = None
    unaccounted_since: Mapping[str, float] = field(default_factory=dict)
    owners: frozenset[ProcessIdentity] = frozenset()
    inheritance: Mapping[ProcessIdentity, Inheritance] = field(default_factory=dict)
    health: HealthState = field(default_factory=HealthState)  # decide/health/judge.py

    def to_json(self) -> dict[str, object]:
        return {
            "health": self.health.to_json(),
            "version": ASSESS_STATE_VERSION,
            "boot_id": self.boot_id,
            "baselines": dict(sorted(self.baselines.items())),
            "unaccounted_since": dict(sorted(self.unaccounted_since.items())),
            "owners": [[ident.pid, ident.start_ticks] for ident in sorted(self.owners)],
            "lineage": [
                {"pid": ident.pid, "start_ticks": ident.start_ticks, **asdict(lin)}
                for ident, lin in sorted(self.lineage.items())
            ],
            "inheritance": [
                {
                    "pid": ident.pid,
                    "start_ticks": ident.start_ticks,
                    "owners": [[o.pid, o.start_ticks, shared] for o, shared in answers],
                }
                for ident, answers in sorted(self.inheritance.items())
            ],
        }

    @classmethod
    def from_json(cls, data: object) -> AssessState:
        """Rebuild the state written by :meth:`to_json`; raise ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("assess state must be an object")
        if not is_version(data.get("version"), *ASSESS_STATE_VERSIONS_READ):
            raise ValueError(f"unsupported assess state version: {shown(data.get('version'))}")
        boot_id = data.get("boot_id")
        if boot_id is not None and not isinstance(boot_id, str):
            raise ValueError("boot_id must be a string or null")
        baselines: dict[str, int] = {}
        for uuid, value in _part(data, "baselines", dict).items():
            amount = as_int(value)
            if not isinstance(uuid, str) or amount is None or amount < 0:
                raise ValueError(f"bad baseline entry: {uuid!r}: {value!r}")
            baselines[uuid] = amount
        since: dict[str, float] = {}
        for uuid, value in _part(data, "unaccounted_since", dict).items():
            time = as_number(value)  # finite: the state is written without NaN
            if not isinstance(uuid, str) or time is None:
                raise ValueError(f"bad unaccounted_since entry: {uuid!r}: {value!r}")
            since[uuid] = time
        lineage = dict(_lineage_entry(entry) for entry in _part(data, "lineage", list))
        owners: set[ProcessIdentity] = set()
        for entry in _part(data, "owners", list):
            pair = [as_int(v) for v in entry] if isinstance(entry, list) else []
            if len(pair) != 2 or pair[0] is None or pair[1] is None:
                raise ValueError(f"bad owners entry: {entry!r}")
            owners.add(ProcessIdentity(pair[0], pair[1]))
        inheritance = dict(_inheritance_entry(entry) for entry in _part(data, "inheritance", list))
        return cls(
            baselines=baselines,
            lineage=lineage,
            boot_id=boot_id,
            unaccounted_since=since,
            owners=frozenset(owners),
            inheritance=inheritance,
            health=HealthState.from_json(data.get("health", {})),
        )


def _part(data: dict[object, object], key: str, kind: type[_C]) -> _C:
    """``data[key]`` (absent: empty) if it is a ``kind`` (dict or list); ValueError if not."""
    value = data.get(key, kind())
    if not isinstance(value, kind):
        raise ValueError(f"{key} must be {'an object' if kind is dict else 'a list'}")
    return value


def _inheritance_entry(entry: object) -> tuple[ProcessIdentity, Inheritance]:
    if not isinstance(entry, dict):
        raise ValueError(f"bad inheritance entry: {entry!r}")
    pid, start = as_int(entry.get("pid")), as_int(entry.get("start_ticks"))
    raw = entry.get("owners")
    if pid is None or start is None or not isinstance(raw, list):
        raise ValueError(f"inheritance entry needs pid, start_ticks and owners: {entry!r}")
    if len(raw) > MAX_INHERITANCE_PER_HOLDER:
        raise ValueError(f"inheritance entry names too many owners: {entry!r}")
    answers: list[tuple[ProcessIdentity, bool | None]] = []
    for item in raw:
        ok = isinstance(item, list) and len(item) == 3 and isinstance(item[2], bool | None)
        pair = [as_int(v) for v in item[:2]] if ok else []
        if len(pair) != 2 or pair[0] is None or pair[1] is None:
            raise ValueError(f"bad inheritance owner: {item!r}")
        answers.append((ProcessIdentity(pair[0], pair[1]), item[2]))
    return ProcessIdentity(pid, start), tuple(answers)


def _lineage_entry(entry: object) -> tuple[ProcessIdentity, Lineage]:
    if not isinstance(entry, dict):
        raise ValueError(f"bad lineage entry: {entry!r}")
    pid, start = as_int(entry.get("pid")), as_int(entry.get("start_ticks"))
    first_seen = as_number(entry.get("first_seen"))
    job = entry.get("job")
    if pid is None or start is None:
        raise ValueError(f"lineage entry needs integer pid and start_ticks: {entry!r}")
    if first_seen is None:
        raise ValueError(f"lineage entry needs a numeric first_seen: {entry!r}")
    if job is not None and not isinstance(job, str):
        raise ValueError(f"lineage job must be a string or null: {entry!r}")
    ids = [entry.get(name) for name in ("ppid", "pgid", "sid")]
    if any(value is not None and as_int(value) is None for value in ids):
        raise ValueError(f"lineage ppid/pgid/sid must be integers or null: {entry!r}")
    lineage = Lineage(as_int(ids[0]), as_int(ids[1]), as_int(ids[2]), job, first_seen)
    return ProcessIdentity(pid, start), lineage


# --- carrying it forward ---------------------------------------------------------------------


def update_lineage(
    host: HostView, previous: Mapping[ProcessIdentity, Lineage], tracked: Iterable[ProcessInfo]
) -> dict[ProcessIdentity, Lineage]:
    """This boot's ``previous`` lineage where still true, and newcomers (docs/internals.md)."""
    kept: dict[ProcessIdentity, Lineage] = {}
    for ident, lin in previous.items():
        proc = host.procs.get(ident.pid)
        if proc is not None:
            if proc.start_ticks is None or proc.start_ticks == ident.start_ticks:
                kept[ident] = lin
        elif ident.pid in host.listed_dead or not host.full_scan:
            kept[ident] = lin
    for proc in tracked:
        new = proc.identity
        if new is None or new in kept:
            continue
        job = proc.cgroup.job_key if proc.cgroup is not None else None
        kept[new] = Lineage(proc.ppid, proc.pgid, proc.sid, job, host.snapshot.monotonic)
    return kept


def update_inheritance(
    host: HostView,
    previous: Mapping[ProcessIdentity, Inheritance],
    lineage: Mapping[ProcessIdentity, Lineage],
) -> dict[ProcessIdentity, Inheritance]:
    """Carry this boot's earlier kcmp answers forward and add this poll's definite ones and
    those cut short (None); a newer answer for the same owner replaces the older one."""
    kept = {ident: dict(answers) for ident, answers in previous.items() if ident in lineage}
    for answer in host.snapshot.file_sharing:
        holder, owner = host.procs.get(answer.holder), host.procs.get(answer.owner)
        if (answer.shared is None and not answer.cut) or holder is None or owner is None:
            continue
        if holder.identity is None or owner.identity is None or holder.identity not in lineage:
            continue
        known = kept.setdefault(holder.identity, {})
        if owner.identity in known or len(known) < MAX_INHERITANCE_PER_HOLDER:
            known[owner.identity] = answer.shared
    return {ident: tuple(sorted(answers.items())) for ident, answers in kept.items() if answers}


def update_owners(
    host: HostView, previous: frozenset[ProcessIdentity], lineage: Mapping[ProcessIdentity, Lineage]
) -> frozenset[ProcessIdentity]:
    """Context owners seen so far, kept as docs/internals.md says (``owners``)."""
    kept = {p.identity for p in host.listed_alive.values() if p.identity is not None}
    named = {v for lin in lineage.values() for v in (lin.ppid, lin.pgid, lin.sid) if v}
    for ident in previous:
        proc = host.procs.get(ident.pid)
        alive = proc is not None and proc.start_ticks == ident.start_ticks
        if alive or ident.pid in named:
            kept.add(ident)
    return frozenset(kept)
