"""The escalation state machine: findings + carried state + policy + time → intents and events.

This module owns every decision about *acting*: per-target signal ladders (SIGTERM → wait →
SIGKILL → wait → ended), confirmation windows, the post-action delay, the kill caps (per user
and node-wide) whose latches force dry-run until they expire, pause, and the GPU reset gates
(confirmation, live holders, MIG, a refused incident, cooldown, count per window, circuit
breaker, one reset in flight). The semantics are documented in ``docs/escalation.md``.

It is pure: no I/O, no clock reads, no logging. Time comes in as ``now`` (monotonic seconds,
for deadlines) and ``wall`` (wall-clock seconds, only for reset limits that must survive a
reboot). It never sends a signal or runs a command: it returns intents, which ``act.py``
carries out after re-verifying the target, and the outcome comes back through
``record_signal`` / ``record_exit`` / ``record_reset``. ``None`` means unknown, and unknown
never leads to an intent.

The state it carries between polls, with that state's JSON form and validation, is defined in
``plan_state.py``; which rule matches a finding and which targets may never be touched (the
floor, then ``protect``) is decided in ``targets.py``. Both are re-exported here, so callers can
import everything from ``plan``.

It is long (about 1,400 lines) because ladders, resets, the kill cap, pause and GPU health's
drain-then-reset share one scratch state per call (``_Work``), one set of deadlines and one set
of reset gates: each decision reads what the others just decided in the same poll. Split, that
state would have to be passed between modules. What GPU health *means* is
``decide/health.py``'s; only acting on it is here, so that a health reset goes through the very
gates (``reset_gates``, the history gates) and the one ``ResetIntent`` of a ghost-memory reset.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

from gpuwatchd.decide.floor import live_holder
from gpuwatchd.decide.health import HEALTH_KINDS, drain_blockers
from gpuwatchd.decide.mig import busy_instances, parent_of
from gpuwatchd.decide.plan_state import (
    HealthWait,
    Ladder,
    Latch,
    PlanState,
    ResetInFlight,
    ResetRefusal,
    SeenFinding,
)
from gpuwatchd.decide.policy import Policy
from gpuwatchd.decide.shadow import ShadowWork
from gpuwatchd.decide.spares import spare_reason
from gpuwatchd.decide.targets import (
    gpu_by_uuid,
    gpu_protected,
    process_facts,
    refusal,
    rule_for,
)
from gpuwatchd.model import (
    Finding,
    FindingKind,
    GpuInfo,
    ProcessIdentity,
    ProcessInfo,
    Snapshot,
)
from gpuwatchd.vocabulary import (
    ActionOutcome,
    EventName,
    HookName,
    LadderStatus,
    Level,
    ResetResult,
    SignalOutcome,
    check_ladder_transition,
)

__all__ = [
    "HOUR",
    "Event",
    "EventName",
    "HookIntent",
    "Intent",
    "Ladder",
    "PlanResult",
    "PlanState",
    "ResetGate",
    "ResetInFlight",
    "ResetIntent",
    "SeenFinding",
    "SignalIntent",
    "clear_circuit",
    "clear_forced_dry_run",
    "forget_reset_refusals",
    "gpu_protected",
    "hidden_holders",
    "kill_cap_scope",
    "next_deadline",
    "pending",
    "pending_keys",
    "plan",
    "process_facts",
    "record_assumed_exit",
    "record_exit",
    "record_reset",
    "record_signal",
    "refusal",
    "reset_gates",
    "rule_for",
    "set_paused",
    "target_key",
]

HOUR = 3600.0

# Findings about a live process on a GPU: any of them means the GPU has a live holder.
_HOLDER_KINDS = frozenset(
    {
        FindingKind.ORPHANED,
        FindingKind.ABANDONED,
        FindingKind.STUCK,
        FindingKind.HIDDEN_HOLDER,
        FindingKind.ZOMBIE,
    }
)


# --- intents and events -----------------------------------------------------------------------


@dataclass(frozen=True)
class SignalIntent:
    """Send ``signal`` to ``identity`` (act re-verifies the start time first).

    ``step`` is 1-based: step 1 is the rule's first step. ``facts`` carries what justified it
    (user, cmdline, cgroup/job, memory) for the log event.
    """

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
    """Run the reset procedure for one GPU, addressed by UUID / PCI bus id (design-notes §7)."""

    gpu: str
    pci_bus_id: str | None
    minor: int | None
    finding_key: str
    dry_run: bool
    reason: str
    facts: Mapping[str, object]
    drained: bool = False  # the drain hooks ran already (health: drain, wait, then reset)


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


# --- the planner ------------------------------------------------------------------------------


def _move(lad: Ladder, status: LadderStatus) -> Ladder:
    """The ladder in a terminal ``status``, nothing due; an illegal transition raises."""
    return replace(lad, status=check_ladder_transition(lad.status, status), due=None)


def target_key(identity: ProcessIdentity) -> str:
    return f"{identity.pid}@{identity.start_ticks}"


def _finding_fields(finding: Finding) -> dict[str, object]:
    return {
        "finding": finding.key,
        "kind": finding.kind.value,
        "gpu": finding.gpu,
        "pid": finding.pid,
        "start_ticks": finding.start_ticks,
        "memory": finding.memory,
        "reason": finding.reason,
    }


class _Work:
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

    def rebase_wall(self, wall: float) -> None:
        last = self.state.last_wall
        if last is not None and wall < last:
            step = last - wall
            self.last_reset = {g: t - step for g, t in self.last_reset.items()}
            self.last_dry_reset = {g: t - step for g, t in self.last_dry_reset.items()}
            self.reset_history = [(g, t - step) for g, t in self.reset_history]
            self.scope_latches = {
                k: replace(v, since=v.since - step) for k, v in self.scope_latches.items()
            }
            since = self.state.forced_since
            if since is not None:
                self.state = replace(self.state, forced_since=since - step)
            self.shadow.shift(step)
            self.event(EventName.CLOCK_STEPPED_BACK, Level.WARNING, seconds=step, wall=wall)
        self.state = replace(self.state, last_wall=wall)

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
class _Ctx:
    snapshot: Snapshot
    policy: Policy
    now: float
    wall: float
    report_only: Mapping[str, str]
    self_ancestors: frozenset[int]
    findings: Mapping[str, Finding]
    quiet_before: Mapping[str, float]
    blocked: str | None  # a node-wide reason no action may be taken this poll


def _dry(w: _Work, ctx: _Ctx, scope: str | None = None) -> bool:
    """Whether intents are dry runs: by policy, the node's kill-cap latch, or (for a target's
    signals) the latch of the user it belongs to."""
    if ctx.policy.dry_run or w.state.forced_dry_run:
        return True
    return scope is not None and scope in w.scope_latches


def kill_cap_scope(proc: ProcessInfo | None) -> str:
    """Whose kill cap a target counts against: its owner's uid (``uid:N``); processes whose
    owner is unknown share one scope (``uid:unknown``)."""
    uid = None if proc is None else proc.uid
    return f"uid:{'unknown' if uid is None else uid}"


def _previewing(w: _Work, ctx: _Ctx) -> bool:
    """A policy's dry run, which keeps the would-be kill cap (shadow.py); under the dry run
    the real kill cap forced, enforcement's own latch is already there."""
    return ctx.policy.dry_run and not w.state.forced_dry_run


def _node_block(snapshot: Snapshot) -> str | None:
    if not snapshot.nvml.available:
        return "NVML unavailable"
    if snapshot.nvml.wedged:
        return "NVML is wedged (a call missed its deadline)"
    if snapshot.host_namespaces is not True:
        return "host PID/cgroup namespaces not visible"
    return None


def plan(
    findings: Sequence[Finding],
    snapshot: Snapshot,
    state: PlanState,
    policy: Policy,
    *,
    now: float,
    wall: float,
    report_only: Mapping[str, str] | None = None,
    self_ancestors: frozenset[int] = frozenset(),
) -> PlanResult:
    """Decide what to do this poll. Pure: the same inputs give the same result."""
    w = _Work(state)
    w.rebase_wall(wall)
    _check_boot(w, snapshot)
    current = {f.key: f for f in findings}
    ctx = _Ctx(
        snapshot=snapshot,
        policy=policy,
        now=now,
        wall=wall,
        report_only=report_only or {},
        self_ancestors=self_ancestors,
        findings=current,
        quiet_before={g: t for g, t in w.quiet_until.items() if t > now},
        blocked=_node_block(snapshot),
    )
    w.quiet_until = dict(ctx.quiet_before)
    if _dry(w, ctx):
        w.shadow.prune(now=now, wall=wall, window=policy.reset.window, findings=current,
                       ladders=w.ladders)  # fmt: skip
        for scope, why, lasted in w.shadow.expire(wall, policy.limits.kill_cap_latch):
            w.event(EventName.LIMITS_KILL_CAP_EXPIRED, Level.INFO, scope=scope, why=why,
                    lasted=lasted, dry_run=True)  # fmt: skip
    else:
        w.shadow.drop()  # what dry-run would have done never blocks the real thing
        w.reset_refusals = {g: r for g, r in w.reset_refusals.items() if not r.dry_run}
    w.waiting = {}
    w.signal_history = [(t, at) for t, at in w.signal_history if now - at < HOUR]
    _expire_latches(w, ctx)
    _review_refusals(w, ctx)
    _track_findings(w, ctx)
    _watch_lost_gpus(w, ctx)
    _advance_ladders(w, ctx)
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.pid is not None:
            _consider_process_finding(w, ctx, finding)
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.kind == FindingKind.GHOST_MEMORY and finding.gpu is not None:
            _consider_reset(w, ctx, finding)
    # GPU health (decide/health.py): drain, then reset; reboot; drain.
    w.health_waits = {g: wait for g, wait in w.health_waits.items() if wait.finding_key in current}
    # A GPU stays drained while any of its health findings lasts: one incident, one drain.
    unhealthy = {f.gpu for f in current.values() if f.kind in HEALTH_KINDS}
    w.health_drained = {g: dry for g, dry in w.health_drained.items() if g in unhealthy}
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.kind in HEALTH_KINDS and finding.gpu is not None:
            _consider_health(w, ctx, finding)
    # Forget what was said about findings that are gone.
    w.notes = {k: v for k, v in w.notes.items() if k.startswith("node:") or k in current}
    return PlanResult(tuple(w.intents), tuple(w.events), w.freeze())


def _watch_lost_gpus(w: _Work, ctx: _Ctx) -> None:
    """A GPU NVML reports lost needs a reboot: say so once (critical) and ask for on_failure.

    Whatever it held is out of reach now (its findings resolve for want of readings), so this
    is the one event that tells the admin. Said again only after the GPU came back and was lost
    once more.
    """
    for gpu in sorted(ctx.snapshot.nvml.gpus, key=lambda g: g.index):
        key = f"node:lost:{gpu.uuid}"
        if not gpu.lost:
            w.notes.pop(key, None)
            continue
        if not w.noted(key, "lost"):
            continue
        why = f"NVML reports the GPU lost: {gpu.error or 'not answering'}"
        fields: dict[str, object] = {"gpu": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "why": why}
        w.event(EventName.GPU_NEEDS_REBOOT, Level.CRITICAL, **fields)
        w.intents.append(
            HookIntent(
                HookName.ON_FAILURE, f"{gpu.uuid} is lost and needs a reboot", fields, _dry(w, ctx)
            )
        )


def _check_boot(w: _Work, snapshot: Snapshot) -> None:
    old = w.state.boot_id
    new = snapshot.boot_id
    if new is None:
        return
    if old is not None and old != new:
        # Monotonic times and process identities mean nothing after a reboot; wall-time reset
        # history, the circuit breaker, forced dry-run and pause are kept.
        w.event(
            EventName.STATE_BOOT_CHANGED,
            Level.INFO,
            old=old,
            new=new,
            dropped_ladders=len(w.ladders),
        )
        w.seen, w.ladders, w.quiet_until, w.signal_history = {}, {}, {}, []
        w.signal_scopes = {}
        w.health_waits = {}
        w.reset_refusals = {}  # a reboot resets every GPU
        w.health_drained = {}
        w.shadow.new_boot()
        w.notes = {k: v for k, v in w.notes.items() if k.startswith("node:")}
        w.state = replace(w.state, reset_in_flight=None)
    w.state = replace(w.state, boot_id=new)


def _track_findings(w: _Work, ctx: _Ctx) -> None:
    for key, finding in sorted(ctx.findings.items()):
        digest = f"{finding.reason}|actionable={finding.actionable}"
        seen = w.seen.get(key)
        target = None if finding.identity is None else target_key(finding.identity)
        if seen is None:
            w.seen[key] = SeenFinding(ctx.now, digest, finding.gpu, target)
            level = Level.WARNING if finding.actionable else Level.INFO
            w.event(
                EventName.FINDING_NEW,
                level,
                actionable=finding.actionable,
                evidence=dict(finding.evidence),
                **_finding_fields(finding),
            )
        elif seen.digest != digest:
            w.seen[key] = replace(seen, digest=digest)
            w.event(
                EventName.FINDING_CHANGED,
                Level.INFO,
                actionable=finding.actionable,
                lasted=ctx.now - seen.first_seen,
                **_finding_fields(finding),
            )
    for key in sorted(set(w.seen) - set(ctx.findings)):
        seen = w.seen.pop(key)
        w.event(
            EventName.FINDING_RESOLVED,
            Level.INFO,
            finding=key,
            kind=key.split(":", 1)[0],  # which finding, as finding.new said it
            gpu=seen.gpu,
            pid=_target_pid(seen.target),
            lasted=max(0.0, ctx.now - seen.first_seen),
        )


def _target_pid(target: str | None) -> int | None:
    """The PID of a target key (``pid@start_ticks``); None for a GPU-level finding."""
    pid = None if target is None else target.split("@", 1)[0]
    return int(pid) if pid is not None and pid.isdigit() else None


def _ladder_fields(lad: Ladder) -> dict[str, object]:
    return {
        "target": lad.target,
        "pid": lad.pid,
        "start_ticks": lad.start_ticks,
        "finding": lad.finding_key,
        "rule": lad.rule,
        "gpu": lad.gpu,
        "step": lad.step,
        "dry_run": lad.dry_run,
    }


def _action_ended(
    lad: Ladder, outcome: ActionOutcome, why: str, *, signalled: int | None = None
) -> tuple[HookIntent, ...]:
    """The ``on_action`` notification for a ladder that just ended, if it acted for real.

    ``signalled`` is how many of its steps were sent (default: every step emitted). A dry-run
    ladder, or one whose sent steps were all report-only, did nothing anyone must be told of.
    """
    sent = lad.steps[: lad.step if signalled is None else signalled]
    if lad.dry_run or not any(signal is not None for signal, _wait in sent):
        return ()
    facts = {**_ladder_fields(lad), "action": "signal", "outcome": outcome, "user": lad.user,
             "why": why}  # fmt: skip
    return (HookIntent(HookName.ON_ACTION, f"{lad.target}: {outcome} ({why})", facts),)


def _stuck_finding(ctx: _Ctx, target: str) -> Finding | None:
    for finding in ctx.findings.values():
        identity = finding.identity
        if finding.kind == FindingKind.STUCK and identity and target_key(identity) == target:
            return finding
    return None


def _advance_ladders(w: _Work, ctx: _Ctx) -> None:
    for target, lad in sorted(w.ladders.items()):
        proc = ctx.snapshot.processes.get(lad.pid)
        if proc is None:
            if lad.finding_key not in ctx.findings and _stuck_finding(ctx, target) is None:
                _freed(w, lad, "target gone")
            continue  # listed by a finding but not described: unknown, so wait
        if proc.start_ticks is None:
            continue
        if proc.start_ticks != lad.start_ticks:
            _freed(w, lad, "target gone (PID reused)")
            continue
        if proc.is_zombie:
            _freed(w, lad, "target exited (zombie)")
            _zombie_event(w, lad.finding_key, proc.ppid, lad.pid, lad.gpu, force=True)
            continue
        _advance_live_ladder(w, ctx, lad, proc)


def _advance_live_ladder(w: _Work, ctx: _Ctx, lad: Ladder, proc: ProcessInfo) -> None:
    """One poll of a ladder whose target is alive and still the same process."""
    target = lad.target
    finding = ctx.findings.get(lad.finding_key) or _successor(ctx, lad, proc)
    if finding is not None and finding.key != lad.finding_key:
        # The same process, now described by another finding (e.g. orphaned → abandoned): the
        # ladder follows the process, keeping its steps, so a kind flip never skips a wait.
        lad = replace(lad, finding_key=finding.key)
        w.ladders[target] = lad
    scope = kill_cap_scope(proc)
    if lad.status is not LadderStatus.ACTIVE:
        if lad.dry_run and not _dry(w, ctx, scope) and _hold_reason(w, ctx) is None:
            _restart_after_dry_run(w, lad)
        return
    stuck = _stuck_finding(ctx, target)
    if stuck is not None:
        _mark_stuck(w, ctx, lad, proc, "target is in uninterruptible sleep (D)")
        return
    if finding is None:
        resolved = "finding resolved"
        _close(
            w,
            lad,
            EventName.ESCALATION_RESOLVED,
            Level.INFO,
            resolved,
            outcome=ActionOutcome.RELEASED,
        )
        return
    if lad.due is not None and ctx.now < lad.due:
        w.waiting[lad.finding_key] = lad.due
        return
    if lad.step >= len(lad.steps):
        if proc.is_uninterruptible:
            _mark_stuck(w, ctx, lad, proc, "target still alive in D state after its ladder")
        else:
            w.ladders[target] = _move(lad, LadderStatus.ENDED)
            survived = "target still alive after the last step"
            w.event(
                EventName.ESCALATION_ENDED,
                Level.INFO if lad.dry_run else Level.ERROR,
                why=survived,
                **_ladder_fields(lad),
                **process_facts(proc),
            )
            w.intents.extend(_action_ended(lad, ActionOutcome.SURVIVED, survived))
        return
    hold = _hold_reason(w, ctx)
    if hold is None:
        # An administrator's spare holds the ladder (it goes on when the spare ends).
        spared = spare_reason(proc, ctx.snapshot.spares, ctx.snapshot.wall_time)
        hold = None if spared is None else f"spare: {spared}"
    if hold is None and _dry(w, ctx, scope) and not lad.dry_run:
        capped = w.state.forced_dry_run or scope in w.scope_latches
        hold = "dry_run (kill cap engaged)" if capped else "dry_run"
    if hold is None and _previewing(w, ctx) and w.shadow.holds(lad.target, scope):
        hold = "dry_run (kill cap engaged)"  # where enforcement's latch would hold it
    if hold is not None:
        # Not put in ``waiting``: nothing is due until the hold lifts (no busy loop).
        if w.noted(lad.finding_key, f"hold:{hold}"):
            w.event(EventName.ACTION_REFUSED, Level.INFO, why=hold, **_ladder_fields(lad))
        return
    if lad.dry_run and not _dry(w, ctx, scope):
        _restart_after_dry_run(w, lad)
        return
    why = refusal(proc, finding, ctx.snapshot, ctx.policy, ctx.self_ancestors)
    if why is not None:
        w.ladders[target] = _move(lad, LadderStatus.FAILED)
        w.event(EventName.ACTION_REFUSED, Level.WARNING, why=why, **_ladder_fields(lad))
        w.intents.extend(_action_ended(lad, ActionOutcome.FAILED, f"refused: {why}"))
        return
    _emit_step(w, ctx, lad, proc, finding)


def _successor(ctx: _Ctx, lad: Ladder, proc: ProcessInfo) -> Finding | None:
    """Another actionable finding about the ladder's target that some rule selects."""
    for finding in sorted(ctx.findings.values(), key=lambda f: f.key):
        identity = finding.identity
        if identity is None or target_key(identity) != lad.target or not finding.actionable:
            continue
        if rule_for(finding, proc, ctx.policy, lasted=math.inf) is not None:
            return finding
    return None


def _restart_after_dry_run(w: _Work, lad: Ladder) -> None:
    """What dry-run "would have done" never blocks the real thing: drop the ladder, so the
    target starts over, for real, from step 1."""
    del w.ladders[lad.target]
    w.event(EventName.ESCALATION_RESTARTED, Level.INFO, why="dry-run ended", **_ladder_fields(lad))


def _hold_reason(w: _Work, ctx: _Ctx) -> str | None:
    if w.state.paused:
        return "paused" + (f" ({w.state.paused_reason})" if w.state.paused_reason else "")
    return ctx.blocked


def _close(
    w: _Work,
    lad: Ladder,
    name: str,
    level: Level,
    why: str,
    *,
    outcome: ActionOutcome | None = None,
) -> None:
    """Drop the ladder; an active one says why, and tells ``on_action`` of its ``outcome``."""
    w.ladders.pop(lad.target, None)
    if lad.status is LadderStatus.ACTIVE:
        w.event(name, level, why=why, **_ladder_fields(lad))
        if outcome is not None:
            w.intents.extend(_action_ended(lad, outcome, why))


def _freed(w: _Work, lad: Ladder, why: str) -> None:
    _close(w, lad, EventName.ESCALATION_RESOLVED, Level.INFO, why, outcome=ActionOutcome.FREED)


def _zombie_event(
    w: _Work, key: str, ppid: int | None, pid: int, gpu: str | None, *, force: bool = False
) -> None:
    if w.noted(key, "zombie") or force:
        w.event(
            EventName.ZOMBIE_NEEDS_REAP,
            Level.WARNING,
            finding=key,
            pid=pid,
            gpu=gpu,
            parent=ppid,
            why="a zombie holds nothing and cannot be signalled; its parent must reap it",
        )


def _mark_stuck(w: _Work, ctx: _Ctx, lad: Ladder, proc: ProcessInfo | None, why: str) -> None:
    w.ladders[lad.target] = _move(lad, LadderStatus.STUCK)
    facts = {**_ladder_fields(lad), **process_facts(proc)}
    w.event(EventName.TARGET_STUCK, Level.CRITICAL, why=why + "; needs drain/reboot", **facts)
    w.intents.append(
        HookIntent(HookName.ON_FAILURE, f"{lad.target} stuck: {why}", facts, dry_run=_dry(w, ctx))
    )
    if lad.status is LadderStatus.ACTIVE:
        w.intents.extend(_action_ended(lad, ActionOutcome.STUCK, why))


def _emit_step(
    w: _Work, ctx: _Ctx, lad: Ladder, proc: ProcessInfo | None, finding: Finding
) -> None:
    signal, wait = lad.steps[lad.step]
    number = lad.step + 1
    lad = replace(lad, step=number, due=ctx.now + wait)
    w.ladders[lad.target] = lad
    facts = {**_finding_fields(finding), **process_facts(proc)}
    fields = {**_ladder_fields(lad), "signal": signal, "wait": wait, "of": len(lad.steps)}
    # info: the action itself (action.signal) is the one warning line, real or would-be.
    w.event(EventName.ESCALATION_STEP_DUE, Level.INFO, **fields)
    w.waiting[lad.finding_key] = ctx.now + wait
    if signal is None:
        return  # a report-only step: the wait still counts
    if lad.gpu is not None:
        w.quiet_until[lad.gpu] = max(
            w.quiet_until.get(lad.gpu, 0.0), ctx.now + ctx.policy.limits.post_action_delay
        )
    if not lad.dry_run and all(t != lad.target for t, _ in w.signal_history):
        scope = kill_cap_scope(proc)
        w.signal_history.append((lad.target, ctx.now))
        w.signal_scopes[lad.target] = scope
        w.new_targets[scope] = w.new_targets.get(scope, 0) + 1
    elif _previewing(w, ctx):
        w.shadow.count(lad.target, kill_cap_scope(proc), ctx.now)
    w.intents.append(
        SignalIntent(
            identity=ProcessIdentity(lad.pid, lad.start_ticks),
            signal=signal,
            gpu=lad.gpu,
            finding_key=lad.finding_key,
            rule=lad.rule,
            step=number,
            dry_run=lad.dry_run,
            reason=f"rule {lad.rule} step {number}/{len(lad.steps)}: {finding.reason}",
            facts=facts,
        )
    )


def _refuse(w: _Work, key: str, why: str, level: Level, finding: Finding) -> None:
    if w.noted(key, why):
        w.event(EventName.ACTION_REFUSED, level, why=why, **_finding_fields(finding))


def _cap_exceeded(w: _Work, ctx: _Ctx, scope: str) -> tuple[str, str] | None:
    """(the scope latched: ``scope`` or "node", why) when one more target would pass a cap."""
    limits = ctx.policy.limits
    if len(w.signal_history) + 1 > limits.node_max_signalled_per_hour:
        why = f"more than {limits.node_max_signalled_per_hour} processes in one hour on the node"
        return "node", why
    if w.new_targets.get(scope, 0) + 1 > limits.max_signalled_per_poll:
        return scope, f"more than {limits.max_signalled_per_poll} processes of {scope} in one poll"
    mine = sum(1 for t, _ in w.signal_history if w.signal_scopes.get(t) == scope)
    if mine + 1 > limits.max_signalled_per_hour:
        return scope, f"more than {limits.max_signalled_per_hour} processes of {scope} in one hour"
    return None


REFUSAL_MEMORY_CHANGE = 64 * 1024 * 1024  # bytes of allocated memory that count as a change


def _review_refusals(w: _Work, ctx: _Ctx) -> None:
    """A refused incident may be tried again once something changed: its finding is gone (the
    incident is over; a new one starts afresh), or the GPU's allocated memory moved by
    :data:`REFUSAL_MEMORY_CHANGE` or more (a holder let go, or a new one came). A reload and
    ``resume --clear-latches`` forget every refusal (:func:`forget_reset_refusals`,
    :func:`clear_circuit`)."""
    for uuid, held in sorted(w.reset_refusals.items()):
        gpu = gpu_by_uuid(ctx.snapshot, uuid)
        allocated = None if gpu is None or gpu.memory is None else gpu.memory.allocated
        why = None
        if held.finding_key not in ctx.findings:
            why = "the incident is over (its finding resolved)"
        elif allocated is not None and held.allocated is None:
            w.reset_refusals[uuid] = replace(held, allocated=allocated)
        elif (
            allocated is not None
            and held.allocated is not None
            and abs(allocated - held.allocated) >= REFUSAL_MEMORY_CHANGE
        ):
            why = f"its allocated memory changed ({held.allocated} -> {allocated} bytes)"
        if why is not None:
            del w.reset_refusals[uuid]
            w.event(
                EventName.RESET_REFUSAL_CLEARED,
                Level.INFO,
                gpu=uuid,
                finding=held.finding_key,
                in_use=held.in_use,
                why=why,
            )


def _expire_latches(w: _Work, ctx: _Ctx) -> None:
    """Kill-cap latches last ``limits.kill_cap_latch`` (wall time); then they lift, with a
    warning. A latch from a state file that did not record its start starts counting now."""
    lasts = ctx.policy.limits.kill_cap_latch
    if w.state.forced_dry_run:
        since = w.state.forced_since
        if since is None:
            w.state = replace(w.state, forced_since=ctx.wall)
        elif ctx.wall - since >= lasts:
            w.event(
                EventName.LIMITS_KILL_CAP_EXPIRED,
                Level.WARNING,
                scope="node",
                why=w.state.forced_reason,
                lasted=ctx.wall - since,
            )
            w.state = replace(w.state, forced_dry_run=False, forced_reason=None, forced_since=None)
    for scope, latch in sorted(w.scope_latches.items()):
        if ctx.wall - latch.since >= lasts:
            del w.scope_latches[scope]
            w.event(
                EventName.LIMITS_KILL_CAP_EXPIRED,
                Level.WARNING,
                scope=scope,
                why=latch.reason,
                lasted=ctx.wall - latch.since,
            )


def _consider_process_finding(w: _Work, ctx: _Ctx, finding: Finding) -> None:
    key = finding.key
    proc = None if finding.pid is None else ctx.snapshot.processes.get(finding.pid)
    if finding.kind == FindingKind.ZOMBIE or (proc is not None and proc.is_zombie):
        ppid = finding.evidence.get("ppid", None if proc is None else proc.ppid)
        parent = ppid if isinstance(ppid, int) else None
        _zombie_event(w, key, parent, finding.pid or 0, finding.gpu)
        return
    target = None if finding.identity is None else target_key(finding.identity)
    if target is not None and target in w.ladders:
        return  # in progress or finished for this identity
    pending_rule = rule_for(finding, proc, ctx.policy, lasted=math.inf)
    if pending_rule is None:
        return
    first_seen = w.seen[key].first_seen
    rule = rule_for(finding, proc, ctx.policy, lasted=ctx.now - first_seen)
    if rule is None:
        w.waiting[key] = first_seen + pending_rule.for_
        if w.noted(key, "confirming"):
            w.event(
                EventName.ESCALATION_CONFIRMING,
                Level.DEBUG,
                rule=pending_rule.name,
                due=first_seen + pending_rule.for_,
                **_finding_fields(finding),
            )
        return
    if finding.kind != FindingKind.STUCK and all(step.signal is None for step in rule.steps):
        if w.noted(key, f"report:{rule.name}"):
            w.event(
                EventName.RULE_REPORT_ONLY, Level.INFO, rule=rule.name, **_finding_fields(finding)
            )
        return
    why = _gate(w, ctx, finding, proc)
    if why is not None:
        text, level = why
        _refuse(w, key, text, level, finding)
        return
    identity = finding.identity
    if identity is None or target is None:
        return  # refusal() already refused an unknown identity; this is for the type checker
    gpu = finding.gpu
    if finding.kind != FindingKind.STUCK and gpu is not None and gpu in ctx.quiet_before:
        until = ctx.quiet_before[gpu]
        w.waiting[key] = until
        if w.noted(key, "quiet"):
            w.event(
                EventName.ACTION_DEFERRED,
                Level.DEBUG,
                why="post_action_delay",
                until=until,
                **_finding_fields(finding),
            )
        return
    scope = kill_cap_scope(proc)
    dry = _dry(w, ctx, scope)
    lad = Ladder(
        target=target,
        pid=identity.pid,
        start_ticks=identity.start_ticks,
        finding_key=key,
        rule=rule.name,
        gpu=finding.gpu,
        steps=tuple((s.signal, s.wait) for s in rule.steps),
        step=0,
        due=None,
        status=LadderStatus.ACTIVE,
        dry_run=dry,
        started=ctx.now,
        user=None if proc is None else proc.user,
    )
    if finding.kind == FindingKind.STUCK:
        _mark_stuck(w, ctx, lad, proc, "target is in uninterruptible sleep (D); never signalled")
        return
    lad = _kill_caps(w, ctx, lad, proc, finding)
    _emit_step(w, ctx, lad, proc, finding)


def _kill_caps(
    w: _Work, ctx: _Ctx, lad: Ladder, proc: ProcessInfo | None, finding: Finding
) -> Ladder:
    """A new ladder against the kill caps (its owner's scope and the node's): past one, a
    real ladder starts as a dry run and the latch engages; a policy's dry run books the same
    in its shadow, where enforcement would latch (shadow.py)."""
    scope = kill_cap_scope(proc)
    dry = lad.dry_run
    target = lad.target
    if not dry:
        exceeded = _cap_exceeded(w, ctx, scope)
        if exceeded is not None:
            latched, over = exceeded
            if latched == "node":
                w.state = replace(
                    w.state, forced_dry_run=True, forced_reason=over, forced_since=ctx.wall
                )
            else:
                w.scope_latches[latched] = Latch(over, ctx.wall)
            w.event(
                EventName.LIMITS_KILL_CAP_REACHED,
                Level.CRITICAL,
                why=over,
                scope=latched,
                user=None if proc is None else proc.user,
                until=ctx.wall + ctx.policy.limits.kill_cap_latch,
                signalled_this_hour=len(w.signal_history),
                **_finding_fields(finding),
            )
            lad = replace(lad, dry_run=True)
    elif _previewing(w, ctx):
        capped = w.shadow.admit(target, scope, ctx.policy.limits, ctx.wall)
        if capped is not None:
            latched, over = capped
            w.event(
                EventName.LIMITS_KILL_CAP_REACHED,
                Level.WARNING,  # a would-be latch: nothing was switched
                why=over,
                scope=latched,
                user=None if proc is None else proc.user,
                until=ctx.wall + ctx.policy.limits.kill_cap_latch,
                dry_run=True,
                signalled_this_hour=len(w.shadow.signalled),
                **_finding_fields(finding),
            )
    return lad


def _gate(
    w: _Work, ctx: _Ctx, finding: Finding, proc: ProcessInfo | None
) -> tuple[str, Level] | None:
    """Why a new ladder may not start now (text, level), or None."""
    if not finding.actionable:
        return "not_actionable: the assessment is report-only", Level.INFO
    if finding.gpu is not None and finding.gpu in ctx.report_only:
        return f"report_only: {ctx.report_only[finding.gpu]}", Level.INFO
    if ctx.blocked is not None:
        return f"blocked: {ctx.blocked}", Level.WARNING
    why = refusal(proc, finding, ctx.snapshot, ctx.policy, ctx.self_ancestors)
    if why is not None:
        return why, Level.INFO
    if w.state.paused:
        return f"paused: {w.state.paused_reason or 'by an administrator'}", Level.INFO
    return None


# --- resets -----------------------------------------------------------------------------------


def _say(w: _Work, finding: Finding, said: tuple[str, Level, str]) -> None:
    """Log a reset decision (event name, level, why) once per finding until it changes."""
    name, level, why = said
    # The circuit breaker is node-wide: said once, not once per GPU.
    key = "node:circuit" if name == EventName.RESET_CIRCUIT_OPEN else finding.key
    if w.noted(key, f"{name}:{why}"):
        w.event(name, level, why=why, **_finding_fields(finding))


@dataclass(frozen=True)
class ResetGate:
    """One reason, known from a snapshot alone, that a GPU may not be reset now.

    ``name`` says which gate (``live_holder`` is checked only after the confirmation window,
    the others before it); ``why`` is what ``reset.refused`` says; ``level`` its log level.
    """

    name: str
    why: str
    level: Level


def _live_holder(gpu: GpuInfo, snapshot: Snapshot, findings: Iterable[Finding]) -> str | None:
    for other in sorted(findings, key=lambda f: f.key):
        if other.gpu != gpu.uuid or other.kind not in _HOLDER_KINDS:
            continue
        if other.pid is not None:
            return f"{other.kind.value} pid {other.pid} holds the GPU"
        if other.kind == FindingKind.HIDDEN_HOLDER:  # the driver said so (act/reset.py)
            return "hidden_holder: the driver refused the last reset, in use by another client"
    return live_holder(snapshot.holders, snapshot.processes, gpu.minor, snapshot.self_pids)


def reset_gates(
    finding: Finding,
    snapshot: Snapshot,
    policy: Policy,
    *,
    report_only: Mapping[str, str],
    findings: Iterable[Finding],
) -> list[ResetGate]:
    """Every gate that holds the reset of ``finding``'s GPU in this snapshot, in plan's order.

    Pure. These are the gates that need no history; plan checks them (the first that holds
    wins) around the confirmation window, then the ones that do need history (circuit
    breaker, reset limits, cooldown, a reset in flight, pause, post-action delay). ``explain``
    lists them all for a saved report.
    """
    reset = policy.reset
    gates: list[ResetGate] = []

    def gate(name: str, why: str, level: Level = Level.INFO) -> None:
        gates.append(ResetGate(name, why, level))

    uuid = finding.gpu or ""
    gpu = gpu_by_uuid(snapshot, finding.gpu)
    blocked = _node_block(snapshot)
    if not finding.actionable:
        gate("not_actionable", "not_actionable")
    if uuid in report_only:
        gate("report_only", f"report_only: {report_only[uuid]}")
    if blocked is not None:
        gate("blocked", f"blocked: {blocked}", Level.WARNING)
    if gpu is None and (mig := parent_of(snapshot, finding.gpu)) is not None:
        gate("mig", f"a MIG instance of GPU {mig[0].index}: no GPU reset of an instance")
        return gates
    if gpu is None or gpu.lost:
        why = "GPU not in this snapshot" if gpu is None else "GPU is lost (needs reboot)"
        gate("gpu", why, Level.WARNING)
        return gates
    entry = gpu_protected(uuid, gpu, policy)
    if entry is not None:
        gate("protect", f"protect: gpus {entry}")
    if gpu.mig_enabled is not False and not reset.allow_mig:
        gate("mig", "MIG enabled" if gpu.mig_enabled else "MIG mode unknown")
    elif (busy := busy_instances(snapshot, gpu)) is not None:
        gate("mig_busy", f"MIG: {busy}")  # a whole-GPU reset takes every instance down
    # Unknown topology is no blocker: nvidia-smi itself refuses (resetting nothing) when the
    # GPU's NVLink peers would have to be named too; this only spares a futile attempt.
    if gpu.reset_needs_nvlink_peers and not reset.allow_nvlink_group:
        gate("nvlink", "NVLink peers must be reset together (Volta, or Ampere with links)")
    holder = _live_holder(gpu, snapshot, findings)
    if holder is not None:
        gate("live_holder", f"live holder: {holder}")
    return gates


def _reset_blocker(
    w: _Work, ctx: _Ctx, finding: Finding, gpu: GpuInfo | None
) -> tuple[str, Level, str] | None:
    """Why this ghost_memory finding may not lead to a reset now: (event, level, why)."""
    reset = ctx.policy.reset
    refused = EventName.RESET_REFUSED
    refusal, holders = _gates(ctx, finding)
    if refusal is not None:
        return refusal
    if gpu is None:
        return refused, Level.WARNING, "GPU not in this snapshot"  # for the type checker
    first_seen = w.seen[finding.key].first_seen
    if ctx.now - first_seen < reset.confirm_for:
        w.waiting[finding.key] = first_seen + reset.confirm_for
        return EventName.RESET_CONFIRMING, Level.DEBUG, f"confirming for {reset.confirm_for:g}s"
    if holders:
        return refused, Level.INFO, holders[0]
    if _escalating(w, gpu.uuid):
        return refused, Level.INFO, f"live holder: {_ESCALATING}"
    return _history_blocker(w, ctx, finding, gpu)


_ESCALATING = "an escalation on this GPU is in progress"


def _gates(ctx: _Ctx, finding: Finding) -> tuple[tuple[str, Level, str] | None, list[str]]:
    """The reset gates of ``finding`` (:func:`reset_gates`, shared with ``explain``): the first
    refusal that is not a live holder as (event, level, why), and the live holders' reasons."""
    gates = reset_gates(
        finding, ctx.snapshot, ctx.policy, report_only=ctx.report_only,
        findings=ctx.findings.values(),
    )  # fmt: skip
    before = [g for g in gates if g.name != "live_holder"]
    refusal = (EventName.RESET_REFUSED, before[0].level, before[0].why) if before else None
    return refusal, [g.why for g in gates if g.name == "live_holder"]


def _escalating(w: _Work, uuid: str) -> bool:
    """A kill ladder is under way on this GPU: a reset must wait for it."""
    return any(lad.gpu == uuid and lad.status is LadderStatus.ACTIVE for lad in w.ladders.values())


def _history_blocker(
    w: _Work, ctx: _Ctx, finding: Finding, gpu: GpuInfo
) -> tuple[str, Level, str] | None:
    """The reset gates that need history: circuit breaker, limits, cooldown, a reset in flight,
    pause, post-action delay. Shared by ghost-memory and health resets: (event, level, why)."""
    reset = ctx.policy.reset
    refused = EventName.RESET_REFUSED
    uuid = gpu.uuid
    held = w.reset_refusals.get(uuid)
    if held is not None and held.finding_key == finding.key:
        would = "would have been refused" if held.dry_run else "was refused"
        why = (
            f"a reset for this incident {would} ({held.reason}); tried again when its "
            "memory changes, the finding resolves, the configuration is reloaded or "
            "`gpuwatchd resume --clear-latches` is run"
        )
        return refused, Level.INFO, why
    if w.state.reset_failures >= reset.max_failures and not w.state.circuit_open:
        w.state = replace(w.state, circuit_open=True)
    if w.state.circuit_open:
        why = f"circuit open after {w.state.reset_failures} failed reset(s); clear it by hand"
        return EventName.RESET_CIRCUIT_OPEN, Level.CRITICAL, why
    recent = [t for g, t in w.reset_history if g == uuid and ctx.wall - t < reset.window]
    if _dry(w, ctx):
        if finding.key in w.shadow.done:
            why = "dry run: a would-be reset is assumed to have dealt with it already"
            return refused, Level.INFO, why
        recent += w.shadow.recent_resets(uuid, ctx.wall, reset.window)  # would-be resets
    if len(recent) >= reset.max_resets:
        why = f"{len(recent)} reset(s) of this GPU within {reset.window:g}s"
        return EventName.RESET_LIMIT_REACHED, Level.WARNING, why
    last = w.last_reset.get(gpu.uuid)
    if _dry(w, ctx) and gpu.uuid in w.last_dry_reset:
        last = max(last if last is not None else -math.inf, w.last_dry_reset[gpu.uuid])
    if last is not None and ctx.wall - last < reset.cooldown:
        return refused, Level.DEBUG, "cooldown"
    if w.state.reset_in_flight is not None:
        return refused, Level.INFO, "another reset is in flight"
    hold = _hold_reason(w, ctx)
    if hold is not None:
        return refused, Level.INFO, hold
    if gpu.uuid in ctx.quiet_before:
        w.waiting[finding.key] = ctx.quiet_before[gpu.uuid]
        return EventName.ACTION_DEFERRED, Level.DEBUG, "post_action_delay"
    return None


def _consider_reset(w: _Work, ctx: _Ctx, finding: Finding) -> None:
    if not ctx.policy.reset.enabled or finding.gpu is None:
        return
    gpu = gpu_by_uuid(ctx.snapshot, finding.gpu)
    blocker = _reset_blocker(w, ctx, finding, gpu)
    if blocker is not None:
        _say(w, finding, blocker)
        return
    if gpu is None:
        return  # _reset_blocker refused it already; this is for the type checker
    lasted = ctx.now - w.seen[finding.key].first_seen
    _start_reset(w, ctx, finding, gpu, f"ghost memory confirmed for {lasted:.0f}s")


def _start_reset(
    w: _Work, ctx: _Ctx, finding: Finding, gpu: GpuInfo, why: str, *, drained: bool = False
) -> None:
    """Hand one GPU's reset to act: the one reset path, for ghost memory and GPU health
    (``drained``: the drain hooks ran already, before the health wait)."""
    dry = _dry(w, ctx)
    lasted = ctx.now - w.seen[finding.key].first_seen
    facts = {
        **_finding_fields(finding),
        "pci_bus_id": gpu.pci_bus_id,
        "minor": gpu.minor,
        "lasted": lasted,
        "evidence": dict(finding.evidence),
    }
    delay = ctx.policy.limits.post_action_delay
    flight = ResetInFlight(gpu.uuid, finding.key, dry, ctx.now, delay)
    w.state = replace(w.state, reset_in_flight=flight)
    w.quiet_until[gpu.uuid] = ctx.now + delay
    w.event(EventName.RESET_DUE, Level.INFO, dry_run=dry, **facts)  # reset.outcome is the warning
    w.intents.append(
        ResetIntent(
            gpu=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            minor=gpu.minor,
            finding_key=finding.key,
            dry_run=dry,
            reason=f"{why}: {finding.reason}",
            facts=facts,
            drained=drained,
        )
    )


# --- GPU health -------------------------------------------------------------------------------


def _health_once(w: _Work, finding: Finding, what: str) -> bool:
    """True the first time ``what`` is done for this finding (notes are kept while it lasts)."""
    return w.noted(finding.key, what)


def _drained_already(w: _Work, uuid: str, dry: bool) -> bool:
    """Whether this GPU's health incident ran its drain hooks already (a real drain covers a
    later dry run too; a dry run's does not cover a real one)."""
    earlier = w.health_drained.get(uuid)
    return earlier is not None and (not earlier or dry)


def _drain_hooks(w: _Work, ctx: _Ctx, finding: Finding, why: str, dry: bool) -> None:
    """The ``reset.drain`` hooks, at most once per health incident of the GPU: a finding that
    follows another on the same GPU (DRAIN_P2P settling to GPU_RESET) finds it drained."""
    uuid = finding.gpu or ""
    if _drained_already(w, uuid, dry):
        return
    w.health_drained[uuid] = dry
    if ctx.policy.reset.drain:
        # The GPU's bus id and minor too: a drain hook may name the GPU by any placeholder.
        gpu = gpu_by_uuid(ctx.snapshot, finding.gpu)
        facts = {
            **_finding_fields(finding),
            "pci_bus_id": None if gpu is None else gpu.pci_bus_id,
            "minor": None if gpu is None else gpu.minor,
        }
        w.intents.append(HookIntent(HookName.RESET_DRAIN, why, facts, dry_run=dry))


def _consider_health(w: _Work, ctx: _Ctx, finding: Finding) -> None:
    """What a health finding leads to (docs/policy.md#health). Never a signal to a job.

    ``reboot_required``: said once (critical), ``on_failure`` and drain hooks once, no reset.
    ``drain_required``, or a reset without ``action: reset``: drain hooks once. A
    ``reset_required`` with ``action: reset``: drain, wait (bounded by ``drain_timeout``, the
    wait persisted) until nothing holds the GPU, then the one reset path, under every gate.
    """
    health = ctx.policy.health
    if not health.enabled or finding.gpu is None:
        return
    dry = _dry(w, ctx)
    act = health.action != "report" and ctx.blocked is None and not w.state.paused
    fields = _finding_fields(finding)
    if not finding.actionable:
        # e.g. a recovery action gpuwatchd does not know: said once, loudly; nothing done.
        if _health_once(w, finding, "health:report"):
            w.event(EventName.ACTION_REFUSED, Level.WARNING, why="report only: not actionable",
                    **fields)  # fmt: skip
        return
    if finding.kind == FindingKind.REBOOT_REQUIRED:
        if _health_once(w, finding, "health:reboot"):
            w.event(EventName.GPU_NEEDS_REBOOT, Level.CRITICAL, why=finding.reason, **fields)
            w.intents.append(
                HookIntent(
                    HookName.ON_FAILURE, f"{finding.gpu} needs a reboot", fields, dry_run=dry
                )
            )
            if act:
                _drain_hooks(w, ctx, finding, f"{finding.gpu} needs a reboot", dry)
        return
    resetting = health.action == "reset" and ctx.policy.reset.enabled
    if finding.kind == FindingKind.DRAIN_REQUIRED or not resetting:
        if act and _health_once(w, finding, "health:drain"):
            w.event(
                EventName.HEALTH_DRAIN_STARTED, Level.WARNING, blockers=[], timeout=None, **fields
            )
            _drain_hooks(w, ctx, finding, f"{finding.gpu}: {finding.reason}", dry)
        return
    _consider_health_reset(w, ctx, finding, dry)


def _consider_health_reset(w: _Work, ctx: _Ctx, finding: Finding, dry: bool) -> None:
    uuid = finding.gpu or ""
    refusal, blockers = _gates(ctx, finding)
    if refusal is not None:
        _say(w, finding, refusal)
        return
    gpu = gpu_by_uuid(ctx.snapshot, uuid)
    if gpu is None:
        return  # a gate said so already; for the type checker
    blockers += drain_blockers(
        gpu, ctx.snapshot, device_isolation=ctx.policy.health.device_isolation
    )
    if _escalating(w, uuid):
        blockers.append(_ESCALATING)
    timeout = ctx.policy.health.drain_timeout
    wait = w.health_waits.get(uuid)
    if wait is None or wait.dry_run != dry:
        hold = _hold_reason(w, ctx)
        if hold is not None:
            _say(w, finding, (EventName.RESET_REFUSED, Level.INFO, hold))
            return
        wait = HealthWait(finding.key, ctx.now, dry)
        w.health_waits[uuid] = wait
        w.event(
            EventName.HEALTH_DRAIN_STARTED,
            Level.WARNING,
            blockers=blockers,
            timeout=timeout,
            dry_run=dry,
            drained_already=_drained_already(w, uuid, dry),
            **_finding_fields(finding),
        )
        _drain_hooks(w, ctx, finding, f"{uuid} is drained for a reset: {finding.reason}", dry)
    if blockers:
        if wait.expired:
            return
        if ctx.now - wait.since >= timeout:
            w.health_waits[uuid] = replace(wait, expired=True)
            held = "; ".join(blockers)
            why = f"still held after {timeout:g}s: {held}; waiting on, never signalling"
            facts = {**_finding_fields(finding), "blockers": blockers}
            w.event(EventName.HEALTH_DRAIN_TIMED_OUT, Level.CRITICAL, why=why, **facts)
            w.intents.append(HookIntent(HookName.ON_FAILURE, f"{uuid}: {why}", facts, dry_run=dry))
            return
        w.waiting[finding.key] = wait.since + timeout
        if w.noted(finding.key, "drain:" + "; ".join(blockers)):
            w.event(
                EventName.HEALTH_DRAIN_WAITING,
                Level.INFO,
                blockers=blockers,
                until=wait.since + timeout,
                **_finding_fields(finding),
            )
        return
    blocker = _history_blocker(w, ctx, finding, gpu)
    if blocker is not None:
        _say(w, finding, blocker)
        return
    _start_reset(w, ctx, finding, gpu, "GPU health asks for a reset", drained=True)


# --- outcomes from act ------------------------------------------------------------------------


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
    fields = {**_ladder_fields(lad), "outcome": outcome}
    waiting = {k: v for k, v in state.waiting.items() if k != lad.finding_key}
    intents: tuple[Intent, ...] = ()
    if outcome in (SignalOutcome.DELIVERED, SignalOutcome.DRY_RUN):
        due = now + lad.steps[lad.step - 1][1]
        ladders[target] = replace(lad, due=due)
        waiting[lad.finding_key] = due
    elif outcome in (SignalOutcome.GONE, SignalOutcome.ZOMBIE):
        del ladders[target]
        events.append(Event(EventName.ESCALATION_RESOLVED, Level.INFO, {**fields, "why": outcome}))
        # Gone before this step's signal: an earlier step, if one was sent, freed it.
        intents = _action_ended(lad, ActionOutcome.FREED, outcome, signalled=lad.step - 1)
        if outcome is SignalOutcome.ZOMBIE:
            events.append(
                Event(
                    EventName.ZOMBIE_NEEDS_REAP,
                    Level.WARNING,
                    {"pid": lad.pid, "gpu": lad.gpu, "finding": lad.finding_key, "parent": None},
                )
            )
    elif outcome is SignalOutcome.REUSED:
        del ladders[target]
        events.append(
            Event(EventName.ESCALATION_ABORTED, Level.WARNING, {**fields, "why": outcome})
        )
    else:  # denied / failed: never retried
        ladders[target] = _move(lad, LadderStatus.FAILED)
        events.append(Event(EventName.ESCALATION_ENDED, Level.ERROR, {**fields, "why": outcome}))
        intents = _action_ended(lad, ActionOutcome.FAILED, outcome)
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
        fields = {**_ladder_fields(lad), "why": "target exited", "after": now - lad.started}
        events = (Event(EventName.ESCALATION_RESOLVED, Level.INFO, fields),)
        intents = _action_ended(lad, ActionOutcome.FREED, "target exited")
    return PlanResult(intents, events, replace(state, ladders=ladders, waiting=waiting))


def record_assumed_exit(state: PlanState, identity: ProcessIdentity, *, now: float) -> PlanResult:
    """A dry run's would-be SIGKILL went to ``identity``: assumed to end it, as a real one would.

    SIGKILL cannot be caught (only uninterruptible sleep delays it, and that is ``stuck``), so
    the preview ends the ladder as enforcement would when the target exits: resolved, with the
    would-be ``on_action`` notification. The ladder stays, terminal, while the process lives,
    so a dry run never signals it again; it is dropped (and starts over for real) when the
    daemon acts for real. A SIGTERM is never assumed to end anything: it can be caught.
    """
    target = target_key(identity)
    lad = state.ladders.get(target)
    if lad is None or lad.status is not LadderStatus.ACTIVE or not lad.dry_run:
        return PlanResult((), (), state)
    ladders = {**state.ladders, target: _move(lad, LadderStatus.ENDED)}
    waiting = {k: v for k, v in state.waiting.items() if k != lad.finding_key}
    why = "would-be SIGKILL: assumed to end the target (dry run)"
    fields = {**_ladder_fields(lad), "why": why, "after": now - lad.started}
    facts = {**_ladder_fields(lad), "action": "signal", "outcome": ActionOutcome.FREED,
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
    facts = {
        **fields,
        "minor": intent.minor,
        "action": "reset",
        "outcome": outcome,
        "user": intent.facts.get("user"),
    }
    return HookIntent(
        HookName.ON_ACTION, f"reset of {intent.gpu}: {outcome}", facts, dry_run=intent.dry_run
    )


def _reset_came_back(w: _Work, intent: ResetIntent, undrained: bool) -> float:
    """The reset of ``intent`` is no longer in flight: its post-action delay (0 when it was
    not the one in flight). ``undrained``: it succeeded (or a dry run's would have), so its
    after hooks undid the drain — an undrain hook learns the result and keeps the node
    drained otherwise — and a later health incident of this GPU drains again (a dry run's
    would-be undrain undoes no real drain)."""
    if undrained and (not intent.dry_run or w.health_drained.get(intent.gpu) is True):
        w.health_drained.pop(intent.gpu, None)
    in_flight = w.state.reset_in_flight
    if in_flight is None or in_flight.gpu != intent.gpu:
        return 0.0
    w.state = replace(w.state, reset_in_flight=None)
    return in_flight.delay


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
    """Book a reset attempt: history, cooldown, circuit breaker; a failure runs on_failure.

    A dry run's reset that would have gone all the way (``would_succeed``: its read-only final
    scan found the GPU clear) is booked in the dry-run shadow as enforcement would book a
    success: it counts against ``max_resets``, is assumed to have dealt with its finding, and
    the ``on_action`` notification is shown as a would-be one.
    """
    if outcome not in set(ResetResult):
        raise ValueError(f"unknown reset outcome {outcome!r}")
    outcome = ResetResult(outcome)
    w = _Work(state)
    w.rebase_wall(wall)
    succeeded = outcome is ResetResult.SUCCESS or (outcome is ResetResult.DRY_RUN and would_succeed)
    delay = _reset_came_back(w, intent, succeeded)
    gpu = intent.gpu
    fields: dict[str, object] = {
        "gpu": gpu,
        "pci_bus_id": intent.pci_bus_id,
        "finding": intent.finding_key,
        "outcome": outcome,
    }
    if outcome is ResetResult.DRY_RUN:
        w.last_dry_reset[gpu] = wall
        if would_succeed:
            w.shadow.book_reset(gpu, intent.finding_key, wall)
            assumed = "success: assumed for the decisions that follow (dry run)"
            w.event(EventName.RESET_DRY_RUN, Level.INFO, assumed=assumed, **fields)
            w.intents.append(_reset_action(intent, ActionOutcome.RESET, fields))
        else:
            # Enforcement's final scan would have found the GPU held as well: the incident is
            # held as enforcement's would be (drain and before hooks once), in the preview only.
            why = "a dry run's final holder scan found the GPU held"
            w.reset_refusals[gpu] = ResetRefusal(intent.finding_key, why, False, wall, dry_run=True)
            w.event(EventName.RESET_DRY_RUN, Level.INFO, assumed="refused", **fields)
    elif outcome in (ResetResult.REFUSED, ResetResult.IN_USE):
        # Refused, not failed: aborted before the command ran (the final holder scan found a
        # holder, a hook failed), or the driver said "in use" although no scan saw a holder.
        # No history, no failure, no breaker; the cooldown applies, and this incident's reset
        # (with its drain and before hooks) is not tried again until something changes.
        w.last_reset[gpu] = wall
        in_use = outcome is ResetResult.IN_USE
        why = (
            "the driver refused: in use by another client that no holder scan found"
            if in_use
            else "refused by the reset procedure"
        )
        if not intent.dry_run:
            w.reset_refusals[gpu] = ResetRefusal(intent.finding_key, why, in_use, wall)
        w.event(EventName.RESET_REFUSED, Level.WARNING, why=why, hidden_holder=in_use, **fields)
    elif outcome is ResetResult.SUCCESS:
        w.last_reset[gpu] = wall
        w.reset_history.append((gpu, wall))
        w.state = replace(w.state, reset_failures=0)
        w.event(EventName.RESET_SUCCEEDED, Level.INFO, **fields)  # booked; reset.outcome said it
        w.intents.append(_reset_action(intent, ActionOutcome.RESET, fields))
    else:  # failed / timeout
        w.last_reset[gpu] = wall
        w.reset_history.append((gpu, wall))
        failures = w.state.reset_failures + 1
        w.state = replace(w.state, reset_failures=failures)
        w.event(EventName.RESET_FAILED, Level.INFO, failures=failures, **fields)  # as above
        w.intents.append(
            HookIntent(
                HookName.ON_FAILURE,
                f"reset of {gpu} {outcome}",
                {**fields, "failures": failures},
                dry_run=intent.dry_run,
            )
        )
        w.intents.append(_reset_action(intent, ActionOutcome.RESET_FAILED, fields))
    if needs_reboot:
        w.event(EventName.GPU_NEEDS_REBOOT, Level.CRITICAL, **fields)
        if outcome not in (ResetResult.FAILED, ResetResult.TIMEOUT):
            w.intents.append(
                HookIntent(
                    HookName.ON_FAILURE, f"{gpu} needs a reboot", fields, dry_run=intent.dry_run
                )
            )
    if delay > 0:
        w.quiet_until[gpu] = max(w.quiet_until.get(gpu, 0.0), now + delay)
        w.waiting[intent.finding_key] = now + delay
    return PlanResult(tuple(w.intents), tuple(w.events), w.freeze())


# --- queries and admin switches ---------------------------------------------------------------


def next_deadline(state: PlanState) -> float | None:
    """The earliest monotonic time something is due: a step, an end, a confirmation window,
    a post-action delay. Held ladders (paused, dry-run) and cooldowns are not deadlines: the
    daemon still polls every ``interval``."""
    return min(state.waiting.values()) if state.waiting else None


def pending(state: PlanState, keys: Iterable[str]) -> bool:
    """True while any of these findings has a ladder, confirmation window or reset in progress."""
    return bool(pending_keys(state, keys))


def pending_keys(state: PlanState, keys: Iterable[str]) -> list[str]:
    """Those of these findings that have a ladder, confirmation window or reset in progress."""
    wanted = set(keys)
    found = {k for k in state.waiting if k in wanted}
    if state.reset_in_flight is not None and state.reset_in_flight.finding_key in wanted:
        found.add(state.reset_in_flight.finding_key)
    found.update(
        lad.finding_key
        for lad in state.ladders.values()
        if lad.status is LadderStatus.ACTIVE and lad.finding_key in wanted
    )
    return sorted(found)


def set_paused(
    state: PlanState, paused: bool, *, reason: str, until: float | None = None
) -> PlanState:
    """The admin pause switch: while paused no intent is emitted (ladders hold, events say so).
    ``until`` (wall time) is when the pause ends, for status and metrics; the caller ends it."""
    return replace(
        state,
        paused=paused,
        paused_reason=reason if paused else None,
        paused_until=until if paused else None,
    )


def clear_forced_dry_run(state: PlanState) -> PlanState:
    """Admin: lift the dry-run the kill cap engaged, the node's and every user's (``resume``
    does not do it by itself), and the would-be latches a dry run keeps in its shadow."""
    return replace(
        state,
        forced_dry_run=False,
        forced_reason=None,
        forced_since=None,
        scope_latches={},
        shadow=state.shadow.without_latches(),
    )


def clear_circuit(state: PlanState) -> PlanState:
    """Admin: close the reset circuit breaker, forget the consecutive failures and every
    refused incident (their resets may be tried again)."""
    notes = {k: v for k, v in state.notes.items() if k != "node:circuit"}
    return replace(state, circuit_open=False, reset_failures=0, notes=notes, reset_refusals={})


def forget_reset_refusals(state: PlanState) -> PlanState:
    """A reloaded configuration (new hooks, say) may succeed where the last one was refused."""
    return replace(state, reset_refusals={})


def hidden_holders(state: PlanState) -> dict[str, dict[str, object]]:
    """GPU UUID → evidence, for each GPU whose last reset the driver refused as in use while
    no scan saw a holder: assess reports it as a GPU-level ``hidden_holder``."""
    return {
        gpu: {
            "gap": "driver_in_use",
            "refused_at": r.since,
            "incident": r.finding_key,
            "allocated_then": r.allocated,
        }
        for gpu, r in state.reset_refusals.items()
        if r.in_use
    }
