"""Outcomes from act folded back into the planner's state: what a signal's, an exit's or a
reset's result does to the ladders, the reset history and the hooks that follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpuwatchd.core.model import ProcessIdentity, fields_of
from gpuwatchd.core.vocabulary import (
    ActionOutcome,
    EventName,
    HookName,
    LadderStatus,
    Level,
    ResetResult,
    SignalOutcome,
)
from gpuwatchd.decide.plan.intents import (
    Event,
    HookIntent,
    Intent,
    PlanResult,
    ResetIntent,
    SignalIntent,
    Work,
    action_ended,
    end_ladder,
    ladder_fields,
    page,
    target_key,
)
from gpuwatchd.decide.plan.state import MigUnfinished, PlanState, ResetRefusal

RESUMED = "resumed after an interruption"  # the reason of a reset a restart finished or undid


def record_signal(
    state: PlanState, intent: SignalIntent, outcome: str, *, now: float
) -> PlanResult:
    """Advance the target's ladder by what act saw. The next step's wait starts now."""
    if outcome not in set(SignalOutcome):
        raise ValueError(f"unknown signal outcome {outcome!r}")
    outcome = SignalOutcome(outcome)
    target = target_key(intent.identity)
    lad = state.ladders.get(target)
    base = {"target": target, "signal": intent.signal, "outcome": outcome, "step": intent.step}
    if lad is None or lad.step != intent.step or lad.status is not LadderStatus.ACTIVE:
        ev = Event(EventName.ESCALATION_SIGNAL_RECORDED, Level.DEBUG, {**base, "stale": True})
        return PlanResult((), (ev,), state)
    ladders = dict(state.ladders)
    events = [Event(EventName.ESCALATION_SIGNAL_RECORDED, Level.DEBUG, base)]
    fields = {**ladder_fields(lad), "outcome": outcome, "why": outcome}
    waiting = {k: v for k, v in state.waiting.items() if k != lad.finding_key}
    intents: tuple[Intent, ...] = ()
    if outcome in (SignalOutcome.DELIVERED, SignalOutcome.DRY_RUN):
        due = now + lad.steps[lad.step - 1][1]
        ladders[target] = replace(lad, due=due)
        waiting[lad.finding_key] = due
    elif outcome in (SignalOutcome.GONE, SignalOutcome.ZOMBIE):
        del ladders[target]
        events.append(Event(EventName.ESCALATION_RESOLVED, Level.INFO, fields))
        # Gone before this step's signal: an earlier step, if one was sent, freed it.
        intents = action_ended(lad, ActionOutcome.FREED, outcome, signalled=lad.step - 1)
        if outcome is SignalOutcome.ZOMBIE:
            reap = {"pid": lad.pid, "gpu": lad.gpu, "finding": lad.finding_key, "parent": None}
            events.append(Event(EventName.ZOMBIE_NEEDS_REAP, Level.WARNING, reap))
    elif outcome is SignalOutcome.REUSED:
        del ladders[target]
        events.append(Event(EventName.ESCALATION_ABORTED, Level.WARNING, fields))
    else:  # denied / failed: never retried
        ladders[target] = end_ladder(lad, LadderStatus.FAILED)
        events.append(Event(EventName.ESCALATION_ENDED, Level.ERROR, fields))
        intents = action_ended(lad, ActionOutcome.FAILED, outcome)
    return PlanResult(intents, tuple(events), replace(state, ladders=ladders, waiting=waiting))


def record_exit(state: PlanState, identity: ProcessIdentity, *, now: float) -> PlanResult:
    """Act saw the target exit (its pidfd became readable): its ladder is resolved."""
    target = target_key(identity)
    lad = state.ladders.get(target)
    if lad is None:
        return PlanResult((), (), state)
    ladders = {k: v for k, v in state.ladders.items() if k != target}
    waiting = {k: v for k, v in state.waiting.items() if k != lad.finding_key}
    events: tuple[Event, ...] = ()
    intents: tuple[Intent, ...] = ()
    if lad.status is LadderStatus.ACTIVE:
        fields = {**ladder_fields(lad), "why": "target exited", "after": now - lad.started}
        events = (Event(EventName.ESCALATION_RESOLVED, Level.INFO, fields),)
        intents = action_ended(lad, ActionOutcome.FREED, "target exited")
    return PlanResult(intents, events, replace(state, ladders=ladders, waiting=waiting))


def record_assumed_exit(state: PlanState, identity: ProcessIdentity, *, now: float) -> PlanResult:
    """A dry run's would-be SIGKILL went to ``identity``: assumed to end it, as a real one would
    (it cannot be caught); its ladder stays, terminal, while the process lives."""
    target = target_key(identity)
    lad = state.ladders.get(target)
    if lad is None or lad.status is not LadderStatus.ACTIVE or not lad.dry_run:
        return PlanResult((), (), state)
    ladders = {**state.ladders, target: end_ladder(lad, LadderStatus.ENDED)}
    waiting = {k: v for k, v in state.waiting.items() if k != lad.finding_key}
    why = "would-be SIGKILL: assumed to end the target (dry run)"
    fields = {**ladder_fields(lad), "why": why, "after": now - lad.started}
    facts = {**ladder_fields(lad), "action": "signal", "outcome": ActionOutcome.FREED,
             "user": lad.user}  # fmt: skip
    notify = HookIntent(HookName.ON_ACTION, f"{target}: {ActionOutcome.FREED} ({why})", facts,
                        dry_run=True)  # fmt: skip
    return PlanResult(
        (notify,),
        (Event(EventName.ESCALATION_RESOLVED, Level.INFO, fields),),
        replace(state, ladders=ladders, waiting=waiting),
    )


def _reset_action(
    intent: ResetIntent, outcome: ActionOutcome, fields: Mapping[str, object]
) -> HookIntent:
    """The ``on_action`` notification for a reset that ran (its command was started)."""
    action = "reset" if intent.instance is None else "mig_recovery"
    facts = {
        **fields,
        "minor": intent.minor,
        "action": action,
        "outcome": outcome,
        "user": intent.facts.get("user"),
    }
    return HookIntent(
        HookName.ON_ACTION, f"{action} of {intent.gpu}: {outcome}", facts, dry_run=intent.dry_run
    )


def _reset_came_back(w: Work, intent: ResetIntent, undrained: bool) -> float:
    """The reset of ``intent`` is no longer in flight: its post-action delay (0 when it was not
    the one in flight). ``undrained``: it succeeded, so its after hooks undid the drain."""
    # One MIG GPU instance re-created leaves its GPU's health drain as it was.
    undrained = undrained and intent.instance is None
    if undrained and (not intent.dry_run or w.health_drained.get(intent.gpu) is True):
        w.health_drained.pop(intent.gpu, None)
    in_flight = w.state.reset_in_flight
    if in_flight is None or in_flight.gpu != intent.gpu:
        return 0.0
    w.state = replace(w.state, reset_in_flight=None)
    return in_flight.delay


def _refusal_key(intent: ResetIntent) -> str:
    """A refusal is kept per incident's target: the GPU, or the MIG GPU instance re-created."""
    return intent.gpu if intent.instance is None else intent.instance.mig_uuid


def _book_dry_run(
    w: Work, intent: ResetIntent, fields: Mapping[str, object], wall: float, would_succeed: bool
) -> None:
    """A dry run's reset: assumed done when it would have succeeded, else held as refused."""
    w.last_dry_reset[intent.gpu] = wall
    if would_succeed:
        w.shadow.book_reset(intent.gpu, intent.finding_key, wall)
        assumed = "success: assumed for the decisions that follow (dry run)"
        w.event(EventName.RESET_DRY_RUN, Level.INFO, assumed=assumed, **fields)
        w.intents.append(_reset_action(intent, ActionOutcome.RESET, fields))
        return
    # Enforcement's final scan would have found the GPU held as well: the incident is held as
    # enforcement's would be (drain and before hooks once), in the preview only.
    why = "a dry run's final holder scan found the GPU held"
    w.reset_refusals[_refusal_key(intent)] = ResetRefusal(
        intent.finding_key, why, False, wall, dry_run=True
    )
    w.event(EventName.RESET_DRY_RUN, Level.INFO, assumed="refused", **fields)


def _book_refusal(
    w: Work, intent: ResetIntent, fields: Mapping[str, object], wall: float, *, in_use: bool
) -> None:
    """Refused, not failed: no history, no failure, no breaker (docs/internals.md)."""
    w.last_reset[intent.gpu] = wall
    why = (
        "the driver refused: in use by another client that no holder scan found"
        if in_use
        else "the daemon restarted during the reset, before it took effect"
        if intent.reason == RESUMED
        else "refused by the reset procedure"
    )
    if not intent.dry_run:
        w.reset_refusals[_refusal_key(intent)] = ResetRefusal(intent.finding_key, why, in_use, wall)
    w.event(EventName.RESET_REFUSED, Level.WARNING, why=why, hidden_holder=in_use, **fields)


def _book_attempt(
    w: Work, intent: ResetIntent, outcome: ResetResult, fields: Mapping[str, object], wall: float
) -> None:
    """A reset whose command ran: it counts in the history; a failure (or a timeout) counts
    towards the circuit breaker and runs on_failure, a success resets the count."""
    gpu = intent.gpu
    w.last_reset[gpu] = wall
    w.reset_history.append((gpu, wall))
    if outcome is ResetResult.SUCCESS:
        w.state = replace(w.state, reset_failures=0, last_failure=None)
        w.event(EventName.RESET_SUCCEEDED, Level.INFO, **fields)  # booked; RESET_OUTCOME said it
        w.intents.append(_reset_action(intent, ActionOutcome.RESET, fields))
        return
    failures = w.state.reset_failures + 1
    w.state = replace(w.state, reset_failures=failures, last_failure=wall)
    w.event(EventName.RESET_FAILED, Level.INFO, failures=failures, **fields)  # as above
    facts = {**fields, "failures": failures}
    page(w, f"reset of {gpu} {outcome}", facts, fields, dry_run=intent.dry_run)
    w.intents.append(_reset_action(intent, ActionOutcome.RESET_FAILED, fields))


def record_reset(
    state: PlanState,
    intent: ResetIntent,
    outcome: str,
    *,
    now: float,
    wall: float,
    needs_reboot: bool = False,
    would_succeed: bool = False,
) -> PlanResult:
    """Book a reset attempt: history, cooldown, circuit breaker; a failure runs on_failure. A
    dry run's that ``would_succeed`` is booked in the shadow as a success would be."""
    if outcome not in set(ResetResult):
        raise ValueError(f"unknown reset outcome {outcome!r}")
    outcome = ResetResult(outcome)
    w = Work(state)
    w.rebase_wall(wall, now)
    succeeded = outcome is ResetResult.SUCCESS or (outcome is ResetResult.DRY_RUN and would_succeed)
    delay = _reset_came_back(w, intent, succeeded)
    gpu = intent.gpu
    fields = {**fields_of(intent, ("gpu", "pci_bus_id", "finding=finding_key")), "outcome": outcome}
    if intent.instance is not None:
        fields.update(intent.instance.fields())  # a MIG recovery's: its instance
    if outcome is ResetResult.DRY_RUN:
        _book_dry_run(w, intent, fields, wall, would_succeed)
    elif outcome in (ResetResult.REFUSED, ResetResult.IN_USE):
        _book_refusal(w, intent, fields, wall, in_use=outcome is ResetResult.IN_USE)
    else:
        _book_attempt(w, intent, outcome, fields, wall)
    if needs_reboot:
        w.event(EventName.GPU_NEEDS_REBOOT, Level.CRITICAL, **fields)
        if outcome not in (ResetResult.FAILED, ResetResult.TIMEOUT):
            page(w, f"{gpu} needs a reboot", fields, fields, dry_run=intent.dry_run)
    if delay > 0:
        w.quiet_until[gpu] = max(w.quiet_until.get(gpu, 0.0), now + delay)
        w.waiting[intent.finding_key] = now + delay
    return PlanResult(
        tuple(w.intents), tuple(w.events), _unfinished(w.freeze(), intent, outcome, wall)
    )


def _unfinished(
    state: PlanState, intent: ResetIntent, outcome: ResetResult, wall: float
) -> PlanState:
    """A MIG recovery that failed once its commands started may be half done: its GPU stays
    dirty (``mig_unfinished``) until its instance is seen back; one that succeeded is back."""
    # A MIG GPU's reset failed: each of its GPU instances likewise, until seen back.
    recoveries = intent.layout if intent.instance is None else (intent.instance,)
    if not recoveries or intent.dry_run:
        return state
    unfinished = dict(state.mig_unfinished)
    for recovery in recoveries:
        if outcome in (ResetResult.FAILED, ResetResult.TIMEOUT):
            unfinished[recovery.mig_uuid] = MigUnfinished(
                recovery.uuid, recovery.gi, recovery.profile, recovery.placement, recovery.size,
                wall, outcome.value,
            )  # fmt: skip
        elif outcome is ResetResult.SUCCESS:
            unfinished.pop(recovery.mig_uuid, None)
        else:
            return state
    return replace(state, mig_unfinished=unfinished)
