"""The planner's carried state (``PlanState`` and its parts), what survives restarts, and its
checked JSON form (version ``PLAN_STATE_VERSION``): a damaged state file is a ValueError,
never a wrong decision.

In detail: docs/internals.md, section `gpuwatchd.decide.plan.state`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Generic, TypeVar

from gpuwatchd.core.checked import (
    by_name,
    flag,
    integer,
    is_version,
    items,
    name,
    number,
    numbers,
    obj,
    opt_name,
    opt_number,
    opt_reason,
    opt_text,
    pairs,
    reason,
    shown,
    text,
)
from gpuwatchd.core.codec import Reader
from gpuwatchd.core.model import fields_of
from gpuwatchd.core.vocabulary import PLAN_STATE_VERSION, LadderStatus
from gpuwatchd.decide.plan.shadow import MAX_ENTRIES, DryShadow
from gpuwatchd.decide.policy import SIGNAL_NAMES

_T = TypeVar("_T")


@dataclass(frozen=True)
class SeenFinding:
    """When a finding key was first seen (monotonic) and a digest to notice changes."""

    first_seen: float
    digest: str
    gpu: str | None
    target: str | None


@dataclass(frozen=True)
class Ladder:
    """One target's escalation: ``steps`` copied from the rule at its start, ``step`` how many
    were emitted, ``due`` when the next (or the end) is due (docs/internals.md)."""

    target: str
    pid: int
    start_ticks: int
    finding_key: str
    rule: str
    gpu: str | None
    steps: tuple[tuple[str | None, float], ...]
    step: int
    due: float | None
    status: LadderStatus
    dry_run: bool
    started: float
    user: str | None = None  # the target's owner at the start (for on_action)


@dataclass(frozen=True)
class ResetInFlight:
    """The one reset that was handed to act and whose outcome has not come back yet."""

    gpu: str
    finding_key: str
    dry_run: bool
    since: float
    delay: float  # the post-action delay to apply when the outcome comes back


@dataclass(frozen=True)
class HealthWait:
    """A health reset waiting for its GPU's users to finish (drain, then reset), per GPU UUID:
    ``since`` (monotonic) the drain began; ``expired`` once past ``health.drain_timeout``."""

    finding_key: str
    since: float
    dry_run: bool
    expired: bool = False


@dataclass(frozen=True)
class ResetRefusal:
    """A reset of one GPU that did not happen, and for which incident (docs/internals.md)."""

    finding_key: str
    reason: str
    in_use: bool
    since: float
    allocated: int | None = None
    dry_run: bool = False
    held: bool = False


@dataclass(frozen=True)
class MigUnfinished:
    """A MIG GPU instance (by MIG UUID) whose re-creation failed after its commands started:
    its GPU is not clean until a snapshot shows its GI ``profile`` at its ``placement`` again."""

    gpu: str
    gi: int
    profile: int
    placement: int
    size: int
    since: float
    outcome: str


@dataclass(frozen=True)
class Latch:
    """A kill-cap latch: why, since when (wall time), and its monotonic anchor (None until
    anchored: after a reboot, or from an older state file)."""

    reason: str
    since: float
    since_monotonic: float | None = None


_Since = TypeVar("_Since", Latch, ResetRefusal, MigUnfinished)  # each keeps a wall ``since``


def moved_since(entries: Mapping[str, _Since], step: float) -> dict[str, _Since]:
    """``entries`` with each ``since`` moved ``step`` seconds back (a wall-clock step)."""
    return {key: replace(entry, since=entry.since - step) for key, entry in entries.items()}


@dataclass(frozen=True)
class PlanState:
    """Everything ``plan`` carries from poll to poll; saved across restarts (to_json)."""

    boot_id: str | None = None
    seen: Mapping[str, SeenFinding] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)
    waiting: Mapping[str, float] = field(default_factory=dict)
    ladders: Mapping[str, Ladder] = field(default_factory=dict)
    quiet_until: Mapping[str, float] = field(default_factory=dict)
    last_reset: Mapping[str, float] = field(default_factory=dict)
    last_dry_reset: Mapping[str, float] = field(default_factory=dict)
    reset_history: tuple[tuple[str, float], ...] = ()
    reset_failures: int = 0
    last_failure: float | None = None  # wall time of the last failure counted (None: unknown)
    circuit_open: bool = False
    reset_in_flight: ResetInFlight | None = None
    signal_history: tuple[tuple[str, float], ...] = ()
    forced_dry_run: bool = False
    forced_reason: str | None = None
    forced_since: float | None = None
    forced_since_monotonic: float | None = None
    signal_scopes: Mapping[str, str] = field(default_factory=dict)
    scope_latches: Mapping[str, Latch] = field(default_factory=dict)
    paused: bool = False
    paused_reason: str | None = None
    paused_until: float | None = None  # wall time a timed pause ends (pause --for)
    last_wall: float | None = None
    last_monotonic: float | None = None  # the monotonic time of last_wall (rebase_wall)
    health_waits: Mapping[str, HealthWait] = field(default_factory=dict)
    reset_refusals: Mapping[str, ResetRefusal] = field(default_factory=dict)
    health_drained: Mapping[str, bool] = field(default_factory=dict)
    mig_unfinished: Mapping[str, MigUnfinished] = field(default_factory=dict)
    shadow: DryShadow = field(default_factory=DryShadow)  # dry-run's would-be limits (shadow.py)

    def without_node_latch(self) -> PlanState:
        """The node's kill-cap latch (its forced dry run) lifted."""
        return replace(
            self,
            forced_dry_run=False,
            forced_reason=None,
            forced_since=None,
            forced_since_monotonic=None,
        )

    def to_json(self) -> dict[str, object]:
        """Plain JSON-able data (dicts, lists, str, float, int, bool, None)."""
        parts = {key: write(getattr(self, key)) for key, (write, _, _) in _PARTS.items()}
        return {"version": PLAN_STATE_VERSION, **_SCALARS.values_of(self), **parts}

    @classmethod
    def from_json(cls, data: object) -> PlanState:
        """Rebuild a state saved by ``to_json``; ValueError when ``data`` is malformed."""
        d = obj(data, "plan")
        version = d.get("version", PLAN_STATE_VERSION)
        if not is_version(version, PLAN_STATE_VERSION):
            raise ValueError(f"plan: unsupported state version {shown(version)}")
        scalars = _SCALARS.read(d, "plan")
        if scalars["reset_failures"] < 0:
            raise ValueError("plan.reset_failures: negative")
        parts = {
            key: read(d.get(key, absent), f"plan.{key}")
            for key, (_, read, absent) in _PARTS.items()
        }
        return cls(**scalars, **parts)


# --- JSON -------------------------------------------------------------------------------------
# Field by field, not by reflection: the saved format is an interface (restarts, upgrades).


@dataclass(frozen=True)
class _Form(Generic[_T]):
    """A saved record's form: its ``fields`` ("key=attribute", as ``fields_of`` names them),
    each with its checked reader; ``absent``: what a key older files lack reads as (None)."""

    make: Callable[..., _T]
    fields: Mapping[str, Reader]
    absent: Mapping[str, object] = field(default_factory=dict)

    def values_of(self, record: object) -> dict[str, object]:
        return fields_of(record, tuple(self.fields))

    def read(self, data: Mapping[str, object], what: str) -> dict[str, Any]:
        """Each field's checked value by attribute; ValueError naming ``what`` and the key."""
        found = {}
        for field_name, reader in self.fields.items():
            key, _, attribute = field_name.partition("=")
            found[attribute or key] = reader(data.get(key, self.absent.get(key)), f"{what}.{key}")
        return found

    def load(self, value: object, what: str) -> _T:
        return self.make(**self.read(obj(value, what), what))

    def load_all(self, value: object, what: str) -> dict[str, _T]:
        """A saved ``{key: record}`` mapping."""
        return _each(self.load, value, what)

    def dump_all(self, records: Mapping[str, _T], ordered: bool = False) -> dict[str, object]:
        entries = sorted(records.items()) if ordered else records.items()
        return {key: self.values_of(record) for key, record in entries}


def _each(read: Callable[[object, str], _T], value: object, what: str) -> dict[str, _T]:
    """The saved object ``value`` keyed by names, each of its values read by ``read``."""
    return {key: read(item, f"{what}.{key}") for key, item in by_name(value, what).items()}


def _opt_int(value: object, what: str) -> int | None:
    return None if value is None else integer(value, what)


# PlanState's own scalar fields ("reset_failures" is also checked to be >= 0).
_SCALARS = _Form(PlanState, {"boot_id": opt_name, "reset_failures": integer,
                 # absent in older state files: unknown, lifted by any resume --clear-latches
                 "last_failure": opt_number,
                 "circuit_open": flag, "forced_dry_run": flag, "forced_reason": opt_reason,
                 "forced_since": opt_number,
                 # absent in older state files: anchored once by wall time
                 "forced_since_monotonic": opt_number,
                 "paused": flag, "paused_reason": opt_reason, "paused_until": opt_number,
                 "last_wall": opt_number,
                 # absent in older state files: a forward step is first seen after a poll
                 "last_monotonic": opt_number},
                 {"reset_failures": 0, "circuit_open": False, "forced_dry_run": False,
                  "paused": False})  # fmt: skip
_SEEN = _Form(
    SeenFinding, {"first_seen": number, "digest": text, "gpu": opt_name, "target": opt_text}
)
_IN_FLIGHT = _Form(ResetInFlight, {"gpu": text, "finding=finding_key": text, "dry_run": flag,
                   "since": number, "delay": number}, {"delay": 0.0})  # fmt: skip
_LATCH = _Form(Latch, {"reason": reason, "since": number, "since_monotonic": opt_number})
_HEALTH_WAIT = _Form(HealthWait, {"finding=finding_key": name, "since": number,
                     "dry_run": flag, "expired": flag}, {"expired": False})  # fmt: skip
_REFUSAL = _Form(ResetRefusal, {"finding=finding_key": name, "reason": reason, "in_use": flag,
                 "since": number, "allocated": _opt_int, "dry_run": flag, "held": flag},
                 {"dry_run": False, "held": False})  # fmt: skip
_UNFINISHED = _Form(MigUnfinished, {"gpu": name, "gi": integer, "profile": integer,
                    "placement": integer, "size": integer, "since": number,
                    "outcome": reason})  # fmt: skip

# A ladder's fields in its events, and (with the rest, in this order) in the state file.
LADDER_EVENT_FIELDS = ("target", "pid", "start_ticks", "finding=finding_key", "rule", "gpu",
                       "step", "dry_run")  # fmt: skip


def _steps(value: object, what: str) -> tuple[tuple[str | None, float], ...]:
    steps = []
    for i, item in enumerate(items(value, what)):
        pair = items(item, f"{what}[{i}]")
        if len(pair) != 2:
            raise ValueError(f"{what}[{i}]: expected [signal, wait]")
        signal = opt_text(pair[0], f"{what}[{i}]")
        if signal is not None and signal not in SIGNAL_NAMES:
            raise ValueError(f"{what}[{i}]: not a signal a ladder sends: {signal!r}")
        steps.append((signal, number(pair[1], what.removesuffix(".steps"))))
    return tuple(steps)


# "user" is absent in older state files: unknown. "status" is checked with "step" (_ladder).
_LADDER = _Form(Ladder, {"target": text, "pid": integer, "start_ticks": integer,
                "finding=finding_key": name, "rule": name, "gpu": opt_name, "steps": _steps,
                "step": integer, "due": opt_number, "status": text, "dry_run": flag,
                "started": number, "user": opt_name})  # fmt: skip


def _dump_ladder(lad: Ladder) -> dict[str, object]:
    # "steps" keeps its place in the file's order; its pairs become lists.
    return {**_LADDER.values_of(lad), "steps": [[sig, wait] for sig, wait in lad.steps]}


def _ladder(value: object, what: str) -> Ladder:
    found = _LADDER.read(obj(value, what), what)
    if found["status"] not in set(LadderStatus) or not 0 <= found["step"] <= len(found["steps"]):
        raise ValueError(f"{what}: invalid status or step")
    return Ladder(**{**found, "status": LadderStatus(found["status"])})


def _ladders(value: object, what: str) -> dict[str, Ladder]:
    """The saved ladders, each under its own target, ``pid@start_ticks``: one under another key
    would be advanced under its target while the copy repeated its step at every poll."""
    ladders = _each(_ladder, value, what)
    for key, lad in ladders.items():
        if not key == lad.target == f"{lad.pid}@{lad.start_ticks}":
            raise ValueError(f"{what}.{key}: not saved under its target, pid@start_ticks")
    return ladders


def _listed(history: tuple[tuple[str, float], ...]) -> list[list[object]]:
    return [[name, at] for name, at in history]


# PlanState's other parts, in the file's order: key -> (write, read, what the key reads as in
# an older file that lacks it).
_PARTS: dict[str, tuple[Callable[[Any], object], Reader, object]] = {
    "seen": (_SEEN.dump_all, _SEEN.load_all, {}),
    "notes": (dict, partial(_each, text), {}),
    "waiting": (dict, numbers, {}),
    "ladders": (lambda ladders: {k: _dump_ladder(v) for k, v in ladders.items()}, _ladders, {}),
    "quiet_until": (dict, numbers, {}),
    "last_reset": (dict, numbers, {}),
    "last_dry_reset": (dict, numbers, {}),
    "reset_history": (_listed, pairs, []),
    "reset_in_flight": (
        lambda flight: None if flight is None else _IN_FLIGHT.values_of(flight),
        lambda value, what: None if value is None else _IN_FLIGHT.load(value, what),
        None,
    ),
    "signal_history": (_listed, pairs, []),
    "signal_scopes": (dict, partial(_each, name), {}),
    "scope_latches": (
        _LATCH.dump_all,
        lambda value, what: _LATCH.load_all(by_name(value, what, MAX_ENTRIES), what),
        {},
    ),
    "health_waits": (_HEALTH_WAIT.dump_all, _HEALTH_WAIT.load_all, {}),
    "reset_refusals": (_REFUSAL.dump_all, _REFUSAL.load_all, {}),
    "health_drained": (lambda drained: dict(sorted(drained.items())), partial(_each, flag), {}),
    "mig_unfinished": (partial(_UNFINISHED.dump_all, ordered=True), _UNFINISHED.load_all, {}),
    "shadow": (DryShadow.to_json, lambda value, _what: DryShadow.from_json(value), None),
}


def unfinished_recoveries(state: PlanState) -> dict[str, str]:
    """GPU UUID → why it is not clean, for each GPU with a MIG recovery left half done."""
    found: dict[str, list[str]] = {}
    for mig, u in sorted(state.mig_unfinished.items()):
        found.setdefault(u.gpu, []).append(
            f"the re-creation of MIG GPU instance {u.gi} ({mig}, GI profile {u.profile}, "
            f"placement {u.placement}:{u.size}) {u.outcome} after its commands started: it may "
            "be half done (`nvidia-smi mig -lgi`; re-create it by hand)"
        )
    return {gpu: "; ".join(whys) for gpu, whys in found.items()}
