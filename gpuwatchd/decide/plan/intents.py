"""What the planner returns (intents, events, ``PlanResult``) and the scratch state one call of
``plan`` shares (``Work``, ``Ctx``), with the small helpers every step reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

from gpuwatchd.core.model import (
    Finding,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
    SubIdRange,
    fields_of,
)
from gpuwatchd.core.vocabulary import (
    ActionOutcome,
    EventName,
    HookName,
    LadderStatus,
    Level,
    check_ladder_transition,
)
from gpuwatchd.decide.mig.recovery import InstanceRecovery
from gpuwatchd.decide.plan.shadow import ShadowWork
from gpuwatchd.decide.plan.state import LADDER_EVENT_FIELDS, Ladder, PlanState, moved_since
from gpuwatchd.decide.policy import Policy

# How far the wall clock may run ahead of the monotonic clock between two polls before that is
# a forward step: a snapshot reads them a poll's duration apart (under the 30 s watchdog).
STEP_FORWARD = 60.0


@dataclass(frozen=True)
class SignalIntent:
    """Send ``signal`` to ``identity`` (act re-verifies the start time first); ``step`` is
    1-based, ``facts`` what justified it (user, cmdline, cgroup/job, memory)."""

    identity: ProcessIdentity
    signal: str
    gpu: str | None
    finding_key: str
    rule: str
    step: int
    dry_run: bool
    reason: str
    facts: Mapping[str, object]


@dataclass(frozen=True)
class ResetIntent:
    """Run the reset procedure for one GPU, addressed by UUID / PCI bus id; with ``instance``,
    re-create that MIG GPU instance of it in place instead (docs/reset.md#mig)."""

    gpu: str
    pci_bus_id: str | None
    minor: int | None
    finding_key: str
    dry_run: bool
    reason: str
    facts: Mapping[str, object]
    drained: bool = False  # the drain hooks ran already (health: drain, wait, then reset)
    instance: InstanceRecovery | None = None
    # A MIG GPU's reset: its GPU instances, created again after it (docs/reset.md#mig).
    layout: tuple[InstanceRecovery, ...] = ()


@dataclass(frozen=True)
class HookIntent:
    """Run the configured hooks named ``hook`` (a :class:`HookName`). ``facts`` fill the
    hooks' placeholders (``gpu``, ``pci_bus_id``, ``minor``, ``user``) and environment."""

    hook: str
    reason: str
    facts: Mapping[str, object]
    dry_run: bool = False


Intent: TypeAlias = SignalIntent | ResetIntent | HookIntent


@dataclass(frozen=True)
class Event:
    """One decision, to be logged as one structured event. ``name`` is from ``EventName``."""

    name: str
    level: Level
    fields: Mapping[str, object]


@dataclass(frozen=True)
class PlanResult:
    intents: tuple[Intent, ...]
    events: tuple[Event, ...]
    state: PlanState


def end_ladder(lad: Ladder, status: LadderStatus) -> Ladder:
    """The ladder in a terminal ``status``, nothing due; an illegal transition raises."""
    return replace(lad, status=check_ladder_transition(lad.status, status), due=None)


def target_key(identity: ProcessIdentity) -> str:
    return f"{identity.pid}@{identity.start_ticks}"


def finding_fields(finding: Finding) -> dict[str, object]:
    """A finding's fields as every planner event about it carries them."""
    return {
        "finding": finding.key,
        "kind": finding.kind.value,
        **fields_of(finding, ("gpu", "pid", "start_ticks", "memory", "reason")),
    }


class Work:
    """The mutable scratch copy of a PlanState while one call decides."""

    def __init__(self, state: PlanState) -> None:
        self.seen = dict(state.seen)
        self.notes = dict(state.notes)
        self.waiting: dict[str, float] = dict(state.waiting)
        self.ladders = dict(state.ladders)
        self.quiet_until = dict(state.quiet_until)
        self.last_reset = dict(state.last_reset)
        self.last_dry_reset = dict(state.last_dry_reset)
        self.reset_history = list(state.reset_history)
        self.signal_history = list(state.signal_history)
        self.signal_scopes = dict(state.signal_scopes)
        self.scope_latches = dict(state.scope_latches)
        self.health_waits = dict(state.health_waits)
        self.reset_refusals = dict(state.reset_refusals)
        self.health_drained = dict(state.health_drained)
        self.new_targets: dict[str, int] = {}  # scope -> targets first signalled this poll
        self.shadow = ShadowWork(state.shadow)  # dry-run's would-be limits (shadow.py)
        self.events: list[Event] = []
        self.intents: list[Intent] = []
        self.state = state

    def event(self, name: str, level: Level, **fields: object) -> None:
        self.events.append(Event(name, level, fields))

    def noted(self, key: str, text: str) -> bool:
        """Record ``text`` as the last thing said about ``key``; True when it is news."""
        if self.notes.get(key) == text:
            return False
        self.notes[key] = text
        return True

    def rebase_wall(self, wall: float, now: float) -> None:
        """A wall-clock step counts as no time passed: the recorded wall times move with it,
        back when ``wall`` is before the last one, forward when the wall clock ran more than
        ``STEP_FORWARD`` ahead of the monotonic clock (``now``, of this boot) since."""
        last, since = self.state.last_wall, self.state.last_monotonic
        step = 0.0 if last is None else max(0.0, last - wall)
        if not step and last is not None and since is not None and now >= since:
            ahead = wall - last - (now - since)
            step = -ahead if ahead > STEP_FORWARD else 0.0
        if step:
            self.last_reset = {g: t - step for g, t in self.last_reset.items()}
            self.last_dry_reset = {g: t - step for g, t in self.last_dry_reset.items()}
            self.reset_history = [(g, t - step) for g, t in self.reset_history]
            self.scope_latches = moved_since(self.scope_latches, step)
            self.reset_refusals = moved_since(self.reset_refusals, step)
            forced, failed = self.state.forced_since, self.state.last_failure
            self.state = replace(
                self.state,
                forced_since=None if forced is None else forced - step,
                last_failure=None if failed is None else failed - step,
                mig_unfinished=moved_since(self.state.mig_unfinished, step),
            )
            self.shadow.shift(step)
            name = EventName.CLOCK_STEPPED_BACK if step > 0 else EventName.CLOCK_STEPPED_FORWARD
            self.event(name, Level.WARNING, seconds=abs(step), wall=wall)
        self.state = replace(self.state, last_wall=wall, last_monotonic=now)

    def freeze(self) -> PlanState:
        return replace(
            self.state,
            seen=self.seen,
            notes=self.notes,
            waiting=self.waiting,
            ladders=self.ladders,
            quiet_until=self.quiet_until,
            last_reset=self.last_reset,
            last_dry_reset=self.last_dry_reset,
            reset_history=tuple(self.reset_history),
            signal_history=tuple(self.signal_history),
            signal_scopes={
                t: self.signal_scopes[t] for t, _ in self.signal_history if t in self.signal_scopes
            },
            scope_latches=self.scope_latches,
            health_waits=self.health_waits,
            reset_refusals=self.reset_refusals,
            health_drained=self.health_drained,
            shadow=self.shadow.freeze(),
        )


@dataclass(frozen=True)
class Ctx:
    """What one call of ``plan`` decides from, read-only; the state it changes is ``Work``'s."""

    snapshot: Snapshot
    policy: Policy
    now: float
    wall: float
    report_only: Mapping[str, str]
    self_ancestors: frozenset[int]
    findings: Mapping[str, Finding]
    quiet_before: Mapping[str, float]
    blocked: str | None  # a node-wide reason no action may be taken this poll


def is_dry_run(w: Work, ctx: Ctx, scope: str | None = None) -> bool:
    """Whether intents are dry runs: by policy, or a kill-cap latch (the node's, ``scope``'s)."""
    if ctx.policy.dry_run or w.state.forced_dry_run:
        return True
    return scope is not None and scope in w.scope_latches


def kill_cap_scope(proc: ProcessInfo | None, subuids: Sequence[SubIdRange]) -> str:
    """Whose kill cap a target counts against: its owner's (``uid:N``), a sub-uid's owner's
    (``uid:N`` or ``user:NAME``), or ``uid:unknown``."""
    uid = None if proc is None else proc.uid
    if uid is None:
        return "uid:unknown"
    for entry in subuids:
        if entry.holds(uid):
            return f"user:{entry.owner}" if entry.owner_uid is None else f"uid:{entry.owner_uid}"
    return f"uid:{uid}"


def previewing(w: Work, ctx: Ctx) -> bool:
    """A policy's dry run (which keeps a would-be kill cap), not one a real kill cap forced."""
    return ctx.policy.dry_run and not w.state.forced_dry_run


def hold_reason(w: Work, ctx: Ctx) -> str | None:
    """Why no action may start now (paused, or a node-wide block); None: none."""
    if w.state.paused:
        return "paused" + (f" ({w.state.paused_reason})" if w.state.paused_reason else "")
    return ctx.blocked


def pause_hold(w: Work) -> str | None:
    """``paused: <why>`` while an administrator's pause holds every action; else None."""
    return f"paused: {w.state.paused_reason or 'by an administrator'}" if w.state.paused else None


def page(
    w: Work, reason: str, facts: Mapping[str, object], said: Mapping[str, object], *, dry_run: bool
) -> None:
    """The ``on_failure`` hooks about ``reason``; none while paused (a pause holds every hook:
    a page or a node drain waits for the maintenance to end), said by
    ``EventName.ACTION_REFUSED`` with ``said``, the fields of its subject."""
    held = pause_hold(w)
    if held is not None:
        why = f"{held}; on_failure not run: {reason}"
        w.event(EventName.ACTION_REFUSED, Level.INFO, **{**said, "why": why})
        return
    w.intents.append(HookIntent(HookName.ON_FAILURE, reason, dict(facts), dry_run))


def ladder_fields(lad: Ladder) -> dict[str, object]:
    """A ladder's fields as every event about its target carries them."""
    return fields_of(lad, LADDER_EVENT_FIELDS)


def action_ended(
    lad: Ladder, outcome: ActionOutcome, why: str, *, signalled: int | None = None
) -> tuple[HookIntent, ...]:
    """The ``on_action`` notification for a ladder that just ended, if it sent a real signal
    in its first ``signalled`` steps (default: every step emitted)."""
    sent = lad.steps[: lad.step if signalled is None else signalled]
    if lad.dry_run or not any(signal is not None for signal, _wait in sent):
        return ()
    facts = {**ladder_fields(lad), "action": "signal", "outcome": outcome, "user": lad.user,
             "why": why}  # fmt: skip
    return (HookIntent(HookName.ON_ACTION, f"{lad.target}: {outcome} ({why})", facts),)
