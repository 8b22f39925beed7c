"""The escalation state machine: findings + carried state + policy + time → intents and events.

This module owns ``plan``, one poll's decisions in order (boot, findings seen, lost GPUs,
ladders, process findings, resets, GPU health), and the queries and admin switches on
``PlanState``. Semantics: ``docs/escalation.md``.

In detail: docs/internals.md, section `gpuwatchd.decide.plan.decisions`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from gpuwatchd.core.checked import decimal
from gpuwatchd.core.model import Finding, FindingKind, Snapshot
from gpuwatchd.core.vocabulary import EventName, LadderStatus, Level
from gpuwatchd.decide.kinds import HEALTH as HEALTH_KINDS
from gpuwatchd.decide.plan.health import consider_health
from gpuwatchd.decide.plan.intents import (
    Ctx,
    PlanResult,
    Work,
    finding_fields,
    is_dry_run,
    page,
    target_key,
)
from gpuwatchd.decide.plan.ladders import advance_ladders, consider_process_finding, expire_latches
from gpuwatchd.decide.plan.resets import consider_reset, node_block, review_refusals
from gpuwatchd.decide.plan.shadow import HOUR, DryShadow, ShadowWork
from gpuwatchd.decide.plan.state import PlanState, SeenFinding
from gpuwatchd.decide.policy import Policy


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
    w = Work(state)
    _check_boot(w, snapshot)  # first: another boot's monotonic time measures nothing
    w.rebase_wall(wall, now)
    current = {f.key: f for f in findings}
    ctx = Ctx(
        snapshot=snapshot,
        policy=policy,
        now=now,
        wall=wall,
        report_only=report_only or {},
        self_ancestors=self_ancestors,
        findings=current,
        quiet_before={g: t for g, t in w.quiet_until.items() if t > now},
        blocked=node_block(snapshot),
    )
    w.quiet_until = dict(ctx.quiet_before)
    if is_dry_run(w, ctx):
        w.shadow.prune(now=now, wall=wall, window=policy.reset.window, findings=current,
                       ladders=w.ladders)  # fmt: skip
        for scope, why, lasted in w.shadow.expire(wall, policy.limits.kill_cap_latch):
            w.event(EventName.LIMITS_KILL_CAP_EXPIRED, Level.INFO, scope=scope, why=why,
                    lasted=lasted, dry_run=True)  # fmt: skip
    else:
        # What dry-run would have done never blocks the real thing.
        w.shadow = ShadowWork(DryShadow())
        w.reset_refusals = {g: r for g, r in w.reset_refusals.items() if not r.dry_run}
    w.waiting = {}
    w.signal_history = [(t, at) for t, at in w.signal_history if now - at < HOUR]
    expire_latches(w, ctx)
    review_refusals(w, ctx)
    _track_findings(w, ctx)
    _watch_lost_gpus(w, ctx)
    advance_ladders(w, ctx)
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.pid is not None:
            consider_process_finding(w, ctx, finding)
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.kind == FindingKind.GHOST_MEMORY and finding.gpu is not None:
            consider_reset(w, ctx, finding)
    # GPU health (decide/health/judge.py): drain, then reset; reboot; drain.
    w.health_waits = {g: wait for g, wait in w.health_waits.items() if wait.finding_key in current}
    # A GPU stays drained while any of its health findings lasts: one incident, one drain.
    unhealthy = {f.gpu for f in current.values() if f.kind in HEALTH_KINDS}
    w.health_drained = {g: dry for g, dry in w.health_drained.items() if g in unhealthy}
    for finding in sorted(current.values(), key=lambda f: f.key):
        if finding.kind in HEALTH_KINDS and finding.gpu is not None:
            consider_health(w, ctx, finding)
    w.notes = {k: v for k, v in w.notes.items() if k.startswith("node:") or k in current}
    return PlanResult(tuple(w.intents), tuple(w.events), w.freeze())


def _watch_lost_gpus(w: Work, ctx: Ctx) -> None:
    """A GPU NVML reports lost needs a reboot: say so once (critical) and ask for on_failure;
    again only after it came back and was lost once more."""
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
        reason = f"{gpu.uuid} is lost and needs a reboot"
        page(w, reason, fields, {"gpu": gpu.uuid}, dry_run=is_dry_run(w, ctx))


def _check_boot(w: Work, snapshot: Snapshot) -> None:
    old, new = w.state.boot_id, snapshot.boot_id
    if new is None:
        return
    if old is not None and old != new:
        dropped = len(w.ladders)
        w.event(EventName.STATE_BOOT_CHANGED, Level.INFO, old=old, new=new, dropped_ladders=dropped)
        _forget_boot(w)
    w.state = replace(w.state, boot_id=new)


def another_boots(state: PlanState, *, rebooted: bool = True) -> PlanState:
    """``state`` less what a poll reading a new boot id drops: for the start, which takes a
    state saved with no boot id for another boot's (daemon/lifecycle.py). Not ``rebooted``
    (this boot's id is unreadable: maybe the same boot), what only a reboot ends on the GPUs
    stays: refused resets, half-done MIG recoveries, drains done."""
    w = Work(state)
    _forget_boot(w, rebooted=rebooted)
    return w.freeze()


def _forget_boot(w: Work, *, rebooted: bool = True) -> None:
    # Monotonic times and process identities mean nothing after a reboot; wall-time reset
    # history, the circuit breaker, forced dry-run and pause are kept.
    w.seen, w.ladders, w.quiet_until, w.signal_history = {}, {}, {}, []
    w.signal_scopes, w.health_waits = {}, {}
    if rebooted:  # a reboot resets every GPU and takes every MIG instance down
        w.reset_refusals, w.health_drained = {}, {}
        w.state = replace(w.state, mig_unfinished={})  # a half-done recovery is no longer
    w.shadow.new_boot()
    # Latches hold on: their monotonic anchors are of the old boot (anchored again).
    w.scope_latches = {k: replace(v, since_monotonic=None) for k, v in w.scope_latches.items()}
    w.notes = {k: v for k, v in w.notes.items() if k.startswith("node:")}
    w.state = replace(w.state, reset_in_flight=None, forced_since_monotonic=None,
                      last_monotonic=None)  # fmt: skip


def _track_findings(w: Work, ctx: Ctx) -> None:
    for key, finding in sorted(ctx.findings.items()):
        digest = f"{finding.reason}|actionable={finding.actionable}"
        seen = w.seen.get(key)
        target = None if finding.identity is None else target_key(finding.identity)
        if seen is None:
            w.seen[key] = SeenFinding(ctx.now, digest, finding.gpu, target)
            w.event(
                EventName.FINDING_NEW,
                Level.WARNING if finding.actionable else Level.INFO,
                actionable=finding.actionable,
                evidence=dict(finding.evidence),
                **finding_fields(finding),
            )
        elif seen.digest != digest:
            w.seen[key] = replace(seen, digest=digest)
            w.event(
                EventName.FINDING_CHANGED,
                Level.INFO,
                actionable=finding.actionable,
                lasted=ctx.now - seen.first_seen,
                **finding_fields(finding),
            )
    for key in sorted(set(w.seen) - set(ctx.findings)):
        seen = w.seen.pop(key)
        w.event(
            EventName.FINDING_RESOLVED,
            Level.INFO,
            finding=key,
            kind=key.split(":", 1)[0],  # which finding, as EventName.FINDING_NEW said it
            gpu=seen.gpu,
            # None for a GPU-level finding, or a PID a damaged state file spells in other than
            # a few ASCII digits (``'²'.isdigit()`` is True, and int() refuses 5,000 digits).
            pid=None if seen.target is None else decimal(seen.target.split("@", 1)[0]),
            lasted=max(0.0, ctx.now - seen.first_seen),
        )


# --- queries and admin switches ---------------------------------------------------------------


def next_deadline(state: PlanState) -> float | None:
    """The earliest monotonic time something is due (held ladders and cooldowns are not)."""
    return min(state.waiting.values()) if state.waiting else None


def pending_keys(state: PlanState, keys: Iterable[str]) -> list[str]:
    """Those of these findings that have a ladder, confirmation window or reset in progress."""
    flight = state.reset_in_flight
    busy = {lad.finding_key for lad in state.ladders.values() if lad.status is LadderStatus.ACTIVE}
    busy.update(state.waiting, () if flight is None else (flight.finding_key,))
    return sorted(busy.intersection(keys))


def set_paused(
    state: PlanState, paused: bool, *, reason: str, until: float | None = None
) -> PlanState:
    """The admin pause switch: while paused no intent is emitted. ``until`` (wall time) is when
    the pause ends, for status and metrics; the caller ends it."""
    return replace(
        state,
        paused=paused,
        paused_reason=reason if paused else None,
        paused_until=until if paused else None,
    )


def _after(since: float | None, made: float) -> bool:
    """Set after the admin's request was made (wall times): unseen by it, so it holds."""
    return since is not None and since > made


def clear_forced_dry_run(state: PlanState, made: float = math.inf) -> PlanState:
    """Admin: lift every kill-cap latch set by wall time ``made`` (when ``resume
    --clear-latches`` asked), the node's, each user's and the dry-run shadow's."""
    scopes = {k: v for k, v in state.scope_latches.items() if _after(v.since, made)}
    state = replace(state, scope_latches=scopes, shadow=state.shadow.without_latches())
    return state if _after(state.forced_since, made) else state.without_node_latch()


def clear_circuit(state: PlanState, made: float = math.inf) -> PlanState:
    """Admin: close the reset circuit breaker and forget the failures, unless one failed after
    wall time ``made`` (the request: nobody saw it), and forget the refused incidents and MIG
    recoveries left half done by then (the admin says they are dealt with)."""
    refusals = {k: v for k, v in state.reset_refusals.items() if _after(v.since, made)}
    unfinished = {k: v for k, v in state.mig_unfinished.items() if _after(v.since, made)}
    state = replace(state, reset_refusals=refusals, mig_unfinished=unfinished)
    if _after(state.last_failure, made):
        return state
    notes = {k: v for k, v in state.notes.items() if k != "node:circuit"}
    return replace(state, circuit_open=False, reset_failures=0, last_failure=None, notes=notes)


def forget_reset_refusals(state: PlanState) -> PlanState:
    """A reloaded configuration (new hooks, say) may succeed where the last one was refused."""
    return replace(state, reset_refusals={})


def hidden_holders(state: PlanState) -> dict[str, dict[str, object]]:
    """GPU UUID → evidence, for each GPU whose reset the driver refused as in use unseen."""
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
