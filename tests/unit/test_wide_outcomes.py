"""What a GPU health finding leads to (decide/plan/health.py) and what an outcome from act does
to the planner's state (decide/plan/outcomes.py), to the exact reason, event field and hook:
the cases the wide mutation run found untested. Pure: time is passed in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwatchd.core.model import FindingKind, ProcessIdentity
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.plan.intents import HookIntent, PlanResult, ResetIntent, SignalIntent
from gpuwatchd.decide.plan.outcomes import RESUMED, record_exit, record_reset, record_signal
from gpuwatchd.decide.plan.state import MigUnfinished, PlanState, ResetInFlight, ResetRefusal
from gpuwatchd.decide.policy import HealthPolicy, Policy
from tests.support.gatecases import (
    GPU0,
    JOB,
    RESET_DRAIN,
    WALL,
    _after_sigterm,
    _health,
    _hooks,
    _idle_host,
    _job_host,
    _plan,
    _policy,
    _signals,
)
from tests.support.migsnap import Inst, mig_uuid, with_mig
from tests.support.snapshots import HostBuilder, gpu_uuid

REASON = _health().reason
BUS0 = "00000000:10:00.0"  # GPU 0's, as HostBuilder names it
ABSENT = gpu_uuid(7)  # a GPU this snapshot does not have


def _draining(*, dry: bool = False, drain: bool = True, action: str = "reset") -> Policy:
    reset = replace(_policy().reset, drain=RESET_DRAIN if drain else ())
    health = HealthPolicy(action=action, drain_timeout=600.0)
    return _policy(dry_run=dry, reset=reset, health=health)


def _said(result: PlanResult) -> list[tuple[object, ...]]:
    """Each hook or reset intent as (hook or "reset", reason, pci_bus_id, minor, dry_run)."""
    said: list[tuple[object, ...]] = []
    for i in result.intents:
        if isinstance(i, HookIntent):
            facts = i.facts
            said.append((i.hook, i.reason, facts.get("pci_bus_id"), facts.get("minor"), i.dry_run))
        elif isinstance(i, ResetIntent):
            said.append(("reset", i.reason, i.pci_bus_id, i.minor, i.dry_run))
    return said


def _names(result: PlanResult) -> list[str]:
    return [e.name for e in result.events]


def _fields(result: PlanResult, name: str) -> list[dict[str, object]]:
    return [dict(e.fields) for e in result.events if e.name == name]


# --- plan_health: the hooks and the reset a health finding asks for ------------------------------

REBOOT = f"{GPU0} needs a reboot"


@pytest.mark.parametrize(
    ("kind", "gpu", "pol", "said"),
    [
        pytest.param(
            FindingKind.DRAIN_REQUIRED, GPU0, _draining(),
            [("reset_drain", f"{GPU0}: {REASON}", BUS0, 0, False)], id="drain",
        ),
        pytest.param(FindingKind.DRAIN_REQUIRED, GPU0, _draining(drain=False), [], id="no-hooks"),
        pytest.param(
            FindingKind.RESET_REQUIRED, GPU0, _draining(action="drain"),
            [("reset_drain", f"{GPU0}: {REASON}", BUS0, 0, False)], id="reset-as-drain",
        ),
        pytest.param(
            FindingKind.REBOOT_REQUIRED, GPU0, _draining(),
            [("on_failure", REBOOT, None, None, False), ("reset_drain", REBOOT, BUS0, 0, False)],
            id="reboot",
        ),
        pytest.param(
            FindingKind.REBOOT_REQUIRED, GPU0, _draining(dry=True),
            [("on_failure", REBOOT, None, None, True), ("reset_drain", REBOOT, BUS0, 0, True)],
            id="reboot-dry",
        ),
        pytest.param(
            FindingKind.REBOOT_REQUIRED, ABSENT, _draining(),
            [
                ("on_failure", f"{ABSENT} needs a reboot", None, None, False),
                ("reset_drain", f"{ABSENT} needs a reboot", None, None, False),
            ],
            id="reboot-gpu-gone",
        ),
        pytest.param(
            FindingKind.RESET_REQUIRED, GPU0, _draining(dry=True),
            [
                ("reset_drain", f"{GPU0} is drained for a reset: {REASON}", BUS0, 0, True),
                ("reset", f"GPU health asks for a reset: {REASON}", BUS0, 0, True),
            ],
            id="reset-dry",
        ),
    ],
)  # fmt: skip
def test_a_health_finding_runs_its_hooks_once_with_what_they_name(
    kind: FindingKind, gpu: str, pol: Policy, said: list[tuple[object, ...]]
) -> None:
    """The drain hooks only when configured, with the GPU's bus id and minor (none for a GPU
    the snapshot lacks); the reason each hook and the reset are given; a dry run's are dry."""
    first = _plan([_health(kind, gpu)], _idle_host(), PlanState(), pol, 0.0)
    assert _said(first) == said
    again = _plan([_health(kind, gpu)], _idle_host(), first.state, pol, 1.0)
    assert [s for s in _said(again) if s[0] != "reset"] == []


def test_a_health_drain_wait_says_each_new_set_of_blockers_once_then_times_out_exactly() -> None:
    pol = _draining(dry=True)
    busy = _idle_host(job_on=0)
    result = _plan([_health()], busy, PlanState(), pol, 100.0)
    (blockers,) = [f["blockers"] for f in _fields(result, EventName.HEALTH_DRAIN_WAITING)]
    assert isinstance(blockers, list)
    assert blockers
    result = _plan([_health()], busy, result.state, pol, 200.0)
    assert EventName.HEALTH_DRAIN_WAITING not in _names(result)  # the same blockers: said once
    result = _plan([_health()], busy, result.state, pol, 700.0)
    why = f"still held after 600s: {'; '.join(blockers)}; waiting on, never signalling"
    (timed_out,) = _fields(result, EventName.HEALTH_DRAIN_TIMED_OUT)
    assert (timed_out["why"], timed_out["blockers"]) == (why, blockers)
    (hook,) = _hooks(result, "on_failure")
    assert (hook.reason, hook.facts["blockers"], hook.facts["finding"], hook.dry_run) == (
        f"{GPU0}: {why}",
        blockers,
        _health().key,
        True,
    )


def test_a_health_reset_naming_a_recoverable_mig_instance_does_nothing() -> None:
    """No gate holds GPU instance 1 (idle, re-creatable), but a health reset is of a whole GPU
    and the snapshot has no GPU of that UUID: nothing is drained, waited on or reset."""
    snapshot = with_mig(HostBuilder().gpu(0).build(), instances=[Inst(1, allocated=0)])
    pol = replace(_draining(), reset=replace(_draining().reset, mig_recovery=True))
    finding = _health(FindingKind.RESET_REQUIRED, mig_uuid(0, 1))
    result = _plan([finding], snapshot, PlanState(), pol, 0.0)
    assert (result.intents, _names(result)) == ((), [EventName.FINDING_NEW])


# --- plan_outcomes: a signal's outcome, an exit -------------------------------------------------


def _at_sigkill() -> tuple[PlanState, SignalIntent]:
    """JOB's ladder after its SIGTERM was delivered (at 0): its SIGKILL, step 2, handed to act."""
    pol = _policy()
    state, finding = _after_sigterm(pol)
    second = _plan([finding], _job_host().build(), state, pol, 30.0)
    (sigkill,) = _signals(second)
    assert (sigkill.signal, sigkill.step) == ("SIGKILL", 2)
    return second.state, sigkill


def _told(result: PlanResult) -> list[tuple[str, str, object]]:
    """Each hook as (hook, reason, the why its facts carry)."""
    return [(i.hook, i.reason, i.facts.get("why")) for i in _hooks(result)]


RECORDED = EventName.ESCALATION_SIGNAL_RECORDED


@pytest.mark.parametrize(
    ("outcome", "events", "ended"),
    [
        ("gone", [RECORDED, EventName.ESCALATION_RESOLVED], "freed (gone)"),
        (
            "zombie",
            [RECORDED, EventName.ESCALATION_RESOLVED, EventName.ZOMBIE_NEEDS_REAP],
            "freed (zombie)",
        ),
        ("reused", [RECORDED, EventName.ESCALATION_ABORTED], None),
        ("denied", [RECORDED, EventName.ESCALATION_ENDED], "failed (denied)"),
        ("failed", [RECORDED, EventName.ESCALATION_ENDED], "failed (failed)"),
    ],
)
def test_a_signal_that_ends_its_ladder_says_how_and_stops_waiting(
    outcome: str, events: list[str], ended: str | None
) -> None:
    state, sigkill = _at_sigkill()
    target = f"{JOB}@{sigkill.identity.start_ticks}"
    finding = state.ladders[target].finding_key
    state = replace(state, waiting={**state.waiting, finding: 40.0, "other": 50.0})
    result = record_signal(state, sigkill, outcome, now=31.0)
    assert _names(result) == events
    why = outcome if ended is not None else None
    assert _told(result) == ([] if ended is None else [("on_action", f"{target}: {ended}", why)])
    assert result.state.waiting == {"other": 50.0}


def test_a_stale_signal_outcome_changes_nothing() -> None:
    state, sigkill = _at_sigkill()
    stale = replace(sigkill, step=1)
    result = record_signal(state, stale, "delivered", now=31.0)
    assert (result.intents, _names(result), result.state) == ((), [RECORDED], state)
    assert _fields(result, RECORDED)[0]["stale"] is True


def test_an_exit_resolves_an_active_ladder_only() -> None:
    state, sigkill = _at_sigkill()
    target = f"{JOB}@{sigkill.identity.start_ticks}"
    unknown = record_exit(state, ProcessIdentity(JOB + 1, 5), now=31.0)
    assert (unknown.intents, unknown.events, unknown.state) == ((), (), state)
    active = record_exit(state, sigkill.identity, now=31.0)
    assert _names(active) == [EventName.ESCALATION_RESOLVED]
    assert _told(active) == [("on_action", f"{target}: freed (target exited)", "target exited")]
    assert target not in active.state.ladders
    failed = record_signal(state, sigkill, "denied", now=31.0).state
    assert failed.ladders[target].status != state.ladders[target].status
    after = record_exit(failed, sigkill.identity, now=32.0)
    assert (after.intents, after.events) == ((), ())
    assert target not in after.state.ladders


# --- plan_outcomes: a reset's outcome ------------------------------------------------------------

INTENT = ResetIntent(
    gpu=GPU0, pci_bus_id=BUS0, minor=0, finding_key="ghost_memory:x:gpu", dry_run=False,
    reason="ghost memory", facts={"user": None},
)  # fmt: skip
DRY = replace(INTENT, dry_run=True)
RESUMED_INTENT = replace(INTENT, reason=RESUMED)  # a reset a restart undid (engine/cycle.py)
RESTARTED = "the daemon restarted during the reset, before it took effect"
IN_USE = "the driver refused: in use by another client that no holder scan found"
HELD = "a dry run's final holder scan found the GPU held"


def _booked(result: PlanResult) -> list[tuple[object, ...]]:
    """Each event as (name, outcome, why, hidden_holder, assumed); each hook as (hook, reason,
    its facts' outcome, dry_run)."""
    events = [
        (e.name, *(e.fields.get(k) for k in ("outcome", "why", "hidden_holder", "assumed")))
        for e in result.events
    ]
    return events + [(i.hook, i.reason, i.facts.get("outcome"), i.dry_run) for i in _hooks(result)]


@pytest.mark.parametrize(
    ("intent", "outcome", "options", "booked", "refusal"),
    [
        pytest.param(
            INTENT, "refused", {},
            [(EventName.RESET_REFUSED, "refused", "refused by the reset procedure", False, None)],
            ResetRefusal(INTENT.finding_key, "refused by the reset procedure", False, WALL),
            id="refused",
        ),
        pytest.param(
            RESUMED_INTENT, "refused", {},
            [(EventName.RESET_REFUSED, "refused", RESTARTED, False, None)],
            ResetRefusal(INTENT.finding_key, RESTARTED, False, WALL), id="refused-at-a-restart",
        ),
        pytest.param(
            INTENT, "in_use", {}, [(EventName.RESET_REFUSED, "in_use", IN_USE, True, None)],
            ResetRefusal(INTENT.finding_key, IN_USE, True, WALL), id="in-use",
        ),
        pytest.param(
            DRY, "in_use", {}, [(EventName.RESET_REFUSED, "in_use", IN_USE, True, None)], None,
            id="in-use-dry",
        ),
        pytest.param(
            DRY, "dry_run", {}, [(EventName.RESET_DRY_RUN, "dry_run", None, None, "refused")],
            ResetRefusal(INTENT.finding_key, HELD, False, WALL, dry_run=True), id="dry-held",
        ),
        pytest.param(
            DRY, "dry_run", {"would_succeed": True},
            [
                (EventName.RESET_DRY_RUN, "dry_run", None, None,
                 "success: assumed for the decisions that follow (dry run)"),
                ("on_action", f"reset of {GPU0}: reset", "reset", True),
            ],
            None, id="dry-would-succeed",
        ),
        pytest.param(
            INTENT, "success", {},
            [
                (EventName.RESET_SUCCEEDED, "success", None, None, None),
                ("on_action", f"reset of {GPU0}: reset", "reset", False),
            ],
            None, id="success",
        ),
        pytest.param(
            DRY, "timeout", {},
            [
                (EventName.RESET_FAILED, "timeout", None, None, None),
                ("on_failure", f"reset of {GPU0} timeout", "timeout", True),
                ("on_action", f"reset of {GPU0}: reset_failed", "reset_failed", True),
            ],
            None, id="failed-dry",
        ),
        pytest.param(
            DRY, "success", {"needs_reboot": True},
            [
                (EventName.RESET_SUCCEEDED, "success", None, None, None),
                (EventName.GPU_NEEDS_REBOOT, "success", None, None, None),
                ("on_action", f"reset of {GPU0}: reset", "reset", True),
                ("on_failure", f"{GPU0} needs a reboot", "success", True),
            ],
            None, id="needs-reboot-dry",
        ),
        pytest.param(
            INTENT, "failed", {"needs_reboot": True},
            [
                (EventName.RESET_FAILED, "failed", None, None, None),
                (EventName.GPU_NEEDS_REBOOT, "failed", None, None, None),
                ("on_failure", f"reset of {GPU0} failed", "failed", False),
                ("on_action", f"reset of {GPU0}: reset_failed", "reset_failed", False),
            ],
            None, id="needs-reboot-after-a-failure",
        ),
    ],
)  # fmt: skip
def test_a_reset_outcome_is_booked_with_its_reason_and_hooks(
    intent: ResetIntent,
    outcome: str,
    options: dict[str, bool],
    booked: list[tuple[object, ...]],
    refusal: ResetRefusal | None,
) -> None:
    result = record_reset(PlanState(), intent, outcome, now=1.0, wall=WALL, **options)
    assert _booked(result) == booked
    assert result.state.reset_refusals == ({} if refusal is None else {GPU0: refusal})
    assert result.state.last_wall == WALL


def test_a_reset_outcome_booked_after_the_clock_stepped_back_says_so() -> None:
    state = replace(PlanState(), last_wall=WALL + 100.0, last_reset={GPU0: WALL + 50.0})
    result = record_reset(state, INTENT, "refused", now=1.0, wall=WALL)
    assert _names(result)[0] == EventName.CLOCK_STEPPED_BACK
    assert result.state.last_reset == {GPU0: WALL}


GPU1 = gpu_uuid(1)


@pytest.mark.parametrize(
    ("flight", "quiet", "until", "due"),
    [
        ((GPU0, 0.5), {}, {GPU0: 0.75}, 0.75),  # nothing quiet before: from now
        ((GPU0, 5.0), {GPU0: 100.0}, {GPU0: 100.0}, 5.25),  # quiet longer already: kept
        ((GPU0, 5.0), {GPU0: 2.0, GPU1: 300.0}, {GPU0: 5.25, GPU1: 300.0}, 5.25),
        ((GPU0, 0.0), {}, {}, None),  # no post-action delay: nothing quiet, nothing due
        ((GPU1, 5.0), {}, {}, None),  # another GPU's reset is in flight: not this one's delay
        (None, {}, {}, None),
    ],
)
def test_a_reset_that_came_back_keeps_its_gpu_quiet_for_the_post_action_delay(
    flight: tuple[str, float] | None,
    quiet: dict[str, float],
    until: dict[str, float],
    due: float | None,
) -> None:
    in_flight = None if flight is None else ResetInFlight(flight[0], "k", False, 0.0, flight[1])
    state = replace(PlanState(), reset_in_flight=in_flight, quiet_until=quiet)
    result = record_reset(state, INTENT, "success", now=0.25, wall=WALL)
    assert result.state.quiet_until == until
    assert result.state.waiting == ({} if due is None else {INTENT.finding_key: due})
    assert result.state.reset_in_flight == (None if flight and flight[0] == GPU0 else in_flight)


@pytest.mark.parametrize(
    ("intent", "outcome", "would_succeed", "drained", "left"),
    [
        (INTENT, "success", False, {GPU0: False, GPU1: False}, {GPU1: False}),  # undrained
        (INTENT, "failed", False, {GPU0: False}, {GPU0: False}),  # the node stays drained
        (INTENT, "refused", False, {GPU0: False}, {GPU0: False}),
        (DRY, "dry_run", True, {GPU0: True}, {}),  # a dry run's would-be undrain, of its own
        (DRY, "dry_run", True, {GPU0: False}, {GPU0: False}),  # ... undoes no real drain
        (DRY, "dry_run", False, {GPU0: True}, {GPU0: True}),
    ],
)
def test_a_reset_that_succeeded_lets_the_next_health_incident_drain_again(
    intent: ResetIntent,
    outcome: str,
    would_succeed: bool,
    drained: dict[str, bool],
    left: dict[str, bool],
) -> None:
    state = replace(PlanState(), health_drained=drained)
    result = record_reset(state, intent, outcome, now=1.0, wall=WALL, would_succeed=would_succeed)
    assert result.state.health_drained == left


# --- plan_outcomes: a MIG GPU instance's re-creation ---------------------------------------------

GI1 = mig_uuid(0, 1)
GI2 = mig_uuid(0, 2)
OTHER = MigUnfinished(GPU0, 2, 9, 0, 2, 0.0, "failed")  # another instance's: left as it was
RECREATE = InstanceRecovery(GPU0, BUS0, 0, 1, 0, GI1, profile=9, placement=4, size=2)


BEFORE = MigUnfinished(GPU0, 1, 9, 4, 2, 0.0, "failed")  # an earlier failure of GI 1


@pytest.mark.parametrize(
    ("outcome", "unfinished", "refused"),
    [
        ("failed", {GI1: replace(BEFORE, since=WALL), GI2: OTHER}, {}),
        ("timeout", {GI1: replace(BEFORE, since=WALL, outcome="timeout"), GI2: OTHER}, {}),
        ("success", {GI2: OTHER}, {}),
        ("refused", {GI1: BEFORE, GI2: OTHER}, {GI1: "refused by the reset procedure"}),
    ],
)
def test_a_mig_instance_recovery_is_booked_under_its_instance(
    outcome: str, unfinished: dict[str, MigUnfinished], refused: dict[str, str]
) -> None:
    """A failed re-creation leaves its instance unfinished (since the outcome's wall time); a
    success finishes it; a refusal is kept under the instance; its GPU's health drain stays."""
    intent = replace(INTENT, instance=RECREATE)
    before = {GI1: BEFORE, GI2: OTHER}
    state = replace(PlanState(), mig_unfinished=before, health_drained={GPU0: False})
    result = record_reset(state, intent, outcome, now=1.0, wall=WALL)
    assert dict(result.state.mig_unfinished) == unfinished
    assert {k: r.reason for k, r in result.state.reset_refusals.items()} == refused
    assert result.state.health_drained == {GPU0: False}
