"""Acting on process findings: confirmation, the kill caps (per user and node-wide) whose
latches force dry-run until they expire, and each ladder's steps (``docs/escalation.md``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from gpuwatchd.core.model import Finding, FindingKind, ProcessIdentity, ProcessInfo
from gpuwatchd.core.vocabulary import ActionOutcome, EventName, LadderStatus, Level
from gpuwatchd.decide.plan.intents import (
    Ctx,
    SignalIntent,
    Work,
    action_ended,
    end_ladder,
    finding_fields,
    hold_reason,
    is_dry_run,
    kill_cap_scope,
    ladder_fields,
    page,
    pause_hold,
    previewing,
    target_key,
)
from gpuwatchd.decide.plan.shadow import cap_exceeded
from gpuwatchd.decide.plan.state import Ladder, Latch
from gpuwatchd.decide.policy import Rule
from gpuwatchd.decide.spares import spare_reason
from gpuwatchd.decide.targets import process_facts, refusal, rule_for


def _stuck_finding(ctx: Ctx, target: str) -> Finding | None:
    for finding in ctx.findings.values():
        identity = finding.identity
        if finding.kind == FindingKind.STUCK and identity and target_key(identity) == target:
            return finding
    return None


def _cannot_tell(ctx: Ctx, target: str) -> bool:
    """Whether this poll cannot tell that ``target`` is no leftover any more: a node-wide block
    (NVML unavailable or wedged), or a finding about it the orphan rule could not decide."""
    return ctx.blocked is not None or any(
        f.evidence.get("undecided") is True and f.identity and target_key(f.identity) == target
        for f in ctx.findings.values()
    )


def advance_ladders(w: Work, ctx: Ctx) -> None:
    """Move every ladder on: a target gone, reused or a zombie ends it; a live one steps."""
    for target, lad in sorted(w.ladders.items()):
        proc = ctx.snapshot.processes.get(lad.pid)
        if proc is None:
            if lad.finding_key not in ctx.findings and _stuck_finding(ctx, target) is None:
                _close(w, lad, "target gone")
            continue  # listed by a finding but not described: unknown, so wait
        if proc.start_ticks is None:
            continue
        if proc.start_ticks != lad.start_ticks:
            _close(w, lad, "target gone (PID reused)")
            continue
        if proc.is_zombie:
            _close(w, lad, "target exited (zombie)")
            _zombie_event(w, lad.finding_key, proc.ppid, lad.pid, lad.gpu, force=True)
            continue
        _advance_live_ladder(w, ctx, lad, proc)


def _advance_live_ladder(w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo) -> None:
    """One poll of a ladder whose target is alive and still the same process."""
    target = lad.target
    finding = ctx.findings.get(lad.finding_key) or _successor(ctx, lad, proc)
    if finding is not None and finding.key != lad.finding_key:
        # The same process, now described by another finding (e.g. orphaned → abandoned): the
        # ladder follows the process, keeping its steps, so a kind flip never skips a wait.
        lad = replace(lad, finding_key=finding.key)
        w.ladders[target] = lad
    scope = kill_cap_scope(proc, ctx.snapshot.subuid_ranges)
    if lad.status is not LadderStatus.ACTIVE:
        if lad.dry_run and not is_dry_run(w, ctx, scope) and hold_reason(w, ctx) is None:
            _restart_after_dry_run(w, lad)
        return
    if _stuck_finding(ctx, target) is not None:
        _mark_stuck(w, ctx, lad, proc, "target is in uninterruptible sleep (D)")
        return
    if finding is None:
        if not _cannot_tell(ctx, target):  # else unknown, so wait (nothing said, as above)
            _close(w, lad, "finding resolved", ActionOutcome.RELEASED)
        return
    if lad.due is not None and ctx.now < lad.due:
        w.waiting[lad.finding_key] = lad.due
        return
    if lad.step >= len(lad.steps):
        _last_step_over(w, ctx, lad, proc)
        return
    hold = _report_only(ctx, finding) or _ladder_hold(w, ctx, lad, proc, scope)
    if hold is not None:
        _hold(w, lad, hold)
        return
    if lad.dry_run and not is_dry_run(w, ctx, scope):
        _restart_after_dry_run(w, lad)
        return
    why = refusal(proc, finding, ctx.snapshot, ctx.policy, ctx.self_ancestors)
    if why is not None:
        w.ladders[target] = end_ladder(lad, LadderStatus.FAILED)
        w.event(EventName.ACTION_REFUSED, Level.WARNING, why=why, **ladder_fields(lad))
        w.intents.extend(action_ended(lad, ActionOutcome.FAILED, f"refused: {why}"))
        return
    if _first_signal_capped(w, ctx, lad, proc, finding):
        _hold(w, lad, "dry_run (kill cap engaged)")  # as its latch holds it from now on
        return
    _emit_step(w, ctx, lad, proc, finding)


def _hold(w: Work, lad: Ladder, why: str) -> None:
    """The ladder's next step waits: said once. Not put in ``waiting``: nothing is due until
    the hold lifts (no busy loop)."""
    if w.noted(lad.finding_key, f"hold:{why}"):
        w.event(EventName.ACTION_REFUSED, Level.INFO, why=why, **ladder_fields(lad))


def _last_step_over(w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo) -> None:
    """The last step's wait is over and the target still lives: stuck in D state, or ended."""
    if proc.is_uninterruptible:
        _mark_stuck(w, ctx, lad, proc, "target still alive in D state after its ladder")
        return
    w.ladders[lad.target] = end_ladder(lad, LadderStatus.ENDED)
    survived = "target still alive after the last step"
    level = Level.INFO if lad.dry_run else Level.ERROR
    w.event(EventName.ESCALATION_ENDED, level, why=survived, **ladder_fields(lad),
            **process_facts(proc))  # fmt: skip
    w.intents.extend(action_ended(lad, ActionOutcome.SURVIVED, survived))


def _ladder_hold(w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo, scope: str) -> str | None:
    """Why an active ladder's next step waits: a pause or block, a spare, a kill cap's dry run
    (or, in a preview, where enforcement's latch would hold it)."""
    hold = hold_reason(w, ctx)
    if hold is not None:
        return hold
    spared = spare_reason(proc, ctx.snapshot)
    if spared is not None:
        return f"spare: {spared}"
    if is_dry_run(w, ctx, scope) and not lad.dry_run:
        capped = w.state.forced_dry_run or scope in w.scope_latches
        return "dry_run (kill cap engaged)" if capped else "dry_run"
    if previewing(w, ctx) and w.shadow.holds(lad.target, scope):
        return "dry_run (kill cap engaged)"
    return None


def _successor(ctx: Ctx, lad: Ladder, proc: ProcessInfo) -> Finding | None:
    """Another actionable finding about the ladder's target that some rule selects."""
    for finding in sorted(ctx.findings.values(), key=lambda f: f.key):
        identity = finding.identity
        if identity is None or target_key(identity) != lad.target or not finding.actionable:
            continue
        if rule_for(finding, proc, ctx.policy, lasted=math.inf) is not None:
            return finding
    return None


def _restart_after_dry_run(w: Work, lad: Ladder) -> None:
    """Drop a dry run's ladder when the daemon acts for real: it starts over from step 1."""
    del w.ladders[lad.target]
    w.event(EventName.ESCALATION_RESTARTED, Level.INFO, why="dry-run ended", **ladder_fields(lad))


def _close(w: Work, lad: Ladder, why: str, outcome: ActionOutcome = ActionOutcome.FREED) -> None:
    """Drop the ladder; an active one is resolved: said why, ``outcome`` told to ``on_action``."""
    w.ladders.pop(lad.target, None)
    if lad.status is LadderStatus.ACTIVE:
        w.event(EventName.ESCALATION_RESOLVED, Level.INFO, why=why, **ladder_fields(lad))
        w.intents.extend(action_ended(lad, outcome, why))


def _zombie_event(
    w: Work, key: str, ppid: int | None, pid: int, gpu: str | None, *, force: bool = False
) -> None:
    if w.noted(key, "zombie") or force:
        why = "a zombie holds nothing and cannot be signalled; its parent must reap it"
        w.event(EventName.ZOMBIE_NEEDS_REAP, Level.WARNING, finding=key, pid=pid, gpu=gpu,
                parent=ppid, why=why)  # fmt: skip


def _mark_stuck(w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo | None, why: str) -> None:
    w.ladders[lad.target] = end_ladder(lad, LadderStatus.STUCK)
    facts = {**ladder_fields(lad), **process_facts(proc)}
    w.event(EventName.TARGET_STUCK, Level.CRITICAL, why=why + "; needs drain/reboot", **facts)
    dry = is_dry_run(w, ctx, kill_cap_scope(proc, ctx.snapshot.subuid_ranges))  # its user's
    page(w, f"{lad.target} stuck: {why}", facts, ladder_fields(lad), dry_run=dry)
    w.intents.extend(action_ended(lad, ActionOutcome.STUCK, why))  # every caller's is active


def _emit_step(w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo | None, finding: Finding) -> None:
    signal, wait = lad.steps[lad.step]
    number = lad.step + 1
    lad = replace(lad, step=number, due=ctx.now + wait)
    w.ladders[lad.target] = lad
    facts = {**finding_fields(finding), **process_facts(proc)}
    fields = {**ladder_fields(lad), "signal": signal, "wait": wait, "of": len(lad.steps)}
    # info: the action itself (EventName.ACTION_SIGNAL) is the one warning line, real or would-be.
    w.event(EventName.ESCALATION_STEP_DUE, Level.INFO, **fields)
    w.waiting[lad.finding_key] = ctx.now + wait
    if signal is None:
        return  # a report-only step: the wait still counts
    if lad.gpu is not None:
        w.quiet_until[lad.gpu] = max(
            w.quiet_until.get(lad.gpu, 0.0), ctx.now + ctx.policy.limits.post_action_delay
        )
    if not lad.dry_run and all(t != lad.target for t, _ in w.signal_history):
        scope = kill_cap_scope(proc, ctx.snapshot.subuid_ranges)
        w.signal_history.append((lad.target, ctx.now))
        w.signal_scopes[lad.target] = scope
        w.new_targets[scope] = w.new_targets.get(scope, 0) + 1
    elif previewing(w, ctx):
        w.shadow.count(lad.target, kill_cap_scope(proc, ctx.snapshot.subuid_ranges), ctx.now)
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


def _held(since: float, since_monotonic: float | None, ctx: Ctx) -> tuple[float, float]:
    """How long a latch has held, and its anchor on the plan's monotonic clock (anchored once
    by the wall time it has held when it has none)."""
    if since_monotonic is None:
        since_monotonic = ctx.now - max(0.0, ctx.wall - since)
    return ctx.now - since_monotonic, since_monotonic


def expire_latches(w: Work, ctx: Ctx) -> None:
    """Lift the kill-cap latches that lasted ``limits.kill_cap_latch``, with a warning; one
    whose start was not recorded starts counting now."""
    lasts = ctx.policy.limits.kill_cap_latch
    if w.state.forced_dry_run:
        since = w.state.forced_since
        if since is None:
            w.state = replace(w.state, forced_since=ctx.wall, forced_since_monotonic=ctx.now)
        else:
            lasted, anchor = _held(since, w.state.forced_since_monotonic, ctx)
            if lasted >= lasts:
                w.event(EventName.LIMITS_KILL_CAP_EXPIRED, Level.WARNING, scope="node",
                        why=w.state.forced_reason, lasted=lasted)  # fmt: skip
                w.state = w.state.without_node_latch()
            else:
                w.state = replace(w.state, forced_since_monotonic=anchor)
    for scope, latch in sorted(w.scope_latches.items()):
        lasted, anchor = _held(latch.since, latch.since_monotonic, ctx)
        if lasted >= lasts:
            del w.scope_latches[scope]
            w.event(EventName.LIMITS_KILL_CAP_EXPIRED, Level.WARNING, scope=scope,
                    why=latch.reason, lasted=lasted)  # fmt: skip
        else:
            w.scope_latches[scope] = replace(latch, since_monotonic=anchor)


def consider_process_finding(w: Work, ctx: Ctx, finding: Finding) -> None:
    """Whether a process finding starts a kill ladder now (confirmed, a rule, the gates)."""
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
    rule = _confirmed_rule(w, ctx, finding, proc)
    if rule is None:
        return
    if finding.kind != FindingKind.STUCK and all(step.signal is None for step in rule.steps):
        if w.noted(key, f"report:{rule.name}"):
            w.event(EventName.RULE_REPORT_ONLY, Level.INFO, rule=rule.name,
                    **finding_fields(finding))  # fmt: skip
        return
    why = _gate(w, ctx, finding, proc)
    if why is not None:
        text, level = why
        if w.noted(key, text):
            w.event(EventName.ACTION_REFUSED, level, why=text, **finding_fields(finding))
        return
    identity = finding.identity
    if identity is None or target is None:
        return  # refusal() already refused an unknown identity; this is for the type checker
    if _post_action_delay(w, ctx, finding):
        return
    scope = kill_cap_scope(proc, ctx.snapshot.subuid_ranges)
    dry = is_dry_run(w, ctx, scope)
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


def _confirmed_rule(w: Work, ctx: Ctx, finding: Finding, proc: ProcessInfo | None) -> Rule | None:
    """The rule that selects ``finding`` now; while a rule's confirmation window (``for``)
    runs, None, the finding waiting for its end (said once)."""
    pending_rule = rule_for(finding, proc, ctx.policy, lasted=math.inf)
    if pending_rule is None:
        return None
    first_seen = w.seen[finding.key].first_seen
    rule = rule_for(finding, proc, ctx.policy, lasted=ctx.now - first_seen)
    if rule is None:
        w.waiting[finding.key] = first_seen + pending_rule.for_
        if w.noted(finding.key, "confirming"):
            w.event(EventName.ESCALATION_CONFIRMING, Level.DEBUG, rule=pending_rule.name,
                    due=first_seen + pending_rule.for_, **finding_fields(finding))  # fmt: skip
    return rule


def _post_action_delay(w: Work, ctx: Ctx, finding: Finding) -> bool:
    """Whether a new ladder waits out its GPU's post-action delay (a stuck target's does not)."""
    gpu = finding.gpu
    if finding.kind == FindingKind.STUCK or gpu is None or gpu not in ctx.quiet_before:
        return False
    until = ctx.quiet_before[gpu]
    w.waiting[finding.key] = until
    if w.noted(finding.key, "quiet"):
        w.event(EventName.ACTION_DEFERRED, Level.DEBUG, why="post_action_delay", until=until,
                **finding_fields(finding))  # fmt: skip
    return True


def _kill_caps(
    w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo | None, finding: Finding
) -> Ladder:
    """A new ladder against the kill caps: past one, a real ladder starts as a dry run and the
    latch engages; a policy's dry run books the same in its shadow (shadow.py)."""
    if lad.dry_run and not previewing(w, ctx):
        return lad
    return replace(lad, dry_run=True) if _cap_reached(w, ctx, lad, proc, finding) else lad


def _first_signal_capped(
    w: Work, ctx: Ctx, lad: Ladder, proc: ProcessInfo | None, finding: Finding
) -> bool:
    """Whether a ladder's next step, its first signal (the steps before it only reported),
    would pass a kill cap: the latch engages as at a ladder's start, and the ladder holds (a
    real one by its latch; a would-be one by the would-be latch, which does not force it)."""
    if lad.steps[lad.step][0] is None:
        return False
    if not lad.dry_run:
        signalled = {t for t, _ in w.signal_history}
    elif previewing(w, ctx):
        signalled = {t for t, _ in w.shadow.signalled} | w.shadow.forced
    else:
        return False  # a ladder a kill cap forced to a dry run counts nothing
    return lad.target not in signalled and _cap_reached(w, ctx, lad, proc, finding, held=True)


def _cap_reached(
    w: Work,
    ctx: Ctx,
    lad: Ladder,
    proc: ProcessInfo | None,
    finding: Finding,
    *,
    held: bool = False,
) -> bool:
    """Whether one more target, ``lad``'s, would pass a kill cap: the latch engages (in a
    preview the would-be one, forcing ``lad`` to a dry run unless it is ``held``)."""
    scope = kill_cap_scope(proc, ctx.snapshot.subuid_ranges)
    if not lad.dry_run:
        exceeded = cap_exceeded(ctx.policy.limits, scope, w.signal_history, w.signal_scopes,
                                w.new_targets)  # fmt: skip
        signalled = len(w.signal_history)
    else:
        limits, wall = ctx.policy.limits, ctx.wall
        exceeded = (
            w.shadow.engage(scope, limits, wall)
            if held
            else w.shadow.admit(lad.target, scope, limits, wall)
        )
        signalled = len(w.shadow.signalled)
    if exceeded is None:
        return False
    latched, over = exceeded
    if lad.dry_run:  # a would-be latch: nothing was switched
        level, would = Level.WARNING, {"dry_run": True}
    elif latched == "node":
        level, would = Level.CRITICAL, {}
        w.state = replace(w.state, forced_dry_run=True, forced_reason=over,
                          forced_since=ctx.wall, forced_since_monotonic=ctx.now)  # fmt: skip
    else:
        level, would = Level.CRITICAL, {}
        w.scope_latches[latched] = Latch(over, ctx.wall, ctx.now)
    w.event(EventName.LIMITS_KILL_CAP_REACHED, level, why=over, scope=latched,
            user=None if proc is None else proc.user,
            until=ctx.wall + ctx.policy.limits.kill_cap_latch, **would,
            signalled_this_hour=signalled, **finding_fields(finding))  # fmt: skip
    return True


def _report_only(ctx: Ctx, finding: Finding) -> str | None:
    """Why ``finding`` may not be acted on: the assessment or its GPU is report-only (a new
    ladder does not start; one in progress holds its next step)."""
    if not finding.actionable:
        return "not_actionable: the assessment is report-only"
    if finding.gpu is not None and finding.gpu in ctx.report_only:
        return f"report_only: {ctx.report_only[finding.gpu]}"
    return None


def _gate(
    w: Work, ctx: Ctx, finding: Finding, proc: ProcessInfo | None
) -> tuple[str, Level] | None:
    """Why a new ladder may not start now (text, level), or None."""
    report_only = _report_only(ctx, finding)
    if report_only is not None:
        return report_only, Level.INFO
    if ctx.blocked is not None:
        return f"blocked: {ctx.blocked}", Level.WARNING
    why = refusal(proc, finding, ctx.snapshot, ctx.policy, ctx.self_ancestors)
    if why is not None:
        return why, Level.INFO
    paused = pause_hold(w)
    return None if paused is None else (paused, Level.INFO)
