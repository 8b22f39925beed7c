"""The planner's carried state: what survives restarts, its JSON form and its validation.

This module owns the state ``plan`` carries from poll to poll and saves across restarts
(``PlanState`` and its parts: ``SeenFinding``, ``Ladder``, ``ResetInFlight``, ``HealthWait``,
``Latch``, ``ResetRefusal``, ``MigUnfinished``),
the saved JSON format (``PlanState.to_json`` / ``PlanState.from_json``, version
``PLAN_STATE_VERSION``) and the checks applied when it is read back, so a damaged state file is
a ValueError, never a wrong decision.

In detail: docs/internals.md, section `gpuwatchd.decide.plan.state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.core.checked import flag as _bool
from gpuwatchd.core.checked import integer as _int
from gpuwatchd.core.checked import items as _list
from gpuwatchd.core.checked import number as _float
from gpuwatchd.core.checked import numbers as _floats
from gpuwatchd.core.checked import obj as _obj
from gpuwatchd.core.checked import opt_number as _opt_float
from gpuwatchd.core.checked import opt_text as _opt_str
from gpuwatchd.core.checked import pairs as _pairs
from gpuwatchd.core.checked import text as _str
from gpuwatchd.core.vocabulary import PLAN_STATE_VERSION, LadderStatus
from gpuwatchd.decide.plan.shadow import DryShadow


@dataclass(frozen=True)
class SeenFinding:
    """When a finding key was first seen (monotonic) and a digest to notice changes."""

    first_seen: float
    digest: str
    gpu: str | None
    target: str | None


@dataclass(frozen=True)
class Ladder:
    """One target's escalation. ``steps`` is copied from the rule when the ladder starts, so a
    config reload never changes a ladder in progress. ``step`` is how many steps were emitted;
    ``due`` is when the next step (or, after the last, the end) is due. ``status`` is "active"
    or terminal: "ended", "stuck", "failed" (terminal ladders stay while the process lives, so
    that identity is never signalled again)."""

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
    user: str | None = None  # the target's owner when the ladder started (for on_action)


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
    """A health reset waiting for its GPU's users to finish (drain, then reset).

    ``since`` is monotonic (when the drain began: the hooks were asked for then, and
    ``health.drain_timeout`` counts from it); ``expired`` once the wait passed the timeout and
    ``on_failure`` was asked for (once). Kept per GPU UUID while its finding lasts.
    """

    finding_key: str
    since: float
    dry_run: bool
    expired: bool = False


@dataclass(frozen=True)
class ResetRefusal:
    """A reset of one GPU that did not happen, and for which incident (docs/reset.md).

    ``finding_key`` is the incident (the ghost-memory or health finding the reset was for);
    ``in_use`` says the driver itself refused ("In use by another client") although the final
    scan found no holder; ``since`` is wall time. ``allocated`` is the GPU's allocated memory
    at the first poll after the refusal (None until then, or unknown): a change of it is one of
    the things that let the reset be tried again. ``dry_run``: a dry run's would-be reset that
    its read-only final scan found held, kept so the preview holds the incident as enforcement
    would; dropped the moment the daemon acts for real.
    """

    finding_key: str
    reason: str
    in_use: bool
    since: float
    allocated: int | None = None
    dry_run: bool = False
    # A live holder (a monitor, say) was seen on the GPU since: its letting go is a change.
    held: bool = False


@dataclass(frozen=True)
class MigUnfinished:
    """A MIG GPU instance whose re-creation failed once its commands had started: it may be
    half done (destroyed, not created again), so its GPU is not clean (decide/verdict.py) until
    a snapshot shows an instance of the planned GI ``profile`` at the planned ``placement``
    (``size`` slices) on GPU ``gpu`` again. Kept by the instance's MIG UUID; ``since`` is wall
    time, ``outcome`` the recovery's result (docs/reset.md)."""

    gpu: str
    gi: int
    profile: int
    placement: int
    size: int
    since: float
    outcome: str


@dataclass(frozen=True)
class Latch:
    """A kill-cap latch: why, and since when. It holds ``limits.kill_cap_latch`` measured on
    the plan's monotonic clock from ``since_monotonic`` (a wall clock step neither lifts it
    early nor stretches it); ``since`` (wall time) shows it and, across a reboot or from an
    older state file (``since_monotonic`` None), anchors it once on the monotonic clock."""

    reason: str
    since: float
    since_monotonic: float | None = None


@dataclass(frozen=True)
class PlanState:
    """Everything ``plan`` carries from poll to poll; saved across restarts (to_json).

    Monotonic times (``seen``, ``waiting``, ladders, ``quiet_until``, ``signal_history``) are only
    meaningful within one boot and are dropped when the boot id changes (the latches'
    ``since_monotonic`` too: a latch is anchored again, see :class:`Latch`). Wall times
    (``last_reset``, ``reset_history``, the latches' ``since``) are kept; a backward wall-clock
    step shifts them back by the step, so the step counts as no time passed.

    ``signal_scopes`` says whose (``uid:N``) each target of ``signal_history`` was; the node's
    kill-cap latch is ``forced_dry_run`` (since ``forced_since``, and ``forced_since_monotonic``
    as a :class:`Latch`'s ``since_monotonic``), one user's is in
    ``scope_latches``. ``health_drained`` maps a GPU UUID to whether the ``reset.drain`` hooks
    its health incident ran were a dry run: kept while any health finding of that GPU lasts
    (DRAIN_P2P settling to GPU_RESET is one incident, drained once) and until a reset of it
    succeeded (its ``after`` hooks undid the drain).
    """

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
    health_waits: Mapping[str, HealthWait] = field(default_factory=dict)
    reset_refusals: Mapping[str, ResetRefusal] = field(default_factory=dict)
    health_drained: Mapping[str, bool] = field(default_factory=dict)
    mig_unfinished: Mapping[str, MigUnfinished] = field(default_factory=dict)
    shadow: DryShadow = field(default_factory=DryShadow)  # dry-run's would-be limits (shadow.py)

    def to_json(self) -> dict[str, object]:
        """Plain JSON-able data (dicts, lists, str, float, int, bool, None)."""
        return _dump_state(self)

    @classmethod
    def from_json(cls, data: object) -> PlanState:
        """Rebuild a state saved by ``to_json``; ValueError when ``data`` is malformed."""
        return _load_state(data)


# --- JSON -------------------------------------------------------------------------------------
# Written by hand, not by reflection: the saved format is an interface (restarts, upgrades), and
# every value read back is checked, so a damaged file is a ValueError, never a wrong decision.


def _dump_ladder(lad: Ladder) -> dict[str, object]:
    return {
        "target": lad.target,
        "pid": lad.pid,
        "start_ticks": lad.start_ticks,
        "finding": lad.finding_key,
        "rule": lad.rule,
        "gpu": lad.gpu,
        "steps": [[sig, wait] for sig, wait in lad.steps],
        "step": lad.step,
        "due": lad.due,
        "status": lad.status,
        "dry_run": lad.dry_run,
        "started": lad.started,
        "user": lad.user,
    }


def _dump_state(s: PlanState) -> dict[str, object]:
    flight = s.reset_in_flight
    return {
        "version": PLAN_STATE_VERSION,
        "boot_id": s.boot_id,
        "seen": {
            k: {"first_seen": v.first_seen, "digest": v.digest, "gpu": v.gpu, "target": v.target}
            for k, v in s.seen.items()
        },
        "notes": dict(s.notes),
        "waiting": dict(s.waiting),
        "ladders": {k: _dump_ladder(v) for k, v in s.ladders.items()},
        "quiet_until": dict(s.quiet_until),
        "last_reset": dict(s.last_reset),
        "last_dry_reset": dict(s.last_dry_reset),
        "reset_history": [[g, t] for g, t in s.reset_history],
        "reset_failures": s.reset_failures,
        "circuit_open": s.circuit_open,
        "reset_in_flight": None
        if flight is None
        else {
            "gpu": flight.gpu,
            "finding": flight.finding_key,
            "dry_run": flight.dry_run,
            "since": flight.since,
            "delay": flight.delay,
        },
        "signal_history": [[t, at] for t, at in s.signal_history],
        "forced_dry_run": s.forced_dry_run,
        "forced_reason": s.forced_reason,
        "forced_since": s.forced_since,
        "forced_since_monotonic": s.forced_since_monotonic,
        "signal_scopes": dict(s.signal_scopes),
        "scope_latches": {
            scope: {
                "reason": latch.reason,
                "since": latch.since,
                "since_monotonic": latch.since_monotonic,
            }
            for scope, latch in s.scope_latches.items()
        },
        "paused": s.paused,
        "paused_reason": s.paused_reason,
        "paused_until": s.paused_until,
        "last_wall": s.last_wall,
        "health_waits": {
            gpu: {
                "finding": wait.finding_key,
                "since": wait.since,
                "dry_run": wait.dry_run,
                "expired": wait.expired,
            }
            for gpu, wait in s.health_waits.items()
        },
        "reset_refusals": {
            gpu: {
                "finding": r.finding_key,
                "reason": r.reason,
                "in_use": r.in_use,
                "since": r.since,
                "allocated": r.allocated,
                "dry_run": r.dry_run,
                "held": r.held,
            }
            for gpu, r in s.reset_refusals.items()
        },
        "health_drained": dict(sorted(s.health_drained.items())),
        "mig_unfinished": {
            mig: {
                "gpu": u.gpu,
                "gi": u.gi,
                "profile": u.profile,
                "placement": u.placement,
                "size": u.size,
                "since": u.since,
                "outcome": u.outcome,
            }
            for mig, u in sorted(s.mig_unfinished.items())
        },
        "shadow": s.shadow.to_json(),
    }


def _load_ladder(value: object, what: str) -> Ladder:
    d = _obj(value, what)
    steps = []
    for i, item in enumerate(_list(d.get("steps"), f"{what}.steps")):
        pair = _list(item, f"{what}.steps[{i}]")
        if len(pair) != 2:
            raise ValueError(f"{what}.steps[{i}]: expected [signal, wait]")
        steps.append((_opt_str(pair[0], f"{what}.steps[{i}]"), _float(pair[1], what)))
    status = _str(d.get("status"), f"{what}.status")
    step = _int(d.get("step"), f"{what}.step")
    if status not in set(LadderStatus) or not 0 <= step <= len(steps):
        raise ValueError(f"{what}: invalid status or step")
    return Ladder(
        target=_str(d.get("target"), f"{what}.target"),
        pid=_int(d.get("pid"), f"{what}.pid"),
        start_ticks=_int(d.get("start_ticks"), f"{what}.start_ticks"),
        finding_key=_str(d.get("finding"), f"{what}.finding"),
        rule=_str(d.get("rule"), f"{what}.rule"),
        gpu=_opt_str(d.get("gpu"), f"{what}.gpu"),
        steps=tuple(steps),
        step=step,
        due=_opt_float(d.get("due"), f"{what}.due"),
        status=LadderStatus(status),
        dry_run=_bool(d.get("dry_run"), f"{what}.dry_run"),
        started=_float(d.get("started"), f"{what}.started"),
        user=_opt_str(d.get("user"), f"{what}.user"),  # absent in older state files: unknown
    )


def _load_state(data: object) -> PlanState:
    d = _obj(data, "plan")
    version = d.get("version", PLAN_STATE_VERSION)
    if version != PLAN_STATE_VERSION:
        raise ValueError(f"plan: unsupported state version {version!r}")
    seen = {}
    for k, v in _obj(d.get("seen", {}), "plan.seen").items():
        e = _obj(v, f"plan.seen.{k}")
        seen[k] = SeenFinding(
            first_seen=_float(e.get("first_seen"), f"plan.seen.{k}.first_seen"),
            digest=_str(e.get("digest"), f"plan.seen.{k}.digest"),
            gpu=_opt_str(e.get("gpu"), f"plan.seen.{k}.gpu"),
            target=_opt_str(e.get("target"), f"plan.seen.{k}.target"),
        )
    flight_data = d.get("reset_in_flight")
    flight = None
    if flight_data is not None:
        f = _obj(flight_data, "plan.reset_in_flight")
        flight = ResetInFlight(
            gpu=_str(f.get("gpu"), "plan.reset_in_flight.gpu"),
            finding_key=_str(f.get("finding"), "plan.reset_in_flight.finding"),
            dry_run=_bool(f.get("dry_run"), "plan.reset_in_flight.dry_run"),
            since=_float(f.get("since"), "plan.reset_in_flight.since"),
            delay=_float(f.get("delay", 0.0), "plan.reset_in_flight.delay"),
        )
    failures = _int(d.get("reset_failures", 0), "plan.reset_failures")
    if failures < 0:
        raise ValueError("plan.reset_failures: negative")
    return PlanState(
        boot_id=_opt_str(d.get("boot_id"), "plan.boot_id"),
        seen=seen,
        notes={k: _str(v, f"plan.notes.{k}") for k, v in _obj(d.get("notes", {}), "notes").items()},
        waiting=_floats(d.get("waiting", {}), "plan.waiting"),
        ladders={
            k: _load_ladder(v, f"plan.ladders.{k}")
            for k, v in _obj(d.get("ladders", {}), "plan.ladders").items()
        },
        quiet_until=_floats(d.get("quiet_until", {}), "plan.quiet_until"),
        last_reset=_floats(d.get("last_reset", {}), "plan.last_reset"),
        last_dry_reset=_floats(d.get("last_dry_reset", {}), "plan.last_dry_reset"),
        reset_history=_pairs(d.get("reset_history", []), "plan.reset_history"),
        reset_failures=failures,
        circuit_open=_bool(d.get("circuit_open", False), "plan.circuit_open"),
        reset_in_flight=flight,
        signal_history=_pairs(d.get("signal_history", []), "plan.signal_history"),
        forced_dry_run=_bool(d.get("forced_dry_run", False), "plan.forced_dry_run"),
        forced_reason=_opt_str(d.get("forced_reason"), "plan.forced_reason"),
        forced_since=_opt_float(d.get("forced_since"), "plan.forced_since"),
        forced_since_monotonic=_opt_float(
            d.get("forced_since_monotonic"), "plan.forced_since_monotonic"
        ),  # absent in older state files: anchored once by wall time
        signal_scopes={
            k: _str(v, f"plan.signal_scopes.{k}")
            for k, v in _obj(d.get("signal_scopes", {}), "plan.signal_scopes").items()
        },
        scope_latches=_load_latches(d.get("scope_latches", {})),
        paused=_bool(d.get("paused", False), "plan.paused"),
        paused_reason=_opt_str(d.get("paused_reason"), "plan.paused_reason"),
        paused_until=_opt_float(d.get("paused_until"), "plan.paused_until"),
        last_wall=_opt_float(d.get("last_wall"), "plan.last_wall"),
        health_waits=_load_health_waits(d.get("health_waits", {})),
        reset_refusals=_load_refusals(d.get("reset_refusals", {})),
        health_drained={
            gpu: _bool(dry, f"plan.health_drained.{gpu}")
            for gpu, dry in _obj(d.get("health_drained", {}), "plan.health_drained").items()
        },
        mig_unfinished=_load_unfinished(d.get("mig_unfinished", {})),
        shadow=DryShadow.from_json(d.get("shadow")),
    )


def _load_unfinished(value: object) -> dict[str, MigUnfinished]:
    unfinished = {}
    for mig, item in _obj(value, "plan.mig_unfinished").items():
        what = f"plan.mig_unfinished.{mig}"
        e = _obj(item, what)
        unfinished[mig] = MigUnfinished(
            gpu=_str(e.get("gpu"), f"{what}.gpu"),
            gi=_int(e.get("gi"), f"{what}.gi"),
            profile=_int(e.get("profile"), f"{what}.profile"),
            placement=_int(e.get("placement"), f"{what}.placement"),
            size=_int(e.get("size"), f"{what}.size"),
            since=_float(e.get("since"), f"{what}.since"),
            outcome=_str(e.get("outcome"), f"{what}.outcome"),
        )
    return unfinished


def _load_refusals(value: object) -> dict[str, ResetRefusal]:
    refusals = {}
    for gpu, item in _obj(value, "plan.reset_refusals").items():
        what = f"plan.reset_refusals.{gpu}"
        e = _obj(item, what)
        allocated = e.get("allocated")
        refusals[gpu] = ResetRefusal(
            finding_key=_str(e.get("finding"), f"{what}.finding"),
            reason=_str(e.get("reason"), f"{what}.reason"),
            in_use=_bool(e.get("in_use"), f"{what}.in_use"),
            since=_float(e.get("since"), f"{what}.since"),
            allocated=None if allocated is None else _int(allocated, f"{what}.allocated"),
            dry_run=_bool(e.get("dry_run", False), f"{what}.dry_run"),
            held=_bool(e.get("held", False), f"{what}.held"),
        )
    return refusals


def _load_latches(value: object) -> dict[str, Latch]:
    latches = {}
    for scope, item in _obj(value, "plan.scope_latches").items():
        what = f"plan.scope_latches.{scope}"
        e = _obj(item, what)
        latches[scope] = Latch(
            reason=_str(e.get("reason"), f"{what}.reason"),
            since=_float(e.get("since"), f"{what}.since"),
            since_monotonic=_opt_float(e.get("since_monotonic"), f"{what}.since_monotonic"),
        )
    return latches


def _load_health_waits(value: object) -> dict[str, HealthWait]:
    waits = {}
    for gpu, item in _obj(value, "plan.health_waits").items():
        what = f"plan.health_waits.{gpu}"
        e = _obj(item, what)
        waits[gpu] = HealthWait(
            finding_key=_str(e.get("finding"), f"{what}.finding"),
            since=_float(e.get("since"), f"{what}.since"),
            dry_run=_bool(e.get("dry_run"), f"{what}.dry_run"),
            expired=_bool(e.get("expired", False), f"{what}.expired"),
        )
    return waits


def unfinished_recoveries(state: PlanState) -> dict[str, str]:
    """GPU UUID → why it is not clean, for each GPU with a MIG recovery left half done
    (decide/verdict.py's ``mig_unfinished``)."""
    found: dict[str, list[str]] = {}
    for mig, u in sorted(state.mig_unfinished.items()):
        found.setdefault(u.gpu, []).append(
            f"the re-creation of MIG GPU instance {u.gi} ({mig}, GI profile {u.profile}, "
            f"placement {u.placement}:{u.size}) {u.outcome} after its commands started: it may "
            "be half done (`nvidia-smi mig -lgi`; re-create it by hand)"
        )
    return {gpu: "; ".join(whys) for gpu, whys in found.items()}
