"""Acting on GPU health (what it *means* is ``decide/health/judge.py``'s): report, drain hooks,
then a reset through the same gates as a ghost-memory reset (``resets.py``).
"""

from __future__ import annotations

from dataclasses import replace

from gpuwatchd.core.model import Finding, FindingKind
from gpuwatchd.core.vocabulary import EventName, HookName, Level
from gpuwatchd.decide.health.judge import drain_blockers
from gpuwatchd.decide.plan.intents import (
    Ctx,
    HookIntent,
    Work,
    finding_fields,
    hold_reason,
    is_dry_run,
    page,
)
from gpuwatchd.decide.plan.resets import (
    ESCALATING,
    escalating,
    history_blocker,
    say_once,
    snapshot_gates,
    start_reset,
)
from gpuwatchd.decide.plan.state import HealthWait
from gpuwatchd.decide.targets import gpu_by_uuid


def _drained_already(w: Work, uuid: str, dry: bool) -> bool:
    """Whether this GPU's incident was drained already (a dry run's drain covers no real one)."""
    earlier = w.health_drained.get(uuid)
    return earlier is not None and (not earlier or dry)


def _drain_hooks(w: Work, ctx: Ctx, finding: Finding, why: str, dry: bool) -> None:
    """The ``reset.drain`` hooks, at most once per health incident of the GPU."""
    uuid = finding.gpu or ""
    if not ctx.policy.reset.drain or _drained_already(w, uuid, dry):
        return
    w.health_drained[uuid] = dry
    # The GPU's bus id and minor too: a drain hook may name the GPU by any placeholder.
    gpu = gpu_by_uuid(ctx.snapshot, finding.gpu)
    facts = {
        **finding_fields(finding),
        "pci_bus_id": None if gpu is None else gpu.pci_bus_id,
        "minor": None if gpu is None else gpu.minor,
    }
    w.intents.append(HookIntent(HookName.RESET_DRAIN, why, facts, dry_run=dry))


def consider_health(w: Work, ctx: Ctx, finding: Finding) -> None:
    """What a health finding leads to (docs/policy.md#health): report, drain hooks once, or
    drain, wait until nothing holds the GPU, then reset. Never a signal to a job."""
    health = ctx.policy.health
    if not health.enabled or finding.gpu is None:
        return
    dry = is_dry_run(w, ctx)
    act = health.action != "report" and ctx.blocked is None and not w.state.paused
    fields = finding_fields(finding)
    if not finding.actionable:
        # e.g. a recovery action gpuwatchd does not know: said once, loudly; nothing done.
        if w.noted(finding.key, "health:report"):
            w.event(EventName.ACTION_REFUSED, Level.WARNING, why="report only: not actionable",
                    **fields)  # fmt: skip
        return
    if finding.kind == FindingKind.REBOOT_REQUIRED:
        if w.noted(finding.key, "health:reboot"):
            w.event(EventName.GPU_NEEDS_REBOOT, Level.CRITICAL, why=finding.reason, **fields)
            page(w, f"{finding.gpu} needs a reboot", fields, fields, dry_run=dry)
        if act:  # once per incident; one held (paused, blocked, a dry run's) follows later
            _drain_hooks(w, ctx, finding, f"{finding.gpu} needs a reboot", dry)
        return
    resetting = health.action == "reset" and ctx.policy.reset.enabled
    if finding.kind == FindingKind.DRAIN_REQUIRED or not resetting:
        if act and w.noted(finding.key, "health:drain"):
            w.event(
                EventName.HEALTH_DRAIN_STARTED, Level.WARNING, blockers=[], timeout=None, **fields
            )
            _drain_hooks(w, ctx, finding, f"{finding.gpu}: {finding.reason}", dry)
        return
    _consider_health_reset(w, ctx, finding, dry)


def _consider_health_reset(w: Work, ctx: Ctx, finding: Finding, dry: bool) -> None:
    uuid = finding.gpu or ""
    refusal, blockers = snapshot_gates(ctx, finding)
    if refusal is not None:
        say_once(w, finding, refusal)
        return
    gpu = gpu_by_uuid(ctx.snapshot, uuid)
    if gpu is None:
        return  # a gate said so already; for the type checker
    blockers += drain_blockers(
        gpu, ctx.snapshot, device_isolation=ctx.policy.health.device_isolation
    )
    if escalating(w, uuid):
        blockers.append(ESCALATING)
    timeout = ctx.policy.health.drain_timeout
    fields = finding_fields(finding)
    wait = w.health_waits.get(uuid)
    if wait is None or wait.dry_run != dry:
        hold = hold_reason(w, ctx)
        if hold is not None:
            say_once(w, finding, (EventName.RESET_REFUSED, Level.INFO, hold))
            return
        wait = HealthWait(finding.key, ctx.now, dry)
        w.health_waits[uuid] = wait
        w.event(EventName.HEALTH_DRAIN_STARTED, Level.WARNING, blockers=blockers,
                timeout=timeout, dry_run=dry, drained_already=_drained_already(w, uuid, dry),
                **fields)  # fmt: skip
        _drain_hooks(w, ctx, finding, f"{uuid} is drained for a reset: {finding.reason}", dry)
    if blockers:
        if wait.expired:
            return
        held = "; ".join(blockers)
        if ctx.now - wait.since >= timeout:
            w.health_waits[uuid] = replace(wait, expired=True)
            why = f"still held after {timeout:g}s: {held}; waiting on, never signalling"
            facts = {**fields, "blockers": blockers}
            w.event(EventName.HEALTH_DRAIN_TIMED_OUT, Level.CRITICAL, why=why, **facts)
            page(w, f"{uuid}: {why}", facts, fields, dry_run=dry)
            return
        until = wait.since + timeout
        w.waiting[finding.key] = until
        if w.noted(finding.key, "drain:" + held):
            w.event(
                EventName.HEALTH_DRAIN_WAITING, Level.INFO, blockers=blockers, until=until, **fields
            )
        return
    blocker = history_blocker(w, ctx, finding, gpu)
    if blocker is not None:
        say_once(w, finding, blocker)
        return
    start_reset(w, ctx, finding, gpu, "GPU health asks for a reset", drained=True)
